"""The activation quantizer's ops:

- quantize_activations: bf16 [..., K] -> (float8_e4m3fn [..., K], float32 scale [...]);
- quantize_geglu: bf16 gate, up [..., K] -> the same quantization of
  bf16(bf16(gelu_tanh(gate)) * up), without materialising that product (the input of a W4A8
  down projection).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import dispatch

OP = "quantize_activations"
GEGLU_OP = "quantize_geglu"
# The kernels move rows in 16-byte vectors.
K_MULTIPLE = 16


def _validate_rows(op: str, arg: str, x) -> None:
    _checks.check_rank(op, arg, x, min_rank=2, layout="([..., M, K])")
    _checks.check_dtype(op, arg, x, [jnp.bfloat16])
    _checks.check_nonempty(op, arg, x)
    if x.shape[-1] % K_MULTIPLE:
        _checks.fail(op, arg, f"K={x.shape[-1]} (last dim of {list(x.shape)}) must be a "
                              f"multiple of {K_MULTIPLE}")


def _out_types(shape):
    return (jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct(shape[:-1], jnp.float32))


def _kernel(x):
    # Every leading dim is a row to the kernel, so a vmapped axis is just more rows.
    call = jax.ffi.ffi_call("jax_mila_quantize_activations", _out_types(x.shape),
                            vmap_method="broadcast_all")
    return call(x)


def _geglu_kernel(gate, up):
    call = jax.ffi.ffi_call("jax_mila_quantize_geglu", _out_types(gate.shape),
                            vmap_method="broadcast_all")
    return call(gate, up)


def quantize_activations(x):
    """Quantizes each row of bf16 ``x`` to float8_e4m3fn with a float32 scale per row.

    Returns ``(q, scale)`` with ``q.shape == x.shape`` and ``scale.shape == x.shape[:-1]``;
    ``q * scale[..., None]`` approximates ``x`` (see jax_mila.reference.quantize for the
    exact definition, which the kernel matches bit for bit).
    """
    _validate_rows(OP, "x", x)
    return dispatch(OP, _kernel, reference.quantize_activations, x)


def quantize_geglu(gate, up):
    """``quantize_activations(bf16(bf16(gelu_tanh(gate)) * up))`` in one pass over gate and up.

    gate and up: bf16 of the same shape [..., K]; returns ``(q, scale)`` like
    quantize_activations. gelu_tanh is HF's gelu_pytorch_tanh in float32
    (jax_mila.reference.quantize). The kernel's float32 tanh is not XLA's (both are within
    2^-20 of the exact one), which moves rare codes by one e4m3 step; what any implementation
    may return is stated and checked by jax_mila.testing.geglu_quantization_problem.
    """
    _validate_rows(GEGLU_OP, "gate", gate)
    _checks.check_dtype(GEGLU_OP, "up", up, [jnp.bfloat16])
    if tuple(up.shape) != tuple(gate.shape):
        _checks.fail(GEGLU_OP, "up", f"shape {list(up.shape)} must equal gate's shape "
                                     f"{list(gate.shape)}")
    return dispatch(GEGLU_OP, _geglu_kernel, reference.quantize_geglu, gate, up)
