"""The dense gated MLP of Gemma 4: down(gelu_tanh(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import nn
from jax_mila.parallel.tensor import reduce_partial_sums


def gelu_tanh(x: jax.Array) -> jax.Array:
    """HF "gelu_pytorch_tanh", computed in float32 (as PyTorch does for bf16) and rounded once."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


class Gemma4MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, backend, dtype, param_dtype, quantize,
                 rngs: nnx.Rngs):
        lin = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, quantize=quantize, rngs=rngs)
        self.gate_proj = nn.Linear(hidden, intermediate, **lin)
        self.up_proj = nn.Linear(hidden, intermediate, **lin)
        self.down_proj = nn.Linear(intermediate, hidden, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        # down_proj is row-parallel under tensor parallelism: its partial sums are all-reduced.
        return reduce_partial_sums(self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x)))
