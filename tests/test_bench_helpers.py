"""The benchmarks' timing helpers, without a GPU: benchmarks/_bench.py's GpuSampler (the clock
and power beside every GEMM number) against a stand-in nvidia-smi on PATH, and
benchmarks/gemm.py's trial scheduling (one path after another, or interleaved)."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest

_BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_bench():
    return _load("_bench")


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
        self.assertEqual(sampler.window([(t0, t1)]), (1500.0, 650.5))
        self.assertEqual(sampler.window([(t0, t1), (before - 10, before - 5)]), (1500.0, 650.5))
        self.assertEqual(sampler.window([(before - 10, before - 5)]), (None, None))

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
        self.assertEqual(sampler.window([(0, time.monotonic())]), (None, None))
        sampler.close()


class _FakeTimer:
    """Records the order of its calls in a shared log; fails on the given call if asked."""

    def __init__(self, name, log, seconds, fail_at=None):
        self.name, self.log, self.seconds, self.fail_at = name, log, seconds, fail_at

    def warmup(self):
        self.log.append((self.name, "warmup"))

    def trial(self):
        self.log.append((self.name, "trial"))
        calls = sum(1 for who, _ in self.log if who == self.name)
        if self.fail_at is not None and calls > self.fail_at:
            raise RuntimeError(f"{self.name} broke")
        return self.seconds.pop(0)


class TrialScheduleTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        sys.path.insert(0, _BENCHMARKS)  # gemm.py imports _bench from beside it
        self.addCleanup(sys.path.remove, _BENCHMARKS)
        # Its import sets XLA_PYTHON_CLIENT_MEM_FRACTION for the benchmark's own process; it
        # must not reach the tests that run after this one.
        with mock.patch.dict(os.environ):
            self.gemm = _load("gemm")

    def test_sequential_then_interleaved_order(self):
        for interleave, want in (
                (False, ["a warmup", "a trial", "a trial", "a trial",
                         "b warmup", "b trial", "b trial", "b trial"]),
                (True, ["a warmup", "b warmup", "a trial", "b trial", "a trial", "b trial",
                        "a trial", "b trial"])):
            log = []
            timers = {"a": _FakeTimer("a", log, [3.0, 1.0, 2.0]),
                      "b": _FakeTimer("b", log, [5.0, 4.0, 6.0])}
            out = self.gemm._time_all(timers, 3, interleave)
            self.assertEqual([" ".join(e) for e in log], want, msg=f"interleave={interleave}")
            self.assertEqual(out["a"][0], 2.0)  # medians
            self.assertEqual(out["b"][0], 5.0)
            for key in "ab":
                self.assertLen(out[key][1], 3)  # one window per trial, in time order
                self.assertTrue(all(t0 <= t1 for t0, t1 in out[key][1]))

    def test_a_failing_path_does_not_stop_the_others(self):
        for interleave in (False, True):
            log = []
            timers = {"bad": _FakeTimer("bad", log, [1.0] * 3, fail_at=2),
                      "good": _FakeTimer("good", log, [1.0, 2.0, 3.0])}
            out = self.gemm._time_all(timers, 3, interleave)
            self.assertIsInstance(out["bad"], RuntimeError)
            self.assertEqual(out["good"][0], 2.0)
            self.assertLen(out["good"][1], 3)


if __name__ == "__main__":
    absltest.main()
