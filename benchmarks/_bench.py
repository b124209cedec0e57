"""Timing helpers shared by the benchmarks: medians of device time after warm-up."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import threading
import time

import jax


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


def median_seconds_per_call(op, inputs, *, calls: int = 20, warmup: int = 2, reps: int = 7):
    """For short ops: each timed run dispatches `op` `calls` times back to back, rotating over
    `inputs` (several buffers so L2 does not serve repeats), and synchronises once; returns the
    median time per call. Separate dispatches, not one jitted program with many calls: XLA's
    CSE merges identical calls inside one program (it did, and inflated a first measurement)."""
    fn = jax.jit(op)
    for i in range(warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*inputs[i % len(inputs)]) for i in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


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
