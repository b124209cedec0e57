"""Tests of jax_mila.ffi.decode_attention: the wrapper's argument checks, the reference against an
independent NumPy float64 brute force (CPU), and the CUDA kernel against the same brute force
(GPU; skipped without a CUDA device or without the kernel built).

The brute force replays the cache writes (position p goes to slot p % S on a ring, slot p
otherwise) to learn which position each slot holds, instead of the reference's closed form, and
builds rotary_keys_only's keys by column lists. Error criterion for bf16 outputs, elementwise:

    |o - oracle| <= 2^-8 (max|v| + |oracle|) + 4 * 2^-23 * scale * D * max|q| * max|k| * max|v|

(P rounded to bf16 inside the kernels: 2^-9 of max|v|; the bf16 output: 2^-9 of the value; the
last term bounds how far float32 dot products of D terms move a softmax). A query that sees no
key must give exact zeros.

Selectors (pytest -k): "Cpu" the CPU tests, "Gpu" the kernel tests, "small" the small GPU cases
for compute-sanitizer runs. Inputs come from a fresh seed per run, printed on failure.
"""

from __future__ import annotations

import importlib
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi
import testing  # tests/testing.py

# The module (jax_mila.ffi.decode_attention is also the name of the function it exports).
da = importlib.import_module("jax_mila.ffi.decode_attention")
reference_decode = importlib.import_module("jax_mila.reference.decode_attention")

