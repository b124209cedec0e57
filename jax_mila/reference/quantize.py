"""Reference activation quantizer: bf16 rows -> float8_e4m3fn with one float32 scale per row.

Definition (the CUDA kernel computes exactly this, in the same float32 operations):
    amax  = max |x[r, :]|
    scale = amax * f32(1 / 448)              (1.0 for rows with amax < 2**-112)
    q     = e4m3_round_nearest_even(clip(x * (448 / amax), -448, 448))   (0 for those rows)
so that q * scale ~= x. The scale is a multiplication by the float32 constant 1/448, not a
division, because XLA rewrites division by a constant that way and the kernel must agree bit
for bit. Rows below 2**-112 count as zero rows because 448 / amax would
overflow float32; their values dequantize to exact zeros, never NaN or inf. Inputs are
expected to be finite.
"""

from __future__ import annotations

import jax.numpy as jnp

E4M3_MAX = 448.0
INV_E4M3_MAX = 1.0 / 448.0  # rounded to float32 where used
QUANT_MIN_AMAX = 2.0**-112


def quantize_activations(x, *, amax=None):
    """x: [..., K] -> (q float8_e4m3fn [..., K], scale float32 [...]).

    ``amax`` [...] overrides the rows' own max |x|: a slice of a row (tensor parallelism) then
    quantizes exactly as the whole row would (jax_mila/nn/linear.py)."""
    x32 = x.astype(jnp.float32)
    if amax is None:
        amax = jnp.max(jnp.abs(x32), axis=-1)
    zero_row = amax < QUANT_MIN_AMAX
    safe_amax = jnp.where(zero_row, jnp.float32(1.0), amax)
    inv_scale = jnp.where(zero_row, jnp.float32(0.0), jnp.float32(E4M3_MAX) / safe_amax)
    scale = jnp.where(zero_row, jnp.float32(1.0), safe_amax * jnp.float32(INV_E4M3_MAX))
    q = jnp.clip(x32 * inv_scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_activations(q, scale, dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
