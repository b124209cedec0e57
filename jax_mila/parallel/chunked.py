"""Context parallelism inside the chunked prefill: a `seq` mesh axis of P devices shares each
chunk's tokens, and the full-attention layers' KV cache is sharded by position.

Each chunk of C tokens (C a multiple of P) is cut into P contiguous slices of C / P tokens;
device d runs the embedding, norms, projections, MLP (and MoE, PLE) of positions
pos + d C/P .. pos + (d+1) C/P - 1 only (`slice_positions`). Only attention needs other
devices' tokens:

Full-attention layers. The cache of capacity M is cut into n = P x S contiguous segments of
L = M / n positions (S = segments per device, even), dealt out zig-zag in rounds of 2P:
in round r device d owns segments 2Pr + d and 2Pr + 2P-1-d (`owned_segments`), so at every
point of the prompt each device holds about 1/P of the filled positions (the causal work of
every chunk is balanced to within about one segment, and so is memory) and 1/P of the buffer
in all. A device's local buffer [B, M/P, H, D] is its segments in increasing position order.
Per layer and chunk: the chunk's K/V and Q are all-gathered; each device writes the chunk's
K/V into the slots of the segments it owns (jax_mila.gemma4.cache.sharded_chunk_update) and
attends all C queries to its whole block in one kernel call (`attention`: the segments' true
positions as a vector kv_offset, jax_mila.ffi.flash_attention; causal: unfilled slots lie
after every query and future segments cost only skipped tiles; a device with no visible key
for a row returns zeros with lse -inf). Its result is weighted by its share of the total over
all devices (an all-gather of [P, B, H, C] floats: exp(lse_part - lse_total)), and one
psum_scatter in the model's dtype leaves each device the rows of its own C / P queries.

Sliding-window layers. The ring of the last R = W positions is small and kept replicated.
When a device's slice holds at least R keys (C/P >= R, as in long prompts), the devices
exchange only halos: one all-gather of each slice's last R real keys gives every device the R
keys before its own queries and the ring's new contents. Shorter slices all-gather the chunk's
K/V and every device applies the same ring update (both in jax_mila.gemma4.cache). Each
device attends its own queries over a slab of the keys before its slice and the slice itself.

These functions run inside `jax.shard_map` on the axis they are given; a model's layers reach
them through jax_mila.parallel.Layout (seq_split "chunk"), which the engine builds for the step
(jax_mila.engine.mesh).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_mila.ffi._checks import is_int

# Segments per device: more balance the causal work of each chunk better (measured in
# docs/design/parallel.md). The kernel walks them in one call, so more cost only a few integer
# operations per CTA and segment, and capacity rounds up to a multiple of P x S.
DEFAULT_SEGMENTS = 32


# ------------------------------------------------------------------------------ the layout

def check_segments(segments: int) -> None:
    if not is_int(segments) or segments < 2 or segments % 2:
        raise ValueError(f"context parallel: segments per device must be an even int >= 2 "
                         f"(zig-zag pairs), got {segments!r}")


def capacity(max_len: int, devices: int, segments: int = DEFAULT_SEGMENTS) -> int:
    """The cache capacity a position-sharded cache uses for `max_len`: rounded up to a
    multiple of devices x segments (the extra slots are never written)."""
    n = devices * segments
    return -(-max_len // n) * n


def owned_segments(device, devices: int, segments: int):
    """Segments of `device` (an int or a traced index) in increasing position order."""
    out = []
    for r in range(segments // 2):
        out += [2 * devices * r + device, 2 * devices * r + 2 * devices - 1 - device]
    return out


def slot_positions(max_len: int, devices: int, segments: int = DEFAULT_SEGMENTS) -> np.ndarray:
    """Position held by each slot of the global buffer (device blocks one after the other)."""
    if max_len % (devices * segments):
        raise ValueError(f"context parallel: capacity {max_len} is not a multiple of "
                         f"devices x segments = {devices * segments}")
    length = max_len // (devices * segments)
    return np.concatenate([np.arange(s * length, (s + 1) * length)
                           for d in range(devices) for s in owned_segments(d, devices, segments)])


def cache_in_position_order(cache):
    """A KVCache from a context-parallel prefill with its full-attention buffers put back in
    position order (slot j = position j, as one device's prefill leaves them); gathers the
    whole cache, for tests and for handing the cache to single-device code."""
    if not cache.seq_layout:
        return cache
    devices, segments = cache.seq_layout
    inverse = np.argsort(slot_positions(cache.max_len, devices, segments))

    def reorder(buf):
        if buf is None or buf.shape[1] != cache.max_len:
            return buf  # KV-shared layers, rings
        return jnp.asarray(jax.device_get(buf))[:, inverse]

    return dataclasses.replace(cache, keys=tuple(map(reorder, cache.keys)),
                               values=tuple(map(reorder, cache.values)), seq_layout=())


# ------------------------------------------------------------------- inside the chunk step

def slice_positions(offset, local_len: int, axis: str) -> jax.Array:
    """Positions of this device's slice (over `axis`) of the chunk that starts at `offset`."""
    i = jax.lax.axis_index(axis)
    return offset + i * local_len + jnp.arange(local_len, dtype=jnp.int32)


def last_real_token(h, valid, axis: str):
    """h [B, C/P, H] of every device -> the hidden state of the chunk's token `valid` - 1
    (on the device whose slice holds it), replicated: [B, H]."""
    t = h.shape[1]
    local = valid - 1 - jax.lax.axis_index(axis) * t
    mine = (local >= 0) & (local < t)
    pick = jax.lax.dynamic_index_in_dim(h, jnp.clip(local, 0, t - 1), axis=1, keepdims=False)
    return jax.lax.psum(jnp.where(mine, pick, jnp.zeros_like(pick)), axis)


def attention(q, k, v, kv_offset, attn, *, window, pos, axis: str, segments: int):
    """This device's queries q [B, C/P, Hq, D] (positions pos + d C/P ..) over the view that
    jax_mila.gemma4.cache.sharded_chunk_update returns; `attn` is an nn.Attention (backend and
    scale)."""
    t = q.shape[1]
    i = jax.lax.axis_index(axis)
    if window is not None:
        return attn(q, k, v, window=window, q_offset=pos + i * t, kv_offset=kv_offset)
    devices = jax.lax.axis_size(axis)
    q_all = jax.lax.all_gather(q, axis, axis=1, tiled=True)  # [B, C, Hq, D]
    length = k.shape[1] // segments
    starts = jnp.stack([jnp.asarray(s, jnp.int32) * length  # the segments' first positions
                        for s in owned_segments(i, devices, segments)])
    # One call over the whole local block: the kernel walks the segments itself (a vector
    # kv_offset, jax_mila.ffi.flash_attention), so no partial per segment is written, sliced
    # or merged.
    o, lse = attn(q_all, k, v, q_offset=pos, kv_offset=starts, return_lse=True)
    # This device's share of the total over all devices, exp(lse - total), summed over the
    # devices in the model's dtype (as the tensor-parallel all-reduces are): half the bytes of
    # float32 on the wire and in the workspace; one more rounding for bf16 models.
    total = _logsumexp(jax.lax.all_gather(lse, axis))
    out = _share(o, lse, total).astype(q.dtype)
    return jax.lax.psum_scatter(out, axis, scatter_dimension=1, tiled=True)  # own C/P rows


def _share(o, lse, total):
    """A partial result o [B, C, Hq, D] (normalized over its own keys, log-sum-exp lse
    [B, Hq, C]) as its share of a softmax over more keys (log-sum-exp `total`): o * exp(lse -
    total) in float32, 0 where lse is -inf (no visible key: never NaN, whatever o holds)."""
    safe = jnp.where(jnp.isneginf(total), 0.0, total)
    w = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))  # [B, Hq, C]
    w = jnp.transpose(w, (0, 2, 1))[..., None]  # [B, C, Hq, 1]
    return jnp.where(w > 0, o.astype(jnp.float32) * w, 0.0)


