"""Reference of rms_norm_rope: a Gemma 4 attention layer's per-head q/k norm and its rotary
embedding as one op (jax_mila/gemma4/attention.py: ``apply_rope(q_norm(q), cos, sin)``).

Definition (the CUDA kernel computes it in the same float32 operations, but for the order of
the sum of squares and its rsqrt):
    n   = bf16(rms_norm(x, weight, eps))          jax_mila.nn.norm.rms_norm: float32, the weight
                                                  itself as multiplier, rounded once to bf16
    out = bf16(n * cos + rotate_half(n) * sin)    float32 from the bf16 n, rounded once
    rotate_half(n) = concat(-n[..., D/2:], n[..., :D/2])       (half-split, not interleaved)
x is bf16 [..., T, H, D] and cos, sin bf16 [T, D] (jax_mila.gemma4.rope.rope_tables), the same
row of each for every head of a token.

The unfused model (jax_mila.gemma4.rope.apply_rope on a bf16 n) rounds each of its three bf16
operations, x * cos, rotate_half(x) * sin and their sum, to bf16, as a bf16 PyTorch model does;
this op rounds once. Both products are exact in float32 (two 8-bit significands), so its
float32 sum is within half a float32 ulp of the exact value and the output is its bf16
rounding: one rounding where the unfused path has three (under jit XLA may already keep the
unfused path's intermediates in float32: xla_allow_excess_precision). Each rounding moves a
value by at most 2^-8 of it, so the two differ by less than 2^-6 (|n cos| + |rotate_half(n)
sin|), a couple of bf16 ulps of the terms (tests/test_norm_rope.py).

n's rounding is lax.reduce_precision, not a convert pair: under jit XLA deletes
f32 -> bf16 -> f32 convert chains (jax_mila/reference/quantize.py), which would skip it.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_mila.reference.norm import rms_norm
from jax_mila.reference.quantize import _round_to_bf16


def rotate_half(x):
    """concat(-x[..., D/2:], x[..., :D/2])."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rms_norm_rope(x, weight, cos, sin, *, eps):
    """x: bf16 [..., T, H, D]; weight: [D] (any float dtype: rms_norm uses it in float32);
    cos, sin: bf16 [T, D]; eps: a Python float. Returns bf16 [..., T, H, D]."""
    f32 = jnp.float32
    # rms_norm of a float32 x is the model's norm without its final cast.
    n = _round_to_bf16(rms_norm(x.astype(f32), weight, eps))
    c = cos.astype(f32)[:, None, :]  # [T, 1, D]: one row for every head of a token
    s = sin.astype(f32)[:, None, :]
    return (n * c + rotate_half(n) * s).astype(x.dtype)
