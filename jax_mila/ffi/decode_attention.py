"""decode_attention: attention of a few new tokens per row over the KV cache (decode steps).

q [B, T, Hq, D] (T <= 16 new tokens, already in the cache), k and v [B, S, Hkv, D] (the
cache: q's dtype or float8_e4m3fn), kv_len [B] int32 (row b's tokens, the new ones included:
its query i sits at position kv_len[b] - T + i). Without ``ring`` slot s holds position s;
with ``ring`` (a sliding layer) the S slots are a ring read in place: slot s holds the newest
position p < kv_len[b] with p % S == s. Causal, with an optional ``window`` W (q_pos - k_pos
< W); a ring needs a window and S >= W + T - 1. ``rotary_keys_only=r`` as flash_attention's.
The full contract: jax_mila/reference/decode_attention.py.

The kernel (csrc/decode_attention/, docs/design/decode_attention.md) splits each row's visible
keys into pieces across the SMs (flash-decoding: a partial softmax per piece, one fixed-order
combine); it reads only the slots a query of the row can see. Its partial results are two
extra outputs of the custom call (``pieces`` below sizes them) that this wrapper drops.
Calls past the kernel's limits (B or Hkv above 65535, S above 2^31 - 65) run the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila.ffi import _checks
from jax_mila.ffi._registry import dispatch
from jax_mila.reference.attention import keys_except_rotary
from jax_mila.reference.decode_attention import decode_attention as _reference

OP = "decode_attention"
HEAD_DIMS = (256, 512)
MAX_NEW_TOKENS = 16
MAX_GROUPS = 16
CACHE_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)
TARGET = "jax_mila_decode_attention"
# Kernel limits (csrc/decode_attention/decode_attention_ffi.cc): B and Hkv are grid dimensions;
# the kernel loads K in 16-column steps, so rotary_keys_only=r with r % 16 != 0 gets the
# substituted keys (reference.keys_except_rotary) and reads K everywhere.
MAX_GRID = 65535
ROTARY_STEP = 16
MAX_SLOTS = 2**31 - 65
# Pieces: about TARGET_CTAS_PER_SM split CTAs per SM (two waves of two resident CTAs), none
# shorter than MIN_PIECE_KEYS keys, nor so short that its partial results (rows x (D + 2)
# floats, written and read again, mostly in L2) pass ~1/16 of the cache bytes it reads (2 D
# bytes a key in bf16: a piece of 64 rows / itemsize keys per row).
TARGET_CTAS_PER_SM = 4
MIN_PIECE_KEYS = 64
DEFAULT_SMS = 132


def _check(q, k, v, kv_len, scale, window, ring, rotary_keys_only) -> None:
    fail = lambda arg, msg: _checks.fail(OP, arg, msg)  # noqa: E731
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_rank(OP, name, x, rank=4, layout="[B, T or S, heads, D]")
        _checks.check_nonempty(OP, name, x)
    _checks.check_dtype(OP, "q", q, (jnp.bfloat16,))
    _checks.check_dtype(OP, "k", k, CACHE_DTYPES)
    if np.dtype(v.dtype) != np.dtype(k.dtype) or v.shape != k.shape:
        fail("v", f"must match k (k{list(k.shape)} {np.dtype(k.dtype).name}), got "
                  f"v{list(v.shape)} {np.dtype(v.dtype).name}")
    b, t, hq, d = q.shape
    if d not in HEAD_DIMS:
        fail("q", f"head dim {d} is not supported (supported: {HEAD_DIMS}); got q{list(q.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        fail("k", f"batch and head dim must match q{list(q.shape)}, got k{list(k.shape)}")
    if t > MAX_NEW_TOKENS:
        fail("q", f"T={t} new tokens per row; supported: 1 to {MAX_NEW_TOKENS} (a longer "
                  f"step is a prefill chunk: flash_attention)")
    hkv = k.shape[2]
    if hq % hkv or hq // hkv > MAX_GROUPS:
        fail("q", f"query heads {hq} must be a multiple of the KV heads {hkv}, at most "
                  f"{MAX_GROUPS} per KV head")
    _checks.check_rank(OP, "kv_len", kv_len, rank=1, layout="[B]")
    _checks.check_dtype(OP, "kv_len", kv_len, (jnp.int32,))
    if kv_len.shape[0] != b:
        fail("kv_len", f"one length per row: expected [{b}], got {list(kv_len.shape)}")
    if scale is not None and not (_is_real(scale) and _checks.finite_in_float32(float(scale))):
        fail("scale", f"must be None or a number finite in float32, got {scale!r}")
    if window is not None:
        if not _checks.is_int(window) or window < 1:
            fail("window", f"must be None or an int >= 1, got {window!r}")
        _checks.int32_value(OP, "window", window)
    if not isinstance(ring, bool):
        fail("ring", f"must be a bool, got {ring!r}")
    if ring:
        s = k.shape[1]
        if window is None:
            fail("ring", "a ring of slots holds a sliding window: pass window")
        if s < window + t - 1:
            fail("ring", f"{s} slots cannot hold the keys of {t} new tokens with window "
                         f"{window} (needs >= window + T - 1 = {window + t - 1})")
    if rotary_keys_only is not None and not (_checks.is_int(rotary_keys_only)
                                             and 0 <= rotary_keys_only <= d // 2):
        fail("rotary_keys_only", f"must be None or an int in [0, {d // 2}], got "
                                 f"{rotary_keys_only!r}")


def _is_real(x) -> bool:
    if isinstance(x, (bool, str, bytes)):
        return False
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def decode_attention(q, k, v, kv_len, *, scale=None, window=None, ring=False,
                     rotary_keys_only=None):
    """o [B, T, Hq, D] (q's dtype): each row's T new queries over its cache (module
    docstring). ``scale=None`` means 1/sqrt(D) (Gemma 4 uses 1.0)."""
    _check(q, k, v, kv_len, scale, window, ring, rotary_keys_only)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    kwargs = dict(scale=scale, window=window, ring=ring, rotary_keys_only=rotary_keys_only)

    def ref(q, k, v, kv_len):
        return _reference(q, k, v, kv_len, **kwargs)

    if q.shape[0] > MAX_GRID or k.shape[2] > MAX_GRID or k.shape[1] > MAX_SLOTS:
        return ref(q, k, v, kv_len)
    return dispatch(OP, _kernel(kwargs), ref, q, k, v, kv_len, target=TARGET)


def _sms() -> int:
    try:
        return max(int(getattr(d, "core_count", 0) or 0) for d in jax.devices("cuda"))
    except (RuntimeError, ValueError):
        return 0


def pieces(b: int, t: int, hq: int, hkv: int, s: int, window, cache_itemsize: int,
           sms: int) -> int:
    """Key pieces per (row, KV head) of a call: TARGET_CTAS_PER_SM split CTAs per SM over
    B x Hkv x rows blocks, each piece at least max(MIN_PIECE_KEYS, 64 rows / itemsize) of the
    at most min(S, window + T - 1) keys a row's queries can see."""
    rows = t * (hq // hkv)
    row_blocks = -(-rows // (16 if rows <= 16 else 32))
    keys = s if window is None else min(s, window + t - 1)
    min_piece = max(MIN_PIECE_KEYS, 64 * rows // cache_itemsize)
    want = -(-(TARGET_CTAS_PER_SM * sms) // (b * hkv * row_blocks))
    return max(1, min(want, -(-keys // min_piece)))


def _kernel(kwargs):
    def kernel(q, k, v, kv_len):
        b, t, hq, d = q.shape
        s, hkv = k.shape[1], k.shape[2]
        r = kwargs["rotary_keys_only"]
        if r is not None and r % ROTARY_STEP:
            k, r = keys_except_rotary(k, v, r), None
        n = pieces(b, t, hq, hkv, s, kwargs["window"], np.dtype(k.dtype).itemsize,
                   _sms() or DEFAULT_SMS)
        rows = t * (hq // hkv)
        out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                     jax.ShapeDtypeStruct((b, hkv, n, rows, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, n, rows, 2), jnp.float32))
        call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
        return call(q, k, v, kv_len, scale=np.float32(kwargs["scale"]),
                    window=np.int64(kwargs["window"] or 0), ring=bool(kwargs["ring"]),
                    rotary=np.int64(d // 2 if r is None else r), pieces=np.int64(n))[0]
    return kernel
