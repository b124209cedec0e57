"""RMSNorm with Gemma 4's convention.

Trap: Gemma 4 multiplies by the weight itself, NOT by ``1 + weight`` as Gemma 1/2/3 did;
checkpoint norm weights are the actual multipliers (HF initialises them to ones).
Computed in float32 (including the weight multiply) and rounded once to the input dtype.
``with_scale=False`` is the weightless norm (V-norm, the MoE router's input norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila.reference.norm import rms_norm  # the function, beside the ops' references


class RMSNorm(nnx.Module):
    """RMS norm over the last axis; ``weight`` [dim] (absent when ``with_scale=False``)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, with_scale: bool = True,
                 param_dtype=jnp.float32):
        self.dim, self.eps, self.with_scale = dim, eps, with_scale
        if with_scale:
            self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...] if self.with_scale else None, self.eps)
