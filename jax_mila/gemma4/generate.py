"""Jitted forward, prefill and greedy generation over a KVCache.

``prefill`` runs the prompt (positions 0..S-1), in one call or in chunks of ``chunk_size``
tokens, and returns the last position's logits and the cache; ``generate`` continues greedily one token per step from that cache. The
decode steps use the same positions, window and masks as a full re-run, so the tokens equal
those of re-running the full sequence at every step (the parity suite checks this).

The jitted steps here (forward, one-shot prefill, chunk step, decode; the mesh's chunk step is
jax_mila.parallel.chunked's) take the model as ``model_args`` gives it: its pytree treedef
(static) and array leaves, one flatten per call, or ``nnx.split`` where flax cannot flatten it.
Taking the model apart is host time the device waits for at every call, so it is kept cheap.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4 import pieces
from jax_mila.gemma4.cache import KVCache
from jax_mila.gemma4.model import Gemma4ForCausalLM, check_input_ids
from jax_mila.parallel import chunked


def model_args(model: Gemma4ForCausalLM):
    """(structure, weights) of ``model`` for the jitted steps below, taken from its current
    weights; ``_model`` rebuilds the model from them inside the step.

    Flax registers nnx Modules as pytrees (flax >= 0.11): then the model's treedef and array
    leaves, one flatten (12B: ~5 ms). nnx.split's GraphDef costs far more, and before the
    device starts: 30-60 ms to split, then 5-10 ms to hash and 1.5-3 ms to compare at every
    jitted call; the treedef hashes and compares in well under a millisecond.
    It holds the modules' non-array attributes, so jit still recompiles when one of those
    changes, as for a GraphDef. A Variable reachable twice gives two leaves (the same array
    twice): the steps only read them.

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


def _model(structure, weights) -> Gemma4ForCausalLM:
    """The model from ``model_args``, inside a jitted step."""
    if isinstance(structure, jax.tree_util.PyTreeDef):
        return jax.tree.unflatten(structure, weights)
    return nnx.merge(structure, weights)


@functools.partial(jax.jit, static_argnames=("structure",))
def _forward(structure, weights, input_ids):
    return _model(structure, weights)(input_ids)


@functools.partial(jax.jit, static_argnames=("structure", "max_len"))
def _prefill(structure, weights, input_ids, max_len):
    model = _model(structure, weights)
    h, cache = model.hidden_states(input_ids, mode="prefill", max_len=max_len)
    return model.logits(h[:, -1]), cache


def chunk_hidden(model, cache, input_ids, valid, first=False):
    """One chunk [B, T] at positions cache.length + arange(T); its first ``valid`` tokens are
    real; ``first``: the caller promises cache.length == 0 (hidden_states' ``first_chunk``).
    Returns (the last real token's hidden state [B, H], before the final norm; cache)."""
    h, cache = model.hidden_states(input_ids, mode="chunk", cache=cache, valid=valid,
                                   first_chunk=first)
    if chunked.active_axis() is not None:  # h is this device's slice of the chunk
        return chunked.last_real_token(h, valid), cache
    return jax.lax.dynamic_index_in_dim(h, valid - 1, axis=1, keepdims=False), cache


def _chunk_step(structure, weights, cache, input_ids, valid, first=False):
    """``chunk_hidden`` as one jitted step, on the model rebuilt from ``model_args``.
    Position and valid length are traced, so every chunk of a prompt (the padded last one
    included) runs the same compiled step, except a ``first`` one (static; ``prefill`` says
    when). The logits are left to ``_last_logits``, once per
    prompt: the output head reads the whole vocabulary's weights (12B: 262144 x 3840, 1.25 ms
    a chunk on the H200 when every chunk computed them)."""
    return chunk_hidden(_model(structure, weights), cache, input_ids, valid, first)


def _last_logits(structure, weights, last):
    """The logits of ``chunk_hidden``'s last token, after a chunked prefill."""
    return _model(structure, weights).logits(last)


# XLA's autotuner runs while a step compiles and allocates scratch copies of the operands it
# times: with the 12B's tied 262144 x 3840 head that scratch, not the step, set the prefill's
# peak (H200, 64K tokens, chunk 2048: 12.50 GiB autotuned, 8.18 GiB without; docs/performance.md).
# On the kernel backend the only ops XLA would tune are its few small dots (0.3% of kernel
# time), so its steps compile without autotuning; the reference backend keeps it, since its
# dots are the work.
_NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}
_prefill_chunk = jax.jit(_chunk_step, static_argnames=("structure", "first"),
                         donate_argnames=("cache",))
