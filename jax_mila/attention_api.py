"""jax_mila.dot_product_attention: ``jax.nn.dot_product_attention`` on jax_mila's kernels.

The signature, layouts ((B, T, N, H) or (T, N, H)) and semantics are those of the installed
``jax.nn.dot_product_attention``: GQA by N % K (query head n reads KV head n // (N / K)),
causal masking top-left aligned (query i sees key j <= i), ``local_window_size`` as jax defines
it (an int w means (w, w); (left, right) lets query i see keys i - left .. i + right), and
``query_seq_lengths`` / ``key_value_seq_lengths`` masking rows and keys past each batch's length
(rows past ``query_seq_lengths`` come back zero).

A call runs ``jax_mila.ffi.flash_attention`` (causal, q_offset = kv_offset = 0) where that op
computes exactly what jax defines (``kernel_plan`` decides, from the call's configuration only):
no ``bias``, no ``mask``, causal (``is_causal=True``, or a window whose right side is 0), a left
window of any size (the op's W = left + 1), head dim 256 or 512, bfloat16 q/k/v, at most 16
query heads per KV head, a scale that is a number, and sequence lengths the kernel path can
honour exactly: ``query_seq_lengths`` by zeroing rows after the kernel; ``key_value_seq_lengths``
only where they hide no key a query row before its ``query_seq_length`` would see (the kernel
has no per-batch key limit): concrete lengths are checked, traced ones pass only when they are
the very array given as ``query_seq_lengths`` (padded self-attention). It also needs a CUDA
device with the kernel built (``device_unsupported_reason``). Everything else falls back to
``jax.nn.dot_product_attention`` with the caller's ``implementation`` (None = jax's default,
XLA; "cudnn" = cuDNN), the reason logged once per reason on the "jax_mila" logger
(jax_mila.ffi._registry.log_fallback). ``implementation="mila"`` asks for the op itself: a
configuration it cannot take raises ValueError; without a GPU the op runs its pure-JAX reference.

The kernel path is differentiable: its backward pass is that of jax.nn.dot_product_attention
(recomputed, with the caller's implementation).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi
from jax_mila.ffi import attention as ffi_attention
from jax_mila.ffi._checks import is_int
from jax_mila.ffi._registry import NO_CUDA_DEVICE, cuda_capabilities, log_fallback, status
from jax_mila.nn.attention import kernel_unsupported_reason

OP = "dot_product_attention"
IMPLEMENTATIONS = (None, "xla", "cudnn", "mila")
_INT32_MAX = int(np.iinfo(np.int32).max)
# The logit jax puts on masked positions (jax._src.nn.functions._get_large_negative for the
# float32 logits of a bf16 call); a row with every key masked has it as its log-sum-exp.
_MASKED_LSE = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How a call maps onto ``jax_mila.ffi.flash_attention(q, k, v, scale=scale, causal=True,
    window=window)``; with ``zero_rows`` the rows past each batch's query_seq_length are zeroed
    afterwards."""

    scale: float
    window: int | None
    zero_rows: bool


def _ensure_4d(x):
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _spec_4d(x) -> jax.ShapeDtypeStruct:
    """x's shape (leading 1s added up to rank 4, as jax does) and dtype, without copying it."""
    shape = tuple(jnp.shape(x))
    return jax.ShapeDtypeStruct((1,) * (4 - len(shape)) + shape, jnp.result_type(x))


