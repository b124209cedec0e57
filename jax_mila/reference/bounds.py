"""How far a result may be from its op's definition, and how to hold a kernel to it.

- The interval oracles that the op docstrings cite as the definition of allowed error:
  ``geglu_quantization_problem`` (jax_mila.ffi.quantize_geglu),
  ``add_rms_norm_quantization_problem`` (add_rms_norm_quantize) and ``norm_rope_problem``
  (rms_norm_rope). Each derives, per element in float64 from the exact function, what any
  correct implementation may return, and names every element and row outside it (None when
  all pass): no backend's rounding is the yardstick and no count of exceptions is allowed.
- The error measures the tests and tools use: ``max_abs_err``, ``rel_fro_err``,
  ``e4m3_steps``.
- ``call_with_poisoned_outputs``: runs a function with every output buffer pre-filled with
  poison (NaN), so that an element a kernel never writes cannot pass a check.

Used by jax_mila.selftest(), the test suites (tests/) and scripts/sanitize_kernels.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def poison_like(struct: jax.ShapeDtypeStruct):
    """An array of `struct`'s shape filled with NaN (floating types) or 0x5A bytes."""
    dtype = np.dtype(struct.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.full(struct.shape, jnp.nan, dtype)
    return jnp.full(struct.shape, 0x5A, dtype)


def call_with_poisoned_outputs(fn, *args):
    """Runs `fn(*args)` under jit with every output buffer pre-filled with poison.

    The poisoned arrays are donated and XLA aliases each donated buffer to the output of the
    same shape and dtype, so an element the kernel forgets to write keeps its poison (NaN for
    floating outputs). Asserts that the output really reuses the poisoned memory; returns the
    outputs.
    """
    out_structs = jax.eval_shape(fn, *args)
    leaves, treedef = jax.tree.flatten(out_structs)
    poisons = [poison_like(s) for s in leaves]
    ptrs = [p.unsafe_buffer_pointer() for p in poisons]

    def run(poisons, *args):
        del poisons  # donated only so XLA can place the outputs in their memory
        return fn(*args)

    # keep_unused: `poisons` is unused in the body, and jit would otherwise drop it before
    # XLA sees it, so nothing would be donated (the reuse check below then always fails).
    out = jax.jit(run, donate_argnums=0, keep_unused=True)(poisons, *args)
    out_leaves = jax.tree.leaves(out)
    for i, (o, p) in enumerate(zip(out_leaves, ptrs)):
        if o.unsafe_buffer_pointer() != p:
            raise AssertionError(f"output {i} did not reuse its poisoned buffer; "
                                 "the poison check would prove nothing")
    return jax.tree.unflatten(treedef, out_leaves)


def e4m3_steps(q, q_ref) -> np.ndarray:
    """|q - q_ref| of two float8_e4m3fn arrays in units of q_ref's local e4m3 spacing (2^-3 of
    the value, 2^-9 among the subnormals)."""
    a = np.asarray(q, np.float32)
    b = np.asarray(q_ref, np.float32)
    return np.abs(a - b) / np.maximum(np.abs(b) * 2.0**-3, 2.0**-9)


# ---- quantize_geglu's interval oracle ---------------------------------------------------------
#
# What any correct implementation of quantize_geglu (jax_mila/reference/quantize.py) may return,
# derived per element in float64 from the exact function, so that no backend's rounding is the
# yardstick. An implementation is admitted when:
# - its float32 tanh is within GEGLU_TANH_ERROR (absolute) of the exact tanh of its argument:
#   XLA's float32 tanh (Eigen's rational approximation, on CPU and GPU) is within 2^-21.0 even
#   with a 2-ulp division (div.full.f32, XLA's GPU lowering), measured on every float32 in
#   [2^-12, 20) (tanh is odd; exactly x below 4e-4, exactly +-1 from 20); the kernel's
#   2^(x k (1 + c x^2)) form is within 2^-21.4 with ex2.approx and rcp.approx 4 ulp off
#   (csrc/quantize/quantize_geglu_kernel.cu). 2^-20 leaves a factor of two;
# - the rest of gelu_tanh is float32 arithmetic in any order or contraction (FMA), each step
#   rounding to nearest: at most 8 roundings of 2^-24 relative on the argument of tanh and two
#   on 1 + tanh and the final product;
# - then exactly: a = bf16(gelu) and h = bf16(a * u) (round to nearest even), amax = max |h|,
#   scale = f32(amax * f32(1/448)) (1 for amax < 2^-112, codes 0), codes =
#   e4m3(clip(f32(h * inv), +-448)) with inv = 448 / amax within 3 ulp (XLA's GPU division is
#   div.full.f32, 2 ulp) and the e4m3 rounding to nearest even, directly or through float16
#   (XLA's older GPU emitters convert f32 -> f16 -> f8).
# Every element then has an interval of admissible h (bf16 values) and of admissible codes given
# the scale the implementation chose, and every row an interval of admissible amax. A wrong
# formula, a missing or extra rounding, or a code one step off falls outside: near-ties are the
# only slack, and only where the stated errors can reach them.
GEGLU_TANH_ERROR = 2.0**-20
_U32 = 2.0**-24
_SQRT_2_OVER_PI = float(np.float32(np.sqrt(2.0 / np.pi)))
_CUBIC = float(np.float32(0.044715))
_INV_E4M3_MAX = np.float32(1.0 / 448.0)
_QUANT_MIN_AMAX = 2.0**-112


def _f32_toward(x, direction):
    """float64 -> float32, rounded down (direction < 0) or up: so that a later round-to-nearest
    of the result never lands inside the interval it bounds."""
    f = x.astype(np.float32)
    back = f.astype(np.float64)
    if direction < 0:
        return np.where(back > x, np.nextafter(f, np.float32(-np.inf)), f)
    return np.where(back < x, np.nextafter(f, np.float32(np.inf)), f)


def _bf16(x, direction):
    """The bf16 value round-to-nearest gives at the low (direction < 0) or high end of [x, ...]."""
    import ml_dtypes

    return _f32_toward(x, direction).astype(ml_dtypes.bfloat16).astype(np.float64)


def _e4m3(x, direction):
    """The lowest (direction < 0) or highest e4m3 value of a float64 interval's end, rounded to
    nearest even directly or through float16."""
    import ml_dtypes

    f = _f32_toward(x, direction)
    direct = f.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    via16 = f.astype(np.float16).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.minimum(direct, via16) if direction < 0 else np.maximum(direct, via16)


class _RowsCheck(NamedTuple):
    ok_row: np.ndarray     # [R] bool: the scale (and, for a zero row, every code) is admissible
    ok_code: np.ndarray    # [R, K] bool: the code is admissible given the row's scale
    amax: np.ndarray       # [R] the amax read back from the scale
    amax_lo: np.ndarray    # [R] admissible amax
    amax_hi: np.ndarray
    code_lo: np.ndarray    # [R, K] admissible codes
    code_hi: np.ndarray


def _quantized_rows_check(v_lo, v_hi, qv, s) -> _RowsCheck:
    """The row quantization of both oracles (quantize_activations' definition, see above): rows
    [R, K] whose elements may be any bf16 value in [v_lo, v_hi] (float64), against the codes qv
    (float64 [R, K]) and scales s (float32 [R]) an implementation returned."""
    spans_zero = (v_lo <= 0) & (v_hi >= 0)
    mag_lo = np.where(spans_zero, 0.0, np.minimum(np.abs(v_lo), np.abs(v_hi)))
    mag_hi = np.maximum(np.abs(v_lo), np.abs(v_hi))
    amax_lo, amax_hi = mag_lo.max(axis=1), mag_hi.max(axis=1)
    # The row's amax, read back from its scale (a bf16 value: scale * 448 is within 2^-22
    # of it), must be admissible and give that scale exactly.
    amax = _bf16(s.astype(np.float64) * 448.0, -1)
    regular = ((amax >= _QUANT_MIN_AMAX) & (amax >= amax_lo) & (amax <= amax_hi)
               & (amax.astype(np.float32) * _INV_E4M3_MAX == s))
    # ... and the element that set it quantizes to +-448.
    regular &= np.abs(qv).max(axis=1) == 448.0
    zero = (amax_lo < _QUANT_MIN_AMAX) & (s == 1.0) & np.all(qv == 0, axis=1)
    inv = np.where(regular, 448.0 / np.where(regular, amax, 1.0), 0.0)[:, None]
    slack = 3 * 2.0**-23  # inv within 3 ulp, then the float32 rounding of v * inv
    x_lo = np.minimum(v_lo * inv * (1 - slack), v_lo * inv * (1 + slack))
    x_hi = np.maximum(v_hi * inv * (1 - slack), v_hi * inv * (1 + slack))
    x_lo = np.clip(x_lo - np.abs(x_lo) * 2.0**-23, -448.0, 448.0)
    x_hi = np.clip(x_hi + np.abs(x_hi) * 2.0**-23, -448.0, 448.0)
    code_lo, code_hi = _e4m3(x_lo, -1), _e4m3(x_hi, +1)
    ok = (zero[:, None] & (qv == 0)) | (regular[:, None] & (qv >= code_lo) & (qv <= code_hi))
    return _RowsCheck(regular | zero, ok, amax, amax_lo, amax_hi, code_lo, code_hi)


def geglu_gelu_interval(gate, *, tanh_error: float = GEGLU_TANH_ERROR):
    """(lo, hi) float64 arrays: where an admitted float32 gelu_tanh(gate) may land, before its
    bf16 rounding."""
    g = np.asarray(gate, np.float64)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        y = _SQRT_2_OVER_PI * (g + _CUBIC * g**3)
        # 1 + tanh(y) without cancellation; y's rounding (8 roundings) moves tanh by at most
        # 8 u * max |y| sech^2(y) < 4 u.
        c = 2.0 / (1.0 + np.exp(-2.0 * y))
        err = tanh_error + 4 * _U32 + 3 * _U32 * c
        ends = (0.5 * g * (c - err), 0.5 * g * (c + err))
    return np.minimum(*ends), np.maximum(*ends)


def geglu_h_interval(gate, up, *, tanh_error: float = GEGLU_TANH_ERROR):
    """(lo, hi) float64 arrays: the bf16 values h = bf16(bf16(gelu_tanh(gate)) * up) may take in
    an admitted implementation (see above); lo <= hi elementwise."""
    gl, gh = geglu_gelu_interval(gate, tanh_error=tanh_error)
    u = np.asarray(up, np.float64)
    a_lo, a_hi = _bf16(gl, -1), _bf16(gh, +1)
    # a * u is exact in float32 (8-bit significands) and monotone in a.
    p1, p2 = a_lo * u, a_hi * u
    return _bf16(np.minimum(p1, p2), -1), _bf16(np.maximum(p1, p2), +1)


def geglu_quantization_problem(gate, up, q, scale, *, tanh_error: float = GEGLU_TANH_ERROR,
                               max_listed: int = 3) -> str | None:
    """Why (q, scale) is not a quantization of gelu_tanh(gate) * up that an admitted
    implementation could return (the interval oracle above), or None. gate, up: bf16 [..., K];
    q float8_e4m3fn [..., K]; scale float32 [...]. Every element and every row must pass: there
    is no count of allowed exceptions."""
    k = np.shape(gate)[-1]
    g = np.asarray(gate, np.float32).reshape(-1, k)
    u = np.asarray(up, np.float32).reshape(-1, k)
    qv = np.asarray(q, np.float32).reshape(-1, k).astype(np.float64)
    s = np.asarray(scale, np.float32).reshape(-1)
    if qv.shape != g.shape or s.size != g.shape[0]:
        return f"shapes: q {np.shape(q)}, scale {np.shape(scale)} for gate {np.shape(gate)}"
    if not np.all(np.isfinite(qv)) or not np.all(np.isfinite(s)):
        return "NaN/inf in the result"
    bad_rows, bad_codes = [], []
    step = max(1, (1 << 22) // k)  # rows per block: bounded memory for large inputs
    for r0 in range(0, g.shape[0], step):
        rows = slice(r0, r0 + step)
        h_lo, h_hi = geglu_h_interval(g[rows], u[rows], tanh_error=tanh_error)
        qr, sr = qv[rows], s[rows]
        c = _quantized_rows_check(h_lo, h_hi, qr, sr)
        bad_rows += _bad_rows(c, qr, sr, r0)
        for r, col in zip(*np.nonzero(~c.ok_code & c.ok_row[:, None])):
            bad_codes.append(f"[{r0 + r}, {col}] gate {g[r0 + r, col]!r} up {u[r0 + r, col]!r}: "
                             f"code {qr[r, col]!r}, admissible [{c.code_lo[r, col]!r}, "
                             f"{c.code_hi[r, col]!r}] (h in [{h_lo[r, col]!r}, {h_hi[r, col]!r}])")
    return _problem_report(((bad_rows, s.size, "rows have an inadmissible scale"),
                            (bad_codes, qv.size, "codes outside their interval")), max_listed)


# ---- add_rms_norm_quantize's interval oracle -------------------------------------------------
#
# What any correct implementation of add_rms_norm_quantize (jax_mila/reference/quantize.py)
# may return, derived per element in float64 from the exact function. An implementation is
# admitted when each rms_norm(v, w, eps) of a bf16 row v of K values is evaluated in float32 as
#   t = sum(v^2) / K + f32(eps)   the squares exact (bf16 values), summed in ANY order (a tree
#                                 of any shape: relative error <= gamma_(K-1) =
#                                 (K-1) u / (1 - (K-1) u)), the mean a division or a multiply by
#                                 f32(1/K), eps one addition;
#   r = t^-0.5                    within NORM_RSQRT_ULPS ulp (rsqrtf, rsqrt.approx, pow, 1/sqrt);
#   y = bf16((v * r) * w)         two float32 roundings in any order (a spare third is allowed),
#                                 then exactly one rounding to nearest even bf16;
# and then exactly: n = that norm of the branch, h = bf16(x + n) (round to nearest even; x + n
# of two bf16 values), the norm of h (h as the implementation returned it: the codes depend on
# the h it computed) and the row quantization of quantize_activations (see the GEGLU oracle
# above: inv = 448 / amax within 3 ulp, e4m3 directly or through float16).
# Every element then has an interval of admissible n, h and normed values, every row one of
# admissible amax. The sum-order bound is rigorous whatever the reduction, and wide only where
# it must be (about 2^-13 of r at K = 3840, so some 7% of normed elements have two admissible
# bf16 values and a few per thousand codes two admissible e4m3 values); the oracle still pins
# what a wrong eps moves (the scale, on rows with mean square near eps), a weight applied as
# (1 + w), any missing bf16 rounding and a scale one ulp off (tests/test_quantize.py).
# Inputs are expected finite, with products outside float32's subnormal range.
NORM_RSQRT_ULPS = 4


def rms_norm_interval(v, weight, eps, *, rsqrt_ulps: float = NORM_RSQRT_ULPS):
    """(lo, hi) float64 arrays of bf16 values: what an admitted float32 rms_norm(v, weight, eps)
    (jax_mila.nn.norm, rounded to bf16) may return for rows v [..., K] of bf16 values."""
    v = np.asarray(v, np.float32).astype(np.float64)
    w = np.asarray(weight, np.float32).astype(np.float64)
    k = v.shape[-1]
    r = (np.mean(v * v, axis=-1, keepdims=True) + float(np.float32(eps))) ** -0.5
    g = (k - 1) * _U32
    t_err = (1 + g / (1 - g)) * (1 + _U32) ** 3 - 1
    r_lo = r * (1 + t_err) ** -0.5 * (1 - rsqrt_ulps * 2.0**-23)
    r_hi = r * (1 - t_err) ** -0.5 * (1 + rsqrt_ulps * 2.0**-23)
    p = v * w  # exact: 8 x 24 significant bits
    ends = (p * r_lo * (1 - 4 * _U32), p * r_hi * (1 + 4 * _U32))
    # 2^-148: float32 roundings in the subnormal range are absolute, not relative.
    lo = np.minimum(*ends) - 2.0**-148
    hi = np.maximum(*ends) + 2.0**-148
    return _bf16(lo, -1), _bf16(hi, +1)


def add_rms_norm_h_interval(x, branch, branch_weight, eps, *,
                            rsqrt_ulps: float = NORM_RSQRT_ULPS):
    """(lo, hi) float64 arrays: the bf16 values h = bf16(x + bf16(rms_norm(branch,
    branch_weight, eps))) may take in an admitted implementation; lo <= hi elementwise."""
    n_lo, n_hi = rms_norm_interval(branch, branch_weight, eps, rsqrt_ulps=rsqrt_ulps)
    xv = np.asarray(x, np.float32).astype(np.float64)
    # x + n is exact in float64 and monotone in n.
    return _bf16(xv + n_lo, -1), _bf16(xv + n_hi, +1)


def add_rms_norm_quantization_problem(x, branch, result, *, branch_weight=None, norm_weight,
                                      eps, rsqrt_ulps: float = NORM_RSQRT_ULPS,
                                      max_listed: int = 3) -> str | None:
    """Why ``result`` is not what an admitted implementation of
    add_rms_norm_quantize(x, branch, branch_weight=, norm_weight=, eps=) could return (the
    interval oracle above), or None. x, branch: bf16 [..., K] (branch None: the op without a
    branch); result: (h, q, scale) with a branch, else (q, scale). Every element and every row
    must pass: there is no count of allowed exceptions."""
    k = np.shape(x)[-1]
    xv = np.asarray(x, np.float32).reshape(-1, k)
    if branch is None:
        q, scale = result
        h = None
    else:
        h, q, scale = result
        if np.shape(h) != np.shape(x) or np.dtype(h.dtype) != np.dtype(jnp.bfloat16):
            return f"h: {np.dtype(h.dtype).name}{list(np.shape(h))} for x {list(np.shape(x))}"
        bv = np.asarray(branch, np.float32).reshape(-1, k)
        hv = np.asarray(h, np.float32).reshape(-1, k)
        if not np.all(np.isfinite(hv)):
            return "NaN/inf in h"
    qv = np.asarray(q, np.float32).reshape(-1, k).astype(np.float64)
    s = np.asarray(scale, np.float32).reshape(-1)
    if qv.shape != xv.shape or s.size != xv.shape[0]:
        return f"shapes: q {np.shape(q)}, scale {np.shape(scale)} for x {np.shape(x)}"
    if not np.all(np.isfinite(qv)) or not np.all(np.isfinite(s)):
        return "NaN/inf in the result"
    bad_h, bad_rows, bad_codes = [], [], []
    step = max(1, (1 << 21) // k)  # rows per block: bounded memory for large inputs
    for r0 in range(0, xv.shape[0], step):
        rows = slice(r0, r0 + step)
        if branch is None:
            v = xv[rows]
        else:
            h_lo, h_hi = add_rms_norm_h_interval(xv[rows], bv[rows], branch_weight, eps,
                                                 rsqrt_ulps=rsqrt_ulps)
            v = hv[rows]
            for r, col in zip(*np.nonzero((v < h_lo) | (v > h_hi))):
                bad_h.append(f"[{r0 + r}, {col}] x {xv[r0 + r, col]!r} branch "
                             f"{bv[r0 + r, col]!r}: h {v[r, col]!r}, admissible "
                             f"[{h_lo[r, col]!r}, {h_hi[r, col]!r}]")
        # The codes are those of the norm of the h the implementation returned.
        y_lo, y_hi = rms_norm_interval(v, norm_weight, eps, rsqrt_ulps=rsqrt_ulps)
        qr, sr = qv[rows], s[rows]
        c = _quantized_rows_check(y_lo, y_hi, qr, sr)
        bad_rows += _bad_rows(c, qr, sr, r0)
        what = "x" if branch is None else "h"
        for r, col in zip(*np.nonzero(~c.ok_code & c.ok_row[:, None])):
            bad_codes.append(f"[{r0 + r}, {col}] {what} {v[r, col]!r}: code {qr[r, col]!r}, "
                             f"admissible [{c.code_lo[r, col]!r}, {c.code_hi[r, col]!r}] "
                             f"(normed value in [{y_lo[r, col]!r}, {y_hi[r, col]!r}])")
    return _problem_report(((bad_h, xv.size, "elements of h outside their interval"),
                            (bad_rows, s.size, "rows have an inadmissible scale"),
                            (bad_codes, qv.size, "codes outside their interval")), max_listed)


# ---- rms_norm_rope's interval oracle ---------------------------------------------------------
#
# What any correct implementation of rms_norm_rope (jax_mila/reference/norm_rope.py) may return,
# per element in float64: the normed values n as rms_norm_interval admits them (any order of the
# sum of squares, the rsqrt within NORM_RSQRT_ULPS ulp, one bf16 rounding), then exactly
#   out = bf16(f32(n cos + rotate_half(n) sin))
# whose products are exact in float32 (two bf16 significands; 2^-148 of absolute slack for the
# subnormal range), so that the float32 sum is the one float32 rounding, then one bf16 rounding.
# The expression is linear in n and in its partner, so its extremes over their intervals are at
# the intervals' ends. Where n has one admissible value the output has one too, up to a
# float32-level tie: a missing or extra bf16 rounding (of n, of the products, of the sum), a
# flipped rotate_half, another cos row or a (1 + w) weight falls outside.


def norm_rope_interval(x, weight, cos, sin, eps, *, rsqrt_ulps: float = NORM_RSQRT_ULPS):
    """(lo, hi) float64 arrays of x's shape [..., T, H, D], bf16 values: what an admitted
    rms_norm_rope(x, weight, cos, sin, eps=eps) may return."""
    n_lo, n_hi = rms_norm_interval(x, weight, eps, rsqrt_ulps=rsqrt_ulps)
    half = np.shape(x)[-1] // 2
    rot_lo = np.concatenate([-n_hi[..., half:], n_lo[..., :half]], axis=-1)
    rot_hi = np.concatenate([-n_lo[..., half:], n_hi[..., :half]], axis=-1)
    c = np.asarray(cos, np.float32).astype(np.float64)[:, None, :]
    s = np.asarray(sin, np.float32).astype(np.float64)[:, None, :]
    lo = np.minimum(n_lo * c, n_hi * c) + np.minimum(rot_lo * s, rot_hi * s)
    hi = np.maximum(n_lo * c, n_hi * c) + np.maximum(rot_lo * s, rot_hi * s)
    # The float64 sums themselves may round (operands far apart in magnitude).
    lo = lo - np.abs(lo) * 2.0**-52 - 2.0**-148
    hi = hi + np.abs(hi) * 2.0**-52 + 2.0**-148
    return _bf16(lo, -1), _bf16(hi, +1)


def norm_rope_problem(x, weight, cos, sin, out, *, eps, rsqrt_ulps: float = NORM_RSQRT_ULPS,
                      max_listed: int = 3) -> str | None:
    """Why ``out`` is not what an admitted implementation of rms_norm_rope(x, weight, cos, sin,
    eps=eps) could return (the interval oracle above), or None. Every element must pass: there
    is no count of allowed exceptions."""
    if np.shape(out) != np.shape(x) or np.dtype(out.dtype) != np.dtype(jnp.bfloat16):
        return f"out: {np.dtype(out.dtype).name}{list(np.shape(out))} for x {list(np.shape(x))}"
    got = np.asarray(out, np.float32).astype(np.float64)
    if not np.all(np.isfinite(got)):
        return f"{int(np.sum(~np.isfinite(got)))} NaN/inf elements in out"
    lo, hi = norm_rope_interval(x, weight, cos, sin, eps, rsqrt_ulps=rsqrt_ulps)
    bad = [f"{list(map(int, i))} x {float(np.asarray(x, np.float32)[i])!r}: out {got[i]!r}, "
           f"admissible [{lo[i]!r}, {hi[i]!r}]" for i in zip(*np.nonzero((got < lo) | (got > hi)))]
    return _problem_report(((bad, got.size, "elements outside their interval"),), max_listed)


def _bad_rows(c: _RowsCheck, qr, sr, r0: int) -> list[str]:
    """One line per row of a block (starting at row r0) whose scale _quantized_rows_check
    rejected."""
    return [f"row {r0 + r}: scale {sr[r]!r} (amax {c.amax[r]!r}, max |code| "
            f"{np.abs(qr[r]).max()!r}), admissible amax [{c.amax_lo[r]!r}, {c.amax_hi[r]!r}]"
            for r in np.flatnonzero(~c.ok_row)]


def _problem_report(groups, max_listed: int) -> str | None:
    """An oracle's verdict: None, or per non-empty group of (failures, out of how many, what
    failed) its count and first ``max_listed`` entries."""
    parts = [f"{len(items)} of {total} {what}: " + "; ".join(items[:max_listed])
             for items, total, what in groups if items]
    return " | ".join(parts) if parts else None


def max_abs_err(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def rel_fro_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
