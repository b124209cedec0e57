"""Reference attention with the contract of jax_mila.ffi.flash_attention.

q [B, T, Hq, D], k and v [B, S, Hkv, D]; query head n reads KV head n // (Hq // Hkv).
Query i sits at position q_offset + i and key j at kv_offset + j, or with a vector kv_offset
of N segment starts, key n L + j (L = S / N) at kv_offset[n] + j. With causal=True a key
is visible when its position is not after the query's; a window W additionally requires
q_pos - k_pos < W. A query row with no visible key returns zeros (and lse = -inf).
With rotary_keys_only=r the scores read k only in the RoPE-rotated columns (keys_except_rotary).

Computed in float32 from the inputs (scores, softmax and the PV product), then cast to
q.dtype. It materialises the [T, S] scores, so it is an oracle and a CPU path, not a
long-context implementation.
"""

from __future__ import annotations

import jax.numpy as jnp


def visible_mask(q_pos, k_pos, *, causal: bool, window: int | None):
    """[T, S] boolean mask of the keys each query sees."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = jnp.ones(diff.shape, dtype=bool)
    if causal:
        mask = diff >= 0
    if window is not None:
        mask = mask & (diff < window)
    return mask


def keys_except_rotary(k, v, rotary_pairs: int):
    """The keys the scores read under ``rotary_keys_only=r`` (jax_mila.ffi.flash_attention):
    k in the columns RoPE rotates, [0:r] and [D/2 : D/2 + r] of the half-split layout, v in all
    others. Gemma 4's K=V layers: there V is the normed raw key and K = RoPE(V * k_norm.w), so
    with k_norm's weight folded into q outside the rotated columns, q . k_eff is the same
    score up to rounding (jax_mila/gemma4/attention.py)."""
    d = k.shape[-1]
    col = jnp.arange(d) % (d // 2)
    return jnp.where(col < rotary_pairs, k, v)


def flash_attention(q, k, v, *, scale=None, causal=False, window=None, q_offset=0,
                    kv_offset=0, return_lse=False, rotary_keys_only=None):
    if rotary_keys_only is not None:
        k = keys_except_rotary(k, v, rotary_keys_only)
    t, s = q.shape[1], k.shape[1]
    q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
    starts = jnp.atleast_1d(jnp.asarray(kv_offset, jnp.int32))  # one per segment
    seg_len = s // starts.shape[0]
    k_pos = jnp.repeat(starts, seg_len) + jnp.tile(jnp.arange(seg_len, dtype=jnp.int32),
                                                   starts.shape[0])
    mask = visible_mask(q_pos, k_pos, causal=causal, window=window)
    out, lse = masked_attention(q, k, v, mask, scale)
    return (out, lse) if return_lse else out


def masked_attention(q, k, v, mask, scale=None):
    """(o [B, T, Hq, D] in q.dtype, float32 lse [B, Hq, T]) of q over k, v where ``mask``
    (broadcast to [B, Hkv, G, T, S]: [T, S], or [B, 1, 1, T, S] per row) says which keys each
    query sees; scores, softmax and PV in float32; rows with no visible key give zeros and
    lse -inf. Query head n reads KV head n // (Hq // Hkv)."""
    batch, t, hq, d = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(batch, t, hkv, groups, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * jnp.float32(scale), -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - row_max)
    denom = jnp.sum(p, axis=-1)  # [B, Hkv, G, T]
    has_key = denom > 0
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    inv = jnp.where(has_key, 1.0 / jnp.where(has_key, denom, 1.0), 0.0)
    out = out * jnp.transpose(inv, (0, 3, 1, 2))[..., None]
    out = out.reshape(batch, t, hq, d).astype(q.dtype)
    lse = jnp.where(has_key, row_max[..., 0] + jnp.log(jnp.where(has_key, denom, 1.0)), -jnp.inf)
    return out, lse.reshape(batch, hq, t)
