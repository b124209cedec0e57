"""benchmarks/decode.py (jax_mila.bench.decode) on the embedded checkpoint, CPU: one worker
process per backend, a row per (prompt, batch), the table, the JSON, argument errors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest
import pytest

from jax_mila.bench import decode


class DecodeBenchTest(absltest.TestCase):

    @pytest.mark.slow
    def test_rows_table_and_json(self):
        with tempfile.TemporaryDirectory() as out, mock.patch.dict(os.environ, OUT=out):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                rows = decode.main(["--model", "embedded", "--prompts", "9", "--batches", "2",
                                    "--steps", "3", "--reps", "1", "--backends", "mila"])
            with open(os.path.join(out, "decode.json")) as f:
                saved = json.load(f)
        self.assertEqual([(r["prompt"], r["batch"], r["status"]) for r in rows], [(9, 2, "ok")])
        for r in rows:
            self.assertAlmostEqual(r["tokens_per_s"], r["batch"] * 3 / r["median_s"])
            self.assertGreater(r["cache_bytes_read"], 0)
        self.assertEqual(saved["rows"], rows)
        self.assertIn("| mila | 9 | 2 |", text.getvalue())

    def test_a_worker_that_dies_leaves_marked_rows(self):
        with contextlib.redirect_stdout(io.StringIO()):
            rows = decode.main(["--model", "embedded", "--prompts", "5", "--batches", "1",
                                "--steps", "2", "--backends", "mila", "--timeout", "0.01"])
        self.assertLen(rows, 1)
        self.assertRegex(rows[0]["status"], r"^not run \(timed out after 0 s\)")

    def test_bad_arguments(self):
        for argv, pattern in ((["--prompts", "0"], "--prompts and --batches must be positive"),
                              (["--steps", "0"], "--steps and --reps must be >= 1"),
                              (["--backends", "vllm"], r"--backends: \['vllm'\]")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), self.assertRaises(SystemExit):
                decode.main(argv)
            self.assertIn(pattern.replace("\\", ""), err.getvalue().replace("\\", ""))


if __name__ == "__main__":
    absltest.main()
