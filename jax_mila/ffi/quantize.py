"""The activation quantizer's ops:

- quantize_activations: bf16 [..., K] -> (float8_e4m3fn [..., K], float32 scale [...]);
- quantize_geglu: bf16 gate, up [..., K] -> the same quantization of
  bf16(bf16(gelu_tanh(gate)) * up), without materialising that product (the input of a W4A8
  down projection);
- add_rms_norm_quantize: bf16 x (and a branch) [..., K] -> the same quantization of an RMS norm
  of x, or of h = x + rms_norm(branch) (returned too), without materialising the normed rows
  (the inputs of a decoder layer's W4A8 q/k/v and gate/up projections).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import dispatch

OP = "quantize_activations"
GEGLU_OP = "quantize_geglu"
NORM_OP = "add_rms_norm_quantize"
# The op's FFI targets: with a branch (returns h too) and without.
NORM_TARGET = "jax_mila_add_rms_norm_quantize"
NORM_ONLY_TARGET = "jax_mila_rms_norm_quantize"
# The kernels move rows in 16-byte vectors.
K_MULTIPLE = 16
MAX_ROWS = 2**31 - 1  # rows and row length: int32 in the kernels


def _validate_rows(op: str, arg: str, x) -> None:
    _checks.check_rank(op, arg, x, min_rank=2, layout="([..., M, K])")
    _checks.check_dtype(op, arg, x, [jnp.bfloat16])
    _checks.check_nonempty(op, arg, x)
    if x.shape[-1] % K_MULTIPLE:
        _checks.fail(op, arg, f"K={x.shape[-1]} (last dim of {list(x.shape)}) must be a "
                              f"multiple of {K_MULTIPLE}")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if rows > MAX_ROWS or x.shape[-1] > MAX_ROWS:
        _checks.fail(op, arg, f"{rows} rows of K={x.shape[-1]} are not supported (the kernels "
                              f"take at most {MAX_ROWS} of each); got {arg}{list(x.shape)}")


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
    may return is stated and checked by jax_mila.reference.bounds.geglu_quantization_problem.
    """
    _validate_rows(GEGLU_OP, "gate", gate)
    _checks.check_dtype(GEGLU_OP, "up", up, [jnp.bfloat16])
    if tuple(up.shape) != tuple(gate.shape):
        _checks.fail(GEGLU_OP, "up", f"shape {list(up.shape)} must equal gate's shape "
                                     f"{list(gate.shape)}")
    return dispatch(GEGLU_OP, _geglu_kernel, reference.quantize_geglu, gate, up)


def _validate_norm_weight(arg: str, w, k: int) -> None:
    _checks.check_dtype(NORM_OP, arg, w, [jnp.bfloat16, jnp.float32])
    if tuple(w.shape) != (k,):
        _checks.fail(NORM_OP, arg, f"shape {list(w.shape)} must be [{k}] (one weight per column "
                                   "of x)")


def _norm_kernel(x, branch, branch_weight, norm_weight, *, eps):
    # The weights enter rms_norm as float32 (exact for bf16 weights): the kernel takes them so.
    # vmap_method "sequential": x and branch are rows, the weights are not; a batched call is a
    # loop of unbatched ones.
    attrs = dict(eps=np.float32(eps))
    wn = norm_weight.astype(jnp.float32)
    if branch is None:
        call = jax.ffi.ffi_call(NORM_ONLY_TARGET, _out_types(x.shape), vmap_method="sequential")
        return call(x, wn, **attrs)
    out = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),) + _out_types(x.shape)
    call = jax.ffi.ffi_call(NORM_TARGET, out, vmap_method="sequential")
    return call(x, branch, branch_weight.astype(jnp.float32), wn, **attrs)


def add_rms_norm_quantize(x, branch=None, *, branch_weight=None, norm_weight, eps):
    """A decoder layer's RMS norm (and residual add) fused with the activation quantizer.

    With ``branch``: h = bf16(x + rms_norm(branch, branch_weight, eps)) (``h = h +
    post_attention_layernorm(a)``) and (q, scale) = quantize_activations(rms_norm(h,
    norm_weight, eps)) (``pre_feedforward_layernorm`` feeding W4A8 gate/up); returns
    ``(h, q, scale)``. Without: ``(q, scale)`` of quantize_activations(rms_norm(x, norm_weight,
    eps)) (``input_layernorm`` feeding W4A8 q/k/v).

    x, branch: bfloat16 [..., K] of the same shape, K a multiple of 16; branch_weight (with a
    branch only), norm_weight: bfloat16 or float32 [K]; eps: a finite number > 0. rms_norm is
    jax_mila.nn.norm.rms_norm (float32, the weight itself as multiplier, rounded once to bf16);
    q float8_e4m3fn [..., K], scale float32 [...] as quantize_activations returns them.

    Without the kernel (CPU, JAX_MILA_DISABLE) this is jax_mila.reference.add_rms_norm_quantize,
    the decoder layer's own expression, so a model computes what it computed unfused, bit for
    bit (under jit XLA may keep h in float32 for the second norm there: see that module). The
    kernel computes the definition, every bf16 rounding included, with the squares summed in its
    own order, which moves rare elements of h and of the normed rows by a bf16 step: what any
    implementation of the definition may return is stated and checked by
    jax_mila.reference.bounds.add_rms_norm_quantization_problem.
    """
    _validate_rows(NORM_OP, "x", x)
    k = x.shape[-1]
    if branch is not None:
        _checks.check_dtype(NORM_OP, "branch", branch, [jnp.bfloat16])
        if tuple(branch.shape) != tuple(x.shape):
            _checks.fail(NORM_OP, "branch", f"shape {list(branch.shape)} must equal x's shape "
                                            f"{list(x.shape)}")
        if branch_weight is None:
            _checks.fail(NORM_OP, "branch_weight", "required with a branch (the branch's norm "
                                                   "weight)")
        _validate_norm_weight("branch_weight", branch_weight, k)
    elif branch_weight is not None:
        _checks.fail(NORM_OP, "branch_weight", "given without a branch (pass branch=, or no "
                                               "branch_weight)")
    _validate_norm_weight("norm_weight", norm_weight, k)
    eps = _checks.static_eps(NORM_OP, eps)
    ref = functools.partial(_norm_reference, eps=eps)
    kernel = functools.partial(_norm_kernel, eps=eps)
    if branch is None:
        return dispatch(NORM_OP, lambda x, w: kernel(x, None, None, w),
                        lambda x, w: ref(x, None, None, w), x, norm_weight,
                        target=NORM_ONLY_TARGET)
    return dispatch(NORM_OP, kernel, ref, x, branch, branch_weight, norm_weight,
                    target=NORM_TARGET)


def _norm_reference(x, branch, branch_weight, norm_weight, *, eps):
    return reference.add_rms_norm_quantize(x, branch, branch_weight=branch_weight,
                                           norm_weight=norm_weight, eps=eps)
