"""w4a8_matmul: FP8 activations x MXFP4 weights on FP8 tensor cores, weights 4-bit in memory.

    y = w4a8_matmul(x_fp8, x_scale, w)          # x_fp8, x_scale = quantize_activations(x_bf16)

x_fp8 float8_e4m3fn [..., K], x_scale float32 [...] (one scale per row), w an
jax_mila.quant.MXFP4Weight of shape [N, K]; returns [..., N] = (x_fp8 * x_scale) @ w.T in
``out_dtype`` (bfloat16 or float32). Every leading dim of x is a row (M = their product,
any size >= 1).

Supported sizes: K % 128 == 0 (Gemma 4's K: 2816, 3840, 4096, 5376, 8192, 15360, 21504),
N % 8 == 0; others raise ValueError at trace time (the C++ handler checks again).

Kernels (``kernel=``): "mma_sync" (m16n8k32 FP8 mma.sync: native on sm_89 / sm_120; on Hopper
ptxas lowers FP8 mma.sync to fp16 HMMA, about half the FP8 rate) and "wgmma" (sm_90a only:
wgmma.m64n128k32 FP8 with the converted weights as the register operand) and "wgmma_ws" (sm_90a
only: the same math, warp-specialized: a TMA producer warpgroup with an mbarrier ring, two
consumer warpgroups, persistent tile scheduling, and stream-K for the tiles of the last partial
wave: their K range is split over all SMs and the pieces' float32 partial sums are added, in a
fixed order, by the piece that holds k = 0; the scratch for them is a second result of the custom
call, one 128 KiB slot per SM; csrc/w4a8/w4a8_sm90_ws.cu). "wgmma_ws_dp" is wgmma_ws on whole
tiles only (its schedule before stream-K, kept for comparison). "wgmma_ws_cluster" is wgmma_ws
on clusters of two CTAs that compute adjacent weight tiles of one activation tile and share it
through TMA multicast (each CTA reads 24 KiB per K tile from L2 instead of 40: at the board's
power limit that is energy saved; docs/performance.md, sixteenth and seventeenth rounds).
"wgmma_ws_e4m3" and "wgmma_ws_e4m3_cluster" are those two on weights expanded to e4m3 first: a
small kernel writes the call's weights as e4m3 [N, K] (the same bytes the others convert each
weight word into) into the scratch, and the GEMM takes them through TMA as its shared-memory
wgmma operand, with no conversion in its loop. Each weight is then converted once per call
instead of once per 256 activation rows, for 1.5 bytes of extra memory traffic per weight and
N x K bytes of scratch while the call runs (118 MB for the 12B's gate+up); the weights stay
4-bit between calls. "auto" (default) runs wgmma_ws_cluster on compute capability 9.0 when this
build has sm_90a code (JAX_MILA_CUDA_ARCHS includes 90a, the default), wgmma_ws_e4m3_cluster
there from EXPAND_MIN_ROWS (4096) rows up, mma_sync otherwise; JAX_MILA_W4A8_CLUSTER=1 (read
once per process) makes them wgmma_ws and wgmma_ws_e4m3; ``auto_kernel(m)`` says which one for
this process. Module attributes, read at trace time: AUTO_WGMMA_ON_SM90 = False turns the wgmma
choice off; EXPAND_MIN_ROWS = None never expands (no N x K scratch; GEMMs 5-12% slower at
M = 16384). Hopper's FP8 wgmma accumulates at reduced precision (~14 bits, truncated); both wgmma
kernels therefore sum every K chunk (128 long in wgmma, 256 in wgmma_ws) in a fresh accumulator
and add it into float32 registers (DeepGEMM-style promotion), so the error no longer grows with
K: relative Frobenius error ~1e-4 at any K (unpromoted it was 1.6e-3 at K=15360), against
< 1e-5 for mma_sync's float32 accumulation. The FP8 product rounding inside one wgmma cannot be promoted away.

Where it runs: the CUDA kernel needs FP8 mma (compute capability >= 8.9). On sm_80 GPUs the
wrapper routes to the pure-JAX reference (jax_mila.reference.w4a8_matmul), as it does on CPU,
when the kernel is not built, or with JAX_MILA_DISABLE=w4a8_matmul. (The handler itself returns
an Unimplemented error below sm_89, so a mis-routed call fails loudly rather than silently.)
A wgmma kernel named explicitly raises ValueError at trace time where it cannot run (a build
without sm_90a code, a GPU other than 9.0); the handler refuses it too, and refuses mma_sync
when the device would run it from PTX older than compute_89 (both would be empty kernels).

Numerics: every weight code becomes an exact e4m3 value (see jax_mila/quant/mxfp4.py), products
accumulate in float32 (mma_sync; wgmma: see above), and x_scale[m] * 2**(channel_exp[n] - 133)
is applied once in the epilogue, so the kernel equals the float32 product of the dequantized
operands up to float32 summation order. Measured on the reference path (CPU) at K=15360 against
a float64 product: relative Frobenius error 5.6e-8 with out_dtype=float32 and 1.7e-3 with
bfloat16 (the bf16 rounding of the output alone is 1.7e-3). The MXFP4 weight quantization itself
costs ~12% relative error against unquantized Gaussian weights (e2m1 has one mantissa bit).

Status (H200, 2026-12-01): every kernel passes tests/test_w4a8.py's GPU class (odd M,
poisoned outputs, exponent-floor exactness, stream-K splits; K=15360 relative error 6.0e-8 for
mma_sync, 5.6e-5 for wgmma, under 4e-4 for wgmma_ws, float32 out); at M=16384 wgmma_ws runs
1,160-1,349 TFLOP/s on the 12B's qkv, down and gate+up (wgmma: 837-912; docs/performance.md),
and wgmma_ws_cluster -0.3% to +9.5% more per shape at M=16384 and 1.7-1.9% less GEMM time end
to end, hence "auto". 2026-12-02: the e4m3 variants equal wgmma_ws / wgmma_ws_cluster bit for bit
where no tile is split along K, and "auto" (wgmma_ws_e4m3_cluster) runs 1,148-1,230 TFLOP/s on
the six 12B shapes at M=16384 (0.93-0.96x cuBLASLt; the converting kernel 0.82-0.91x),
docs/performance.md, twenty-eighth round. JAX_MILA_DISABLE=w4a8_matmul routes to the reference.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import build_info, cuda_capabilities, dispatch, status
from jax_mila.quant.mxfp4 import MXFP4Weight

OP = "w4a8_matmul"
K_MULTIPLE = 128  # the kernel's K tile
N_MULTIPLE = 8  # 16-byte output rows per store group
MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 mma.sync
OUT_DTYPES = (jnp.bfloat16, jnp.float32)
KERNELS = {"auto": 0, "mma_sync": 1, "wgmma": 2, "wgmma_ws": 3,  # the handler's `variant`
           "wgmma_ws_dp": 4, "wgmma_ws_cluster": 5, "wgmma_ws_e4m3": 6,
           "wgmma_ws_e4m3_cluster": 7}
# Variants that expand the weights into the scratch; 256: the expanded weights' alignment.
_EXPAND_KERNELS = ("wgmma_ws_e4m3", "wgmma_ws_e4m3_cluster")
_EXPAND_ALIGN = 256
# "auto" with room for the expanded weights (the handler's kAutoExpanded): what "auto" sends from
# EXPAND_MIN_ROWS activation rows up when a GPU is compute capability 9.0; the handler runs the
# e4m3 variant there (mma_sync on other GPUs). Measured on the H200 (docs/performance.md,
# twenty-eighth round): expanding wins on every 12B shape at M = 4096 (+3% to +9%) and loses on
# most at 2048. A larger value (or None: never) keeps the scratch at the stream-K slots, for
# callers short of memory; read at trace time.
_AUTO_EXPANDED = 8
EXPAND_MIN_ROWS: int | None = 4096
# wgmma_ws's stream-K scratch (csrc/w4a8/w4a8_kernel.h): 4096 bytes of flags, then one float32
# 128 x 256 partial tile per SM. A second result of the custom call, so that XLA plans it.
_SK_FLAG_BYTES = 4096
_SK_SLOT_BYTES = 128 * 256 * 4
_SK_DEFAULT_SMS = 132  # when the device does not say (an H200 has 132 SMs)
# Whether "auto" may run the wgmma kernel on compute capability 9.0 (False: mma_sync everywhere;
# no rebuild needed, the handler only sees "auto" when this is True).
AUTO_WGMMA_ON_SM90 = True


def _wgmma_built() -> bool:
    """Whether the extension holds sm_90a code (the wgmma kernel); e.g. "80-real,89-real,90a"."""
    archs = build_info().get("cuda_archs", "")
    return any(a.strip().split("-")[0] == "90a" for a in archs.split(","))


def _expands(m: int) -> bool:
    """Whether "auto" expands the weights for m activation rows (EXPAND_MIN_ROWS)."""
    return EXPAND_MIN_ROWS is not None and m >= EXPAND_MIN_ROWS


def _hopper_auto_kernel(m: int) -> str:
    """What the handler runs for "auto" on a 9.0 device for m activation rows (csrc/w4a8/w4a8.cu,
    ResolveW4A8Variant; it reads the same variable once per process)."""
    single = os.environ.get("JAX_MILA_W4A8_CLUSTER") == "1"
    if _expands(m):
        return "wgmma_ws_e4m3" if single else "wgmma_ws_e4m3_cluster"
    return "wgmma_ws" if single else "wgmma_ws_cluster"


def auto_kernel(m: int = 1) -> str:
    """The kernel that kernel="auto" runs in this process for m activation rows:
    "wgmma_ws_cluster" ("wgmma_ws" with JAX_MILA_W4A8_CLUSTER=1), or from EXPAND_MIN_ROWS rows
    up "wgmma_ws_e4m3_cluster" ("wgmma_ws_e4m3"), when every GPU is compute capability 9.0 and
    the build has sm_90a code, "mma_sync" otherwise (with several GPU kinds the handler picks
    per device)."""
    caps = cuda_capabilities()
    hopper = bool(caps) and all(c == (9, 0) for c in caps)
    if AUTO_WGMMA_ON_SM90 and hopper and _wgmma_built():
        return _hopper_auto_kernel(m)
    return "mma_sync"


# Kernels that run only sm_90a code on compute capability 9.0 (the handler refuses them
# elsewhere; a build without 90a holds no code that runs them).
_WGMMA_KERNELS = ("wgmma", "wgmma_ws", "wgmma_ws_dp", "wgmma_ws_cluster") + _EXPAND_KERNELS


def _check_kernel_runs(kernel: str) -> None:
    """Fails when an explicitly named wgmma kernel cannot run in this process: the build lacks
    sm_90a code or a GPU is not compute capability 9.0. (Without a GPU, or with the kernel not
    built, every call runs the reference and ``kernel`` is not used.)"""
    caps = cuda_capabilities()
    if kernel not in _WGMMA_KERNELS or not caps or not status(OP).kernel:
        return
    if not _wgmma_built():
        _checks.fail(OP, "kernel", f"{kernel!r} needs sm_90a code, and this build has "
                                   f"JAX_MILA_CUDA_ARCHS={build_info().get('cuda_archs', '')!r} "
                                   "(rebuild with 90a, or pass kernel='auto' or 'mma_sync')")
    if any(cc != (9, 0) for cc in caps):
        _checks.fail(OP, "kernel", f"{kernel!r} runs on compute capability 9.0 only; this "
                                   f"process has GPUs of {sorted(set(caps))} (pass kernel='auto' "
                                   "or 'mma_sync')")


def _variant(kernel: str, m: int = 1) -> int:
    # "auto" reaches the handler as "auto" (it picks wgmma_ws_cluster on a 9.0 device) only when
    # the build has the sm_90a wgmma code: without it a 9.0 device would run a PTX-JIT kernel
    # that traps. From EXPAND_MIN_ROWS rows up, with a 9.0 GPU in the process, it goes as "auto
    # with room for the expanded weights" (the scratch is sized for them).
    if kernel != "auto":
        return KERNELS[kernel]
    if not (AUTO_WGMMA_ON_SM90 and _wgmma_built()):
        return KERNELS["mma_sync"]
    return _AUTO_EXPANDED if _expands(m) and (9, 0) in cuda_capabilities() else KERNELS["auto"]


def _validate(x, x_scale, w, out_dtype, kernel) -> None:
    if kernel not in KERNELS:
        _checks.fail(OP, "kernel", f"{kernel!r} is not one of {sorted(KERNELS)}")
    if not isinstance(w, MXFP4Weight):
        _checks.fail(OP, "w", f"expected a jax_mila.quant.MXFP4Weight, got {type(w).__name__}")
    try:
        w.validate("w")
    except ValueError as e:
        _checks.fail(OP, "w", str(e))
    _checks.check_rank(OP, "x_fp8", x, min_rank=1, layout="([..., K])")
    _checks.check_dtype(OP, "x_fp8", x, [jnp.float8_e4m3fn])
    _checks.check_dtype(OP, "x_scale", x_scale, [jnp.float32])
    _checks.check_nonempty(OP, "x_fp8", x)
    n, k = w.shape
    if n < 1:
        _checks.fail(OP, "w", f"N={n} output channels: empty weights are not supported")
    if x.shape[-1] != k:
        _checks.fail(OP, "x_fp8", f"K={x.shape[-1]} (last dim of {list(x.shape)}) must equal the "
                                  f"weight's K={k}")
    if tuple(x_scale.shape) != tuple(x.shape[:-1]):
        _checks.fail(OP, "x_scale", f"shape {list(x_scale.shape)} must be x_fp8's leading shape "
                                    f"{list(x.shape[:-1])} (one scale per row)")
    if k % K_MULTIPLE:
        _checks.fail(OP, "w", f"K={k} is not supported: K must be a multiple of {K_MULTIPLE} "
                              "(Gemma 4: 2816, 3840, 4096, 5376, 8192, 15360, 21504)")
    if n % N_MULTIPLE:
        _checks.fail(OP, "w", f"N={n} is not supported: N must be a multiple of {N_MULTIPLE}")
    if np.dtype(out_dtype) not in [np.dtype(d) for d in OUT_DTYPES]:
        _checks.fail(OP, "out_dtype", f"{np.dtype(out_dtype).name} is not supported "
                                      "(supported: bfloat16, float32)")
    _check_kernel_runs(kernel)


def _workspace_bytes(variant: int, n: int = 0, k: int = 0) -> int:
    """Scratch for the handler: one stream-K slot per SM where wgmma_ws may run, then the
    expanded e4m3 weights (N x K, 256-byte aligned) where an e4m3 variant may run, else a
    token."""
    expanding = [KERNELS[name] for name in _EXPAND_KERNELS] + [_AUTO_EXPANDED]
    stream_k = [KERNELS["auto"], KERNELS["wgmma_ws"], KERNELS["wgmma_ws_cluster"]] + expanding
    if variant not in stream_k:
        return 16
    try:
        sms = max(int(getattr(d, "core_count", 0) or 0) for d in jax.devices("cuda"))
    except RuntimeError:
        sms = 0
    scratch = _SK_FLAG_BYTES + (sms or _SK_DEFAULT_SMS) * _SK_SLOT_BYTES
    return scratch + n * k + _EXPAND_ALIGN if variant in expanding else scratch


def _kernel(out_dtype, variant, x2, s1, packed, scales, channel_exp):
    (m, k), n = x2.shape, packed.shape[0]
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    workspace = jax.ShapeDtypeStruct((_workspace_bytes(variant, n, k),), jnp.uint8)
    call = jax.ffi.ffi_call("jax_mila_w4a8_matmul", (out, workspace), vmap_method="sequential")
    return call(x2, s1, packed, scales, channel_exp, variant=np.int64(variant))[0]


def _reference(out_dtype, x2, s1, packed, scales, channel_exp):
    return reference.w4a8_matmul(x2, s1, MXFP4Weight(packed, scales, channel_exp),
                                 out_dtype=out_dtype)


def w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, *, out_dtype=jnp.bfloat16, kernel: str = "auto"):
    """(x_fp8 * x_scale[..., None]) @ dequantize(w).T on FP8 tensor cores -> out_dtype [..., N].

    See the module docstring for sizes, devices, ``kernel`` and numerics.
    """
    _validate(x_fp8, x_scale, w, out_dtype, kernel)
    lead = x_fp8.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64))
    x2 = x_fp8.reshape(m, x_fp8.shape[-1])
    s1 = x_scale.reshape(m)
    kernel_fn = functools.partial(_kernel, out_dtype, _variant(kernel, m))
    ref = functools.partial(_reference, out_dtype)
    args = (x2, s1, w.packed, w.scales, w.channel_exp)
    y = dispatch(OP, kernel_fn, ref, *args,
                 device_ok=lambda cc: cc >= MIN_COMPUTE_CAPABILITY,
                 device_requirement="the W4A8 kernel needs FP8 mma (compute capability >= 8.9)")
    return y.reshape(*lead, w.shape[0])
