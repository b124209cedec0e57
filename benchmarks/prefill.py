"""End-to-end Gemma 4 12B prefill: jax_mila kernels vs the reference path vs transformers.

    python3 benchmarks/prefill.py [--seqs 4096,8192,16384,32768,65536] [--backends mila,reference,transformers]

A thin entry point: the benchmark lives in jax_mila/bench/prefill.py (installed with the
package, also `python -m jax_mila bench prefill`); see its docstring or --help.
"""

from __future__ import annotations

from jax_mila.bench import prefill

if __name__ == "__main__":
    prefill.main()
