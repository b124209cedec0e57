"""jax_mila.gemma4.fidelity on a tiny config (CPU: the kernel path is the reference path, so
every error must be exactly 0), and that its per-layer comparison does see a difference."""

from __future__ import annotations

import json
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from jax_mila.ffi import _registry
from jax_mila.gemma4 import fidelity

SEED = int.from_bytes(os.urandom(4), "little") % 2**31


class FidelityTest(absltest.TestCase):

    def test_tiny_run_writes_the_table_and_json(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "fidelity.json")
            rc = fidelity.main(["--model", "tiny", "--tokens", "40", "--logit-rows", "16",
                                "--prefill-chunk", "16", "--generate-tokens", "6",
                                "--seed", str(SEED), "--out", out])
            with open(out) as f:
                result = json.load(f)
        msg = f"seed {SEED}: {result}"
        self.assertEqual(rc, 0, msg)
        lg = result["forward"]["logits"]
        self.assertEqual(lg["positions"], 40, msg)
        if not _registry.cuda_capabilities():
            # No kernels: both paths are the same computation.
            self.assertEqual((lg["top1_agreement"], lg["max_abs_err"], lg["rel_err"]),
                             (1.0, 0.0, 0.0), msg)
            self.assertGreater(lg["cosine_min"], 1 - 1e-6, msg)  # float32 rounding of the cosine
            self.assertEqual(result["forward"]["layer_rel_err"], [0.0] * 6, msg)
        else:
            # The W4A8 kernels run (the embedded dims are multiples of 128); they equal the
            # reference up to float32 summation order (wgmma: ~1e-4), then bf16 rounding.
            self.assertGreater(lg["cosine_min"], 0.999, msg)
            self.assertLess(max(result["forward"]["layer_rel_err"]), 2e-2, msg)
            self.assertLen(result["forward"]["layer_rel_err"], 6, msg)
        self.assertTrue(result["forward"]["chunked_prefill_last_logits"]["top1_equal"], msg)
        self.assertTrue(result["generate"]["equal"], msg)
        self.assertLen(result["generate"]["kernel_tokens"], 6)

    def test_divergence_reports_both_margins(self):
        ref = np.zeros(5)
        ker = np.zeros(5)
        ref[[1, 3]] = 2.0, 1.5   # the reference picks token 1, by 0.5 over token 3
        ker[[1, 3]] = 1.9, 2.2   # the kernel path picks token 3, by 0.3 over token 1
        d = fidelity.divergence(ref, ker, ref_token=1, kernel_token=3)
        self.assertAlmostEqual(d["reference_margin"], 0.5)
        self.assertAlmostEqual(d["kernel_margin"], 0.3)
        self.assertAlmostEqual(d["max_abs_logit_diff"], 0.7)
        self.assertTrue(d["near_tie"])  # a margin of 0.5 inside a 0.7 difference
        ker[1] = 2.0 - 0.1
        ker[3] = 2.0 + 0.1  # the paths now differ by at most 0.6: still inside
        self.assertTrue(fidelity.divergence(ref, ker, 1, 3)["near_tie"])
        ref[1] = 3.0        # the reference prefers token 1 by 1.5, more than any difference (1.1)
        self.assertFalse(fidelity.divergence(ref, ker, 1, 3)["near_tie"])

    def test_generate_mismatch_reports_the_divergence(self):
        # A kernel path whose third greedy token is changed: the check names that token and
        # measures both paths' logits over the common prefix there.
        real = fidelity.generate

        def flipped(model, ids, n, **kw):
            tokens = real(model, ids, n, **kw)
            return tokens.at[0, 2].add(1) if "cache" in kw else tokens

        with mock.patch.object(fidelity, "generate", flipped):
            g = fidelity.compare_generate(prompt_tokens=12, new_tokens=4, chunk=8, seed=SEED)
        self.assertFalse(g["equal"])
        d = g["divergence"]
        if _registry.cuda_capabilities():  # the kernel path may also differ earlier on its own
            self.assertLessEqual(g["first_mismatch"], 2)
        else:  # the same computation: the flip is the only difference
            self.assertEqual(g["first_mismatch"], 2)
            self.assertEqual(d["max_abs_logit_diff"], 0.0)
            self.assertGreaterEqual(d["reference_margin"], 0.0)
            self.assertAlmostEqual(d["kernel_margin"], -d["reference_margin"])
            # A flip the logits do not explain is a divergence, not a near tie.
            self.assertEqual(d["near_tie"], d["reference_margin"] == 0.0)

    def test_per_layer_error_starts_at_the_perturbed_layer(self):
        cfg = fidelity.model_config("tiny")
        model = fidelity.random_model(cfg, quantize=None, backend="reference", seed=SEED)
        other = nnx.clone(fidelity.with_backend(model, "reference"))
        w = other.layers[3].mlp.down_proj.kernel
        w.set_value(w[...] * 1.5)
        ids = jax.random.randint(jax.random.key(SEED), (1, 24), 3, cfg.vocab_size, jnp.int32)
        res = fidelity.compare_forward(other, model, ids, logit_rows=8)
        err = np.asarray(res["layer_rel_err"])
        msg = f"seed {SEED}: {err}"
        np.testing.assert_array_equal(err[:3], 0, msg)
        self.assertTrue(np.all(err[3:] > 1e-4), msg)
        self.assertGreater(res["logits"]["rel_err"], 0.0, msg)
        self.assertGreater(res["logits"]["max_abs_err"], 0.0, msg)

    def test_with_backend_shares_the_weights(self):
        cfg = fidelity.model_config("tiny", layers=3)
        model = fidelity.random_model(cfg, quantize="w4a8", backend="mila", seed=SEED)
        ref = fidelity.with_backend(model, "reference")
        self.assertEqual(len(ref.layers), 3)
        self.assertEqual(ref.layers[0].self_attn.attn.backend, "reference")
        self.assertEqual(ref.layers[0].mlp.down_proj.backend, "reference")
        self.assertEqual(model.layers[0].mlp.down_proj.backend, "mila")
        self.assertIs(ref.embed_tokens.weight[...], model.embed_tokens.weight[...])


if __name__ == "__main__":
    absltest.main()
