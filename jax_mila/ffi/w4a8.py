"""W4A8 GEMMs: FP8 activations x MXFP4 weights on FP8 tensor cores, weights 4-bit in memory.

    y = w4a8_matmul(x_fp8, x_scale, w)          # x_fp8, x_scale = quantize_activations(x_bf16)
    y = grouped_w4a8_matmul(x_fp8, x_scale, w_experts, group_sizes)   # mixture of experts
    q, k, v = w4a8_matmul_many(x_fp8, x_scale, [w_q, w_k, w_v])       # one activation

``w4a8_matmul``: x_fp8 float8_e4m3fn [..., K], x_scale float32 [...] (one scale per row), w a
jax_mila.quant.MXFP4Weight [N, Kp]; returns [..., N] = (x_fp8 * x_scale) @ w[:, :K].T in
``out_dtype`` (bfloat16 or float32). Every leading dim of x is a row (M = their product).

``w4a8_matmul_many``: the products of one activation with several weights, the same results
as w4a8_matmul on each up to float32 summation order; in decode (the GEMV, 1-16 rows) up to
GEMV_MAX_WEIGHTS of them run in one launch.

``grouped_w4a8_matmul``: x_fp8 [M, K] with its rows sorted by expert, x_scale [M], w the experts'
MXFP4Weight [E, N, Kp], group_sizes int32 [E]: rows [offset_e, offset_e + group_sizes[e]) are
multiplied by expert e's weight (offset_e = the sum of the sizes before e). The sizes are read on
the device, so a new routing neither recompiles nor waits for the host. Negative sizes count as
0, groups end at row M and rows past the last group come back as zeros (jax_mila.reference.w4a8);
concrete sizes that do so raise ValueError instead.

Supported sizes: K % 32 == 0 (whole MXFP4 blocks) with Kp = K rounded up to a multiple of 128
(jax_mila.quant.padded_k: the weight stores zeros past K), N % 8 == 0, M < 2^31, E <= 1024;
others raise ValueError at trace time (the C++ handlers check again).

Kernels (``kernel=``): "auto" (default) runs "gemv" for dense calls of at most GEMV_MAX_ROWS
(16) rows; otherwise "wgmma_ws" on compute capability 9.0 when the build has sm_90a code, dense
calls of EXPAND_MIN_ROWS rows or more on "wgmma_ws_e4m3", "mma_sync" elsewhere;
``auto_kernel(m)`` says which. "gemv" (dense, 1-16 rows: decode): streams the MXFP4 codes and
exponents straight from memory, dequantizes them to fp16 in registers and multiplies on fp16
mma.sync with float32 accumulation, K split across CTAs where N is small (on Hopper across
the CTAs of a thread-block cluster; partials added in a fixed order: the same bits every
run). "wgmma_ws": warp-specialized FP8 wgmma, the weights
converted to e4m3 in registers, persistent (dense: 2-CTA clusters sharing each activation tile,
stream-K for the last wave; grouped: a tile list built on the device). "wgmma_ws_e4m3" (dense
only): the same on weights expanded to e4m3 [N, Kp] in the call's scratch first (N x Kp bytes
while the call runs; the weights stay 4-bit between calls). "mma_sync": m16n8k32 FP8 mma.sync
(native on sm_89; on Hopper ptxas lowers it to fp16 HMMA at half the FP8 rate). The wgmma
kernels sum every 256 of K in a fresh wgmma accumulator and add it into float32 registers
(Hopper's FP8 wgmma accumulates at ~14 bits), which leaves a relative error of ~1e-4 against
< 1e-5 for mma_sync's float32 accumulation (tests/test_w4a8.py). Kernels and measurements:
docs/design/w4a8.md, docs/performance.md.

Where it runs: the CUDA kernels need FP8 mma (compute capability >= 8.9; "gemv" needs only
sm_80's fp16 mma but runs where the others do until an sm_80 GPU has validated it). Elsewhere
(sm_80, CPU, kernel not built, JAX_MILA_DISABLE) the wrappers run the pure-JAX reference
(jax_mila.reference.w4a8), logged once. A wgmma kernel named explicitly raises ValueError at
trace time where it cannot run.

Numerics: every weight code becomes an exact e4m3 value (jax_mila/quant/mxfp4.py; "gemv": an
exact fp16 value, the activations too), products accumulate in float32, and the row and channel
scales (x_scale[m] * 2**(channel_exp[n] - 133), "gemv": - 127) are applied once in the
epilogue, so the kernels equal the float32 product of the dequantized operands up to float32
summation order (and the wgmma promotion above).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import build_info, cuda_capabilities, dispatch, status
from jax_mila.quant.mxfp4 import BLOCK, GROUP, MXFP4Weight

OP = "w4a8_matmul"
GROUPED_OP = "grouped_w4a8_matmul"
K_MULTIPLE = BLOCK  # activation K: whole MXFP4 blocks
N_MULTIPLE = 8  # 16-byte output rows per store group
MAX_EXPERTS = 1024
MAX_ROWS = 2**31 - 257  # TMA row coordinates are int32
MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 mma.sync
OUT_DTYPES = (jnp.bfloat16, jnp.float32)
KERNELS = {"auto": 0, "mma_sync": 1, "wgmma_ws": 2, "wgmma_ws_e4m3": 3,
           "gemv": 4}  # the handlers' `variant`
_WGMMA_KERNELS = ("wgmma_ws", "wgmma_ws_e4m3")
# The GEMV (csrc/w4a8/w4a8_kernel.h, kW4A8Gemv*): dense calls of at most this many rows, which
# "auto" sends to it. Its split-K plan, _gemv_plan, sizes the scratch.
GEMV_MAX_ROWS = 16
_GEMV_CTA_ROWS = 128
_GEMV_CTAS_PER_SM = 2
_GEMV_MAX_KC = {8: 47, 16: 23}  # groups of 128 of K a CTA's shared memory holds, by rows8
_GEMV_SPLIT_SEARCH = 64
_GEMV_CTA_OVERHEAD = 2
_GEMV_MAX_CLUSTER_SPLITS = 8  # kW4A8GemvMaxClusterSplits
GEMV_MAX_WEIGHTS = 3  # weights one w4a8_matmul_many launch takes (kW4A8GemvMaxWeights)
# Dense calls of this many rows or more run on expanded weights under "auto" on Hopper
# (csrc/w4a8/w4a8_kernel.h, kW4A8ExpandMinRows): the scratch then holds them.
EXPAND_MIN_ROWS = 4096
_EXPAND_ALIGN = 256
# wgmma_ws's stream-K scratch (csrc/w4a8/w4a8_kernel.h): 4096 bytes of flags, then one float32
# 128 x 256 partial tile per SM. A second result of the custom call, so that XLA plans it.
_SK_FLAG_BYTES = 4096
_SK_SLOT_BYTES = 128 * 256 * 4
_SK_DEFAULT_SMS = 132  # when the device does not say (an H100 or H200 has 132 SMs)
# Grouped calls' tile list: a 16-byte header and one 16-byte entry per M tile, at most
# ceil(M / rows) + E of them; 128 rows per tile is the smallest any kernel uses (mma_sync).
_GROUP_HEADER_BYTES = 16
_GROUP_TILE_ROWS_MIN = 128


def _wgmma_built() -> bool:
    """Whether the extension holds sm_90a code (the wgmma kernels); e.g. "80-real,89-real,90a"."""
    archs = build_info().get("cuda_archs", "")
    return any(a.strip().split("-")[0] == "90a" for a in archs.split(","))


def _hopper_process() -> bool:
    caps = cuda_capabilities()
    return bool(caps) and all(c == (9, 0) for c in caps)


def auto_kernel(m: int, *, grouped: bool = False) -> str:
    """The kernel that kernel="auto" runs in this process for m activation rows (with several
    GPU kinds the handler picks per device)."""
    if not grouped and m <= GEMV_MAX_ROWS:
        return "gemv"
    if not (_hopper_process() and _wgmma_built()):
        return "mma_sync"
    return "wgmma_ws_e4m3" if not grouped and m >= EXPAND_MIN_ROWS else "wgmma_ws"


def _check_kernel_runs(op: str, kernel: str, *, grouped: bool) -> None:
    """Fails when an explicitly named wgmma kernel cannot run in this process. (Without a GPU,
    or with the kernel not built, every call runs the reference and ``kernel`` is not used.)"""
    if kernel not in KERNELS:
        _checks.fail(op, "kernel", f"{kernel!r} is not one of {sorted(KERNELS)}")
    if grouped and kernel in ("wgmma_ws_e4m3", "gemv"):
        _checks.fail(op, "kernel", f"{kernel!r} takes dense calls only (supported here: "
                                   "'auto', 'wgmma_ws', 'mma_sync')")
    caps = cuda_capabilities()
    if kernel not in _WGMMA_KERNELS or not caps or not status(op).kernel:
        return
    if not _wgmma_built():
        _checks.fail(op, "kernel", f"{kernel!r} needs sm_90a code, and this build has "
                                   f"JAX_MILA_CUDA_ARCHS={build_info().get('cuda_archs', '')!r} "
                                   "(rebuild with 90a, or pass kernel='auto' or 'mma_sync')")
    if any(cc != (9, 0) for cc in caps):
        _checks.fail(op, "kernel", f"{kernel!r} runs on compute capability 9.0 only; this "
                                   f"process has GPUs of {sorted(set(caps))} (pass kernel='auto' "
                                   "or 'mma_sync')")


def _variant(kernel: str, m: int, *, grouped: bool = False) -> int:
    """The handlers' `variant` for `kernel` on m rows. "auto" names the GEMV itself for dense
    calls of up to GEMV_MAX_ROWS rows (so that the scratch is sized for its plan), and reaches
    the handler as "auto" only when the build has the sm_90a code: without it a 9.0 device
    would run a PTX-JIT kernel that traps."""
    if kernel == "auto" and not grouped and m <= GEMV_MAX_ROWS:
        return KERNELS["gemv"]
    if kernel == "auto" and not _wgmma_built():
        return KERNELS["mma_sync"]
    return KERNELS[kernel]


def _check_weight(op: str, x, w, rank: int) -> tuple[int, int]:
    if not isinstance(w, MXFP4Weight):
        _checks.fail(op, "w", f"expected a jax_mila.quant.MXFP4Weight, got {type(w).__name__}")
    try:
        w.validate("w", rank=rank)
    except ValueError as e:
        _checks.fail(op, "w", str(e))
    n, kp = w.shape[-2:]
    k = x.shape[-1]
    if n < 1 or n % N_MULTIPLE:
        _checks.fail(op, "w", f"N={n} is not supported: N must be a positive multiple of "
                              f"{N_MULTIPLE}")
    if k % K_MULTIPLE or not kp - GROUP < k <= kp:
        _checks.fail(op, "x_fp8", f"K={k} (last dim of {list(x.shape)}) does not fit the "
                                  f"weight's stored K={kp}: K must be a multiple of {K_MULTIPLE} "
                                  f"in ({kp - GROUP}, {kp}] (a weight quantized from [N, K])")
    return n, kp


def _validate(op, x, x_scale, out_dtype, kernel, *, grouped: bool) -> None:
    _check_kernel_runs(op, kernel, grouped=grouped)
    _checks.check_rank(op, "x_fp8", x, rank=2 if grouped else None, min_rank=1,
                       layout="([M, K])" if grouped else "([..., K])")
    _checks.check_dtype(op, "x_fp8", x, [jnp.float8_e4m3fn])
    _checks.check_dtype(op, "x_scale", x_scale, [jnp.float32])
    _checks.check_nonempty(op, "x_fp8", x)
    if tuple(x_scale.shape) != tuple(x.shape[:-1]):
        _checks.fail(op, "x_scale", f"shape {list(x_scale.shape)} must be x_fp8's leading shape "
                                    f"{list(x.shape[:-1])} (one scale per row)")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if rows > MAX_ROWS:
        _checks.fail(op, "x_fp8", f"{rows} rows are not supported (at most {MAX_ROWS})")
    if np.dtype(out_dtype) not in [np.dtype(d) for d in OUT_DTYPES]:
        _checks.fail(op, "out_dtype", f"{np.dtype(out_dtype).name} is not supported "
                                      "(supported: bfloat16, float32)")


def _sms() -> int:
    try:
        return max(int(getattr(d, "core_count", 0) or 0) for d in jax.devices("cuda"))
    except (RuntimeError, ValueError):
        return 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _gemv_clusters() -> bool:
    """Whether the GEMV splits K over thread-block clusters in this process (sm_90a code on
    9.0 GPUs only; csrc/w4a8/w4a8_gemv.cu, DeviceRunsClusters)."""
    return _hopper_process() and _wgmma_built()


def _gemv_tiles(n) -> int:
    """Tiles of 128 output columns of one weight (N = n) or of a launch's weights (a sequence)."""
    ns = (n,) if isinstance(n, (int, np.integer)) else tuple(n)
    return sum(_ceil_div(int(v), _GEMV_CTA_ROWS) for v in ns)


