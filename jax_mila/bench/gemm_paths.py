"""What the GEMM benchmarks (benchmarks/gemm.py, benchmarks/gemm_kernels.py) time: Gemma 4 12B's
linear-layer shapes, and XLA's FP8 paths that the W4A8 kernel is held against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Gemma 4 12B: name -> (N, K) of y[M, N] = x[M, K] @ W[N, K]^T. No spaces in the names: they
# are passed through --only and through scripts/gpu_round.sh's space-separated entries.
SHAPES = {
    "qkv": (8192, 3840),
    "q+k_global": (8704, 3840),
    "o_proj_sliding": (3840, 4096),
    "o_proj_global": (3840, 8192),
    "gate+up": (30720, 3840),
    "down": (3840, 15360),
    # The projections as jax_mila.gemma4 runs them (one call each; the fused names above are
    # the shapes): sliding layers' q and k / v, both layers' gate / up, global k.
    "q_sliding": (4096, 3840),
    "kv_sliding": (2048, 3840),
    "gate": (15360, 3840),
    "q_global": (8192, 3840),
    "k_global": (512, 3840),
}
# XLA's FP8 dot (jax 0.11.2, H200) never returned for these N at M=16384 (three runs, each cut
# by a 200-300 s timeout): not timed, so the rest of the table still comes out.
XLA_FP8_HANGS_N = {30720}


def fp8_rows(w):
    """Per-row float8_e4m3fn quantization of w [N, K] (for the XLA / cuBLASLt FP8 paths)."""
    amax = jnp.maximum(jnp.max(jnp.abs(w), axis=1), 1e-30)
    scale = amax / 448.0
    return (w / scale[:, None]).astype(jnp.float8_e4m3fn), scale.astype(jnp.float32)


def xla_fp8_scaled(precision=None, out_dtype=jnp.bfloat16):
    """XLA's FP8 dot with the row and column scales applied in XLA, jitted. precision None is
    jnp's default, under which XLA:GPU lets cuBLASLt accumulate FP8 products in its fast,
    reduced-precision mode (stream_executor's cuda_blas_lt: FP8 operands and DEFAULT precision);
    DotAlgorithmPreset.ANY_F8_ANY_F8_F32 asks for float32 accumulation, the class of the W4A8
    kernel's promoted sums and of torch._scaled_mm's default."""

    @jax.jit
    def fn(xq, xs, w8, ws):
        acc = jax.lax.dot_general(xq, w8, (((1,), (1,)), ((), ())), precision=precision,
                                  preferred_element_type=jnp.float32)
        return (acc * xs[:, None] * ws[None, :]).astype(out_dtype)

    return fn


XLA_FP8_PRECISION = {"xla_fp8_scaled": None,
                     "xla_fp8_f32acc": jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32}
