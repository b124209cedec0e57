"""End-to-end Gemma 4 decode: jax_mila kernels vs the reference path vs transformers.

    python3 benchmarks/decode.py [--model 12b] [--prompts 4096,65536] [--batches 1,8] [--steps 128]

A thin entry point: the benchmark lives in jax_mila/bench/decode.py (installed with the
package, also `python -m jax_mila bench decode`); see its docstring or --help.
"""

from __future__ import annotations

from jax_mila.bench import decode

if __name__ == "__main__":
    decode.main()
