"""Chunked prefill (prefill(chunk_size=...)) equals the one-shot prefill (no transformers).

Random Gemma4ForCausalLM models built directly in JAX (float32, and float64 for the equality
with the one-shot prefill; reference attention) with tiny windows so the local rings wrap
inside and across chunks: the generate suite's config (window 3, KV sharing, K=V, PLE), an
E2B-like one (window 4, KV sharing of both layer types, one KV head, double-wide MLP) and a
MoE one (window 5). Chunk sizes straddle the window and the prompt
(1, 3, W-1, W, W+1, S, > S), prompt lengths too (1, W-1, W, 2W+3, 5W). Also: greedy decoding
continued from a chunked cache, one compile for every chunk and prompt length, the progress
bar, the default chunk size, and a cache capacity below the window. The chunk step takes the
model as a pytree (its treedef and arrays) where flax allows, else through nnx.split: both
give the same bits, the step always reads the model's current weights, and the fallback works;
the same for forward, the one-shot prefill and decode.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import gemma4
from jax_mila.__main__ import main
from jax_mila.engine import jitted, plan
from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4.mlp import Gemma4MLP
from jax_mila.nn.linear import MXFP4Param
from test_gemma4_generate import S, F, TINY, tiny_model


CONFIGS = {
    "generate_suite_w3": dict(),
    "e2b_like_w4": dict(sliding_window=4, num_hidden_layers=8, num_key_value_heads=1,
                        layer_types=[S, S, S, F, S, S, S, F], num_kv_shared_layers=3,
                        attention_k_eq_v=False, num_global_key_value_heads=None),
    "moe_w5": dict(sliding_window=5, num_hidden_layers=4, layer_types=[S, S, F, F],
                   num_kv_shared_layers=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=16, hidden_size_per_layer_input=0),
}
NEW_TOKENS = 6


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**31)


def prompt(seed, length, batch=2, base=None):
    # Fresh ids per test run (from `base` + seed: a test that names `base` in its failures can
    # be replayed); the two rows differ.
    seed = (fresh_seed() if base is None else base) + seed
    return jax.random.randint(jax.random.key(seed), (batch, length), 3, 61, jnp.int32)


def assert_close_logits(actual, expected):
    """Within 1e-5 of the largest logit magnitude (up to ~20 here): chunks change the shapes
    of the float32 matmuls and the order of the attention sums, which moves the random tiny
    models' logits by a few 1e-6 x scale (max observed ~3e-5 on logits of magnitude 20);
    a wrongly visible or missing key moves them by O(0.1)."""
    expected = np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, atol=1e-5 * scale, rtol=0)


def assert_same_cache(test, a, b):
    """Every buffer within 1e-5 of its largest magnitude, the logits' criterion (the K/V of
    later layers come from hidden states that went through reordered sums; float64 in
    test_chunked_equals_one_shot, which says why); a key in the wrong slot is off by O(0.1)."""
    np.testing.assert_array_equal(a.length, b.length, strict=True)
    test.assertEqual(a.max_len, b.max_len)
    for i, (x, y) in enumerate(zip(a.keys + a.values, b.keys + b.values)):
        test.assertEqual(x is None, y is None)
        if x is not None:
            test.assertEqual((x.shape, x.dtype), (y.shape, y.dtype))
            x, y = np.asarray(x), np.asarray(y)
            scale = max(1.0, float(np.max(np.abs(y))))
            np.testing.assert_allclose(x, y, atol=1e-5 * scale, rtol=0, err_msg=f"buffer {i}")


def _recorded(fn, calls, *args):
    out = fn(*args)
    calls.append(out)
    return out


class ChunkedPrefillTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        # The 1e-5 bounds assume float32 (or float64) arithmetic, where chunking changes only
        # the order of sums. XLA:GPU's default precision may run float32 dots as TF32, whose
        # rounding these bounds do not cover; two float32 comparisons failed on the H200
        # (test_capacity_below_window, test_one_compile_for_all_chunks; their messages were
        # lost to a timeout, so TF32 is the suspected, not the confirmed, cause). The CPU
        # computes float32 dots in float32 either way.
        self.enter_context(jax.default_matmul_precision("float32"))

    @parameterized.named_parameters(*CONFIGS.items())
    def test_chunked_equals_one_shot(self, overrides):
        # float64, so that the 1e-5 bounds sit far above rounding: in float32 these random
        # 8-layer models amplify the chunks' reordered sums up to the bound (E2B-like,
        # prompt_seed 2101812063, length 20: a cache buffer 1.3e-5 x its magnitude from the
        # one-shot prefill at chunk 3, and 1.1e-5 x at chunk 20, one chunk holding the whole
        # prompt; in float64 3e-7 x, the rest being the reference ops' float32 parts).
        # On the host CPU device, also where a GPU is present: XLA:GPU refuses float64 GEMMs
        # ("GEMM is not supported by cublasLt and legacy cublas fallback is removed", jax 0.11
        # on the H200), and what this checks, the chunks' masks, ring slots and positions, is
        # the same computation on every device (these head dims run the reference attention).
        with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            self._chunked_equals_one_shot(overrides)

    def _chunked_equals_one_shot(self, overrides):
        model = tiny_model(seed=len(overrides), dtype=jnp.float64, **overrides)
        w = model.config.sliding_window
        lengths = (1, w, 2 * w + 3, 5 * w)
        cap = 5 * w + NEW_TOKENS  # one capacity for all prompts: one compile per chunk size
        base = fresh_seed()
        for length in lengths:
            ids = prompt(length, length, base=base)
            ref_logits, ref_cache = gemma4.prefill(model, ids, max_cache_len=cap)
            # Every chunk size on the longest prompt, where each of them crosses the ring's
            # wrap several times; on the shorter ones a chunk per token, one of the window's
            # size, one holding the prompt and one longer than it (each size is a compile).
            sizes = ((1, 3, w - 1, w, w + 1, length, 5 * w + 1) if length == lengths[-1]
                     else (1, w, length, 5 * w + 1))
            for size in sizes:
                with self.subTest(length=length, chunk_size=size, prompt_seed=base + length):
                    logits, cache = gemma4.prefill(model, ids, chunk_size=size, max_cache_len=cap)
                    assert_close_logits(logits, ref_logits)
                    assert_same_cache(self, cache, ref_cache)

    @parameterized.named_parameters(*CONFIGS.items())
    def test_generate_continues_from_chunked_cache(self, overrides):
        model = tiny_model(seed=1 + len(overrides), **overrides)
        w = model.config.sliding_window
        for length, size in ((2 * w + 3, w - 1), (5 * w, 3)):
            with self.subTest(length=length, chunk_size=size):
                ids = prompt(length, length)
                cap = length + NEW_TOKENS
                expected = gemma4.generate(model, ids, NEW_TOKENS)
                logits, cache = gemma4.prefill(model, ids, chunk_size=size, max_cache_len=cap)
                new = gemma4.generate(model, ids, NEW_TOKENS, cache=cache, logits=logits)
                np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))
                # generate's own prefill takes chunk_size too.
                new = gemma4.generate(model, ids, NEW_TOKENS, chunk_size=size)
                np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))

    def test_capacity_below_window(self):
        """Ring of capacity (< window) slots: the ring holds every earlier position."""
        model = tiny_model(sliding_window=16)
        ids = prompt(0, 10)
        ref_logits, ref_cache = gemma4.prefill(model, ids, max_cache_len=13)
        expected = gemma4.generate(model, ids, 3, cache=ref_cache, logits=ref_logits)
        for size in (3, 4, 10):
            logits, cache = gemma4.prefill(model, ids, chunk_size=size, max_cache_len=13)
            self.assertEqual(cache.keys[0].shape[1], 13)
            assert_close_logits(logits, ref_logits)
            new = gemma4.generate(model, ids, 3, cache=cache, logits=logits)
            np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))

    def test_one_compile_for_all_chunks(self):
        model = tiny_model()
        before = jitted.chunk_step_fn(model)._cache_size()
        ids = prompt(0, 33)  # 5 chunks of 7, the last one padded (5 real tokens)
        ref, _ = gemma4.prefill(model, ids, max_cache_len=40)
        logits, cache = gemma4.prefill(model, ids, chunk_size=7, max_cache_len=40)
        np.testing.assert_array_equal(cache.length, 33)
        assert_close_logits(logits, ref)
        # Another prompt length (3 chunks, last with 1 real token) reuses the same step.
        gemma4.prefill(model, ids[:, :15], chunk_size=7, max_cache_len=40)
        self.assertEqual(jitted.chunk_step_fn(model)._cache_size() - before, 1)

    def test_the_head_runs_once_after_the_chunks(self):
        # Each chunk step returns the last real token's hidden state; prefill applies the output
        # head (the product with the whole vocabulary) once, with the step's compile options.
        model = tiny_model()
        ids = prompt(0, 11)
        ref, _ = gemma4.prefill(model, ids, max_cache_len=12)
        steps, heads = [], []
        step, head = jitted.chunk_step_fn(model), jitted.head_fn(model)
        record_step = lambda *a: _recorded(step, steps, *a)  # noqa: E731
        record_head = lambda *a: _recorded(head, heads, *a)  # noqa: E731
        with mock.patch.object(jitted, "chunk_step_fn", return_value=record_step), \
             mock.patch.object(jitted, "head_fn", return_value=record_head):
            logits, _ = gemma4.prefill(model, ids, chunk_size=4, max_cache_len=12)
        self.assertEqual(len(steps), 3)
        hidden = (ids.shape[0], model.config.hidden_size)  # not the vocabulary's logits
        self.assertNotEqual(model.config.hidden_size, model.config.vocab_size)
        self.assertEqual([out[0].shape for out in steps], [hidden] * 3)
        self.assertEqual(len(heads), 1)
        assert_close_logits(logits, ref)
        self.assertIs(head, jitted._head_kernels if model.backend != "reference"
                      else jitted._head_reference)

    def test_progress_bar(self):
        model = tiny_model()
        ids = prompt(0, 10)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            logits, cache = gemma4.prefill(model, ids, chunk_size=4, progress=True)
        self.assertIn("3/3", err.getvalue())
        self.assertIn("chunk", err.getvalue())
        np.testing.assert_array_equal(cache.length, 10)

    def test_default_chunk_size(self):
        model = tiny_model()
        cpu = mock.Mock(memory_stats=mock.Mock(return_value=None))
        with mock.patch.object(jax, "devices", return_value=[cpu]):
            self.assertEqual(plan.default_chunk_size(model, 1, 100), plan.DEFAULT_CHUNK)
        # 64 MiB free less a ~1 KiB cache; the widest activation is the global layers' query
        # heads (4 x 32 float32 values). Not on the kernels (a mock device), so a token costs
        # 16 * 128 * 4 bytes plus 12 bytes of scores per head and position (4 x 1): half of
        # the free memory over that is 4072 tokens, rounded down to a power of two.
        gpu = mock.Mock(memory_stats=mock.Mock(return_value=dict(bytes_limit=2**26, bytes_in_use=0)))
        with mock.patch.object(jax, "devices", return_value=[gpu]):
            self.assertEqual(plan.default_chunk_size(model, 1, 1), 2048)
            self.assertEqual(plan.default_chunk_size(model, 64, 1), plan.MIN_CHUNK)
        # chunk_size=None chunks a prompt longer than the default chunk. The default is patched
        # where prefill takes it: on a GPU the plan comes from the device's free memory (far
        # above 9 tokens, so the prompt would go through the one-shot prefill), not from
        # DEFAULT_CHUNK as on a device without memory figures.
        ids = prompt(0, 9)
        ref, _ = gemma4.prefill(model, ids)
        before = jitted.chunk_step_fn(model)._cache_size()
        with mock.patch.object(plan, "default_chunk_size", return_value=4) as planned:
            logits, cache = gemma4.prefill(model, ids)
        planned.assert_called_once()
        self.assertEqual(jitted.chunk_step_fn(model)._cache_size() - before, 1)
        assert_close_logits(logits, ref)

    def test_default_chunk_size_keeps_the_wide_margin_where_unmeasured(self):
        # On the kernels a dense model plans 2 values of its widest activation a token; one with
        # per-layer embeddings (or routed experts) keeps 4, never having been measured there.
        # The same widths and cache here, so the dense plan is twice as long.
        ple = tiny_model(num_kv_shared_layers=0)
        dense = tiny_model(num_kv_shared_layers=0, hidden_size_per_layer_input=0)
        gpu = mock.Mock(memory_stats=mock.Mock(return_value=dict(bytes_limit=2**23, bytes_in_use=0)))
        with mock.patch.object(jax, "devices", return_value=[gpu]), \
             mock.patch.object(plan, "_attention_on_kernels", return_value=True):
            plans = [plan.default_chunk_size(m, 1, 64) for m in (ple, dense)]
        self.assertEqual(plans[1], 2 * plans[0])
        self.assertGreater(plans[0], plan.MIN_CHUNK)
        self.assertLess(plans[1], plan.MAX_CHUNK)

    def test_chunk_spans(self):
        self.assertEqual(plan.chunk_spans(64, 32), [32, 32])
        self.assertEqual(plan.chunk_spans(65, 32), [32, 32, 32])  # padded to the chunk
        with mock.patch.object(plan, "MIN_CHUNK", 4):
            self.assertEqual(plan.chunk_spans(65, 32, short_tail=True), [32, 32, 4])
            self.assertEqual(plan.chunk_spans(69, 32, short_tail=True), [32, 32, 8])
            self.assertEqual(plan.chunk_spans(81, 32, short_tail=True), [32, 32, 32])  # 17 -> 32
            self.assertEqual(plan.chunk_spans(69, 32, short_tail=True, multiple=3), [32, 32, 9])
            self.assertEqual(plan.chunk_spans(3, 32, short_tail=True), [4])
        self.assertEqual(plan.chunk_spans(40000, 32768, short_tail=True), [32768, 8192])
        self.assertEqual(plan.chunk_spans(32769, 32768, short_tail=True), [32768, plan.MIN_CHUNK])

    def test_default_chunks_end_in_a_short_tail(self):
        # chunk_size=None: whole chunks of the plan, then the 3 tokens left in a chunk of 4
        # (one more compiled step), not one padded to 8; the same logits and cache as chunks
        # of 8 that pad, and as the one-shot prefill.
        model = tiny_model()
        ids = prompt(0, 19)
        ref, _ = gemma4.prefill(model, ids, max_cache_len=24)
        padded_logits, padded_cache = gemma4.prefill(model, ids, chunk_size=8, max_cache_len=24)
        widths, step = [], jitted.chunk_step_fn(model)
        before = step._cache_size()

        def record(*args):
            widths.append(args[3].shape[1])  # (structure, state, cache, ids, valid)
            return step(*args)

        with mock.patch.object(plan, "default_chunk_size", return_value=8), \
             mock.patch.object(plan, "MIN_CHUNK", 2), \
             mock.patch.object(jitted, "chunk_step_fn", return_value=record):
            logits, cache = gemma4.prefill(model, ids, max_cache_len=24)
        self.assertEqual(widths, [8, 8, 4])
        self.assertEqual(step._cache_size() - before, 1)  # the tail (chunks of 8: compiled above)
        np.testing.assert_array_equal(cache.length, 19)
        assert_close_logits(logits, ref)
        assert_close_logits(logits, padded_logits)
        assert_same_cache(self, cache, padded_cache)

    @staticmethod
    def card_model(name):
        from flax import nnx  # noqa: PLC0415

        from jax_mila.gemma4 import paths  # noqa: PLC0415
        from jax_mila.gemma4.config import Gemma4Config  # noqa: PLC0415

        with open(paths.model_card(name)) as f:
            cfg = Gemma4Config.from_dict(json.load(f))
        return nnx.eval_shape(lambda: gemma4.Gemma4ForCausalLM(
            cfg, dtype=jnp.bfloat16, quantize="w4a8", rngs=nnx.Rngs(0)))

    def plans(self, name, weights_gib, budget_gib, lengths, *, kernels=True):
        stats = dict(bytes_limit=141 * 2**30, bytes_in_use=int(weights_gib * 2**30))
        gpu = mock.Mock(memory_stats=mock.Mock(return_value=stats))
        model = self.card_model(name)
        with mock.patch.object(jax, "devices", return_value=[gpu]), \
             mock.patch.object(plan, "_attention_on_kernels", return_value=kernels):
            return [plan.default_chunk_size(model, 1, n, memory_limit=int(budget_gib * 2**30))
                    for n in lengths]

    def test_default_chunk_size_for_the_12b_at_64k(self):
        # The H200 measurements the plan comes from (docs/performance.md): 12B, bf16 MXFP4
        # weights (7.27 GiB in use), 12 GiB budget. On the kernels: chunk 16384 ran 32K at
        # 9.50-9.71 GiB peak, 8192 ran 64K at 9.36, and chunk 32768 (11.01 / 11.53 GiB) is
        # more than half the free memory: the plan must pick the first two. Through XLA the
        # float32 scores cost 12.3 MiB per chunk token at 64K: the smallest chunk.
        self.assertEqual(self.plans("12b", 7.27, 12, (32768, 65536, 131072)), [16384, 8192, 8192])
        self.assertEqual(self.plans("12b", 7.27, 12, (65536,), kernels=False), [plan.MIN_CHUNK])

    def test_default_chunk_size_reserves_a_layer_of_the_cache(self):
        # 31B at 128K on one H200 (17.12 GiB of weights, a 10.78 GiB cache) held 0.8 GiB more
        # than its chunk's share at chunk 4096 (29.23 GiB peak). Under a 30 GiB budget the plan
        # without the reserve would be 4096, at 0.77 GiB of margin; with it, 2048.
        self.assertEqual(self.plans("31b", 17.12, 30, (131072,)), [2048])
        with mock.patch.object(plan, "KV_RESERVE_LAYERS", 0):
            self.assertEqual(self.plans("31b", 17.12, 30, (131072,)), [4096])

    def test_bf16_kernel_head_dims_through_ffi(self):
        """Head dims 256/512 in bf16 take jax_mila.ffi.flash_attention (its reference on CPU;
        the kernels on GPU) with the slab / full-buffer views and traced offsets."""
        model = tiny_model(dtype=jnp.bfloat16, backend="auto", head_dim=256, global_head_dim=512,
                           hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                           hidden_size_per_layer_input=0)
        ids = prompt(0, 11, batch=1)
        ref, ref_cache = gemma4.prefill(model, ids, max_cache_len=14)
        logits, cache = gemma4.prefill(model, ids, chunk_size=4, max_cache_len=14)
        self.assertEqual(logits.dtype, jnp.bfloat16)
        for x, y in zip(cache.keys, ref_cache.keys):
            self.assertEqual(x is None, y is None)
            if x is not None:
                self.assertEqual((x.shape, x.dtype), (y.shape, y.dtype))
        # bf16 rounding of differently shaped chunks: a few bf16 ulps of the logit scale.
        ref = np.asarray(ref, np.float32)
        scale = float(np.max(np.abs(ref)))
        np.testing.assert_allclose(np.asarray(logits, np.float32), ref, atol=0.05 * scale, rtol=0)

    def test_bad_chunk_size(self):
        with self.assertRaisesRegex(ValueError, "chunk_size must be an int >= 1 or None, got 0"):
            gemma4.prefill(tiny_model(), jnp.ones((1, 4), jnp.int32), chunk_size=0)

    @parameterized.parameters(4, None)  # chunked, and a prompt that fits one default chunk
    def test_fp8_cache_for_full_layers(self, chunk):
        model = tiny_model(seed=3)
        ids = prompt(3, 13)
        want, ref_cache = gemma4.prefill(model, ids, chunk_size=chunk)
        got, cache = gemma4.prefill(model, ids, chunk_size=chunk, kv_cache_dtype="float8_e4m3fn")
        for spec, k, v in zip(model.config.layers, cache.keys, cache.values):
            if k is not None:
                want_dtype = model.dtype if spec.is_sliding else jnp.float8_e4m3fn
                self.assertEqual((k.dtype, v.dtype), (jnp.dtype(want_dtype),) * 2, spec)
        # e4m3 keeps 3 mantissa bits of the normed K and V: close, not equal (a wrongly placed
        # key, or an overflow to NaN, would not be close).
        a, b = np.asarray(want, np.float32), np.asarray(got, np.float32)
        cos = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        self.assertGreater(float(cos.min()), 0.99)
        self.assertFalse(np.array_equal(a, b), "the FP8 cache changed nothing: not in use?")
        tokens = gemma4.generate(model, ids, NEW_TOKENS, chunk_size=chunk,
                              kv_cache_dtype="float8_e4m3fn")  # decode reads and appends FP8
        self.assertEqual(tokens.shape, (2, NEW_TOKENS))

    def test_bad_kv_cache_dtype(self):
        with self.assertRaisesRegex(ValueError, "'int8' is not supported .*float8_e4m3fn"):
            gemma4.prefill(tiny_model(), jnp.ones((1, 4), jnp.int32), kv_cache_dtype="int8")


def w4a8_model(seed=0):
    """The generate suite's tiny model, wide enough (128) for MXFP4 linears, in bf16."""
    cfg = gemma4.Gemma4Config.from_dict({**TINY, "hidden_size": 128, "intermediate_size": 128,
                                         "head_dim": 32, "global_head_dim": 32})
    return gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16, backend="reference",
                                    quantize="w4a8", rngs=nnx.Rngs(seed))