def _gemv_min_splits(kp: int, m: int) -> int:
    """The fewest splits of K whose CTAs' activations fit their shared memory."""
    return _ceil_div(kp // GROUP, _GEMV_MAX_KC[8 if m <= 8 else 16])


def _gemv_splits_in_clusters(kp: int, m: int, cluster: bool) -> bool:
    """Whether a process that runs cluster split-K (``cluster``) runs this call's splits as
    clusters: where the fewest fit in _GEMV_MAX_CLUSTER_SPLITS (W4A8GemvMakePlan)."""
    return cluster and _gemv_min_splits(kp, m) <= _GEMV_MAX_CLUSTER_SPLITS


def _gemv_plan(n, kp: int, m: int, sms: int, cluster: bool = False,
               cluster_slots=None) -> tuple[int, int, int, int]:
    """(tiles, splits, kc, rows8) of the GEMV of the weights of N = n (an int, or a sequence for
    one launch of several weights): the split rule of csrc/w4a8/w4a8_kernel.h
    (W4A8GemvMakePlan, which documents it), the same function. sms <= 0: the fewest splits;
    ``cluster``: the process runs cluster split-K (at most _GEMV_MAX_CLUSTER_SPLITS splits where
    the fewest fit in that many); ``cluster_slots[s]``: the CTAs clusters of s fit on the GPU at
    once (the handler asks the device; None counts every SM's slots, so the handler may take
    fewer splits than this returns where clusters fit fewer CTAs; either way clusters need no
    scratch)."""
    tiles = _gemv_tiles(n)
    rows8 = 8 if m <= 8 else 16
    groups = kp // GROUP
    s_min = _gemv_min_splits(kp, m)
    cluster = _gemv_splits_in_clusters(kp, m, cluster)
    s_cap = min(groups, _GEMV_MAX_CLUSTER_SPLITS) if cluster else groups
    s = s_min
    if sms > 0:
        slots = _GEMV_CTAS_PER_SM * sms

        def slots_of(c):
            return cluster_slots[c] if cluster and c > 1 and cluster_slots is not None else slots

        if tiles * s_min <= slots_of(s_min):
            s = min(slots // tiles, s_cap)
            while s > s_min and tiles * s > slots_of(s):
                s -= 1
            s = max(s, s_min)
        else:
            best = None
            for c in range(s_min, min(s_cap, s_min + _GEMV_SPLIT_SEARCH) + 1):
                kc = _ceil_div(groups, c)
                if _ceil_div(groups, kc) != c:
                    continue
                cost = _ceil_div(tiles * c, slots_of(c)) * (kc + _GEMV_CTA_OVERHEAD)
                if best is None or cost < best:
                    best, s = cost, c
    kc = _ceil_div(groups, s)
    return tiles, _ceil_div(groups, kc), kc, rows8


def _gemv_workspace_bytes(n, kp: int, m: int, sms: int, cluster: bool = False) -> int:
    """The GEMV's split-K scratch (W4A8GemvWorkspaceBytes): none unsplit or with clusters
    (``cluster`` and at most _GEMV_MAX_CLUSTER_SPLITS splits); else a 4-byte arrival counter per
    tile, 256-byte aligned, then one float32 [rows8, 128] partial per (tile, split)."""
    tiles, splits, _, rows8 = _gemv_plan(n, kp, m, sms, cluster)
    if splits <= 1 or _gemv_splits_in_clusters(kp, m, cluster):
        return 0
    return _ceil_div(4 * tiles, 256) * 256 + tiles * splits * rows8 * _GEMV_CTA_ROWS * 4


def _dense_workspace_bytes(variant: int, m: int, n: int, kp: int) -> int:
    """Scratch of a dense call: the GEMV's split-K partials for its plan on this process's GPUs
    (at least 16 bytes); one stream-K slot per SM for wgmma_ws, and the expanded e4m3 weights
    (N x Kp, 256-byte aligned) where wgmma_ws_e4m3 may run, else a token."""
    if variant == KERNELS["gemv"] or (variant == KERNELS["auto"] and m <= GEMV_MAX_ROWS):
        return max(16, _gemv_workspace_bytes(n, kp, m, _sms() or _SK_DEFAULT_SMS,
                                             _gemv_clusters()))
    if variant == KERNELS["mma_sync"]:
        return 16
    scratch = _SK_FLAG_BYTES + (_sms() or _SK_DEFAULT_SMS) * _SK_SLOT_BYTES
    expands = variant == KERNELS["wgmma_ws_e4m3"] or (
        variant == KERNELS["auto"] and m >= EXPAND_MIN_ROWS and (9, 0) in cuda_capabilities())
    return scratch + n * kp + _EXPAND_ALIGN if expands else scratch


def _grouped_workspace_bytes(m: int, experts: int) -> int:
    tiles = -(-m // _GROUP_TILE_ROWS_MIN) + experts
    return _GROUP_HEADER_BYTES + 16 * tiles


def _kernel(out_dtype, variant, x2, s1, packed, scales, channel_exp):
    (m, _), (n, kp2) = x2.shape, packed.shape
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    workspace = jax.ShapeDtypeStruct((_dense_workspace_bytes(variant, m, n, 2 * kp2),), jnp.uint8)
    call = jax.ffi.ffi_call("jax_mila_w4a8_matmul", (out, workspace), vmap_method="sequential")
    return call(x2, s1, packed, scales, channel_exp, variant=np.int64(variant))[0]


def _reference(out_dtype, x2, s1, packed, scales, channel_exp):
    return reference.w4a8_matmul(x2, s1, MXFP4Weight(packed, scales, channel_exp),
                                 out_dtype=out_dtype)


def _device_ok(cc) -> bool:
    return cc >= MIN_COMPUTE_CAPABILITY


_REQUIREMENT = "the W4A8 kernels need FP8 mma (compute capability >= 8.9)"


def w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, *, out_dtype=jnp.bfloat16, kernel: str = "auto"):
    """(x_fp8 * x_scale[..., None]) @ dequantize(w)[:, :K].T on FP8 tensor cores -> out_dtype
    [..., N]. See the module docstring for sizes, devices, ``kernel`` and numerics."""
    _validate(OP, x_fp8, x_scale, out_dtype, kernel, grouped=False)
    n, _ = _check_weight(OP, x_fp8, w, rank=2)
    lead = x_fp8.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64))
    if kernel == "gemv" and m > GEMV_MAX_ROWS:
        _checks.fail(OP, "kernel", f"'gemv' takes 1 to {GEMV_MAX_ROWS} rows, x_fp8 has {m} "
                                   f"(shape {list(x_fp8.shape)}); pass kernel='auto'")
    kernel_fn = functools.partial(_kernel, out_dtype, _variant(kernel, m))
    ref = functools.partial(_reference, out_dtype)
    args = (x_fp8.reshape(m, x_fp8.shape[-1]), x_scale.reshape(m), w.packed, w.scales,
            w.channel_exp)
    y = dispatch(OP, kernel_fn, ref, *args, device_ok=_device_ok, device_requirement=_REQUIREMENT)
    return y.reshape(*lead, n)


