"""W4A8 main-loop roofline on Hopper: builds benchmarks/micro/wgmma_fp8_loop.cu with nvcc and
runs it (one CTA per SM; the wgmma_ws consumers' loop with its loads taken away, as chained
accumulation, with the kernel's promotion, with promotion plus weight conversion, with random
instead of constant data; then with the kernel's surroundings put back one at a time: its
384-thread launch with the 5-stage full/empty mbarrier ring and a producer warp, the producer's
TMA loads and exponent copies, and the kernel's own consumer chain). Its header says what each
variant keeps. Prints a table, one line per variant: time, TFLOP/s over all SMs, the SM clock.
Needs an sm_90 GPU and nvcc (PATH, $CUDA_HOME or /usr/local/cuda).

    python3 benchmarks/wgmma_loop.py [--tiles 4096]
    python3 benchmarks/wgmma_loop.py --micro alu_overlap [--tiles 20000]
    python3 benchmarks/wgmma_loop.py --micro smem_traffic [--tiles 20000]
    python3 benchmarks/wgmma_loop.py --micro gemv_stream [--tiles 50]

--micro alu_overlap runs benchmarks/micro/wgmma_alu_overlap.cu instead: whether integer work
beside FP8 wgmmas in flight slows them, with A from registers or from shared memory (--tiles is
then its number of 8-wgmma batches). --micro smem_traffic runs benchmarks/micro/wgmma_smem_traffic.cu:
how much shared-memory bandwidth other warps get beside FP8 wgmmas at the full rate (--tiles: its
number of 8-wgmma batches). --micro gemv_stream runs benchmarks/micro/gemv_stream.cu: what a
decode GEMV launch of the 12B costs before its arithmetic (an empty launch of its grid, plain and
as clusters; its bytes streamed with the GEMV's access pattern, coalesced, and copied; --tiles:
launches a CUDA graph).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --micro: its source under benchmarks/micro and the default of the count it takes.
MICROS = {"loop": ("wgmma_fp8_loop.cu", 4096), "alu_overlap": ("wgmma_alu_overlap.cu", 20000),
          "smem_traffic": ("wgmma_smem_traffic.cu", 20000), "gemv_stream": ("gemv_stream.cu", 50)}


def _nvcc() -> str:
    found = shutil.which("nvcc")
    if found:
        return found
    path = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(path):
        sys.exit("wgmma_loop: nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", choices=sorted(MICROS), default="loop")
    parser.add_argument("--tiles", type=int, default=None,
                        help="K tiles per CTA, even (default 4096); alu_overlap, "
                             "smem_traffic: batches (default 20000); gemv_stream: launches "
                             "a graph (default 50)")
    args = parser.parse_args()
    name, default_count = MICROS[args.micro]
    source = os.path.join(ROOT, "benchmarks", "micro", name)
    tiles = default_count if args.tiles is None else args.tiles
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, args.micro)
        subprocess.run([_nvcc(), "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                        "-DMILA_HAS_SM90A", "-I", os.path.join(ROOT, "csrc"), source, "-o", exe],
                       check=True)
        return subprocess.run([exe, str(tiles)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