def replace_a_weight(model):
    """Replaces layer 0's down projection weight by a new Variable holding other values;
    returns a function that sets the old values back in place."""
    down = model.layers[0].mlp.down_proj
    if down.quantize == "w4a8":
        old = down.mxfp4
        down.packed = MXFP4Param(old.packed ^ jnp.uint8(0x11))
        return lambda: down.set_mxfp4(old)
    old = down.kernel[...]
    down.kernel = nnx.Param(-old)
    return lambda: down.kernel.set_value(old)


@contextlib.contextmanager
def without_tree_mode(model, error=None):
    """As if flax did not register nnx Modules as pytrees (``model`` flattens to itself), or,
    with ``error``, as if flattening it raised that."""
    flatten = jax.tree.flatten

    def fake(tree, *args, **kwargs):
        if tree is not model:
            return flatten(tree, *args, **kwargs)
        if error is not None:
            raise error
        return flatten(tree, is_leaf=lambda x: x is model)

    with mock.patch.object(jax.tree, "flatten", fake):
        yield


def assert_same_bits(test, a, b):
    """Two prefills' (logits, cache), bit for bit."""
    (la, ca), (lb, cb) = a, b
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    np.testing.assert_array_equal(ca.length, cb.length, strict=True)
    for i, (x, y) in enumerate(zip(ca.keys + ca.values, cb.keys + cb.values)):
        test.assertEqual(x is None, y is None)
        if x is not None:
            test.assertEqual((x.shape, x.dtype), (y.shape, y.dtype))
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"buffer {i}")


