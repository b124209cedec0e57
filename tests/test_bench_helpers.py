"""The benchmarks' timing helpers, without a GPU: jax_mila/bench/timing.py's GpuSampler (the clock
and power beside every GEMM number) against a stand-in nvidia-smi on PATH,
benchmarks/gemm.py's trial scheduling (one path after another, or interleaved), and the device
time per call of short ops (jax_mila/bench/trace.py's windows over synthetic traces)."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import sys
import tempfile
import time
from unittest import mock

import jax.numpy as jnp
from absl.testing import absltest, parameterized

from jax_mila.bench import timing, trace
import testing  # tests/testing.py


def _load(name):
    return testing.load_script(f"benchmarks/{name}.py")


def _load_bench():
    return timing


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


def _device_trace(kernels, annotations=(), host_kernels=()):
    """A perfetto trace as jax.profiler writes it on a GPU: kernels (tid, name, ts, dur) on
    /device:GPU:0's threads (7, 8: streams; 9: the derived "XLA Ops" line), annotations
    (name, ts, dur) on the host's python thread, host_kernels (name, ts, dur) on
    the device's "XLA Ops" line only."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    meta += [{"ph": "M", "pid": p, "tid": t, "name": "thread_name", "args": {"name": n}}
             for (p, t), n in {(1, 7): "Stream #7(Compute)", (1, 8): "Stream #8(Compute)",
                               (1, 9): "XLA Ops", (2, 1): "python3"}.items()]
    events = [{"ph": "X", "pid": 1, "tid": t, "name": n, "ts": ts, "dur": d}
              for t, n, ts, d in kernels]
    events += [{"ph": "X", "pid": 2, "tid": 1, "name": n, "ts": ts, "dur": d}
               for n, ts, d in annotations]
    events += [{"ph": "X", "pid": 1, "tid": 9, "name": n, "ts": ts, "dur": d}
               for n, ts, d in host_kernels]
    return {"traceEvents": meta + events}


_REPS = (("rep 0", 100.0, 100.0), ("rep 1", 300.0, 100.0))
_KERNELS = (
    (7, "warm_up_fusion", 10.0, 30.0),      # before the timed windows: left out
    (7, "rms_norm_rope_kernel", 110.0, 20.0),
    (8, "loop_fusion", 150.0, 10.0),        # a second stream: counted too
    (7, "stray_fusion", 260.0, 10.0),       # between the windows, nearer rep 1
    (9, "custom-call.1", 110.0, 20.0),      # XLA Ops repeats stream 7's kernel: left out
    (7, "rms_norm_rope_kernel", 310.0, 40.0),
    (7, "rms_norm_rope_kernel", 398.0, 6.0),  # midpoint 401: rep 1's only with slack
    (7, "after_fusion", 600.0, 50.0),       # after the last window: left out
)


class DeviceTimeWindowsTest(parameterized.TestCase):

    def test_host_windows_in_the_order_of_the_names(self):
        t = _device_trace(_KERNELS, _REPS, host_kernels=[("rep 0", 0.0, 5.0)])
        self.assertEqual(trace.host_windows(t, ["rep 1", "rep 0"]),
                         [(300.0, 400.0), (100.0, 200.0)])
        # A name the trace lacks is left out; a device event of that name is no window.
        self.assertEqual(trace.host_windows(t, ["rep 0", "rep 9"]), [(100.0, 200.0)])

    @parameterized.named_parameters(
        ("exact_windows", 0.0, [30e-6, 40e-6]),
        ("with_slack", 5.0, [30e-6, 46e-6]),
        ("nearest_window", 70.0, [30e-6, 56e-6]))  # both take the stray one: rep 1 gets it
    def test_stream_kernels_inside_the_windows(self, slack_us, want):
        t = _device_trace(_KERNELS, _REPS)
        got = trace.device_seconds_in_windows(t, trace.host_windows(t, ["rep 0", "rep 1"]),
                                              slack_us=slack_us)
        self.assertLen(got, 2)
        for g, w in zip(got, want):
            self.assertAlmostEqual(g, w, delta=1e-12)

    @parameterized.named_parameters(
        ("empty_trace", {"traceEvents": []}),
        ("cpu_run", _device_trace([], _REPS)),  # annotations, no device kernels
        ("kernels_outside_the_windows", _device_trace(_KERNELS[:1], _REPS)))
    def test_none_without_device_kernels_in_the_windows(self, t):
        windows = trace.host_windows(t, ["rep 0", "rep 1"])
        self.assertIsNone(trace.device_seconds_in_windows(t, windows))


