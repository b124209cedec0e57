"""Prompts of different lengths in one batch (``lengths``, right padding), and decode steps that
read the cache where it lies (decode_attention: per-row lengths, rings in place, FP8 as stored).

The reference for a row is always that row alone: its prefill's logits and cache, and for
tokens re-running its full sequence (test_gemma4_generate's greedy_by_rerun). The tiny model of
the generate suite has a window of 3 (its rings wrap), KV-shared layers (reading a ring and a
full layer), K=V full layers and per-layer embeddings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import gemma4, reference
from jax_mila.engine import jitted
from jax_mila.gemma4 import cache as kv
from test_gemma4_generate import TINY, WINDOW, greedy_by_rerun, tiny_model

VOCAB = TINY["vocab_size"]
LENGTHS = [9, 4, 1, 3]   # past, above, below and at the window (3); the longest is not row 0
WIDTH = 11               # the prompt array's width: columns 9, 10 are padding of every row
# No per-layer embeddings or KV-shared layers: the prefill runs in layer pieces.
IN_PIECES = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0)


def lively(seed: int, **overrides):
    """tiny_model with its post-attention and post-MLP norms at scale 10, so greedy tokens
    change from step to step (test_decode_loop.lively_model, with config overrides)."""
    model = tiny_model(seed=seed, **overrides)
    leaves, tree = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [10 * jax.random.normal(k, x.shape, x.dtype)
           if any(n in jax.tree_util.keystr(p) for n in ("post_attention_layernorm",
                                                          "post_feedforward_layernorm"))
           else x for (p, x), k in zip(leaves, keys)]
    nnx.update(model, jax.tree_util.tree_unflatten(tree, new))
    return model


def prompts(seed: int, width: int = WIDTH, batch: int = len(LENGTHS)) -> np.ndarray:
    """Random ids [batch, width]; the padding past each row's length is random ids too (not
    0), so a padded key reaching a real query would show."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, VOCAB, size=(batch, width), dtype=np.int32)


def greedy_rows_by_rerun(model, ids, lengths, n) -> np.ndarray:
    """greedy_by_rerun of every row alone, ids[b, :lengths[b]], in one compiled shape: the
    model is causal, so in a buffer of the batch's final width row b's logits at its position
    p depend only on its tokens up to p, whatever follows them."""
    ids = np.asarray(ids)
    lengths = np.asarray(lengths)
    rows = np.arange(len(lengths))
    buf = np.zeros((len(lengths), ids.shape[1] + n), np.int32)
    for row, length in enumerate(lengths):
        buf[row, :length] = ids[row, :length]
    for i in range(n):
        logits = gemma4.forward(model, buf)[rows, lengths + i - 1]
        buf[rows, lengths + i] = np.asarray(jnp.argmax(logits, axis=-1))
    return np.stack([buf[row, length:length + n] for row, length in enumerate(lengths)])


def generate_alone(model, ids, row: int, length: int, new: int, cap: int, **prefill_kwargs):
    """generate of row ``row``'s prompt ids[row, :length] alone, from a prefill of capacity
    ``cap`` (one decode compile serves every row)."""
    prompt = np.asarray(ids)[row:row + 1, :length]
    logits, cache = gemma4.prefill(model, prompt, max_cache_len=cap, **prefill_kwargs)
    return np.asarray(gemma4.generate(model, prompt, new, cache=cache, logits=logits))[0]


def assert_row_cache(test, model, got, want, row: int, length: int, *, atol):
    """Row ``row`` of the batch's cache ``got`` against ``want``, the cache of that row alone:
    every ring whole (a ring only ever holds real keys), full layers' first ``length`` slots."""
    test.assertEqual(int(got.length[row]), length)
    test.assertEqual(int(want.length[0]), length)
    for i, spec in enumerate(model.config.layers):
        for name, bufs, ref in (("k", got.keys, want.keys), ("v", got.values, want.values)):
            if spec.is_kv_shared:
                test.assertIsNone(bufs[i])
                continue
            g, w = np.asarray(bufs[i][row], np.float32), np.asarray(ref[i][0], np.float32)
            if not spec.is_sliding:
                g, w = g[:length], w[:length]
            np.testing.assert_allclose(g, w, atol=atol, rtol=0,
                                       err_msg=f"layer {i} {name}, row {row}")