def _concrete(x):
    """x as a NumPy array, or None when it is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _window_sides(local_window_size):
    """(left, right) as jax reads local_window_size, or None."""
    if local_window_size is None:
        return None
    if is_int(local_window_size):
        return int(local_window_size), int(local_window_size)
    left, right = local_window_size
    return int(left), int(right)


def kernel_plan(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None):
    """``(KernelPlan, None)`` where jax_mila.ffi.flash_attention computes exactly what
    jax.nn.dot_product_attention defines for this call, else ``(None, reason)``. Looks at the
    configuration only (shapes, dtypes, arguments, concrete lengths); whether this process can
    run the kernel is ``device_unsupported_reason``. Takes the arguments of
    dot_product_attention, already checked as jax checks them; q/k/v of rank 3 or 4."""
    q, k, v = (_spec_4d(x) for x in (query, key, value))
    if bias is not None:
        return None, "a bias (the kernels add no logit bias)"
    if mask is not None:
        return None, "a boolean mask (the kernels express causal and sliding-window masks only)"
    sides = _window_sides(local_window_size)
    if sides is not None and (sides[0] < 0 or sides[1] < 0):
        return None, f"local_window_size={local_window_size!r} with a negative side"
    if not is_causal and (sides is None or sides[1] != 0):
        return None, ("non-causal attention (the kernels run causal attention: is_causal=True or "
                      "a local_window_size whose right side is 0)")
    b, t, n, d = q.shape
    s = k.shape[1]
    if 0 in (b, t, s, n, d):
        return None, f"an empty query or key (query {list(q.shape)}, key {list(k.shape)})"
    # Query i sees keys i - left .. i: the op's window W = left + 1; a left side of T - 1 or
    # more hides nothing.
    left = math.inf if sides is None or sides[0] >= t - 1 else sides[0]
    window = None if left == math.inf else left + 1

    if scale is None:
        scale = 1.0 / np.sqrt(d)
    if isinstance(scale, (str, bytes, bool)):
        return None, f"scale={scale!r} (the kernels take a number)"
    try:
        scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None, "a traced or non-numeric scale (the kernels take a number)"
    if not np.isfinite(np.float32(scale)) or not np.isfinite(scale):
        return None, f"scale={scale!r} (the kernels take a scale finite in float32)"

    reason = kernel_unsupported_reason(q, k, v)
    if reason is not None:
        return None, reason
    g = n // k.shape[2]
    if b > ffi_attention.MAX_BATCH:
        return None, f"batch {b} (the kernels take at most {ffi_attention.MAX_BATCH})"
    if k.shape[2] > ffi_attention.MAX_KV_HEADS:
        return None, (f"{k.shape[2]} KV heads (the kernels take at most "
                      f"{ffi_attention.MAX_KV_HEADS})")
    if t * g > _INT32_MAX or (d == 256 and t > ffi_attention.D256_MAX_QUERIES):
        return None, f"{t} queries at {g} query heads per KV head (beyond the kernels' row limits)"

    # Rows that see no key: jax averages every value there, the kernel writes zeros. Query
    # i (< its query_seq_length) sees keys max(0, i - left) .. min(i, S - 1): none when
    # i >= S + left. Key lengths must hide none of those keys: min(i, S - 1) < kv_length.
    q_len, kv_len = query_seq_lengths, key_value_seq_lengths
    q_vals = None if q_len is None else _concrete(q_len)
    kv_vals = None if kv_len is None else _concrete(kv_len)
    rows = np.full((b,), t, np.int64) if q_vals is None else np.minimum(q_vals.astype(np.int64), t)
    # (a traced query_seq_lengths is bounded by T, the worst case of both conditions)
    if np.any((rows > 0) & (rows > s + left)):
        return None, ("query rows that see no key (a left window of "
                      f"{sides[0] if sides else None} with more queries than keys; jax averages "
                      "all values there, the kernels write zeros)")
    if kv_len is not None:
        if kv_vals is None and kv_len is not q_len:
            return None, ("traced key_value_seq_lengths (the kernels take no per-batch key limit; "
                          "they run where key_value_seq_lengths is the array given as "
                          "query_seq_lengths, or concrete lengths that hide no visible key)")
        if kv_vals is not None and np.any((rows > 0) & (np.minimum(rows, s) > kv_vals)):
            return None, ("key_value_seq_lengths shorter than the keys some query row sees (the "
                          "kernels take no per-batch key limit)")
    return KernelPlan(scale=scale, window=window, zero_rows=q_len is not None), None


def device_unsupported_reason(query, key) -> str | None:
    """Why this process cannot run the flash_attention kernel for these q, k shapes (no CUDA
    device, kernel not built or disabled, GPU without the shared memory), or None; the reasons
    of jax_mila.ffi's dispatch."""
    q, k = _spec_4d(query), _spec_4d(key)
    caps = cuda_capabilities()
    if not caps:
        return NO_CUDA_DEVICE.format(platform=jax.default_backend())
    target = ffi_attention._target(q, k)
    st = status(ffi_attention.OP, target)
    if not st.kernel:
        return st.reason
    if (target == "jax_mila_flash_attention_d512"
            and not all(cc in ffi_attention.D512_CAPABILITIES for cc in caps)):
        return (f"the D=512 kernel needs >= 160 KB of shared memory per block (sm_80, sm_90); "
                f"this process has GPUs of compute capability {sorted(set(caps))}")
    return None


