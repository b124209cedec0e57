"""Context-parallel prefill across processes (multi-controller JAX, as on several hosts or one
process per GPU): two processes joined by jax.distributed on CPU devices with gloo collectives
each run tests/multiprocess_prefill_worker.py. The sharded prefill over both processes' devices
must equal each process's own single-device prefill (float32 logits, and the process's block of
the position-sharded cache). The same mode runs compute-sanitizer over two GPUs
(scripts/sanitize_kernels.py --num-processes)."""

import json
import os
import socket
import subprocess
import sys

from absl.testing import absltest
import numpy as np
import pytest

import jax_mila
from test_parallel_chunked import _assert_close_logits

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_prefill_worker.py")
PROCESSES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class MultiProcessPrefillTest(absltest.TestCase):

    @pytest.mark.slow
    def test_two_processes_equal_one_device(self):
        seed = int(np.random.SeedSequence().entropy % (2**31))
        coordinator = f"localhost:{_free_port()}"
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one CPU device a process
        # The workers import the jax_mila this test imported (the installed one, or the tree).
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(jax_mila.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        procs = [subprocess.Popen([sys.executable, WORKER, coordinator, str(PROCESSES), str(i),
                                   str(seed)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for i in range(PROCESSES)]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=240)
                self.assertEqual(p.returncode, 0, f"seed={seed}: worker failed:\n{err[-3000:]}")
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                p.kill()
        for r in outs:
            ctx = f"seed={seed}, process {r['process']}"
            self.assertEqual((r["devices"], r["local_devices"]), (PROCESSES, 1), ctx)
            _assert_close_logits(self, r["got"], r["want"], f"{seed} (process {r['process']})",
                                 [lambda r=r: r["reordered"]])  # the model's own reordering
            self.assertLessEqual(r["cache_err"], 1e-4, ctx)
            self.assertTrue(r["unwritten_zero"], ctx)
            self.assertEqual(r["local_slots"] * PROCESSES, r["capacity"], ctx)


if __name__ == "__main__":
    absltest.main()