def _gemv_kernel(out_dtype, x2, s1, *arrays):
    m, kp = x2.shape[0], 2 * arrays[0].shape[1]
    ns = [arrays[i].shape[0] for i in range(0, len(arrays), 3)]
    outs = tuple(jax.ShapeDtypeStruct((m, n), out_dtype) for n in ns)
    workspace = jax.ShapeDtypeStruct(
        (max(16, _gemv_workspace_bytes(ns, kp, m, _sms() or _SK_DEFAULT_SMS, _gemv_clusters())),),
        jnp.uint8)
    call = jax.ffi.ffi_call("jax_mila_w4a8_gemv", outs + (workspace,), vmap_method="sequential")
    return tuple(call(x2, s1, *arrays)[:-1])


def _gemv_reference(out_dtype, x2, s1, *arrays):
    return tuple(reference.w4a8_matmul(x2, s1, MXFP4Weight(*arrays[i:i + 3]), out_dtype=out_dtype)
                 for i in range(0, len(arrays), 3))


def w4a8_matmul_many(x_fp8, x_scale, weights, *, out_dtype=jnp.bfloat16, kernel: str = "auto"):
    """``tuple(w4a8_matmul(x_fp8, x_scale, w, out_dtype=out_dtype, kernel=kernel) for w in
    weights)``: the projections of one activation (attention's q, k and v; the MLP's gate and
    up). Where the GEMV runs (``kernel`` "auto" or "gemv", at most GEMV_MAX_ROWS rows), up to
    GEMV_MAX_WEIGHTS weights share one launch: their tiles of output columns
    form one list and one split of K, which fills the GPU where each alone would not and saves
    the launches. Each result equals its separate call up to float32 summation order (the split
    of K follows the launch's list); repeated calls give the same bits."""
    weights = tuple(weights)
    if not weights or not all(isinstance(w, MXFP4Weight) for w in weights):
        _checks.fail(OP, "weights", f"expected a non-empty sequence of MXFP4Weight, got "
                                    f"{[type(w).__name__ for w in weights]}")
    _validate(OP, x_fp8, x_scale, out_dtype, kernel, grouped=False)
    ns = [_check_weight(OP, x_fp8, w, rank=2)[0] for w in weights]
    lead = x_fp8.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64))
    one_launch = kernel in ("auto", "gemv") and m <= GEMV_MAX_ROWS
    if not one_launch or len(weights) == 1:
        return tuple(w4a8_matmul(x_fp8, x_scale, w, out_dtype=out_dtype, kernel=kernel)
                     for w in weights)
    # Launches of up to GEMV_MAX_WEIGHTS weights, in order (every weight fits x's K, so all
    # have one stored K).
    launches = [range(i, min(i + GEMV_MAX_WEIGHTS, len(weights)))
                for i in range(0, len(weights), GEMV_MAX_WEIGHTS)]
    x2, s1 = x_fp8.reshape(m, x_fp8.shape[-1]), x_scale.reshape(m)
    results = [None] * len(weights)
    for launch in launches:
        arrays = [a for i in launch for a in (weights[i].packed, weights[i].scales,
                                              weights[i].channel_exp)]
        ys = dispatch(OP, functools.partial(_gemv_kernel, out_dtype),
                      functools.partial(_gemv_reference, out_dtype), x2, s1, *arrays,
                      device_ok=_device_ok, device_requirement=_REQUIREMENT)
        for i, y in zip(launch, ys):
            results[i] = y.reshape(*lead, ns[i])
    return tuple(results)


