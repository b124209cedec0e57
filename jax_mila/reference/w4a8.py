"""Reference W4A8 GEMM: FP8 activations (one float32 scale per row) times an MXFP4 weight.

    y[m, n] = x_scale[m] * sum_k float(x_fp8[m, k]) * w[n, k]

with w the dequantized MXFP4 weight (jax_mila.quant.dequantize_mxfp4, kernel semantics), the
product in float32 (precision HIGHEST), rounded once to ``out_dtype``. The CUDA kernel computes
the same sum on FP8 tensor cores (every operand exact in e4m3, float32 accumulation), so the two
differ only by float32 summation order. This is the CPU path, the sm_80 path and the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mila.quant.mxfp4 import MXFP4Weight, dequantize_mxfp4


def w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, *, out_dtype=jnp.bfloat16):
    """x_fp8 float8_e4m3fn [..., K], x_scale float32 [...], w MXFP4 [N, K] -> out_dtype [..., N]."""
    wf = dequantize_mxfp4(w, jnp.float32, kernel_semantics=True)
    acc = jnp.einsum("...k,nk->...n", x_fp8.astype(jnp.float32), wf,
                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (acc * x_scale[..., None].astype(jnp.float32)).astype(out_dtype)
