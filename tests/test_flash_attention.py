"""Tests of jax_mila.ffi.flash_attention (head dims 256 and 512).

The oracle here is written independently of jax_mila.reference: plain float32 einsum /
softmax over key heads expanded with jnp.repeat, masks built from explicit positions, run
with precision=HIGHEST (no TF32). Error criterion for the bf16 output:

    max|o - oracle| <= 2 * max|xla_bf16 - oracle| + FLOOR * max(1, max|oracle|)

where xla_bf16 is jax.nn.dot_product_attention(implementation="xla") on the same bf16
inputs (bf16 output, probabilities rounded to bf16) and FLOOR = 2**-8 (one bf16 ulp at the
output's scale): it only matters when the XLA path happens to be exact (e.g. S = 1).
The log-sum-exp is checked against the oracle's to within
    LSE_ATOL + LSE_RTOL_DOT * scale * D * max|q| * max|k|
(float32 accumulation of the D-term dot products bounds how far two summation orders may
differ; the second term is ~3e-3 for unit-normal inputs at D=256 and grows with the x8 case).

Selectors (pytest -k): "d256" / "d512" pick a head dim (class and test names carry it),
"D256GpuTest" / "D512GpuTest" the GPU class alone, "small" the tiny GPU cases meant for
compute-sanitizer runs (e.g. -k "D256GpuTest and small"), "Cpu" the CPU tests.
Inputs are drawn from a fresh seed each run; the seed is printed in every failure message.
On the GPU, XLA_FLAGS=--xla_gpu_autotune_level=0 keeps the oracle/XLA compiles short (the
D256 GPU class ran in ~55 s on an H200 before a redundant GQA test was dropped, most of
it compiling).
"""

from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi
from jax_mila.ffi import attention
from jax_mila.ffi._registry import _registered_targets
import testing  # tests/testing.py

FLOOR = 2.0**-8
LSE_ATOL = 1e-3
LSE_RTOL_DOT = 2e-5
CPU = jax.devices("cpu")[0]


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# ---------------------------------------------------------------------------------------------
# Independent float32 oracle and the bf16 XLA baseline.


