"""`python -m jax_mila prefill|generate` on the embedded checkpoint (CPU)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest, parameterized

from jax_mila import _selftest, gemma4
from jax_mila.__main__ import _generated_text, _tokenizer, main

EMBEDDED = str(gemma4.embedded_checkpoint())


def run_cli(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(argv))
    return out.getvalue()


def run_cli_error(*argv) -> tuple[int, str]:
    """(exit status, stderr) of a command line the CLI refuses."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as e:
            return e.code, err.getvalue()
    raise AssertionError(f"{argv} did not exit")


class CliTest(parameterized.TestCase):

    def test_generate_prints_tokens_and_throughput(self):
        text = run_cli("generate", "--length", "20", "--new-tokens", "4", "--dtype", "float32")
        self.assertRegex(text, r"prefill: 20 tokens in .* tokens/s")
        self.assertRegex(text, r"decode: 3 steps in .* tokens/s")
        ids = re.search(r"generated ids: \[(.*)\]", text).group(1).split(",")
        self.assertLen(ids, 4)

    def test_several_prompts_of_different_lengths(self):
        """Repeated --prompt-ids run as one batch (prefill's lengths); each row's ids are what
        the same command prints for that prompt alone."""
        prompts = ("2,5,9,11,40,7,8", "2,7", "2,8,9")
        argv = ("generate", "--new-tokens", "5", "--dtype", "float32", "--ignore-eos")
        text = run_cli(*argv, *[a for p in prompts for a in ("--prompt-ids", p)])
        self.assertIn("prompt 1: 2 tokens: [2, 7]", text)
        self.assertRegex(text, r"prefill: 12 tokens in")  # the real tokens, not 3 x 7
        for row, prompt in enumerate(prompts):
            alone = run_cli(*argv, "--prompt-ids", prompt)
            want = re.search(r"generated ids: (\[.*\])", alone).group(1)
            self.assertIn(f"generated ids (prompt {row}): {want}", text)

    def test_prefill_from_text_and_ids(self):
        text = run_cli("prefill", "--prompt", "Hello world")
        self.assertRegex(text, r"prompt: \d+ tokens: \[2, ")   # BOS from the tokenizer
        self.assertIn("next token:", text)
        text = run_cli("prefill", "--prompt-ids", "2,5,9")
        self.assertIn("prompt: 3 tokens: [2, 5, 9]", text)

    def test_bad_ids_exit(self):
        with self.assertRaises(SystemExit):
            run_cli("prefill", "--prompt-ids", "2,999999")

    @parameterized.named_parameters(
        ("ids_not_integers", ("generate", "--prompt-ids", "2,abc"),
         r"argument --prompt-ids: expected comma- or space-separated integer ids, got '2,abc'"),
        ("ids_empty", ("generate", "--prompt-ids", ""), r"argument --prompt-ids: no token ids given"),
        ("ids_only_separators", ("prefill", "--prompt-ids", " , "), r"argument --prompt-ids: no token ids"),
        ("negative_seed", ("generate", "--seed", "-1"), r"--seed must be >= 0, got -1"),
        ("new_tokens_on_prefill", ("prefill", "--new-tokens", "5"),
         r"unrecognized arguments: --new-tokens 5"),
    )
    def test_bad_arguments_are_usage_errors_naming_the_flag(self, argv, pattern):
        code, err = run_cli_error(*argv)
        self.assertEqual(code, 2)
        self.assertNotIn("Traceback", err)
        self.assertRegex(err.strip().splitlines()[-1], r"error: " + pattern)

    @parameterized.product(command=("generate", "convert"),
                           model=(("nope", "does not exist"), ("config.json", "not a directory")))
    def test_bad_model_path_gives_one_message_for_every_subcommand(self, command, model):
        with tempfile.TemporaryDirectory() as d:
            shutil.copy(os.path.join(EMBEDDED, "config.json"), d)
            path = os.path.join(d, model[0])
            out = ("--out", os.path.join(d, "out")) if command == "convert" else ()
            code, err = run_cli_error(command, "--model", path, *out)
        self.assertEqual(code, 2)
        self.assertEqual(err.strip(), f"python -m jax_mila: error: --model {path}: {model[1]} "
                                      "(expected a checkpoint directory" +
                                      (", holding config.json)" if model[0] == "config.json" else ")"))

    def test_checkpoint_errors_name_the_path_once(self):
        with tempfile.TemporaryDirectory() as d:
            code, err = run_cli_error("prefill", "--model", d)
        self.assertEqual(code, 2)
        self.assertEqual(err.strip(), f"python -m jax_mila: error: --model {d}: no config.json")

    def test_truncated_checkpoint_is_one_line_naming_the_file(self):
        with tempfile.TemporaryDirectory() as d:
            shutil.copy(os.path.join(EMBEDDED, "config.json"), d)
            with open(os.path.join(EMBEDDED, "model.safetensors"), "rb") as f:
                data = f.read()
            with open(os.path.join(d, "model.safetensors"), "wb") as f:
                f.write(data[:len(data) // 3])
            code, err = run_cli_error("prefill", "--model", d, "--prompt-ids", "2,5")
        self.assertEqual(code, 2)
        self.assertNotIn("Traceback", err)
        self.assertLen(err.strip().splitlines(), 1)
        self.assertRegex(err, rf"error: --model {re.escape(d)}: {re.escape(d)}/model\.safetensors: "
                              r"not a readable safetensors file .*truncated or corrupt")

    def test_malformed_environment_knob_is_one_line(self):
        with mock.patch.dict(os.environ, {"JAX_MILA_DISABLE": "flash"}):
            code, err = run_cli_error("prefill", "--length", "5")
        pattern = r"JAX_MILA_DISABLE='flash' names unknown ops"
        self.assertEqual(code, 2)
        self.assertNotIn("Traceback", err)
        self.assertRegex(err.strip().splitlines()[-1], r"error: environment variable " + pattern)

    def test_unused_gpu_is_named_with_the_fix(self):
        hint = "an NVIDIA GPU is present (/dev/nvidia0) but jax 0.0 sees none ... Fix: pip x"
        with mock.patch.object(_selftest, "gpu_install_hint", return_value=hint):
            with self.assertLogs("jax_mila", logging.WARNING) as logs:
                run_cli("prefill", "--length", "5")
            self.assertIn(hint, "".join(logs.output))
            out = io.StringIO()
            with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as exit_:
                main(["selftest"])
        self.assertEqual(exit_.exception.code, 1)  # a GPU left unused fails the selftest
        self.assertIn(f"jax_mila selftest: {hint}", out.getvalue())
        self.assertIn("though an NVIDIA GPU is present (see above)", out.getvalue())
        with mock.patch.object(_selftest, "gpu_install_hint", return_value=None), \
                self.assertNoLogs("jax_mila", logging.WARNING):
            run_cli("prefill", "--length", "5")

    def test_positions_past_max_position_embeddings_warn(self):
        with tempfile.TemporaryDirectory() as d:
            for name in ("config.json", "model.safetensors"):
                shutil.copy(os.path.join(EMBEDDED, name), d)
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(dict(cfg, max_position_embeddings=16), f)
            with self.assertLogs("jax_mila", logging.WARNING) as logs:
                text = run_cli("generate", "--model", d, "--length", "12", "--new-tokens", "5")
            self.assertIn("generated ids:", text)  # a warning only: it still runs
            warnings = [line for line in logs.output if "max_position_embeddings" in line]
            self.assertLen(warnings, 1)
            self.assertIn("the prompt (12 tokens) + --new-tokens 5 = 17 positions pass the "
                          "model's max_position_embeddings (16", warnings[0])
            with self.assertLogs("jax_mila", logging.WARNING) as logs:
                run_cli("prefill", "--model", d, "--length", "17")
            self.assertIn("the prompt's 17 positions pass", "".join(logs.output))
            with self.assertNoLogs("jax_mila", logging.WARNING):
                run_cli("generate", "--model", d, "--length", "12", "--new-tokens", "4")

    def test_ids_the_tokenizer_cannot_decode_are_named(self):
        tokenizer = _tokenizer(EMBEDDED)   # 674 tokens, against the model's 2048
        size = tokenizer.get_vocab_size()
        text = _generated_text(tokenizer, [2, size + 10, 5, size + 10, 2047])
        self.assertIn(f"ids {[size + 10, 2047]} not shown: the tokenizer ({size} tokens) has no "
                      "token for them", text)
        self.assertNotIn("not shown", _generated_text(tokenizer, [2, 5, size - 1]))


if __name__ == "__main__":
    absltest.main()
