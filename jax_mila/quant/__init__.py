"""Weight formats. ``MXFP4Weight`` (e2m1 values, e8m0 block exponents, kernel-ordered packing)
is the W4A8 weight; its layout is documented in jax_mila/quant/mxfp4.py."""

from jax_mila.quant.mxfp4 import (
    BLOCK,
    E2M1_VALUES,
    FORMAT_VERSION,
    GROUP,
    KERNEL_ORDER,
    MAX_BLOCK_EXP_DROP,
    SIGN_SOURCE,
    MXFP4Weight,
    check_kernel_invariant,
    dequantize_mxfp4,
    packed_from_version,
    padded_k,
    quantize_mxfp4,
    unpack_codes,
)

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "FORMAT_VERSION",
    "GROUP",
    "KERNEL_ORDER",
    "MAX_BLOCK_EXP_DROP",
    "MXFP4Weight",
    "SIGN_SOURCE",
    "check_kernel_invariant",
    "dequantize_mxfp4",
    "packed_from_version",
    "padded_k",
    "quantize_mxfp4",
    "unpack_codes",
]
