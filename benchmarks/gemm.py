"""W4A8 GEMM throughput (TFLOP/s = 2*M*N*K / time) on Gemma 4 12B's linear-layer shapes, side
by side in one run with XLA's bf16 jnp.dot, XLA's FP8 dot with the same row/column scaling done
in XLA (at jnp's default precision, and with float32 accumulation asked for), and
torch._scaled_mm (cuBLASLt FP8, row-wise scales) when torch is importable.

Every path gets pre-quantized operands (the activation quantizer is not timed). Times are medians
of trials of `--calls` back-to-back calls after warm-up. Tables last; JSON to $OUT/gemm.json.

    python benchmarks/gemm.py [--m 16384,1024] [--only qkv,down] [--kernels auto,mma_sync]
                              [--shapes 8192x8192,8192x15360] [--interleave]
    python benchmarks/gemm.py --decode [--m 1,4,8,16] [--only 12b,31b_gate] [--launches 8]

--decode times the GEMV of decode instead (kernel="gemv", what "auto" runs for 1-16 rows) on
every linear of Gemma 4 12B and 31B and on the launches their decode makes of several weights
at once (q/k/v, gate/up: w4a8_matmul_many) (DECODE_SHAPES): device time per call, the bytes it moves
(MXFP4 codes, exponents and channel exponents, activations, output) per second, and that as a
fraction of a device-to-device copy's bandwidth measured in the same run: (read + write) bytes
per second of an XLA elementwise pass over 1 GiB, and over the same bytes as the weights (a
launch of that size has the same fixed costs). Weights and copies rotate over enough buffers
that L2 (50 MiB on an H100) does not serve repeats. JSON to $OUT/gemm_decode.json. With
--launches N each launch only runs N times, untimed, for ncu or compute-sanitizer (the timing's
profiler and ncu cannot share a process).

The second table gives, per path, the median SM clock and board power while it was timed
(nvidia-smi, sampled in the background: FP8 GEMMs run at the board's power limit, where the
clock moves by several percent between runs) and its accumulation error (float32 output against
a float32 product of the same operands: XLA's default FP8 path accumulates in a reduced-precision
mode, the W4A8 kernel promotes). NVML's energy counter was tried for energy per FLOP and dropped:
over trials of 20-30 ms it advanced in steps that read 0 W to 2,100 W.

GEMMs under SMALL_GEMM_FLOP (M = 1024 but gate+up) report a JAX path's device time: the kernels'
durations in a jax.profiler trace (jax_mila/bench/timing.py), median of 5 runs of `--calls` calls.
Their wall time measures the host instead: one dispatch of a jitted call costs JAX tens of us,
and a jitted program of 20 such GEMMs still spent ~500 us per execution outside its kernels
(on an H200, o_proj_sliding: 28.9 us kernels back to back, 47-57 us per GEMM in wall time). The wall time stays in the JSON ("<path>_wall"). torch's path is timed with CUDA events
around its calls either way (its dispatch, ~10 us, stays under the kernels' time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_mila import ffi, quant  # noqa: E402
from jax_mila.bench.gemm_paths import (SHAPES, XLA_FP8_HANGS_N, XLA_FP8_PRECISION,  # noqa: E402
                                       fp8_rows, xla_fp8_scaled)
from jax_mila.bench.timing import (GpuSampler, copy_device_seconds, markdown_table,  # noqa: E402
                                   median_device_seconds_per_call, rotation, write_json)

# anchors.md's XLA FP8 + scales at M=16384 (an older XLA; recorded in the JSON for reference:
# the tables compare with the XLA of the same run).
XLA_FP8_SCALED_ANCHOR = {"qkv": 697, "q+k_global": 740}
TRIALS = 7  # timed trials per path; the median is reported
# Below this many FLOP a JAX path reports device time (see the docstring).
SMALL_GEMM_FLOP = 2e11


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


class Timing(NamedTuple):
    seconds: float  # median per call
    windows: list   # (start, end) of each trial, time.monotonic()


def _time_all(timers, trials, interleave):
    """{key: Timing} for {key: timer}, or an exception in place of the Timing for a timer that
    failed. One after another (each warmed up, then its trials), or with `interleave` every
    timer warmed up first and then one trial of each in turn: at the board's power limit the
    clock drifts with its temperature over a run (docs/performance.md), and
    taking turns exposes every path to the same drift instead of giving the first a cooler or a
    hotter board."""
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
    return {key: failed[key] if key in failed else
            Timing(statistics.median(times[key]), windows[key]) for key in order}


def _torch_scaled_mm(xq, xs, w8, ws, out_dtype="bfloat16"):
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
    dtype = getattr(torch, out_dtype)
    return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=dtype)


ACCURACY_ROWS = 256


def _relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _accumulation_errors(keys, xq, xs, wq, w8, ws):
    """{path: relative Frobenius error of its first ACCURACY_ROWS output rows, float32 output,
    against the float32 product of its own operands} (None where a path cannot write float32).
    The operands are exact in both products, so what is left is how the path accumulates (and
    applies the scales): the W4A8 kernel's promoted FP8 sums against XLA's and cuBLASLt's."""
    rows = slice(0, ACCURACY_ROWS)
    hi = jax.lax.Precision.HIGHEST
    x32 = xq[rows].astype(jnp.float32) * xs[rows, None]
    ref_w4 = jnp.dot(x32, quant.dequantize_mxfp4(wq).T, precision=hi)
    ref_w8 = jnp.dot(x32, w8.astype(jnp.float32).T, precision=hi) * ws[None, :]
    errors = {}
    for key in keys:
        try:
            if key.startswith("w4a8_"):
                out = ffi.w4a8_matmul(xq, xs, wq, kernel=key[len("w4a8_"):],
                                      out_dtype=jnp.float32)
                errors[key] = _relative_error(out[rows], ref_w4)
            elif key in XLA_FP8_PRECISION:
                out = xla_fp8_scaled(XLA_FP8_PRECISION[key], jnp.float32)(xq, xs, w8, ws)
                errors[key] = _relative_error(out[rows], ref_w8)
            elif key == "torch_scaled_mm":
                out = _torch_scaled_mm(xq, xs, w8, ws, out_dtype="float32")()
                errors[key] = _relative_error(out[rows].cpu().numpy(), ref_w8)
        except Exception as e:  # noqa: BLE001 - e.g. no float32 output for row-wise scales
            print(f"  accuracy of {key}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            errors[key] = None
    return errors


@jax.jit
def _xla_bf16(x, wt):
    return jnp.dot(x, wt)


# Every linear of Gemma 4 12B and 31B as jax_mila.gemma4 runs it (one call each: q, k and v,
# gate and up separately; ../shared/specs/gemma4.md, 2.1): name -> (N, K).
DECODE_SHAPES = {
    "12b_q_sliding": (4096, 3840), "12b_kv_sliding": (2048, 3840),
    "12b_q_global": (8192, 3840), "12b_k_global": (512, 3840),
    "12b_o_sliding": (3840, 4096), "12b_o_global": (3840, 8192),
    "12b_gate": (15360, 3840), "12b_down": (3840, 15360),
    "31b_q_sliding": (8192, 5376), "31b_kv_sliding": (4096, 5376),
    "31b_q_global": (16384, 5376), "31b_k_global": (2048, 5376),
    "31b_o_sliding": (5376, 8192), "31b_o_global": (5376, 16384),
    "31b_gate": (21504, 5376), "31b_down": (5376, 21504),
    # The launches the models make (w4a8_matmul_many: q/k/v, gate/up in one launch).
    "12b_qkv_sliding": ((4096, 2048, 2048), 3840), "12b_qk_global": ((8192, 512), 3840),
    "12b_gate_up": ((15360, 15360), 3840),
    "31b_qkv_sliding": ((8192, 4096, 4096), 5376), "31b_qk_global": ((16384, 2048), 5376),
    "31b_gate_up": ((21504, 21504), 5376),
}
DECODE_ROWS = "1,4,8,16"
# Buffers a timed call rotates over: at least this many bytes in all, so that L2 holds none of
# them when its turn comes again.
COPY_BYTES = 1 << 30


def _decode_weights(name, most_copies: int = 256):
    """(N of each weight, K, the MXFP4 weights, their copies to rotate over: enough that L2 holds
    none when its turn comes again, at most ``most_copies``) of a DECODE_SHAPES launch."""
    ns, k = DECODE_SHAPES[name]
    ns = ns if isinstance(ns, tuple) else (ns,)
    wqs = [quant.quantize_mxfp4(
        jax.random.normal(jax.random.key(n + k + i), (n, k), jnp.float32) / np.sqrt(k),
        name=name) for i, n in enumerate(ns)]
    copies = max(1, min(most_copies, rotation(sum(w.nbytes for w in wqs))))
    weights = [tuple(wqs)] + [tuple(jax.tree.map(lambda a: a + jnp.uint8(0), w) for w in wqs)
                              for _ in range(copies - 1)]
    return ns, k, wqs, weights


def _decode_launches(names, args) -> None:
    """--launches N: each launch N times over its rotated weights, untimed and without the
    profiler (which ncu and compute-sanitizer cannot share the process with)."""
    fn = jax.jit(lambda a, b, ws: ffi.w4a8_matmul_many(a, b, ws, kernel="gemv"))
    for name in names:
        _, k, _, weights = _decode_weights(name, most_copies=args.launches)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xq, xs = ffi.quantize_activations(x)
            for i in range(args.launches):
                jax.block_until_ready(fn(xq, xs, weights[i % len(weights)]))
            print(f"{name} M={m}: {args.launches} launches", flush=True)
        del weights


def decode_main(args) -> None:
    """The decode table (--decode): see the module docstring."""
    from jax_mila.ffi import w4a8 as w4a8_module

    # --only: names of DECODE_SHAPES, or a model's prefix ("12b", "31b") for all of its linears.
    tokens = [t for t in args.only.split(",") if t]
    names = [n for n in DECODE_SHAPES
             if not tokens or any(n == t or n.startswith(t + "_") for t in tokens)]
    unknown = [t for t in tokens if not any(n == t or n.startswith(t + "_") for n in names)]
    if unknown:
        sys.exit(f"--only: unknown {unknown} for --decode; known: 12b, 31b, "
                 f"{', '.join(DECODE_SHAPES)}")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; {ffi.status('w4a8_matmul')}", flush=True)
    if args.launches:
        _decode_launches(names, args)
        return
    copy_s = copy_device_seconds(COPY_BYTES, calls=args.calls)
    if copy_s is None:
        sys.exit("--decode needs device time from a profiler trace (a GPU run)")
    copy_gbps = 2 * COPY_BYTES / copy_s / 1e9
    print(f"copy bandwidth (1 GiB, read + write): {copy_gbps:.0f} GB/s", flush=True)
    header = ["linear", "N x K", "M", "us", "GB/s", "of copy BW (1 GiB)", "same-bytes copy us",
              "of same-bytes copy BW", "splits"]
    rows, records = [], []
    sms = w4a8_module._sms()
    for name in names:
        ns, k, wqs, weights = _decode_weights(name)
        nbytes = sum(w.nbytes for w in wqs)
        copies = len(weights)
        same_s = copy_device_seconds(nbytes, calls=args.calls)
        label = " + ".join(str(n) for n in ns)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xq, xs = jax.block_until_ready(ffi.quantize_activations(x))
            fn = lambda a, b, ws: ffi.w4a8_matmul_many(a, b, ws, kernel="gemv")  # noqa: E731
            seconds = median_device_seconds_per_call(
                fn, [(xq, xs, wi) for wi in weights], calls=max(args.calls, copies))
            moved = nbytes + xq.size + 4 * xs.size + 2 * m * sum(ns)
            # The plan as this process's handler would make it where clusters fit the GPU's
            # SMs (the handler asks the device how many clusters fit: fewer splits, at times).
            splits = w4a8_module._gemv_plan(ns, wqs[0].shape[1], m, sms,
                                            w4a8_module._gemv_clusters())[1]
            rec = {"linear": name, "N": list(ns), "K": k, "M": m, "bytes": moved,
                   "seconds": seconds, "copy_gbps_1gib": copy_gbps,
                   "copy_seconds_same_bytes": same_s, "splits": splits}
            if seconds is None:
                rows.append([name, f"{label} x {k}", m, "-", "-", "-", "-", "-", splits])
            else:
                gbps = moved / seconds / 1e9
                same_gbps = 2 * nbytes / same_s / 1e9 if same_s else None
                rec.update(gbps=gbps, fraction_of_copy=gbps / copy_gbps,
                           fraction_of_same_bytes_copy=gbps / same_gbps if same_gbps else None)
                rows.append([name, f"{label} x {k}", m, f"{seconds * 1e6:.1f}", f"{gbps:.0f}",
                             f"{gbps / copy_gbps:.0%}",
                             f"{same_s * 1e6:.1f}" if same_s else "-",
                             f"{gbps / same_gbps:.0%}" if same_gbps else "-", splits])
            records.append(rec)
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        del weights
    write_json("gemm_decode", {"device": dev.device_kind, "copy_gbps_1gib": copy_gbps,
                               "rows": records})
    print()
    print(markdown_table(header, rows))


ANCHOR_LABELS = {
    "xla_bf16": "XLA bf16",
    "xla_fp8_scaled": "XLA FP8 + scales",
    "xla_fp8_f32acc": "XLA FP8 + scales, f32 acc",
    "torch_scaled_mm": "torch._scaled_mm",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="16384,1024")
    parser.add_argument("--only", default=",".join(SHAPES))
    parser.add_argument("--kernels", default="auto,mma_sync")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--anchors", default=",".join(ANCHOR_LABELS),
                        help="baselines to time beside the kernels (comma-separated; '' for none): "
                             + ", ".join(ANCHOR_LABELS))
    parser.add_argument("--interleave", action="store_true",
                        help="warm every path up, then time one trial of each in turn (the "
                             "board's drift at its power limit then hits all paths alike)")
    parser.add_argument("--shapes", default="",
                        help="extra NxK shapes (comma-separated, e.g. 8192x15360: how time grows "
                             "with K at a fixed tile grid)")
    parser.add_argument("--time-hanging", action="store_true",
                        help=f"time XLA's FP8 paths also at N in {sorted(XLA_FP8_HANGS_N)}, where "
                             "they were seen not to return (run such an entry under a timeout)")
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false",
                        help="skip each path's accumulation error (float32 output, first "
                             f"{ACCURACY_ROWS} rows, against a float32 product)")
    parser.add_argument("--decode", action="store_true",
                        help=f"the decode GEMV on every 12B/31B linear (--m defaults to "
                             f"{DECODE_ROWS}; --only picks from DECODE_SHAPES or names a "
                             "model: 12b, 31b)")
    parser.add_argument("--launches", type=int, default=0,
                        help="with --decode: run each launch this many times, untimed and "
                             "without the profiler (for ncu or compute-sanitizer: ncu -k "
                             "regex:w4a8_gemv --launch-skip 4 -c 1 python3 benchmarks/gemm.py "
                             "--decode --only 12b_gate_up --m 1 --launches 8)")
    args = parser.parse_args()
    if args.launches and not args.decode:
        parser.error("--launches goes with --decode")
    if args.decode:
        if args.m == parser.get_default("m"):
            args.m = DECODE_ROWS
        if args.only == parser.get_default("only"):
            args.only = ""
        decode_main(args)
        return
    extra = [v.lower() for v in args.shapes.split(",") if v]
    shapes = {**SHAPES, **{spec: tuple(int(d) for d in spec.split("x")) for spec in extra}}
    sampler = GpuSampler()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; {ffi.status('w4a8_matmul')}", flush=True)
    kernels = [k for k in args.kernels.split(",") if k]
    anchors = [a for a in args.anchors.split(",") if a]
    unknown = sorted(set(anchors) - set(ANCHOR_LABELS))
    if unknown:
        parser.error(f"--anchors: unknown {unknown}; known: {', '.join(ANCHOR_LABELS)}")
    names = [n for n in args.only.split(",") if n] + extra
    paths = [f"w4a8_{k}" for k in kernels] + anchors
    labels = {**{f"w4a8_{k}": f"w4a8 {k}" for k in kernels}, **ANCHOR_LABELS}
    fp8_anchors = [a for a in ("xla_fp8_scaled", "xla_fp8_f32acc") if a in anchors]
    # The ratios are the first kernel's (--kernels order): the header names it.
    ratio_of = labels[paths[0]] if kernels else "w4a8"
    header = (["GEMM", "N x K", "M"] + [labels[p] for p in paths]
              + [f"{ratio_of} / {labels[a]}" for a in fp8_anchors] + ["weight bits/value"])
    detail_header = ["GEMM", "M", "path", "TFLOP/s", "timed by", "SM MHz", "board W",
                     f"rel. error, f32 out, {ACCURACY_ROWS} rows"]
    rows, detail_rows, records = [], [], []
    fmt = lambda v, spec=".0f": "-" if v is None else format(v, spec)  # noqa: E731
    for m in (int(v) for v in args.m.split(",")):
        for name in names:
            n, k = shapes[name]
            kx, kw = jax.random.split(jax.random.key(m + n + k))
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
            xq, xs = jax.block_until_ready(ffi.quantize_activations(x))
            wq = quant.quantize_mxfp4(w, name=name)
            w8, ws = fp8_rows(w)
            wt16 = w.T.astype(jnp.bfloat16)
            flops = 2.0 * m * n * k
            rec = {"gemm": name, "N": n, "K": k, "M": m,
                   "weight_bits_per_value": 8 * wq.nbytes / (n * k)}

            timers = {}
            for kern in kernels:
                fn = jax.jit(lambda a, b, c, kern=kern: ffi.w4a8_matmul(a, b, c, kernel=kern))
                timers[f"w4a8_{kern}"] = _JaxTimer(fn, (xq, xs, wq), args.calls)
            for key in anchors:
                if key in XLA_FP8_PRECISION and n in XLA_FP8_HANGS_N and not args.time_hanging:
                    print(f"  {name} M={m} {labels[key]}: skipped (hangs at N={n}; "
                          "--time-hanging times it)", file=sys.stderr, flush=True)
                elif key == "xla_bf16":
                    timers[key] = _JaxTimer(_xla_bf16, (x, wt16), args.calls)
                elif key in XLA_FP8_PRECISION:
                    timers[key] = _JaxTimer(xla_fp8_scaled(XLA_FP8_PRECISION[key]),
                                            (xq, xs, w8, ws), args.calls)
                elif key == "torch_scaled_mm":
                    tfn = _torch_scaled_mm(xq, xs, w8, ws)
                    if tfn is not None:
                        timers[key] = _TorchTimer(tfn, args.calls)
            rec.update({key: None for key in anchors})
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
                    rec[key] = flops / result.seconds / 1e12
                    rec[f"{key}_mhz"], rec[f"{key}_watts"] = sampler.window(result.windows)
                    clock = "" if rec[f"{key}_mhz"] is None else (
                        f" at {rec[f'{key}_mhz']:.0f} MHz, {rec[f'{key}_watts']:.0f} W")
                    print(f" {rec[key]:.0f} TFLOP/s{clock}", file=sys.stderr, flush=True)
            for key, timer in timers.items():
                rec[f"{key}_timed_by"] = "CUDA events" if isinstance(timer, _TorchTimer) else "wall"
                if (flops >= SMALL_GEMM_FLOP or not isinstance(timer, _JaxTimer)
                        or not rec.get(key)):
                    continue
                seconds = median_device_seconds_per_call(timer.fn, [timer.args],
                                                         calls=args.calls)
                if seconds is not None:  # None: no device kernels in the trace (a CPU run)
                    rec[f"{key}_wall"], rec[key] = rec[key], flops / seconds / 1e12
                    rec[f"{key}_timed_by"] = "device time"
                    print(f"  {name} M={m} {labels[key]}: {rec[key]:.0f} TFLOP/s in device time "
                          f"({rec[f'{key}_wall']:.0f} in wall time)", file=sys.stderr, flush=True)
            if args.accuracy:
                errors = _accumulation_errors([p for p in paths if p in timers and rec.get(p)],
                                              xq, xs, wq, w8, ws)
                rec.update({f"{key}_rel_error": e for key, e in errors.items()})
            records.append(rec)
            first = rec.get(f"w4a8_{kernels[0]}") if kernels else None
            ratios = [f"{first / rec[a]:.2f}x" if first and rec.get(a) else "-"
                      for a in fp8_anchors]
            row = ([name, f"{n} x {k}", m] + [fmt(rec.get(p)) for p in paths] + ratios
                   + [f"{rec['weight_bits_per_value']:.3f}"])
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
            for p in paths:
                if rec.get(p):
                    detail_rows.append([name, m, labels[p], fmt(rec[p]),
                                        rec.get(f"{p}_timed_by", "-"), fmt(rec.get(f"{p}_mhz")),
                                        fmt(rec.get(f"{p}_watts")),
                                        fmt(rec.get(f"{p}_rel_error"), ".2e")])
            del x, w, xq, xs, wq, w8, ws, wt16
    sampler.close()
    write_json("gemm", {"device": dev.device_kind, "rows": records,
                        "anchors_xla_fp8_scaled_m16384": XLA_FP8_SCALED_ANCHOR})
    print()
    print(markdown_table(header, rows))
    print()
    print(markdown_table(detail_header, detail_rows))


if __name__ == "__main__":
    main()
