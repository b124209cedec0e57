"""Reference W4A8 GEMMs: FP8 activations (one float32 scale per row) times MXFP4 weights.

    y[m, n] = x_scale[m] * sum_k float(x_fp8[m, k]) * w[n, k]

with w the dequantized MXFP4 weight (jax_mila.quant.dequantize_mxfp4, kernel semantics; its
first K stored columns, K = x's last dim), the product in float32 (precision HIGHEST), rounded
once to ``out_dtype``. The grouped form takes rows sorted by expert: rows [offset_e, offset_e +
group_sizes[e]) use expert e's weight (offset_e = the sum of the sizes before e; negative sizes
count as 0, groups end at row M, rows past the last group are zeros). The CUDA kernels compute
the same sums on FP8 tensor cores (every operand exact in e4m3, float32 accumulation), so they
differ only by float32 summation order. This is the CPU path, the sm_80 path and the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mila.quant.mxfp4 import MXFP4Weight, dequantize_mxfp4


def w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, *, out_dtype=jnp.bfloat16):
    """x_fp8 float8_e4m3fn [..., K], x_scale float32 [...], w MXFP4 [N, Kp] -> out_dtype [..., N]."""
    wf = dequantize_mxfp4(w, jnp.float32, k=x_fp8.shape[-1], kernel_semantics=True)
    acc = jnp.einsum("...k,nk->...n", x_fp8.astype(jnp.float32), wf,
                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (acc * x_scale[..., None].astype(jnp.float32)).astype(out_dtype)


def w4a8_matmul_many(x_fp8, x_scale, weights, *, out_dtype=jnp.bfloat16):
    """``tuple(w4a8_matmul(x_fp8, x_scale, w, out_dtype=out_dtype) for w in weights)``."""
    return tuple(w4a8_matmul(x_fp8, x_scale, w, out_dtype=out_dtype) for w in weights)


def group_bounds(group_sizes, rows: int):
    """The rows each group covers, as the kernels read ``group_sizes`` [E] int32: (start [E],
    end [E]) with negative sizes counted as 0 and every group clamped to [0, rows)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def grouped_w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, group_sizes, *,
                        out_dtype=jnp.bfloat16):
    """x_fp8 float8_e4m3fn [M, K] (rows sorted by expert), x_scale float32 [M], w MXFP4 experts
    [E, N, Kp], group_sizes int32 [E] -> out_dtype [M, N]."""
    wf = dequantize_mxfp4(w, jnp.float32, k=x_fp8.shape[-1], kernel_semantics=True)
    starts, ends = group_bounds(group_sizes, x_fp8.shape[0])
    acc = jax.lax.ragged_dot(x_fp8.astype(jnp.float32), jnp.swapaxes(wf, 1, 2), ends - starts,
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    # ragged_dot does not promise zeros in the rows past the last group on every backend; the
    # kernels write zeros there.
    covered = jnp.arange(x_fp8.shape[0])[:, None] < ends[-1]
    return jnp.where(covered, acc * x_scale[:, None].astype(jnp.float32), 0.0).astype(out_dtype)
