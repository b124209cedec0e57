"""Context-parallel attention (ring for causal layers, halo exchange for sliding windows)
against single-device attention, on forced host devices (tests/conftest.py) with the reference
op; the same functions take the CUDA kernel on GPUs."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, PartitionSpec as P

from jax_mila import gemma4, parallel, reference


def _seed():
    return int(np.random.SeedSequence().entropy % (2**31))


def _qkv(seed, t, hq, hkv, d=16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (2, t, hq, d), jnp.float32),
            jax.random.normal(kk, (2, t, hkv, d), jnp.float32),
            jax.random.normal(kv, (2, t, hkv, d), jnp.float32))


def _sharded(fn, n_dev):
    mesh = Mesh(np.array(jax.devices("cpu")[:n_dev]), ("seq",))
    spec = P(None, "seq")
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))


class ContextParallelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if len(jax.devices("cpu")) < 4:
            self.skipTest("needs 4 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")

    def test_zigzag_layout(self):
        order = parallel.zigzag_order(16, 2)
        np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
        np.testing.assert_array_equal(order[parallel.zigzag_inverse(16, 2)], np.arange(16))
        with self.assertRaisesRegex(ValueError, "multiple of 2 x devices on the axis = 8; got 20"):
            parallel.zigzag_order(20, 4)

    @parameterized.product(n_dev=(2, 4), gqa=((4, 2), (4, 1)))
    def test_ring_attention_equals_single_device(self, n_dev, gqa):
        seed, t = _seed(), 2 * n_dev * 11
        q, k, v = _qkv(seed, t, *gqa)
        order, inv = parallel.zigzag_order(t, n_dev), parallel.zigzag_inverse(t, n_dev)
        ring = _sharded(functools.partial(parallel.ring_attention, attention=reference.flash_attention,
                                          axis_name="seq", scale=0.3), n_dev)
        got = ring(q[:, order], k[:, order], v[:, order])[:, inv]
        want = reference.flash_attention(q, k, v, causal=True, scale=0.3)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"seed={seed}")

    @parameterized.product(n_dev=(2, 4), window=(1, 5, 12))
    def test_halo_window_attention_equals_single_device(self, n_dev, window):
        seed, t = _seed(), 2 * n_dev * 11
        q, k, v = _qkv(seed, t, 4, 2)
        order, inv = parallel.zigzag_order(t, n_dev), parallel.zigzag_inverse(t, n_dev)
        fn = _sharded(functools.partial(parallel.halo_window_attention,
                                        attention=reference.flash_attention, axis_name="seq",
                                        window=window), n_dev)
        got = fn(q[:, order], k[:, order], v[:, order])[:, inv]
        want = reference.flash_attention(q, k, v, causal=True, window=window)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"seed={seed}")

    def test_window_longer_than_a_chunk_is_refused(self):
        q, k, v = _qkv(0, 16, 2, 1)
        fn = _sharded(functools.partial(parallel.halo_window_attention,
                                        attention=reference.flash_attention, axis_name="seq",
                                        window=6), 4)
        with self.assertRaisesRegex(ValueError, "window of 6 needs chunks of at least 5 tokens; got 2"):
            fn(q, k, v)

    def test_ring_passes_kv_with_collective_permutes_only(self):
        q, k, v = _qkv(0, 32, 4, 1)
        ring = _sharded(functools.partial(parallel.ring_attention, attention=reference.flash_attention,
                                          axis_name="seq"), 4)
        hlo = ring.lower(q, k, v).compile().as_text()
        self.assertRegex(hlo, "collective-permute")
        self.assertIsNone(re.search(r"all-gather|all-reduce|all-to-all", hlo),
                          "ring attention must not gather or reduce the sequence")


if __name__ == "__main__":
    absltest.main()


class ContextParallelModelTest(parameterized.TestCase):
    """The whole Gemma 4 forward with the sequence (and optionally the heads) split."""

    def setUp(self):
        super().setUp()
        if len(jax.devices("cpu")) < 4:
            self.skipTest("needs 4 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")

    def _model(self, seed):
        from flax import nnx
        from jax_mila.gemma4.config import Gemma4Config
        s, f = "sliding_attention", "full_attention"
        # 12B-like: K=V global layers with one KV head; a window of 4 (halo 3 <= chunk 3).
        raw = dict(model_type="gemma4_text", vocab_size=256, hidden_size=256,
                   intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, global_head_dim=128,
                   num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[s, s, f],
                   sliding_window=4, final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
        return gemma4.Gemma4ForCausalLM(Gemma4Config.from_dict(raw), dtype=jnp.float32,
                                        rngs=nnx.Rngs(seed))

    @parameterized.named_parameters(
        ("seq2", (2,), ("seq",), None), ("seq4", (4,), ("seq",), None),
        ("heads2_x_seq2", (2, 2), ("heads", "seq"), "heads"))
    def test_logits_equal_single_device(self, shape, names, heads_axis):
        seed = _seed()
        model = self._model(seed)
        ids = jax.random.randint(jax.random.key(seed), (2, 24), 0, 256)
        want = model(ids)
        mesh = Mesh(np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape), names)
        got = gemma4.forward(model, ids, mesh, heads_axis=heads_axis, seq_axis="seq")
        # float32; the ring merges partial softmax results through exp/log (observed 1.7e-5
        # on logits of magnitude up to 30)
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got, want, atol=1e-6 * scale, rtol=1e-5, err_msg=f"seed={seed}")

    def test_sequence_must_split_into_chunks(self):
        model = self._model(0)
        mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("seq",))
        with self.assertRaisesRegex(ValueError, "multiple of 2 x devices on the axis = 8; got 12"):
            gemma4.forward(model, jnp.zeros((1, 12), jnp.int32), mesh, heads_axis=None,
                           seq_axis="seq")
