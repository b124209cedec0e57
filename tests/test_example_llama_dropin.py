"""examples/llama_dropin.py runs end to end with --tiny (CPU sizes; the reference paths here).

Its plain flax.nnx decoder (head dims 128 and 256 alternating, GQA) goes through both drop-in
calls: every linear is swapped, the head-dim-128 layers' attention falls back (logged), the
attention swap alone leaves the outputs at bf16 noise (exactly jax's on CPU, where every call
falls back), and the W4A8 model's final hidden states sit within the format's error (two layers
of ~0.12 per projection: measured 0.38 on CPU) but not at zero.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile

from absl.testing import absltest

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "llama_dropin.py")


def _load():
    spec = importlib.util.spec_from_file_location("llama_dropin", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ExampleTest(absltest.TestCase):

    def test_tiny_run(self):
        example = _load()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            result = example.main(["--tiny", "--reps", "1", "--json", path])
            with open(path) as f:
                self.assertEqual(json.load(f)["swapped"], result["swapped"])
        self.assertEqual(result["swapped"], 2 * 7 + 1)  # q, k, v, o, gate, up, down; lm_head
        self.assertEqual(result["kept"], [])
        self.assertTrue(any(f.startswith("dot_product_attention: head_dim=128")
                            for f in result["fallbacks"]), result["fallbacks"])
        runs = result["runs"]
        self.assertLess(runs["attention"]["hidden_rel_err"], 0.02)
        self.assertGreaterEqual(runs["attention"]["top1_agree"], 0.95)
        self.assertGreater(runs["w4a8"]["hidden_rel_err"], 0.05)
        self.assertLess(runs["w4a8"]["hidden_rel_err"], 0.6)
        for run in runs.values():
            self.assertGreater(run["seconds"], 0)


if __name__ == "__main__":
    absltest.main()
