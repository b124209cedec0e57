"""The decoder layer's fused norms: in a bf16 model whose q/k/v (gate/up) projections are W4A8,
input_layernorm and h + post_attention_layernorm(a) -> pre_feedforward_layernorm run with those
projections' quantizer as one op (add_rms_norm_quantize) and the attention / MLP take the
quantized rows (nn.QuantizedRows). Which configurations take that path, and that it computes the
unfused layers' output: bit for bit on the reference path (the CPU), within the kernels' rounding
on a GPU."""

from __future__ import annotations

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import ffi, gemma4, nn, reference
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.model import Gemma4DecoderLayer
from jax_mila.parallel import Layout
import testing  # tests/testing.py

S, F = "sliding_attention", "full_attention"
# Every projection W4A8-sized (hidden 128, q heads x head_dim 128); PLE (16 -> 128: dense),
# KV sharing, K=V full layers, MoE, double-wide MLP between the two configs.
CONFIGS = {
    "ple_kv_shared": dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, global_head_dim=64,
        layer_types=[S, S, S, F, S, F], num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, sliding_window=4,
        final_logit_softcapping=30.0),
    "moe_k_eq_v": dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F, F],
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64,
        hidden_size_per_layer_input=0, sliding_window=5, final_logit_softcapping=30.0),
}


def _seed():
    return int.from_bytes(os.urandom(4), "little")


def _model(name="moe_k_eq_v", *, dtype=jnp.bfloat16, quantize="w4a8", backend="auto", seed=None):
    seed = _seed() if seed is None else seed
    cfg = Gemma4Config.from_dict(dict(model_type="gemma4_text", **CONFIGS[name]))
    model = gemma4.Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend, quantize=quantize,
                                     rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(model):   # norm weights away from 1, as in a checkpoint
        if isinstance(node, nn.RMSNorm) and node.with_scale:
            w = node.weight[...]
            node.weight.set_value(jnp.asarray(1 + 0.3 * rng.standard_normal(w.shape), w.dtype))
    return model


def _ids(model, shape=(2, 11)):
    key = jax.random.key(_seed())
    return jax.random.randint(key, shape, 3, model.config.vocab_size, jnp.int32)


def _unfused():
    """Every decoder layer on its unfused path."""
    return mock.patch.multiple(Gemma4DecoderLayer, fuses_input_norm=lambda *args: False,
                               fuses_pre_feedforward_norm=lambda *args: False)


