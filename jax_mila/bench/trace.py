"""GPU kernel time by op from a jax.profiler trace (the perfetto / Chrome-trace JSON).

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes
``dir/plugins/profile/<run>/perfetto_trace.json.gz``: processes named ``/device:GPU:N`` hold
one thread per CUDA stream ("Stream #..."), whose complete events ("ph": "X", "dur" in us)
are the kernels and copies as CUPTI saw them. Other device threads ("XLA Ops", "XLA
Modules", ...) repeat the same time under HLO names and are skipped, so nothing is counted
twice. Kernels are bucketed by name (BUCKETS, first match wins); the sum is device busy time,
not wall time (streams can overlap, and host gaps are not in it; :func:`timeline` measures
those gaps). With several devices the
split is also kept per device: NCCL kernels spin while they wait for a peer, so a device's
"collectives" time is transfers plus the other devices' lateness. :func:`host_windows` and
:func:`device_seconds_in_windows` give the device time of timed runs the caller marked with
host annotations (jax_mila/bench/timing.py's device time per call of short ops).
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
    ("attn decode", re.compile(r"DecodeSplitKernel|DecodeCombineKernel")),
    ("w4a8 gemv", re.compile(r"w4a8_gemv", re.I)),
    ("w4a8 gemm", re.compile(r"w4a8", re.I)),
    ("act quantize", re.compile(r"quantize_rows|rms_norm_quantize", re.I)),  # + fused norms
    ("cudnn attention", re.compile(r"cudnn|fmha|flash_fprop|fprop", re.I)),
    ("xla gemm", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|matmul|triton_dot|__dot", re.I)),
    ("collectives (nccl)", re.compile(r"nccl", re.I)),
)
TOP_OTHER = 8  # the heaviest kernels of the "other" bucket, by name, kept in the split
OTHER = "other"
BUCKET_NAMES = tuple(b for b, _ in BUCKETS) + (OTHER,)
_SKIP_THREADS = re.compile(r"XLA|Step|Framework|Source|Launch|Module|Op", re.I)


def bucket_of(name: str) -> str:
    for bucket, pattern in BUCKETS:
        if pattern.search(name):
            return bucket
    return OTHER


def buckets_used(splits) -> list[str]:
    """The buckets of BUCKET_NAMES (in that order) holding time in any of ``splits`` (dicts as
    :func:`split_by_op` returns): the columns a report needs."""
    return [b for b in BUCKET_NAMES if any(split.get(b) for split in splits)]


def find_trace(log_dir: str) -> str | None:
    """The newest perfetto_trace.json.gz (or *.trace.json.gz) under ``log_dir``."""
    found = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    found = found or glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def load(trace_path: str) -> dict:
    """A trace file (gzipped JSON, as :func:`find_trace` finds them) parsed."""
    with gzip.open(trace_path, "rt") as f:
        return json.load(f)


def kernel_events(trace: dict):
    """(device, name, duration in us) of every kernel / copy on a device stream of a parsed
    trace; device is the process name ("/device:GPU:0")."""
    for device, name, _, dur in kernel_intervals(trace):
        yield device, name, dur


def _events(trace) -> list:
    return trace.get("traceEvents", []) if isinstance(trace, dict) else trace


def _device_processes(events) -> dict:
    """{pid: process name} of the device processes ("/device:GPU:0", ...)."""
    return {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device:")}


def kernel_intervals(trace: dict):
    """(device, name, start in us, duration in us) of every kernel / copy on a device stream
    of a parsed trace; device is the process name ("/device:GPU:0")."""
    events = _events(trace)
    devices = _device_processes(events)
    threads = {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    streams = {k for k, n in threads.items() if k[0] in devices and n.startswith("Stream")}
    if not streams:  # no stream lines: every device thread that is not a derived (HLO) line
        streams = {k for k, n in threads.items() if k[0] in devices and not _SKIP_THREADS.search(n)}
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            yield (devices[e.get("pid")], str(e.get("name", "")), float(e.get("ts", 0.0)),
                   float(e.get("dur", 0.0)))


def host_windows(trace: dict, names) -> list[tuple[float, float]]:
    """(start, end) in us of the host events named ``names``, in the order of ``names``: the
    spans of the jax.profiler.TraceAnnotation's a caller wrapped its timed runs in. Host and
    device events share one time base in the trace, so the windows select kernels. A name
    the trace lacks is left out (fewer windows than names); one seen twice counts once."""
    wanted, found = set(names), {}
    for name, start, end in host_events(trace):
        if name in wanted:
            found.setdefault(name, (start, end))
    return [found[n] for n in names if n in found]


def device_seconds_in_windows(trace: dict, windows, slack_us: float = 0.0) -> list[float] | None:
    """Per (start, end) window in us: seconds of device-stream kernels (those of
    :func:`kernel_intervals`: summed over streams and devices, the derived HLO lines left out)
    whose midpoint lies in the window or at most ``slack_us`` outside it, each kernel in the
    nearest such window. The midpoint and the slack absorb a small offset between the host and
    GPU clocks. Kernels further from every window (warm-up, the profiler's own start and stop)
    count nowhere. None when no kernel falls in any window: a CPU run, or clocks further apart
    than the slack."""
    per_window = [0.0] * len(windows)
    seen = False
    for _, _, ts, dur in kernel_intervals(trace):
        mid = ts + dur / 2
        distance = [max(start - mid, mid - end, 0.0) for start, end in windows]
        if distance and min(distance) <= slack_us:
            per_window[distance.index(min(distance))] += dur / 1e6
            seen = True
    return per_window if seen else None


def split_by_op(trace_path: str) -> dict | None:
    """{bucket: milliseconds} of device kernel time summed over the devices, plus "total",
    "kernels" (the count), "per_device" ({device: {bucket: ms, "total": ms}}) and
    "top_other" ([name, ms] of the heaviest kernels no bucket took) and "timeline" (see
    :func:`timeline`); None when the trace holds no device events (CPU, or the profiler saw no
    GPU)."""
    trace = load(trace_path)
    split = _split(trace)
    if split is not None:
        split["timeline"] = timeline(trace)
    return split


# Idle stretches of a device between its kernels, by length in us: (label, upper bound).
GAP_CLASSES = (("<5us", 5.0), ("5-20us", 20.0), ("20-100us", 100.0), ("0.1-1ms", 1e3),
               (">1ms", float("inf")))
TOP_GAPS = 8
TOP_HOST = 5  # host events named per long gap


def host_events(trace: dict):
    """(name, start in us, end in us) of every complete event outside the device processes:
    the host's TraceMe spans (jit dispatch, XLA's executable launch, Python annotations)."""
    events = _events(trace)
    devices = _device_processes(events)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in devices:
            ts = float(e.get("ts", 0.0))
            yield str(e.get("name", "")), ts, ts + float(e.get("dur", 0.0))


def host_during(spans, start: float, end: float, top: int = TOP_HOST) -> list[list]:
    """[name, ms] of the host events (from :func:`host_events`) that overlap [start, end) us,
    by name, the most overlap first: what the host was doing while a device sat idle. Nested
    spans are all listed (a dispatch and the launch inside it), so the names read as a call
    chain, outermost (longest) first when they cover the whole gap."""
    overlap = {}
    for name, s, e in spans:
        o = min(e, end) - max(s, start)
        if o > 0:
            overlap[name] = overlap.get(name, 0.0) + o
    return [[n, ms / 1e3] for n, ms in sorted(overlap.items(), key=lambda x: -x[1])[:top]]


def timeline(trace: dict) -> dict:
    """Per device: how busy its streams were between the first kernel's start and the last
    one's end. {device: {"span_ms", "busy_ms" (union of kernel intervals: overlapping streams
    count once), "idle_ms" (span - busy), "gaps" ({class: [count, ms]} over GAP_CLASSES),
    "top_gaps" ([ms, kernel before, kernel after, host] of the longest TOP_GAPS, host being
    :func:`host_during` the gap: what the device waited for), "idle_before"
    ([kernel, count, ms] of the kernels that gaps of 20 us or more end at, most idle time
    first: what the device most often waits to start)}}. The idle time is
    what the kernel sums of split_by_op leave out of a wall-clock measurement: launch latency,
    host work the device waited for, synchronizations."""
    per_device = {}
    for device, name, ts, dur in kernel_intervals(trace):
        per_device.setdefault(device, []).append((ts, ts + dur, name))
    out, host = {}, None
    for device, spans in sorted(per_device.items()):
        spans.sort()
        gaps = {label: [0, 0.0] for label, _ in GAP_CLASSES}
        top, before = [], {}
        busy, end, last = 0.0, spans[0][0], spans[0][2]
        for start, stop, name in spans:
            if start > end:  # idle from the latest end so far to this start
                idle = start - end
                label = next(lbl for lbl, bound in GAP_CLASSES if idle < bound)
                gaps[label][0] += 1
                gaps[label][1] += idle / 1e3
                top.append((idle / 1e3, last, name, end, start))
                if idle >= 20.0:
                    count, ms = before.get(name, (0, 0.0))
                    before[name] = (count + 1, ms + idle / 1e3)
            busy += max(0.0, stop - max(start, end))
            if stop > end:
                end, last = stop, name
        top = sorted(top, key=lambda g: -g[0])[:TOP_GAPS]
        if host is None and top:
            host = list(host_events(trace))  # once for all devices: a trace holds many
        out[device] = {"span_ms": (end - spans[0][0]) / 1e3, "busy_ms": busy / 1e3,
                       "idle_ms": (end - spans[0][0] - busy) / 1e3, "gaps": gaps,
                       "top_gaps": [[ms, before, after, host_during(host, g0, g1)]
                                    for ms, before, after, g0, g1 in top],
                       "idle_before": [[n, c, ms] for n, (c, ms) in
                                       sorted(before.items(), key=lambda x: -x[1][1])[:TOP_GAPS]]}
    return out


def _split(trace: dict) -> dict | None:
    ms = {b: 0.0 for b in BUCKET_NAMES}
    per_device, other = {}, {}
    count = 0
    for device, name, dur in kernel_events(trace):
        bucket = bucket_of(name)
        ms[bucket] += dur / 1e3
        own = per_device.setdefault(device, {b: 0.0 for b in BUCKET_NAMES})
        own[bucket] += dur / 1e3
        if bucket == OTHER:
            other[name] = other.get(name, 0.0) + dur / 1e3
        count += 1
    if count == 0:
        return None
    ms["total"] = sum(ms[b] for b in BUCKET_NAMES)
    ms["kernels"] = count
    for own in per_device.values():
        own["total"] = sum(own[b] for b in BUCKET_NAMES)
    ms["per_device"] = dict(sorted(per_device.items()))
    ms["top_other"] = [[n, t] for n, t in sorted(other.items(), key=lambda x: -x[1])[:TOP_OTHER]]
    return ms
