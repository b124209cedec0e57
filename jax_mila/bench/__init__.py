"""Benchmarks that ship with the package, and what the repository's benchmarks share.

- :mod:`jax_mila.bench.prefill`: end-to-end Gemma 4 prefill (tokens/s, peak memory and its
  breakdown, time split by kernel) for the kernel path, the reference path and transformers
  (``python -m jax_mila bench prefill``).
- :mod:`jax_mila.bench.decode`: end-to-end decode after a prompt (tokens/s against the HBM
  bound) for the same three paths (``python -m jax_mila bench decode``).
- :mod:`jax_mila.bench.trace`: reads a jax.profiler trace and buckets GPU kernel time.
- :mod:`jax_mila.bench.timing`: medians of wall or device time, the GPU's clock and power
  while a path ran, markdown tables and JSON output.
- :mod:`jax_mila.bench.gemm_paths`: the 12B GEMM shapes and XLA's FP8 paths the W4A8 kernel is
  timed against.

The kernel benchmarks themselves (attention, gemm, quantize, ...) are programs in the source
repository's ``benchmarks/`` directory, run by path against the installed package (BUILD.md).
"""