_prefill_chunk_kernels = jax.jit(_chunk_step, static_argnames=("structure", "first"),
                                 donate_argnames=("cache",), compiler_options=_NO_AUTOTUNE)
# The head's product is exactly the dot whose autotuning scratch set that peak.
_head = jax.jit(_last_logits, static_argnames=("structure",))
_head_kernels = jax.jit(_last_logits, static_argnames=("structure",),
                        compiler_options=_NO_AUTOTUNE)


def chunk_step_fn(model: Gemma4ForCausalLM):
    """The jitted chunk step ``prefill`` runs for ``model`` (its backend picks the compile
    options above), called as step(*model_args(model), cache, ids, valid) -> (the last real
    token's hidden state, cache), and with first=True for a first chunk; the benchmark's
    memory plan compiles the same one."""
    return _prefill_chunk if model.backend == "reference" else _prefill_chunk_kernels


def _head_fn(model: Gemma4ForCausalLM):
    """``_last_logits`` jitted with the chunk step's compile options for ``model``."""
    return _head if model.backend == "reference" else _head_kernels


@functools.partial(jax.jit, static_argnames=("structure", "steps"), donate_argnames=("cache",))
def _decode(structure, weights, cache, token, steps):
    model = _model(structure, weights)

    def step(carry, _):
        cache, tok = carry
        h, cache = model.hidden_states(tok[:, None], mode="decode", cache=cache)
        nxt = jnp.argmax(model.logits(h[:, 0]), axis=-1).astype(jnp.int32)
        return (cache, nxt), nxt

    (cache, _), tokens = jax.lax.scan(step, (cache, token), None, length=steps)
    return tokens.T, cache


def _ids(model: Gemma4ForCausalLM, input_ids) -> jax.Array:
    """``input_ids`` as int32 [B, S], checked (model.check_input_ids: integer ids, in the
    vocabulary where they are concrete; here, outside the jitted steps, they always are)."""
    return check_input_ids(input_ids, model.config.vocab_size)


def forward(model: Gemma4ForCausalLM, input_ids) -> jax.Array:
    """Jitted ``model(input_ids)``: logits [B, S, vocab]; compiles once per input shape."""
    return _forward(*model_args(model), _ids(model, input_ids))


DEFAULT_CHUNK = 2048        # tokens per chunk when the device reports no memory figures
# MAX_CHUNK: 12B on the H200 (docs/performance.md, twenty-second round), 16384 -> 32768 is
# +0.4-0.8% at 32K and +0.6-0.7% at 64K (half the chunk boundaries: launches, last waves, the
# sliding layers' slabs), at 11.01 / 11.53 GiB peak (in layer pieces) against 9.71 / 10.23.
MIN_CHUNK, MAX_CHUNK = 256, 32768
ACTIVATION_FRACTION = 0.5   # of the free device memory, for one chunk's activations
# One chunk token's activations, in values of the model's widest layer activation (hidden, MLP
# gate+up, all query heads, routed experts' gate+up) in its dtype. Measured on the H200
# (docs/performance.md, twenty-third round), the kernel path of dense models holds 1.4-1.6 of
# them per chunk token (the peak's growth with the chunk; 12B: 83 KiB a token between chunks
# 16384 and 32768, gate+up 30720 wide; 31B: 127 KiB between 4096 and 16384, 43008 wide), plus
# a part that grows with the cache, not the chunk (31B, 128K tokens: 0.8 GiB), which
# KV_RESERVE_LAYERS covers. 2 values leave a margin. Models with routed experts or per-layer
# embeddings were never measured there and keep the older, wider margin of 4.
KERNEL_VALUES_PER_TOKEN = 2
UNMEASURED_KERNEL_VALUES_PER_TOKEN = 4
# Reserved beside the cache: the K and V buffers of this many of its largest layers (the
# full-attention ones, past the window; 31B at 128K: 1 GiB, against the 0.8 GiB measured).
KV_RESERVE_LAYERS = 1
# The reference path also holds float32 attention scores: ~12 bytes per query head and cache
# position (12.3 MiB per token at 64K, against 1.5 MiB at 4K).
REFERENCE_VALUES_PER_TOKEN = 16
REFERENCE_SCORE_BYTES = 12


