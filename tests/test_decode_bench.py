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

    def test_op_split_per_step(self):
        # A profiled point of 4 steps: 2 ms of GEMV and 0.4 ms of decode attention in all, the
        # device busy 3 ms and idle 1 ms: per step 500 / 100 us, 750 / 250 us.
        split = {"attn decode": 0.4, "w4a8 gemv": 2.0, "other": 0.6, "total": 3.0,
                 "kernels": 40, "top_other": [["loop_add_fusion", 0.6]],
                 "timeline": {"/device:GPU:0": {"span_ms": 4.0, "busy_ms": 3.0, "idle_ms": 1.0}}}
        row = dict(backend="mila", prompt=9, batch=2, steps=4, status="ok", tokens_per_s=8.0,
                   ms_per_step=1.0, split_ms=split, split_note="profiled")
        text = decode.report([row, dict(row, prompt=5, split_ms=None, split_note="CPU: none")])
        self.assertIn("| mila | 9 | 2 | 10 | 750 | 250 | 100 | 500 | 150 |", text)
        self.assertIn("| backend | prompt | batch | kernels/step | busy | idle | attn decode | "
                      "w4a8 gemv | other |", text)
        self.assertIn("loop_add_fusion 150.0 us/step", text)
        self.assertIn("op split: CPU: none", text)

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
