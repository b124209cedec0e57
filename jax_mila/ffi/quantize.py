"""quantize_activations: bf16 [..., K] -> (float8_e4m3fn [..., K], float32 scale [...])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import dispatch

OP = "quantize_activations"
# The kernel moves rows in 16-byte vectors.
K_MULTIPLE = 16


def _validate(x) -> None:
    _checks.check_rank(OP, "x", x, min_rank=2, layout="([..., M, K])")
    _checks.check_dtype(OP, "x", x, [jnp.bfloat16])
    _checks.check_nonempty(OP, "x", x)
    if x.shape[-1] % K_MULTIPLE:
        _checks.fail(OP, "x", f"K={x.shape[-1]} (last dim of {list(x.shape)}) must be a "
                              f"multiple of {K_MULTIPLE}")


def _kernel(x):
    out_types = (
        jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32),
    )
    # Every leading dim is a row to the kernel, so a vmapped axis is just more rows.
    call = jax.ffi.ffi_call("jax_mila_quantize_activations", out_types,
                            vmap_method="broadcast_all")
    return call(x)


def quantize_activations(x):
    """Quantizes each row of bf16 ``x`` to float8_e4m3fn with a float32 scale per row.

    Returns ``(q, scale)`` with ``q.shape == x.shape`` and ``scale.shape == x.shape[:-1]``;
    ``q * scale[..., None]`` approximates ``x`` (see jax_mila.reference.quantize for the
    exact definition, which the kernel matches bit for bit).
    """
    _validate(x)
    return dispatch(OP, _kernel, reference.quantize_activations, x)
