"""MXFP4 weights: e2m1 values, one e8m0 exponent per 32 values of K, per output channel.

One layout, used by the CUDA kernels (jax_mila.ffi.w4a8_matmul, grouped_w4a8_matmul), the
pure-JAX reference and checkpoints. A weight ``w`` of shape [N, K] (N output channels, K input
features, K % 32 == 0) is stored as an :class:`MXFP4Weight` with three uint8 arrays over its
*stored* K, Kp = K rounded up to a multiple of 128 (``padded_k``; the columns past K are zeros,
which the GEMMs may read: activations of K columns multiply the first K). Expert weights
[E, N, K] are the same arrays with a leading expert dimension.

``scales[n, b]`` (uint8 [N, K/32])
    e8m0 exponent of block b = values k in [32b, 32b + 32) of channel n: the block's scale is
    2**(scales[n, b] - 127) (ml_dtypes.float8_e8m0fnu; 255 = NaN never occurs).
``channel_exp[n]`` (uint8 [N])
    The channel's reference exponent R = max_b scales[n, b]. Invariant (kept by
    :func:`quantize_mxfp4`): every block holding a nonzero value has scale >= R - 11
    (``MAX_BLOCK_EXP_DROP``); see "Blocks far below the channel's largest" below.
``packed[n, 64 G + j]`` (uint8 [N, K/2])
    e2m1 codes (ml_dtypes.float4_e2m1fn bits: sign, 2 exponent bits, 1 mantissa bit; values
    0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the first of each pair in the low nibble, in
    *kernel order*: each group G of 128 values of K (4 blocks, 64 bytes) is a 4 x 4 array of
    little-endian 32-bit words, word (q, b) at byte 16 q + 4 b holding block b's codes of
    k = 4q .. 4q+3 (low 16 bits) and k = 16+4q .. 16+4q+3 (high 16 bits), k counted from the
    block's start. Byte r of a word holds k0 = 4q + 16 (r // 2) + 2 (r % 2) and k0 + 1.
    Why: a word is exactly the 8 values one lane of an m16n8k32 (mma.sync) or m64nNk32 (wgmma)
    FP8 fragment needs from one weight row and block, nibble-packed; and one 16-byte load gives
    a lane its words for all 4 blocks of a 128-wide K tile. ``KERNEL_ORDER`` is the permutation
    (storage position -> k within the group); :func:`unpack_codes` undoes it.

    Sign-swizzled words (format version 2): nibble i of a word (i = 2 r + h: byte r, high
    nibble if h) holds in its bits 0-2 the magnitude bits of the word's code i (the code of the
    k above), but in its bit 3 the sign of code ``SIGN_SOURCE[i]``: nibble 2j + 1 carries code
    j's sign, nibble 2j code 4 + j's. Why: the kernel turns codes 0-3 into the four e4m3 bytes of
    one register and codes 4-7 into another, and there every sign already sits at bit 8j + 7
    (codes 0-3) or 4 bits below it (codes 4-7), where e4m3 keeps its sign bit: 7 instructions
    convert a word instead of 11 (csrc/common/ptx.cuh, e2m1x8_to_e4m3x8). Version 1 kept each
    code's sign in its own nibble; :func:`packed_from_version` converts such bytes.

Value: w[n, k] = e2m1(code[n, k]) * 2**(scales[n, k // 32] - 127).

Quantization (:func:`quantize_mxfp4`) follows the OCP MX v1.0 rule: block scale exponent
floor(log2(amax)) - 2 (2 = emax of e2m1), clamped to [-127, 127]; each value is divided by the
scale (exact: a power of two), rounded to nearest even on the e2m1 grid and saturated to +-6.
All-zero blocks get the smallest allowed exponent. NaN or inf anywhere is an error. Subnormal
inputs (|w| < 2**-126) count as zero (values that small are not weights; XLA flushes them anyway).

Blocks far below the channel's largest: the kernel turns codes into e4m3 by adding the block's
exponent offset d = scale - R (<= 0) to the e4m3 exponent of code * 2**6 (which spans
2**5 .. 1.5 * 2**8, inside e4m3's normal range). That is exact for d >= -11; for smaller d the
e4m3 exponent would leave the normal range. :func:`quantize_mxfp4` therefore raises such a
block's exponent to R - 11 before rounding its values, so the stored weight is always exact on
the kernel. Only values below 2**-14.6 of the channel's largest magnitude are affected (they
round on a grid of 0.5 * 2**(R - 138)); on Gaussian weights of Gemma 4's shapes no block is
affected at all (tests/test_quant_mxfp4.py measures it). Weights that break the invariant
(hand-made ones) are flushed to zero in those blocks by the reference and give unspecified
values on the kernel; :func:`check_kernel_invariant` tests a concrete weight.

K must be a multiple of 32 (BLOCK); it is stored padded with zeros to a multiple of 128
(GROUP), the kernel order's groups.

Memory: 4 bits per value + 8 bits per 32 values = 4.25 bits per value (+ 8 bits per channel).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
E8M0_BIAS = 127
E2M1_MAX = 6.0
E2M1_EMAX = 2  # largest e2m1 exponent: 6 = 1.5 * 2**2
MAX_BLOCK_EXP_DROP = 11  # kernel exactness bound on scales[n, b] - channel_exp[n]

GROUP = 128  # values of K per kernel-order group (4 blocks)
# Storage position t (0..127) of a group holds the code of k = KERNEL_ORDER[t] (k within the
# group): t = 32 q + 8 b + 2 r + h (word q of block b, byte r, nibble h) ->
# k = 32 b + 4 q + 16 (r // 2) + 2 (r % 2) + h.
KERNEL_ORDER = np.array([32 * b + 4 * q + 16 * (r // 2) + 2 * (r % 2) + h
                         for q in range(4) for b in range(4) for r in range(4) for h in range(2)],
                        dtype=np.int32)
_INVERSE_ORDER = np.argsort(KERNEL_ORDER).astype(np.int32)
# Format version 2: bit 3 of nibble i of a word holds the sign of the word's code SIGN_SOURCE[i].
SIGN_SOURCE = np.array([4, 0, 5, 1, 6, 2, 7, 3], dtype=np.int32)
_SIGN_HOLDER = np.argsort(SIGN_SOURCE).astype(np.int32)  # code c's sign is in nibble _SIGN_HOLDER[c]
FORMAT_VERSION = 2  # of the packed bytes; checkpoints record it (jax_mila/gemma4/mxfp4_names.py)

# e2m1 code (0..15) -> value.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4-quantized [N, K] weight (layout in the module docstring). A pytree of three
    uint8 arrays, so it can be a jit argument, live in Flax NNX modules and be donated."""

    packed: jax.Array  # uint8 [..., N, Kp // 2], codes in kernel order
    scales: jax.Array  # uint8 [..., N, Kp // 32], e8m0 block exponents
    channel_exp: jax.Array  # uint8 [..., N], max over blocks of scales

    @property
    def shape(self) -> tuple[int, ...]:
        """(..., N, Kp): the stored shape (Kp = padded_k(K) of the weight it represents)."""
        return tuple(self.packed.shape[:-1]) + (self.packed.shape[-1] * 2,)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) for a in (self.packed, self.scales, self.channel_exp))

    def validate(self, name: str = "w", *, rank: int | None = None) -> None:
        """Checks dtypes and shapes (not values); raises ValueError naming `name`. ``rank``:
        the rank of the weight it must represent (2: [N, K]; 3: experts [E, N, K])."""
        n2 = self.packed.shape
        for field, arr in (("packed", self.packed), ("scales", self.scales),
                           ("channel_exp", self.channel_exp)):
            if np.dtype(arr.dtype) != np.uint8:
                raise ValueError(f"{name}.{field}: dtype {np.dtype(arr.dtype).name} must be uint8")
        if len(n2) < 2 or (n2[-1] * 2) % GROUP or (rank is not None and len(n2) != rank):
            want = "[N, Kp/2]" if rank in (None, 2) else f"rank {rank} [..., N, Kp/2]"
            raise ValueError(f"{name}.packed: expected {want} with Kp % {GROUP} == 0, "
                             f"got shape {list(n2)}")
        *lead, n, k = self.shape
        if tuple(self.scales.shape) != (*lead, n, k // BLOCK):
            raise ValueError(f"{name}.scales: expected shape {[*lead, n, k // BLOCK]} for a "
                             f"{[*lead, n, k]} weight, got {list(self.scales.shape)}")
        if tuple(self.channel_exp.shape) != (*lead, n):
            raise ValueError(f"{name}.channel_exp: expected shape {[*lead, n]}, got "
                             f"{list(self.channel_exp.shape)}")


def padded_k(k: int) -> int:
    """The stored K of a weight with K input features: K rounded up to a multiple of GROUP."""
    return -(-int(k) // GROUP) * GROUP


def _round_to_e2m1_codes(v):
    """float32 values (already divided by the block scale) -> e2m1 codes (uint8 0..15), round
    to nearest even on the e2m1 grid, saturating to +-6. Sign of -0 and of negative values that
    round to zero is kept (as ml_dtypes does)."""
    a = jnp.abs(v)
    # Each threshold passed moves one code up; '>' at ties whose lower neighbour has the even
    # code (0.25, 1.25, 2.5, 5), '>=' where the upper one does (0.75, 1.75, 3.5).
    mag = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0)).astype(jnp.uint8)
    sign = jnp.signbit(v).astype(jnp.uint8) << 3
    return mag | sign