def _logsumexp(x):
    """log-sum-exp over axis 0 of float32 lse values, -inf where all are -inf (no NaN)."""
    m = jnp.max(x, axis=0)
    safe = jnp.where(jnp.isneginf(m), 0.0, m)
    s = jnp.sum(jnp.where(jnp.isneginf(x), 0.0, jnp.exp(x - safe)), axis=0)
    return jnp.where(s > 0, safe + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)


# ---------------------------------------------------------------------------- the shardings

def cache_specs(cache, cfg, *, seq_axis: str | None, tp_axis: str | None, tp_size: int = 1):
    """PartitionSpecs of a KVCache: full-attention buffers split by position over `seq_axis`,
    rings replicated over it; K/V heads split over `tp_axis` like their k_proj."""
    def layer_spec(spec, buf):
        if buf is None:
            return None
        heads = tp_axis if tp_axis is not None and spec.num_kv_heads % tp_size == 0 else None
        seq = seq_axis if not spec.is_sliding else None
        # Trailing Nones dropped, as the step's outputs report their specs: equal shardings
        # on the first chunk's cache and the later ones', so the step compiles once.
        if heads is not None:
            return P(None, seq, heads)
        return P() if seq is None else P(None, seq)

    keys = tuple(layer_spec(s, k) for s, k in zip(cfg.layers, cache.keys))
    values = tuple(layer_spec(s, v) for s, v in zip(cfg.layers, cache.values))
    return dataclasses.replace(cache, keys=keys, values=values, length=P())
