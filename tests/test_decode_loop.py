"""The decode loop: blocks of steps, stop tokens, batch rows stopping on their own, streaming,
the config's EOS ids and the generate command's streamed output (CPU, no transformers).

The reference for every token is re-running the full sequence (test_gemma4_generate's
greedy_by_rerun), never the decode loop itself; the tiny model's window of 3 makes the local
layers' rings wrap many times within a run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from flax import nnx

from jax_mila import gemma4
from jax_mila.__main__ import _TokenPrinter, _tokenizer, main
from jax_mila.engine import jitted, run
from test_gemma4_cli import EMBEDDED, run_cli
from test_gemma4_generate import TINY, greedy_by_rerun, tiny_model

VOCAB = TINY["vocab_size"]
PAD = 0  # Gemma4Config's pad_token_id


def lively_model(seed: int):
    """The tiny model with its post-attention and post-MLP norm weights drawn at scale 10: the
    layers then outweigh the token's own embedding, and greedy decoding changes tokens from
    step to step (the plain random init mostly repeats the last prompt token, which would let
    a stop token end every row at once)."""
    model = tiny_model(seed=seed)
    leaves, tree = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [10 * jax.random.normal(k, x.shape, x.dtype) if "post_attention_layernorm" in
           jax.tree_util.keystr(p) or "post_feedforward_layernorm" in jax.tree_util.keystr(p)
           else x for (p, x), k in zip(leaves, keys)]
    nnx.update(model, jax.tree_util.tree_unflatten(tree, new))
    return model


def prompt(seed: int, batch: int, length: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 3, VOCAB, jnp.int32)


def expected_stop(reference: np.ndarray, stop) -> np.ndarray:
    """``reference`` [B, n] (greedy tokens without a stop) as generate with ``stop`` must return
    them: each row up to its first stop id, then pad ids, cut after the longest row."""
    hits = np.isin(reference, list(stop))
    ends = np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, reference.shape[1])
    out = reference.copy()
    for row, end in enumerate(ends):
        out[row, end:] = PAD
    return out[:, :ends.max()]


def stop_pair(reference: np.ndarray) -> tuple[int, int]:
    """Two stop ids, one from each row of ``reference`` [2, n], that end the rows at different
    steps, neither at the first token, both before the last three."""
    n = reference.shape[1]
    for a in reference[0, 1:n - 3]:
        for b in reference[1, 1:n - 3]:
            stop = (int(a), int(b))
            hits = np.isin(reference, stop)
            ends = hits.argmax(axis=1)
            if hits.any(axis=1).all() and ends[0] != ends[1] and 0 < ends.min() \
                    and ends.max() < n - 3:
                return stop
    raise AssertionError(f"no stop pair ends the rows at different steps: {reference}")


def cache_leaves(cache):
    return [np.asarray(x) for x in jax.tree.leaves(cache)]


class DecodeBlocksTest(parameterized.TestCase):

    @parameterized.parameters(1, 4, 5, 13)
    def test_blocks_give_the_rerun_tokens_and_cache(self, block):
        model = lively_model(block)
        ids = prompt(block, 2, 5)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=5 + 14)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        want_cache = jax.tree.map(jnp.copy, cache)
        tokens, cache = gemma4.decode(model, first, cache, 13, block=block)
        _, want_cache = gemma4.decode(model, first, want_cache, 13)   # one block of 13
        expected = greedy_by_rerun(model, ids, 14)
        np.testing.assert_array_equal(np.asarray(first), expected[:, 0])
        np.testing.assert_array_equal(np.asarray(tokens), expected[:, 1:])
        np.testing.assert_array_equal(cache.length, 5 + 13)
        for i, (got, want) in enumerate(zip(cache_leaves(cache), cache_leaves(want_cache))):
            np.testing.assert_array_equal(got, want, err_msg=f"cache leaf {i}")

    def test_norm_weights_widened_once_give_the_same_bits(self):
        # decode_steps hands its scan float32 copies of the bf16 vectors (norm weights, layer
        # scalars), made once per block: every consumer computes in float32, so a bf16 model
        # with norm weights far from 1 decodes to the same tokens and cache bits as the model's
        # own decode steps on its bf16 weights, run one by one.
        model = tiny_model(seed=5, dtype=jnp.bfloat16)
        vectors = lambda a: a.ndim <= 1 and a.dtype == jnp.bfloat16  # noqa: E731
        state = nnx.state(model)
        self.assertGreater(sum(map(vectors, jax.tree.leaves(state))), 10)
        nnx.update(model, jax.tree.map(lambda a: (jax.random.normal(jax.random.key(a.size), a.shape)
                                                  * 0.7 + 1.0).astype(a.dtype)
                                       if vectors(a) else a, state))
        widened = jitted._vectors_in_float32(nnx.state(model))
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(widened)):
            self.assertEqual(b.dtype, jnp.float32 if vectors(a) else a.dtype)
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        ids = prompt(5, 2, 5)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=5 + 6)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        want_cache = jax.tree.map(jnp.copy, cache)
        tokens, cache = gemma4.decode(model, first, cache, 6)
        graph, plain = nnx.split(model)

        @jax.jit
        def step(weights, tok, c):
            m = nnx.merge(graph, weights)
            h, c = m.hidden_states(tok[:, None], mode="decode", cache=c)
            return jnp.argmax(m.logits(h[:, 0]), axis=-1).astype(jnp.int32), c

        tok, want = first, []
        for _ in range(6):
            tok, want_cache = step(plain, tok, want_cache)
            want.append(tok)
        np.testing.assert_array_equal(np.asarray(tokens), np.stack(want, axis=1))
        for i, (got, ref) in enumerate(zip(cache_leaves(cache), cache_leaves(want_cache))):
            np.testing.assert_array_equal(got, ref, err_msg=f"cache leaf {i}")

    def test_one_dispatch_per_block_and_one_model_flatten(self):
        model = lively_model(3)
        ids = prompt(3, 1, 4)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=4 + 11)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        seen = []
        with mock.patch.object(jitted, "decode_steps", wraps=jitted.decode_steps) as step, \
                mock.patch.object(jitted, "model_args", wraps=jitted.model_args) as args:
            tokens, _ = gemma4.decode(model, first, cache, 11, block=4, stream=seen.append)
        self.assertEqual([c.args[-1] for c in step.call_args_list], [4, 4, 3])
        args.assert_called_once()
        self.assertEqual([b.shape for b in seen], [(1, 4), (1, 4), (1, 3)])
        self.assertTrue(all(isinstance(b, np.ndarray) and b.dtype == np.int32 for b in seen))
        np.testing.assert_array_equal(np.concatenate(seen, axis=1), np.asarray(tokens))

    def test_compiles_once_per_block_size(self):
        model = lively_model(4)
        ids = prompt(4, 1, 3)
        step = jitted.decode_steps

        def decode(steps, **kw):
            logits, cache = gemma4.prefill(model, ids, max_cache_len=3 + 13)  # one shape
            first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return np.asarray(gemma4.decode(model, first, cache, steps, block=4, **kw)[0])

        before = step._cache_size()
        decode(9)                                   # blocks 4, 4, 1
        self.assertEqual(step._cache_size() - before, 2)
        decode(5, stop_tokens=[VOCAB - 1])          # 4, 1 again; the stop ids are traced
        decode(13, stop_tokens=(VOCAB - 1, VOCAB - 2, 7))
        self.assertEqual(step._cache_size() - before, 2)


class StopTokensTest(parameterized.TestCase):

    @parameterized.parameters(1, 3, 16, None)
    def test_rows_stop_on_their_own(self, block):
        model = lively_model(11)
        ids = prompt(11, 2, 4)
        reference = greedy_by_rerun(model, ids, 20)
        stop = stop_pair(reference)
        want = expected_stop(reference, stop)
        self.assertLess(want.shape[1], 20)
        seen = []
        got = gemma4.generate(model, ids, 20, stop_tokens=stop, block=block, stream=seen.append)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"stop {stop}")
        np.testing.assert_array_equal(np.concatenate(seen, axis=1), want)
        self.assertEqual(seen[0].shape, (2, 1))   # the prefill's token first

    def test_one_stop_id_and_numpy_ids(self):
        model = lively_model(12)
        ids = prompt(12, 1, 6)
        reference = greedy_by_rerun(model, ids, 12)
        token = reference[0, 3]
        want = expected_stop(reference, [token])
        for stop in (int(token), np.int64(token), np.array([token]), [token]):
            got = gemma4.generate(model, ids, 12, stop_tokens=stop, block=2)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=repr(stop))

    def test_a_stop_at_the_first_token(self):
        model = lively_model(13)
        ids = prompt(13, 2, 5)
        reference = greedy_by_rerun(model, ids, 10)
        stop = [int(reference[0, 0])]
        self.assertNotIn(stop[0], reference[1].tolist())
        got = np.asarray(gemma4.generate(model, ids, 10, stop_tokens=stop, block=4))
        np.testing.assert_array_equal(got, expected_stop(reference, stop))
        self.assertTrue((got[0, 1:] == PAD).all())
        # every row stops at once: the prefill's tokens alone, no decode step dispatched
        with mock.patch.object(jitted, "decode_steps", wraps=jitted.decode_steps) as step:
            got = gemma4.generate(model, ids, 10, stop_tokens=reference[:, 0].tolist())
        step.assert_not_called()
        np.testing.assert_array_equal(np.asarray(got), reference[:, :1])

    def test_the_host_stops_dispatching(self):
        model = lively_model(14)
        ids = prompt(14, 1, 3)
        reference = greedy_by_rerun(model, ids, 40)
        stop = [int(reference[0, 5])]
        end = int(np.isin(reference[0], stop).argmax())  # the first stop, at most step 5
        with mock.patch.object(jitted, "decode_steps", wraps=jitted.decode_steps) as step:
            got = gemma4.generate(model, ids, 40, stop_tokens=stop, block=2)
        np.testing.assert_array_equal(np.asarray(got), reference[:, :end + 1])
        # blocks of 2 steps after the prefill's token: the one holding the stop, and one ahead
        self.assertEqual(step.call_count, -(-end // 2) + 1 if end else 0)

    def test_decode_returns_every_step_run_and_the_cache_holds_them(self):
        model = lively_model(15)
        ids = prompt(15, 2, 4)
        reference = greedy_by_rerun(model, ids, 30)
        stop = stop_pair(reference)
        logits, cache = gemma4.prefill(model, ids, max_cache_len=4 + 30 + 3)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens, cache = gemma4.decode(model, first, cache, 29, stop_tokens=stop, block=3)
        tokens = np.asarray(tokens)
        n = tokens.shape[1]
        self.assertLess(n, 29)
        self.assertEqual(n % 3, 0)
        np.testing.assert_array_equal(cache.length, 4 + n)
        full = np.concatenate([reference[:, :1], tokens], axis=1)
        want = expected_stop(reference, stop)
        np.testing.assert_array_equal(full[:, :want.shape[1]], want)
        self.assertTrue((full[:, want.shape[1]:] == PAD).all())
        # The cache holds the prompt, the tokens and the pads fed back: decoding on from it
        # gives what re-running that whole sequence gives.
        sequence = np.concatenate([np.asarray(ids), full], axis=1)
        more, _ = gemma4.decode(model, jnp.asarray(full[:, -1]), cache, 3)
        np.testing.assert_array_equal(np.asarray(more), greedy_by_rerun(model, sequence, 3))

    def test_no_stop_gives_exactly_the_count(self):
        model = lively_model(16)
        ids = prompt(16, 3, 2)
        got = gemma4.generate(model, ids, 7, block=3, stream=lambda tokens: None)
        np.testing.assert_array_equal(np.asarray(got), greedy_by_rerun(model, ids, 7))

    @parameterized.named_parameters(
        ("past_vocab", dict(stop_tokens=[1, VOCAB]),
         rf"stop_tokens: \[{VOCAB}\] outside the vocabulary \[0, {VOCAB}\)"),
        ("negative", dict(stop_tokens=-1), r"stop_tokens: \[-1\] outside the vocabulary"),
        ("float", dict(stop_tokens=[1.0]), r"stop_tokens must be integer token ids, got \[1.0\]"),
        ("bool", dict(stop_tokens=True), r"stop_tokens must be None, a token id or a sequence "
                                         r"of token ids, got True"),
        ("string", dict(stop_tokens="eos"), r"stop_tokens must be integer token ids, got 'eos'"),
        ("object", dict(stop_tokens=object()), r"stop_tokens must be None, a token id or a "
                                               r"sequence of token ids"),
        ("block_zero", dict(block=0), r"block must be an int >= 1 or None, got 0"),
        ("block_float", dict(block=2.0), r"block must be an int >= 1 or None, got 2.0"),
        ("stream", dict(stream=3), r"stream must be None or a callable .* got 3"),
    )
    def test_bad_arguments(self, kwargs, pattern):
        model = lively_model(17)
        ids = prompt(17, 1, 3)
        with self.assertRaisesRegex(ValueError, pattern):
            gemma4.generate(model, ids, 4, **kwargs)
        _, cache = gemma4.prefill(model, ids, max_cache_len=8)
        with self.assertRaisesRegex(ValueError, pattern):
            gemma4.decode(model, jnp.array([3], jnp.int32), cache, 4, **kwargs)


NESTED = {"model_type": "gemma4", "text_config": {**TINY, "eos_token_id": 1},
          "eos_token_id": [1, 106]}


class EosIdsTest(absltest.TestCase):

    def test_the_embedded_checkpoint(self):
        cfg = gemma4.Gemma4Config.from_pretrained(gemma4.embedded_checkpoint())
        self.assertEqual(cfg.eos_token_id, (1,))
        self.assertEqual(cfg.pad_token_id, 0)

    def test_top_level_text_config_and_generation_config(self):
        self.assertEqual(gemma4.Gemma4Config.from_dict(NESTED).eos_token_id, (1, 106))
        flat = {k: v for k, v in TINY.items()}
        self.assertEqual(gemma4.Gemma4Config.from_dict(flat).eos_token_id, (1,))  # the default
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(NESTED, f)
            with open(os.path.join(d, "generation_config.json"), "w") as f:
                json.dump({"eos_token_id": [1, 106, 50], "do_sample": True}, f)
            self.assertEqual(gemma4.Gemma4Config.from_pretrained(d).eos_token_id, (1, 106, 50))
            with open(os.path.join(d, "generation_config.json"), "w") as f:
                json.dump({"eos_token_id": "x"}, f)
            with self.assertRaisesRegex(ValueError, r"generation_config.json: 'x'"):
                gemma4.Gemma4Config.from_pretrained(d)
        with self.assertRaisesRegex(ValueError, r"unsupported eos_token_id: \[1, -2\]"):
            gemma4.Gemma4Config.from_dict({**TINY, "eos_token_id": [1, -2]})


def generated_ids(text: str) -> list[int]:
    return [int(t) for t in re.search(r"generated ids: \[(.*)\]", text).group(1).split(",")]


class GenerateCommandTest(absltest.TestCase):
    """The command stops at the checkpoint's EOS ids (config.json), unless --ignore-eos, and
    streams what it generates."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.args = ("generate", "--length", "9", "--new-tokens", "12", "--dtype", "float32",
                    "--block", "3")
        cls.full = generated_ids(run_cli(*cls.args, "--ignore-eos"))

    def checkpoint_with_eos(self, d: str, eos: int, tokenizer: bool) -> str:
        path = os.path.join(d, "ckpt")
        shutil.copytree(EMBEDDED, path)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, "eos_token_id": [eos]}, f)
        if not tokenizer:
            os.remove(os.path.join(path, "tokenizer.json"))
        return path

    def test_stops_at_eos_and_streams_ids(self):
        full = self.full
        self.assertLen(full, 12)
        eos = next(t for t in full if t != full[0])   # ends the decode, past the first token
        end = full.index(eos)
        with tempfile.TemporaryDirectory() as d:
            text = run_cli(*self.args, "--model", self.checkpoint_with_eos(d, eos, False))
        self.assertEqual(generated_ids(text), full[:end + 1])
        streamed = re.search(r"generated: (.*)\n", text).group(1).split()
        self.assertEqual([int(t) for t in streamed], full[:end + 1])
        self.assertRegex(text, rf"decode: {end} steps in .* tokens/s \(blocks of 3 steps, "
                               rf"stopped at EOS {eos};")
        self.assertRegex(text, r"throughput: prefill [\d,]+ tokens/s, decode [\d,.]+ tokens/s")
        self.assertNotIn("generated text:", text)   # no tokenizer.json

    def test_ignore_eos_and_text(self):
        with tempfile.TemporaryDirectory() as d:
            path = self.checkpoint_with_eos(d, self.full[0], True)
            text = run_cli(*self.args, "--model", path, "--ignore-eos")
            self.assertEqual(generated_ids(text), self.full)
            self.assertRegex(text, r"decode: 11 steps in .* \(blocks of 3 steps; first call")
            self.assertIn("generated text:", text)   # tokenizer.json is there
            text = run_cli(*self.args, "--model", path)
            self.assertEqual(generated_ids(text), self.full[:1])
            self.assertIn(f"decode: no steps (the first token is EOS {self.full[0]})", text)

    def test_bad_block(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit):
            main(["generate", "--block", "0"])
        self.assertIn("--block must be >= 1", err.getvalue())

    def test_block_default_in_the_help(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertRaises(SystemExit):
            main(["generate", "--help"])
        self.assertIn(f"(default {run.DEFAULT_BLOCK}, jax_mila.engine.run.DEFAULT_BLOCK)",
                      " ".join(out.getvalue().split()))


class TokenPrinterTest(absltest.TestCase):

    def test_streamed_text_is_the_whole_text(self):
        tokenizer = _tokenizer(EMBEDDED)   # 674 tokens, against the model's 2048
        size = tokenizer.get_vocab_size()
        hello = tokenizer.encode("Hello world, streaming").ids
        ids = hello[:3] + [size + 5] + hello[3:] + [size + 5]
        printer = _TokenPrinter(tokenizer)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for start in range(0, len(ids), 2):
                printer(np.asarray([ids[start:start + 2]], np.int32))
        whole = tokenizer.decode(hello[:3]) + f"[{size + 5}]" + tokenizer.decode(hello[3:])
        self.assertEqual(out.getvalue(), whole + f"[{size + 5}]")
        self.assertTrue(whole.startswith("Hello wor"))
        self.assertIsNotNone(printer.first)
        self.assertGreaterEqual(printer.last, printer.first)

    def test_line_breaks_and_bytes_one_token_at_a_time(self):
        tokenizer = _tokenizer(EMBEDDED)
        ids = tokenizer.encode("naïve café\nnext line ✓ ok\n  two spaces").ids
        self.assertIn("\n", [tokenizer.id_to_token(t) for t in ids])
        printer = _TokenPrinter(tokenizer)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for t in ids:
                printer(np.asarray([[t]], np.int32))
            printer.finish()
        self.assertEqual(out.getvalue(), tokenizer.decode(ids))
        self.assertLess(len(printer.line), len(ids))   # the lines before are done with

    def test_ids_without_a_tokenizer(self):
        printer = _TokenPrinter(None)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            printer(np.asarray([[5, 7]], np.int32))
            printer(np.asarray([[9]], np.int32))
        self.assertEqual(out.getvalue().split(), ["5", "7", "9"])


if __name__ == "__main__":
    absltest.main()
