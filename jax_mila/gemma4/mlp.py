"""The dense gated MLP of Gemma 4: down(gelu_tanh(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import nn, reference
from jax_mila.nn import noise
from jax_mila.nn.linear import quantized_ops
from jax_mila.parallel.layout import SINGLE_DEVICE, Layout


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

    def takes_quantized_input(self, layout: Layout = SINGLE_DEVICE) -> bool:
        """Whether __call__ may be given x already quantized (nn.QuantizedRows, e.g. from
        add_rms_norm_quantize) and compute what it computes from x in a step of ``layout``:
        gate_proj and up_proj W4A8 on one backend (nn.shares_quantized_input), no tensor
        parallelism (the layers under it quantize inside their shard_map)."""
        return layout.heads_axis is None and nn.shares_quantized_input(self.gate_proj,
                                                                       self.up_proj)

    def fuses_geglu(self, layout: Layout = SINGLE_DEVICE) -> bool:
        """Whether __call__ quantizes gelu_tanh(g) * u for down_proj in one op (quantize_geglu)
        instead of forming the product and quantizing it inside down_proj.

        Only where that op computes exactly what down_proj would quantize:
        - all three projections W4A8 with one backend: down_proj's input is quantized at all,
          and by the ops the layers would use;
        - a bfloat16 model: there gelu_tanh(g) and the product are rounded to bf16 like the
          op rounds them. A float32 model keeps both in float32 and rounds h to bf16 once,
          at the quantizer; the op would round twice, so it keeps the unfused expression;
        - no tensor parallelism: down_proj is row-parallel there, and its rows are quantized
          against the whole row's amax (nn.Linear._w4a8), which the op cannot see.
        """
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        return (all(lin.quantize == "w4a8" for lin in layers)
                and len({lin.backend for lin in layers}) == 1
                and all(jnp.dtype(lin.dtype) == jnp.dtype(jnp.bfloat16) for lin in layers)
                and layout.heads_axis is None)

    def __call__(self, x, layout: Layout = SINGLE_DEVICE) -> jax.Array:
        """x [..., hidden], or its W4A8 quantization (nn.QuantizedRows, where
        takes_quantized_input(layout)); ``layout``: the step's split over the mesh (under
        tensor parallelism this device holds a slice of the MLP's columns)."""
        g, u = nn.project_many((self.gate_proj, self.up_proj), x)
        if self.fuses_geglu(layout):
            rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731 - the op takes rank >= 2
            ops = quantized_ops(self.down_proj.backend)
            if noise.active():
                # The probe perturbs the quantizer's input, which the fused op never forms: the
                # reference GeGLU forms it (the same bf16 values, so the same codes unperturbed).
                q, s = ops.quantize_activations(noise.perturb(reference.geglu(rows(g), rows(u))))
            else:
                q, s = ops.quantize_geglu(rows(g), rows(u))
            return self.down_proj.matmul_quantized(q, s).reshape(*x.shape[:-1], -1)
        # down_proj is row-parallel under tensor parallelism: its partial sums are all-reduced.
        return layout.reduce(self.down_proj(gelu_tanh(g) * u,
                                            row_parallel_axis=layout.heads_axis))
