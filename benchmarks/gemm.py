"""W4A8 GEMM throughput (TFLOP/s = 2*M*N*K / time) on Gemma 4 12B's linear-layer shapes, side
by side in one run with XLA's bf16 jnp.dot, XLA's FP8 dot with the same row/column scaling done
in XLA, and torch._scaled_mm (cuBLASLt FP8, row-wise scales) when torch is importable.

Every path gets pre-quantized operands (the activation quantizer is not timed). Times are medians
of trials of `--calls` back-to-back calls after warm-up. Table last; JSON to $OUT/gemm.json.

    python benchmarks/gemm.py [--m 16384,1024] [--only qkv,down] [--kernels auto,mma_sync]
                              [--shapes 8192x8192,8192x15360]

Each number comes with the median SM clock and board power while it was timed (nvidia-smi,
sampled in the background): at the power limit the clock moves by several percent between
runs, so a ratio of two columns is only meaningful beside their clocks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _bench import GpuSampler, markdown_table, write_json  # noqa: E402

from jax_mila import ffi, quant  # noqa: E402

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
# Measured anchors at M=16384 (specs/anchors.md), for the table.
XLA_FP8_SCALED_ANCHOR = {"qkv": 697, "q+k_global": 740}
# XLA's FP8 dot (jax 0.11.2, H200) never returned for these N at M=16384 (three runs, each cut
# by a 200-300 s timeout): not timed, so the rest of the table still comes out.
XLA_FP8_HANGS_N = {30720}


# The timing functions append (start, end) of their timed trials (time.monotonic) to `window`,
# so that the clock beside a number is read while it ran, not while it compiled.
def _time_jax(fn, args, calls, window, trials=7, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    window.append(time.monotonic())
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    window.append(time.monotonic())
    return statistics.median(times)


def _time_torch(fn, calls, window, trials=7, warmup=2):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    window.append(time.monotonic())
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    window.append(time.monotonic())
    return statistics.median(times)


def _torch_scaled_mm(xq, xs, w8, ws):
    """torch._scaled_mm with row-wise scales on the same FP8 operands, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or jax.devices()[0].platform != "gpu":
        return None
    # FP8 crosses DLPack as bytes (not every DLPack version knows float8).
    fp8 = lambda a: torch.from_dlpack(  # noqa: E731
        jax.lax.bitcast_convert_type(a, jnp.uint8)).view(torch.float8_e4m3fn)
    a = fp8(xq)                                  # [M, K] e4m3 row-major
    b = fp8(w8).t()                              # [K, N] column-major
    sa = torch.from_dlpack(xs).reshape(-1, 1).contiguous()
    sb = torch.from_dlpack(ws).reshape(1, -1).contiguous()
    return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _fp8_rows(w):
    """Per-row float8_e4m3fn quantization of w [N, K] (for the XLA / cuBLASLt FP8 paths)."""
    amax = jnp.maximum(jnp.max(jnp.abs(w), axis=1), 1e-30)
    scale = amax / 448.0
    return (w / scale[:, None]).astype(jnp.float8_e4m3fn), scale.astype(jnp.float32)


