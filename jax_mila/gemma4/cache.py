"""KVCache: the per-layer keys and values kept between prefill and decode steps.

Layout, per layer that computes its own K/V (KV-shared layers own no entry; they read their
source layer's view):
- full-attention layers: [B, max_len, Hkv, D], slot j holds position j;
- sliding layers: a ring of R = min(window, max_len) slots, slot (p % R) holds position p, so
  local memory is bounded by the window however long the sequence gets.

Attention reads a cache through the position-offset contract of jax_mila.ffi.flash_attention
(key j at kv_offset + j), so each view must be contiguous in position:
- full layers: the buffer itself with kv_offset 0; unwritten slots hold positions after the
  query, which causal masking hides.
- rings, when the query at position p has filled the ring (p >= R - 1): rolled so the oldest
  slot comes first, holding positions p-R+1 .. p (kv_offset p-R+1), all inside the window
  since R <= window. Before that, slot j holds position j (kv_offset 0) and the empty slots
  j > p are hidden by causality, exactly as in a full layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Pytree of per-layer K/V buffers (None for KV-shared layers) and the filled length.

    ``length`` is an int32 scalar: the number of positions already processed, i.e. the
    position of the next token. ``max_len`` (static) is the capacity of full-layer buffers.
    """

    keys: tuple
    values: tuple
    length: jax.Array
    max_len: int = dataclasses.field(metadata=dict(static=True), default=0)


def ring_size(window: int, max_len: int) -> int:
    return min(window, max_len)


def prefill_entry(k: jax.Array, v: jax.Array, *, ring: int | None, max_len: int):
    """Cache buffers for a prompt's k, v [B, S, H, D] at positions 0..S-1 (S static)."""
    return _prefill_buffer(k, ring, max_len), _prefill_buffer(v, ring, max_len)


def _prefill_buffer(x: jax.Array, ring: int | None, max_len: int) -> jax.Array:
    b, s, h, d = x.shape
    if ring is None:
        return jnp.zeros((b, max_len, h, d), x.dtype).at[:, :s].set(x)
    if s < ring:
        return jnp.zeros((b, ring, h, d), x.dtype).at[:, :s].set(x)
    # The last `ring` positions s-ring .. s-1 go to slots (p % ring): a static roll.
    return jnp.roll(x[:, s - ring:], (s - ring) % ring, axis=1)


def decode_update(k_buf, v_buf, k, v, pos, *, ring: bool):
    """Writes one step's k, v [B, 1, H, D] at position ``pos`` (traced int32) and returns
    (k_buf, v_buf, k_view, v_view, kv_offset) for attention over the cache."""
    if k.shape[1] != 1:
        raise ValueError(f"decode steps take one token at a time, got k{list(k.shape)}")
    size = k_buf.shape[1]
    slot = pos % size if ring else pos
    start = (0, slot, 0, 0)
    k_buf = jax.lax.dynamic_update_slice(k_buf, k.astype(k_buf.dtype), start)
    v_buf = jax.lax.dynamic_update_slice(v_buf, v.astype(v_buf.dtype), start)
    if not ring:
        return k_buf, v_buf, k_buf, v_buf, jnp.int32(0)
    filled = pos >= size - 1
    shift = jnp.where(filled, (pos + 1) % size, 0)
    kv_offset = jnp.maximum(pos - size + 1, 0).astype(jnp.int32)
    return (k_buf, v_buf, jnp.roll(k_buf, -shift, axis=1), jnp.roll(v_buf, -shift, axis=1),
            kv_offset)
