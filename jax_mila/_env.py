"""Environment knobs of jax_mila, parsed so that a malformed value fails with one message naming
the variable, the value and what is supported.

jax_mila reads one variable at run time: ``JAX_MILA_DISABLE`` (jax_mila/ffi/_registry.py, the
kill switch that sends ops to their pure-JAX reference). The kernels read none: every kernel
family keeps its winning variant only. Build-time settings (``JAX_MILA_CUDA_ARCHS``,
``JAX_MILA_KERNELS``) are CMake's (BUILD.md). An unset variable, or one set to the empty
string, takes its default.
"""

from __future__ import annotations

import os
from typing import Iterable

KNOBS = ("JAX_MILA_DISABLE",)  # every JAX_MILA_* variable read at run time


class EnvError(ValueError):
    """An environment variable holds a value jax_mila does not support."""


def names(name: str, known: Iterable[str], *, everything: str = "all") -> frozenset[str]:
    """``name`` as a comma-separated subset of ``known`` (``everything``: all of them); empty
    when unset or empty."""
    known = tuple(known)
    value = os.environ.get(name) or None
    if value is None:
        return frozenset()
    given = {n.strip() for n in value.split(",") if n.strip()}
    if everything in given:
        return frozenset(known)
    unknown = sorted(given - set(known))
    if unknown:
        raise EnvError(f"environment variable {name}={value!r} names unknown ops {unknown} "
                       f"(supported: a comma-separated list of {sorted(known)}, or "
                       f"'{everything}')")
    return frozenset(given)
