"""The jitted single-device steps: forward, the one-shot prefill, the chunk step and the output
head of a chunked prefill, greedy decode; and how they take the model apart.

Every step takes the model as ``model_args`` gives it: its pytree treedef (static) and array
leaves, one flatten per call, or ``nnx.split`` where flax cannot flatten it. Taking the model
apart is host time the device waits for at every call, so it is kept cheap. Inside the step the
model is rebuilt (``rebuild``) and run through its own methods: hidden_states, logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila.parallel.layout import SINGLE_DEVICE


def model_args(model):
    """(structure, weights) of ``model`` for the jitted steps below, taken from its current
    weights; ``rebuild`` makes the model from them inside the step.

    Flax registers nnx Modules as pytrees (flax >= 0.11): then the model's treedef and array
    leaves, one flatten. nnx.split's GraphDef costs far more host time, and before the device
    starts: splitting, then hashing and comparing it at every jitted call; the treedef hashes
    and compares in well under a millisecond. It holds the modules' non-array attributes, so
    jit still recompiles when one of those changes, as for a GraphDef. A Variable reachable
    twice gives two leaves (the same array twice): the steps only read them.

    Otherwise (flax that does not flatten the model to arrays, or a flatten that fails):
    ``nnx.split(model)``. The steps take either."""
    try:
        leaves, treedef = jax.tree.flatten(model)
    except Exception:  # noqa: BLE001 -- any flatten failure means graph mode, not an error
        return nnx.split(model)
    # An unregistered model comes back as its own single leaf, and a submodule that is not a
    # pytree as a non-array one: neither can be a jit argument. Abstract weights (a model from
    # nnx.eval_shape) are kept for .lower(), as scripts/measure_compile.py does.
    if all(isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves):
        return treedef, leaves
    return nnx.split(model)


def rebuild(structure, weights):
    """The model from ``model_args``, inside a jitted step."""
    if isinstance(structure, jax.tree_util.PyTreeDef):
        return jax.tree.unflatten(structure, weights)
    return nnx.merge(structure, weights)


# XLA's autotuner runs while a step compiles and allocates scratch copies of the operands it
# times: with a large tied output head (the 12B's 262144 x 3840) that scratch, not the step,
# would set the prefill's peak memory. On the kernel backend the only ops XLA would tune are
# its few small dots, so its steps compile without autotuning; the reference backend keeps it,
# since its dots are the work.
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


def compile_options(model):
    """The compile options of ``model``'s prefill steps (one device or a mesh): NO_AUTOTUNE
    on the kernel backend, XLA's defaults on "reference"."""
    return None if model.backend == "reference" else NO_AUTOTUNE


@functools.partial(jax.jit, static_argnames=("structure",))
def forward_step(structure, weights, input_ids):
    return rebuild(structure, weights)(input_ids)


@functools.partial(jax.jit, static_argnames=("structure", "max_len"))
def prefill_step(structure, weights, input_ids, max_len):
    """The one-shot prefill: (the last position's logits, a new cache of capacity max_len)."""
    model = rebuild(structure, weights)
    h, cache = model.hidden_states(input_ids, mode="prefill", max_len=max_len)
    return model.logits(h[:, -1]), cache


def chunk_hidden(model, cache, input_ids, valid, first=False, *, layout=SINGLE_DEVICE):
    """One chunk [B, T] at positions max(cache.length) + arange(T); its first ``valid`` tokens
    are real (a scalar, or [B]: row b's first valid[b]); ``first``: the caller promises
    cache.length == 0 (hidden_states' ``first_chunk``); ``layout``: the step's split over the
    mesh (jax_mila.parallel.Layout).
    Returns (each row's last real token's hidden state [B, H], before the final norm; cache)."""
    h, cache = model.hidden_states(input_ids, mode="chunk", cache=cache, valid=valid,
                                   first_chunk=first, layout=layout)
    return layout.last_real_token(h, valid), cache


def _chunk_step(structure, weights, cache, input_ids, valid, first=False):
    """``chunk_hidden`` as one jitted step, on the model rebuilt from ``model_args``.
    Position and valid length are traced, so every chunk of a prompt (the padded last one
    included) runs the same compiled step, except a ``first`` one (static; the prefill loop
    says when). The logits are left to the head, once per prompt: the output head reads the
    whole vocabulary's weights."""
    return chunk_hidden(rebuild(structure, weights), cache, input_ids, valid, first)


