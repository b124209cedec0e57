"""Trace-time argument checks shared by the op wrappers. Each error names the op,
the argument, what it got and what is supported."""

from __future__ import annotations

import math
from typing import Iterable

import jax.numpy as jnp
import numpy as np


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool (an int subclass that no integer argument means)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def fail(op: str, arg: str, msg: str) -> None:
    raise ValueError(f"jax_mila.{op}: {arg}: {msg}")


def check_dtype(op: str, arg: str, x, allowed: Iterable) -> None:
    allowed = [np.dtype(a) for a in allowed]
    if np.dtype(x.dtype) not in allowed:
        names = ", ".join(a.name for a in allowed)
        fail(op, arg, f"dtype {np.dtype(x.dtype).name} is not supported (supported: {names}); "
                      f"got {arg}{list(x.shape)}")


def check_rank(op: str, arg: str, x, *, rank: int | None = None, min_rank: int | None = None,
               layout: str = "") -> None:
    nd = len(x.shape)
    if rank is not None and nd != rank:
        fail(op, arg, f"expected rank {rank} {layout}, got shape {list(x.shape)}")
    if min_rank is not None and nd < min_rank:
        fail(op, arg, f"expected rank >= {min_rank} {layout}, got shape {list(x.shape)}")


def check_nonempty(op: str, arg: str, x) -> None:
    if any(d == 0 for d in x.shape):
        fail(op, arg, f"empty arrays are not supported, got shape {list(x.shape)}")


def is_bf16(x) -> bool:
    return np.dtype(x.dtype) == np.dtype(jnp.bfloat16)


def static_eps(op: str, eps) -> float:
    """``eps`` as a Python float, if it is a static finite number > 0 (a kernel attribute)."""
    try:
        value = float(eps)
    except Exception:  # noqa: BLE001 - a tracer, an array of several values, a string ...
        fail(op, "eps", f"must be a static Python number (an attribute of the kernel), got "
                        f"{type(eps).__name__}")
    if not (math.isfinite(value) and value > 0):
        fail(op, "eps", f"{value!r} is not supported (supported: a finite number > 0)")
    return value
