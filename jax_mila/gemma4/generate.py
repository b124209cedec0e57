"""Jitted forward, prefill and greedy generation over a KVCache.

``prefill`` runs the prompt (positions 0..S-1), in one call or in chunks of ``chunk_size``
tokens, and returns the last position's logits and the cache; ``generate`` continues greedily one token per step from that cache. The
decode steps use the same positions, window and masks as a full re-run, so the tokens equal
those of re-running the full sequence at every step (the parity suite checks this).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4.cache import KVCache
from jax_mila.gemma4.model import Gemma4ForCausalLM


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, state, input_ids):
    return nnx.merge(graphdef, state)(input_ids)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _prefill(graphdef, state, input_ids, max_len):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden_states(input_ids, mode="prefill", max_len=max_len)
    return model.logits(h[:, -1]), cache


def chunk_forward(model, cache, input_ids, valid):
    """One chunk [B, T] at positions cache.length + arange(T); its first ``valid`` tokens are
    real. Returns (logits of the last real token, cache). Shared by the single-device step
    below and the tensor-parallel one (jax_mila.parallel.tensor)."""
    h, cache = model.hidden_states(input_ids, mode="chunk", cache=cache, valid=valid)
    last = jax.lax.dynamic_index_in_dim(h, valid - 1, axis=1, keepdims=False)
    return model.logits(last), cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, cache, input_ids, valid):
    """``chunk_forward`` as one jitted step. Position and valid length are traced, so every
    chunk of a prompt (the padded last one included) runs the same compiled step."""
    return chunk_forward(nnx.merge(graphdef, state), cache, input_ids, valid)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnames=("cache",))
def _decode(graphdef, state, cache, token, steps):
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        cache, tok = carry
        h, cache = model.hidden_states(tok[:, None], mode="decode", cache=cache)
        nxt = jnp.argmax(model.logits(h[:, 0]), axis=-1).astype(jnp.int32)
        return (cache, nxt), nxt

    (cache, _), tokens = jax.lax.scan(step, (cache, token), None, length=steps)
    return tokens.T, cache


def _ids(input_ids) -> jax.Array:
    ids = jnp.asarray(input_ids, jnp.int32)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must be int32 [B, S] with S >= 1, got shape {list(ids.shape)}")
    return ids


def forward(model: Gemma4ForCausalLM, input_ids) -> jax.Array:
    """Jitted ``model(input_ids)``: logits [B, S, vocab]; compiles once per input shape."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, _ids(input_ids))


DEFAULT_CHUNK = 2048        # tokens per chunk when the device reports no memory figures
MIN_CHUNK, MAX_CHUNK = 256, 16384
ACTIVATION_FRACTION = 0.25  # of the free device memory, for one chunk's activations


