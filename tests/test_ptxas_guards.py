"""ptxas's performance diagnostics on the kernel files that issue wgmma or setmaxnreg, for sm_90a,
where nvcc is installed.

A wgmma batch issued under a branch that ptxas cannot prove warp-uniform makes it serialize
every wgmma of the kernel (a wait after each one), and it says so only in an info line (C7518,
C7520). A seesaw D=512 kernel was once measured that way, its tests and sanitizers all passing.
This compiles each csrc/*/*.cu naming either as the build does for sm_90a and fails on any
C75xx "Potential Performance Loss" line. No GPU needed; skipped without nvcc.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

from absl.testing import absltest
import jax.ffi
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((REPO / "csrc").glob("*/*.cu"))
# ptxas's "Potential Performance Loss" lines are about wgmma batches and setmaxnreg: the files
# naming either are the ones to compile (a file without them, e.g. the mma.sync kernels, cannot
# trip one; compiling every file cost the suite ~30 s more).
SM90_PIPELINE_FILES = [f for f in KERNEL_FILES
                       if any(word in f.read_text() for word in ("wgmma", "setmaxnreg"))]
PERF_LOSS = re.compile(r"\(C75\d\d\).*")


def _ptxas_perf_warnings(source: pathlib.Path, out_dir: str) -> list[str]:
    cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
           "-gencode", "arch=compute_90a,code=sm_90a",
           f"-I{REPO / 'csrc'}", f"-I{jax.ffi.include_dir()}",
           "-c", str(source), "-o", os.path.join(out_dir, source.stem + ".o")]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise AssertionError(f"nvcc failed on {source.relative_to(REPO)}:\n{run.stderr[-2000:]}")
    return PERF_LOSS.findall(run.stdout + run.stderr)


class PtxasGuardsTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        if shutil.which("nvcc") is None:
            self.skipTest("nvcc is not installed")

    def test_kernel_files_exist(self):
        self.assertGreaterEqual(len(KERNEL_FILES), 5, KERNEL_FILES)
        # The Hopper kernels of wgmma and setmaxnreg (attention D=256 and D=512, the W4A8 GEMM).
        self.assertGreaterEqual(len(SM90_PIPELINE_FILES), 4, SM90_PIPELINE_FILES)

    @pytest.mark.slow
    def test_no_wgmma_serialization_or_other_performance_loss_on_sm90a(self):
        with tempfile.TemporaryDirectory() as out_dir, \
                concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            found = dict(zip(SM90_PIPELINE_FILES, pool.map(
                lambda f: _ptxas_perf_warnings(f, out_dir), SM90_PIPELINE_FILES)))
        problems = {str(f.relative_to(REPO)): w for f, w in found.items() if w}
        self.assertEqual(problems, {}, "ptxas reports a performance loss (see the module doc)")

    def test_the_guard_sees_a_serialized_wgmma(self):
        # Negative control: a kernel whose only wgmma sits under a thread-dependent branch, with
        # another batch in flight (the seesaw kernel's first version, reduced).
        src = r'''
#include <cstdint>
#include "common/ptx_sm90.cuh"
namespace hx = ::mila::ptx::sm90;
__global__ void k(uint64_t da, uint64_t db, float* out) {
  float s[32], t[32];
  for (int e = 0; e < 32; ++e) s[e] = t[e] = 0.f;
  hx::wgmma_fence();
  hx::wgmma_m64n64k16_ss<true>(s, da, db);
  hx::wgmma_commit();
  if (threadIdx.x / 128 == 1) {
    hx::wgmma_m64n64k16_ss<true>(t, da, db);
    hx::wgmma_commit();
  }
  hx::wgmma_wait<0>();
  for (int e = 0; e < 32; ++e) out[threadIdx.x * 32 + e] = s[e] + t[e];
}
'''
        with tempfile.TemporaryDirectory() as out_dir:
            path = pathlib.Path(out_dir) / "serialized.cu"
            path.write_text(src)
            warnings = _ptxas_perf_warnings(path, out_dir)
        # C7518 or C7520 (WG.DP or WG.AR in a divergent path): both serialize every wgmma.
        self.assertTrue(any("serialized" in w for w in warnings), warnings)


if __name__ == "__main__":
    absltest.main()