class Float32Dots(parameterized.TestCase):
    """Each row against the row alone (logits at 1e-4, greedy tokens) with float32 dots: XLA:GPU's
    default precision runs them as TF32, whose rounding differs between the batch's shapes and
    the row's (the CPU computes float32 dots in float32 either way)."""

    def setUp(self):
        super().setUp()
        self.enter_context(jax.default_matmul_precision("float32"))


class PrefillLengthsTest(Float32Dots):

    @parameterized.named_parameters(
        ("one_chunk", None, {}, None),
        ("chunks_of_2", 2, {}, None),
        ("chunks_of_4", 4, {}, None),       # row 1 (length 4) ends on a chunk boundary
        ("chunks_of_3_fp8", 3, {}, "float8_e4m3fn"),
        ("pieces_one_chunk", None, IN_PIECES, None),
        ("pieces_chunks_of_2", 2, IN_PIECES, None),
    )
    def test_each_row_equals_its_prefill_alone(self, chunk_size, overrides, cache_dtype):
        model = lively(3, **overrides)
        ids = prompts(3)
        cap = WIDTH + 5
        logits, cache = gemma4.prefill(model, ids, lengths=LENGTHS, chunk_size=chunk_size,
                                       max_cache_len=cap, kv_cache_dtype=cache_dtype)
        np.testing.assert_array_equal(np.asarray(cache.length), LENGTHS)
        self.assertEqual(cache.max_len, cap)
        fp8 = cache_dtype is not None
        for row, n in enumerate(LENGTHS):
            want_logits, want_cache = gemma4.prefill(
                model, ids[row:row + 1, :n], chunk_size=chunk_size, max_cache_len=cap,
                kv_cache_dtype=cache_dtype)
            np.testing.assert_allclose(np.asarray(logits[row]), np.asarray(want_logits[0]),
                                       atol=1e-4, rtol=0, err_msg=f"row {row}")
            # An FP8 cache: one e4m3 step of rounding apart where the f32 keys differ by ulps.
            assert_row_cache(self, model, cache, want_cache, row, n, atol=0.07 if fp8 else 1e-5)

    def test_padding_never_reaches_a_ring(self):
        """A row's ring after a prefill whose padding is far longer than the window: its last
        real keys only, so the ring equals the row's alone (a padded write would overwrite
        them)."""
        model = tiny_model(seed=5)
        ids = prompts(5, width=4 * WINDOW + 1, batch=2)
        lengths = [4 * WINDOW + 1, WINDOW + 1]
        logits, cache = gemma4.prefill(model, ids, lengths=lengths, chunk_size=2)
        _, alone = gemma4.prefill(model, ids[1:, :WINDOW + 1], chunk_size=2,
                                  max_cache_len=4 * WINDOW + 1)
        assert_row_cache(self, model, cache, alone, 1, WINDOW + 1, atol=1e-5)

    def test_one_length_for_every_row_is_the_plain_prefill(self):
        model = tiny_model(seed=6)
        ids = prompts(6, width=7, batch=2)
        plain = gemma4.prefill(model, ids)
        same = gemma4.prefill(model, np.pad(ids, ((0, 0), (0, 3))), lengths=[7, 7],
                              max_cache_len=7)
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(same)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        _, cache = gemma4.prefill(model, np.pad(ids, ((0, 0), (0, 3))), lengths=[7, 5])
        self.assertEqual(cache.max_len, 7)  # the default capacity: the longest row
        with self.assertRaisesRegex(ValueError, "max_cache_len=6 is shorter than the prompt"):
            gemma4.prefill(model, ids, lengths=[7, 5], max_cache_len=6)