def default_chunk_size(model: Gemma4ForCausalLM, batch: int, max_len: int, *,
                       memory_limit: int | None = None) -> int:
    """Tokens per chunk when ``chunk_size`` is None.

    With device memory figures (``memory_stats()`` bytes_limit / bytes_in_use, e.g. on GPU):
    free = limit - in use - the KV cache about to be allocated, where limit is the smaller of
    bytes_limit and ``memory_limit`` (bytes; a budget the whole prefill should stay under,
    e.g. the benchmark's 12 GiB on an H200 that has far more); the chunk is the largest power
    of two whose activations fit in ACTIVATION_FRACTION of that, where one token of one
    sequence costs about 16 values of the widest layer activation (hidden, MLP gate+up, all
    query heads, routed experts' gate+up) in the model's dtype; clamped to [MIN_CHUNK,
    MAX_CHUNK]. Without figures (CPU): DEFAULT_CHUNK. A rough bound, not a measurement: pass
    chunk_size to override."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return DEFAULT_CHUNK
    cfg, itemsize = model.config, jnp.dtype(model.dtype).itemsize
    cache_bytes = sum(2 * batch * s.num_kv_heads * s.head_dim * itemsize
                      * (kv.ring_size(cfg.sliding_window, max_len) if s.is_sliding else max_len)
                      for s in cfg.layers if not s.is_kv_shared)
    widths = [cfg.hidden_size] + [2 * s.intermediate_size for s in cfg.layers]
    widths += [cfg.num_attention_heads * s.head_dim for s in cfg.layers]
    if cfg.enable_moe_block:
        widths.append(2 * cfg.top_k_experts * cfg.moe_intermediate_size)
    per_token = 16 * max(widths) * itemsize * batch
    limit = stats["bytes_limit"] if memory_limit is None else min(stats["bytes_limit"], memory_limit)
    free = limit - stats["bytes_in_use"] - cache_bytes
    tokens = max(int(free * ACTIVATION_FRACTION) // per_token, 1)
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << (tokens.bit_length() - 1)))


def prefill(model: Gemma4ForCausalLM, input_ids, *, chunk_size: int | None = None,
            max_cache_len: int | None = None, progress: bool = False, kv_cache_dtype=None,
            mesh=None, tp_axis: str = "heads"):
    """Runs the prompt [B, S]; returns (logits of the last position [B, vocab], KVCache).

    ``max_cache_len`` (default S) is the number of positions the cache can hold in total,
    prompt included; sliding layers keep only a ring of ``sliding_window`` positions.

    ``chunk_size``: the prompt runs in chunks of that many tokens, each one jitted step that
    updates the (donated) cache, so activation memory is bounded by the chunk, not the prompt.
    The last chunk is padded to chunk_size (padding is never written to the cache and comes
    after every real query), so one compiled step serves every chunk and prompt length.
    None: ``default_chunk_size``; a prompt that fits in one such chunk runs in one call without
    padding (compiled per prompt length). ``progress`` shows a tqdm bar over the chunks.

    ``kv_cache_dtype="float8_e4m3fn"`` stores the full-attention layers' K/V (the part of the
    cache that grows with the sequence) in FP8, half the bytes (accuracy: docs/notes_model.md);
    the prompt then always runs through the chunked step.

    ``mesh``: a jax.sharding.Mesh with a ``tp_axis`` axis: tensor parallelism (query heads, MLP
    and their weights split over that axis, jax_mila.parallel.tensor; the cache comes back
    sharded the same way). The prompt then always runs through the chunked step."""
    ids = _ids(input_ids)
    batch, length = ids.shape
    max_len = length if max_cache_len is None else int(max_cache_len)
    if max_len < length:
        raise ValueError(f"max_cache_len={max_len} is shorter than the prompt ({length})")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    graphdef, state = nnx.split(model)
    size = default_chunk_size(model, batch, max_len) if chunk_size is None else int(chunk_size)
    if chunk_size is None and length <= size:
        if kv_cache_dtype is None and mesh is None:
            return _prefill(graphdef, state, ids, max_len)
        size = length  # one chunk, through the chunked step
    chunks = -(-length // size)
    padded = jnp.pad(ids, ((0, 0), (0, chunks * size - length)))  # pad id 0, never cached
    cache = kv.empty(model.config, batch, max_len, model.dtype, full_dtype=kv_cache_dtype)
    step = functools.partial(_prefill_chunk, graphdef)
    if mesh is not None:
        from jax_mila.parallel import tensor  # noqa: PLC0415 - only for multi-device prefill

        step, state, cache = tensor.sharded_chunk_step(model, state, cache, mesh, tp_axis)
    steps = range(chunks)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, unit="chunk", desc=f"prefill ({size} tokens/chunk)")
    for c in steps:
        valid = jnp.int32(min(size, length - c * size))
        logits, cache = step(state, cache, padded[:, c * size:(c + 1) * size], valid)
        if progress:  # otherwise the bar would count asynchronous dispatches, not finished chunks
            logits.block_until_ready()
    return logits, cache


def decode(model: Gemma4ForCausalLM, token, cache: KVCache, steps: int):
    """Feeds ``token`` [B] (the token at position cache.length) and then its own greedy
    choices for ``steps`` steps. Returns (the ``steps`` new tokens [B, steps], cache).
    The cache passed in is donated (do not reuse it)."""
    needed = int(cache.length) + steps
    if needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {steps} decode steps from "
                         f"length {int(cache.length)} need {needed} (pass a larger max_cache_len)")
    graphdef, state = nnx.split(model)
    return _decode(graphdef, state, cache, jnp.asarray(token, jnp.int32), steps)


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
    ids = _ids(input_ids)
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
