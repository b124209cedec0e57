"""Model cards of every released size: parsed geometry against the spec (gemma4.md §2, §2.1)
and against transformers' own config classes, and the full forward traced on abstract weights
(no memory) to the right logits shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import gemma4

SIZES = ("e2b", "e4b", "26b-a4b", "31b", "12b")

# size: (layers, full layer indices, q_proj out (sliding, full), k_proj out (sliding, full),
#        v_proj on full layers, MLP widths, KV sources)
EXPECTED = {
    "e2b": (35, list(range(4, 35, 5)), (2048, 4096), (256, 512), True, {6144, 12288},
            {"sliding_attention": 13, "full_attention": 14}),
    "e4b": (42, list(range(5, 42, 6)), (2048, 4096), (512, 1024), True, {10240},
            {"sliding_attention": 22, "full_attention": 23}),
    "26b-a4b": (30, list(range(5, 30, 6)), (4096, 8192), (2048, 1024), False, {2112}, None),
    "31b": (60, list(range(5, 60, 6)), (8192, 16384), (4096, 2048), False, {21504}, None),
    "12b": (48, list(range(5, 48, 6)), (4096, 8192), (2048, 512), False, {15360}, None),
}
HIDDEN = {"e2b": 1536, "e4b": 2560, "26b-a4b": 2816, "31b": 5376, "12b": 3840}


def abstract_model(size):
    cfg = gemma4.Gemma4Config.from_pretrained(gemma4.model_card(size))
    return nnx.eval_shape(lambda: gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16))


class ModelCardTest(parameterized.TestCase):

    @parameterized.parameters(*SIZES)
    def test_geometry_matches_spec(self, size):
        layers, full, q_out, k_out, v_on_full, mlp, sources = EXPECTED[size]
        model = abstract_model(size)
        cfg = model.config
        self.assertEqual(cfg.num_hidden_layers, layers)
        self.assertEqual([i for i, t in enumerate(cfg.layer_types) if t == "full_attention"], full)
        self.assertEqual(cfg.vocab_size, 262144)
        self.assertEqual(cfg.final_logit_softcapping, 30.0)
        widths = set()
        for i, layer in enumerate(model.layers):
            attn, is_full = layer.self_attn, i in full
            self.assertEqual(attn.q_proj.kernel.shape, (HIDDEN[size], q_out[is_full]))
            if not layer.spec.is_kv_shared:
                self.assertEqual(attn.k_proj.kernel.shape, (HIDDEN[size], k_out[is_full]))
                self.assertEqual(hasattr(attn, "v_proj"), v_on_full or not is_full)
            widths.add(layer.mlp.gate_proj.kernel.shape[1])
        self.assertEqual(widths, mlp)
        self.assertEqual(cfg.kv_sources if cfg.num_kv_shared_layers else None, sources)
        self.assertEqual(cfg.rope["full_attention"].rotated, 64)   # dims [0:64] and [256:320]
        self.assertEqual(cfg.rope["full_attention"].head_dim, 512)
        if size == "26b-a4b":
            self.assertEqual(model.layers[0].experts.gate_up_proj.kernel.shape, (128, 2816, 1408))
            self.assertEqual(model.layers[0].experts.down_proj.kernel.shape, (128, 704, 2816))
        if size in ("e2b", "e4b"):
            self.assertEqual(model.embed_tokens_per_layer.weight.shape, (262144, layers * 256))

    @parameterized.parameters(*SIZES)
    def test_every_linear_of_every_size_is_w4a8(self, size):
        # The W4A8 kernels take every Gemma 4 projection (K a multiple of 32: the 26B's 2112
        # and 704 are stored padded): none falls back to a dense weight but the router, which
        # stays dense float32 by design (near-tied expert choices).
        from jax_mila import nn
        cfg = gemma4.Gemma4Config.from_pretrained(gemma4.model_card(size))
        model = nnx.eval_shape(lambda: gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16,
                                                                 quantize="w4a8"))
        dense = [".".join(map(str, path)) for path, node in nnx.iter_graph(model)
                 if isinstance(node, (nn.Linear, nn.GroupedLinear)) and node.quantize is None]
        self.assertTrue(all(name.endswith("router.proj") for name in dense), dense)

    @parameterized.parameters(*SIZES)
    def test_agrees_with_transformers_config(self, size):
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(gemma4.model_card(size).parent)
        hf = getattr(hf, "text_config", hf)
        ours = gemma4.Gemma4Config.from_pretrained(gemma4.model_card(size))
        for spec in ours.layers:
            layer = hf.per_layer_config[spec.index]
            self.assertEqual(spec.head_dim, layer.head_dim, f"layer {spec.index}")
            self.assertEqual(spec.num_kv_heads, layer.num_key_value_heads, f"layer {spec.index}")
            mode = hf.kv_sharing_modes[spec.index]
            self.assertEqual(spec.is_kv_shared, mode == "reuse", f"layer {spec.index}")
            if mode == "store":
                self.assertIn(spec.index, ours.kv_sources.values())

    @parameterized.parameters("e2b", "26b-a4b", "12b")
    def test_forward_traces_on_abstract_weights(self, size):
        graphdef, state = nnx.split(abstract_model(size))
        ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, ids)
        self.assertEqual(out.shape, (1, 8, 262144))
        self.assertEqual(out.dtype, jnp.bfloat16)


if __name__ == "__main__":
    absltest.main()
