"""tests/conftest.py's hooks that change what a run prints."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest

TESTS = pathlib.Path(__file__).resolve().parent


class InstafailTest(absltest.TestCase):

    def _run(self, env_value: str | None) -> subprocess.CompletedProcess:
        # A failing test beside a copy of the suite's conftest.py, run with no summary
        # (--tb=no -rN): what the hook writes is all that names the failure.
        with tempfile.TemporaryDirectory() as d:
            shutil.copy(TESTS / "conftest.py", d)
            probe = pathlib.Path(d) / "test_probe.py"
            probe.write_text("def test_fails():\n    assert 1 == 2, 'the probe fails'\n")
            env = {k: v for k, v in os.environ.items() if k != "JAX_MILA_TEST_INSTAFAIL"}
            # Its own session must not share, and at its end delete, this suite's XLA cache.
            env["JAX_MILA_TEST_XLA_CACHE"] = "off"
            if env_value is not None:
                env["JAX_MILA_TEST_INSTAFAIL"] = env_value
            return subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rN", "-o", "addopts=",
                 "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", d, str(probe)],
                capture_output=True, text=True, env=env, cwd=d, timeout=240)

    def test_failure_is_written_as_it_happens(self):
        run = self._run("1")
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertIn("=== FAILED", run.stderr)
        self.assertIn("test_probe.py::test_fails (call)", run.stderr)
        self.assertIn("the probe fails", run.stderr)

    def test_off_by_default(self):
        run = self._run(None)
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        self.assertNotIn("=== FAILED", run.stderr + run.stdout)


if __name__ == "__main__":
    absltest.main()