class MedianDeviceSecondsTest(absltest.TestCase):

    def test_median_per_call_of_the_traced_reps(self):
        bench = _load_bench()
        names = [bench._REP_NAME.format(r) for r in range(3)]
        reps = [(names[0], 100.0, 100.0), (names[1], 300.0, 100.0), (names[2], 500.0, 100.0)]
        kernels = [(7, "k", 110.0, 40.0), (7, "k", 310.0, 20.0), (8, "k", 350.0, 10.0),
                   (7, "k", 510.0, 90.0)]
        with mock.patch.object(bench, "_profiled_reps", return_value=_device_trace(kernels, reps)):
            got = bench.median_device_seconds_per_call(jnp.sin, [(jnp.ones(4),)], calls=10,
                                                       reps=3)
        self.assertAlmostEqual(got, 40e-6 / 10, delta=1e-15)  # reps of 40, 30, 90 us

    def test_cpu_falls_back_to_none(self):
        # The real profiler on the CPU backend: a trace without device kernels.
        bench = _load_bench()
        self.assertIsNone(bench.median_device_seconds_per_call(
            jnp.sin, [(jnp.ones(16),), (jnp.ones(16),)], calls=3, warmup=1, reps=2))
        timing = bench.time_per_call(jnp.sin, [(jnp.ones(16),)])
        self.assertIsNone(timing["device_us"])
        self.assertGreater(timing["wall_us"], 0)
        self.assertEqual(bench.cell(timing["device_us"]), "-")
        self.assertIsNone(bench.tb_per_s(1000, None))
        self.assertAlmostEqual(bench.tb_per_s(4_000_000, 2.0), 2.0)  # 4 MB in 2 us


    def test_copy_bandwidth_is_none_on_cpu_without_touching_its_buffers(self):
        # The decode benchmark asks for a 1 GiB copy's bandwidth: on a CPU, None at once
        # (passes over 2 GiB of buffers there took tens of seconds for nothing).
        bench = _load_bench()
        with mock.patch.object(jnp, "full", side_effect=AssertionError("allocated")):
            self.assertIsNone(bench.copy_device_seconds(1 << 30))


class GemmKernelsScriptTest(absltest.TestCase):

    def test_both_paths_on_the_cpu(self):
        # benchmarks/gemm_kernels.py end to end on the CPU backend: the W4A8 path (the reference)
        # and XLA's scaled FP8 path each get a row; the CPU trace holds no device kernels, so
        # their device time is 0 and their kernel list empty.
        out = io.StringIO()
        with mock.patch.dict(os.environ), contextlib.redirect_stdout(out), mock.patch.object(
                sys, "argv", ["gemm_kernels.py", "--m", "8", "--only", "o_proj_sliding",
                              "--calls", "2", "--rounds", "1"]):
            _load("gemm_kernels").main()
        rows = [line for line in out.getvalue().splitlines() if line.startswith("| o_proj")]
        self.assertLen(rows, 2, out.getvalue())
        self.assertIn("w4a8 auto", rows[0])
        self.assertIn("XLA FP8 + scales", rows[1])
        self.assertTrue(all(row.split("|")[6].strip() == "0" for row in rows), rows)


class GemmDecodeLaunchesTest(absltest.TestCase):

    def test_launches_run_without_the_profiler(self):
        # --decode --launches: each launch run untimed, no trace started (ncu and
        # compute-sanitizer cannot share the process with the profiler).
        gemm = _load("gemm")
        out = io.StringIO()
        with contextlib.redirect_stdout(out), mock.patch.object(
                sys, "argv", ["gemm.py", "--decode", "--only", "12b_k_global", "--m", "1,3",
                              "--launches", "2"]), \
                mock.patch.object(gemm, "copy_device_seconds",
                                  side_effect=AssertionError("timed")), \
                mock.patch.object(gemm, "median_device_seconds_per_call",
                                  side_effect=AssertionError("timed")):
            gemm.main()
        self.assertIn("12b_k_global M=1: 2 launches", out.getvalue())
        self.assertIn("12b_k_global M=3: 2 launches", out.getvalue())

    def test_launches_needs_decode(self):
        with mock.patch.object(sys, "argv", ["gemm.py", "--launches", "2"]), \
                contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            _load("gemm").main()


if __name__ == "__main__":
    absltest.main()
