"""Rotary position embeddings of Gemma 4 (half-split "rotate_half", not interleaved).

Traps:
- Sliding layers use the default RoPE over the whole head (theta 1e4).
- Full layers use "proportional" RoPE: only int(0.25 * 512 // 2) = 64 angles are non-zero, and
  the exponent's denominator is the FULL head dim (512). With the half-split layout the rotated
  dims are [0:64] and [256:320]; every other dim passes through (cos 1, sin 0). It is not
  "rotate the first 128 contiguous dims".
- As HF does, cos/sin are computed in float32 and cast to the activation dtype before the
  multiply-add, which runs in that dtype.

The attention layers apply RoPE to the outputs of their q/k norms: ``norm_rope`` runs the two
as one op (jax_mila.ffi.rms_norm_rope) on the backends with kernels, ``apply_rope(norm(x))``
on "reference" and where that op cannot take the call. The fused op rounds the RoPE once, not
per bf16 operation (jax_mila/reference/norm_rope.py), so "mila" and "reference" models differ
by that rounding, on CPU too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi
from jax_mila.ffi import norm_rope as ffi_norm_rope
from jax_mila.ffi._registry import log_fallback
from jax_mila.gemma4.config import RopeSpec
from jax_mila.nn.norm import rms_norm


def inv_freq(spec: RopeSpec) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies (zeros past ``spec.rotated``)."""
    exponents = np.arange(0, 2 * spec.rotated, 2, dtype=np.float32) / np.float32(spec.head_dim)
    rotated = np.float32(1.0) / np.power(np.float32(spec.theta), exponents, dtype=np.float32)
    out = np.zeros(spec.head_dim // 2, np.float32)
    out[: spec.rotated] = rotated
    return out / np.float32(spec.factor)


def rope_tables(spec: RopeSpec, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, head_dim] for int positions [T] shared by the batch's rows, or
    [B, T, head_dim] for positions [B, T] of each row (decode steps of rows at different
    lengths), rounded to ``dtype``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(spec))
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D] rotated with cos/sin [T, D] (or [B, T, D] per row): x * cos +
    rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # over the heads; [T, 1, D] broadcasts
    return (x * cos + rotated * sin).astype(x.dtype)


def fused_unsupported_reason(x: jax.Array, weight: jax.Array | None, cos: jax.Array) -> str | None:
    """Why jax_mila.ffi.rms_norm_rope cannot take norm + RoPE of x [B, T, H, D] (norm weight
    ``weight``, None for a weightless norm), or None. The reasons name the configuration, never
    the length, so a model logs each once."""
    d = x.shape[-1]
    if d not in ffi_norm_rope.HEAD_DIMS:
        return f"head_dim={d} (the kernel takes head_dim in {ffi_norm_rope.HEAD_DIMS})"
    bf16 = jnp.dtype(jnp.bfloat16)
    if jnp.dtype(x.dtype) != bf16 or jnp.dtype(cos.dtype) != bf16:
        return (f"dtype {jnp.dtype(x.dtype).name} activations / {jnp.dtype(cos.dtype).name} "
                "rope tables (the kernel takes bfloat16 for both)")
    if weight is None:
        return "a norm without weight (the kernel takes one)"
    if jnp.dtype(weight.dtype) not in [jnp.dtype(t) for t in ffi_norm_rope.WEIGHT_DTYPES]:
        return (f"norm weight dtype {jnp.dtype(weight.dtype).name} (the kernel takes bfloat16 or "
                "float32)")
    return None


def norm_rope(norm, x: jax.Array, cos: jax.Array, sin: jax.Array, *, backend: str,
              weight: jax.Array | None = None) -> jax.Array:
    """``apply_rope(norm(x), cos, sin)`` for an nn.RMSNorm ``norm`` and x [B, T, H, D]: one op,
    jax_mila.ffi.rms_norm_rope (the kernel on GPU, its reference elsewhere), on a backend with
    kernels where it takes the call (else it logs why, once per reason); the two steps on
    "reference".

    ``weight`` [D] (bf16 or float32), if given, replaces the norm's own weight on both paths
    (Gemma 4's K=V layers norm q with k_norm's weight folded in: jax_mila/gemma4/attention.py);
    the norm's eps stays. As in nn.rms_norm, it multiplies in float32 and the normed values are
    rounded once to x's dtype.

    cos, sin [B, T, D] (each row's own positions): the fused op takes one table row per token,
    so x goes to it as one sequence of B T tokens, [1, B T, H, D], and comes back as
    [B, T, H, D] (norm and RoPE are per token; the same values)."""
    if cos.ndim == 3:
        b, t = x.shape[:2]
        flat = lambda a: a.reshape((1, b * t) + a.shape[2:])  # noqa: E731
        out = norm_rope(norm, flat(x), cos.reshape(b * t, -1), sin.reshape(b * t, -1),
                        backend=backend, weight=weight)
        return out.reshape(x.shape)
    if backend != "reference":
        w = weight if weight is not None else (norm.weight[...] if norm.with_scale else None)
        reason = fused_unsupported_reason(x, w, cos)
        if reason is None:
            return ffi.rms_norm_rope(x, w, cos, sin, eps=norm.eps)
        log_fallback(ffi_norm_rope.OP, reason, instead="the unfused norm and RoPE")
    normed = norm(x) if weight is None else rms_norm(x, weight, norm.eps)
    return apply_rope(normed, cos, sin)
