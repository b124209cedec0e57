"""Environment knobs of jax_mila: every ``JAX_MILA_*`` variable is parsed here, so a malformed
value fails with one message naming the variable, the value and what is supported.

An unset variable, or one set to the empty string, takes its default; values are compared
exactly (" 1" is not "1", as for the handlers). Python reads its knobs through ``choice`` /
``flag`` / ``integer`` / ``names``; the knobs the CUDA handlers read themselves (once per
process, ignoring values they do not know) are listed in ``KERNEL_KNOBS`` and checked by
``check_kernel_knobs`` when the extension registers its targets (jax_mila/ffi/_registry.py),
before any handler can read them. ``check_all`` checks every knob at once (the CLI runs it
first).
"""

from __future__ import annotations

import os
from typing import Iterable


class EnvError(ValueError):
    """An environment variable holds a value jax_mila does not support."""


# Read by the CUDA handlers (csrc/), not by Python: name -> the values they recognise. None
# today: every kernel family keeps its winning variant only, chosen without the environment.
KERNEL_KNOBS: dict[str, tuple[str, ...]] = {}


# Read by Python: switches ("0" / "1") and integers (name -> smallest value). Their readers
# parse them where they are used; check_all checks them all at once (the CLI, at its start).
SWITCHES = ("JAX_MILA_PREFILL_ONE_STEP",)                          # jax_mila/gemma4/pieces.py
INTEGERS = {"JAX_MILA_PREFILL_PIECE_LAYERS": 1}                   # jax_mila/gemma4/pieces.py


def _raw(name: str) -> str | None:
    """The variable's value as set (not stripped: the handlers compare it exactly), or None
    when unset or empty."""
    value = os.environ.get(name)
    return value or None


def _fail(name: str, value: str, supported: str) -> None:
    raise EnvError(f"environment variable {name}={value!r} is not supported (supported: "
                   f"{supported}; unset it for the default)")


def choice(name: str, choices: Iterable[str], default: str | None = None) -> str | None:
    """The value of ``name``, one of ``choices``; ``default`` when unset or empty."""
    choices = tuple(choices)
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        _fail(name, value, ", ".join(choices))
    return value


def flag(name: str, default: bool) -> bool:
    """``name`` as a switch: "1" on, "0" off; ``default`` when unset or empty."""
    value = choice(name, ("0", "1"))
    return default if value is None else value == "1"


def integer(name: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """``name`` as a base-10 integer in [minimum, maximum]; ``default`` when unset or empty."""
    value = _raw(name)
    if value is None:
        return default
    bounds = (f"an integer >= {minimum}" if maximum is None else
              f"an integer in [{minimum}, {maximum}]") if minimum is not None else "an integer"
    try:
        number = int(value, 10)
    except ValueError:
        _fail(name, value, bounds)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        _fail(name, value, bounds)
    return number


def names(name: str, known: Iterable[str], *, everything: str = "all") -> frozenset[str]:
    """``name`` as a comma-separated list of ``known`` names, or ``everything`` for all of them
    (the empty set when unset or empty)."""
    known = tuple(known)
    value = _raw(name)
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


def check_kernel_knobs() -> None:
    """Raises EnvError for a KERNEL_KNOBS variable set to a value its handler does not know
    (the handler would silently run its default instead)."""
    for name, choices in KERNEL_KNOBS.items():
        choice(name, choices)


def check_all() -> None:
    """Raises EnvError for any jax_mila environment knob set to a value it does not support:
    KERNEL_KNOBS, SWITCHES, INTEGERS and JAX_MILA_DISABLE (a program that reads none of them on
    its path, e.g. a model whose ops all run their reference, would otherwise ignore a typo)."""
    check_kernel_knobs()
    for name in SWITCHES:
        flag(name, default=True)
    for name, minimum in INTEGERS.items():
        integer(name, minimum, minimum=minimum)
    from jax_mila.ffi._registry import disabled_ops  # noqa: PLC0415 -- imports jax

    disabled_ops()