def _grouped_kernel(out_dtype, variant, x, s, packed, scales, channel_exp, group_sizes):
    (m, _), (experts, n, _) = x.shape, packed.shape
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    workspace = jax.ShapeDtypeStruct((_grouped_workspace_bytes(m, experts),), jnp.uint8)
    call = jax.ffi.ffi_call("jax_mila_grouped_w4a8_matmul", (out, workspace),
                            vmap_method="sequential")
    return call(x, s, packed, scales, channel_exp, group_sizes, variant=np.int64(variant))[0]


def _grouped_reference(out_dtype, x, s, packed, scales, channel_exp, group_sizes):
    return reference.grouped_w4a8_matmul(x, s, MXFP4Weight(packed, scales, channel_exp),
                                         group_sizes, out_dtype=out_dtype)


def _check_group_sizes(group_sizes, experts: int, rows: int) -> None:
    _checks.check_dtype(GROUPED_OP, "group_sizes", group_sizes, [jnp.int32])
    if tuple(group_sizes.shape) != (experts,):
        _checks.fail(GROUPED_OP, "group_sizes", f"shape {list(group_sizes.shape)} must be "
                                                f"[E] = [{experts}] (one size per expert of w)")
    if isinstance(group_sizes, jax.core.Tracer):
        return  # read on the device (the module docstring says how)
    sizes = np.asarray(group_sizes).astype(np.int64)
    if (sizes < 0).any():
        _checks.fail(GROUPED_OP, "group_sizes", f"negative sizes {sorted(set(sizes[sizes < 0]))}"
                                                " (supported: sizes >= 0)")
    if sizes.sum() > rows:
        _checks.fail(GROUPED_OP, "group_sizes", f"the sizes add up to {int(sizes.sum())} rows, "
                                                f"more than x_fp8's M={rows}")


