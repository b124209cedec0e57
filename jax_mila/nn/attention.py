"""Attention: the dot-product attention core (no projections), backend fixed at construction.

Contract (that of jax_mila.ffi.flash_attention): q [B, T, Hq, D], k and v [B, S, Hkv, D];
query i sits at position q_offset + i, key j at kv_offset + j; causal masking hides keys
after the query; a window W also hides keys with q_pos - k_pos >= W (so each query sees
itself and the W - 1 previous tokens, exactly HF's ``kv_idx > q_idx - sliding_window``).

Backends:
- "reference": always jax_mila.reference.flash_attention (float32 math from the inputs).
- "mila" / "auto": jax_mila.ffi.flash_attention, which runs the CUDA kernel where it is built
  and the reference elsewhere. The kernels exist only for bf16 and head dims 256 / 512, so any
  other call (tiny test configs, float32 models) falls back to the reference, logging once
  per reason why.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import ffi, reference
from jax_mila.nn.backend import check_backend

log = logging.getLogger("jax_mila")

KERNEL_HEAD_DIMS = (256, 512)
KERNEL_DTYPES = (jnp.bfloat16,)
KERNEL_MAX_GROUPS = 16

_logged_fallbacks: set[str] = set()


def _kernel_unsupported_reason(q: jax.Array, k: jax.Array) -> str | None:
    d = q.shape[-1]
    if d not in KERNEL_HEAD_DIMS:
        return f"head_dim={d} (kernels exist for {KERNEL_HEAD_DIMS})"
    if q.dtype not in KERNEL_DTYPES or k.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} (kernels take bfloat16)"
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv or hq // hkv > KERNEL_MAX_GROUPS:
        return f"{hq} query heads over {hkv} KV heads (kernels take up to {KERNEL_MAX_GROUPS} per KV head)"
    return None


class Attention(nnx.Module):
    """Causal (optionally sliding-window) attention with a fixed ``scale`` (Gemma 4: 1.0)."""

    def __init__(self, *, scale: float | None, backend: str = "auto"):
        self.scale = scale
        self.backend = check_backend(backend)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                 q_offset=0, kv_offset=0) -> jax.Array:
        kwargs = dict(scale=self.scale, causal=True, window=window, q_offset=q_offset,
                      kv_offset=kv_offset)
        if self.backend != "reference":
            reason = _kernel_unsupported_reason(q, k)
            if reason is None:
                return ffi.flash_attention(q, k, v, **kwargs)
            if reason not in _logged_fallbacks:
                _logged_fallbacks.add(reason)
                log.info("jax_mila.nn.Attention: using the reference attention for %s", reason)
        return reference.flash_attention(q, k, v, **kwargs)
