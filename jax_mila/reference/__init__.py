"""Pure-JAX references of every op: the parity oracle and the path on machines
without a GPU. Each has the signature of its wrapper in jax_mila.ffi."""

from jax_mila.reference.attention import flash_attention, keys_except_rotary
from jax_mila.reference.decode_attention import decode_attention
from jax_mila.reference.norm_rope import rms_norm_rope
from jax_mila.reference.w4a8 import grouped_w4a8_matmul, w4a8_matmul, w4a8_matmul_many
from jax_mila.reference.quantize import (
    E4M3_MAX,
    QUANT_MIN_AMAX,
    add_rms_norm_quantize,
    dequantize_activations,
    geglu,
    quantize_activations,
    quantize_geglu,
)

__all__ = ["decode_attention", "flash_attention", "E4M3_MAX", "QUANT_MIN_AMAX", "add_rms_norm_quantize",
           "dequantize_activations", "geglu", "keys_except_rotary",
           "quantize_activations", "quantize_geglu", "rms_norm_rope", "w4a8_matmul",
           "grouped_w4a8_matmul", "w4a8_matmul_many"]