F8 = jnp.float8_e4m3fn
CPU = jax.devices("cpu")[0]


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def brute_force(q, k, v, kv_len, *, scale=None, window=None, ring=False, rotary=None):
    """(o float64 [B, T, Hq, D], sees [B, T] bool: whether query t of row b sees any key)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    b_, t_, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g_ = hq // hkv
    scale = d**-0.5 if scale is None else scale
    if rotary is not None:
        k_cols = np.zeros(d, bool)
        k_cols[:rotary] = True
        k_cols[d // 2:d // 2 + rotary] = True
        k = np.where(k_cols, k, v)
    out = np.zeros(q.shape)
    sees = np.zeros((b_, t_), bool)
    for b in range(b_):
        n = int(kv_len[b])
        held = np.full(s, -1)
        for pos in range(max(n, 0)):  # the cache writes of row b, oldest first
            slot = pos % s if ring else pos
            if slot < s:
                held[slot] = pos
        for t in range(t_):
            q_pos = n - t_ + t
            vis = (held >= 0) & (held <= q_pos)
            if window is not None:
                vis &= q_pos - held < window
            if not vis.any():
                continue
            sees[b, t] = True
            for hk in range(hkv):
                heads = slice(hk * g_, (hk + 1) * g_)
                logits = scale * q[b, t, heads] @ k[b, vis, hk].T
                p = np.exp(logits - logits.max(-1, keepdims=True))
                out[b, t, heads] = (p / p.sum(-1, keepdims=True)) @ v[b, vis, hk]
    return out, sees


def assert_close(testcase, got, q, k, v, oracle, sees, *, scale, seed, what=""):
    got = _f64(got)
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    mq, mk, mv = (float(np.abs(_f64(x)).max()) for x in (q, k, v))
    tol = (2.0**-8 * (mv + np.abs(oracle)) + 4 * 2.0**-23 * abs(scale) * d * mq * mk * mv)
    err = np.abs(got - oracle)
    bad = np.argwhere(~(err <= tol))
    testcase.assertEqual(
        bad.shape[0], 0,
        f"seed {seed} {what}: {bad.shape[0]} elements off, first {bad[:3].tolist()}: got "
        f"{[got[tuple(i)] for i in bad[:3]]} want {[oracle[tuple(i)] for i in bad[:3]]}; "
        f"max err {err.max():.3g}")
    blind = ~sees
    testcase.assertTrue(np.all(got[blind] == 0), f"seed {seed} {what}: queries that see no key "
                                                 "must give zeros")


def _inputs(rng, b, t, hq, hkv, s, d, dtype, magnitude=1.0):
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)) * magnitude, jnp.float32).astype(jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)) * magnitude, jnp.float32).astype(dtype)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)) * magnitude, jnp.float32).astype(dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# CPU: the wrapper's checks and the reference.


class DecodeAttentionArgumentsCpuTest(parameterized.TestCase):
    def _args(self, **over):
        a = dict(q=jnp.zeros((2, 1, 4, 256), jnp.bfloat16), k=jnp.zeros((2, 8, 2, 256), jnp.bfloat16),
                 v=jnp.zeros((2, 8, 2, 256), jnp.bfloat16), kv_len=jnp.array([3, 8], jnp.int32))
        kw = {}
        for name, value in over.items():
            (a if name in a else kw)[name] = value
        return a, kw

    @parameterized.named_parameters(
        ("q_rank", dict(q=jnp.zeros((2, 4, 256), jnp.bfloat16)), "q"),
        ("k_rank", dict(k=jnp.zeros((2, 8, 256), jnp.bfloat16)), "k"),
        ("v_rank", dict(v=jnp.zeros((2, 8, 256), jnp.bfloat16)), "v"),
        ("q_empty", dict(q=jnp.zeros((2, 0, 4, 256), jnp.bfloat16)), "q"),
        ("k_empty", dict(k=jnp.zeros((2, 0, 2, 256), jnp.bfloat16),
                         v=jnp.zeros((2, 0, 2, 256), jnp.bfloat16)), "k"),
        ("q_dtype", dict(q=jnp.zeros((2, 1, 4, 256), jnp.float32)), "q"),
        ("k_dtype", dict(k=jnp.zeros((2, 8, 2, 256), jnp.float16),
                         v=jnp.zeros((2, 8, 2, 256), jnp.float16)), "k"),
        ("v_dtype", dict(v=jnp.zeros((2, 8, 2, 256), F8)), "v"),
        ("v_shape", dict(v=jnp.zeros((2, 9, 2, 256), jnp.bfloat16)), "v"),
        ("head_dim", dict(q=jnp.zeros((2, 1, 4, 128), jnp.bfloat16),
                          k=jnp.zeros((2, 8, 2, 128), jnp.bfloat16),
                          v=jnp.zeros((2, 8, 2, 128), jnp.bfloat16)), "q"),
        ("k_batch", dict(k=jnp.zeros((3, 8, 2, 256), jnp.bfloat16),
                         v=jnp.zeros((3, 8, 2, 256), jnp.bfloat16)), "k"),
        ("k_head_dim", dict(k=jnp.zeros((2, 8, 2, 512), jnp.bfloat16),
                            v=jnp.zeros((2, 8, 2, 512), jnp.bfloat16)), "k"),
        ("too_many_tokens", dict(q=jnp.zeros((2, 17, 4, 256), jnp.bfloat16)), "q"),
        ("heads_not_multiple", dict(q=jnp.zeros((2, 1, 3, 256), jnp.bfloat16)), "q"),
        ("too_many_groups", dict(q=jnp.zeros((2, 1, 34, 256), jnp.bfloat16)), "q"),
        ("kv_len_list", dict(kv_len=[3, 8]), "kv_len"),
        ("kv_len_rank", dict(kv_len=jnp.zeros((2, 1), jnp.int32)), "kv_len"),
        ("kv_len_dtype", dict(kv_len=np.array([3, 8], np.int64)), "kv_len"),
        ("kv_len_shape", dict(kv_len=jnp.array([3, 8, 1], jnp.int32)), "kv_len"),
        ("scale_inf", dict(scale=float("inf")), "scale"),
        ("scale_f32_overflow", dict(scale=1e39), "scale"),
        ("scale_string", dict(scale="1"), "scale"),
        ("scale_bool", dict(scale=True), "scale"),
        ("window_zero", dict(window=0), "window"),
        ("window_float", dict(window=1.5), "window"),
        ("window_bool", dict(window=True), "window"),
        ("window_int32", dict(window=2**31), "window"),
        ("ring_not_bool", dict(ring=1, window=4), "ring"),
        ("ring_without_window", dict(ring=True), "ring"),
        ("ring_too_small", dict(ring=True, window=8, q=jnp.zeros((2, 2, 4, 256), jnp.bfloat16)),
         "ring"),
        ("rotary_negative", dict(rotary_keys_only=-1), "rotary_keys_only"),
        ("rotary_too_large", dict(rotary_keys_only=129), "rotary_keys_only"),
        ("rotary_float", dict(rotary_keys_only=64.0), "rotary_keys_only"),
        ("rotary_bool", dict(rotary_keys_only=True), "rotary_keys_only"),
    )
    def test_rejects(self, over, arg):
        a, kw = self._args(**over)
        with self.assertRaisesRegex(ValueError, f"jax_mila.decode_attention: {arg}:"):
            ffi.decode_attention(a["q"], a["k"], a["v"], a["kv_len"], **kw)

    def test_accepts_the_edges(self):
        # ring with S == window + T - 1 exactly, r = D/2, a window of 1, an FP8 cache.
        q = jnp.zeros((2, 2, 4, 256), jnp.bfloat16)
        k = jnp.zeros((2, 9, 2, 256), F8)
        o = ffi.decode_attention(q, k, k, jnp.array([3, 8], jnp.int32), ring=True, window=8,
                                 rotary_keys_only=128, scale=1.0)
        self.assertEqual((o.shape, o.dtype), (q.shape, jnp.bfloat16))
        o = ffi.decode_attention(q, k, k, jnp.array([0, 1], jnp.int32), window=1)
        self.assertEqual(o.shape, q.shape)

    def test_pieces(self):
        # Enough CTAs on a large cache, one piece on a tiny one, never more pieces than keys
        # allow, and the window bounds the keys.
        self.assertEqual(da.pieces(1, 1, 16, 1, 97, None, 2, 132), 1)
        self.assertEqual(da.pieces(1, 1, 16, 1, 131072, None, 2, 132), 131072 // 512)
        self.assertEqual(da.pieces(1, 1, 32, 4, 131072, None, 2, 132), 132)  # 4 x 132 CTAs
        self.assertEqual(da.pieces(1, 1, 16, 1, 131072, None, 1, 132), 131072 // 1024)
        self.assertEqual(da.pieces(1, 1, 2, 1, 131072, 200, 2, 132), 4)  # 200 keys, 64 a piece
        self.assertEqual(da.pieces(128, 1, 16, 8, 131072, None, 2, 132), 1)


class DecodeAttentionReferenceCpuTest(parameterized.TestCase):
    @parameterized.named_parameters(
        # name, (B, T, Hq, Hkv, S, D), lengths, window, ring, cache dtype, rotary
        ("d512_gqa16", (2, 1, 16, 1, 40, 512), (40, 7), None, False, jnp.bfloat16, None),
        ("d512_fp8_rotary", (2, 3, 8, 2, 33, 512), (33, 2), None, False, F8, 64),
        ("d512_rotary_odd", (1, 2, 4, 2, 20, 512), (20,), None, False, jnp.bfloat16, 24),
        ("d512_len_past_s", (2, 2, 4, 4, 16, 512), (19, 16), None, False, jnp.bfloat16, None),
        ("d512_short_rows", (3, 4, 2, 1, 12, 512), (1, 3, 0), None, False, jnp.bfloat16, None),
        ("d256_window", (2, 4, 4, 2, 30, 256), (30, 11), 5, False, jnp.bfloat16, None),
        ("d256_ring_wrap", (3, 2, 4, 2, 9, 256), (9, 5 * 9 + 4, 2), 8, True, jnp.bfloat16, None),
        ("d256_ring_fp8", (2, 3, 2, 1, 12, 256), (40, 7), 5, True, F8, None),
        ("d256_ring_big", (2, 16, 4, 2, 1039, 256), (5000, 1039), 1024, True, jnp.bfloat16, None),
        ("d256_ring_one_slot", (2, 1, 2, 2, 1, 256), (1, 6), 1, True, jnp.bfloat16, None),
    )
    def test_reference_matches_brute_force(self, shape, lengths, window, ring, dtype, rotary):
        seed = _fresh_seed()
        rng = np.random.default_rng(seed)
        b, t, hq, hkv, s, d = shape
        q, k, v = _inputs(rng, b, t, hq, hkv, s, d, dtype)
        kv_len = jnp.asarray(lengths, jnp.int32)
        with jax.default_device(CPU):
            got = reference_decode.decode_attention(q, k, v, kv_len, window=window, ring=ring,
                                                    rotary_keys_only=rotary)
            via_wrapper = ffi.decode_attention(q, k, v, kv_len, window=window, ring=ring,
                                               rotary_keys_only=rotary)
        want, sees = brute_force(q, k, v, np.asarray(lengths), window=window, ring=ring,
                                 rotary=rotary)
        assert_close(self, got, q, k, v, want, sees, scale=None, seed=seed)
        np.testing.assert_array_equal(np.asarray(via_wrapper, np.float32), np.asarray(got, np.float32))

    def test_the_oracle_sees_a_wrong_window(self):
        # Negative control: the criterion rejects an off-by-one window (q - k <= W).
        seed = _fresh_seed()
        rng = np.random.default_rng(seed)
        q, k, v = _inputs(rng, 1, 2, 2, 1, 12, 256, jnp.bfloat16)
        kv_len = np.array([12])
        got = reference_decode.decode_attention(q, k, v, jnp.asarray(kv_len, jnp.int32), window=5)
        wrong, sees = brute_force(q, k, v, kv_len, window=6)
        with self.assertRaises(AssertionError):
            assert_close(self, got, q, k, v, wrong, sees, scale=None, seed=seed)

    def test_slot_positions_ring(self):
        pos = np.asarray(reference_decode.slot_positions(jnp.array([0, 3, 10], jnp.int32), 4,
                                                         ring=True))
        np.testing.assert_array_equal(pos, [[-1, -1, -1, -1], [0, 1, 2, -1], [8, 9, 6, 7]])


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the brute force.


def _target_call(q, k, v, kv_len, *, pieces, scale, window=0, ring=False, rotary=None):
    """All three outputs of the FFI target (o, o_part, ml_part) with a chosen piece count."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    rows = t * (hq // hkv)
    out = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
           jax.ShapeDtypeStruct((b, hkv, pieces, rows, d), jnp.float32),
           jax.ShapeDtypeStruct((b, hkv, pieces, rows, 2), jnp.float32))
    return jax.ffi.ffi_call(da.TARGET, out)(
        q, k, v, kv_len, scale=np.float32(scale), window=np.int64(window), ring=bool(ring),
        rotary=np.int64(d // 2 if rotary is None else rotary), pieces=np.int64(pieces))


GPU_CASES = (
    # name, (B, T, Hq, Hkv, S, D), lengths (None: 1, S and random), window, ring, dtype, rotary,
    # magnitude
    ("d512_b1_t1_g16_small", (1, 1, 16, 1, 97, 512), None, None, False, jnp.bfloat16, None, 1.0),
    ("d512_b3_t2_g8", (3, 2, 16, 2, 4097, 512), None, None, False, jnp.bfloat16, None, 1.0),
    ("d512_b3_t16_g16_fp8", (3, 16, 16, 1, 4097, 512), None, None, False, F8, None, 1.0),
    ("d512_b3_t16_g2_rows32", (3, 16, 4, 2, 97, 512), None, None, False, jnp.bfloat16, None, 1.0),
    ("d512_rotary64_small", (3, 1, 8, 1, 97, 512), None, None, False, jnp.bfloat16, 64, 1.0),
    ("d512_rotary64_fp8", (3, 2, 16, 2, 4097, 512), None, None, False, F8, 64, 1.0),
    ("d512_fp8_rows32", (3, 4, 8, 1, 97, 512), None, None, False, F8, 64, 1.0),
    ("d512_rotary24", (1, 2, 8, 1, 97, 512), None, None, False, jnp.bfloat16, 24, 1.0),
    ("d512_s1_small", (3, 1, 2, 2, 1, 512), None, None, False, jnp.bfloat16, None, 1.0),
    ("d512_large", (1, 2, 16, 1, 4097, 512), None, None, False, jnp.bfloat16, 64, 8.0),
    ("d256_ring1024_b3_t1_g2", (3, 1, 16, 8, 1024, 256), "ring", 1024, True, jnp.bfloat16, None, 1.0),
    ("d256_ring1039_t16_fp8", (3, 16, 16, 8, 1039, 256), "ring", 1024, True, F8, None, 1.0),
    ("d256_ring_w5_small", (3, 2, 2, 1, 6, 256), "ring", 5, True, jnp.bfloat16, None, 1.0),
    ("d256_ring_w5_fp8_small", (3, 16, 16, 1, 20, 256), "ring", 5, True, F8, None, 1.0),
    ("d256_window_noring", (3, 2, 8, 1, 4097, 256), None, 1024, False, jnp.bfloat16, None, 1.0),
    ("d256_full_g1", (1, 16, 8, 8, 97, 256), None, None, False, jnp.bfloat16, None, 1.0),
    ("d256_rows32_window", (3, 16, 4, 2, 97, 256), None, 64, False, jnp.bfloat16, None, 1.0),
    ("d256_large_fp8", (3, 1, 4, 2, 97, 256), None, None, False, F8, None, 8.0),
)


def _lengths(rng, kind, b, t, s, window):
    if kind == "ring":  # short rows, a full ring, far past S
        return np.array([1, s, 7 * s + int(rng.integers(0, s))][:b] + [s] * max(0, b - 3))
    base = [1, s, int(rng.integers(1, s + 1))]
    return np.array((base * b)[:b])


class DecodeAttentionGpuTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "decode_attention")

    @parameterized.named_parameters(*GPU_CASES)
    def test_kernel_matches_brute_force(self, shape, lengths, window, ring, dtype, rotary, mag):
        seed = _fresh_seed()
        rng = np.random.default_rng(seed)
        b, t, hq, hkv, s, d = shape
        q, k, v = _inputs(rng, b, t, hq, hkv, s, d, dtype, mag)
        kv_len = _lengths(rng, lengths, b, t, s, window)
        fn = jax.jit(lambda q, k, v, n: ffi.decode_attention(
            q, k, v, n, window=window, ring=ring, rotary_keys_only=rotary))
        got = testing.call_with_poisoned_outputs(fn, q, k, v, jnp.asarray(kv_len, jnp.int32))
        want, sees = brute_force(q, k, v, kv_len, window=window, ring=ring, rotary=rotary)
        assert_close(self, got, q, k, v, want, sees, scale=None, seed=seed,
                     what=f"kv_len {kv_len.tolist()}")
        again = fn(q, k, v, jnp.asarray(kv_len, jnp.int32))
        np.testing.assert_array_equal(np.asarray(again).view(np.uint16),
                                      np.asarray(got).view(np.uint16),
                                      err_msg=f"seed {seed}: two runs differ")

    @parameterized.named_parameters(
        ("d512_small", (2, 2, 16, 1, 97, 512), jnp.bfloat16, None, False, 64),
        ("d256_ring_small", (2, 3, 4, 2, 40, 256), F8, 8, True, None),
    )
    def test_pieces_partials_and_empty_pieces(self, shape, dtype, window, ring, rotary):
        # Every piece count from one to more pieces than tiles (empty pieces: m = -inf, l = 0,
        # o = 0) gives the same answer; every workspace element is written (poisoned first).
        seed = _fresh_seed()
        rng = np.random.default_rng(seed)
        b, t, hq, hkv, s, d = shape
        q, k, v = _inputs(rng, b, t, hq, hkv, s, d, dtype)
        kv_len = np.array([s, 3 * s + 5] if ring else [s, 2])
        want, sees = brute_force(q, k, v, kv_len, window=window, ring=ring, rotary=rotary)
        for pieces in (1, 2, 3, 7, 64):
            fn = jax.jit(lambda q, k, v, n, pieces=pieces: _target_call(
                q, k, v, n, pieces=pieces, scale=d**-0.5, window=window or 0, ring=ring,
                rotary=rotary))
            o, o_part, ml = testing.call_with_poisoned_outputs(
                fn, q, k, v, jnp.asarray(kv_len, jnp.int32))
            assert_close(self, o, q, k, v, want, sees, scale=None, seed=seed,
                         what=f"pieces {pieces}")
            o_part, ml = np.asarray(o_part), np.asarray(ml)
            self.assertTrue(np.all(np.isfinite(o_part)), f"seed {seed} pieces {pieces}")
            self.assertFalse(np.any(np.isnan(ml)), f"seed {seed} pieces {pieces}")
            empty = ml[..., 0] == -np.inf
            np.testing.assert_array_equal(ml[..., 1][empty], 0)
            np.testing.assert_array_equal(o_part[empty], 0)
            if pieces == 64:
                self.assertTrue(empty.any(), "64 pieces of a short row leave some empty")

    def test_inside_cuda_graph(self):
        """In a child process with XLA command buffers (CUDA graphs) forced on for custom calls:
        the handler's attribute queries and both launches under capture, replayed with new
        lengths (kv_len is read on the device)."""
        script = textwrap.dedent("""
            import sys
            sys.path.insert(0, %r)
            import jax, jax.numpy as jnp, numpy as np
            from jax_mila import ffi
            from test_decode_attention import brute_force, _inputs
            rng = np.random.default_rng(5)
            q, k, v = _inputs(rng, 2, 2, 8, 2, 300, 256, jnp.float8_e4m3fn)
            f = jax.jit(lambda *a: ffi.decode_attention(*a, window=64, ring=True))
            for lens in ([300, 7], [1000, 65], [301, 2]):
                got = np.asarray(f(q, k, v, jnp.asarray(lens, jnp.int32)), np.float64)
                want, _ = brute_force(q, k, v, np.array(lens), window=64, ring=True)
                assert np.abs(got - want).max() < 2e-2, (lens, np.abs(got - want).max())
            print("CHILD OK")
        """ % os.path.dirname(os.path.abspath(__file__)))
        testing.assert_child_ok_in_cuda_graphs(self, script)

    def test_vmap(self):
        seed = _fresh_seed()
        rng = np.random.default_rng(seed)
        q, k, v = _inputs(rng, 2, 1, 16, 1, 97, 512, jnp.bfloat16)
        q2, k2, v2 = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
        lens = jnp.array([[97, 3], [5, 60]], jnp.int32)
        got = jax.vmap(lambda *a: ffi.decode_attention(*a, rotary_keys_only=64))(q2, k2, v2, lens)
        for i in range(2):
            want, sees = brute_force(q2[i], k2[i], v2[i], np.asarray(lens[i]), rotary=64)
            assert_close(self, got[i], q2[i], k2[i], v2[i], want, sees, scale=None, seed=seed,
                         what=f"vmap element {i}")

    def test_handler_rejects_bad_calls(self):
        q = jnp.zeros((1, 1, 2, 256), jnp.bfloat16)
        k = jnp.zeros((1, 8, 1, 256), jnp.bfloat16)
        n = jnp.array([4], jnp.int32)
        with self.assertRaisesRegex(Exception, "decode_attention: rotary_keys_only"):
            jax.block_until_ready(_target_call(q, k, k, n, pieces=1, scale=1.0, rotary=24))
        with self.assertRaisesRegex(Exception, "decode_attention: workspace"):
            out = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                   jax.ShapeDtypeStruct((1, 1, 2, 2, 256), jnp.float32),
                   jax.ShapeDtypeStruct((1, 1, 2, 2, 2), jnp.float32))
            jax.block_until_ready(jax.ffi.ffi_call(da.TARGET, out)(
                q, k, k, n, scale=np.float32(1), window=np.int64(0), ring=False,
                rotary=np.int64(128), pieces=np.int64(3)))
        with self.assertRaisesRegex(Exception, "decode_attention: ring"):
            jax.block_until_ready(_target_call(q, k, k, n, pieces=1, scale=1.0, ring=True))


if __name__ == "__main__":
    absltest.main()