def _positions(t, s, q_offset, kv_offset):
    """Query and key positions; a vector kv_offset holds the starts of equal key segments."""
    qp = jnp.asarray(q_offset, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
    starts = jnp.asarray(kv_offset, jnp.int32).reshape(-1, 1)  # [N, 1]
    kp = (starts + jnp.arange(s // starts.shape[0], dtype=jnp.int32)[None, :]).reshape(s)
    return qp, kp


def _oracle_mask(t, s, causal, window, q_offset, kv_offset):
    """[T, S] bool: key j visible to query i."""
    qp, kp = _positions(t, s, q_offset, kv_offset)
    delta = qp[:, None] - kp[None, :]
    visible = jnp.full((t, s), True)
    if causal:
        visible = visible & (delta >= 0)
    if window is not None:
        visible = visible & (delta < window)
    return visible


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _oracle(q, k, v, q_offset, kv_offset, *, scale, causal, window):
    """float32 attention: o [B, T, Hq, D] f32 and lse [B, Hq, T] f32 (-inf when no key)."""
    hi = jax.lax.Precision.HIGHEST
    t, hq, d = q.shape[1], q.shape[2], q.shape[3]
    s, hkv = k.shape[1], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)  # head n reads KV head n // G
    vf = jnp.repeat(v.astype(jnp.float32), hq // hkv, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf, precision=hi) * scale
    visible = _oracle_mask(t, s, causal, window, q_offset, kv_offset)[None, None]
    logits = jnp.where(visible, logits, -jnp.inf)
    any_key = jnp.any(visible, axis=-1)  # [1, 1, T]
    m = jnp.where(any_key, jnp.max(logits, axis=-1), 0.0)
    e = jnp.where(visible, jnp.exp(logits - m[..., None]), 0.0)
    denom = jnp.sum(e, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", e, vf, precision=hi)
    o = o / jnp.where(any_key, denom, 1.0).transpose(0, 2, 1)[..., None]
    lse = jnp.where(any_key, m + jnp.log(jnp.where(any_key, denom, 1.0)), -jnp.inf)
    return o, lse


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _xla_bf16(q, k, v, q_offset, kv_offset, *, scale, causal, window):
    """The same attention by XLA in bf16 (bf16 in/out): the error yardstick."""
    t, s = q.shape[1], k.shape[1]
    visible = _oracle_mask(t, s, causal, window, q_offset, kv_offset)
    o = jax.nn.dot_product_attention(q, k, v, mask=visible[None, None], scale=scale,
                                     implementation="xla")
    # XLA spreads a fully masked row uniformly; the contract says zeros.
    return jnp.where(jnp.any(visible, axis=-1)[None, :, None, None], o, jnp.zeros_like(o))


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _oracle_and_xla(q, k, v, q_offset, kv_offset, *, scale, causal, window):
    kw = dict(scale=scale, causal=causal, window=window)
    o, lse = _oracle(q, k, v, q_offset, kv_offset, **kw)
    return o, lse, _xla_bf16(q, k, v, q_offset, kv_offset, **kw)


def _inputs(seed, b, t, s, hq, hkv, d, magnitude=1.0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = (magnitude * jax.random.normal(kq, (b, t, hq, d), jnp.float32)).astype(jnp.bfloat16)
    k = (magnitude * jax.random.normal(kk, (b, s, hkv, d), jnp.float32)).astype(jnp.bfloat16)
    v = (magnitude * jax.random.normal(kv, (b, s, hkv, d), jnp.float32)).astype(jnp.bfloat16)
    return q, k, v


# One case: (name, B, T, S, Hq, Hkv, causal, window, q_offset, kv_offset, scale, magnitude).
# Shapes are never tile multiples; offsets cover queries at the end of a longer key range,
# local-layer key slabs that start before the chunk, and rows (or whole calls) with no key.
# "small" cases are the compute-sanitizer subset.
CASES = (
    ("small_t1_s1", 1, 1, 1, 2, 1, True, None, 0, 0, None, 1.0),
    ("small_t97_w5_gqa2_b2", 2, 97, 97, 4, 2, True, 5, 0, 0, None, 1.0),
    ("small_masked_rows", 1, 33, 50, 2, 2, True, None, 0, 10, None, 1.0),
    ("small_noncausal_gqa8", 1, 97, 130, 8, 1, False, None, 0, 0, None, 1.0),
    ("gqa1_t1000_causal", 1, 1000, 1000, 2, 2, True, None, 0, 0, None, 1.0),
    ("gqa16_tail_queries", 1, 97, 1000, 16, 1, True, None, 903, 0, None, 1.0),
    ("window1_t1000", 1, 1000, 1000, 4, 2, True, 1, 0, 0, None, 1.0),
    ("window1024_slab_before_chunk", 1, 1000, 2023, 16, 8, True, 1024, 5000, 3977, 1.0, 0.25),
    ("window1024_t4100", 1, 4100, 4100, 16, 8, True, 1024, 0, 0, None, 1.0),
    ("causal_t257_s4133_tail", 1, 257, 4133, 4, 1, True, None, 3876, 0, None, 1.0),
    ("noncausal_t1_s4097", 2, 1, 4097, 2, 1, False, None, 0, 0, None, 1.0),
    ("scaled_by_8", 1, 500, 700, 4, 2, True, None, 200, 0, None, 8.0),
    ("batch3_window64_offsets", 3, 130, 200, 8, 4, True, 64, 170, 100, 0.3, 1.0),
    ("all_rows_masked", 1, 40, 60, 2, 1, True, None, 0, 100, None, 1.0),
    ("window5_partial_mask", 1, 97, 97, 16, 16, True, 5, 10, 13, None, 1.0),
    # Positions offset + index pass INT32_MAX (the oracle's int32 differences wrap back to
    # the true q_pos - k_pos); a kernel that forms q_offset + i in int32 masks rows >= 100.
    ("offsets_past_int32_max", 1, 130, 200, 16, 1, True, 64, 2**31 - 100, 2**31 - 170,
     None, 1.0),
)
CPU_CASES = tuple(c for c in CASES if c[2] * c[3] <= 130_000)  # the reference is O(T*S) memory

# Segmented keys (head dim 512): kv_offset holds the starts of N equal segments of S / N slots
# (a context-parallel device's share of the cache). Segment lengths that are and are not key
# tile multiples, starts out of order and with gaps, future segments, rows that see no
# segment, a window across segments, and a device's zig-zag share of a 16K cache.
_ZIGZAG = tuple(s * 256 for r in range(16) for s in (4 * r + 1, 4 * r + 2))  # 2 devices, 32 segs
SEGMENTED_CASES = (
    ("small_seg4_len100", 1, 250, 400, 4, 1, True, None, 350, (0, 300, 400, 700), None, 1.0),
    ("small_seg4_unordered_gqa16", 2, 97, 256, 16, 1, True, None, 480, (500, 0, 1000, 64),
     None, 1.0),
    ("small_seg2_all_future", 1, 40, 128, 2, 1, True, None, 0, (1000, 2000), None, 1.0),
    ("seg3_window100", 1, 130, 384, 8, 2, True, 100, 200, (0, 256, 128), None, 1.0),
    ("seg32_zigzag_share_of_16k", 1, 1000, 8192, 16, 1, True, None, 7000, _ZIGZAG, 1.0, 0.5),
)
# On the CPU (the reference path) the 32 zigzag segments at a quarter of the size: the segment
# bookkeeping is the same, and the full case's float32 oracle alone took ~40 s there.
_ZIGZAG_SMALL = tuple(s * 64 for r in range(16) for s in (4 * r + 1, 4 * r + 2))
CPU_SEGMENTED_CASES = SEGMENTED_CASES[:-1] + (
    ("seg32_zigzag_share_of_4k", 1, 250, 2048, 4, 1, True, None, 1750, _ZIGZAG_SMALL, 1.0, 0.5),
)


class _Checks:
    """Assertions shared by the CPU and GPU classes."""

    def check_case(self, fn, seed, d, b, t, s, hq, hkv, causal, window, q_offset, kv_offset,
                   scale, magnitude):
        """Runs `fn(q, k, v, q_offset, kv_offset) -> (o, lse)` and checks it against the oracle."""
        q, k, v = _inputs(seed, b, t, s, hq, hkv, d, magnitude)
        qo, ko = jnp.int32(q_offset), jnp.int32(kv_offset)
        sc = float(d**-0.5 if scale is None else scale)
        o, lse = fn(q, k, v, qo, ko)
        ref_o, ref_lse, xla_o = _oracle_and_xla(q, k, v, qo, ko, scale=sc, causal=causal,
                                                window=window)
        ctx = f"seed={seed} d={d} b={b} t={t} s={s} hq={hq} hkv={hkv} causal={causal} " \
              f"window={window} offsets=({q_offset},{kv_offset}) scale={sc} x{magnitude}"

        self.assertEqual(o.shape, q.shape, ctx)
        self.assertEqual(o.dtype, jnp.bfloat16, ctx)
        self.assertEqual(lse.shape, (b, hq, t), ctx)
        self.assertEqual(lse.dtype, jnp.float32, ctx)
        o32 = np.asarray(o, np.float32)
        self.assertTrue(np.all(np.isfinite(o32)), f"non-finite output; {ctx}")

        err = testing.max_abs_err(o, ref_o)
        err_xla = testing.max_abs_err(xla_o, ref_o)
        bound = 2 * err_xla + FLOOR * max(1.0, float(jnp.max(jnp.abs(ref_o))))
        self.assertLessEqual(err, bound, f"o error {err:.3g} > bound {bound:.3g} "
                                         f"(xla bf16 error {err_xla:.3g}); {ctx}")

        ref_lse = np.asarray(ref_lse)
        lse = np.asarray(lse)
        masked = np.isneginf(ref_lse)
        np.testing.assert_array_equal(np.isneginf(lse), masked, f"lse -inf pattern; {ctx}")
        # Rows with no visible key are exactly zero (not NaN, not a uniform average).
        rows = np.broadcast_to(masked.transpose(0, 2, 1)[..., None], o32.shape)
        self.assertTrue(np.all(o32[rows] == 0), f"masked rows not zero; {ctx}")
        qmax = float(jnp.max(jnp.abs(q.astype(jnp.float32))))
        kmax = float(jnp.max(jnp.abs(k.astype(jnp.float32))))
        lse_tol = LSE_ATOL + LSE_RTOL_DOT * sc * d * qmax * kmax
        if not masked.all():
            lse_err = float(np.max(np.abs(lse[~masked] - ref_lse[~masked])))
            self.assertLessEqual(lse_err, lse_tol, f"lse error {lse_err:.3g}; {ctx}")
        return o, lse


def _wrapper(causal, window, scale):
    @jax.jit
    def fn(q, k, v, qo, ko):
        return ffi.flash_attention(q, k, v, scale=scale, causal=causal, window=window,
                                   q_offset=qo, kv_offset=ko, return_lse=True)
    return fn


# ---------------------------------------------------------------------------------------------
# CPU: the wrapper (the reference path on CPU) against the oracle, semantics, validation.


def _cpu_params(cases, dims=(256, 512)):
    return [dict(testcase_name=f"_d{d}_{c[0]}", d=d, case=c[1:]) for d in dims for c in cases]


class FlashAttentionCpuTest(parameterized.TestCase, _Checks):

    def setUp(self):
        super().setUp()
        self.enter_context(jax.default_device(CPU))

    @parameterized.named_parameters(*_cpu_params(CPU_CASES))
    def test_wrapper_matches_oracle(self, d, case):
        b, t, s, hq, hkv, causal, window, qo, ko, scale, mag = case
        self.check_case(_wrapper(causal, window, scale), _fresh_seed(), d, *case)

    @parameterized.named_parameters(*_cpu_params(CPU_SEGMENTED_CASES, dims=(512,)))
    def test_segmented_keys_match_oracle(self, d, case):
        b, t, s, hq, hkv, causal, window, qo, ko, scale, mag = case
        self.check_case(_wrapper(causal, window, scale), _fresh_seed(), d, *case)

    def test_segments_equal_keys_in_position_order(self):
        # Segments are positions, not slots: the same keys stored in another segment order
        # give the same result as one contiguous block in position order.
        q, k, v = _inputs(_fresh_seed(), 1, 50, 192, 4, 1, 512)
        order = np.array([2, 0, 1])  # slot segment j holds position segment order[j]
        perm = lambda x: jnp.concatenate([x[:, 64 * o:64 * o + 64] for o in order], axis=1)
        fn = _wrapper(True, None, None)
        o1, l1 = fn(q, k, v, jnp.int32(150), jnp.int32(0))
        o2, l2 = fn(q, perm(k), perm(v), jnp.int32(150), jnp.asarray(64 * order, jnp.int32))
        np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2, np.float32),
                                   atol=1e-2)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5)

    def test_poisoned_outputs_harness_d256(self):
        # The poison harness (donated NaN buffers) works here too; on GPU it guards the kernel.
        b, t, s, hq, hkv, causal, window, qo, ko, scale, mag = CASES[1][1:]
        fn = lambda q, k, v, a, c: ffi.flash_attention(
            q, k, v, scale=scale, causal=causal, window=window, q_offset=a, kv_offset=c,
            return_lse=True)
        self.check_case(lambda *a: testing.call_with_poisoned_outputs(fn, *a), _fresh_seed(),
                        256, *CASES[1][1:])

    @parameterized.named_parameters(("_d256", 256), ("_d512", 512))
    def test_window_semantics(self, d):
        # q_pos - k_pos in [0, W): with W=3 query 5 sees exactly keys 3, 4, 5; key values
        # one-hot in their position make the output the attention weights.
        t = s = 8
        q = jnp.zeros((1, t, 1, d), jnp.bfloat16)
        v = jax.nn.one_hot(jnp.arange(s), d, dtype=jnp.bfloat16)[None, :, None, :]
        o, lse = ffi.flash_attention(q, jnp.zeros_like(v), v, causal=True, window=3,
                                     return_lse=True)
        w = np.asarray(o, np.float32)[0, :, 0, :s]
        expect = np.zeros((t, s), np.float32)
        for i in range(t):
            lo = max(0, i - 2)
            expect[i, lo:i + 1] = 1.0 / (i + 1 - lo)
        np.testing.assert_allclose(w, expect, atol=4e-3)
        np.testing.assert_allclose(np.asarray(lse)[0, 0], np.log(expect.astype(bool).sum(1)),
                                   rtol=1e-6)

    @parameterized.named_parameters(("_d256", 256), ("_d512", 512))
    def test_offsets_shift_positions(self, d):
        # Shifting both offsets by the same amount changes nothing; the traced offsets go
        # through one compiled function.
        q, k, v = _inputs(_fresh_seed(), 1, 20, 30, 2, 1, d)
        fn = _wrapper(True, 7, None)
        o1, l1 = fn(q, k, v, jnp.int32(15), jnp.int32(5))
        o2, l2 = fn(q, k, v, jnp.int32(1015), jnp.int32(1005))
        np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
        o3, _ = fn(q, k, v, jnp.int32(0), jnp.int32(5))  # different relative offset: differs
        self.assertGreater(testing.max_abs_err(o1, o3), 0.0)

    def test_default_scale_is_rsqrt_d(self):
        q, k, v = _inputs(_fresh_seed(), 1, 9, 11, 2, 2, 256)
        a = ffi.flash_attention(q, k, v)
        b = ffi.flash_attention(q, k, v, scale=1 / 16)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def test_vmap_and_shard_map_d256(self):
        _check_vmap(self, 256)
        _check_shard_map(self, 256, jax.devices("cpu"))

    def test_d512_on_small_shared_memory_gpus_uses_the_reference(self):
        # sm_89 offers 99 KB of shared memory per block, too little for the D=512 kernel: the
        # call must trace to the reference there (no custom call in the jaxpr; lowering for CPU
        # would drop the CUDA branch anyway), while D=256 keeps its kernel branch.
        from unittest import mock
        from jax_mila.ffi import _registry
        from jax_mila.ffi import attention as ffi_attention
        forced = lambda op, target=None: _registry.OpStatus(op, True, "forced by the test")
        # Both the routing (attention._target) and the dispatch read the capabilities: on a
        # machine with an H200, routing alone would pick the sm_90 D=256 kernel.
        with mock.patch.object(_registry, "status", forced), \
             mock.patch.object(_registry, "cuda_capabilities", return_value=((8, 9),)), \
             mock.patch.object(ffi_attention, "cuda_capabilities", return_value=((8, 9),)):
            for d, kernel_expected in ((512, False), (256, True)):
                q, k, v = _inputs(_fresh_seed(), 1, 8, 8, 2, 1, d)
                jaxpr = str(jax.make_jaxpr(
                    lambda q, k, v: ffi.flash_attention(q, k, v, causal=True))(q, k, v))
                self.assertEqual(f"jax_mila_flash_attention_d{d}" in jaxpr, kernel_expected, d)

    def test_kernel_branch_types_match_under_shard_map(self):
        # Pretend the kernel exists so lax.platform_dependent traces the ffi_call branch too:
        # inside shard_map both branches must carry the same varying mesh axes.
        from unittest import mock
        from jax.sharding import Mesh, PartitionSpec as P
        from jax_mila.ffi import _registry
        forced = lambda op, target=None: _registry.OpStatus(op, True, "forced by the test")
        mesh = Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("b", "h"))
        q, k, v = _inputs(_fresh_seed(), 2, 8, 8, 4, 2, 256)
        x = P("b", None, "h", None)
        f = jax.shard_map(
            lambda q, k, v, a, c: ffi.flash_attention(q, k, v, causal=True, window=3, q_offset=a,
                                                      kv_offset=c, return_lse=True),
            mesh=mesh, in_specs=(x, x, x, P(), P()), out_specs=(x, P("b", "h", None)))
        with mock.patch.object(_registry, "status", forced):
            jax.jit(f).lower(q, k, v, jnp.int32(0), jnp.int32(0))  # raised TypeError before

    # ---- validation: ValueErrors at trace time naming the argument ----

    def _bad(self, regex, q, k, v, **kw):
        with self.assertRaisesRegex(ValueError, regex):
            ffi.flash_attention(q, k, v, **kw)

    def test_packed_rows_past_int32_refused(self):
        q = jax.ShapeDtypeStruct((1, 2**28, 16, 256), jnp.bfloat16)  # abstract: never allocated
        k = jax.ShapeDtypeStruct((1, 8, 1, 256), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "q: T \\* Hq / Hkv = 4294967296 packed rows"):
            jax.eval_shape(lambda q, k: ffi.flash_attention(q, k, k, causal=True), q, k)

    def test_grid_limits_refused(self):
        # Abstract, never allocated: B and Hkv are grid dimensions of the kernels.
        q = jax.ShapeDtypeStruct((65536, 8, 1, 256), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "q: batch 65536 is not supported"):
            jax.eval_shape(lambda q: ffi.flash_attention(q, q, q), q)
        q = jax.ShapeDtypeStruct((1, 8, 65536, 256), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "k: Hkv=65536 KV heads are not supported"):
            jax.eval_shape(lambda q: ffi.flash_attention(q, q, q), q)

    def test_vmap_past_the_batch_limit_maps(self):
        # Folding a vmapped axis into B would pass the kernels' batch limit: one call per
        # element instead (a scan in the jaxpr), not an error.
        q = jax.ShapeDtypeStruct((65536, 1, 8, 1, 256), jnp.bfloat16)
        f = jax.vmap(lambda q: ffi.flash_attention(q, q, q, causal=True))
        self.assertEqual(jax.eval_shape(f, q).shape, q.shape)
        self.assertIn("scan", str(jax.make_jaxpr(f)(q)))

    def test_bad_head_dim(self):
        x = jnp.zeros((1, 4, 2, 128), jnp.bfloat16)
        self._bad(r"flash_attention: q: head_dim=128 is not supported", x, x, x)

    def test_bad_dtype(self):
        x = jnp.zeros((1, 4, 2, 256), jnp.bfloat16)
        self._bad(r"q: dtype float16 is not supported", x.astype(jnp.float16), x, x)
        self._bad(r"v: dtype float32 is not supported", x, x, x.astype(jnp.float32))

    def test_bad_rank_and_shapes(self):
        x = jnp.zeros((1, 4, 2, 256), jnp.bfloat16)
        self._bad(r"q: expected rank 4", x[0], x, x)
        self._bad(r"v: shape \[1, 5, 2, 256\] must equal k's", x, x, jnp.zeros((1, 5, 2, 256),
                                                                               jnp.bfloat16))
        self._bad(r"k: head_dim=512 must equal q's 256", x, jnp.zeros((1, 4, 2, 512),
                                                                       jnp.bfloat16),
                  jnp.zeros((1, 4, 2, 512), jnp.bfloat16))
        self._bad(r"k: batch 2 must equal q's 1", x, jnp.zeros((2, 4, 2, 256), jnp.bfloat16),
                  jnp.zeros((2, 4, 2, 256), jnp.bfloat16))
        self._bad(r"q: empty arrays", x[:, :0], x, x)
        self._bad(r"q: expected an array \(jax or numpy\), got list", [[1]], x, x)

    def test_bad_gqa_ratio(self):
        q6 = jnp.zeros((1, 4, 6, 256), jnp.bfloat16)
        k4 = jnp.zeros((1, 4, 4, 256), jnp.bfloat16)
        self._bad(r"Hq=6 query heads over Hkv=4", q6, k4, k4)
        q32 = jnp.zeros((1, 4, 32, 256), jnp.bfloat16)
        k1 = jnp.zeros((1, 4, 1, 256), jnp.bfloat16)
        self._bad(r"Hq=32 query heads over Hkv=1 .*at most 16", q32, k1, k1)

    def test_bad_window_scale_offsets(self):
        x = jnp.zeros((1, 4, 2, 256), jnp.bfloat16)
        self._bad(r"window: a sliding window needs causal=True", x, x, x, window=4)
        self._bad(r"window: must be None or an int in \[1, 2\^31 - 1\], got 0", x, x, x,
                  causal=True, window=0)
        self._bad(r"window: .*got 2147483648", x, x, x, causal=True, window=2**31)
        # The kernels take scale as float32 and positions as int32: nothing may overflow on the
        # way (1e300 would be inf, 2**32 would wrap to 0).
        for scale in (float("inf"), 1e300, "a", True):
            self._bad(r"scale: must be None or a number that float32 holds", x, x, x, scale=scale)
        for off in (np.int64(2**32), 2**40, np.uint32(2**32 - 1), -2**31 - 1):
            self._bad(r"q_offset: -?\d+ is out of range \(supported: int32", x, x, x,
                      q_offset=off)
        self._bad(r"kv_offset: 2147483648 is out of range", x, x, x, kv_offset=np.int64(2**31))
        self._bad(r"q_offset: must be an integer scalar", x, x, x, q_offset=jnp.zeros(2, jnp.int32))
        self._bad(r"kv_offset: must be an integer scalar", x, x, x, kv_offset=1.5)
        y = jnp.zeros((1, 4, 2, 512), jnp.bfloat16)
        self._bad(r"kv_offset: .*N dividing S=4; got shape \(3,\)", y, y, y,
                  kv_offset=jnp.zeros(3, jnp.int32))
        self._bad(r"kv_offset: .*got shape \(2, 2\)", y, y, y,
                  kv_offset=jnp.zeros((2, 2), jnp.int32))
        self._bad(r"kv_offset: segmented keys \(2 segment starts\) .*head dim 512 only; got "
                  r"head dim 256", x, x, x, kv_offset=jnp.zeros(2, jnp.int32))


# ---------------------------------------------------------------------------------------------
# Transformations, shared by CPU and GPU classes.


def _check_vmap(tc, d):
    seed = _fresh_seed()
    q, k, v = _inputs(seed, 2, 33, 40, 4, 2, d)
    qs, ks, vs = (jnp.stack([x, x[::-1] * 0.5]) for x in (q, k, v))  # [2, B, ...]
    f = lambda q, k, v, qo, ko: ffi.flash_attention(q, k, v, causal=True, window=9,
                                                    q_offset=qo, kv_offset=ko, return_lse=True)
    # vmapped q/k/v with shared offsets (folded into the batch) ...
    o, lse = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None, None)))(qs, ks, vs, jnp.int32(7),
                                                                 jnp.int32(0))
    # ... and vmapped offsets (one call per element).
    qos = jnp.array([7, 30], jnp.int32)
    o2, lse2 = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None)))(qs, ks, vs, qos, jnp.int32(0))
    for i in range(2):
        for oo, ll, qo in ((o, lse, 7), (o2, lse2, int(qos[i]))):
            ro, rl = _oracle(qs[i], ks[i], vs[i], jnp.int32(qo), jnp.int32(0), scale=d**-0.5,
                             causal=True, window=9)
            xo = _xla_bf16(qs[i], ks[i], vs[i], jnp.int32(qo), jnp.int32(0), scale=d**-0.5,
                           causal=True, window=9)
            bound = 2 * testing.max_abs_err(xo, ro) + FLOOR * max(1.0, float(jnp.max(jnp.abs(ro))))
            tc.assertLessEqual(testing.max_abs_err(oo[i], ro), bound, f"vmap seed={seed}")
            np.testing.assert_allclose(np.asarray(ll[i]), np.asarray(rl), atol=5e-3, rtol=1e-4)


