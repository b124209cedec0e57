"""Flax NNX building blocks whose compute backend is chosen at construction.

``Linear`` and ``Attention`` are the seams where the CUDA kernels plug in; models are written
against these modules only, so switching backend or weight format (``quantize="w4a8"``:
MXFP4 weights held in ``MXFP4Param`` variables) never touches model code. ``swap_linears`` turns an existing flax.nnx model's nnx.Linear
layers into W4A8 ``Linear`` layers in place (jax_mila/nn/swap.py).
"""

from jax_mila.nn.attention import Attention
from jax_mila.nn.backend import BACKENDS, check_backend
from jax_mila.nn.embed import Embed
from jax_mila.nn.grouped import GroupedLinear
from jax_mila.nn.linear import (
    QUANTIZE_MODES,
    Linear,
    MXFP4Param,
    QuantizedRows,
    check_quantize,
    project,
    project_many,
    shares_quantized_input,
)
from jax_mila.nn.norm import RMSNorm, rms_norm
from jax_mila.nn.swap import ReshapedLinear, SwapEntry, SwapReport, swap_linears

__all__ = ["Attention", "BACKENDS", "Embed", "GroupedLinear", "Linear", "MXFP4Param",
           "QUANTIZE_MODES", "QuantizedRows", "RMSNorm", "ReshapedLinear", "SwapEntry",
           "SwapReport", "check_backend", "check_quantize", "project", "project_many",
           "rms_norm",
           "shares_quantized_input", "swap_linears"]