class GenerateLengthsTest(Float32Dots):

    @parameterized.named_parameters(
        ("one_chunk", None, {}, "reference"),
        ("chunks_of_3", 3, {}, "reference"),
        ("pieces", 2, IN_PIECES, "reference"),
        # K=V layers fold k_norm into q and decode with rotary_keys_only (a kernel backend;
        # the reference runs on CPU)
        ("auto_backend", None, {}, "auto"),
    )
    def test_each_row_continues_from_its_own_end(self, chunk_size, overrides, backend):
        model = lively(7, backend=backend, **overrides)
        ids = prompts(7)
        got = np.asarray(gemma4.generate(model, ids, 8, lengths=LENGTHS, chunk_size=chunk_size))
        self.assertEqual(got.shape, (len(LENGTHS), 8))
        np.testing.assert_array_equal(got, greedy_rows_by_rerun(model, ids, LENGTHS, 8))
        self.assertGreater(len(np.unique(got)), 4)  # the tokens change: a real test

    def test_rows_rerun_is_each_row_alone(self):
        """The reference above against greedy_by_rerun of one row alone."""
        model = lively(7)
        ids = prompts(7)
        np.testing.assert_array_equal(greedy_rows_by_rerun(model, ids, LENGTHS, 5)[1],
                                      greedy_by_rerun(model, ids[1:2, :LENGTHS[1]], 5)[0])

    def test_fp8_cache(self):
        model = lively(8)
        ids = prompts(8)
        got = np.asarray(gemma4.generate(model, ids, 6, lengths=LENGTHS, chunk_size=4,
                                         kv_cache_dtype="float8_e4m3fn"))
        for row, n in enumerate(LENGTHS):
            alone = generate_alone(model, ids, row, n, 6, WIDTH + 6, chunk_size=4,
                                   kv_cache_dtype="float8_e4m3fn")
            np.testing.assert_array_equal(got[row], alone, err_msg=f"row {row}")

    def test_bf16_kernel_head_dims(self):
        """Head dims 256/512 in bf16: q/k norm + RoPE through ffi.rms_norm_rope with each row's
        own positions, attention through ffi.decode_attention (their references on CPU)."""
        model = lively(9, dtype=jnp.bfloat16, backend="auto", head_dim=256,
                       global_head_dim=512, hidden_size=64, num_attention_heads=2,
                       num_key_value_heads=1, hidden_size_per_layer_input=0)
        ids = prompts(9, batch=2)
        lengths = [9, 5]
        got = np.asarray(gemma4.generate(model, ids, 5, lengths=lengths))
        for row, n in enumerate(lengths):
            alone = generate_alone(model, ids, row, n, 5, WIDTH + 5)
            np.testing.assert_array_equal(got[row], alone, err_msg=f"row {row}")

    def test_decode_continues_each_row(self):
        model = lively(10)
        ids = prompts(10)
        logits, cache = gemma4.prefill(model, ids, lengths=LENGTHS, max_cache_len=WIDTH + 7)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens, cache = gemma4.decode(model, first, cache, 6, block=4)
        np.testing.assert_array_equal(np.asarray(cache.length), np.add(LENGTHS, 6))
        want = greedy_rows_by_rerun(model, ids, LENGTHS, 7)
        np.testing.assert_array_equal(np.asarray(first), want[:, 0])
        np.testing.assert_array_equal(np.asarray(tokens), want[:, 1:])

    def test_stop_tokens_per_row(self):
        model = lively(11)
        ids = prompts(11)
        ref = greedy_rows_by_rerun(model, ids, LENGTHS, 10)
        stop = int(ref[0][2])
        got = np.asarray(gemma4.generate(model, ids, 10, lengths=LENGTHS, stop_tokens=stop,
                                         block=2))
        for row, want in enumerate(ref):
            hit = np.flatnonzero(want == stop)
            end = hit[0] + 1 if hit.size else len(want)
            np.testing.assert_array_equal(got[row, :end], want[:end])
            self.assertTrue((got[row, end:] == model.config.pad_token_id).all())


class LengthsArgumentTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("too_long", [3, 6], r"lengths: each must be in \[1, 5\].*\(1, 6\)"),
        ("zero", [0, 5], r"lengths: each must be in \[1, 5\].*\(0, 0\)"),
        ("negative", [-1, 5], r"lengths: each must be in \[1, 5\]"),
        ("wrong_batch", [3, 4, 5], r"lengths must have shape \[B\] = \[2\].*got shape \[3\]"),
        ("two_dims", [[3, 4]], r"lengths must have shape \[B\] = \[2\].*got shape \[1, 2\]"),
        ("float", [3.0, 4.0], r"lengths must be integers, got dtype float64"),
        ("bool", [True, True], r"lengths must be integers, got dtype bool"),
        ("scalar", 3, r"lengths must be a sequence of 2 ints"),
        ("string", "34", r"lengths must be a sequence of 2 ints"),
        ("ragged", [[3], [4, 5]], r"lengths must be a sequence of 2 ints"),
    )
    def test_bad_lengths_are_refused(self, lengths, pattern):
        model = tiny_model()
        ids = np.full((2, 5), 7, np.int32)
        for name, fn in (("prefill", lambda: gemma4.prefill(model, ids, lengths=lengths)),
                         ("generate", lambda: gemma4.generate(model, ids, 2, lengths=lengths))):
            with self.subTest(name), self.assertRaisesRegex(ValueError, pattern):
                fn()

    def test_numpy_and_device_lengths(self):
        model = tiny_model()
        ids = prompts(12, width=5, batch=2)
        want = np.asarray(gemma4.prefill(model, ids, lengths=[5, 2])[0])
        for lengths in (np.array([5, 2], np.int64), jnp.array([5, 2], jnp.int32), (5, 2)):
            np.testing.assert_array_equal(
                np.asarray(gemma4.prefill(model, ids, lengths=lengths)[0]), want)

    def test_traced_lengths_are_refused(self):
        model = tiny_model()
        ids = np.full((1, 3), 7, np.int32)
        with self.assertRaisesRegex(ValueError, "lengths must be concrete"):
            jax.jit(lambda n: gemma4.prefill(model, ids, lengths=n)[0])(jnp.array([2]))

    def test_generate_with_a_cache_takes_no_lengths(self):
        model = tiny_model()
        ids = np.full((2, 4), 7, np.int32)
        logits, cache = gemma4.prefill(model, ids, lengths=[4, 2], max_cache_len=8)
        with self.assertRaisesRegex(ValueError, "lengths is for generate's own prefill"):
            gemma4.generate(model, ids, 2, cache=cache, logits=logits, lengths=[4, 2])

    def test_context_parallel_lengths_are_refused(self):
        model = tiny_model()
        mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2])
        with self.assertRaisesRegex(ValueError, "lengths with context parallelism"):
            gemma4.prefill(model, np.full((2, 4), 7, np.int32), lengths=[4, 2], mesh=mesh)

    def test_decode_checks_the_longest_row(self):
        model = tiny_model()
        ids = np.full((2, 6), 7, np.int32)
        logits, cache = gemma4.prefill(model, ids, lengths=[6, 2], max_cache_len=8)
        with self.assertRaisesRegex(ValueError, "3 decode steps from length 6 need 9"):
            gemma4.decode(model, jnp.argmax(logits, -1), cache, 3)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (scan bodies, pjit calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


class DecodeReadsInPlaceTest(parameterized.TestCase):

    def _decode_jaxpr(self, model, cache, batch):
        structure, weights = jitted.model_args(model)
        return jax.make_jaxpr(
            lambda w, c, t: jitted.decode_steps.__wrapped__(
                structure, w, c, t, jnp.zeros(batch, bool), jnp.full(8, -1, jnp.int32),
                jnp.int32(0), 2))(weights, cache, jnp.zeros(batch, jnp.int32)).jaxpr

    @parameterized.parameters(None, "float8_e4m3fn")
    def test_no_copy_of_a_ring_or_the_cache(self, cache_dtype):
        model = tiny_model()
        ids = prompts(13, width=2 * WINDOW + 1, batch=2)
        _, cache = gemma4.prefill(model, ids, lengths=[2 * WINDOW + 1, 2], max_cache_len=12,
                                  kv_cache_dtype=cache_dtype)
        buffers = {tuple(k.shape) for k in cache.keys if k is not None}
        ring = next(tuple(k.shape) for k, s in zip(cache.keys, model.config.layers)
                    if k is not None and s.is_sliding)
        self.assertEqual(ring[1], WINDOW)
        # A traced jnp.roll is a concatenate of the buffer with itself and a dynamic slice.
        copies = [(eqn.primitive.name, [tuple(v.aval.shape) for v in eqn.invars])
                  for eqn in _eqns(self._decode_jaxpr(model, cache, 2))
                  if eqn.primitive.name in ("concatenate", "dynamic_slice", "rev")
                  and any(tuple(getattr(v.aval, "shape", ())) in buffers for v in eqn.invars)]
        self.assertEqual(copies, [], "decode copies a cache buffer")

    @parameterized.parameters(None, "float8_e4m3fn")
    def test_decode_attention_reads_the_buffers(self, cache_dtype):
        model = tiny_model()
        ids = prompts(14, width=5, batch=2)
        logits, cache = gemma4.prefill(model, ids, lengths=[5, 2], max_cache_len=9,
                                       kv_cache_dtype=cache_dtype)
        calls = []
        real = reference.decode_attention

        def spy(q, k, v, kv_len, **kwargs):
            calls.append((k.shape, k.dtype, kwargs["ring"], kwargs["window"]))
            return real(q, k, v, kv_len, **kwargs)

        from unittest import mock
        with mock.patch.object(reference, "decode_attention", spy):
            jax.make_jaxpr(lambda c, t: model.hidden_states(t[:, None], mode="decode",
                                                             cache=c))(
                cache, jnp.argmax(logits, -1).astype(jnp.int32))
        d, g = TINY["head_dim"], TINY["global_head_dim"]
        want = []
        full = jnp.dtype(cache_dtype or model.dtype)  # as stored: FP8 is not cast first
        for spec in model.config.layers:
            if spec.is_sliding:
                want.append(((2, WINDOW, 2, d), model.dtype, True, WINDOW))
            else:  # full layers, KV-shared ones included: the whole buffer and kv_len
                want.append(((2, 9, 1, g), full, False, None))
        self.assertEqual(calls, want)

    def test_attention_decode_arguments(self):
        from jax_mila import nn
        attn = nn.Attention(scale=1.0, backend="reference")
        q = jnp.zeros((2, 1, 4, 16))
        k = jnp.zeros((2, 3, 2, 16))
        kv_len = jnp.array([3, 1], jnp.int32)
        self.assertEqual(attn.decode(q, k, k, kv_len, window=3, ring=True).shape, q.shape)
        for kwargs, args, pattern in (
                (dict(ring=True), (q, k, k, kv_len), "ring: a ring of slots holds a sliding "
                                                     "window: pass window"),
                (dict(window=4, ring=True), (q, k, k, kv_len), "ring: 3 slots cannot hold"),
                (dict(), (q, k, k, kv_len[:1]), r"kv_len: must be integer \[B\] = \[2\]"),
                (dict(), (q, k, k, kv_len.astype(jnp.float32)), "kv_len: must be integer"),
                (dict(ring=1, window=3), (q, k, k, kv_len), "ring: must be a bool"),
                (dict(), (q[:, :, :3], k, k, kv_len), "k: Hq=3 query heads over Hkv=2")):
            with self.subTest(pattern), self.assertRaisesRegex(
                    ValueError, "jax_mila.nn.Attention.decode: " + pattern):
                attn.decode(*args, **kwargs)

    def test_attention_decode_picks_the_op_by_backend(self):
        from unittest import mock

        from jax_mila import ffi, nn
        q = jnp.zeros((1, 1, 2, 256), jnp.bfloat16)
        k = jnp.zeros((1, 4, 1, 256), jnp.float8_e4m3fn)
        kv_len = jnp.array([2], jnp.int32)
        with mock.patch.object(ffi, "decode_attention", wraps=ffi.decode_attention) as op, \
                mock.patch.object(reference, "decode_attention",
                                  wraps=reference.decode_attention) as ref:
            nn.Attention(scale=1.0, backend="auto").decode(q, k, k, kv_len)
            self.assertEqual((op.call_count, ref.call_count), (1, 0))
            nn.Attention(scale=1.0, backend="reference").decode(q, k, k, kv_len)
            self.assertEqual((op.call_count, ref.call_count), (1, 1))
            # head dim 16: no kernel; the reference, the fallback logged
            nn.Attention(scale=1.0, backend="auto").decode(q[..., :16], k[..., :16],
                                                           k[..., :16], kv_len)
            self.assertEqual((op.call_count, ref.call_count), (1, 2))

    def test_a_ring_cut_below_the_window_reads_as_a_buffer(self):
        self.assertTrue(kv.decode_reads_ring(3, 3))
        self.assertFalse(kv.decode_reads_ring(7, 16))   # capacity 7 < window 16: never wraps
        self.assertFalse(kv.decode_reads_ring(7, None))


if __name__ == "__main__":
    absltest.main()
