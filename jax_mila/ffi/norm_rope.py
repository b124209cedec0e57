"""rms_norm_rope: a Gemma 4 attention layer's per-head RMS norm (q_norm / k_norm) and rotary
embedding in one pass over q or k, bf16 [..., T, H, D] -> bf16 [..., T, H, D], D in {256, 512}.
The definition, and how it differs from the unfused model by its single rounding, is
jax_mila.reference.rms_norm_rope."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import dispatch

OP = "rms_norm_rope"
TARGET = "jax_mila_rms_norm_rope"
HEAD_DIMS = (256, 512)  # csrc/norm_rope/norm_rope_kernel.h
WEIGHT_DTYPES = (jnp.bfloat16, jnp.float32)


def _validate(x, weight, cos, sin) -> None:
    _checks.check_rank(OP, "x", x, min_rank=3, layout="([..., T, H, D])")
    _checks.check_dtype(OP, "x", x, [jnp.bfloat16])
    _checks.check_nonempty(OP, "x", x)
    t, d = x.shape[-3], x.shape[-1]
    if d not in HEAD_DIMS:
        _checks.fail(OP, "x", f"head dim D={d} (last dim of {list(x.shape)}) is not supported "
                              f"(supported: {', '.join(map(str, HEAD_DIMS))})")
    _checks.check_dtype(OP, "weight", weight, WEIGHT_DTYPES)
    if tuple(weight.shape) != (d,):
        _checks.fail(OP, "weight", f"shape {list(weight.shape)} must be [{d}] (one weight per "
                                   f"element of a head of x{list(x.shape)})")
    for arg, table in (("cos", cos), ("sin", sin)):
        _checks.check_dtype(OP, arg, table, [jnp.bfloat16])
        if tuple(table.shape) != (t, d):
            _checks.fail(OP, arg, f"shape {list(table.shape)} must be [{t}, {d}] ([T, D] of "
                                  f"x{list(x.shape)} = [..., T, H, D])")


def _kernel(x, weight, cos, sin, *, eps):
    # The weight enters rms_norm as float32 (exact for bf16): the kernel takes it so.
    # vmap_method "sequential": x is rows, weight and the tables are not; a batched call is a
    # loop of unbatched ones.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
                            vmap_method="sequential")
    return call(x, weight.astype(jnp.float32), cos, sin, eps=np.float32(eps))


def rms_norm_rope(x, weight, cos, sin, *, eps):
    """``rope(bf16(rms_norm(x, weight, eps)), cos, sin)`` rounded once to bf16.

    x: bfloat16 [..., T, H, D], D in {256, 512}, any T, H >= 1 and any leading dims; weight:
    bfloat16 or float32 [D] (Gemma 4's convention: the weight itself is the multiplier);
    cos, sin: bfloat16 [T, D] (jax_mila.gemma4.rope.rope_tables); eps: a finite number > 0.
    Returns bfloat16 of x's shape. The RoPE runs in float32 from the bf16-rounded normed values
    and rounds once at the end, one rounding where the unfused model's bf16 ops have three
    (jax_mila.reference.rms_norm_rope).

    Without the kernel (CPU, JAX_MILA_DISABLE) this is jax_mila.reference.rms_norm_rope. The
    kernel sums the squares in its own order, which moves rare normed values by a bf16 step;
    what any implementation of the definition may return is stated and checked by
    jax_mila.reference.bounds.norm_rope_problem.
    """
    _validate(x, weight, cos, sin)
    eps = _checks.static_eps(OP, eps)
    return dispatch(OP, functools.partial(_kernel, eps=eps),
                    functools.partial(reference.rms_norm_rope, eps=eps), x, weight, cos, sin)
