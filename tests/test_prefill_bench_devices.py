"""The prefill benchmark over several devices (--devices, context parallelism) and random
models built replicated on a mesh, on forced host devices (tests/conftest.py; the benchmark's
worker processes get JAX_NUM_CPU_DEVICES)."""

from __future__ import annotations

import contextlib
import io
import os
from unittest import mock

from absl.testing import absltest
from flax import nnx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from jax_mila.bench import prefill as bench
from jax_mila.gemma4 import random_init


class ReplicatedRandomModelTest(absltest.TestCase):

    def test_replicated_build_equals_the_single_device_one(self):
        if len(jax.devices("cpu")) < 2:
            self.skipTest("needs 2 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
        seed = int(np.random.default_rng().integers(1 << 30))
        mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("seq",))
        replicated = NamedSharding(mesh, P())
        with jax.default_device(jax.devices("cpu")[0]):  # both builds on one platform
            got = nnx.state(random_init.random_model("embedded", seed=seed, sharding=replicated))
            want = nnx.state(random_init.random_model("embedded", seed=seed))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            self.assertTrue(x.sharding.is_equivalent_to(replicated, x.ndim), msg=str(x.sharding))
            for shard in x.addressable_shards:  # every device holds the whole, equal array
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(y),
                                              err_msg=f"seed {seed}")


class DevicesBenchTest(absltest.TestCase):

    @pytest.mark.slow
    def test_cpu_run_on_one_and_two_devices(self):
        out = io.StringIO()
        # The workers on 2 CPU devices wherever this runs (a GPU machine may have one GPU).
        with mock.patch.dict(os.environ, {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}), \
                contextlib.redirect_stdout(out):
            rows = bench.main(["--model", "embedded", "--seqs", "40", "--backends", "reference",
                               "--devices", "2,1", "--reps", "1", "--chunk-size", "15",
                               "--seq-segments", "2", "--no-profile", "--memory-plan"])
        text = out.getvalue()
        by = {r.get("devices", 1): r for r in rows}
        self.assertEqual(sorted(by), [1, 2], msg=str(rows))
        for r in rows:
            self.assertEqual(r["status"], "ok", msg=str(r))
            self.assertTrue(r["finite"], msg=str(r))
        # XLA's plan of the context-parallel step, per device (--memory-plan).
        self.assertGreater(by[2]["plan_temp_bytes"], 0, msg=str(by[2]))
        self.assertEqual(by[1]["chunk"], 15)
        self.assertEqual(by[2]["chunk"], 16)  # rounded up to a multiple of the devices
        # The full-attention layers' cache is split over the two devices.
        self.assertLess(by[2]["cache_bytes"], by[1]["cache_bytes"])
        self.assertIn("| seq | reference tok/s | reference x2 tok/s |", text)
        self.assertRegex(text, r"\| reference \| 40 \| 2 \| [\d,]+ \| [\d,]+ \| [\d.]+x \| \d+% \|")

    def test_scaling_table(self):
        rows = [dict(backend="mila", seq=8, status="ok", tokens_per_s=100.0, median_s=0.08,
                     first_s=1.0, chunk=8, peak_bytes=4 * 2**30),
                dict(backend="mila", seq=8, devices=2, status="ok", tokens_per_s=180.0,
                     median_s=0.044, first_s=1.0, chunk=8, peak_bytes=3 * 2**30,
                     peak_bytes_per_device=[3 * 2**30, 2 * 2**30]),
                dict(backend="mila", seq=16, devices=2, status="OOM")]
        text = bench.report(rows, ["mila"], [8, 16])
        self.assertIn("| mila | 8 | 2 | 180 | 100 | 1.80x | 90% | 3.00 GiB / 2.00 GiB | 4.00 GiB |",
                      text)
        self.assertIn("| mila | 16 | 2 | OOM |", text)
        self.assertIn("| 8 | 100 | 180 |", text)

    def test_bad_device_counts_exit(self):
        for argv in (["--devices", "0"], ["--devices", "x"], ["--seq-segments", "3"]):
            with self.assertRaises(SystemExit, msg=str(argv)), \
                    contextlib.redirect_stderr(io.StringIO()):
                bench.main(argv)


if __name__ == "__main__":
    absltest.main()
