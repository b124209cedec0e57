"""Planning a chunked prefill: how many tokens a chunk holds (``default_chunk_size``) and the
widths of a prompt's chunks (``chunk_spans``).

The plan reads the model's geometry from ``model.config`` (its layers' KV heads, head dims,
window and MLP widths; routed experts and per-layer embeddings) and the device's memory
figures; it imports no model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mila import ffi

DEFAULT_CHUNK = 2048        # tokens per chunk when the device reports no memory figures
# MAX_CHUNK: on the 12B (H200), 32768 tokens a chunk are faster than 16384 (half the chunk
# boundaries: launches, last waves, the sliding layers' slabs) and stay inside the 12 GiB
# budget in layer pieces (docs/performance.md).
MIN_CHUNK, MAX_CHUNK = 256, 32768
ACTIVATION_FRACTION = 0.5   # of the free device memory, for one chunk's activations
# One chunk token's activations, in values of the model's widest layer activation (hidden, MLP
# gate+up, all query heads, routed experts' gate+up) in its dtype. Measured on the H200
# (docs/performance.md), the kernel path of dense models holds 1.4-1.6 of them per chunk token
# (the peak's growth with the chunk), plus a part that grows with the cache, not the chunk,
# which KV_RESERVE_LAYERS covers. 2 values leave a margin. Models with routed experts or
# per-layer embeddings were never measured there and keep a wider margin of 4.
KERNEL_VALUES_PER_TOKEN = 2
UNMEASURED_KERNEL_VALUES_PER_TOKEN = 4
# Reserved beside the cache: the K and V buffers of this many of its largest layers (the
# full-attention ones, past the window).
KV_RESERVE_LAYERS = 1
# The reference path also holds float32 attention scores: ~12 bytes per query head and cache
# position.
REFERENCE_VALUES_PER_TOKEN = 16
REFERENCE_SCORE_BYTES = 12


def _attention_on_kernels(model) -> bool:
    """Whether this model's attention runs on the CUDA kernels here (the chunk plan's memory
    model differs: the XLA path holds float32 scores)."""
    if model.backend == "reference":
        return False
    try:
        on_gpu = jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False
    return on_gpu and ffi.status("flash_attention").kernel


def default_chunk_size(model, batch: int, max_len: int, *,
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
    ring = min(cfg.sliding_window, max_len)  # a sliding layer's slots (gemma4.cache.ring_size)
    layer_kv = sorted((2 * batch * s.num_kv_heads * s.head_dim * itemsize
                       * (ring if s.is_sliding else max_len)
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
