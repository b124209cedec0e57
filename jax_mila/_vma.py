"""Inside ``shard_map``, every value's type says which mesh axes it varies over (jax 0.11:
``vma``; jax 0.10: ``manual_axis_type.varying``). A loop carry or a custom call's result made
from constants varies over none, and JAX refuses to mix it with values that vary: these mark
it varying like the values it stands beside. Outside shard_map both are no-ops."""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` varies inside shard_map (empty outside)."""
    t = jax.typeof(x)
    if hasattr(t, "vma"):
        return frozenset(t.vma)
    return frozenset(getattr(getattr(t, "manual_axis_type", None), "varying", ()) or ())


def vary_like(value, *refs):
    """``value`` (an array) marked varying over every axis any leaf of ``refs`` varies over."""
    axes = frozenset().union(*(varying_axes(r) for r in jax.tree.leaves(refs)))
    missing = tuple(sorted(axes - varying_axes(value)))
    if not missing:
        return value
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(value, missing, to="varying")
    return jax.lax.pvary(value, missing)
