"""Timing helpers shared by the benchmarks: medians of device time after warm-up."""

from __future__ import annotations

import json
import os
import statistics
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
