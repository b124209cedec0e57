"""Kernel path vs reference path: logits, per-layer hidden states, chunked prefill and greedy
generate (see jax_mila/gemma4/fidelity.py). GPU: --model 12b --tokens 8192."""

import os
import sys

# The checkout's package, not an older installed copy.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_mila.gemma4.fidelity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
