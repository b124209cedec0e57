"""Linear: y = x @ kernel, with the kernel stored [in, out] (Flax layout), no bias.

Every projection of the model goes through this module, so a quantized weight format can be
added here (``quantize="w4a8"``: MXFP4 weights through jax_mila.ffi.w4a8_matmul) without the
model changing. Today only ``quantize=None`` (a plain dense kernel) exists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila.nn.backend import check_backend

QUANTIZE_MODES = (None,)


def check_quantize(quantize) -> None:
    """Raises ValueError for a quantization mode this build does not implement."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r} is not implemented yet (supported: {QUANTIZE_MODES}); "
                         "the w4a8 weight format arrives with jax_mila.quant")


class Linear(nnx.Module):
    """Bias-free dense layer. ``kernel`` is [in_features, out_features] in ``param_dtype``.

    The product accumulates in float32 and is rounded once to ``dtype`` (like a bf16 PyTorch
    ``nn.Linear`` on GPU/CPU), so bf16 models round exactly once per projection.
    """

    def __init__(self, in_features: int, out_features: int, *, backend: str = "auto",
                 dtype=jnp.float32, param_dtype=jnp.float32, quantize=None,
                 rngs: nnx.Rngs | None = None):
        check_backend(backend)
        check_quantize(quantize)
        self.in_features, self.out_features = in_features, out_features
        self.backend, self.dtype, self.quantize = backend, dtype, quantize
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        init = jax.nn.initializers.normal(stddev=in_features**-0.5)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)
        y = jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=jnp.float32)
        return y.astype(self.dtype)
