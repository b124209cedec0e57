"""Prefill + cached greedy decoding equal re-running the full sequence (no transformers).

Random Gemma4ForCausalLM models built directly in JAX, with a tiny window so the local-layer
rings wrap, KV sharing (shared layers read their source's cache view), PLE and K=V layers.
Prompt lengths straddle the ring edges (shorter than, equal to, one past, and several times
the window), and the cache capacity is also set below the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import gemma4

S, F = "sliding_attention", "full_attention"
WINDOW = 3

TINY = dict(
    model_type="gemma4_text", vocab_size=61, hidden_size=32, intermediate_size=24,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=[S, F, S, S, F, F], num_kv_shared_layers=2, use_double_wide_mlp=True,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=61, sliding_window=WINDOW,
    final_logit_softcapping=30.0)


def tiny_model(seed=0, dtype=jnp.float32, backend="reference", **overrides):
    cfg = gemma4.Gemma4Config.from_dict({**TINY, **overrides})
    return gemma4.Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend, rngs=nnx.Rngs(seed))


def greedy_by_rerun(model, ids, n):
    """The reference: re-run the full sequence for every new token. The model is causal, so
    a buffer of the final length (zeros past the current end) gives the same logits at the
    current end as the sequence alone, and one compiled shape serves every step."""
    ids = np.asarray(ids)
    b, p = ids.shape
    buf = np.zeros((b, p + n), np.int32)
    buf[:, :p] = ids
    for t in range(p, p + n):
        logits = gemma4.forward(model, buf)[:, t - 1]
        buf[:, t] = np.asarray(jnp.argmax(logits, axis=-1))
    return buf[:, p:]


class GenerateTest(parameterized.TestCase):

    @parameterized.parameters(1, WINDOW - 1, WINDOW, WINDOW + 1, 3 * WINDOW + 2)
    def test_generate_equals_rerun(self, prompt_len):
        model = tiny_model(seed=prompt_len)
        ids = jax.random.randint(jax.random.key(prompt_len), (2, prompt_len), 3, 61, jnp.int32)
        new = gemma4.generate(model, ids, 9)
        np.testing.assert_array_equal(np.asarray(new), greedy_by_rerun(model, ids, 9))

    def test_prefill_logits_and_cache(self):
        model = tiny_model()
        ids = jax.random.randint(jax.random.key(1), (2, 11), 3, 61, jnp.int32)
        full = gemma4.forward(model, ids)
        last, cache = gemma4.prefill(model, ids, max_cache_len=20)
        np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, -1]), atol=1e-5, rtol=0)
        self.assertEqual(cache.length.shape, (2,))     # one length per row
        np.testing.assert_array_equal(cache.length, 11)
        self.assertEqual(cache.max_len, 20)
        for spec, k in zip(model.config.layers, cache.keys):
            if spec.is_kv_shared:
                self.assertIsNone(k)   # shared layers own no cache
            elif spec.is_sliding:
                self.assertEqual(k.shape[1], WINDOW)  # bounded ring
            else:
                self.assertEqual(k.shape[1], 20)

    def test_continue_from_prefill(self):
        model = tiny_model()
        ids = jax.random.randint(jax.random.key(2), (1, 8), 3, 61, jnp.int32)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=8 + 6)
        cont = gemma4.generate(model, ids, 6, cache=cache, logits=logits)
        np.testing.assert_array_equal(np.asarray(cont), np.asarray(gemma4.generate(model, ids, 6)))

    def test_capacity_below_window(self):
        model = tiny_model(sliding_window=16)
        ids = jax.random.randint(jax.random.key(3), (1, 4), 3, 61, jnp.int32)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=7)
        self.assertEqual(cache.keys[0].shape[1], 7)  # ring of min(window, capacity)
        new = gemma4.generate(model, ids, 4, cache=cache, logits=logits)
        np.testing.assert_array_equal(np.asarray(new), greedy_by_rerun(model, ids, 4))

    def test_capacity_is_checked(self):
        model = tiny_model()
        ids = jnp.full((1, 5), 7, jnp.int32)
        logits, cache = gemma4.prefill(model, ids)
        with self.assertRaisesRegex(ValueError, "cache holds 5 positions"):
            gemma4.generate(model, ids, 3, cache=cache, logits=logits)
        with self.assertRaisesRegex(ValueError, "shorter than the prompt"):
            gemma4.prefill(model, ids, max_cache_len=4)

    @parameterized.named_parameters(
        ("past_vocab", [[2, 61, 5]], r"input_ids: \[61\] outside the vocabulary \[0, 61\)"),
        ("negative", [[-1, 5]], r"input_ids: \[-1\] outside the vocabulary \[0, 61\)"),
        ("float", np.array([[2.0, 5.0]], np.float32),
         r"input_ids must be integer token ids, got dtype float32 \(supported: integer dtypes"),
        ("bool", np.ones((1, 3), bool), r"integer token ids, got dtype bool"),
        ("one_dim", [2, 5], r"must be int32 \[B, S\] with S >= 1, got shape \[2\]"),
    )
    def test_token_ids_are_checked(self, ids, pattern):
        model = tiny_model()
        for name, fn in (("prefill", gemma4.prefill), ("forward", gemma4.forward),
                         ("generate", lambda m, i: gemma4.generate(m, i, 2)),
                         ("__call__", lambda m, i: m(i))):
            with self.subTest(name), self.assertRaisesRegex(ValueError, pattern):
                fn(model, ids)
            if np.ndim(ids) == 2:  # the same ids, on the device
                with self.subTest(name + " jax.Array"), self.assertRaisesRegex(ValueError, pattern):
                    fn(model, jnp.asarray(ids))

    def test_traced_token_ids_are_checked_for_dtype_only(self):
        model = tiny_model()
        call = jax.jit(lambda ids: model(ids))
        with self.assertRaisesRegex(ValueError, "integer token ids, got dtype float32"):
            call(jnp.ones((1, 3), jnp.float32))
        # Their values do not exist at trace time: no range check (and no device sync) inside jit.
        self.assertEqual(call(jnp.array([[2, 61]], jnp.int32)).shape, (1, 2, 61))
        ids = jnp.array([[2, 60, 0]], jnp.uint8)   # any integer dtype, cast to int32
        np.testing.assert_array_equal(np.asarray(gemma4.forward(model, ids)),
                                      np.asarray(gemma4.forward(model, ids.astype(jnp.int32))))

    def test_bf16_kernel_head_dims_through_ffi(self):
        """Head dims 256/512 in bf16 take the jax_mila.ffi path (its reference on CPU)."""
        model = tiny_model(dtype=jnp.bfloat16, backend="auto", head_dim=256, global_head_dim=512,
                           hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                           hidden_size_per_layer_input=0)
        ids = jax.random.randint(jax.random.key(4), (1, 7), 3, 61, jnp.int32)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=7 + 4)
        self.assertEqual(logits.shape, (1, 61))
        self.assertEqual(logits.dtype, jnp.bfloat16)
        self.assertTrue(bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32)))))
        self.assertEqual(cache.keys[1].dtype, jnp.bfloat16)
        new = gemma4.generate(model, ids, 4, cache=cache, logits=logits)
        self.assertEqual(new.shape, (1, 4))

    def test_forward_compiles_once_per_shape(self):
        model = tiny_model()
        ids = jnp.zeros((1, 6), jnp.int32)
        from jax_mila.engine.jitted import forward_step
        before = forward_step._cache_size()
        gemma4.forward(model, ids)
        gemma4.forward(model, ids + 1)
        self.assertEqual(forward_step._cache_size() - before, 1)


if __name__ == "__main__":
    absltest.main()
