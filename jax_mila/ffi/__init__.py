"""XLA FFI custom calls of jax_mila: typed wrappers that validate at trace time and
dispatch to the CUDA kernel on GPU or to the pure-JAX reference elsewhere."""

from jax_mila.ffi._registry import DISABLE_ENV, OPS, OpStatus, available, build_info, status
from jax_mila.ffi.attention import flash_attention
from jax_mila.ffi.decode_attention import decode_attention
from jax_mila.ffi.norm_rope import rms_norm_rope
from jax_mila.ffi.quantize import add_rms_norm_quantize, quantize_activations, quantize_geglu
from jax_mila.ffi.w4a8 import grouped_w4a8_matmul, w4a8_matmul, w4a8_matmul_many

__all__ = [
    "DISABLE_ENV",
    "OPS",
    "OpStatus",
    "add_rms_norm_quantize",
    "available",
    "build_info",
    "decode_attention",
    "flash_attention",
    "grouped_w4a8_matmul",
    "quantize_activations",
    "quantize_geglu",
    "rms_norm_rope",
    "status",
    "w4a8_matmul",
    "w4a8_matmul_many",
]
