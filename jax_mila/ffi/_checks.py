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


def require_array(op: str, arg: str, x) -> None:
    """A list or a scalar where an array goes fails here, naming the argument (not later, as an
    AttributeError on .shape)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        fail(op, arg, f"expected an array (jax or numpy), got {type(x).__name__}")


def check_dtype(op: str, arg: str, x, allowed: Iterable) -> None:
    require_array(op, arg, x)
    allowed = [np.dtype(a) for a in allowed]
    if np.dtype(x.dtype) not in allowed:
        names = ", ".join(a.name for a in allowed)
        fail(op, arg, f"dtype {np.dtype(x.dtype).name} is not supported (supported: {names}); "
                      f"got {arg}{list(x.shape)}")


def check_rank(op: str, arg: str, x, *, rank: int | None = None, min_rank: int | None = None,
               layout: str = "") -> None:
    require_array(op, arg, x)
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
    """``eps`` as a Python float, if it is a static number > 0 that stays finite and > 0 in
    float32 (the kernels' attribute type: 1e-50 would reach them as 0, 1e300 as inf)."""
    if isinstance(eps, (bool, str, bytes)):
        fail(op, "eps", f"must be a static Python number, got {type(eps).__name__} {eps!r}")
    try:
        value = float(eps)
    except Exception:  # noqa: BLE001 - a tracer, an array of several values ...
        fail(op, "eps", f"must be a static Python number (an attribute of the kernel), got "
                        f"{type(eps).__name__}")
    if not (value > 0 and finite_in_float32(value) and np.float32(value) != 0):
        fail(op, "eps", f"{value!r} is not supported (supported: a number > 0 that float32 "
                        f"holds, {float(np.finfo(np.float32).smallest_subnormal):g} to "
                        f"{float(np.finfo(np.float32).max):g})")
    return value


def finite_in_float32(value: float) -> bool:
    """Whether ``value`` is finite, also once rounded to float32 (a kernel attribute's type)."""
    with np.errstate(over="ignore"):
        return bool(math.isfinite(value) and np.isfinite(np.float32(value)))


def int32_value(op: str, arg: str, value) -> None:
    """Fails unless the concrete integer ``value`` fits the kernels' int32."""
    info = np.iinfo(np.int32)
    if not info.min <= int(value) <= info.max:
        fail(op, arg, f"{int(value)} is out of range (supported: int32, {info.min} to "
                      f"{info.max})")
