"""The largest temporary buffers alive at the peak of one compiled XLA module, from a dump.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=jit_body" python3 benchmarks/prefill.py ...
    python3 scripts/xla_live_buffers.py DIR [--module jit_body] [--top 25]

Reads the module's `*after_optimizations-buffer-assignment.txt` (each value of the temporary
allocation with its size) and `*after_optimizations-live-range.txt` (where each value lives in
the schedule), finds the schedule position where the most temporary bytes are alive and lists
the largest of them with the instructions that define and last use them. Written to find what
makes the context-parallel chunk step (`jit_body`) plan ~1 GiB more than the single-device step
Without a live-range file it lists the largest values.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import re
import sys

# Allocations that are not temporaries of the step (inputs, outputs, constants).
_NOT_TEMP = ("parameter", "constant", "thread-local", "output shape")


def temp_values(buffer_assignment: str):
    """(name, bytes, shape) of every value in a temporary allocation."""
    values = []
    for alloc in re.split(r"^allocation ", buffer_assignment, flags=re.M)[1:]:
        if any(word in alloc.split("\n", 1)[0] for word in _NOT_TEMP):
            continue
        for m in re.finditer(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", alloc):
            values.append((m.group(1).split("{")[0], int(m.group(2)), m.group(3)))
    return values


def live_ranges(live_range: str):
    """(schedule position -> instruction, value name -> (first, last) position)."""
    schedule_text, ranges_text = live_range.split("BufferLiveRange", 1)
    schedule = {int(m.group(1)): m.group(2)
                for m in re.finditer(r"^\s+(\d+):(\S+)$", schedule_text, re.M)}
    ranges: dict[str, tuple[int, int]] = {}
    for m in re.finditer(r"^\s+(\S+?)(?:\{[^}]*\})?:(\d+)-(\d+)$", ranges_text, re.M):
        first, last = int(m.group(2)), int(m.group(3))
        old = ranges.get(m.group(1), (first, last))
        ranges[m.group(1)] = (min(old[0], first), max(old[1], last))
    return schedule, ranges


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump_dir", help="the --xla_dump_to directory")
    parser.add_argument("--module", default="jit_body",
                        help="a substring of the module's file name (default: jit_body)")
    parser.add_argument("--top", type=int, default=25, help="buffers to list (default 25)")
    args = parser.parse_args()
    paths = sorted(p for p in glob.glob(os.path.join(
        args.dump_dir, "*after_optimizations-buffer-assignment.txt")) if args.module in p)
    if not paths:
        sys.exit(f"xla_live_buffers: no *after_optimizations-buffer-assignment.txt whose name "
                 f"contains {args.module!r} in {args.dump_dir}")
    path = paths[-1]
    print(path)
    with open(path) as f:
        values = temp_values(f.read())
    try:
        with open(path.replace("-buffer-assignment.txt", "-live-range.txt")) as f:
            schedule, ranges = live_ranges(f.read())
    except FileNotFoundError:
        print("no live-range file: the largest temporary values, whenever they live")
        for name, size, shape in sorted(values, key=lambda v: -v[1])[:args.top]:
            print(f"  {size / 2**20:8.1f} MiB  {shape:40s} {name}")
        return 0
    timed = [(name, size, shape, *ranges[name]) for name, size, shape in values
             if name in ranges]
    if not timed:
        sys.exit("xla_live_buffers: no temporary value has a live range in the dump")
    end = max(last for *_, last in timed) + 1
    change = [0] * (end + 1)  # bytes that start / stop being alive at each position
    for _, size, _, first, last in timed:
        change[first] += size
        change[last + 1] -= size
    alive = list(itertools.accumulate(change[:end]))
    peak = max(range(end), key=alive.__getitem__)
    print(f"most temporary bytes alive: {alive[peak] / 2**30:.3f} GiB at #{peak} "
          f"({schedule.get(peak)})")
    at_peak = sorted((v for v in timed if v[3] <= peak <= v[4]), key=lambda v: -v[1])
    for name, size, shape, first, last in at_peak[:args.top]:
        print(f"  {size / 2**20:8.1f} MiB  {shape:40s} {name:36s} #{first}-#{last} "
              f"({schedule.get(first)} .. {schedule.get(last)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
