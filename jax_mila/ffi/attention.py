"""flash_attention: causal / sliding-window prefill attention for head dims 256 and 512.

q [B, T, Hq, D], k and v [B, S, Hkv, D] (bf16); query head n reads KV head n // (Hq // Hkv).
Query i sits at position q_offset + i and key j at kv_offset + j; the offsets may be traced
int32 scalars, so chunked prefill does not recompile. Head dim 512 also takes a vector
kv_offset of N segment starts (N dividing S): the keys are N segments of L = S / N slots, slot
n L + j at position kv_offset[n] + j (a device's share of a position-sharded cache, attended in
one call: jax_mila/parallel/chunked.py). With causal=True a key is visible when
its position is not after the query's; a window W (requires causal) also asks
q_pos - k_pos < W. Rows with no visible key return zeros (lse -inf).
With rotary_keys_only=r the scores read k only in the columns RoPE rotates ([0:r] and
[D/2 : D/2 + r]) and v in all others (Gemma 4's K=V layers: reference.keys_except_rotary).
Limits, checked at trace time and again in the handlers: B and Hkv up to 65535 (grid
dimensions; a vmap that would fold more into B runs one call per element instead), scale
finite in float32, offsets and window within int32, and for the mma.sync D=256 kernel T up
to 4,194,240 queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import reference
from jax_mila.ffi import _checks
from jax_mila.ffi._registry import _registered_targets, cuda_capabilities, dispatch

OP = "flash_attention"
HEAD_DIMS = (256, 512)
MAX_GROUPS = 16
# The D=512 kernel keeps a 64 x 512 Q tile resident beside its K and V tiles: it needs the
# 160+ KB of shared memory per block of sm_80 and sm_90 (sm_86/sm_89 offer 99 KB).
D512_CAPABILITIES = ((8, 0), (9, 0))
# Hopper (wgmma + TMA) kernels, csrc/flash512_sm90/ and csrc/flash256_sm90/: they run a call
# when built (every build whose architectures include 90a), every GPU has compute capability 9.0
# and Hq / Hkv divides 64 (the D=512 kernel's M tile; a D=256 consumer's rows); otherwise the
# mma.sync kernel, which stays the portable path and the oracle.
D512_SM90_TARGET = "jax_mila_flash_attention_d512_sm90"
# The Hopper D=512 kernel with rotary_keys_only=64 (Gemma 4's proportional RoPE at D=512): it
# loads V and only K's two rotated 64-column blocks, 80 instead of 128 KB per 64-key tile. Other
# calls with rotary_keys_only pass the substituted keys to the plain targets.
D512_SM90_ROTARY_KEYS_TARGET = "jax_mila_flash_attention_d512_sm90_rotary_keys"
D512_SM90_ROTARY_PAIRS = 64
D256_SM90_TARGET = "jax_mila_flash_attention_d256_sm90"
# CUDA grid limits: B and Hkv are grid y/z dimensions of some kernels; the mma.sync D=256
# kernel puts its blocks of 64 (sm_86/sm_89) or 128 query rows in grid y.
MAX_BATCH = 65535
MAX_KV_HEADS = 65535
D256_MAX_QUERIES = 65535 * 64
# Head dim -> its Hopper target. Tests and the sanitizer hold the mma.sync kernel of a head dim
# to the whole contract on Hopper too by mapping it to None (mock.patch.dict); not a user knob.
_SM90_TARGETS = {512: D512_SM90_TARGET, 256: D256_SM90_TARGET}


def _target(q, k) -> str:
    """The FFI target a call with these q, k shapes runs (see above)."""
    d = q.shape[-1]
    sm90 = _SM90_TARGETS.get(d)
    if (sm90 is not None
            and sm90 in _registered_targets()
            and cuda_capabilities() and all(cc == (9, 0) for cc in cuda_capabilities())
            and 64 % (q.shape[2] // k.shape[2]) == 0):
        return sm90
    return f"jax_mila_flash_attention_d{d}"


def _route(q, k, v, rotary_keys_only):
    """(target, k, rotary_keys_only) of a call: the rotary-keys kernel takes r = 64 where the
    Hopper D=512 kernel runs; every other call gets the substituted keys and r = None."""
    target = _target(q, k)
    if rotary_keys_only is None:
        return target, k, None
    if target == D512_SM90_TARGET and rotary_keys_only == D512_SM90_ROTARY_PAIRS:
        return D512_SM90_ROTARY_KEYS_TARGET, k, rotary_keys_only
    return target, reference.keys_except_rotary(k, v, rotary_keys_only), None


def check_arguments(op, q, k, v, scale, causal, window, q_offset, kv_offset,
                    rotary_keys_only) -> None:
    """The checks every attention of this contract needs, kernel or reference (nn.Attention
    runs them too): q [B, T, Hq, D], k and v [B, S, Hkv, D] of one shape, Hq a multiple of Hkv,
    scale, window, integer offsets within int32, segment starts dividing S, rotary_keys_only.
    ValueError naming ``op`` and the argument."""
    for name, x, layout in (("q", q, "[B, T, Hq, D]"), ("k", k, "[B, S, Hkv, D]"),
                            ("v", v, "[B, S, Hkv, D]")):
        _checks.check_rank(op, name, x, rank=4, layout=layout)
    d = q.shape[-1]
    if k.shape != v.shape:
        _checks.fail(op, "v", f"shape {list(v.shape)} must equal k's {list(k.shape)}")
    if k.shape[-1] != d:
        _checks.fail(op, "k", f"head_dim={k.shape[-1]} must equal q's {d}")
    if k.shape[0] != q.shape[0]:
        _checks.fail(op, "k", f"batch {k.shape[0]} must equal q's {q.shape[0]}")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv < 1 or hq % hkv:
        _checks.fail(op, "k", f"Hq={hq} query heads over Hkv={hkv} KV heads is not supported "
                              f"(Hq must be a multiple of Hkv)")
    if scale is not None and (isinstance(scale, (bool, str, bytes)) or not _is_real(scale)
                              or not _checks.finite_in_float32(float(scale))):
        _checks.fail(op, "scale", f"must be None or a number that float32 holds (the kernels' "
                                  f"type, finite), got {scale!r}")
    if window is not None:
        if not _checks.is_int(window) or not 1 <= window <= np.iinfo(np.int32).max:
            _checks.fail(op, "window", f"must be None or an int in [1, 2^31 - 1], got {window!r}")
        if not causal:
            _checks.fail(op, "window", "a sliding window needs causal=True")
    for name, off in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        shape = np.shape(off)
        dtype = np.result_type(off) if not hasattr(off, "dtype") else np.dtype(off.dtype)
        if not np.issubdtype(dtype, np.integer) or (name == "q_offset" and shape != ()):
            _checks.fail(op, name, f"must be an integer scalar, got {dtype} of shape {shape}")
        # The kernels take int32 positions: a concrete value must fit (jnp.asarray(..., int32)
        # would wrap it); a traced one is converted as it is.
        try:
            values = np.asarray(off)
        except jax.errors.TracerArrayConversionError:
            continue
        for value in values.reshape(-1):
            _checks.int32_value(op, name, value)
    segments = np.shape(kv_offset)  # () or (N,): N segment starts
    if segments != () and (len(segments) != 1 or segments[0] < 1 or k.shape[1] % segments[0]):
        _checks.fail(op, "kv_offset", f"must be an integer scalar or a vector of N segment "
                                      f"starts with N dividing S={k.shape[1]}; got shape "
                                      f"{segments}")
    r = rotary_keys_only
    if r is not None and (not _checks.is_int(r) or not 0 <= r <= d // 2):
        _checks.fail(op, "rotary_keys_only", f"must be None or an int in [0, D/2 = {d // 2}] "
                                             f"(rotated pairs of the half-split RoPE), got {r!r}")


def _validate(q, k, v, scale, causal, window, q_offset, kv_offset, rotary_keys_only) -> None:
    """check_arguments, and what the kernels add: bf16, non-empty, head dims 256 / 512, grid
    and int32 limits, at most MAX_GROUPS query heads per KV head, segments at D=512 only."""
    for name, x, layout in (("q", q, "[B, T, Hq, D]"), ("k", k, "[B, S, Hkv, D]"),
                            ("v", v, "[B, S, Hkv, D]")):
        _checks.check_rank(OP, name, x, rank=4, layout=layout)
        _checks.check_dtype(OP, name, x, [jnp.bfloat16])
        _checks.check_nonempty(OP, name, x)
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        _checks.fail(OP, "q", f"head_dim={d} is not supported (supported: {HEAD_DIMS}); "
                              f"got q{list(q.shape)}")
    check_arguments(OP, q, k, v, scale, causal, window, q_offset, kv_offset, rotary_keys_only)
    hq, hkv = q.shape[2], k.shape[2]
    if q.shape[0] > MAX_BATCH:
        _checks.fail(OP, "q", f"batch {q.shape[0]} is not supported (at most {MAX_BATCH})")
    if hkv > MAX_KV_HEADS:
        _checks.fail(OP, "k", f"Hkv={hkv} KV heads are not supported (at most {MAX_KV_HEADS})")
    if hq // hkv > MAX_GROUPS:
        _checks.fail(OP, "k", f"Hq={hq} query heads over Hkv={hkv} KV heads is not supported "
                              f"(Hq must be a multiple of Hkv, at most {MAX_GROUPS} per KV head)")
    if q.shape[1] * (hq // hkv) > np.iinfo(np.int32).max:
        _checks.fail(OP, "q", f"T * Hq / Hkv = {q.shape[1] * (hq // hkv)} packed rows per KV head "
                              f"exceed the kernels' int32 row index; got q{list(q.shape)}")
    segments = np.shape(kv_offset)
    if segments != () and segments[0] > 1 and d != 512:
        _checks.fail(OP, "kv_offset", f"segmented keys ({segments[0]} segment starts) are "
                                      f"supported for head dim 512 only; got head dim {d}")


def _is_real(x) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def _make_call(target, scale, causal, window, rotary_keys_only=None):
    def kernel(q, k, v, q_offset, kv_offset):
        b, t, hq, _ = q.shape
        if target == "jax_mila_flash_attention_d256" and t > D256_MAX_QUERIES:
            _checks.fail(OP, "q", f"T={t} queries are more than the mma.sync D=256 kernel takes "
                                  f"(at most {D256_MAX_QUERIES}); got q{list(q.shape)}")
        out_types = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                     jax.ShapeDtypeStruct((b, hq, t), jnp.float32))
        call = jax.ffi.ffi_call(target, out_types, vmap_method="sequential")
        return call(q, k, v, q_offset, kv_offset, scale=np.float32(scale), causal=bool(causal),
                    window=np.int64(window or 0))

    def ref(q, k, v, q_offset, kv_offset):
        return reference.flash_attention(q, k, v, scale=scale, causal=causal, window=window,
                                         q_offset=q_offset, kv_offset=kv_offset, return_lse=True,
                                         rotary_keys_only=rotary_keys_only)

    device_ok = None
    if target.endswith("d512"):
        device_ok = lambda cc: cc in D512_CAPABILITIES  # noqa: E731
    elif target in (D512_SM90_TARGET, D512_SM90_ROTARY_KEYS_TARGET, D256_SM90_TARGET):
        device_ok = lambda cc: cc == (9, 0)  # noqa: E731
    requirement = ("the D=512 kernel needs >= 160 KB of shared memory per block (sm_80, sm_90)"
                   if target != D256_SM90_TARGET else "the wgmma D=256 kernel runs on sm_90 only")

    @jax.custom_batching.custom_vmap
    def call(q, k, v, q_offset, kv_offset):
        return dispatch(OP, kernel, ref, q, k, v, q_offset, kv_offset, target=target,
                        device_ok=device_ok,
                        device_requirement=requirement)

    @call.def_vmap
    def _batched(axis_size, in_batched, q, k, v, q_offset, kv_offset):
        # A vmapped axis over q/k/v with shared offsets is more batch: fold it into B, unless
        # the folded batch would pass the kernels' limit (then one call per mapped element).
        batch = q.shape[1] if in_batched[0] else q.shape[0]  # mapped axes come first
        if in_batched[3] or in_batched[4] or axis_size * batch > MAX_BATCH:
            out = jax.lax.map(lambda a: call(*a), tuple(
                x if bat else jnp.broadcast_to(x, (axis_size,) + x.shape)
                for x, bat in zip((q, k, v, q_offset, kv_offset), in_batched)))
            return out, (True, True)
        q, k, v = (x if bat else jnp.broadcast_to(x, (axis_size,) + x.shape)
                   for x, bat in zip((q, k, v), in_batched[:3]))
        fold = lambda x: x.reshape((-1,) + x.shape[2:])
        o, lse = call(fold(q), fold(k), fold(v), q_offset, kv_offset)
        return (o.reshape((axis_size, -1) + o.shape[1:]),
                lse.reshape((axis_size, -1) + lse.shape[1:])), (True, True)

    return call


def flash_attention(q, k, v, *, scale=None, causal=False, window=None, q_offset=0, kv_offset=0,
                    return_lse=False, rotary_keys_only=None):
    """Attention of bf16 q over k, v with causal / sliding-window masking and position offsets.

    Returns o [B, T, Hq, D] (bf16), and with return_lse=True also the float32 log-sum-exp of
    the scaled scores, [B, Hq, T]. ``scale=None`` means 1/sqrt(D) (Gemma 4 uses 1.0).
    ``rotary_keys_only=r``: the scores read k only in the r rotated pairs of columns ([0:r] and
    [D/2 : D/2 + r]) and v elsewhere; Gemma 4's K=V layers pass r = 64 with k_norm's weight
    folded into q outside those columns (jax_mila/gemma4/attention.py).
    """
    _validate(q, k, v, scale, causal, window, q_offset, kv_offset, rotary_keys_only)
    d = q.shape[-1]
    scale = float(d**-0.5 if scale is None else scale)
    target, k, rotary_keys_only = _route(q, k, v, rotary_keys_only)
    call = _make_call(target, scale, bool(causal), window, rotary_keys_only)
    o, lse = call(q, k, v, jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32))
    return (o, lse) if return_lse else o
