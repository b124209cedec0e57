"""Backend names shared by every jax_mila.nn module.

A module's backend is fixed when it is constructed, so the model code never branches on it:
- "reference": pure-JAX oracles only (jax_mila.reference); the parity path.
- "mila": the jax_mila.ffi custom calls (CUDA kernels on GPU). Every call the kernels cannot
  take falls back to the reference per call, with one log line per (op, reason) on the
  "jax_mila" logger (jax_mila.ffi._registry.log_fallback): configs the kernels do not support
  (head dim, dtype, head grouping, W4A8 shapes) at the module, no GPU / kernel not built /
  JAX_MILA_DISABLE / compute capability in the ffi layer.
- "auto": the same as "mila" today; kept as its own name so a later heuristic (e.g. size
  thresholds) can pick per call site without changing callers.
"""

from __future__ import annotations

BACKENDS = ("auto", "mila", "reference")


def check_backend(backend: str) -> str:
    """Returns ``backend`` if it is a known name, else raises ValueError naming the choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported (supported: {BACKENDS})")
    return backend