def _check_shard_map(tc, d, devices=None):
    """Batch over mesh axis "b" and heads over "h" (whatever devices exist; one is fine)."""
    from jax.sharding import Mesh, PartitionSpec as P
    devices = devices or jax.devices()
    n = len(devices)
    nh = 2 if n % 2 == 0 else 1
    mesh = Mesh(np.array(devices).reshape(n // nh, nh), ("b", "h"))
    b, hkv = n // nh * 2, nh * 2
    seed = _fresh_seed()
    q, k, v = _inputs(seed, b, 50, 70, hkv * 2, hkv, d)
    qo, ko = jnp.int32(20), jnp.int32(0)

    def local(q, k, v, qo, ko):
        return ffi.flash_attention(q, k, v, causal=True, window=33, q_offset=qo, kv_offset=ko,
                                   return_lse=True)

    x_spec = P("b", None, "h", None)
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, P(), P()),
                                    out_specs=(x_spec, P("b", "h", None))))
    o, lse = sharded(q, k, v, qo, ko)
    ro, rl = _oracle(q, k, v, qo, ko, scale=d**-0.5, causal=True, window=33)
    xo = _xla_bf16(q, k, v, qo, ko, scale=d**-0.5, causal=True, window=33)
    bound = 2 * testing.max_abs_err(xo, ro) + FLOOR * max(1.0, float(jnp.max(jnp.abs(ro))))
    tc.assertLessEqual(testing.max_abs_err(o, ro), bound, f"shard_map seed={seed} mesh={mesh}")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), atol=5e-3, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA kernel of one head dim. One class per head dim (so -k d256 / -k d512 pick one).


