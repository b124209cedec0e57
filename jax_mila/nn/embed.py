"""Embedding lookup with a multiplicative scale, as Gemma's ScaledWordEmbedding.

Trap: HF casts the scale to the weight dtype before multiplying, so with bf16 weights
sqrt(3840) = 61.97 becomes 62.0. ``scale`` is rounded to ``dtype`` the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Embed(nnx.Module):
    """``weight`` [num_embeddings, features]; returns weight[ids] * dtype(scale)."""

    def __init__(self, num_embeddings: int, features: int, *, scale: float = 1.0,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.num_embeddings, self.features = num_embeddings, features
        self.scale, self.dtype = float(np.float32(scale)), dtype
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        init = jax.nn.initializers.normal(stddev=1.0)
        self.weight = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.weight[...], ids, axis=0).astype(self.dtype)
        return rows * jnp.asarray(self.scale, jnp.float32).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """x @ weight.T (the tied output head), float32 accumulation, rounded to ``dtype``."""
        w = self.weight[...].astype(self.dtype)
        y = jnp.einsum("...h,vh->...v", x.astype(self.dtype), w, preferred_element_type=jnp.float32)
        return y.astype(self.dtype)
