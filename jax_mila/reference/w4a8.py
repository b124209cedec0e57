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

from jax_mila._vma import vary_like
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


def grouped_rows_product(x, group_sizes, weights, weight_of, n: int, *, precision=None,
                         rows_per_step: int = 256):
    """Rows sorted by group times each group's weight: out[m] = x[m] @ weight_of(weights[e])
    for the rows m of group e (``group_bounds``), float32 [M, n]; rows in no group are zeros.

    x [M, K] (any float dtype, multiplied as given); ``weights`` a pytree of arrays with the
    groups on their leading axis, whose slice for one group ``weight_of`` turns into its [K, n]
    matrix, only for groups with rows. Group by group, in steps of ``rows_per_step`` rows (the
    last step of a group masks the rows past it), so the work is the routed rows plus at most
    one step per group and the memory is one group's weight and the output: unlike
    ``jax.lax.ragged_dot``, which XLA (CPU and GPU) expands into a dense product over every
    group ([M, E, K] operands, E times the work).
    """
    m = x.shape[0]
    if m == 0:
        return jnp.zeros((0, n), jnp.float32)
    step = min(rows_per_step, m)
    starts, ends = group_bounds(group_sizes, m)
    # A step starts below M, so its rows [r0, r0 + step) stay inside the padded arrays.
    xp = jnp.concatenate([x, jnp.zeros((step, x.shape[1]), x.dtype)])
    # The carry varies like the products written into it (inside shard_map).
    out = vary_like(jnp.zeros((m + step, n), jnp.float32), x, group_sizes, weights)

    def group(e, out):
        start, end = starts[e], ends[e]

        def run(out):  # an empty group reads no weight
            w = weight_of(jax.tree.map(lambda a: a[e], weights))

            def rows(i, out):
                r0 = start + i * step
                y = jnp.dot(jax.lax.dynamic_slice_in_dim(xp, r0, step), w, precision=precision,
                            preferred_element_type=jnp.float32)
                inside = (r0 + jnp.arange(step))[:, None] < end
                kept = jax.lax.dynamic_slice_in_dim(out, r0, step)
                return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(inside, y, kept), r0, 0)

            return jax.lax.fori_loop(0, (end - start + step - 1) // step, rows, out)

        return jax.lax.cond(end > start, run, lambda out: out, out)

    return jax.lax.fori_loop(0, group_sizes.shape[0], group, out)[:m]


def grouped_w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, group_sizes, *,
                        out_dtype=jnp.bfloat16):
    """x_fp8 float8_e4m3fn [M, K] (rows sorted by expert), x_scale float32 [M], w MXFP4 experts
    [E, N, Kp], group_sizes int32 [E] -> out_dtype [M, N]."""
    k = x_fp8.shape[-1]

    def weight_of(w_e):  # one expert's weight, dequantized when its rows come up
        return dequantize_mxfp4(w_e, jnp.float32, k=k, kernel_semantics=True).T

    acc = grouped_rows_product(x_fp8.astype(jnp.float32), group_sizes, w, weight_of,
                               w.shape[-2], precision=jax.lax.Precision.HIGHEST)
    # Rows past the last group are zeros whatever their scale (as the kernels write them).
    last_row = group_bounds(group_sizes, x_fp8.shape[0])[1][-1]
    covered = jnp.arange(x_fp8.shape[0])[:, None] < last_row
    return jnp.where(covered, acc * x_scale[:, None].astype(jnp.float32), 0.0).astype(out_dtype)