class TreeModeStepTest(parameterized.TestCase):
    """The chunk step on the model as a pytree (model_args) against nnx.split."""

    def prefill(self, model, ids, **kw):
        return gemma4.prefill(model, ids, chunk_size=4, max_cache_len=16, **kw)

    def prefill_compiled(self, model, ids):
        """A tree-mode prefill that finds its step compiled already."""
        step = jitted.chunk_step_fn(model)
        before = step._cache_size()
        out = self.prefill(model, ids)
        self.assertEqual(step._cache_size(), before, "the step recompiled")
        return out

    def graph_prefill(self, model, ids, **kw):
        with without_tree_mode(model), mock.patch.object(nnx, "split", wraps=nnx.split) as split:
            out = self.prefill(model, ids, **kw)
        split.assert_called_once()
        return out

    @parameterized.named_parameters(
        ("bf16", lambda: tiny_model(dtype=jnp.bfloat16), None),
        ("bf16_fp8_cache", lambda: tiny_model(dtype=jnp.bfloat16), "float8_e4m3fn"),
        ("w4a8", w4a8_model, None),
    )
    def test_same_bits_as_graph_mode(self, build, kv_cache_dtype):
        model = build()
        if build is w4a8_model:
            self.assertNotEmpty(jax.tree.leaves(nnx.state(model, MXFP4Param)))
        structure, leaves = jitted.model_args(model)
        self.assertIsInstance(structure, jax.tree_util.PyTreeDef)
        # Exactly the state's arrays: no attribute that is not a Variable became a leaf.
        state = jax.tree.leaves(nnx.state(model))
        self.assertCountEqual([id(x) for x in leaves], [id(x) for x in state])
        ids = prompt(0, 11)  # 3 chunks of 4, the last padded (3 real tokens)
        with mock.patch.object(nnx, "split", wraps=nnx.split) as split:
            tree = self.prefill(model, ids, kv_cache_dtype=kv_cache_dtype)
        split.assert_not_called()
        assert_same_bits(self, tree, self.graph_prefill(model, ids, kv_cache_dtype=kv_cache_dtype))

    def test_variable_reachable_twice(self):
        model = tiny_model()
        shared = model.layers[0].input_layernorm.weight
        shared.set_value(jnp.linspace(0.5, 1.5, shared.shape[0]))
        model.layers[1].input_layernorm.weight = shared
        _, leaves = jitted.model_args(model)
        self.assertLen(leaves, len(jax.tree.leaves(nnx.state(model))) + 1)  # the array twice
        ids = prompt(0, 11)
        tree = self.prefill(model, ids)
        assert_same_bits(self, tree, self.graph_prefill(model, ids))
        shared.set_value(shared[...] * 2)  # both layers read the new value
        again = self.prefill_compiled(model, ids)
        self.assertFalse(np.array_equal(np.asarray(again[0]), np.asarray(tree[0])))
        assert_same_bits(self, again, self.graph_prefill(model, ids))

    @parameterized.named_parameters(("float32", tiny_model), ("w4a8", w4a8_model))
    def test_reads_the_current_weights(self, build):
        model = build()
        ids = prompt(0, 11)
        first = self.prefill(model, ids)
        restore = replace_a_weight(model)
        # Weights are arguments, never constants: none of this recompiles the tree-mode step.
        replaced = self.prefill_compiled(model, ids)
        self.assertFalse(np.array_equal(np.asarray(replaced[0]), np.asarray(first[0])))
        assert_same_bits(self, replaced, self.graph_prefill(model, ids))
        restore()
        assert_same_bits(self, self.prefill_compiled(model, ids), first)
        # A new submodule of the same structure: new arrays, the same treedef.
        up = model.layers[1].mlp.up_proj
        model.layers[1].mlp = Gemma4MLP(up.in_features, up.out_features, backend=model.backend,
                                        dtype=model.dtype, param_dtype=model.dtype,
                                        quantize=up.quantize, rngs=nnx.Rngs(7))
        other = self.prefill_compiled(model, ids)
        self.assertFalse(np.array_equal(np.asarray(other[0]), np.asarray(first[0])))
        assert_same_bits(self, other, self.graph_prefill(model, ids))

    def test_non_array_attributes_stay_static(self):
        model = tiny_model()
        ids = prompt(0, 11)
        first = self.prefill(model, ids)
        model.norm.eps = 0.5  # a float attribute: part of the treedef, so a new compile
        step = jitted.chunk_step_fn(model)
        before = step._cache_size()
        changed = self.prefill(model, ids)
        self.assertEqual(step._cache_size(), before + 1)
        self.assertFalse(np.array_equal(np.asarray(changed[0]), np.asarray(first[0])))

    def test_fallback_to_graph_mode(self):
        model = tiny_model(seed=2)
        ids = prompt(0, 11)
        want = self.prefill(model, ids)
        for error in (None, TypeError("no pytree")):
            with self.subTest(error=repr(error)), without_tree_mode(model, error):
                structure, _ = jitted.model_args(model)
                self.assertIsInstance(structure, nnx.GraphDef)
                assert_same_bits(self, self.prefill(model, ids), want)

        class Opaque(nnx.Module, pytree=False):  # flattens as a leaf that is no array
            def __init__(self):
                self.w = nnx.Param(jnp.ones(3))

        model.extra = Opaque()
        structure, _ = jitted.model_args(model)
        self.assertIsInstance(structure, nnx.GraphDef)
        assert_same_bits(self, self.prefill(model, ids), want)


