"""Where a GEMM path's time goes, per kernel: the W4A8 path (weight expansion and GEMM, or the
converting GEMM alone) against XLA's scaled FP8 path (its FP8 GEMM and the fusion that applies
the scales), on Gemma 4 12B's shapes.

Each round is one short burst of `--calls` back-to-back calls of a path under a jax.profiler
trace: wall time per call beside the device time of each kernel (the median over the burst).
A burst of 20 GEMMs lasts 15-60 ms, too short for the board's power limit to pull the clock
down far; benchmarks/gemm.py's interleaved trials run the paths for seconds at that limit,
where the clock follows the power each path draws. The two answer different questions: this
one what each kernel costs, that one what a path sustains. (No clock column: nvidia-smi's
samples, 10 ms apart, are too coarse for bursts this short.)

    python benchmarks/gemm_kernels.py [--m 16384] [--only down,gate+up] [--kernel auto]
                                      [--time-hanging]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi, quant
from jax_mila.bench import trace as trace_lib
from jax_mila.bench.gemm_paths import (SHAPES, XLA_FP8_HANGS_N, XLA_FP8_PRECISION, fp8_rows,
                                       xla_fp8_scaled)
from jax_mila.bench.timing import markdown_table


def _burst(fn, args, calls: int):
    """(wall seconds per call, {kernel name: [durations in us]}) of one traced burst."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t0) / calls
        path = trace_lib.find_trace(d)
        trace = trace_lib.load(path) if path else {}
    kernels: dict[str, list[float]] = {}
    for _, name, dur in trace_lib.kernel_events(trace):
        kernels.setdefault(name, []).append(dur)
    return wall, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--only", default="qkv,q+k_global,o_proj_sliding,o_proj_global,gate+up,down")
    ap.add_argument("--kernel", default="auto", help="the W4A8 kernel (ffi.w4a8_matmul's kernel=)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="bursts per path; the median is shown")
    ap.add_argument("--time-hanging", action="store_true",
                    help=f"time XLA's path also at N in {sorted(XLA_FP8_HANGS_N)}, where it was "
                         "seen not to return (run such an entry under a timeout)")
    args = ap.parse_args()

    rows = []
    for name in args.only.split(","):
        n, k = SHAPES[name]
        flops = 2.0 * args.m * n * k
        kx, kw = jax.random.split(jax.random.key(args.m + n + k))
        x = jax.random.normal(kx, (args.m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
        xq, xs = jax.block_until_ready(ffi.quantize_activations(x))
        wq = quant.quantize_mxfp4(w, name=name)
        w8, ws = fp8_rows(w)
        paths = {
            f"w4a8 {args.kernel}": (
                jax.jit(lambda a, b, c: ffi.w4a8_matmul(a, b, c, kernel=args.kernel)),
                (xq, xs, wq)),
        }
        if n not in XLA_FP8_HANGS_N or args.time_hanging:
            paths["XLA FP8 + scales"] = (
                xla_fp8_scaled(XLA_FP8_PRECISION["xla_fp8_scaled"]), (xq, xs, w8, ws))
        for fn, fargs in paths.values():
            for _ in range(3):
                jax.block_until_ready(fn(*fargs))
        bursts = {label: [] for label in paths}
        for _ in range(args.rounds):  # the paths take turns, as in gemm.py --interleave
            for label, (fn, fargs) in paths.items():
                bursts[label].append(_burst(fn, fargs, args.calls))
        for label, runs in bursts.items():
            wall = statistics.median(r[0] for r in runs)
            per_kernel: dict[str, list[float]] = {}
            for _, kernels in runs:
                for kname, durs in kernels.items():
                    per_kernel.setdefault(kname, []).extend(durs)
            busy = sum(statistics.median(d) * len(d) / len(runs) / args.calls
                       for d in per_kernel.values())
            split = "; ".join(f"{kname[:48]} {statistics.median(d):.1f}"
                              for kname, d in sorted(per_kernel.items(),
                                                     key=lambda kv: -statistics.median(kv[1])))
            rows.append([name, args.m, label, f"{wall * 1e6:.0f}", f"{flops / wall / 1e12:.0f}",
                         f"{busy:.0f}", split])
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        del x, w, xq, xs, wq, w8, ws
    print()
    print(markdown_table(["GEMM", "M", "path", "wall us / call", "TFLOP/s (wall)",
                          "device busy us / call", "kernels (median us)"], rows))


if __name__ == "__main__":
    main()
