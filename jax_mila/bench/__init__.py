"""Benchmarks that ship with the package (``python -m jax_mila bench``).

- :mod:`jax_mila.bench.prefill`: end-to-end Gemma 4 prefill (tokens/s, peak memory and its
  breakdown, time split by kernel) for the kernel path, the reference path and transformers.
- :mod:`jax_mila.bench.trace`: reads a jax.profiler trace and buckets GPU kernel time.

The kernel micro-benchmarks (attention, gemm, quantize) stay in the source repository's
``benchmarks/`` directory.
"""
