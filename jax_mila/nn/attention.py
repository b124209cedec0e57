"""Attention: the dot-product attention core (no projections), backend fixed at construction.

Contract (that of jax_mila.ffi.flash_attention): q [B, T, Hq, D], k and v [B, S, Hkv, D];
query i sits at position q_offset + i, key j at kv_offset + j (or, with a vector kv_offset of
N segment starts, key n S/N + j at kv_offset[n] + j; kernels for head dim 512); causal
masking hides keys after the query; a window W also hides keys with q_pos - k_pos >= W (so
each query sees itself and the W - 1 previous tokens, exactly HF's ``kv_idx > q_idx -
sliding_window``).

Backends:
- "reference": always jax_mila.reference.flash_attention (float32 math from the inputs).
- "mila" / "auto": jax_mila.ffi.flash_attention, which runs the CUDA kernel where it is built
  and the reference elsewhere. The kernels exist only for bf16 and head dims 256 / 512, so any
  other call (tiny test configs, float32 models) falls back to the reference, logging why
  once per reason (jax_mila.ffi._registry.log_fallback).

``Attention.decode`` is the decode steps' attention over a KV cache (per-row lengths, a
sliding ring read in place, an FP8 cache read as stored): jax_mila.ffi.decode_attention or
jax_mila.reference.decode_attention, picked the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila import ffi, reference
from jax_mila.ffi import _checks
from jax_mila.ffi import attention as ffi_attention
# (jax_mila.ffi's decode_attention is the op; its module's constants are imported by name)
from jax_mila.ffi.decode_attention import CACHE_DTYPES as DECODE_CACHE_DTYPES
from jax_mila.ffi.decode_attention import HEAD_DIMS as DECODE_HEAD_DIMS
from jax_mila.ffi.decode_attention import MAX_GROUPS as DECODE_MAX_GROUPS
from jax_mila.ffi.decode_attention import MAX_NEW_TOKENS as DECODE_MAX_NEW_TOKENS
from jax_mila.ffi.decode_attention import OP as DECODE_OP
from jax_mila.ffi._checks import is_int
from jax_mila.ffi._registry import log_fallback
from jax_mila.nn.backend import check_backend

KERNEL_HEAD_DIMS = ffi_attention.HEAD_DIMS
KERNEL_DTYPES = (jnp.bfloat16,)
KERNEL_MAX_GROUPS = ffi_attention.MAX_GROUPS


def kernel_unsupported_reason(q: jax.Array, k: jax.Array, v: jax.Array,
                              kv_segments: int = 1) -> str | None:
    """Why jax_mila.ffi.flash_attention cannot take this call, or None. The reasons name the
    configuration (head dim, dtype, head grouping, window), never the sequence length, so a
    model logs each once, not once per prompt length. Everything the ffi wrapper rejects with
    a ValueError for a call that passed ffi_attention.check_arguments is caught here first."""
    d = q.shape[-1]
    if d not in KERNEL_HEAD_DIMS:
        return f"head_dim={d} (the kernels take head_dim in {KERNEL_HEAD_DIMS})"
    dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if any(jnp.dtype(x.dtype) not in KERNEL_DTYPES for x in (q, k, v)):
        return f"dtype {'/'.join(sorted(dtypes))} (the kernels take bfloat16 q, k and v)"
    if k.shape[-1] != d or v.shape != k.shape:
        return (f"k/v head_dim {k.shape[-1]}/{v.shape[-1]} differ from q's {d} (the kernels "
                "need one head_dim and k, v of one shape)")
    hq, hkv = q.shape[2], k.shape[2]
    if hq // hkv > KERNEL_MAX_GROUPS:
        return (f"{hq} query heads over {hkv} KV heads (the kernels take at most "
                f"{KERNEL_MAX_GROUPS} per KV head)")
    if kv_segments > 1 and d != 512:
        return f"{kv_segments} key segments at head_dim={d} (segmented keys: head_dim 512 only)"
    return None


def decode_kernel_unsupported_reason(q: jax.Array, k: jax.Array, v: jax.Array) -> str | None:
    """Why jax_mila.ffi.decode_attention cannot take this decode call (one that passed
    check_decode_arguments), or None; the reasons name the configuration, never a length."""
    d = q.shape[-1]
    if d not in DECODE_HEAD_DIMS:
        return f"head_dim={d} (the kernel takes head_dim in {DECODE_HEAD_DIMS})"
    if jnp.dtype(q.dtype) != jnp.dtype(jnp.bfloat16):
        return f"q dtype {jnp.dtype(q.dtype).name} (the kernel takes bfloat16 q)"
    names = tuple(jnp.dtype(t).name for t in DECODE_CACHE_DTYPES)
    if jnp.dtype(k.dtype).name not in names or k.dtype != v.dtype:
        return (f"cache dtype {jnp.dtype(k.dtype).name}/{jnp.dtype(v.dtype).name} (the kernel "
                f"takes k and v of one dtype in {names})")
    if q.shape[1] > DECODE_MAX_NEW_TOKENS:
        return f"more than {DECODE_MAX_NEW_TOKENS} new tokens per row"
    if q.shape[2] // k.shape[2] > DECODE_MAX_GROUPS:
        return (f"{q.shape[2]} query heads over {k.shape[2]} KV heads (the kernel takes at most "
                f"{DECODE_MAX_GROUPS} per KV head)")
    return None


def check_decode_arguments(op: str, q, k, v, kv_len, scale, window, ring: bool,
                           rotary_keys_only) -> None:
    """The checks of the decode_attention contract that every backend needs (the reference
    would compute something else without them): flash_attention's shape, scale and window
    checks, kv_len [B] of integers, and a ring with a window and at least W + T - 1 slots (else
    a query's keys were overwritten by newer ones)."""
    ffi_attention.check_arguments(op, q, k, v, scale, True, window, 0, 0, rotary_keys_only)
    b, t = q.shape[:2]
    if np.shape(kv_len) != (b,) or not jnp.issubdtype(jnp.result_type(kv_len), jnp.integer):
        _checks.fail(op, "kv_len", f"must be integer [B] = [{b}] (one length per row), got "
                                   f"{jnp.result_type(kv_len)} of shape {list(np.shape(kv_len))}")
    if not isinstance(ring, bool):
        _checks.fail(op, "ring", f"must be a bool, got {ring!r}")
    if ring and window is None:
        _checks.fail(op, "ring", "a ring of slots holds a sliding window: pass window")
    if ring and k.shape[1] < window + t - 1:
        _checks.fail(op, "ring", f"{k.shape[1]} slots cannot hold the keys of {t} new tokens "
                                 f"with window {window} (needs >= window + T - 1 = "
                                 f"{window + t - 1})")


class Attention(nnx.Module):
    """Causal (optionally sliding-window) attention with a fixed ``scale`` (Gemma 4: 1.0).

    ``rotary_keys_only=r`` (None: off): the scores read k only in the columns RoPE rotates,
    [0:r] and [D/2 : D/2 + r] of the half-split layout, and v in every other column
    (jax_mila.reference.keys_except_rotary); the values are v as usual. Exact for Gemma 4's
    K=V layers once k_norm's weight is folded into q outside those columns
    (jax_mila/gemma4/attention.py); on Hopper at D=512, r=64 the kernel then loads V and only
    K's rotated blocks (jax_mila/ffi/attention.py). Passed to the kernel path and to the
    reference alike.
    """

    def __init__(self, *, scale: float | None, backend: str = "auto",
                 rotary_keys_only: int | None = None):
        if rotary_keys_only is not None and (not is_int(rotary_keys_only)
                                             or rotary_keys_only < 0):
            raise ValueError(f"nn.Attention: rotary_keys_only must be None or an int >= 0, got "
                             f"{rotary_keys_only!r}")
        self.scale = scale
        self.backend = check_backend(backend)
        self.rotary_keys_only = None if rotary_keys_only is None else int(rotary_keys_only)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                 q_offset=0, kv_offset=0, return_lse: bool = False):
        """o [B, T, Hq, D]; with return_lse=True also the float32 log-sum-exp [B, Hq, T] (what
        context parallelism merges partial results with, jax_mila/parallel/context.py)."""
        # The checks of jax_mila.ffi.flash_attention that hold for every backend: a window of
        # 0 would hide every key (zeros out), a head count not a multiple of the KV heads
        # would fail deep inside the reference's reshape.
        ffi_attention.check_arguments("nn.Attention", q, k, v, self.scale, True, window,
                                      q_offset, kv_offset, self.rotary_keys_only)
        kwargs = dict(scale=self.scale, causal=True, window=window, q_offset=q_offset,
                      kv_offset=kv_offset)
        if return_lse:
            kwargs["return_lse"] = True
        if self.rotary_keys_only is not None:
            kwargs["rotary_keys_only"] = self.rotary_keys_only
        if self.backend != "reference":
            reason = kernel_unsupported_reason(q, k, v, kv_segments=int(np.size(kv_offset)))
            if reason is None:
                # The ffi layer logs its own fallbacks (no GPU, kernel not built or disabled,
                # D=512 on a GPU without the shared memory).
                return ffi.flash_attention(q, k, v, **kwargs)
            log_fallback(ffi_attention.OP, reason)
        return reference.flash_attention(q, k, v, **kwargs)

    def decode(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array, *,
               window: int | None = None, ring: bool = False) -> jax.Array:
        """o [B, T, Hq, D]: each row's T newest queries (already in the cache) over its cache
        k, v [B, S, Hkv, D] (the model's dtype or float8_e4m3fn, read as it is stored), row b
        holding kv_len[b] tokens; ``ring``: the slots are a sliding window's ring, read in
        place (the contract of jax_mila.ffi.decode_attention).

        As __call__ picks flash_attention: "reference" runs jax_mila.reference.decode_attention;
        "mila" / "auto" jax_mila.ffi.decode_attention (its kernel where built, else its
        reference) where the kernel takes the call, else the reference, logging why once per
        configuration. ``rotary_keys_only`` applies as in __call__."""
        op = "nn.Attention.decode"
        check_decode_arguments(op, q, k, v, kv_len, self.scale, window, ring,
                               self.rotary_keys_only)
        kv_len = jnp.asarray(kv_len, jnp.int32)
        kwargs = dict(scale=self.scale, window=window, ring=ring,
                      rotary_keys_only=self.rotary_keys_only)
        if self.backend != "reference":
            reason = decode_kernel_unsupported_reason(q, k, v)
            if reason is None:
                return ffi.decode_attention(q, k, v, kv_len, **kwargs)
            log_fallback(DECODE_OP, reason)
        return reference.decode_attention(q, k, v, kv_len, **kwargs)