def _block_exponents(w32):
    """[N, K] float32 -> (unbiased block exponent int32 [N, K/32], channel R int32 [N])."""
    n, k = w32.shape
    amax = jnp.max(jnp.abs(w32.reshape(n, k // BLOCK, BLOCK)), axis=-1)
    # floor(log2(amax)) exactly, from the float32 bits (frexp: amax = f * 2**e, f in [0.5, 1)).
    _, e = jnp.frexp(amax)
    exp = jnp.where(amax > 0, e - 1 - E2M1_EMAX, -E8M0_BIAS)
    exp = jnp.clip(exp, -E8M0_BIAS, E8M0_BIAS).astype(jnp.int32)
    ref = jnp.max(exp, axis=-1)
    exp = jnp.maximum(exp, jnp.maximum(ref[:, None] - MAX_BLOCK_EXP_DROP, -E8M0_BIAS))
    return exp, ref


@jax.jit
def _quantize_core(w):
    *lead, n, k = w.shape
    w32 = w.astype(jnp.float32).reshape(-1, k)
    # Subnormal inputs flush to zero explicitly, so the result does not depend on whether the
    # backend flushes denormals (XLA on CPU and GPU does).
    w32 = jnp.where(jnp.abs(w32) < jnp.float32(2.0**-126), jnp.float32(0.0), w32)
    nonfinite = jnp.logical_not(jnp.all(jnp.isfinite(w32)))
    w32 = jnp.pad(w32, ((0, 0), (0, padded_k(k) - k)))  # stored K: zeros past K
    n, k = w32.shape
    exp, ref = _block_exponents(w32)
    v = jnp.ldexp(w32.reshape(n, k // BLOCK, BLOCK), -exp[..., None])
    codes = _round_to_e2m1_codes(v).reshape(n, k // GROUP, GROUP)  # natural k order
    packed = _pack_words(codes[..., KERNEL_ORDER].reshape(n, k // 8, 8))
    scales = (exp + E8M0_BIAS).astype(jnp.uint8)
    channel_exp = (ref + E8M0_BIAS).astype(jnp.uint8)
    rows = (*lead, -1)
    return MXFP4Weight(packed.reshape(*rows, packed.shape[-1]), scales.reshape(*rows, k // BLOCK),
                       channel_exp.reshape(rows)), nonfinite


def quantize_mxfp4(w, *, name: str = "weight", check_finite: bool = True) -> MXFP4Weight:
    """Quantizes a bfloat16/float16/float32 weight ``w`` of shape [N, K] (K % 32 == 0: whole
    MXFP4 blocks; N output channels, K the contraction dim, i.e. the transpose of a Flax
    [in, out] kernel), or a stack of them [..., N, K] (experts), to MXFP4, stored over
    Kp = padded_k(K) (zeros past K).

    NaN or inf in ``w`` raises ValueError naming ``name``. That check reads the values, so it
    needs a concrete array; inside jit pass ``check_finite=False`` (non-finite inputs then give
    unspecified codes).
    """
    if np.dtype(w.dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16),
                                 np.dtype(jnp.float32)):
        raise ValueError(f"quantize_mxfp4: {name}: dtype {np.dtype(w.dtype).name} is not supported "
                         "(supported: bfloat16, float16, float32)")
    if len(w.shape) < 2 or w.shape[-1] % BLOCK or 0 in w.shape:
        raise ValueError(f"quantize_mxfp4: {name}: expected a non-empty [..., N, K] weight with "
                         f"K % {BLOCK} == 0, got shape {list(w.shape)}")
    if check_finite and isinstance(w, jax.core.Tracer):
        raise ValueError(f"quantize_mxfp4: {name}: the NaN/inf check needs a concrete array; "
                         "call it outside jit or pass check_finite=False")
    q, nonfinite = _quantize_core(w)
    if check_finite and bool(nonfinite):
        bad = np.argwhere(~np.isfinite(np.asarray(w, np.float32)))
        raise ValueError(f"quantize_mxfp4: {name}: contains {len(bad)} NaN/inf value(s), first at "
                         f"index {tuple(int(i) for i in bad[0])}; refusing to quantize")
    return q


def _pack_words(codes):
    """e2m1 codes uint8 [..., words, 8] (code i of each word in storage order) -> the packed
    bytes [..., words * 4] of format version 2 (signs swizzled within each word)."""
    nibbles = (codes & 7) | (codes[..., SIGN_SOURCE] & 8)
    pairs = nibbles.reshape(*nibbles.shape[:-1], 4, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(*codes.shape[:-2], -1)


def _word_nibbles(packed):
    """Packed bytes [..., words * 4] -> their nibbles [..., words, 8], low nibble first."""
    return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1, 8)


def _unpack_words(packed):
    """The inverse of _pack_words: packed bytes [..., words * 4] -> codes [..., words, 8]."""
    nibbles = _word_nibbles(packed)
    return (nibbles & 7) | (nibbles[..., _SIGN_HOLDER] & 8)


def packed_from_version(packed, version: int):
    """Packed bytes [..., N, Kp/2] written in format ``version`` (1 or 2) -> format
    FORMAT_VERSION. Version 1 kept each code's sign in its own nibble."""
    if version == FORMAT_VERSION:
        return packed
    if version != 1:
        raise ValueError(f"MXFP4 packed bytes of format version {version!r} are not supported "
                         f"(supported: 1, {FORMAT_VERSION})")
    return _pack_words(_word_nibbles(jnp.asarray(packed)))  # v1 nibbles are whole codes


def unpack_codes(w: MXFP4Weight):
    """e2m1 codes uint8 [..., N, Kp] in natural k order."""
    *lead, n, k = w.shape
    stored = _unpack_words(w.packed).reshape(*lead, n, k // GROUP, GROUP)
    return stored[..., _INVERSE_ORDER].reshape(*lead, n, k)


def dequantize_mxfp4(w: MXFP4Weight, dtype=jnp.float32, *, k: int | None = None,
                     kernel_semantics: bool = False):
    """[..., N, K] values code * 2**(scale - 127) in ``dtype`` (exact in float32): the first
    ``k`` columns (default: all Kp stored ones).

    With ``kernel_semantics=True``, blocks whose exponent is more than MAX_BLOCK_EXP_DROP below
    the channel's (never produced by quantize_mxfp4) read as zero, as the reference GEMM defines.
    """
    *lead, n, kp = w.shape
    vals = jnp.asarray(E2M1_VALUES)[unpack_codes(w).astype(jnp.int32)]
    vals = vals.reshape(*lead, n, kp // BLOCK, BLOCK)
    exp = w.scales.astype(jnp.int32) - E8M0_BIAS
    if kernel_semantics:
        floor = w.channel_exp.astype(jnp.int32)[..., None] - MAX_BLOCK_EXP_DROP
        keep = w.scales.astype(jnp.int32) >= floor
        vals = jnp.where(keep[..., None], vals, 0.0)
    out = jnp.ldexp(vals, exp[..., None]).reshape(*lead, n, kp).astype(dtype)
    return out if k is None else out[..., :k]


def check_kernel_invariant(w: MXFP4Weight) -> bool:
    """True when every nonzero block of a concrete weight is within MAX_BLOCK_EXP_DROP
    exponents of its channel's reference exponent and channel_exp is the max block exponent."""
    *lead, n, k = w.shape
    codes = np.asarray(unpack_codes(w)).reshape(-1, k // BLOCK, BLOCK)
    nonzero = np.any((codes & 7) != 0, axis=-1)
    s = np.asarray(w.scales).astype(np.int32).reshape(-1, k // BLOCK)
    r = np.asarray(w.channel_exp).astype(np.int32).reshape(-1)
    return bool(np.all(r == s.max(axis=1)) and
                np.all(~nonzero | (s >= r[:, None] - MAX_BLOCK_EXP_DROP)))
