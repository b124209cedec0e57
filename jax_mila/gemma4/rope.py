"""Rotary position embeddings of Gemma 4 (half-split "rotate_half", not interleaved).

Traps:
- Sliding layers use the default RoPE over the whole head (theta 1e4).
- Full layers use "proportional" RoPE: only int(0.25 * 512 // 2) = 64 angles are non-zero, and
  the exponent's denominator is the FULL head dim (512). With the half-split layout the rotated
  dims are [0:64] and [256:320]; every other dim passes through (cos 1, sin 0). It is not
  "rotate the first 128 contiguous dims".
- As HF does, cos/sin are computed in float32 and cast to the activation dtype before the
  multiply-add, which runs in that dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila.gemma4.config import RopeSpec


def inv_freq(spec: RopeSpec) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies (zeros past ``spec.rotated``)."""
    exponents = np.arange(0, 2 * spec.rotated, 2, dtype=np.float32) / np.float32(spec.head_dim)
    rotated = np.float32(1.0) / np.power(np.float32(spec.theta), exponents, dtype=np.float32)
    out = np.zeros(spec.head_dim // 2, np.float32)
    out[: spec.rotated] = rotated
    return out / np.float32(spec.factor)


def rope_tables(spec: RopeSpec, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, head_dim] for int positions [T], rounded to ``dtype``."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(spec))[None, :]
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D] rotated with cos/sin [T, D]: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x * cos + rotated * sin).astype(x.dtype)