def _last_logits(structure, weights, last):
    """The logits of ``chunk_hidden``'s last token, after a chunked prefill."""
    return rebuild(structure, weights).logits(last)


_chunk_step_reference = jax.jit(_chunk_step, static_argnames=("structure", "first"),
                                donate_argnames=("cache",))
_chunk_step_kernels = jax.jit(_chunk_step, static_argnames=("structure", "first"),
                              donate_argnames=("cache",), compiler_options=NO_AUTOTUNE)
# The head's product is exactly the dot whose autotuning scratch would set the peak.
_head_reference = jax.jit(_last_logits, static_argnames=("structure",))
_head_kernels = jax.jit(_last_logits, static_argnames=("structure",),
                        compiler_options=NO_AUTOTUNE)


def chunk_step_fn(model):
    """The jitted chunk step for ``model`` (its backend picks the compile options), called as
    step(*model_args(model), cache, ids, valid) -> (the last real token's hidden state,
    cache), and with first=True for a first chunk; the benchmark's memory plan compiles the
    same one."""
    return _chunk_step_reference if model.backend == "reference" else _chunk_step_kernels


def head_fn(model):
    """The output head after a chunked prefill, jitted with the chunk step's compile options:
    head(*model_args(model), last) -> logits [B, vocab]."""
    return _head_reference if model.backend == "reference" else _head_kernels


def _vectors_in_float32(weights):
    """``weights`` with every bf16 / fp16 array of rank <= 1 (norm weights, layer scalars, the
    router's scales) in float32, which is how every consumer of them computes (nn.rms_norm,
    the fused norm ops, the router; layer scalars are cast back to the stream's dtype): the
    same values and results. Done once before the decode scan: XLA's loop-invariant code
    motion keeps size-inflating converts inside a loop, so each step would otherwise run one
    small convert kernel per norm weight (hundreds a step on the 12B)."""
    def widen(a):
        if getattr(a, "ndim", 2) <= 1 and jnp.dtype(a.dtype) in (jnp.dtype(jnp.bfloat16),
                                                                 jnp.dtype(jnp.float16)):
            return a.astype(jnp.float32)
        return a
    return jax.tree.map(widen, weights)


@functools.partial(jax.jit, static_argnames=("structure", "steps"), donate_argnames=("cache",))
def decode_steps(structure, weights, cache, token, done, stop, pad, steps):
    """One block of ``steps`` greedy decode steps from ``token`` [B] at cache.length [B], the unit
    of the decode loop (engine.run.decode): returns (tokens [B, steps], the last of them [B],
    cache, done [B]).

    ``done`` [B] bool marks the rows that have emitted a stop token; ``stop`` [K] int32 holds
    the stop ids (-1 matches nothing) and ``pad`` (int32) is what a finished row emits, and
    feeds back, after its stop token, so its cache grows with pad tokens, consistent with the
    tokens returned. Rows not done get exactly the tokens of the plain greedy loop. ``stop``,
    ``pad`` and ``done`` are traced: one compile per block size (and stop-list length).

    The steps run as a scan, whose trip count XLA knows. Data-dependent control flow (a
    while_loop that ends when every row is done, or a lax.cond that skips a block) would make
    XLA's GPU runtime copy its predicate to the host and wait for the device at every test,
    and a lax.cond also copies the whole cache into and out of its branches: the early stop
    is the host's, between blocks."""
    model = rebuild(structure, _vectors_in_float32(weights))

    def step(carry, _):
        cache, tok, done = carry
        h, cache = model.hidden_states(tok[:, None], mode="decode", cache=cache)
        nxt = jnp.argmax(model.logits(h[:, 0]), axis=-1).astype(jnp.int32)
        nxt = jnp.where(done, pad, nxt)
        done = done | jnp.any(nxt[:, None] == stop[None, :], axis=-1)
        return (cache, nxt, done), nxt

    (cache, last, done), tokens = jax.lax.scan(step, (cache, token, done), None, length=steps)
    return tokens.T, last, cache, done
