"""Gemma 4's K=V global layers with k_norm's weight folded into q (jax_mila/gemma4/attention.py):
on backends with kernels q is normed with w_q * w_k outside the columns RoPE rotates and the
attention reads k only in those columns, v elsewhere (nn.Attention rotary_keys_only). Which
layers fold, and that the folded layer / model computes what the unfolded "reference" one does:
float32 to float32 rounding, bf16 no worse than bf16 itself. Each comparison also runs a broken
fold (rotary_keys_only kept, k_norm's weight not folded) and asserts the comparison catches it.
Fresh random weights, norm weights and inputs every run (seeds in the failure messages)."""

from __future__ import annotations

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import Mesh

from jax_mila import gemma4, nn, reference
from jax_mila.gemma4.attention import Gemma4Attention
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.rope import rope_tables
import testing  # tests/testing.py

S, F = "sliding_attention", "full_attention"
# Global layers as in the released K=V checkpoints: head_dim 512, one KV head, proportional RoPE
# with partial_rotary_factor 0.25 (the config default), i.e. 64 rotated pairs; layer 3 is a
# KV-shared full layer reading layer 1's K/V (it must attend without the fold).
RAW = dict(model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=96,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
           layer_types=[S, F, S, F], num_kv_shared_layers=1, sliding_window=4,
           hidden_size_per_layer_input=0, final_logit_softcapping=30.0)
ROTATED = 64
FOLDING_LAYER = 1


def _seed():
    return int.from_bytes(os.urandom(4), "little")


def _config(**overrides):
    return Gemma4Config.from_dict(dict(RAW, **overrides))


def _perturb_norms(module, seed):
    """Norm weights away from 1, as in a checkpoint (with w_k = 1 the fold would be a no-op)."""
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nn.RMSNorm) and node.with_scale:
            w = node.weight[...]
            node.weight.set_value(jnp.asarray(1 + 0.3 * rng.standard_normal(w.shape), w.dtype))


def _twin(module, build):
    """``build()`` (the same module on another backend / dtype) holding ``module``'s weights."""
    other = build()
    nnx.update(other, jax.tree.map(lambda a, b: a.astype(b.dtype), nnx.state(module),
                                   nnx.state(other)))
    return other


def _unfolded_q():
    """The broken fold: q normed with q_norm's own weight, rotary_keys_only still set."""
    return mock.patch.object(Gemma4Attention, "q_norm_weight", lambda self: None)


def _f32(x):
    return np.asarray(x, np.float32)


# float32: the fold only moves where float32 roundings happen (w_q * w_k, and V * w_k inside
# the dot product instead of in K); observed relative (Frobenius) errors: 6e-7..8e-7 on a
# layer's output, <= 5e-7 on logits (single device, ring and chunked context parallelism).
# The broken fold is off by ~0.5 on a layer.
F32_TOL = 1e-5


class FoldSwitchTest(parameterized.TestCase):

    def test_only_k_eq_v_layers_owning_k_norm_fold(self):
        cfg = _config()
        self.assertEqual(cfg.rope[F].rotated, ROTATED)
        self.assertEqual(cfg.layers[3].kv_source, FOLDING_LAYER)
        model = gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.float32, backend="auto",
                                         rngs=nnx.Rngs(0))
        got = [layer.self_attn.attn.rotary_keys_only for layer in model.layers]
        self.assertEqual(got, [None, ROTATED, None, None])   # sliding, K=V, sliding, shared
        ref = gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.float32, backend="reference",
                                       rngs=nnx.Rngs(0))
        self.assertEqual([layer.self_attn.attn.rotary_keys_only for layer in ref.layers],
                         [None] * 4)
        for layer in ref.layers:
            self.assertIsNone(layer.self_attn.q_norm_weight())

    def test_no_fold_without_k_eq_v_or_without_unrotated_columns(self):
        for cfg in (_config(attention_k_eq_v=False),
                    _config(rope_parameters={S: dict(rope_type="default", rope_theta=1e4),
                                             F: dict(rope_type="default", rope_theta=1e6)})):
            model = gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.float32, backend="mila",
                                             rngs=nnx.Rngs(0))
            for layer in model.layers:
                self.assertIsNone(layer.self_attn.attn.rotary_keys_only)
                self.assertIsNone(layer.self_attn.q_norm_weight())

    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_folded_weight(self, param_dtype):
        cfg = _config()
        layer = Gemma4Attention(cfg, cfg.layers[FOLDING_LAYER], backend="mila",
                                dtype=jnp.bfloat16, param_dtype=param_dtype, quantize=None,
                                rngs=nnx.Rngs(0))
        _perturb_norms(layer, _seed())
        w = np.asarray(layer.q_norm_weight())
        self.assertEqual(w.dtype, np.float32)
        w_q, w_k = _f32(layer.q_norm.weight[...]), _f32(layer.k_norm.weight[...])
        rotated = np.zeros(512, bool)
        rotated[:ROTATED] = rotated[256:256 + ROTATED] = True
        np.testing.assert_array_equal(w[rotated], w_q[rotated])
        # float32 products of bf16 weights are exact; float32 ones round once, as here.
        np.testing.assert_array_equal(w[~rotated], w_q[~rotated] * w_k[~rotated])


class FoldedLayerTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        # F32_TOL assumes float32 dots. XLA:GPU's default precision runs them as TF32, whose
        # rounding the fold moves around: 2.6e-4..1.1e-3 on the H200 (nineteenth round).
        self.enter_context(jax.default_matmul_precision("float32"))

    def _layers(self, dtype, seed):
        cfg = _config()
        spec = cfg.layers[FOLDING_LAYER]
        build = lambda backend, dt: Gemma4Attention(  # noqa: E731
            cfg, spec, backend=backend, dtype=dt, param_dtype=dt, quantize=None,
            rngs=nnx.Rngs(seed))
        folded = build("mila", dtype)
        _perturb_norms(folded, seed)
        plain = _twin(folded, lambda: build("reference", dtype))
        oracle = _twin(folded, lambda: build("reference", jnp.float32))
        self.assertEqual(folded.attn.rotary_keys_only, ROTATED)
        self.assertIsNone(plain.attn.rotary_keys_only)
        return cfg, folded, plain, oracle

    @staticmethod
    def _run(layer, cfg, x, dtype, offset=0):
        pos = offset + jnp.arange(x.shape[1])
        cos, sin = rope_tables(cfg.rope[F], pos, dtype)
        out, _, _ = layer(x.astype(dtype), cos, sin, offset=offset, mode="full")
        return _f32(out)

    def test_float32(self):
        seed = _seed()
        cfg, folded, plain, _ = self._layers(jnp.float32, seed)
        x = jax.random.normal(jax.random.key(seed), (2, 37, cfg.hidden_size))
        want = self._run(plain, cfg, x, jnp.float32)
        with mock.patch.object(reference, "flash_attention",
                               wraps=reference.flash_attention) as spy:
            got = self._run(folded, cfg, x, jnp.float32)
        # float32 activations: nn.Attention's reference fallback, with the flag.
        self.assertEqual(spy.call_args.kwargs["rotary_keys_only"], ROTATED)
        err = testing.rel_fro_err(got, want)
        self.assertLess(err, F32_TOL, f"seed={seed}")
        with _unfolded_q():
            bad = self._run(folded, cfg, x, jnp.float32)
        self.assertGreater(testing.rel_fro_err(bad, want), 100 * F32_TOL, f"seed={seed}")

    def test_bfloat16(self):
        """bf16 tolerance. With scale 1.0 and normed q, k of RMS ~1 at D=512, the scores are
        O(20) and a bf16 rounding of q or k (2^-9 relative) moves them by O(0.05): the bf16
        layer itself is ~2% (relative Frobenius) from the same layer in float32 (observed
        1.1-2.6% over 200 seeds), and the folded and unfolded bf16 layers, which round at
        different places (w_q w_k in q, w_k outside K; the fused norm+RoPE's one rounding), are
        as far from each other. So the folded layer is judged on the bf16 layer's own scale
        ``own`` (the unfolded bf16 layer's error against the float32 oracle): at most 2 own
        from the oracle (observed 0.73-1.30 own) and at most 2 own from the unfolded bf16
        layer (observed 0.44-1.09 own). The broken fold is >= 19 own off (observed)."""
        seed = _seed()
        cfg, folded, plain, oracle = self._layers(jnp.bfloat16, seed)
        x = jax.random.normal(jax.random.key(seed), (2, 37, cfg.hidden_size))
        exact = self._run(oracle, cfg, x, jnp.float32)
        want = self._run(plain, cfg, x, jnp.bfloat16)
        own = testing.rel_fro_err(want, exact)       # the bf16 layer's own rounding error
        self.assertLess(own, 0.05, f"seed={seed}")   # sanity: bf16 noise, not a wrong layer

        def check(got):
            return (testing.rel_fro_err(got, exact) <= 2 * own
                    and testing.rel_fro_err(got, want) <= 2 * own)

        with mock.patch.object(nn.attention.ffi, "flash_attention",
                               wraps=nn.attention.ffi.flash_attention) as spy:
            got = self._run(folded, cfg, x, jnp.bfloat16)
        # bf16 at D=512: the ffi wrapper (the kernel on Hopper, the reference here).
        self.assertEqual(spy.call_args.kwargs["rotary_keys_only"], ROTATED)
        self.assertTrue(check(got), f"seed={seed}: {testing.rel_fro_err(got, exact):.4f} from "
                                    f"float32, {testing.rel_fro_err(got, want):.4f} from the "
                                    f"unfolded bf16 layer; bf16 itself {own:.4f}")
        with _unfolded_q():
            bad = self._run(folded, cfg, x, jnp.bfloat16)
        self.assertFalse(check(bad), f"seed={seed}: the broken fold passed")

    @parameterized.parameters("prefill", "chunk")
    def test_cache_modes_float32(self, mode):
        """The cache holds the plain K and V (the fold only changes q): a prefill entry, and a
        chunk attending over an earlier chunk's keys, match the unfolded layer's."""
        seed = _seed()
        cfg, folded, plain, _ = self._layers(jnp.float32, seed)
        x = jax.random.normal(jax.random.key(seed), (2, 12, cfg.hidden_size))

        def run(layer):
            c1, s1 = rope_tables(cfg.rope[F], jnp.arange(12), jnp.float32)
            if mode == "prefill":
                out, _, entry = layer(x, c1, s1, offset=0, mode="prefill", max_len=16)
                return [out, *entry]
            buf = jnp.zeros((2, 20, 1, 512), jnp.float32)
            outs = []
            entry = (buf, buf)
            for start in (0, 6):
                c, s = c1[start:start + 6], s1[start:start + 6]
                out, _, entry = layer(x[:, start:start + 6], c, s, offset=jnp.int32(start),
                                      mode="chunk", entry=entry, max_len=20,
                                      valid=jnp.int32(6))
                outs.append(out)
            return [*outs, *entry]

        got, want = run(folded), run(plain)
        for g, w in zip(got, want):
            self.assertLess(testing.rel_fro_err(_f32(g), _f32(w)), F32_TOL, f"seed={seed}")
        with _unfolded_q():
            bad = run(folded)
        self.assertGreater(testing.rel_fro_err(_f32(bad[0]), _f32(want[0])), 100 * F32_TOL,
                           f"seed={seed}: the broken fold passed")


class FoldedModelTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        # F32_TOL assumes float32 dots. XLA:GPU's default precision runs them as TF32, whose
        # rounding the fold moves around: 2.6e-4..1.1e-3 on the H200 (nineteenth round).
        self.enter_context(jax.default_matmul_precision("float32"))

    def _models(self, seed):
        cfg = _config()
        build = lambda backend: gemma4.Gemma4ForCausalLM(  # noqa: E731
            cfg, dtype=jnp.float32, backend=backend, rngs=nnx.Rngs(seed))
        folded = build("auto")
        _perturb_norms(folded, seed)
        return folded, _twin(folded, lambda: build("reference"))

    def _ids(self, seed, length):
        return jax.random.randint(jax.random.key(seed), (2, length), 3, RAW["vocab_size"],
                                  jnp.int32)

    def assert_close_logits(self, got, want, seed):
        """float32 logits (softcapped at 30): relative (Frobenius) within F32_TOL."""
        got, want = _f32(got), _f32(want)
        self.assertTrue(np.all(np.isfinite(got)), f"seed={seed}")
        self.assertLess(testing.rel_fro_err(got, want), F32_TOL, f"seed={seed}")

    def test_forward_prefill_and_chunks(self):
        seed = _seed()
        folded, plain = self._models(seed)
        ids = self._ids(seed, 13)
        with mock.patch.object(reference, "flash_attention",
                               wraps=reference.flash_attention) as spy:
            got = folded(ids)
        flags = [c.kwargs.get("rotary_keys_only") for c in spy.call_args_list]
        self.assertEqual(flags, [None, ROTATED, None, None])  # the shared layer: plain k
        want = plain(ids)
        self.assert_close_logits(got, want, seed)
        for chunk in (None, 5):
            got_last, got_cache = gemma4.prefill(folded, ids, chunk_size=chunk, max_cache_len=20)
            want_last, want_cache = gemma4.prefill(plain, ids, chunk_size=chunk, max_cache_len=20)
            self.assert_close_logits(got_last, want_last, seed)
            for g, w in zip(got_cache.keys + got_cache.values,
                            want_cache.keys + want_cache.values):
                if w is not None:
                    self.assertLess(testing.rel_fro_err(_f32(g), _f32(w)), F32_TOL)
        with _unfolded_q():
            bad = folded(ids)   # eager: a jitted forward could reuse the folded program
        self.assertGreater(testing.rel_fro_err(_f32(bad), _f32(want)), 100 * F32_TOL,
                           f"seed={seed}: the broken fold passed")

    def test_context_parallel_ring(self):
        # The ring merges partial results of return_lse calls through nn.Attention.
        if len(jax.devices("cpu")) < 2:
            self.skipTest("needs 2 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
        seed = _seed()
        folded, plain = self._models(seed)
        ids = self._ids(seed, 24)
        mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("seq",))
        got = gemma4.forward(folded, ids, mesh, heads_axis=None, seq_axis="seq")
        self.assert_close_logits(got, plain(ids), seed)

    def test_chunked_context_parallel(self):
        # Full layers attend to the position-sharded cache in one return_lse call with a
        # vector kv_offset (jax_mila/parallel/chunked.py).
        if len(jax.devices("cpu")) < 2:
            self.skipTest("needs 2 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
        seed = _seed()
        folded, plain = self._models(seed)
        ids = self._ids(seed, 13)
        mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("seq",))
        got, _ = gemma4.prefill(folded, ids, chunk_size=4, mesh=mesh, seq_segments=2)
        want, _ = gemma4.prefill(plain, ids, chunk_size=4)
        self.assert_close_logits(got, want, seed)


if __name__ == "__main__":
    absltest.main()
