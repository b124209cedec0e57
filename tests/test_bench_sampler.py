"""benchmarks/_bench.py's GpuSampler (the clock and power beside every GEMM number), against a
stand-in nvidia-smi on PATH: no GPU needed."""

from __future__ import annotations

import importlib.util
import os
import stat
import tempfile
import time
from unittest import mock

from absl.testing import absltest

_BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "_bench.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("_bench", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Streams "clock, power" lines (one unparsable reading among them) with -lms; answers the
# sampler's probe of power.draw.instant with an exit status of its choosing.
_FAKE = """#!/bin/sh
case "$*" in
  *-lms*) i=0; while true; do i=$((i + 1))
            if [ $((i % 5)) = 0 ]; then echo "[N/A], [N/A]"; else echo "1500, 650.5"; fi
            sleep 0.01; done ;;
  *) exit {probe_status} ;;
esac
"""


class GpuSamplerTest(absltest.TestCase):

    def _sampler(self, probe_status=0):
        tmp = self.enter_context(tempfile.TemporaryDirectory())
        path = os.path.join(tmp, "nvidia-smi")
        with open(path, "w") as f:
            f.write(_FAKE.format(probe_status=probe_status))
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
        self.enter_context(mock.patch.dict(os.environ, {"PATH": tmp + os.pathsep +
                                                        os.environ.get("PATH", "")}))
        bench = _load_bench()
        with mock.patch.object(bench.subprocess, "Popen", wraps=bench.subprocess.Popen) as popen:
            sampler = bench.GpuSampler(interval_ms=10)
        self.addCleanup(sampler.close)
        return sampler, popen.call_args.args[0]

    def test_medians_inside_the_window_only(self):
        sampler, _ = self._sampler()
        before = time.monotonic()
        time.sleep(0.5)
        t0 = time.monotonic()
        time.sleep(0.5)
        t1 = time.monotonic()
        self.assertEqual(sampler.window(t0, t1), (1500.0, 650.5))
        self.assertEqual(sampler.window(before - 10, before - 5), (None, None))

    def test_instant_power_when_the_driver_has_it(self):
        _, argv = self._sampler(probe_status=0)
        self.assertIn("--query-gpu=clocks.sm,power.draw.instant", argv)
        _, argv = self._sampler(probe_status=6)
        self.assertIn("--query-gpu=clocks.sm,power.draw", argv)

    def test_close_stops_the_sampling_process(self):
        sampler, _ = self._sampler()
        sampler.close()
        self.assertIsNotNone(sampler._proc.poll())

    def test_without_nvidia_smi(self):
        bench = _load_bench()
        with mock.patch.object(bench.shutil, "which", return_value=None):
            sampler = bench.GpuSampler()
        self.assertEqual(sampler.window(0, time.monotonic()), (None, None))
        sampler.close()


if __name__ == "__main__":
    absltest.main()
