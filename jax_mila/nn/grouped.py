"""GroupedLinear: E bias-free linears [in -> out] applied to rows sorted by expert, as a
mixture-of-experts layer runs its experts.

    y = layer(x_sorted, group_sizes)        # x_sorted [M, in], group_sizes int32 [E]

rows [offset_e, offset_e + group_sizes[e]) of x (offset_e = the sum of the sizes before e) go
through expert e; the sizes are traced device values (a new routing recompiles nothing); rows
past the last group are zeros.

- ``quantize=None``: a dense ``kernel`` nnx.Param [E, in, out] in param_dtype; the product
  (jax_mila.reference.w4a8.grouped_rows_product: expert by expert, memory linear in the rows)
  in float32, rounded once to ``dtype``.
- ``quantize="w4a8"``: the experts' weights as one MXFP4 weight [E, out, padded_k(in)] in the
  three uint8 MXFP4Param variables ``packed``, ``scales``, ``channel_exp`` (the [E, out, in]
  orientation of a Hugging Face expert tensor); the forward pass quantizes the rows to FP8
  (quantize_activations) and runs grouped_w4a8_matmul (one launch for every expert). Shapes the
  kernels cannot take stay dense, logged once per shape, as for jax_mila.nn.Linear.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila.nn import noise
from jax_mila.nn.backend import check_backend
from jax_mila.nn.linear import get_mxfp4, quantized_ops, set_mxfp4, w4a8_quantize_mode
from jax_mila.quant.mxfp4 import MXFP4Weight, padded_k, quantize_mxfp4
from jax_mila.reference.w4a8 import grouped_rows_product


class GroupedLinear(nnx.Module):
    """E linears [in_features -> out_features] over rows sorted by expert (module docstring)."""

    def __init__(self, in_features: int, out_features: int, num_experts: int, *,
                 backend: str = "auto", dtype=jnp.float32, param_dtype=jnp.float32,
                 quantize=None, rngs: nnx.Rngs | None = None):
        check_backend(backend)
        quantize = w4a8_quantize_mode(quantize, in_features, out_features, "GroupedLinear")
        if num_experts < 1:
            raise ValueError(f"GroupedLinear: num_experts={num_experts} must be >= 1")
        self.in_features, self.out_features, self.num_experts = in_features, out_features, num_experts
        self.backend, self.dtype, self.quantize = backend, dtype, quantize
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        init = jax.nn.initializers.normal(stddev=in_features**-0.5)
        if quantize is None:
            self.kernel = nnx.Param(init(rngs.params(), (num_experts, in_features, out_features),
                                         param_dtype))
        else:
            # A random weight quantized like a checkpoint's; traceable (nnx.eval_shape builds
            # models abstractly before loading).
            w = init(rngs.params(), (num_experts, out_features, in_features), jnp.float32)
            self.set_mxfp4(quantize_mxfp4(w, check_finite=False))

    @property
    def mxfp4(self) -> MXFP4Weight:
        """The quantized weights [E, out_features, padded_k(in_features)] (W4A8 layers only)."""
        if self.quantize != "w4a8":
            raise AttributeError(f"GroupedLinear {self.in_features} -> {self.out_features} is "
                                 "dense")
        return get_mxfp4(self)

    def set_mxfp4(self, w: MXFP4Weight) -> None:
        """Replaces the quantized weights (stored shape [E, out_features, padded_k(in)])."""
        set_mxfp4(self, w, (self.num_experts, self.out_features, padded_k(self.in_features)),
                  f"GroupedLinear {self.num_experts} x {self.in_features} -> {self.out_features}")

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x [M, in_features] sorted by expert, group_sizes int32 [E] -> [M, out_features]."""
        if self.quantize == "w4a8":
            # noise.perturb: the identity, except inside noise.quantizer_noise (a probe).
            rows = noise.perturb(x.astype(jnp.bfloat16))
            q, s = quantized_ops(self.backend).quantize_activations(rows)
            return self.matmul_quantized(q, s, group_sizes)
        y = grouped_rows_product(x.astype(self.dtype), group_sizes, self.kernel[...],
                                 lambda w: w.astype(self.dtype), self.out_features)
        return y.astype(self.dtype)  # rows past the groups: zeros, as the kernels write them

    def matmul_quantized(self, q: jax.Array, scale: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The W4A8 product of rows already quantized per row (q float8_e4m3fn [M, in_features],
        scale float32 [M], as quantize_activations or quantize_geglu return them)."""
        if self.quantize != "w4a8":
            raise ValueError(f"GroupedLinear {self.in_features} -> {self.out_features}: "
                             "matmul_quantized needs a quantize='w4a8' layer; this one is dense")
        out_dtype = self.dtype if jnp.dtype(self.dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32
        y = quantized_ops(self.backend).grouped_w4a8_matmul(q, scale, self.mxfp4, group_sizes,
                                                            out_dtype=out_dtype)
        return y.astype(self.dtype)