def _decode_setup(model, ids):
    logits, cache = gemma4.prefill(model, ids, max_cache_len=16)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


# forward, the one-shot prefill and decode: (their jitted step, setup(model, ids) -> inputs
# made once, call(model, ids, inputs) -> outputs).
ENTRY_POINTS = {
    "forward": ("forward_step", lambda model, ids: (),
                lambda model, ids, _: gemma4.forward(model, ids)),
    "prefill": ("prefill_step", lambda model, ids: (),
                lambda model, ids, _: gemma4.prefill(model, ids, max_cache_len=16)),
    "decode": ("decode_steps", _decode_setup,
               lambda model, ids, inputs: gemma4.decode(model, *inputs, 3)),
}


class TreeModeEntryPointsTest(parameterized.TestCase):
    """forward, the one-shot prefill and decode take the model as model_args gives it, like the
    chunk step: the same bits as through nnx.split, and the weights as they are at each call."""

    def assert_same_leaves(self, a, b):
        self.assertEqual(jax.tree.structure(a), jax.tree.structure(b))
        for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            self.assertEqual((x.shape, x.dtype), (y.shape, y.dtype))
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"leaf {i}")

    def run_both(self, name, model, ids, inputs):
        """(tree-mode outputs, graph-mode outputs, compiles of the step), each on its own copy
        of ``inputs`` (decode donates its cache). Tree mode never calls nnx.split."""
        step_name, _, call = ENTRY_POINTS[name]
        step = getattr(jitted, step_name)
        before = step._cache_size()
        with mock.patch.object(nnx, "split", wraps=nnx.split) as split:
            tree = call(model, ids, jax.tree.map(jnp.copy, inputs))
        split.assert_not_called()
        with without_tree_mode(model), mock.patch.object(nnx, "split", wraps=nnx.split) as split:
            graph = call(model, ids, jax.tree.map(jnp.copy, inputs))
        split.assert_called_once()
        return tree, graph, step._cache_size() - before

    @parameterized.product(name=list(ENTRY_POINTS), build=["bf16", "w4a8"])
    def test_same_bits_and_current_weights(self, name, build):
        model = tiny_model(dtype=jnp.bfloat16) if build == "bf16" else w4a8_model()
        ids = prompt(0, 11)
        inputs = ENTRY_POINTS[name][1](model, ids)  # decode's token and cache, by these weights
        first, graph, _ = self.run_both(name, model, ids, inputs)
        self.assert_same_leaves(first, graph)
        # Weights are arguments, never constants: a new one changes the outputs (from the same
        # inputs) without a compile in either mode.
        restore = replace_a_weight(model)
        replaced, graph, compiles = self.run_both(name, model, ids, inputs)
        self.assertEqual(compiles, 0)
        self.assert_same_leaves(replaced, graph)
        self.assertFalse(all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                             zip(jax.tree.leaves(first), jax.tree.leaves(replaced))))
        restore()
        back, _, compiles = self.run_both(name, model, ids, inputs)
        self.assertEqual(compiles, 0)
        self.assert_same_leaves(back, first)