def _make_gpu_test_class(d: int, mma_sync: bool = False):
    """The suite for head dim ``d`` through ffi.flash_attention; ``mma_sync``: with the Hopper
    target of ``d`` unmapped while each test runs (the route is chosen at trace time), so that
    the portable kernel answers on Hopper too."""
    target = f"jax_mila_flash_attention_d{d}"
    params = [dict(testcase_name=f"_{c[0]}", case=c[1:]) for c in CASES]
    seg_params = [dict(testcase_name=f"_{c[0]}", case=c[1:]) for c in SEGMENTED_CASES]
    small = [p for p in params + (seg_params if d == 512 else [])
             if p["testcase_name"].startswith("_small")]

    class GpuTest(parameterized.TestCase, _Checks):
        D = d

        def setUp(self):
            super().setUp()
            testing.skip_unless_kernel(self, "flash_attention", target)
            if mma_sync:
                patch = mock.patch.dict(attention._SM90_TARGETS, {d: None})
                patch.start()
                self.addCleanup(patch.stop)

        @parameterized.named_parameters(*params)
        def test_matches_oracle(self, case):
            b, t, s, hq, hkv, causal, window, qo, ko, scale, mag = case
            self.check_case(_wrapper(causal, window, scale), _fresh_seed(), d, *case)

        @parameterized.named_parameters(*seg_params)
        def test_segmented_keys(self, case):
            b, t, s, hq, hkv, causal, window, qo, ko, scale, mag = case
            if d != 512:  # the D=256 kernels take one segment: refused at trace time
                q, k, v = _inputs(0, b, t, s, hq, hkv, d)
                with self.assertRaisesRegex(ValueError, "head dim 512 only"):
                    ffi.flash_attention(q, k, v, causal=causal, kv_offset=jnp.asarray(ko))
                return
            self.check_case(_wrapper(causal, window, scale), _fresh_seed(), d, *case)

        @parameterized.named_parameters(*small)
        def test_poisoned_outputs(self, case):
            # Every element of o and lse must be written: NaN-filled output buffers would show.
            b, t, s, hq, hkv, causal, window, qo, ko, scale, mag = case
            fn = lambda q, k, v, a, c: ffi.flash_attention(
                q, k, v, scale=scale, causal=causal, window=window, q_offset=a, kv_offset=c,
                return_lse=True)
            self.check_case(lambda *a: testing.call_with_poisoned_outputs(fn, *a),
                            _fresh_seed(), d, *case)

        def test_small_offsets_are_read_on_device(self):
            # One compiled function, several offset values: each must match its own oracle.
            fn = _wrapper(True, 16, None)
            seed = _fresh_seed()
            q, k, v = _inputs(seed, 1, 40, 64, 4, 2, d)
            n_compiled = None
            for qo, ko in ((24, 0), (0, 0), (100, 70), (0, 41)):
                o, lse = fn(q, k, v, jnp.int32(qo), jnp.int32(ko))
                ro, rl = _oracle(q, k, v, jnp.int32(qo), jnp.int32(ko), scale=d**-0.5,
                                 causal=True, window=16)
                self.assertLess(testing.max_abs_err(o, ro), 0.05, f"offsets {qo},{ko} seed={seed}")
                np.testing.assert_array_equal(np.isneginf(np.asarray(lse)),
                                              np.isneginf(np.asarray(rl)))
                n = fn._cache_size() if hasattr(fn, "_cache_size") else None
                self.assertTrue(n_compiled is None or n == n_compiled, "offsets recompiled")
                n_compiled = n

        def test_small_vmap(self):
            _check_vmap(self, d)

        def test_small_shard_map(self):
            _check_shard_map(self, d, testing.cuda_devices())

        def test_small_cpp_rejects_bad_shape(self):
            # Bypass the Python checks: the handler itself must answer INVALID_ARGUMENT.
            ffi.status("flash_attention", target)  # registers the targets
            q = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)  # wrong head dim for this target
            call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                                             jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)))
            with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT"):
                jax.block_until_ready(call(q, q, q, jnp.int32(0), jnp.int32(0),
                                           scale=np.float32(1.0), causal=True,
                                           window=np.int64(0)))
            kb = jnp.zeros((1, 8, 3, d), jnp.bfloat16)  # Hq=2 over Hkv=3
            qd = jnp.zeros((1, 8, 2, d), jnp.bfloat16)
            call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(qd.shape, jnp.bfloat16),
                                             jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)))
            with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT.*heads"):
                jax.block_until_ready(call(qd, kb, kb, jnp.int32(0), jnp.int32(0),
                                           scale=np.float32(1.0), causal=True,
                                           window=np.int64(0)))
            k1 = jnp.zeros((1, 8, 1, d), jnp.bfloat16)
            for kw, pattern in ((dict(scale=np.float32(np.inf)), "scale=inf must be finite"),
                                (dict(window=np.int64(2**31)), "window=2147483648 is out of range"),
                                (dict(window=np.int64(4), causal=False), "needs causal=True")):
                attrs = dict(scale=np.float32(1.0), causal=True, window=np.int64(0))
                attrs.update(kw)
                with self.subTest(pattern=pattern), \
                        self.assertRaisesRegex(Exception, "INVALID_ARGUMENT.*" + pattern):
                    jax.block_until_ready(call(qd, k1, k1, jnp.int32(0), jnp.int32(0), **attrs))
            # Three query heads per KV head: the mma.sync kernels take it, the Hopper kernels
            # (64-row tiles of packed heads) refuse it in their handler.
            q3 = jnp.zeros((1, 8, 3, d), jnp.bfloat16)
            hopper = f"{target}_sm90"
            for name in [target] + ([hopper] if hopper in _registered_targets()
                                    and testing.compute_capability() == (9, 0) else []):
                call3 = jax.ffi.ffi_call(name, (jax.ShapeDtypeStruct(q3.shape, jnp.bfloat16),
                                                jax.ShapeDtypeStruct((1, 3, 8), jnp.float32)))
                run3 = lambda: jax.block_until_ready(call3(  # noqa: E731
                    q3, k1, k1, jnp.int32(0), jnp.int32(0), scale=np.float32(1.0),
                    causal=True, window=np.int64(0)))
                with self.subTest(target=name):
                    if name == hopper:
                        with self.assertRaisesRegex(Exception,
                                                    "INVALID_ARGUMENT.*a divisor of 64"):
                            run3()
                    else:
                        run3()

        if d == 256:
            @mock.patch.dict(attention._SM90_TARGETS, {256: None})
            def test_small_cpp_refuses_more_queries_than_the_grid_holds(self):
                ffi.status("flash_attention", target)
                t = 65535 * 64 + 1  # 2 GiB of queries, never read: refused before the launch
                q = jnp.zeros((1, t, 1, d), jnp.bfloat16)
                k = jnp.zeros((1, 8, 1, d), jnp.bfloat16)
                call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                                                 jax.ShapeDtypeStruct((1, 1, t), jnp.float32)))
                with self.assertRaisesRegex(Exception, f"INVALID_ARGUMENT.*T={t} queries"):
                    jax.block_until_ready(call(q, k, k, jnp.int32(0), jnp.int32(0),
                                               scale=np.float32(1.0), causal=True,
                                               window=np.int64(0)))
                with self.assertRaisesRegex(ValueError, f"q: T={t} queries are more than"):
                    ffi.flash_attention(q, k, k, causal=True)

    GpuTest.__name__ = GpuTest.__qualname__ = f"FlashAttentionD{d}GpuTest"
    return GpuTest


# On an H200 the default classes run the Hopper kernels (flash256_sm90, flash512_sm90); the
# MmaSync classes keep the portable mma.sync kernels under the whole contract there too.
FlashAttentionD256GpuTest = _make_gpu_test_class(256)
FlashAttentionD256MmaSyncGpuTest = _make_gpu_test_class(256, mma_sync=True)
FlashAttentionD512GpuTest = _make_gpu_test_class(512)
FlashAttentionD512MmaSyncGpuTest = _make_gpu_test_class(512, mma_sync=True)


if __name__ == "__main__":
    absltest.main()
