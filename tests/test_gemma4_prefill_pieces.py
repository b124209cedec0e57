"""The chunked prefill in layer pieces (jax_mila.engine.pieces) computes what the one-step
chunk computes (prefill(piece_layers=None)), applies only where a layer reads nothing but its
own cache entry and the previous hidden state, and reads the model's current weights.

Tiny random models on the reference backend (CPU): 12B-like (sliding and full layers, K=V full
layers, no per-layer embeddings, no KV sharing; 9 layers: pieces [0, 2), [2, 8), [8, 9)) and
a MoE one. Chunk sizes pad the last chunk and straddle the window, so rings wrap inside and
across chunks. Fresh random prompts every run.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import gemma4
from jax_mila.engine import jitted, pieces, plan
from test_gemma4_chunked_prefill import assert_close_logits, assert_same_cache, prompt
from test_gemma4_generate import F, S, tiny_model

TWELVE_B_LIKE = dict(num_hidden_layers=9, layer_types=[S, S, F, S, S, S, F, S, F],
                     num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=4)
MOE = dict(sliding_window=5, num_hidden_layers=4, layer_types=[S, S, F, F],
           num_kv_shared_layers=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
           moe_intermediate_size=16, hidden_size_per_layer_input=0)


ONE_STEP = dict(piece_layers=None)  # each chunk as one jitted step


class PiecesTest(parameterized.TestCase):

    def test_bounds(self):
        self.assertEqual(pieces.bounds(48), [(0, 2), (2, 8), (8, 14), (14, 20), (20, 26),
                                             (26, 32), (32, 38), (38, 44), (44, 48)])
        self.assertEqual(pieces.bounds(9), [(0, 2), (2, 8), (8, 9)])
        self.assertEqual(pieces.bounds(1), [(0, 1)])
        self.assertEqual(pieces.bounds(0), [])
        self.assertEqual(pieces.bounds(48, 23), [(0, 2), (2, 25), (25, 48)])
        with self.assertRaisesRegex(ValueError, "at least one layer"):
            pieces.bounds(48, 0)
        # prefill checks it whether or not the model runs in pieces (this one does not: PLE).
        with self.assertRaisesRegex(ValueError, "piece_layers must be an int >= 1 or None, "
                                                "got 0"):
            gemma4.prefill(tiny_model(), prompt(0, 4), piece_layers=0)

    def test_applies_only_without_ple_or_kv_sharing(self):
        self.assertTrue(pieces.applies(tiny_model(**TWELVE_B_LIKE)))
        self.assertTrue(pieces.applies(tiny_model(**MOE)))
        self.assertFalse(pieces.applies(tiny_model()))  # PLE and KV-shared layers
        self.assertFalse(pieces.applies(tiny_model(num_kv_shared_layers=0)))  # PLE
        self.assertFalse(pieces.applies(tiny_model(hidden_size_per_layer_input=0)))  # sharing

    @parameterized.named_parameters(
        ("12b_like_chunk3", TWELVE_B_LIKE, 3, 11),
        ("12b_like_chunk5", TWELVE_B_LIKE, 5, 23),
        ("12b_like_one_chunk", TWELVE_B_LIKE, 16, 9),
        ("moe_chunk4", MOE, 4, 13),
    )
    def test_pieces_equal_one_step(self, config, chunk, length):
        # float64 on the host CPU, as test_gemma4_chunked_prefill's equality with the one-shot
        # prefill (its comment says why): the pieces change no sum, so the bounds hold with
        # room to spare; a key in a wrong slot or a wrong offset moves them by O(0.1).
        with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            model = tiny_model(seed=length, dtype=jnp.float64, **config)
            ids = prompt(chunk, length)
            logits, cache = gemma4.prefill(model, ids, chunk_size=chunk)
            ref_logits, ref_cache = gemma4.prefill(model, ids, chunk_size=chunk, **ONE_STEP)
            assert_close_logits(logits, ref_logits)
            assert_same_cache(self, cache, ref_cache)
            # And both equal the one-shot prefill (no chunks).
            full, _ = gemma4.prefill(model, ids)
            assert_close_logits(logits, full)

    def test_kernel_backend_pieces(self):
        # backend "auto": the pieces' jit with the kernel path's compile options (no XLA
        # autotuning), bf16 with head dims 256 / 512 through jax_mila.ffi (its references here,
        # the kernels on a GPU).
        config = dict(TWELVE_B_LIKE, head_dim=256, global_head_dim=512)
        model = tiny_model(seed=3, dtype=jnp.bfloat16, backend="auto", **config)
        ids = prompt(2, 10)
        logits, cache = gemma4.prefill(model, ids, chunk_size=4)
        ref_logits, ref_cache = gemma4.prefill(model, ids, chunk_size=4, **ONE_STEP)
        np.testing.assert_array_equal(np.asarray(logits, np.float32),
                                      np.asarray(ref_logits, np.float32))
        np.testing.assert_array_equal(cache.length, ref_cache.length, strict=True)
        for a, b in zip(cache.keys + cache.values, ref_cache.keys + ref_cache.values):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def test_pieces_run_on_the_chunk_step_path(self):
        # The pieces' step is what runs, once per piece and chunk; the one-step chunk is not
        # called. With piece_layers=None it is the other way round.
        model = tiny_model(**TWELVE_B_LIKE)
        ids = prompt(0, 10)
        calls = []
        real = pieces.ChunkPieces.step

        def counting(self_, *args, **kwargs):
            calls.append(len(self_._bounds))
            return real(self_, *args, **kwargs)

        one_step = mock.Mock(wraps=jitted.chunk_step_fn(model))
        with mock.patch.object(pieces.ChunkPieces, "step", counting), \
             mock.patch.object(jitted, "chunk_step_fn", return_value=one_step):
            gemma4.prefill(model, ids, chunk_size=4)
            self.assertEqual(calls, [3, 3, 3])  # 3 chunks (the last padded), 3 pieces each
            one_step.assert_not_called()
            gemma4.prefill(model, ids, chunk_size=4, piece_layers=4)
            self.assertEqual(calls[3:], [3, 3, 3])  # layers [0, 2), [2, 6), [6, 9)
            calls.clear()
            gemma4.prefill(model, ids, chunk_size=4, **ONE_STEP)
        self.assertEqual(calls, [])
        self.assertEqual(one_step.call_count, 3)

    def test_default_chunk_runs_a_short_prompt_in_pieces(self):
        # chunk_size=None and a prompt within the plan's chunk: one unpadded chunk in pieces
        # (what the benchmark measures with chunk = length), not the one-shot call; the same
        # logits and cache as the one-shot prefill (with one step, it still takes that path).
        with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            model = tiny_model(seed=7, dtype=jnp.float64, **TWELVE_B_LIKE)
            ids = prompt(5, 9)
            widths, real = [], pieces.ChunkPieces.step

            def recording(self_, state, cache, input_ids, valid, **kwargs):
                widths.append(input_ids.shape[1])
                return real(self_, state, cache, input_ids, valid, **kwargs)

            with mock.patch.object(plan, "default_chunk_size", return_value=16), \
                 mock.patch.object(pieces.ChunkPieces, "step", recording):
                logits, cache = gemma4.prefill(model, ids)
                with mock.patch.object(jitted, "prefill_step", wraps=jitted.prefill_step) as shot:
                    ref, ref_cache = gemma4.prefill(model, ids, **ONE_STEP)
            self.assertEqual(widths, [9])
            shot.assert_called_once()
            assert_close_logits(logits, ref)
            assert_same_cache(self, cache, ref_cache)

    @parameterized.named_parameters(("pieces", False), ("one_step", True))
    def test_first_chunk_attends_over_its_own_keys(self, with_one_step):
        # chunk_size=None, a plan of 8 tokens and tails of at least 2 (MIN_CHUNK patched down
        # from 256): 11 tokens run as chunks of 8 and 4. The first one's width is its own, so
        # it runs as a first chunk (its sliding layers attend over the chunk itself, no slab;
        # the window of 4 wraps the ring inside it) and the tail as a later chunk; with
        # explicit chunks of 4 (three of one width) no chunk does. Logits and cache: those of
        # the one-shot prefill and of the explicit chunks.
        with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            model = tiny_model(seed=11, dtype=jnp.float64, **TWELVE_B_LIKE)
            ids = prompt(6, 11)
            seen = []

            def recording(run):
                def call(*args, **kwargs):  # (..., input_ids, valid)
                    seen.append((args[-2].shape[1], kwargs.get("first", False)))
                    return run(*args, **kwargs)
                return call

            real_pieces, real_step_fn = pieces.ChunkPieces.step, jitted.chunk_step_fn
            patches = (
                mock.patch.object(plan, "default_chunk_size", return_value=8),
                mock.patch.object(plan, "MIN_CHUNK", 2),
                mock.patch.object(pieces.ChunkPieces, "step",
                                  lambda self_, *a, **k: recording(
                                      functools.partial(real_pieces, self_))(*a, **k)),
                mock.patch.object(jitted, "chunk_step_fn",
                                  lambda m: recording(real_step_fn(m))))
            run = ONE_STEP if with_one_step else {}
            with contextlib.ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                logits, cache = gemma4.prefill(model, ids, **run)
                self.assertEqual(seen, [(8, True), (4, False)])
                seen.clear()
                chunked, chunked_cache = gemma4.prefill(model, ids, chunk_size=4, **run)
                self.assertEqual(seen, [(4, False)] * 3)
            full, full_cache = jitted.prefill_step(*jitted.model_args(model), ids, 11)  # one shot
            for ref, ref_cache in ((full, full_cache), (chunked, chunked_cache)):
                assert_close_logits(logits, ref)
                assert_same_cache(self, cache, ref_cache)

    def test_middle_pieces_write_the_hidden_state_in_place(self):
        # The hidden state a middle piece takes is donated (its buffer is gone after the call,
        # XLA wrote the new one over it); the first piece's token ids and the last piece's
        # input are not (the one's is int, the other returns a row). Pieces of one layer after
        # the first two: [0, 2), [2, 3), ..., [8, 9).
        model = tiny_model(**TWELVE_B_LIKE)
        seen = []
        real = pieces._piece_jit

        def recording(kernels, donate_hidden):
            run = real(kernels, donate_hidden)

            def call(runner, structure, weights, x, *args, **kwargs):
                out = run(runner, structure, weights, x, *args, **kwargs)
                seen.append((donate_hidden, x.dtype == jnp.int32, x.is_deleted()))
                return out
            return call

        with mock.patch.object(pieces, "_piece_jit", recording):
            gemma4.prefill(model, prompt(4, 6), chunk_size=4, piece_layers=1)
        first, last = (False, True, False), (False, False, False)
        middle = [(True, False, True)] * 6
        self.assertEqual(seen, ([first] + middle + [last]) * 2)  # 2 chunks of 8 pieces

    def test_pieces_read_the_current_weights(self):
        model = tiny_model(**TWELVE_B_LIKE)
        ids = prompt(1, 9)
        before, _ = gemma4.prefill(model, ids, chunk_size=4)
        down = model.layers[5].mlp.down_proj
        down.kernel.set_value(-down.kernel[...])  # a post-norm follows: scaling would cancel
        after, _ = gemma4.prefill(model, ids, chunk_size=4)
        ref, _ = gemma4.prefill(model, ids, chunk_size=4, **ONE_STEP)
        self.assertGreater(float(jnp.max(jnp.abs(after - before))), 1e-3)
        assert_close_logits(after, ref)


if __name__ == "__main__":
    absltest.main()
