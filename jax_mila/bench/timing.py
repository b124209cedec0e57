"""Timing helpers shared by the kernel benchmarks (benchmarks/*.py): medians after warm-up, of
wall time, or for short ops of device time (kernel durations from a jax.profiler trace, host
gaps excluded); the GPU's clock and power while a path ran (GpuSampler); markdown tables and
the JSON the benchmarks write to $OUT."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import jax

from jax_mila.bench import trace as trace_lib


def median_seconds(fn, *args, warmup: int = 3, reps: int = 10) -> float:
    """Median wall time of `fn(*args)` with the device synchronised around each call."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _warm_up(fn, inputs, warmup: int) -> None:
    for i in range(warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))


def _dispatch(fn, inputs, calls: int) -> None:
    """`calls` calls of `fn` back to back, rotating over `inputs` (several buffers so L2 does
    not serve repeats), synchronised once at the end."""
    jax.block_until_ready([fn(*inputs[i % len(inputs)]) for i in range(calls)])


def median_seconds_per_call(op, inputs, *, calls: int = 20, warmup: int = 2, reps: int = 7):
    """For short ops: the median wall time per call over `reps` runs of `_dispatch`. Separate
    dispatches, not one jitted program with many calls: XLA's CSE merges identical calls inside
    one program (it did, and inflated a first measurement). Bound by JAX's per-call dispatch
    cost (tens of us on the H200) when the kernels are shorter than that: see
    median_device_seconds_per_call."""
    fn = jax.jit(op)
    _warm_up(fn, inputs, warmup)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _dispatch(fn, inputs, calls)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


# Host idle time before each profiled rep: the device is idle too, so the reps' kernels lie
# apart, and a quarter of it is the slack that absorbs host/GPU clock offsets in the trace.
REP_GAP_S = 1e-3
_REP_NAME = "median_device_seconds_per_call rep {}"


def median_device_seconds_per_call(op, inputs, *, calls: int = 20, warmup: int = 2,
                                   reps: int = 5) -> float | None:
    """For short ops: device busy time per call, the median over `reps` runs of `_dispatch` of
    (sum of the kernel durations on the device streams during the run) / calls, from one
    jax.profiler trace. Unlike median_seconds_per_call, host dispatch gaps are not in it. The
    kernels are summed, not their union, so streams that overlap would count twice (the ops
    timed here run one stream). None when the trace holds no device kernels (a CPU run) or
    the profiler failed: callers fall back to the wall time."""
    fn = jax.jit(op)
    _warm_up(fn, inputs, warmup)  # outside the trace: compiling and autotuning stay out of it
    names = [_REP_NAME.format(r) for r in range(reps)]
    trace = _profiled_reps(fn, inputs, calls, names)
    if trace is None:
        return None
    per_rep = trace_lib.device_seconds_in_windows(
        trace, trace_lib.host_windows(trace, names), slack_us=REP_GAP_S * 1e6 / 4)
    if per_rep is None:
        return None
    # A zero median: most windows caught no kernel, which a run on a device cannot do (the
    # clocks disagree); no number beats an infinite bandwidth.
    median = statistics.median(per_rep)
    return median / calls if median > 0 else None


def _profiled_reps(fn, inputs, calls: int, names) -> dict | None:
    """The parsed trace of one `_dispatch` run per name, each inside a TraceAnnotation of that
    name. One trace for all reps, not one per rep: starting and stopping the profiler costs
    far more than the runs, and the annotation windows attribute kernels exactly enough, as
    each run synchronises before its annotation closes, so its kernels start after the window
    opens and end before it closes. None if the profiler failed or wrote no trace."""
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for name in names:
                    time.sleep(REP_GAP_S)
                    with jax.profiler.TraceAnnotation(name):
                        _dispatch(fn, inputs, calls)
        except Exception as e:  # noqa: BLE001 -- the profiler is optional: wall time remains
            print(f"device time: jax.profiler failed ({type(e).__name__}: {str(e)[:200]})",
                  file=sys.stderr)
            return None
        path = trace_lib.find_trace(d)
        return None if path is None else trace_lib.load(path)


# Timed calls of a short op rotate through buffers that add up to at least this much, so the
# op reads from HBM, not from a 50-60 MB L2 that a repeated call would find warm.
ROTATE_BYTES = 256 << 20


def rotation(nbytes: int) -> int:
    """How many copies of an operand of ``nbytes`` the timed calls rotate through (2-256)."""
    return max(2, min(256, -(-ROTATE_BYTES // max(nbytes, 1))))


def copy_device_seconds(nbytes: int, *, calls: int = 10) -> float | None:
    """Device seconds per pass of an XLA elementwise kernel reading and writing ``nbytes`` (a
    device-to-device copy's traffic: 2 x nbytes moved), over rotating buffers: the bandwidth
    the memory-bound kernels are held against. None without device kernels (a CPU run, asked
    before any work: a CPU would take tens of seconds over the buffers for nothing)."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "cpu":
        return None

    words = max(nbytes // 4, 1)
    bufs = [(jnp.full((words,), i, jnp.uint32),) for i in range(rotation(nbytes))]
    return median_device_seconds_per_call(lambda a: a ^ jnp.uint32(0x5A5A5A5A), bufs,
                                          calls=max(calls, len(bufs)))


def time_per_call(op, inputs) -> dict:
    """{"device_us": device busy time per call (None without device kernels), "wall_us":
    wall time per call (dispatch-bound for short ops)} of `op` on `inputs`."""
    device = median_device_seconds_per_call(op, inputs)
    return {"device_us": None if device is None else device * 1e6,
            "wall_us": median_seconds_per_call(op, inputs) * 1e6}


def tb_per_s(nbytes: int, us: float | None) -> float | None:
    return None if us is None else nbytes / us / 1e6


def cell(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """A table cell: the value formatted, or "-" for None (no device time on a CPU run)."""
    return "-" if value is None else format(value, spec) + suffix


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(name: str, payload) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(payload, f, indent=1)


class GpuSampler:
    """SM clock (MHz) and board power (W) of the first visible GPU, sampled by `nvidia-smi -lms`
    in the background for the whole run, against time.monotonic(); `window(intervals)` gives
    their medians over one or more (t0, t1) intervals (a path's timed trials). FP8 GEMMs run at
    the power limit, where the clock, not the kernel, moves a number by several percent between
    runs: reading the clock beside each measurement lets a table compare work per clock. Empty
    (None) without nvidia-smi."""

    def __init__(self, interval_ms: int = 20):
        self._samples: list[tuple[float, float, float]] = []
        self._proc = None
        if shutil.which("nvidia-smi") is None:
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        index = visible if visible.isdigit() else "0"
        # power.draw is a one-second average on recent drivers; .instant is the reading.
        power = ("power.draw.instant" if subprocess.run(
            ["nvidia-smi", "-i", index, "--query-gpu=power.draw.instant", "--format=csv"],
            capture_output=True, timeout=30).returncode == 0 else "power.draw")
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", index, f"--query-gpu=clocks.sm,{power}",
             "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self._samples.append((time.monotonic(), clock, power))

    def window(self, intervals) -> tuple[float | None, float | None]:
        """Medians of the samples taken inside any of the (t0, t1) intervals; None, None if
        there are none."""
        inside = [(c, p) for t, c, p in list(self._samples)
                  if any(t0 <= t <= t1 for t0, t1 in intervals)]
        if not inside:
            return None, None
        return (statistics.median(c for c, _ in inside), statistics.median(p for _, p in inside))

    def close(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