def _spec(x):
    return None if x is None else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _check_like_jax(query, key, value, bias, mask, q_len, kv_len, is_causal, local_window_size):
    """Raises what jax.nn.dot_product_attention raises for these arguments (shapes, dtypes,
    head grouping), at trace time and without computing anything."""
    def attend(q, k, v, b, m, ql, kvl):
        return jax.nn.dot_product_attention(q, k, v, b, m, is_causal=is_causal,
                                            query_seq_lengths=ql, key_value_seq_lengths=kvl,
                                            local_window_size=local_window_size,
                                            implementation="xla")
    jax.eval_shape(attend, *(_spec(x) for x in (query, key, value, bias, mask, q_len, kv_len)))


def _kernel_path(q, k, v, q_len, kv_len, *, plan: KernelPlan, return_residual: bool,
                 reference):
    """flash_attention under the plan, 4-D in and out: o [B, T, N, H] (and the log-sum-exp
    [B, T, N] in key's dtype), differentiated through `reference(q, k, v, q_len, kv_len)`."""

    def forward(q, k, v, q_len):
        o, lse = ffi.flash_attention(q, k, v, scale=plan.scale, causal=True, window=plan.window,
                                     return_lse=True)
        lse = jnp.transpose(lse, (0, 2, 1))  # [B, N, T] -> [B, T, N]
        if plan.zero_rows:
            valid = jnp.arange(q.shape[1])[None, :] < q_len[:, None]  # [B, T]
            o = jnp.where(valid[:, :, None, None], o, jnp.zeros((), o.dtype))
            lse = jnp.where(valid[:, :, None], lse, jnp.float32(_MASKED_LSE))
        return o, lse.astype(k.dtype)

    @jax.custom_vjp
    def attend(q, k, v, q_len, kv_len):
        return forward(q, k, v, q_len)

    def attend_fwd(q, k, v, q_len, kv_len):
        return forward(q, k, v, q_len), (q, k, v, q_len, kv_len)

    def attend_bwd(saved, cotangents):
        q, k, v, q_len, kv_len = saved
        _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, q_len, kv_len), q, k, v)
        # jax stops the gradient of the residual; only the output's cotangent flows.
        return (*vjp(cotangents[0]), None, None)

    attend.defvjp(attend_fwd, attend_bwd)
    o, lse = attend(q, k, v, q_len, kv_len)
    return (o, lse) if return_residual else o


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False):
    """``jax.nn.dot_product_attention`` (same arguments, layouts and results) on jax_mila's
    FlashAttention kernels where they apply; see this module's docstring for where that is.

    ``implementation`` picks what runs where the kernels do not apply: None (jax's default,
    XLA), "xla" or "cudnn", as jax.nn.dot_product_attention takes them; "mila" requires the
    kernel path (ValueError naming why a call cannot take it) and runs the op's pure-JAX
    reference where no kernel can run (CPU).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"jax_mila.dot_product_attention: implementation={implementation!r} is "
                         f"not supported (supported: {IMPLEMENTATIONS})")
    jax_implementation = None if implementation == "mila" else implementation
    kwargs = dict(scale=scale, is_causal=is_causal, local_window_size=local_window_size)

    def jax_attention(q, k, v, q_len, kv_len, *, bias=None, mask=None, residual=False):
        return jax.nn.dot_product_attention(q, k, v, bias, mask, query_seq_lengths=q_len,
                                            key_value_seq_lengths=kv_len,
                                            implementation=jax_implementation,
                                            return_residual=residual, **kwargs)

    def fall_back(reason):
        log_fallback(OP, reason, instead="jax.nn.dot_product_attention (implementation="
                                         f"{jax_implementation!r})")
        return jax_attention(query, key, value, query_seq_lengths, key_value_seq_lengths,
                             bias=bias, mask=mask, residual=return_residual)

    _check_like_jax(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                    is_causal, local_window_size)
    plan, reason = kernel_plan(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               local_window_size=local_window_size)
    if plan is None:
        if implementation == "mila":
            raise ValueError(f"jax_mila.dot_product_attention: implementation='mila' cannot take "
                             f"this call: {reason}")
        return fall_back(reason)
    if implementation != "mila":
        reason = device_unsupported_reason(query, key)
        if reason is not None:
            return fall_back(reason)

    shape = jnp.shape(query)
    q_len = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
    kv_len = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    out = _kernel_path(_ensure_4d(query), _ensure_4d(key), _ensure_4d(value), q_len, kv_len,
                       plan=plan, return_residual=return_residual,
                       reference=functools.partial(jax_attention, residual=False))
    if return_residual:
        o, lse = out
        return o.reshape(shape), lse.reshape(shape[:-1])
    return out.reshape(shape)