def grouped_w4a8_matmul(x_fp8, x_scale, w: MXFP4Weight, group_sizes, *,
                        out_dtype=jnp.bfloat16, kernel: str = "auto"):
    """Row r of x_fp8 [M, K] (sorted by expert) times its expert's weight of w [E, N, Kp] ->
    out_dtype [M, N]. See the module docstring for the groups, sizes, ``kernel`` and numerics."""
    _validate(GROUPED_OP, x_fp8, x_scale, out_dtype, kernel, grouped=True)
    _check_weight(GROUPED_OP, x_fp8, w, rank=3)
    experts = w.shape[0]
    if experts > MAX_EXPERTS:
        _checks.fail(GROUPED_OP, "w", f"E={experts} experts are not supported (at most "
                                      f"{MAX_EXPERTS})")
    _check_group_sizes(group_sizes, experts, x_fp8.shape[0])
    kernel_fn = functools.partial(_grouped_kernel, out_dtype,
                                  _variant(kernel, x_fp8.shape[0], grouped=True))
    ref = functools.partial(_grouped_reference, out_dtype)
    return dispatch(GROUPED_OP, kernel_fn, ref, x_fp8, x_scale, w.packed, w.scales,
                    w.channel_exp, group_sizes, device_ok=_device_ok,
                    device_requirement=_REQUIREMENT)
