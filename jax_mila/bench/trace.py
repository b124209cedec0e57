"""GPU kernel time by op from a jax.profiler trace (the perfetto / Chrome-trace JSON).

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes
``dir/plugins/profile/<run>/perfetto_trace.json.gz``: processes named ``/device:GPU:N`` hold
one thread per CUDA stream ("Stream #..."), whose complete events ("ph": "X", "dur" in us)
are the kernels and copies as CUPTI saw them. Other device threads ("XLA Ops", "XLA
Modules", ...) repeat the same time under HLO names and are skipped, so nothing is counted
twice. Kernels are bucketed by name (BUCKETS, first match wins); the sum is device busy time,
not wall time (streams can overlap, and host gaps are not in it).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

# (bucket, regex on the kernel name), first match wins. Kernel names: csrc/*/ (__global__).
BUCKETS = (
    ("attn global (flash d512)", re.compile(r"flash512", re.I)),
    ("attn local (flash d256)", re.compile(r"flashattentiond256|flash256", re.I)),
    ("w4a8 gemm", re.compile(r"w4a8", re.I)),
    ("act quantize", re.compile(r"quantize_rows", re.I)),
    ("cudnn attention", re.compile(r"cudnn|fmha|flash_fprop|fprop", re.I)),
    ("xla gemm", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|matmul|triton_dot|__dot", re.I)),
)
OTHER = "other"
BUCKET_NAMES = tuple(b for b, _ in BUCKETS) + (OTHER,)
_SKIP_THREADS = re.compile(r"XLA|Step|Framework|Source|Launch|Module|Op", re.I)


def bucket_of(name: str) -> str:
    for bucket, pattern in BUCKETS:
        if pattern.search(name):
            return bucket
    return OTHER


def find_trace(log_dir: str) -> str | None:
    """The newest perfetto_trace.json.gz (or *.trace.json.gz) under ``log_dir``."""
    found = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    found = found or glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def kernel_events(trace: dict):
    """(name, duration in us) of every kernel / copy on a device stream of a parsed trace."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    devices, threads = set(), {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name" and str(e.get("args", {}).get("name", "")).startswith("/device:"):
            devices.add(e.get("pid"))
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    streams = {k for k, n in threads.items() if k[0] in devices and n.startswith("Stream")}
    if not streams:  # no stream lines: every device thread that is not a derived (HLO) line
        streams = {k for k, n in threads.items() if k[0] in devices and not _SKIP_THREADS.search(n)}
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            yield str(e.get("name", "")), float(e.get("dur", 0.0))


def split_by_op(trace_path: str) -> dict | None:
    """{bucket: milliseconds} of device kernel time (plus "total" and "kernels": the count),
    or None when the trace holds no device events (CPU, or the profiler saw no GPU)."""
    with gzip.open(trace_path, "rt") as f:
        trace = json.load(f)
    ms = {b: 0.0 for b in BUCKET_NAMES}
    count = 0
    for name, dur in kernel_events(trace):
        ms[bucket_of(name)] += dur / 1e3
        count += 1
    if count == 0:
        return None
    ms["total"] = sum(ms[b] for b in BUCKET_NAMES)
    ms["kernels"] = count
    return ms
