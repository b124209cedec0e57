"""`python -m jax_mila prefill|generate` on the embedded checkpoint (CPU)."""

from __future__ import annotations

import contextlib
import io
import re

from absl.testing import absltest

from jax_mila.__main__ import main


def run_cli(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(argv))
    return out.getvalue()


class CliTest(absltest.TestCase):

    def test_generate_prints_tokens_and_throughput(self):
        text = run_cli("generate", "--length", "20", "--new-tokens", "4", "--dtype", "float32")
        self.assertRegex(text, r"prefill: 20 tokens in .* tokens/s")
        self.assertRegex(text, r"decode: 3 steps in .* tokens/s")
        ids = re.search(r"generated ids: \[(.*)\]", text).group(1).split(",")
        self.assertLen(ids, 4)

    def test_prefill_from_text_and_ids(self):
        text = run_cli("prefill", "--prompt", "Hello world")
        self.assertRegex(text, r"prompt: \d+ tokens: \[2, ")   # BOS from the tokenizer
        self.assertIn("next token:", text)
        text = run_cli("prefill", "--prompt-ids", "2,5,9")
        self.assertIn("prompt: 3 tokens: [2, 5, 9]", text)

    def test_bad_ids_exit(self):
        with self.assertRaises(SystemExit):
            run_cli("prefill", "--prompt-ids", "2,999999")


if __name__ == "__main__":
    absltest.main()
