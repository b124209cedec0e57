"""Kernel path vs reference path: logits, per-layer hidden states, chunked prefill and greedy
generate (see jax_mila/gemma4/fidelity.py). GPU: --model 12b --tokens 8192."""

import os
import sys

try:  # the installed package: it holds the built CUDA extension
    from jax_mila.gemma4.fidelity import main
except ImportError:  # not installed, or an older install: the checkout (no kernels unless built in place)
    for name in [m for m in sys.modules if m == "jax_mila" or m.startswith("jax_mila.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jax_mila.gemma4.fidelity import main

if __name__ == "__main__":
    sys.exit(main())
