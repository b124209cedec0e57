"""Checkpoint loading: formats, skipped tensors, and the errors for broken checkpoints and
unsupported configs (embedded checkpoint as the source; no transformers needed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from safetensors.flax import load_file, save_file

from jax_mila import gemma4
from jax_mila.gemma4.loader import CheckpointError

PREFIX = "model."


class LoaderTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.src = gemma4.embedded_checkpoint()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name
        for name in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(self.src, name), self.dir)

    def _tensors(self):
        return load_file(os.path.join(self.dir, "model.safetensors"))

    def _write(self, tensors):
        save_file(tensors, os.path.join(self.dir, "model.safetensors"))

    def _config(self, **changes):
        path = os.path.join(self.dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(changes)
        with open(path, "w") as f:
            json.dump(cfg, f)

    def test_embedded_loads_every_parameter(self):
        model = gemma4.from_pretrained(self.dir, dtype=jnp.float32)
        cfg = model.config
        self.assertEqual(cfg.layer_types.count("full_attention"), 2)
        self.assertLess(cfg.sliding_window, 64)
        # Transposed to Flax layout once: q_proj kernel is [in, out].
        q = model.layers[0].self_attn.q_proj.kernel[...]
        want = self._tensors()[PREFIX + "layers.0.self_attn.q_proj.weight"]
        np.testing.assert_array_equal(np.asarray(q), np.asarray(want, np.float32).T)
        # K=V full layer: no v_proj parameter at all.
        self.assertFalse(hasattr(model.layers[2].self_attn, "v_proj"))

    def test_missing_tensor_names_it(self):
        tensors = self._tensors()
        del tensors[PREFIX + "layers.1.mlp.up_proj.weight"]
        self._write(tensors)
        with self.assertRaisesRegex(CheckpointError,
                                    r"model\.layers\.1\.mlp\.up_proj\.weight is missing \(expected shape \[256, 128\]\)"):
            gemma4.from_pretrained(self.dir)

    def test_misshaped_tensor_names_shapes(self):
        tensors = self._tensors()
        tensors[PREFIX + "layers.2.self_attn.k_norm.weight"] = jnp.ones((32,), jnp.bfloat16)
        self._write(tensors)
        with self.assertRaisesRegex(CheckpointError, r"layers\.2\.self_attn\.k_norm\.weight has "
                                                     r"shape \[32\], expected \[64\]"):
            gemma4.from_pretrained(self.dir)

    def test_sharded_language_model_prefix_and_skipped_towers(self):
        """Index + shards, model.language_model.* names, a vision tensor and a tied lm_head."""
        tensors = {("model.language_model." + k[len(PREFIX):]): v for k, v in self._tensors().items()}
        tensors["model.vision_tower.encoder.weight"] = jnp.zeros((3, 3), jnp.bfloat16)
        tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"]
        os.remove(os.path.join(self.dir, "model.safetensors"))
        names = sorted(tensors)
        shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
        weight_map = {}
        for file, part in shards.items():
            save_file({n: tensors[n] for n in part}, os.path.join(self.dir, file))
            weight_map.update({n: file for n in part})
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        with open(os.path.join(self.dir, "config.json")) as f:
            text = json.load(f)
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump({"model_type": "gemma4", "text_config": text}, f)
        ids = np.arange(3, 15, dtype=np.int32)[None]
        got = gemma4.forward(gemma4.from_pretrained(self.dir, dtype=jnp.float32), ids)
        want = gemma4.forward(gemma4.from_pretrained(self.src, dtype=jnp.float32), ids)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_unused_kv_shared_tensors_are_skipped(self):
        self._config(num_kv_shared_layers=2)  # layers 4, 5 reuse the K/V of layers 3 and 2
        tensors = self._tensors()   # still has k_proj / k_norm of layers 4 and 5: ignored
        self.assertIn(PREFIX + "layers.5.self_attn.k_proj.weight", tensors)
        model = gemma4.from_pretrained(self.dir, dtype=jnp.float32)
        self.assertFalse(hasattr(model.layers[5].self_attn, "k_proj"))
        self.assertEqual(model.config.kv_sources, {"sliding_attention": 3, "full_attention": 2})

    @parameterized.named_parameters(
        ("nan_bf16", "layers.1.mlp.up_proj.weight", (3, 7), jnp.nan, jnp.bfloat16),
        ("inf_f32", "layers.0.self_attn.q_norm.weight", (5,), jnp.inf, jnp.float32),
        ("neg_inf_embedding", "embed_tokens.weight", (11, 2), -jnp.inf, jnp.bfloat16),
    )
    def test_non_finite_weight_is_refused_naming_it(self, leaf, index, value, dtype):
        tensors = self._tensors()
        name = PREFIX + leaf
        tensors[name] = tensors[name].astype(dtype).at[index].set(value)
        self._write(tensors)
        for quantize in (None, "w4a8"):  # dense, and quantized on load
            with self.subTest(quantize=quantize), self.assertRaisesRegex(
                    CheckpointError, rf"{name.replace('.', '[.]')}: contains 1 NaN/inf value|"
                                     rf"tensor {name.replace('.', '[.]')} contains 1 NaN/inf "
                                     rf"value\(s\) \(in (bfloat16|float32)\), first at index "
                                     rf"{re.escape(str(index))}"):
                gemma4.from_pretrained(self.dir, quantize=quantize)

    def test_float32_value_past_bfloat16_is_refused(self):
        tensors = self._tensors()
        name = PREFIX + "layers.0.input_layernorm.weight"
        tensors[name] = tensors[name].astype(jnp.float32).at[2].set(3.4e38)  # rounds to inf in bf16
        self._write(tensors)
        gemma4.from_pretrained(self.dir, dtype=jnp.float32)  # finite in the model's float32
        with self.assertRaisesRegex(CheckpointError, rf"{re.escape(name)} contains 1 NaN/inf "
                                                     r"value\(s\) \(in bfloat16\)"):
            gemma4.from_pretrained(self.dir, dtype=jnp.bfloat16)

    @parameterized.parameters(jnp.int8, jnp.int32, jnp.uint8, jnp.bool_)
    def test_non_float_weight_is_refused_not_cast(self, dtype):
        tensors = self._tensors()
        name = PREFIX + "layers.3.mlp.down_proj.weight"
        tensors[name] = tensors[name].astype(dtype)
        self._write(tensors)
        for quantize in (None, "w4a8"):
            with self.subTest(quantize=quantize), self.assertRaisesRegex(
                    CheckpointError, rf"tensor {re.escape(name)} has dtype {jnp.dtype(dtype).name} "
                                     r"\(supported: bfloat16, float16, float32\)"):
                gemma4.from_pretrained(self.dir, quantize=quantize)

    def test_float16_and_float32_weights_load(self):
        tensors = self._tensors()
        tensors[PREFIX + "layers.0.mlp.up_proj.weight"] = tensors[PREFIX + "layers.0.mlp.up_proj.weight"].astype(jnp.float16)
        tensors[PREFIX + "layers.1.mlp.up_proj.weight"] = tensors[PREFIX + "layers.1.mlp.up_proj.weight"].astype(jnp.float32)
        self._write(tensors)
        ids = np.arange(3, 12, dtype=np.int32)[None]
        got = gemma4.forward(gemma4.from_pretrained(self.dir, dtype=jnp.float32), ids)
        want = gemma4.forward(gemma4.from_pretrained(self.src, dtype=jnp.float32), ids)
        # float16 rounds the smallest bf16 weights (subnormal in float16): close, not equal.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-2)

    @parameterized.named_parameters(
        ("truncated", lambda b: b[:len(b) // 2], "incomplete metadata"),
        ("header_only", lambda b: b[:20], "invalid header length"),
        ("not_safetensors", lambda b: b"<html>404</html>" * 4, "header too large"),
        ("empty", lambda b: b"", "header too small"),
    )
    def test_unreadable_file_is_named(self, damage, reason):
        path = os.path.join(self.dir, "model.safetensors")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(damage(data))
        with self.assertRaisesRegex(CheckpointError, rf"^{re.escape(path)}: not a readable "
                                                     rf"safetensors file \(.*{reason}.*\); the file "
                                                     r"is truncated or corrupt"):
            gemma4.from_pretrained(self.dir)

    def test_broken_index_is_named(self):
        index = os.path.join(self.dir, "model.safetensors.index.json")
        os.rename(os.path.join(self.dir, "model.safetensors"), os.path.join(self.dir, "shard.safetensors"))
        for text, pattern in (("{", r"not a safetensors index .*JSONDecodeError"),
                              ('{"metadata": {}}', r"not a safetensors index .*KeyError"),
                              ('{"weight_map": {"model.embed_tokens.weight": "gone.safetensors"}}',
                               r"gone\.safetensors: file not found \(listed in .*index\.json\)")):
            with open(index, "w") as f:
                f.write(text)
            with self.subTest(text), self.assertRaisesRegex(CheckpointError, pattern):
                gemma4.from_pretrained(self.dir)

    def test_config_that_is_not_json_is_named(self):
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            f.write('{"model_type": "gemma4",')
        with self.assertRaisesRegex(CheckpointError, r"config\.json: not valid JSON"):
            gemma4.from_pretrained(self.dir)

    def test_quantize_and_backend_are_checked(self):
        with self.assertRaisesRegex(ValueError, "quantize='int4' is not supported"):
            gemma4.from_pretrained(self.dir, quantize="int4")
        with self.assertRaisesRegex(ValueError, "backend='cuda' is not supported"):
            gemma4.from_pretrained(self.dir, backend="cuda")

    @parameterized.parameters(jnp.int32, jnp.float16, "float64", "fp8")
    def test_dtype_is_checked(self, dtype):
        with self.assertRaisesRegex(ValueError, r"dtype=.* is not supported \(supported: "
                                                r"bfloat16, float32\)"):
            gemma4.from_pretrained(self.dir, dtype=dtype)

    @parameterized.named_parameters(
        ("activation", dict(hidden_activation="silu"), "hidden_activation"),
        ("bidirectional", dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        ("bias", dict(attention_bias=True), "attention_bias"),
        ("model_type", dict(model_type="gemma3_text"), "model_type"),
        ("rope_type", dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1.0}}),
         "rope_parameters.sliding_attention.rope_type"),
        ("per_layer_key", dict(per_layer_config={"2": {"head_dim": 64, "intermediate_size": 8}}),
         "per_layer_config"),
        ("all_layers_shared", dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
        ("layer_type", dict(layer_types=["sliding_attention"] * 5 + ["chunked_attention"]), "layer_types"),
        ("heads", dict(num_key_value_heads=3), "num_key_value_heads"),
        ("moe_incomplete", dict(enable_moe_block=True, num_experts=4), "enable_moe_block"),
    )
    def test_unsupported_config_is_refused(self, changes, field):
        self._config(**changes)
        with self.assertRaisesRegex(ValueError, f"unsupported {field}"):
            gemma4.Gemma4Config.from_pretrained(self.dir)


if __name__ == "__main__":
    absltest.main()