class FusedNormsTest(parameterized.TestCase):

    def assert_same(self, got, want, backend):
        self.assertEqual(got.dtype, want.dtype)
        if backend != "reference" and testing.has_cuda():
            # The kernel's sums of squares and the MXFP4 GEMMs' rounding: bf16 noise.
            self.assertLess(testing.rel_fro_err(got.astype(jnp.float32),
                                                want.astype(jnp.float32)), 5e-2)
        else:
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32))

    @parameterized.product(name=tuple(CONFIGS), backend=("auto", "reference"))
    def test_bf16_w4a8_layers_fuse_both_norms(self, name, backend):
        model = _model(name, backend=backend)
        for layer in model.layers:
            self.assertTrue(layer.fuses_input_norm(jnp.bfloat16))
            self.assertTrue(layer.fuses_pre_feedforward_norm(jnp.bfloat16, jnp.bfloat16))
        ids = _ids(model)
        ops = reference if backend == "reference" else ffi
        with mock.patch.object(ops, "add_rms_norm_quantize",
                               wraps=ops.add_rms_norm_quantize) as fused:
            got = model(ids)
        n = len(model.layers)
        n_moe = sum(layer.has_moe for layer in model.layers)  # + the experts' pre-norm
        self.assertEqual(fused.call_count, 2 * n + n_moe)
        with_branch = [c for c in fused.call_args_list if len(c.args) == 2]
        self.assertLen(with_branch, n)  # one per layer: h + post_attention_layernorm(a)
        with _unfused():
            want = model(ids)
        self.assert_same(got, want, backend)

    @parameterized.parameters("full", "prefill", "chunked", "generate")
    def test_every_mode_computes_the_unfused_layers(self, mode):
        model = _model("ple_kv_shared")
        ids = _ids(model, (2, 13))

        def run():
            if mode == "full":
                return gemma4.forward(model, ids)
            if mode == "prefill":
                return gemma4.prefill(model, ids, max_cache_len=20)[0]
            if mode == "chunked":
                return gemma4.prefill(model, ids, chunk_size=4, max_cache_len=20)[0]
            return gemma4.generate(model, ids, 4, chunk_size=5)

        got = run()
        with _unfused():
            want = run()
        if mode == "generate" and not testing.has_cuda():
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        elif mode != "generate":
            self.assert_same(got, want, "auto")

    def test_quantized_rows_into_attention_and_mlp(self):
        model = _model("moe_k_eq_v")
        layer = model.layers[2]            # a K=V full layer
        x = (jax.random.normal(jax.random.key(_seed()), (2, 5, 128)) * 2).astype(jnp.bfloat16)
        q, s = ffi.quantize_activations(x)   # the quantizer the layers of backend "auto" use
        rows = nn.QuantizedRows(q, s)
        self.assertEqual(rows.shape, (2, 5, 128))
        np.testing.assert_array_equal(np.asarray(layer.mlp(rows), np.float32),
                                      np.asarray(layer.mlp(x), np.float32))
        self.assertLen(layer.self_attn.input_projections(), 2)  # q_proj, k_proj (K=V)

    @parameterized.named_parameters(
        ("float32_model", dict(dtype=jnp.float32), False, False),
        ("dense", dict(quantize=None), False, False),
    )
    def test_other_models_keep_the_unfused_layers(self, kwargs, input_norm, ffn_norm):
        model = _model(**kwargs)
        dtype = model.dtype
        for layer in model.layers:
            self.assertEqual(layer.fuses_input_norm(dtype), input_norm)
            self.assertEqual(layer.fuses_pre_feedforward_norm(dtype, dtype), ffn_norm)
        with mock.patch.object(ffi, "add_rms_norm_quantize") as fused:
            model(_ids(model))
        fused.assert_not_called()

    def test_each_norm_fuses_only_where_its_projections_allow(self):
        model = _model()
        layer = model.layers[0]
        bf16 = jnp.bfloat16
        tp = Layout(heads_axis="heads")
        self.assertFalse(layer.fuses_input_norm(bf16, tp))
        self.assertFalse(layer.fuses_pre_feedforward_norm(bf16, bf16, tp))
        self.assertFalse(layer.fuses_pre_feedforward_norm(bf16, jnp.float32))
        layer.self_attn.k_proj.backend = "reference"    # q/k/v on two backends
        self.assertFalse(layer.fuses_input_norm(bf16))
        self.assertTrue(layer.fuses_pre_feedforward_norm(bf16, bf16))
        layer.mlp.up_proj.backend = "reference"
        self.assertFalse(layer.fuses_pre_feedforward_norm(bf16, bf16))
        layer.mlp.up_proj.backend = "auto"
        layer.pre_feedforward_layernorm.eps = 1e-5      # the op has one eps for both norms
        self.assertFalse(layer.fuses_pre_feedforward_norm(bf16, bf16))
        # A dense down_proj does not matter: the op feeds gate_proj and up_proj.
        layer.pre_feedforward_layernorm.eps = layer.post_attention_layernorm.eps
        layer.mlp.down_proj.quantize = None
        self.assertTrue(layer.fuses_pre_feedforward_norm(bf16, bf16))

    def test_mixed_model_fuses_the_ffn_norm_only(self):
        # q/k/v dense, gate/up W4A8: the pre-feedforward norm still fuses.
        model = _model("ple_kv_shared", backend="reference")
        for layer in model.layers:
            for lin in layer.self_attn.input_projections():
                lin.quantize = None
                lin.kernel = nnx.Param(jax.random.normal(
                    jax.random.key(_seed()), (lin.in_features, lin.out_features)) * 0.05)
        ids = _ids(model)
        self.assertFalse(model.layers[0].fuses_input_norm(jnp.bfloat16))
        self.assertTrue(model.layers[0].fuses_pre_feedforward_norm(jnp.bfloat16, jnp.bfloat16))
        with mock.patch.object(reference, "add_rms_norm_quantize",
                               wraps=reference.add_rms_norm_quantize) as fused:
            got = model(ids)
        self.assertEqual(fused.call_count, len(model.layers))
        with _unfused():
            want = model(ids)
        self.assert_same(got, want, "reference")


if __name__ == "__main__":
    absltest.main()
