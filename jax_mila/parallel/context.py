"""Context parallelism: attention over a sequence sharded across a mesh axis.

Layout. The sequence of length T is cut into 2P chunks of C = T / (2P) tokens for P devices
on the axis, and device i holds chunks i and 2P-1-i (zig-zag order). Under a causal mask chunk
c has c+1 chunks of keys to attend to, so every device gets (i+1) + (2P-i) = 2P+1 chunk pairs:
the causal work is balanced without a scheduler. `zigzag_order` gives the token order of that
layout, `zigzag_inverse` undoes it.

Global (causal) layers: ring attention. Each device keeps its queries and passes its K/V block
around the ring with `ppermute`, P steps; at each step it attends its two query chunks to the
block's two key chunks with the single-device kernel (positions through q_offset/kv_offset, so
pairs wholly above the diagonal cost nothing: the kernel skips their tiles) and merges the
partial results with their log-sum-exp. The ppermute of step s+1's block is issued before step
s's attention, so XLA can overlap the transfer with the compute.

Local (sliding-window) layers: a chunk needs the W-1 keys before it, which live at the end of
the chunk before it, so one halo exchange replaces the ring: device i sends the tail of its
first chunk to device i+1 and the tail of its second chunk to device i-1 (device P-1's second
chunk, P, follows its own first chunk). Requires C >= W-1.

Both functions run inside `jax.shard_map` with the sequence axis of q, k, v sharded over
`axis_name`; `attention` is any function with the contract of jax_mila.ffi.flash_attention
(the CUDA kernel, or jax_mila.reference.flash_attention on CPU). A model's layers reach them
through jax_mila.parallel.Layout (seq_split "zigzag"), which also gives them their tokens'
positions (`zigzag_positions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def zigzag_positions(local_len: int, axis: str) -> jax.Array:
    """Positions of this device's `local_len` tokens in the zig-zag layout over `axis`."""
    p, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    c = local_len // 2
    r = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + r, (2 * p - 1 - i) * c + r])


def layer_attention(q, k, v, attn, *, window, axis: str):
    """Attention of the local zig-zag slices over `axis` through `attn` (an nn.Attention: its
    backend and scale): ring attention for causal layers, halo exchange for sliding windows."""
    # attn is always causal and owns the scale; the ring and halo pass both.
    fn = lambda q, k, v, *, scale, causal, **kw: attn(q, k, v, **kw)  # noqa: E731
    if window is None:
        return ring_attention(q, k, v, fn, axis_name=axis)
    return halo_window_attention(q, k, v, fn, axis_name=axis, window=window)


def zigzag_order(seq_len: int, axis_size: int) -> np.ndarray:
    """Token indices in zig-zag layout: device i's slice holds chunks i and 2P-1-i."""
    if seq_len % (2 * axis_size):
        raise ValueError(f"context parallel: the sequence length must be a multiple of 2 x "
                         f"devices on the axis = {2 * axis_size}; got {seq_len}")
    chunks = np.arange(seq_len).reshape(2 * axis_size, -1)
    order = [chunks[c] for i in range(axis_size) for c in (i, 2 * axis_size - 1 - i)]
    return np.concatenate(order)


def zigzag_inverse(seq_len: int, axis_size: int) -> np.ndarray:
    return np.argsort(zigzag_order(seq_len, axis_size))


def _merge(acc, part):
    """Combines two partial softmax results (o in float32, lse [B, H, T]) exactly."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)  # both empty: keep zeros, not NaN

    def weight(l):
        w = jnp.where(jnp.isneginf(l), 0.0, jnp.exp(l - safe))  # [B, H, T]
        return jnp.transpose(w, (0, 2, 1))[..., None]  # [B, T, H, 1]

    return o1 * weight(l1) + o2.astype(jnp.float32) * weight(l2), lse


def _empty(q):
    b, t, h, d = q.shape
    return jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, h, t), -jnp.inf, jnp.float32)


def _halves(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def ring_attention(q, k, v, attention, *, axis_name: str, scale=None):
    """Causal attention of the local zig-zag slices q [B, 2C, Hq, D], k, v [B, 2C, Hkv, D]."""
    p = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name)
    c = q.shape[1] // 2
    q_chunks = (i, 2 * p - 1 - i)
    q_parts = _halves(q)
    acc = [_empty(qp) for qp in q_parts]
    kv = (k, v)
    ring = [(d, (d + 1) % p) for d in range(p)]
    for step in range(p):
        src = (i - step) % p  # the device whose K/V block this is
        nxt = jax.lax.ppermute(kv, axis_name, ring) if step + 1 < p else None
        for kb, (kc, vc) in zip((src, 2 * p - 1 - src), zip(_halves(kv[0]), _halves(kv[1]))):
            for a, (qa, qp) in enumerate(zip(q_chunks, q_parts)):
                part = attention(qp, kc, vc, scale=scale, causal=True, q_offset=qa * c,
                                 kv_offset=kb * c, return_lse=True)
                acc[a] = _merge(acc[a], part)
        kv = nxt
    return jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)


def halo_window_attention(q, k, v, attention, *, axis_name: str, window: int, scale=None):
    """Sliding-window causal attention of the local zig-zag slices (keys inside the window)."""
    p = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name)
    c = q.shape[1] // 2
    halo = window - 1
    if halo > c:
        raise ValueError(f"context parallel: a window of {window} needs chunks of at least "
                         f"{halo} tokens; got {c} (sequence / (2 x devices)); use fewer devices "
                         "on the sequence axis or a longer sequence")
    (k1, k2), (v1, v2) = _halves(k), _halves(v)
    outs = []
    if halo:
        # First chunks' halos travel up the ring (from device i-1), second chunks' down it.
        up = [(d, (d + 1) % p) for d in range(p)]
        down = [(d, (d - 1) % p) for d in range(p)]
        tail = lambda x: x[:, c - halo:]  # noqa: E731
        halo1 = jax.lax.ppermute((tail(k1), tail(v1)), axis_name, up)
        halo2 = jax.lax.ppermute((tail(k2), tail(v2)), axis_name, down)
        own = (tail(k1), tail(v1))  # device P-1: chunk P follows its own chunk P-1
        halo2 = jax.tree.map(lambda h, o: jnp.where(i == p - 1, o, h), halo2, own)
    for a, (qa, qp, kc, vc) in enumerate(zip((i, 2 * p - 1 - i), _halves(q), (k1, k2), (v1, v2))):
        acc = attention(qp, kc, vc, scale=scale, causal=True, window=window, q_offset=qa * c,
                        kv_offset=qa * c, return_lse=True)
        acc = (acc[0].astype(jnp.float32), acc[1])
        if halo:
            hk, hv = (halo1, halo2)[a]
            # Positions shifted by `halo` (the mask sees only differences) so that no offset is
            # negative, chunk 0's included.
            o, lse = attention(qp, hk, hv, scale=scale, causal=True, window=window,
                               q_offset=qa * c + halo, kv_offset=qa * c, return_lse=True)
            lse = jnp.where(qa == 0, -jnp.inf, lse)  # chunk 0 has nothing before it
            acc = _merge(acc, (o, lse))
        outs.append(acc[0])
    return jnp.concatenate(outs, axis=1).astype(q.dtype)
