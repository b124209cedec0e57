"""Context parallelism inside the chunked prefill (gemma4.prefill(mesh=..., seq_axis="seq"),
jax_mila.parallel.chunked, jax_mila.engine.sharded) against the single-device chunked prefill,
on forced host devices (tests/conftest.py) through the reference ops, float32: last logits and
every cache buffer (the position-sharded ones gathered back to positions), for 2 and 4
devices, chunk sizes that do not divide the prompt, prompts shorter than a chunk, caches longer than the prompt (empty
segments), KV-shared / PLE / MoE layers, and a seq x heads mesh."""

import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_mila import gemma4, parallel
from jax_mila.engine import sharded
from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.parallel import Layout, chunked
from jax_mila.reference.w4a8 import grouped_rows_product

S, F = "sliding_attention", "full_attention"

CONFIGS = {
    # 12B-like: K=V global layers with one KV head, 2 KV heads locally.
    "k_eq_v": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                   num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F],
                   sliding_window=4, hidden_size_per_layer_input=0),
    # KV-shared layers of both types (they read their source's view), PLE, double-wide MLP.
    "shared_ple": dict(vocab_size=61, hidden_size=32, intermediate_size=24, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                       layer_types=[S, F, S, S, F, F], num_kv_shared_layers=2,
                       use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=61, sliding_window=3),
    # MoE, separate V, two global KV heads.
    "moe": dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=2, attention_k_eq_v=False, layer_types=[S, F, S, F],
                sliding_window=5, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=16, hidden_size_per_layer_input=0),
}


def _seed():
    return int(np.random.SeedSequence().entropy % (2**31))


def _model(name, seed):
    raw = dict(model_type="gemma4_text", final_logit_softcapping=30.0, **CONFIGS[name])
    return gemma4.Gemma4ForCausalLM(Gemma4Config.from_dict(raw), dtype=jnp.float32,
                                    backend="reference", rngs=nnx.Rngs(seed))


def _mesh(shape, names=("seq",)):
    devices = np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def _spec(*axes):
    """A PartitionSpec as a sharded array reports it (trailing Nones dropped)."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def _ids(seed, length, vocab):
    return jax.random.randint(jax.random.key(seed), (2, length), 3, vocab, jnp.int32)


def _assert_close_logits(test, got, want, seed, reorderings=()):
    """float32: the merged attention sums and the split matmuls add in another order (a few
    1e-6 on logits up to ~30 for most seeds); a wrongly visible key moves them by O(0.1).

    Some random models amplify float32 reassociation far more: "shared_ple", seed 1418859679,
    put the logits 6.2e-4 (2.5e-5 x scale) from one device's, and one device disagreed with
    itself by 5.7e-4 (2.3e-5 x scale) between chunk sizes (one-shot against chunk 8). So
    where 1e-5 x scale does not hold, `reorderings` (callables: the same single-device logits
    summed in another order, e.g. another chunk size) measure that model's own sensitivity,
    and the bound is twice it, never above 1e-2 x scale."""
    got, want = np.asarray(got), np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))))
    test.assertTrue(np.all(np.isfinite(got)), f"seed={seed}")
    err = float(np.max(np.abs(got - want)))
    if err <= 1e-5 * scale:
        return
    own = max((float(np.max(np.abs(np.asarray(f()) - want))) for f in reorderings), default=0.0)
    bound = min(max(1e-5 * scale, 2 * own), 1e-2 * scale)
    test.assertLessEqual(err, bound, f"seed={seed}: logits {err:.2e} from one device's, which "
                                     f"moves by {own:.2e} between its own chunk sizes (scale "
                                     f"{scale:.1f})")


def _assert_same_cache(test, got, want, seed):
    """got: a context-parallel cache; want: one device's cache of capacity want.max_len."""
    np.testing.assert_array_equal(got.length, want.length, strict=True)
    ordered = chunked.cache_in_position_order(got)
    test.assertEqual(ordered.seq_layout, ())
    n = want.max_len
    for i, (x, y) in enumerate(zip(ordered.keys + ordered.values, want.keys + want.values)):
        test.assertEqual(x is None, y is None)
        if x is None:
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.shape[1] == got.max_len and y.shape[1] == n:  # full layer: capacity rounded up
            np.testing.assert_array_equal(x[:, n:], 0, err_msg=f"buffer {i}: slots past max_len")
            x = x[:, :n]
        test.assertEqual(x.shape, y.shape, f"buffer {i}")
        # Layers after the first cache K/V computed from hidden states that went through the
        # merged (reassociated) float32 attention sums: seed 572390202 put a full layer's K
        # 1.7e-5 from one device's at magnitude ~1 (1e-5 failed 2 of 10 runs); a key
        # written to the wrong slot or position is off by O(0.1).
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4, err_msg=f"buffer {i}, seed={seed}")


class ChunkedContextParallelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if len(jax.devices("cpu")) < 4:
            self.skipTest("needs 4 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
        # The one-device prefill on a CPU too, where a GPU is the default device: XLA:GPU's
        # float32 dots may round through TF32, far above these tests' 1e-5.
        self.enter_context(jax.default_device(jax.devices("cpu")[0]))

    # (prompt, chunk, max_cache_len, segments per device): a padded last chunk, a chunk longer
    # than the prompt, a cache far longer than the prompt (most segments empty), a full cache of
    # 8 segments per device (eight running merges, all holding keys). Each case runs on one
    # (config, devices) pair, every config and device count on two cases or more: each case is
    # three compiles of a model, and what it varies (masks, merges, slots) is the same code for
    # every config.
    @parameterized.parameters(
        ("k_eq_v", 2, (13, 4, None, 2)), ("shared_ple", 4, (13, 4, None, 2)),
        ("moe", 4, (13, 8, 40, 4)), ("k_eq_v", 4, (6, 8, None, 2)),
        ("shared_ple", 2, (21, 12, 64, 8)), ("moe", 2, (30, 8, None, 8)),
        ("k_eq_v", 4, (30, 8, None, 8)))
    def test_equals_single_device_prefill(self, name, devices, case):
        length, chunk, max_len, segments = case
        seed = _seed()
        model = _model(name, seed)
        ids = _ids(seed, length, model.config.vocab_size)
        want, want_cache = gemma4.prefill(model, ids, chunk_size=chunk, max_cache_len=max_len)
        got, cache = gemma4.prefill(model, ids, chunk_size=chunk, max_cache_len=max_len,
                                    mesh=_mesh(devices), seq_segments=segments)
        # The same single-device prefill in other chunk sizes: what float32 reassociation alone
        # does to this model's logits (used only where 1e-5 x scale does not hold).
        reorderings = [lambda c=c: gemma4.prefill(model, ids, chunk_size=c,
                                                  max_cache_len=max_len)[0] for c in (length, 2)]
        _assert_close_logits(self, got, want, seed, reorderings)
        self.assertEqual(cache.seq_layout, (devices, segments))
        self.assertEqual(cache.max_len % (devices * segments), 0)
        self.assertBetween(cache.max_len - want_cache.max_len, 0, devices * segments - 1)
        for spec, k in zip(model.config.layers, cache.keys):
            if k is None:
                continue
            self.assertEqual(k.sharding.spec, P() if spec.is_sliding else P(None, "seq"))
            if not spec.is_sliding:  # each device holds 1/devices of the positions
                shards = {s.data.shape[1] for s in k.addressable_shards}
                self.assertEqual(shards, {cache.max_len // devices})
        _assert_same_cache(self, cache, want_cache, seed)

    def test_segments_attend_in_one_call_per_full_layer(self):
        # A device attends to all its segments in one call (a vector kv_offset): no loop over
        # segments, no per-segment partials; the result still equals one device's (eight
        # segments per device, all holding keys).
        seed = _seed()
        model = _model("moe", seed)
        ids = _ids(seed, 30, model.config.vocab_size)
        want, want_cache = gemma4.prefill(model, ids, chunk_size=8)
        got, cache = gemma4.prefill(model, ids, chunk_size=8, mesh=_mesh(2), seq_segments=8)
        _assert_close_logits(self, got, want, seed)
        _assert_same_cache(self, cache, want_cache, seed)
        graphdef, state = nnx.split(model)
        make = functools.partial(kv.empty, model.config, 2, 32, jnp.float32, seq_layout=(2, 8))
        step, state, empty = sharded.chunk_step(model, state, make, _mesh(2), tp_axis=None,
                                                seq_axis="seq", segments=8)
        text = step.lower(state, empty, jnp.zeros((2, 8), jnp.int32), jnp.int32(8)).as_text()
        # No loop over the segments: the only while loops are the experts' (the reference's
        # grouped products, gate_up and down in every layer, loop over their groups).
        whiles = functools.partial(re.findall, r"stablehlo\.while")
        per_product = len(whiles(jax.jit(
            lambda x, g, w: grouped_rows_product(x, g, w, lambda a: a, 4)).lower(
                jnp.zeros((8, 4)), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4, 4))).as_text()))
        self.assertLen(whiles(text), per_product * 2 * model.config.num_hidden_layers)
        # The reference attention's score product (keys [B, 16, Hkv, D] against the 8 queries
        # [B, 8, Hkv, G, D]) once per full layer, over all 16 local slots (8 segments of 2:
        # capacity 32 over 2 devices), not once per 2-slot segment.
        full = sum(not s.is_sliding for s in model.config.layers)
        scores = re.findall(r"stablehlo\.dot_general.*\(tensor<2x16x2x32xf32>, "
                            r"tensor<2x8x2x2x32xf32>\)", text)
        self.assertLen(scores, full)

    def test_default_chunk_is_rounded_up_to_the_devices(self):
        # No chunk_size: a prompt shorter than the default chunk runs as one chunk of its own
        # length rounded up to a multiple of the devices (13 -> 16 on 4 devices).
        seed = _seed()
        model = _model("k_eq_v", seed)
        ids = _ids(seed, 13, 256)
        want, want_cache = gemma4.prefill(model, ids, chunk_size=13)
        got, cache = gemma4.prefill(model, ids, mesh=_mesh(4))
        _assert_close_logits(self, got, want, seed)
        self.assertEqual(cache.seq_layout, (4, chunked.DEFAULT_SEGMENTS))
        _assert_same_cache(self, cache, want_cache, seed)

    @parameterized.parameters("k_eq_v", "shared_ple")
    def test_seq_by_heads_mesh(self, name):
        seed = _seed()
        model = _model(name, seed)
        if name == "shared_ple":  # PLE is not split over heads: refused with its reason
            with self.assertRaisesRegex(ValueError, "per-layer embeddings"):
                gemma4.prefill(model, _ids(seed, 8, 61), chunk_size=4,
                               mesh=_mesh((2, 2), ("seq", "heads")))
            return
        ids = _ids(seed, 19, 256)
        want, want_cache = gemma4.prefill(model, ids, chunk_size=6, max_cache_len=24)
        got, cache = gemma4.prefill(model, ids, chunk_size=6, max_cache_len=24,
                                    mesh=_mesh((2, 2), ("seq", "heads")), seq_segments=4)
        _assert_close_logits(self, got, want, seed)
        for spec, k in zip(model.config.layers, cache.keys):
            heads = "heads" if spec.num_kv_heads % 2 == 0 else None
            seq = None if spec.is_sliding else "seq"
            self.assertEqual(k.sharding.spec, _spec(None, seq, heads))
        _assert_same_cache(self, cache, want_cache, seed)

    @parameterized.parameters(((2,), ("seq",), None), ((2, 2), ("seq", "heads"), "heads"))
    def test_the_head_runs_once_after_the_chunks(self, shape, names, tp_axis):
        # As on one device: every mesh step returns the last real token's hidden state
        # (replicated, [B, H]), and prefill applies the output head once, after the chunks.
        seed = _seed()
        model = _model("k_eq_v", seed)
        ids = _ids(seed, 19, 256)
        want, _ = gemma4.prefill(model, ids, chunk_size=8, max_cache_len=24)
        outs, heads = [], []
        real_step, real_head = sharded.chunk_step, sharded.head

        def recording_step(*args, **kwargs):
            step, state, cache = real_step(*args, **kwargs)

            def recorded(*a):
                out = step(*a)
                outs.append(out[0])
                return out
            return recorded, state, cache

        def recording_head(*args, **kwargs):
            head = real_head(*args, **kwargs)
            self.assertEqual(kwargs["tp_axis"], tp_axis)

            def recorded(state, last):
                heads.append(last)
                return head(state, last)
            return recorded

        with mock.patch.object(sharded, "chunk_step", recording_step), \
             mock.patch.object(sharded, "head", recording_head):
            got, _ = gemma4.prefill(model, ids, chunk_size=8, max_cache_len=24,
                                    mesh=_mesh(shape, names), seq_segments=2)
        hidden = (ids.shape[0], model.config.hidden_size)  # not the vocabulary's logits
        self.assertNotEqual(model.config.hidden_size, model.config.vocab_size)
        self.assertEqual([out.shape for out in outs], [hidden] * 3)
        self.assertLen(heads, 1)
        self.assertEqual(got.shape, (ids.shape[0], model.config.vocab_size))
        _assert_close_logits(self, got, want, seed)

    def test_decode_continues_from_the_cache_in_position_order(self):
        seed = _seed()
        model = _model("shared_ple", seed)
        ids = _ids(seed, 11, 61)
        want = gemma4.generate(model, ids, 5, chunk_size=4)
        logits, cache = gemma4.prefill(model, ids, chunk_size=4, max_cache_len=16,
                                       mesh=_mesh(2), seq_segments=2)
        with self.assertRaisesRegex(ValueError, "sharded by position"):
            gemma4.decode(model, jnp.argmax(logits, -1), cache, 1)
        got = gemma4.generate(model, ids, 5, logits=logits,
                              cache=chunked.cache_in_position_order(cache))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed={seed}")

    def test_one_compiled_step_for_every_chunk_and_prompt(self):
        # The jitted step is kept across prefill calls (keyed by model structure, mesh and
        # layout): prompts of other lengths with the same capacity reuse its one executable.
        model = _model("k_eq_v", 0)
        mesh = _mesh(2)
        sharded._STEPS.clear()
        for length in (5, 13, 18):
            gemma4.prefill(model, _ids(length, length, 256), chunk_size=4, max_cache_len=32,
                           mesh=mesh, seq_segments=2)
        self.assertLen(sharded._STEPS, 2)  # the step and the output head
        for fn in sharded._STEPS.values():
            self.assertEqual(fn._cache_size(), 1)

    @parameterized.parameters(((2,), ("seq",), "seq", None), ((2, 2), ("seq", "heads"), "seq", "heads"))
    def test_empty_cache_is_made_in_its_shards(self, shape, names, seq_axis, tp_axis):
        # prefill's cache on a mesh (sharded.chunk_step makes it): each buffer created with its
        # cache_specs sharding (each device allocates only its part), zero, with the static
        # fields of kv.empty's.
        model = _model("k_eq_v", 0)
        mesh = _mesh(shape, names)
        make = functools.partial(kv.empty, model.config, 1, 24, jnp.float32, seq_layout=(2, 2))
        _, _, cache = sharded.chunk_step(model, nnx.state(model), make, mesh,
                                         tp_axis=tp_axis, seq_axis=seq_axis, segments=2)
        want = make()
        specs = chunked.cache_specs(want, model.config, seq_axis=seq_axis, tp_axis=tp_axis,
                                    tp_size=mesh.shape.get("heads", 1))
        self.assertEqual((cache.max_len, cache.seq_layout), (want.max_len, want.seq_layout))
        got_leaves, got_def = jax.tree.flatten(cache)
        want_leaves, want_def = jax.tree.flatten(want)
        self.assertEqual(got_def, want_def)
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        self.assertLen(spec_leaves, len(got_leaves))
        for got, ref, spec in zip(got_leaves, want_leaves, spec_leaves):
            self.assertEqual((got.shape, got.dtype), (ref.shape, ref.dtype))
            self.assertEqual(got.sharding, NamedSharding(mesh, spec))
            for shard in got.addressable_shards:
                self.assertEqual(shard.data.shape, got.sharding.shard_shape(got.shape))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        # The full-attention buffers are split by position, not whole on any device.
        full = [x for x, sp in zip(got_leaves, spec_leaves) if len(sp) > 1 and sp[1] == seq_axis]
        self.assertNotEmpty(full)
        for x in full:
            self.assertLess(x.addressable_shards[0].data.shape[1], x.shape[1])

    def test_layout_is_zigzag_and_covers_every_position(self):
        # 2 devices x 4 segments of 3: device 0 owns 0, 3, 4, 7 and device 1 owns 1, 2, 5, 6.
        order = chunked.slot_positions(24, 2, 4)
        owned = order.reshape(2, 4, 3)[:, :, 0] // 3
        np.testing.assert_array_equal(owned, [[0, 3, 4, 7], [1, 2, 5, 6]])
        np.testing.assert_array_equal(np.sort(order), np.arange(24))
        self.assertEqual(chunked.capacity(13, 2, 4), 16)
        self.assertEqual(chunked.capacity(16, 2, 4), 16)

    @parameterized.parameters(((2,), ("seq",)), ((2, 2), ("seq", "heads")))
    def test_compiled_step_gathers_activations_only(self, shape, names):
        # Weights are replicated over the seq axis (split over heads): the step's all-gathers
        # carry only the full layers' chunk K/V and Q (the chunk length, 24, sits on their
        # token axis) and lse ([devices, B, H, chunk]), and the sliding layers' halos: each
        # device's last R = 4 keys ([B, 2 R, H, head_dim]; a device's slice of 12 tokens
        # holds more than R, so the chunk's sliding K/V are not gathered). One reduce-scatter
        # per full layer returns each device its rows.
        model = _model("k_eq_v", 0)
        graphdef, state = nnx.split(model)
        mesh, chunk = _mesh(shape, names), 24
        make = functools.partial(kv.empty, model.config, 1, 48, jnp.float32, seq_layout=(2, 2))
        step, state, cache = sharded.chunk_step(
            model, state, make, mesh, tp_axis="heads" if "heads" in names else None,
            seq_axis="seq", segments=2)
        hlo = step.lower(state, cache, jnp.zeros((1, chunk), jnp.int32), jnp.int32(chunk)) \
            .compile().as_text()
        gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
        cfg = model.config
        halos, activations = [], []
        for shape in gathers:
            dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[", 1)[1])]
            if chunk in dims:
                activations.append(shape)
            else:
                self.assertEqual((dims[1], dims[-1]), (2 * cfg.sliding_window, cfg.head_dim),
                                 f"all-gather of {shape}: neither the chunk's nor a halo")
                halos.append(shape)
        full = sum(not s.is_sliding for s in cfg.layers)
        sliding = len(cfg.layers) - full
        self.assertLen(re.findall(r"= \S+ reduce-scatter(?:-start)?\(", hlo), full)
        # K, V, Q and lse of the full layers, K and V halos of the sliding ones (XLA may
        # combine some).
        self.assertBetween(len(activations), 1, 4 * full)
        self.assertBetween(len(halos), 1, 2 * sliding)

    def test_kernels_on_two_gpus(self):
        # The kernel path where 2 GPUs are visible: flash attention d256 / d512 with
        # return_lse inside shard_map (empty segments: zeros, lse -inf), bf16. bf16 noise
        # hides small errors (exactness is the float32 tests' job), so both the sharded and
        # the one-GPU prefill are measured against a float32-math reference of the same bf16
        # weights, and the sharded one may be at most a little further from it.
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if len(gpus) < 2:
            self.skipTest("needs 2 GPUs")
        with jax.default_device(gpus[0]):
            self._kernels_on_gpus(gpus)

    def _kernels_on_gpus(self, gpus):
        seed = _seed()
        raw = dict(model_type="gemma4_text", final_logit_softcapping=30.0, vocab_size=512,
                   hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                   global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
                   layer_types=[S, F, S, F], sliding_window=128, hidden_size_per_layer_input=0)
        cfg = Gemma4Config.from_dict(raw)
        model = gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16, backend="auto",
                                         rngs=nnx.Rngs(seed))
        ref = gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.float32, param_dtype=jnp.bfloat16,
                                       backend="reference", rngs=nnx.Rngs(seed))
        ids = _ids(seed, 1000, 512)
        run = dict(chunk_size=256, max_cache_len=1024)
        exact, exact_cache = gemma4.prefill(ref, ids, **run)
        one, one_cache = gemma4.prefill(model, ids, **run)
        got, cache = gemma4.prefill(model, ids, mesh=Mesh(np.array(gpus[:2]), ("seq",)),
                                    seq_segments=4, **run)
        self.assertTrue(np.all(np.isfinite(np.asarray(got, np.float32))), f"seed={seed}")

        def rel(a, b):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            return float(np.linalg.norm(a - b) / np.linalg.norm(b))

        ordered = chunked.cache_in_position_order(cache)
        pairs = [("logits", got, one, exact)] + [
            (f"keys[{i}]", x, y, z) for i, (x, y, z) in
            enumerate(zip(ordered.keys, one_cache.keys, exact_cache.keys))]
        for what, x, y, z in pairs:
            self.assertLessEqual(rel(x, z), 1.5 * rel(y, z) + 1e-3,
                                 f"{what}: sharded vs one GPU, seed={seed}")

    def test_refusals(self):
        model = _model("k_eq_v", 0)
        ids = jnp.zeros((1, 8), jnp.int32)
        with self.assertRaisesRegex(ValueError, r"chunk_size=5: context parallelism over 2 "
                                                r"devices \('seq'\) needs a multiple of 2"):
            gemma4.prefill(model, ids, chunk_size=5, mesh=_mesh(2))
        with self.assertRaisesRegex(ValueError, r"axes \('data',\) include neither tp_axis="
                                                r"'heads' \(heads\) nor seq_axis='seq'"):
            gemma4.prefill(model, ids, chunk_size=4, mesh=_mesh(2, ("data",)))
        with self.assertRaisesRegex(ValueError, "segments per device must be an even int >= 2"):
            gemma4.prefill(model, ids, chunk_size=4, mesh=_mesh(2), seq_segments=3)
        with self.assertRaisesRegex(ValueError, "chunked context parallelism runs mode 'chunk'"):
            model.hidden_states(ids, layout=Layout(seq_axis="seq", seq_split="chunk",
                                                   segments=2))
        with self.assertRaisesRegex(ValueError, "capacity 13 is not a multiple of devices x "
                                                "segments = 4"):
            chunked.slot_positions(13, 2, 2)
        zigzag = Layout(seq_axis="seq", seq_split="zigzag")
        with self.assertRaisesRegex(ValueError, "context parallelism runs mode 'full' only"):
            model.hidden_states(ids, mode="prefill", max_len=8, layout=zigzag)

    def test_layout_refusals(self):
        self.assertEqual(Layout(), parallel.SINGLE_DEVICE)
        with self.assertRaisesRegex(ValueError, r"seq_split='ring' \(supported: \(None, "
                                                r"'zigzag', 'chunk'\)\)"):
            Layout(seq_axis="seq", seq_split="ring")
        with self.assertRaisesRegex(ValueError, "seq_axis='seq' and seq_split=None: name both "
                                                "or neither"):
            Layout(seq_axis="seq")
        with self.assertRaisesRegex(ValueError, "segments per device must be an even int >= 2"):
            Layout(seq_axis="seq", seq_split="chunk", segments=3)
        with self.assertRaisesRegex(ValueError, "segments=2 is for seq_split 'chunk' only"):
            Layout(seq_axis="seq", seq_split="zigzag", segments=2)
        with self.assertRaisesRegex(ValueError, "one axis 'x' for heads and sequence"):
            Layout(heads_axis="x", seq_axis="x", seq_split="zigzag")


if __name__ == "__main__":
    absltest.main()
