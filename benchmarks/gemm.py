"""W4A8 GEMM throughput (TFLOP/s = 2*M*N*K / time) on Gemma 4 12B's linear-layer shapes, side
by side in one run with XLA's bf16 jnp.dot, XLA's FP8 dot with the same row/column scaling done
in XLA, and torch._scaled_mm (cuBLASLt FP8, row-wise scales) when torch is importable.

Every path gets pre-quantized operands (the activation quantizer is not timed). Times are medians
of trials of `--calls` back-to-back calls after warm-up. Table last; JSON to $OUT/gemm.json.

    python benchmarks/gemm.py [--m 16384,1024] [--only qkv,down] [--kernels auto,mma_sync]
                              [--shapes 8192x8192,8192x15360] [--interleave]

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
TRIALS = 7  # timed trials per path; the median is reported


class _JaxTimer:
    """A trial: `calls` back-to-back calls of a jitted function, synchronised once; seconds per
    call."""

    def __init__(self, fn, args, calls):
        self.fn, self.args, self.calls = fn, args, calls

    def warmup(self, n=2):
        for _ in range(n):
            jax.block_until_ready(self.fn(*self.args))

    def trial(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.calls):
            out = self.fn(*self.args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / self.calls


class _TorchTimer:
    """The same for a torch callable, timed with CUDA events."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def warmup(self, n=2):
        import torch

        for _ in range(n):
            self.fn()
        torch.cuda.synchronize()

    def trial(self) -> float:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.calls):
            self.fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / self.calls


def _time_all(timers, trials, interleave):
    """{key: (median seconds per call, [(start, end) of its trials])} for {key: timer}, or an
    exception in place of the pair for a timer that failed. One after another (each warmed up,
    then its trials), or with `interleave` every timer warmed up first and then one trial of
    each in turn: at the board's power limit the clock drifts with its temperature over a run
    (docs/performance.md, fifteenth round), and taking turns exposes every path to the same
    drift instead of giving the first a cooler or a hotter board."""
    times = {key: [] for key in timers}
    windows = {key: [] for key in timers}
    failed = {}

    def one_trial(key):
        t0 = time.monotonic()
        times[key].append(timers[key].trial())
        windows[key].append((t0, time.monotonic()))

    order = list(timers)
    for key in order:
        try:
            timers[key].warmup()
            if not interleave:
                for _ in range(trials):
                    one_trial(key)
        except Exception as e:  # noqa: BLE001 - an anchor failing must not stop the table
            failed[key] = e
    for _ in range(trials if interleave else 0):
        for key in (k for k in order if k not in failed):
            try:
                one_trial(key)
            except Exception as e:  # noqa: BLE001
                failed[key] = e
    return {key: failed[key] if key in failed else (statistics.median(times[key]), windows[key])
            for key in order}


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
    parser.add_argument("--interleave", action="store_true",
                        help="warm every path up, then time one trial of each in turn (the "
                             "board's drift at its power limit then hits all paths alike)")
    parser.add_argument("--shapes", default="",
                        help="extra NxK shapes (comma-separated, e.g. 8192x15360: how time grows "
                             "with K at a fixed tile grid)")
    args = parser.parse_args()
    extra = [v.lower() for v in args.shapes.split(",") if v]
    for spec in extra:
        SHAPES[spec] = tuple(int(d) for d in spec.split("x"))
    sampler = GpuSampler()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; {ffi.status('w4a8_matmul')}", flush=True)
    kernels = [k for k in args.kernels.split(",") if k]
    anchors = set(a for a in args.anchors.split(",") if a)
    names = [n for n in args.only.split(",") if n] + extra
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

            timers, labels = {}, {}
            for kern in kernels:
                fn = jax.jit(lambda a, b, c, kern=kern: ffi.w4a8_matmul(a, b, c, kernel=kern))
                timers[f"w4a8_{kern}"] = _JaxTimer(fn, (xq, xs, wq), args.calls)
                labels[f"w4a8_{kern}"] = f"w4a8 {kern}"
            if "xla_bf16" in anchors:
                timers["xla_bf16"] = _JaxTimer(_xla_bf16, (x, wt16), args.calls)
                labels["xla_bf16"] = "XLA bf16"
            if "xla_fp8_scaled" in anchors and n in XLA_FP8_HANGS_N:
                print(f"  {name} M={m} XLA FP8 + scales: skipped (hangs at N={n})",
                      file=sys.stderr, flush=True)
            elif "xla_fp8_scaled" in anchors:
                timers["xla_fp8_scaled"] = _JaxTimer(_xla_fp8_scaled, (xq, xs, w8, ws), args.calls)
                labels["xla_fp8_scaled"] = "XLA FP8 + scales"
            tfn = _torch_scaled_mm(xq, xs, w8, ws) if "torch_scaled_mm" in anchors else None
            if tfn is not None:
                timers["torch_scaled_mm"] = _TorchTimer(tfn, args.calls)
                labels["torch_scaled_mm"] = "torch._scaled_mm"
            rec.update(xla_bf16=None, xla_fp8_scaled=None, torch_scaled_mm=None)
            # Sequentially, each path is timed and printed as it lands, so an anchor that hangs
            # still leaves the numbers before it; interleaved, all are printed at the end.
            groups = [timers] if args.interleave else [{key: t} for key, t in timers.items()]
            for group in groups:
                # The labels go out before the timing, so a path that hangs is named in the log.
                print(f"  {name} M={m} {' / '.join(labels[key] for key in group)} ...",
                      file=sys.stderr, flush=True)
                for key, result in _time_all(group, TRIALS, args.interleave).items():
                    print(f"  {name} M={m} {labels[key]}:", end="", file=sys.stderr)
                    if isinstance(result, Exception):
                        rec[key] = None
                        print(f" failed: {type(result).__name__}: {result}", file=sys.stderr,
                              flush=True)
                        continue
                    seconds, windows = result
                    rec[key] = flops / seconds / 1e12
                    rec[f"{key}_mhz"], rec[f"{key}_watts"] = sampler.window(windows)
                    clock = "" if rec[f"{key}_mhz"] is None else (
                        f" at {rec[f'{key}_mhz']:.0f} MHz, {rec[f'{key}_watts']:.0f} W")
                    print(f" {rec[key]:.0f} TFLOP/s{clock}", file=sys.stderr, flush=True)
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