class RingUpdateTest(absltest.TestCase):
    """cache.chunk_update on a ring (and on a full buffer), against a per-position model of
    what the buffer must hold."""

    def test_ring_keeps_the_last_positions_in_their_slots(self):
        seed = int(np.random.SeedSequence().entropy % (2**31))
        rng = np.random.default_rng(seed)
        update = jax.jit(lambda buf, k, pos, valid: kv.chunk_update(buf, buf, k, k, pos, valid,
                                                                    ring=True))
        for size, t in ((1, 1), (3, 5), (4, 4), (8, 3)):
            for pos in (0, 2, size, 3 * size + 1):
                for valid in sorted({1, (t + 1) // 2, t}):
                    buf = rng.standard_normal((1, size, 2, 3)).astype(np.float32)
                    k = rng.standard_normal((1, t, 2, 3)).astype(np.float32)
                    want = buf.copy()
                    for j in range(valid):  # positions in order: later ones overwrite
                        want[:, (pos + j) % size] = k[:, j]
                    got = update(buf, k, jnp.int32(pos), jnp.int32(valid))[0]
                    np.testing.assert_array_equal(
                        np.asarray(got), want,
                        err_msg=f"ring {size}, chunk {t}, pos {pos}, valid {valid}, seed={seed}")

    def test_first_chunk_is_its_own_view(self):
        # first=True (pos 0 promised): the ring the slab path writes, and the chunk itself as
        # the view at kv_offset 0 (the slab path's view is the chunk and R zeros).
        seed = int(np.random.SeedSequence().entropy % (2**31))
        rng = np.random.default_rng(seed)
        update = jax.jit(lambda buf, k, valid, first: kv.chunk_update(
            buf, buf, k, k, jnp.int32(0), valid, ring=True, first=first), static_argnums=3)
        for size, t in ((1, 1), (3, 5), (4, 4), (8, 3)):
            for valid in sorted({1, (t + 1) // 2, t}):
                buf = rng.standard_normal((1, size, 2, 3)).astype(np.float32)
                k = rng.standard_normal((1, t, 2, 3)).astype(np.float32)
                msg = f"ring {size}, chunk {t}, valid {valid}, seed={seed}"
                ring, _, view, _, offset = update(buf, k, jnp.int32(valid), True)
                slab_ring, _, slab, _, slab_offset = update(buf, k, jnp.int32(valid), False)
                np.testing.assert_array_equal(np.asarray(ring), np.asarray(slab_ring), err_msg=msg)
                np.testing.assert_array_equal(np.asarray(view), k, err_msg=msg)
                np.testing.assert_array_equal(np.asarray(slab)[:, :t], k, err_msg=msg)
                self.assertEqual((int(offset), int(slab_offset)), (0, 0), msg)

    def test_full_buffer_takes_the_real_tokens_only(self):
        # The writes go through cache.set_rows, which promises XLA distinct slots (the dropped
        # padding ones included); on a GPU that makes them plain stores.
        seed = int(np.random.SeedSequence().entropy % (2**31))
        rng = np.random.default_rng(seed)
        update = jax.jit(lambda buf, k, pos, valid: kv.chunk_update(buf, buf, k, k, pos, valid,
                                                                    ring=False))
        size = 11
        for t in (1, 4, 7):
            for pos in (0, 3, size - t):
                for valid in sorted({1, (t + 1) // 2, t}):
                    buf = rng.standard_normal((1, size, 2, 3)).astype(np.float32)
                    k = rng.standard_normal((1, t, 2, 3)).astype(np.float32)
                    want = buf.copy()
                    want[:, pos:pos + valid] = k[:, :valid]
                    got = update(buf, k, jnp.int32(pos), jnp.int32(valid))[0]
                    np.testing.assert_array_equal(
                        np.asarray(got), want,
                        err_msg=f"buffer {size}, chunk {t}, pos {pos}, valid {valid}, seed={seed}")


class ChunkedCliTest(absltest.TestCase):
    """`python -m jax_mila prefill|generate --chunk-size N` on the embedded checkpoint."""

    def run_cli(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(argv))
        return out.getvalue(), err.getvalue()

    def test_generate_with_chunks_equals_one_shot(self):
        common = ("generate", "--length", "20", "--new-tokens", "3", "--dtype", "float32")
        text, bar = self.run_cli(*common, "--chunk-size", "8")
        self.assertRegex(text, r"prefill: 20 tokens in .* tokens/s .*chunks of 8")
        self.assertIn("3/3", bar)  # the progress bar over the 3 chunks
        one_shot, _ = self.run_cli(*common)
        ids = lambda t: re.search(r"generated ids: (\[.*\])", t).group(1)
        self.assertEqual(ids(text), ids(one_shot))

    def test_bad_chunk_size_exits(self):
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            main(["prefill", "--chunk-size", "0"])


if __name__ == "__main__":
    absltest.main()