def _attention_on_kernels(model: Gemma4ForCausalLM) -> bool:
    """Whether this model's attention runs on the CUDA kernels here (the chunk plan's memory
    model differs: the XLA path holds float32 scores)."""
    from jax_mila import ffi  # noqa: PLC0415

    if model.backend == "reference":
        return False
    try:
        on_gpu = jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False
    return on_gpu and ffi.status("flash_attention").kernel


def default_chunk_size(model: Gemma4ForCausalLM, batch: int, max_len: int, *,
                       memory_limit: int | None = None) -> int:
    """Tokens per chunk when ``chunk_size`` is None.

    With device memory figures (``memory_stats()`` bytes_limit / bytes_in_use, e.g. on GPU):
    free = limit - in use - the KV cache about to be allocated - a reserve of its
    KV_RESERVE_LAYERS largest layers' K and V, where limit is the smaller of
    bytes_limit and ``memory_limit`` (bytes; a budget the whole prefill should stay under,
    e.g. the benchmark's 12 GiB on an H200 that has far more); the chunk is the largest power
    of two whose activations fit in ACTIVATION_FRACTION of that, clamped to [MIN_CHUNK,
    MAX_CHUNK]. One token of one sequence costs KERNEL_VALUES_PER_TOKEN values of the widest
    layer activation when attention runs on the CUDA kernels (UNMEASURED_KERNEL_VALUES_PER_TOKEN
    for models with routed experts or per-layer embeddings), REFERENCE_VALUES_PER_TOKEN
    of them plus REFERENCE_SCORE_BYTES per query head and cache position when it runs through
    XLA (backend "reference", or no kernel). Without figures (CPU): DEFAULT_CHUNK. An estimate
    from measured runs, not a guarantee: pass chunk_size to override."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return DEFAULT_CHUNK
    cfg, itemsize = model.config, jnp.dtype(model.dtype).itemsize
    layer_kv = sorted((2 * batch * s.num_kv_heads * s.head_dim * itemsize
                       * (kv.ring_size(cfg.sliding_window, max_len) if s.is_sliding else max_len)
                       for s in cfg.layers if not s.is_kv_shared), reverse=True)
    cache_bytes = sum(layer_kv) + sum(layer_kv[:KV_RESERVE_LAYERS])  # the cache and a reserve
    widths = [cfg.hidden_size] + [2 * s.intermediate_size for s in cfg.layers]
    widths += [cfg.num_attention_heads * s.head_dim for s in cfg.layers]
    if cfg.enable_moe_block:
        widths.append(2 * cfg.top_k_experts * cfg.moe_intermediate_size)
    if _attention_on_kernels(model):
        measured = not (cfg.enable_moe_block or cfg.has_ple)
        values = KERNEL_VALUES_PER_TOKEN if measured else UNMEASURED_KERNEL_VALUES_PER_TOKEN
        per_token = values * max(widths) * itemsize * batch
    else:
        per_token = (REFERENCE_VALUES_PER_TOKEN * max(widths) * itemsize
                     + REFERENCE_SCORE_BYTES * cfg.num_attention_heads * max_len) * batch
    limit = stats["bytes_limit"] if memory_limit is None else min(stats["bytes_limit"], memory_limit)
    free = limit - stats["bytes_in_use"] - cache_bytes
    tokens = max(int(free * ACTIVATION_FRACTION) // per_token, 1)
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << (tokens.bit_length() - 1)))


def chunk_spans(length: int, size: int, *, short_tail: bool = False,
                multiple: int = 1) -> list[int]:
    """The widths of the chunks a prompt of ``length`` tokens runs in: chunks of ``size``,
    the last one padded to ``size``; with ``short_tail``, the last one (if it is not whole) is
    the smallest power of two that holds what is left, at least MIN_CHUNK, rounded up to a
    multiple of ``multiple`` (the seq axis' devices), at most ``size``."""
    full, left = divmod(length, size)
    if not left:
        return [size] * full
    tail = size
    if short_tail:
        tail = max(MIN_CHUNK, 1 << (left - 1).bit_length())
        tail = min(size, -(-tail // multiple) * multiple)
    return [size] * full + [tail]


def prefill(model: Gemma4ForCausalLM, input_ids, *, chunk_size: int | None = None,
            max_cache_len: int | None = None, progress: bool = False, kv_cache_dtype=None,
            mesh=None, tp_axis: str = "heads", seq_axis: str = "seq",
            seq_segments: int | None = None):
    """Runs the prompt [B, S]; returns (logits of the last position [B, vocab], KVCache).

    ``max_cache_len`` (default S) is the number of positions the cache can hold in total,
    prompt included; sliding layers keep only a ring of ``sliding_window`` positions.

    ``chunk_size``: the prompt runs in chunks of that many tokens, each one jitted step that
    updates the (donated) cache, so activation memory is bounded by the chunk, not the prompt.
    The last chunk is padded to chunk_size (padding is never written to the cache and comes
    after every real query), so one compiled step serves every chunk and prompt length.
    None: ``default_chunk_size``; a prompt that fits in one such chunk runs as one chunk without
    padding (compiled per prompt length: in layer pieces where they apply, else in one call); a
    longer one ends in a chunk of the tokens left, padded only up to a power of two
    (``chunk_spans``): one more compiled step per such tail size, against up to a whole chunk
    of padding (at 32768 tokens a chunk, a 33K prompt would otherwise compute 64K).
    ``progress`` shows a tqdm bar over the chunks.

    ``kv_cache_dtype="float8_e4m3fn"`` stores the full-attention layers' K/V (the part of the
    cache that grows with the sequence) in FP8, half the bytes (accuracy: docs/notes_model.md);
    the prompt then always runs through the chunked step.

    ``mesh``: a jax.sharding.Mesh with a ``tp_axis`` axis, a ``seq_axis`` axis or both (axes
    named by neither replicate); the prompt then always runs through the chunked step.
    - ``tp_axis``: tensor parallelism (query heads, MLP and their weights split over that
      axis, jax_mila.parallel.tensor; the cache comes back sharded the same way).
    - ``seq_axis``: context parallelism (jax_mila.parallel.chunked): each chunk's tokens are
      split over that axis (the chunk size must be a multiple of its devices; the default
      chunk size is rounded up to one), weights are replicated over it, and the
      full-attention layers' cache is sharded by position in ``seq_segments`` zig-zag
      segments per device (default chunked.DEFAULT_SEGMENTS), so each device holds 1/devices
      of it. The capacity is rounded up to a multiple of devices x segments, and the cache
      comes back in that layout (``cache.seq_layout``; decode does not take it yet;
      jax_mila.parallel.chunked.cache_in_position_order gathers it back to positions)."""
    ids = _ids(model, input_ids)
    batch, length = ids.shape
    max_len = length if max_cache_len is None else int(max_cache_len)
    if max_len < length:
        raise ValueError(f"max_cache_len={max_len} is shorter than the prompt ({length})")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    tp, seq, devices = None, None, 1
    if mesh is not None:
        tp, seq = chunked.check_mesh(mesh, tp_axis, seq_axis)
        devices = mesh.shape[seq] if seq is not None else 1
        segments = chunked.DEFAULT_SEGMENTS if seq_segments is None else seq_segments
        chunked.check_segments(segments)
        if chunk_size is not None and int(chunk_size) % devices:
            raise ValueError(f"chunk_size={chunk_size}: context parallelism over {devices} "
                             f"devices ({seq_axis!r}) needs a multiple of {devices}")
    size = default_chunk_size(model, batch, max_len) if chunk_size is None else int(chunk_size)
    in_pieces = mesh is None and pieces.applies(model)
    if chunk_size is None and length <= size:
        # One unpadded chunk. Where the layer pieces apply it runs in them, as longer prompts
        # do (the one-shot call would expose the whole model's flatten and dispatch, ~25 ms
        # on the 12B, before the device starts; docs/notes_model.md).
        if kv_cache_dtype is None and mesh is None and not in_pieces:
            return _prefill(*model_args(model), ids, max_len)
        size = length  # one chunk, through the chunked step
    size = -(-size // devices) * devices  # a chosen size, rounded up for the seq axis
    spans = chunk_spans(length, size, short_tail=chunk_size is None, multiple=devices)
    padded = jnp.pad(ids, ((0, 0), (0, sum(spans) - length)))  # pad id 0, never cached
    layout = ()
    if seq is not None:
        max_len, layout = chunked.capacity(max_len, devices, segments), (devices, segments)
    make_cache = functools.partial(kv.empty, model.config, batch, max_len, model.dtype,
                                   full_dtype=kv_cache_dtype, seq_layout=layout)
    if in_pieces:
        # Layer pieces: the host takes apart and dispatches only the first piece before the
        # device starts (jax_mila.gemma4.pieces); the head's weights are taken after the chunks.
        cache, state = make_cache(), None
        step = pieces.ChunkPieces(model).step
    elif mesh is None:
        cache = make_cache()
        structure, state = model_args(model)  # once per call: the weights as they are now
        step = functools.partial(chunk_step_fn(model), structure)
    else:
        step, state, cache = chunked.sharded_chunk_step(model, nnx.state(model), make_cache,
                                                        mesh, tp_axis=tp, seq_axis=seq,
                                                        segments=segments)
    # The first chunk starts on an empty cache: its sliding layers can attend over the chunk's
    # own keys rather than a slab of ring and chunk (cache.chunk_update's `first`). That step
    # compiles on its own, so it runs only where no later chunk has the first one's width
    # (one chunk, or whole chunks and a shorter tail) and would have shared its compile.
    first_own = mesh is None and spans[0] not in spans[1:]
    steps = zip(itertools.accumulate(spans[:-1], initial=0), spans)  # (start, width)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, total=len(spans), unit="chunk",
                     desc=f"prefill ({size} tokens/chunk)")
    for start, width in steps:
        valid = jnp.int32(min(width, length - start))
        first = {"first": True} if first_own and start == 0 else {}
        out, cache = step(state, cache, padded[:, start:start + width], valid, **first)
        if progress:  # otherwise the bar would count asynchronous dispatches, not finished chunks
            out.block_until_ready()
    # Each step returns the last real token's hidden state; its logits once, here. The mesh
    # head is looked up only now (its weight specs walk the model), while the chunks run.
    if in_pieces:
        structure, state = model_args(model)
    if mesh is None:
        return _head_fn(model)(structure, state, out), cache
    return chunked.sharded_head(model, state, mesh, tp_axis=tp)(state, out), cache


def decode(model: Gemma4ForCausalLM, token, cache: KVCache, steps: int):
    """Feeds ``token`` [B] (the token at position cache.length) and then its own greedy
    choices for ``steps`` steps. Returns (the ``steps`` new tokens [B, steps], cache).
    The cache passed in is donated (do not reuse it)."""
    if cache.seq_layout:
        raise ValueError(f"decode takes a cache in position order; this one is sharded by "
                         f"position (seq_layout {cache.seq_layout}, a context-parallel prefill): "
                         "pass it through jax_mila.parallel.chunked.cache_in_position_order")
    needed = int(cache.length) + steps
    if needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {steps} decode steps from "
                         f"length {int(cache.length)} need {needed} (pass a larger max_cache_len)")
    return _decode(*model_args(model), cache, jnp.asarray(token, jnp.int32), steps)


def generate(model: Gemma4ForCausalLM, input_ids, max_new_tokens: int, *,
             cache: KVCache | None = None, logits: jax.Array | None = None,
             chunk_size: int | None = None, progress: bool = False,
             kv_cache_dtype=None) -> jax.Array:
    """Greedy continuation of ``input_ids`` [B, S]: returns the new token ids [B, max_new_tokens].

    Without ``cache``, runs ``prefill`` first (sized for S + max_new_tokens; ``chunk_size``,
    ``progress`` and ``kv_cache_dtype`` are passed to it). To continue an
    existing prefill, pass its ``logits`` and ``cache`` (its capacity must cover the new
    tokens; it is donated). There is no early stop at EOS: exactly max_new_tokens come back.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = _ids(model, input_ids)
    if (cache is None) != (logits is None):
        raise ValueError("pass both the cache and the last logits of a prefill, or neither")
    if cache is None:
        logits, cache = prefill(model, ids, chunk_size=chunk_size, progress=progress,
                                max_cache_len=ids.shape[1] + max_new_tokens,
                                kv_cache_dtype=kv_cache_dtype)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if max_new_tokens == 1:
        return first[:, None]
    rest, _ = decode(model, first, cache, max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest], axis=1)
