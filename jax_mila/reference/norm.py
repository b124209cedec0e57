"""RMS norm with Gemma 4's convention (the weight itself is the multiplier, not 1 + weight), in
float32 and rounded once to the input's dtype: the model's norm (jax_mila.nn.RMSNorm calls it)
and the part of the fused ops' references that norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """x * (mean(x^2) + eps)^-0.5 [* weight], in float32, cast back to x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jnp.power(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)