@jax.jit
def _xla_fp8_scaled(xq, xs, w8, ws):
    acc = jax.lax.dot_general(xq, w8, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (acc * xs[:, None] * ws[None, :]).astype(jnp.bfloat16)


@jax.jit
def _xla_bf16(x, wt):
    return jnp.dot(x, wt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="16384,1024")
    parser.add_argument("--only", default=",".join(SHAPES))
    parser.add_argument("--kernels", default="auto,mma_sync")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--anchors", default="xla_bf16,xla_fp8_scaled,torch_scaled_mm",
                        help="baselines to time beside the kernels (comma-separated; '' for none)")
    parser.add_argument("--shapes", default="",
                        help="extra NxK shapes (comma-separated, e.g. 8192x15360: how time grows "
                             "with K at a fixed tile grid)")
    args = parser.parse_args()
    for spec in (v for v in args.shapes.split(",") if v):
        n, k = (int(d) for d in spec.lower().split("x"))
        SHAPES[f"{n}x{k}"] = (n, k)
    sampler = GpuSampler()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; {ffi.status('w4a8_matmul')}", flush=True)
    kernels = [k for k in args.kernels.split(",") if k]
    anchors = set(a for a in args.anchors.split(",") if a)
    names = [n for n in args.only.split(",") if n] + [v.lower() for v in args.shapes.split(",") if v]
    header = (["GEMM", "N x K", "M"] + [f"jax_mila w4a8 ({k})" for k in kernels]
              + ["XLA bf16", "XLA FP8 + row/col scales", "torch._scaled_mm FP8 rowwise",
                 "w4a8 / XLA FP8", "weight bits/value", "SM MHz (w4a8 / XLA FP8 / cuBLASLt)"])
    rows, records = [], []
    for m in (int(v) for v in args.m.split(",")):
        for name in names:
            n, k = SHAPES[name]
            kx, kw = jax.random.split(jax.random.key(m + n + k))
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
            xq, xs = jax.block_until_ready(ffi.quantize_activations(x))
            wq = quant.quantize_mxfp4(w, name=name)
            w8, ws = _fp8_rows(w)
            wt16 = w.T.astype(jnp.bfloat16)
            flops = 2.0 * m * n * k
            rec = {"gemm": name, "N": n, "K": k, "M": m,
                   "weight_bits_per_value": 8 * wq.nbytes / (n * k)}

            def measure(key, label, time_fn):
                # Printed as it lands, so an anchor that hangs still leaves the numbers before it.
                print(f"  {name} M={m} {label} ...", end="", file=sys.stderr, flush=True)
                window = []
                try:
                    rec[key] = flops / time_fn(window) / 1e12
                except Exception as e:  # noqa: BLE001 - an anchor failing must not stop the table
                    rec[key] = None
                    print(f" failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    return
                rec[f"{key}_mhz"], rec[f"{key}_watts"] = sampler.window(*window)
                clock = "" if rec[f"{key}_mhz"] is None else (
                    f" at {rec[f'{key}_mhz']:.0f} MHz, {rec[f'{key}_watts']:.0f} W")
                print(f" {rec[key]:.0f} TFLOP/s{clock}", file=sys.stderr, flush=True)

            for kern in kernels:
                fn = jax.jit(lambda a, b, c, kern=kern: ffi.w4a8_matmul(a, b, c, kernel=kern))
                measure(f"w4a8_{kern}", f"w4a8 {kern}",
                        lambda w, fn=fn: _time_jax(fn, (xq, xs, wq), args.calls, w))
            rec.update(xla_bf16=None, xla_fp8_scaled=None, torch_scaled_mm=None)
            if "xla_bf16" in anchors:
                measure("xla_bf16", "XLA bf16",
                        lambda w: _time_jax(_xla_bf16, (x, wt16), args.calls, w))
            if "xla_fp8_scaled" in anchors and n in XLA_FP8_HANGS_N:
                print(f"  {name} M={m} XLA FP8 + scales: skipped (hangs at N={n})",
                      file=sys.stderr, flush=True)
            elif "xla_fp8_scaled" in anchors:
                measure("xla_fp8_scaled", "XLA FP8 + scales",
                        lambda w: _time_jax(_xla_fp8_scaled, (xq, xs, w8, ws), args.calls, w))
            tfn = _torch_scaled_mm(xq, xs, w8, ws) if "torch_scaled_mm" in anchors else None
            if tfn is not None:
                measure("torch_scaled_mm", "torch._scaled_mm",
                        lambda w: _time_torch(tfn, args.calls, w))
            records.append(rec)
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731  (None: failed)
            ratio = (rec[f"w4a8_{kernels[0]}"] / rec["xla_fp8_scaled"]
                     if kernels and rec[f"w4a8_{kernels[0]}"] and rec["xla_fp8_scaled"] else None)
            row = ([name, f"{n} x {k}", m] + [fmt(rec[f"w4a8_{kk}"]) for kk in kernels]
                   + [fmt(rec["xla_bf16"]), fmt(rec["xla_fp8_scaled"]), fmt(rec["torch_scaled_mm"]),
                      "-" if ratio is None else f"{ratio:.2f}x",
                      f"{rec['weight_bits_per_value']:.3f}",
                      " / ".join(fmt(rec.get(f"{kk}_mhz")) for kk in
                                 ([f"w4a8_{kernels[0]}"] if kernels else []) +
                                 ["xla_fp8_scaled", "torch_scaled_mm"])])
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
            del x, w, xq, xs, wq, w8, ws, wt16
    sampler.close()
    write_json("gemm", {"device": dev.device_kind, "rows": records,
                        "anchors_xla_fp8_scaled_m16384": XLA_FP8_SCALED_ANCHOR})
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
