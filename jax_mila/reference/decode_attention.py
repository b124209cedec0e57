"""Reference decode attention with the contract of jax_mila.ffi.decode_attention.

q [B, T, Hq, D]: each row's T newest tokens (1 <= T <= 16), already written to the cache;
k, v [B, S, Hkv, D]: the cache (the model's dtype, or float8_e4m3fn read as its value);
kv_len [B] int32: how many tokens row b holds, the T new ones included, so its query i sits
at position kv_len[b] - T + i. Query head n reads KV head n // (Hq // Hkv).

Slots: without ``ring``, slot s holds position s and is valid when s < kv_len[b]. With
``ring`` (a sliding layer's S slots used round-robin), slot s holds the newest position
p < kv_len[b] with p % S == s (none when s >= kv_len[b]): the ring is read where it lies, no
copy in position order. A key is visible when its position is not after the query's and,
with a ``window`` W, q_pos - k_pos < W. A ring needs S >= W + T - 1 so that no query's keys
were overwritten by the newer tokens (checked by the wrapper).

``rotary_keys_only=r``: the scores read k only in the columns RoPE rotates ([0:r] and
[D/2 : D/2 + r]) and v in all others, as flash_attention's (Gemma 4's K=V layers).

Computed in float32 (scores, softmax, PV), cast to q.dtype. A query with no visible key (a
row with kv_len[b] < T) returns zeros.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_mila.reference.attention import keys_except_rotary, masked_attention


def slot_positions(kv_len, s: int, *, ring: bool):
    """[B, S] int32: the position each slot holds for rows of ``kv_len`` [B] tokens, -1 where
    the slot holds none yet."""
    kv_len = jnp.asarray(kv_len, jnp.int32)[:, None]
    slot = jnp.arange(s, dtype=jnp.int32)[None, :]
    if ring:
        # the newest p < kv_len with p % S == slot: kv_len - 1 - ((kv_len - 1 - slot) mod S)
        pos = kv_len - 1 - jnp.mod(kv_len - 1 - slot, s)
    else:
        pos = jnp.broadcast_to(slot, (kv_len.shape[0], s))
    return jnp.where(slot < kv_len, pos, -1)


def decode_attention(q, k, v, kv_len, *, scale=None, window=None, ring=False,
                     rotary_keys_only=None):
    if rotary_keys_only is not None:
        k = keys_except_rotary(k, v, rotary_keys_only)
    t, s = q.shape[1], k.shape[1]
    kv_len = jnp.asarray(kv_len, jnp.int32)
    q_pos = kv_len[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]      # [B, T]
    k_pos = slot_positions(kv_len, s, ring=ring)                                # [B, S]
    diff = q_pos[:, :, None] - k_pos[:, None, :]                                # [B, T, S]
    mask = (k_pos[:, None, :] >= 0) & (diff >= 0)
    if window is not None:
        mask = mask & (diff < window)
    # The cache may be FP8: its values in float32 (exact), the products and sums in float32.
    return masked_attention(q, k.astype(jnp.float32), v, mask[:, None, None], scale)[0]
