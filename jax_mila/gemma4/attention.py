"""Gemma4Attention: projections, QK/V norms, RoPE and the attention core of one layer.

Traps (each breaks parity on its own):
- scale 1.0: no 1/sqrt(head_dim), no query_pre_attn_scalar; q_norm / k_norm replace it.
- V-norm: an RMSNorm without weight on V.
- K=V full layers (attention_k_eq_v): no v_proj; V is the RAW k_proj output (before k_norm
  and RoPE), then V-normed.
- KV-shared layers compute only Q and attend over the already normed and RoPE'd K/V of their
  source layer (same positions, same mask); they own no k/v weights and no cache entry.
- Sliding window W: a query sees itself and the W - 1 previous tokens.

K=V layers fold k_norm's weight into q (backends with kernels): outside the columns RoPE
rotates, K = V * w_k (cos 1, sin 0 there), so q . K = sum_rot q_d K_d + sum_other (q_d w_k[d]) V_d.
q is normed with w_q * w_k outside the rotated columns and the attention reads k only in them,
v elsewhere (nn.Attention rotary_keys_only). Same scores up to rounding; the cache and the K/V
that KV-shared layers read stay the plain K and V (those layers attend without the fold).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila import nn
from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4.config import Gemma4Config, LayerSpec
from jax_mila.gemma4.rope import norm_rope
from jax_mila.parallel.layout import CHUNK, SINGLE_DEVICE, Layout

# What attention reads: (k, v, kv_offset) in flash_attention's position contract (modes
# "full", "prefill", "chunk"), or in mode "decode" (k_buf, v_buf, kv_len [B]): the cache
# buffers as they lie and each row's valid length (decode_attention's contract). Shared
# layers receive their source's view.
KVView = tuple[jax.Array, jax.Array, jax.Array]


class Gemma4Attention(nnx.Module):
    def __init__(self, cfg: Gemma4Config, spec: LayerSpec, *, backend: str, dtype, param_dtype,
                 quantize, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_attention_heads, spec.head_dim
        self.num_kv_heads, self.eps = spec.num_kv_heads, cfg.rms_norm_eps
        self.window = cfg.sliding_window if spec.is_sliding else None
        self.is_kv_shared, self.k_eq_v = spec.is_kv_shared, spec.k_eq_v
        self.backend = backend  # of the fused q/k norm + RoPE (rope.norm_rope)
        lin = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, quantize=quantize, rngs=rngs)
        h, q_dim, kv_dim = cfg.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q_dim, **lin)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps, param_dtype=param_dtype)
        if not self.is_kv_shared:
            self.k_proj = nn.Linear(h, kv_dim, **lin)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps, param_dtype=param_dtype)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(h, kv_dim, **lin)
        self.o_proj = nn.Linear(q_dim, h, **lin)
        # K=V layers: k_norm's weight folded into q, the scores read K only in the rotated
        # columns (module docstring). On Hopper at D=512, r=64 the attention kernel then loads
        # 80 instead of 128 KB per 64-key tile (V plus K's two rotated blocks, ffi/attention.py).
        # self.attn.rotary_keys_only is the one switch: q_norm_weight() folds where it is set.
        self.attn = nn.Attention(scale=1.0, backend=backend,
                                 rotary_keys_only=self._fold_rotated(cfg, spec, backend))

    def _fold_rotated(self, cfg: Gemma4Config, spec: LayerSpec, backend: str) -> int | None:
        """The rotated pairs r of this layer's RoPE where it folds k_norm into q, else None:
        K=V layers that own their K/V, with weighted q and k norms, on a backend with kernels
        ("reference" keeps the plain model), and only where RoPE leaves columns unrotated."""
        if (not self.k_eq_v or self.is_kv_shared or backend == "reference"
                or not (self.q_norm.with_scale and self.k_norm.with_scale)):
            return None
        r = cfg.rope[spec.layer_type].rotated
        return r if 0 <= r < self.head_dim // 2 else None

    def q_norm_weight(self) -> jax.Array | None:
        """The weight q is normed with where it differs from q_norm's: on folding layers
        (rotary_keys_only set on self.attn) w_q * w_k outside the rotated columns (col % (D/2)
        >= r), w_q in them, in float32 (the product of two bf16 or float32 weights; the fused
        op and nn.rms_norm multiply in float32 anyway). None: q_norm's own weight."""
        r = self.attn.rotary_keys_only
        if r is None:
            return None
        rotated = np.arange(self.head_dim) % (self.head_dim // 2) < r  # static [D] mask
        w_q = self.q_norm.weight[...].astype(jnp.float32)
        w_k = self.k_norm.weight[...].astype(jnp.float32)
        return w_q * jnp.where(rotated, jnp.float32(1), w_k)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """The projections of the layer's input x: q_proj, and k_proj / v_proj where the layer
        has them (KV-shared layers have neither, K=V layers no v_proj)."""
        if self.is_kv_shared:
            return (self.q_proj,)
        return (self.q_proj, self.k_proj) + (() if self.k_eq_v else (self.v_proj,))

    def takes_quantized_input(self, layout: Layout = SINGLE_DEVICE) -> bool:
        """Whether __call__ may be given x already quantized (nn.QuantizedRows, e.g. from
        add_rms_norm_quantize) and compute what it computes from x in a step of ``layout``:
        every projection of x W4A8 on one backend (nn.shares_quantized_input), no tensor
        parallelism (the layers under it quantize inside their shard_map)."""
        return layout.heads_axis is None and nn.shares_quantized_input(*self.input_projections())

    def __call__(self, x, cos, sin, *, offset, mode: str, entry=None, shared: KVView | None = None,
                 max_len: int = 0, valid=None, first_chunk: bool = False,
                 layout: Layout = SINGLE_DEVICE):
        """x [B, T, H] at positions offset + arange(T), or its W4A8 quantization
        (nn.QuantizedRows, where takes_quantized_input()).

        mode "full" (no cache), "prefill" (offset 0; builds this layer's cache entry),
        "decode" (T == 1; ``offset`` [B] each row's position; writes to ``entry`` and attends
        over its buffers in place, decode_attention) or "chunk" (a prefill chunk whose first
        ``valid`` tokens are real, a scalar or [B] per row; appends them to ``entry``;
        ``first_chunk``: at offset 0, see cache.chunk_update's ``first``). ``layout``: the step's split over the mesh (this
        device's heads, its tokens, how its attention merges across devices; the cos, sin
        given are its tokens'). Returns (out, kv_view, new_entry)."""
        b, t, _ = x.shape
        # Head counts from the arrays: under tensor parallelism this device holds a slice of the
        # heads (jax_mila/parallel/tensor.py).
        # The projections of x in one go (in decode one GEMV launch: nn.project_many).
        projected = nn.project_many(self.input_projections(), x)
        q = projected[0].reshape(b, t, -1, self.head_dim)
        q = norm_rope(self.q_norm, q, cos, sin, backend=self.backend, weight=self.q_norm_weight())
        new_entry = None
        if self.is_kv_shared:
            k, v, kv_offset = shared
        else:
            k_raw = projected[1].reshape(b, t, -1, self.head_dim)
            v_raw = k_raw if self.k_eq_v else projected[2].reshape(k_raw.shape)
            k = norm_rope(self.k_norm, k_raw, cos, sin, backend=self.backend)
            v = nn.rms_norm(v_raw, None, self.eps)
            kv_offset = jnp.int32(0)
            ring = kv.ring_size(self.window, max_len) if self.window is not None else None
            if mode == "prefill":
                new_entry = kv.prefill_entry(k, v, ring=ring, max_len=max_len)
            elif mode == "decode":
                new_entry = kv.decode_update(*entry, k, v, offset, ring=ring is not None)
                k, v = new_entry
                kv_offset = offset + 1  # kv_len: each row's tokens, this step's included
            elif mode == "chunk":
                if layout.seq_split == CHUNK:  # k, v: this device's slice of the chunk
                    update = functools.partial(kv.sharded_chunk_update, axis=layout.seq_axis,
                                               segments=layout.segments)
                else:
                    update = functools.partial(kv.chunk_update, first=first_chunk)
                k_buf, v_buf, k, v, kv_offset = update(*entry, k, v, offset, valid,
                                                       ring=ring is not None)
                new_entry = (k_buf, v_buf)
        if mode == "decode":
            # The buffers as they lie: a ring in place, an FP8 cache as stored.
            kq, vq = layout.kv_heads_for_local_queries(k, v, num_heads=self.num_heads,
                                                       num_kv_heads=self.num_kv_heads,
                                                       local_q_heads=q.shape[2])
            o = layout.attend_cache(q, kq, vq, self.attn, kv_len=kv_offset, window=self.window,
                                    ring=kv.decode_reads_ring(k.shape[1], self.window))
        else:
            if k.dtype != q.dtype:  # an FP8 cache (cache.py): the prefill reads the model's dtype
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            kq, vq = layout.kv_heads_for_local_queries(k, v, num_heads=self.num_heads,
                                                       num_kv_heads=self.num_kv_heads,
                                                       local_q_heads=q.shape[2])
            o = layout.attend(q, kq, vq, self.attn, window=self.window, q_offset=offset,
                              kv_offset=kv_offset)
        # o_proj is row-parallel under tensor parallelism: its partial sums are all-reduced.
        out = self.o_proj(o.reshape(b, t, -1), row_parallel_axis=layout.heads_axis)
        out = layout.reduce(out)
        return out, (k, v, kv_offset), new_entry
