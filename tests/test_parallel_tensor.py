"""Tensor parallelism over a `heads` mesh axis against the single-device model, on forced host
devices (tests/conftest.py) through the reference ops."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jax_mila import gemma4
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.parallel import tensor

S, F = "sliding_attention", "full_attention"


def _config(**overrides):
    # 12B-like: K=V global layers with one KV head (replicated under TP), 2 KV heads locally.
    raw = dict(model_type="gemma4_text", vocab_size=256, hidden_size=256, intermediate_size=512,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
               layer_types=[S, S, F], sliding_window=4, final_logit_softcapping=30.0,
               hidden_size_per_layer_input=0)
    raw.update(overrides)
    return Gemma4Config.from_dict(raw)


def _seed():
    return int(np.random.SeedSequence().entropy % (2**31))


def _mesh(n):
    return Mesh(np.array(jax.devices("cpu")[:n]), ("heads",))


def _float32_noise_sensitivity(model, ids, logits, seed, draws=8):
    """Largest relative change of `logits` when the embedding table is multiplied by 1 + 2e-7
    noise (float32-level, as a different summation order is): ~1e-7 for a smooth model, one
    FP8 step's effect where an activation sits on an e4m3 rounding edge."""
    weight = model.embed_tokens.weight[...]
    worst = 0.0
    for k in range(draws):
        noisy = nnx.clone(model)
        noise = 2e-7 * jax.random.normal(jax.random.key(seed + 1 + k), weight.shape)
        noisy.embed_tokens.weight[...] = weight * (1 + noise)
        moved = noisy(ids)
        worst = max(worst, float(jnp.linalg.norm(moved - logits) / jnp.linalg.norm(logits)))
    return worst


class TensorParallelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if len(jax.devices("cpu")) < 4:
            self.skipTest("needs 4 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")

    @parameterized.parameters(2, 4)
    def test_logits_equal_single_device(self, tp):
        seed = _seed()
        model = gemma4.Gemma4ForCausalLM(_config(), dtype=jnp.float32, rngs=nnx.Rngs(seed))
        ids = jax.random.randint(jax.random.key(seed), (2, 13), 0, 256)
        want = model(ids)
        got = tensor.forward(model, ids, _mesh(tp))
        # float32; the sharded sums are added in another order (observed ~7e-6 on logits ~30)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"seed={seed}")

    def test_w4a8_model_equals_single_device(self, tp=2):
        # Row-parallel layers scale their slice of each row by the whole row's amax (a pmax),
        # so the FP8 codes are one device's and only the float32 sums' order differs. Except
        # when an activation lies within float32 noise of an e4m3 rounding edge: the order can
        # flip its code by one step (seed 635456010: 4.8e-4 relative on the logits, and the same
        # 4.8e-4 when only the embedding is perturbed by 2e-7). So the bound is the model's own
        # sensitivity to float32-level noise, 1e-5 where it has none; a wrong amax or a missing
        # reduction moves the logits by 1e-2 or more.
        seed = _seed()
        model = gemma4.Gemma4ForCausalLM(_config(), dtype=jnp.float32, quantize="w4a8",
                                         rngs=nnx.Rngs(seed))
        ids = jax.random.randint(jax.random.key(seed), (2, 11), 0, 256)
        want = model(ids)
        got = tensor.forward(model, ids, _mesh(tp))
        rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        edge = _float32_noise_sensitivity(model, ids, want, seed)
        self.assertLess(rel, max(1e-5, 2 * edge), f"seed={seed}, float32-noise sensitivity {edge:.1e}")
        self.assertLess(rel, 5e-3, f"seed={seed}")

    def test_specs_split_weights_and_replicate_a_single_kv_head(self):
        model = gemma4.Gemma4ForCausalLM(_config(), dtype=jnp.float32, quantize="w4a8")
        _, state = nnx.split(model)
        specs = tensor.param_specs(state, axis="heads", axis_size=2,
                                   num_kv_heads_of_layer=lambda i: model.config.layers[i].num_kv_heads)
        flat = {tuple(tensor._key_name(k) for k in path if tensor._key_name(k) != "value"): spec
                for path, spec in jax.tree_util.tree_flatten_with_path(
                    specs, is_leaf=lambda x: isinstance(x, P))[0]}
        layer = lambda i, *rest: ("layers", str(i)) + rest  # noqa: E731
        self.assertEqual(flat[layer(0, "self_attn", "q_proj", "packed")], P("heads", None))
        self.assertEqual(flat[layer(0, "self_attn", "k_proj", "packed")], P("heads", None))
        self.assertEqual(flat[layer(2, "self_attn", "k_proj", "packed")], P())  # 1 KV head
        self.assertEqual(flat[layer(2, "self_attn", "o_proj", "packed")], P(None, "heads"))
        self.assertEqual(flat[layer(2, "self_attn", "o_proj", "channel_exp")], P())
        self.assertEqual(flat[layer(1, "mlp", "down_proj", "scales")], P(None, "heads"))
        self.assertEqual(flat[layer(1, "mlp", "up_proj", "channel_exp")], P("heads"))
        self.assertEqual(flat[("embed_tokens", "weight")], P())

    def test_one_all_reduce_per_block_and_no_weight_gather(self):
        model = gemma4.Gemma4ForCausalLM(_config(), dtype=jnp.float32)
        ids = jnp.zeros((1, 8), jnp.int32)
        graphdef, state = nnx.split(model)
        mesh = _mesh(2)
        specs = tensor.param_specs(state, axis="heads", axis_size=2,
                                   num_kv_heads_of_layer=lambda i: model.config.layers[i].num_kv_heads)

        def body(state, ids):
            with tensor.tensor_parallel("heads"):
                return nnx.merge(graphdef, state)(ids)

        hlo = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P())) \
            .lower(state, ids).compile().as_text()
        n_reduce = len(re.findall(r"= \S+ all-reduce(-start)?\(", hlo))
        self.assertEqual(n_reduce, 2 * model.config.num_hidden_layers, "one per attention + MLP")
        self.assertNotRegex(hlo, "all-gather", "a weight (or activation) was gathered")

    @parameterized.parameters(2, 4)
    def test_chunked_prefill_with_a_mesh(self, tp):
        seed = _seed()
        model = gemma4.Gemma4ForCausalLM(_config(), dtype=jnp.float32, rngs=nnx.Rngs(seed))
        ids = jax.random.randint(jax.random.key(seed), (2, 13), 0, 256)
        want, want_cache = gemma4.prefill(model, ids, chunk_size=4)
        got, cache = gemma4.prefill(model, ids, chunk_size=4, mesh=_mesh(tp))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"seed={seed}")
        self.assertEqual(int(cache.length), 13)
        for spec, k, k_want in zip(model.config.layers, cache.keys, want_cache.keys):
            split = spec.num_kv_heads % tp == 0
            self.assertEqual(k.sharding.spec, P(None, None, "heads") if split else P(), spec)
            np.testing.assert_allclose(k, k_want, atol=1e-5, rtol=1e-5)

    def test_w4a8_slices_must_keep_whole_k_groups(self):
        model = gemma4.Gemma4ForCausalLM(_config(), dtype=jnp.float32, quantize="w4a8")
        with self.assertRaisesRegex(ValueError, "o_proj has K=256; its W4A8 slices need K / 4 "
                                                "to be a multiple of 128"):
            tensor.forward(model, jnp.zeros((1, 8), jnp.int32), _mesh(4))

    def test_unsupported_configs_are_refused(self):
        with self.assertRaisesRegex(ValueError, "3 query heads do not divide evenly"):
            tensor.check_config(_config(num_attention_heads=3, num_key_value_heads=1), 2)
        with self.assertRaisesRegex(ValueError, "MoE layers are not split yet"):
            tensor.check_config(_config(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                        moe_intermediate_size=16), 2)


if __name__ == "__main__":
    absltest.main()
