"""jax_mila.dot_product_attention against jax.nn.dot_product_attention.

- The signature is jax's (names, kinds, defaults).
- Fallback calls return exactly what jax.nn.dot_product_attention returns (bitwise): every
  argument reaches jax (masks, bias, windows, lengths, GQA, 3-D inputs, residuals; head dims
  64, 128, 256, 512). On CPU every call falls back, so these run everywhere.
- The kernel path (implementation="mila": on CPU the op's pure-JAX reference, on a GPU the
  kernel) against a float32 oracle, jax.nn.dot_product_attention(implementation="xla") on the
  inputs upcast to float32, with the criterion of tests/test_flash_attention.py:
      max|o - oracle| <= 2 * max|jax_bf16 - oracle| + FLOOR * max(1, max|oracle|)
  where jax_bf16 is jax.nn.dot_product_attention on the bf16 inputs; rows past
  query_seq_lengths exactly zero as jax's; the residual (log-sum-exp) within bf16 rounding.
  Cases: causal, windows as jax defines them ((left, right), an int, (left, 0) without
  is_causal), query/key lengths, GQA up to 16 query heads per KV head, odd and unequal T/S.
- Gradients on the kernel path are jax's.
- The dispatch decision (kernel_plan, device_unsupported_reason) directly, the fallback log
  (once per reason), and errors (jax's own for bad shapes; implementation="mila" on a call the
  kernels cannot take).
- GPU class (skips without the kernel): the default call runs the kernel (no fallback logged)
  and meets the same criterion.
Inputs are drawn from a fresh seed each run; the seed is in every failure message.
"""

from __future__ import annotations

import inspect
import logging
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jax_mila
from jax_mila import attention_api, ffi
import testing  # tests/testing.py
from jax_mila.ffi import _registry

FLOOR = 2.0**-8
LSE_ATOL = 1e-3
LSE_RTOL_DOT = 2e-5
OP = attention_api.OP


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _qkv(seed, b, t, s, n, kh, d, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, n, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, kh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, kh, d), jnp.float32).astype(dtype)
    return q, k, v


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


# (name, b, t, s, n, k, d, kwargs, lengths) for the kernel path. lengths: None, "q" (query
# lengths), "same" (one array as both), or (q_lengths, kv_lengths) concrete.
KERNEL_CASES = (
    ("causal_d256", 2, 97, 97, 8, 2, 256, dict(is_causal=True), None),
    ("causal_d512_gqa16", 1, 97, 97, 16, 1, 512, dict(is_causal=True), None),
    ("causal_t1", 1, 1, 1, 4, 4, 256, dict(is_causal=True), None),
    ("causal_t_lt_s", 1, 33, 80, 4, 2, 256, dict(is_causal=True), None),
    ("causal_t_gt_s", 1, 80, 33, 4, 2, 256, dict(is_causal=True), None),
    ("window_int", 2, 97, 97, 4, 2, 256, dict(is_causal=True, local_window_size=7), None),
    ("window_left_right", 1, 97, 97, 4, 1, 512,
     dict(is_causal=True, local_window_size=(16, 3)), None),
    ("window_no_causal_flag", 1, 97, 97, 8, 4, 256,
     dict(is_causal=False, local_window_size=(10, 0)), None),
    ("window_zero", 1, 40, 40, 2, 2, 256, dict(is_causal=True, local_window_size=(0, 0)), None),
    ("window_wider_than_t", 1, 40, 40, 2, 2, 256,
     dict(is_causal=True, local_window_size=(100, 0)), None),
    ("scale", 1, 50, 50, 4, 2, 256, dict(is_causal=True, scale=0.5), None),
    ("q_lengths", 3, 97, 97, 4, 2, 256, dict(is_causal=True), "q"),
    ("same_lengths_window", 3, 97, 97, 4, 2, 512, dict(is_causal=True, local_window_size=9),
     "same"),
    ("concrete_kv_lengths", 2, 64, 64, 4, 2, 256, dict(is_causal=True),
     ((40, 64), (40, 70))),
    ("zero_q_length", 2, 30, 30, 2, 1, 256, dict(is_causal=True), ((0, 30), (0, 30))),
)


class _Compare(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        _registry.reset_fallback_log()

    def check_against_oracle(self, fn, case, seed):
        b, t, s, n, kh, d, kwargs, lengths = case
        q, k, v = _qkv(seed, b, t, s, n, kh, d)
        rng = np.random.default_rng(seed)
        ql = kvl = None
        if lengths == "q":
            ql = jnp.asarray(rng.integers(1, t + 1, size=b), jnp.int32)
        elif lengths == "same":
            ql = kvl = jnp.asarray(rng.integers(1, t + 1, size=b), jnp.int32)
        elif lengths is not None:
            ql, kvl = (jnp.asarray(x, jnp.int32) for x in lengths)
        kw = dict(kwargs, query_seq_lengths=ql, key_value_seq_lengths=kvl)
        # Each side jitted whole (one compile, not one per op); the lengths stay concrete
        # constants, as the eager caller's would be.
        o, lse = jax.jit(lambda q, k, v: fn(q, k, v, return_residual=True, **kw))(q, k, v)

        @jax.jit
        def oracle(q, k, v):
            with jax.default_matmul_precision("highest"):
                return jax.nn.dot_product_attention(
                    *(x.astype(jnp.float32) for x in (q, k, v)), return_residual=True,
                    implementation="xla", **kw)

        ref_o, ref_lse = oracle(q, k, v)
        jax_o = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="xla", **kw))(q, k, v)
        ctx = f"b={b} t={t} s={s} n={n} k={kh} d={d} {kwargs} lengths={lengths} seed={seed}"
        self.assertEqual(o.shape, q.shape, ctx)
        self.assertEqual(o.dtype, q.dtype, ctx)
        self.assertEqual(lse.shape, (b, t, n), ctx)
        self.assertEqual(lse.dtype, k.dtype, ctx)
        ref = _f32(ref_o)
        err = float(np.max(np.abs(_f32(o) - ref)))
        err_jax = float(np.max(np.abs(_f32(jax_o) - ref)))
        bound = 2 * err_jax + FLOOR * max(1.0, float(np.max(np.abs(ref))))
        self.assertLessEqual(err, bound, f"o error {err:.3g} > {bound:.3g} (jax bf16 "
                                         f"{err_jax:.3g}); {ctx}")
        limit = np.asarray(ql)[:, None] if ql is not None else np.full((b, 1), t)
        rows = np.arange(t)[None, :] < limit  # [B, T]: rows before query_seq_lengths
        self.assertTrue(np.all(_f32(o)[~rows] == 0), f"rows past query_seq_lengths; {ctx}")
        lse32, ref_lse32 = _f32(lse), _f32(ref_lse)
        # Masked rows carry jax's large negative logit, as jax's residual does.
        np.testing.assert_array_equal(lse32[~rows], _f32(ref_lse.astype(k.dtype))[~rows], ctx)
        scale = kwargs.get("scale", d**-0.5)
        qmax, kmax = float(jnp.max(jnp.abs(_f32(q)))), float(jnp.max(jnp.abs(_f32(k))))
        tol = (LSE_ATOL + LSE_RTOL_DOT * scale * d * qmax * kmax
               + 2.0**-8 * np.abs(ref_lse32[rows]))  # + the bf16 rounding of the residual
        lse_err = np.abs(lse32[rows] - ref_lse32[rows])
        self.assertTrue(np.all(lse_err <= tol), f"lse error {lse_err.max():.3g}; {ctx}")
        return o


class SignatureTest(absltest.TestCase):

    def test_signature_is_jax(self):
        ours = inspect.signature(jax_mila.dot_product_attention).parameters
        theirs = inspect.signature(jax.nn.dot_product_attention).parameters
        self.assertEqual(list(ours), list(theirs))
        for name, p in theirs.items():
            self.assertEqual(ours[name].kind, p.kind, name)
            self.assertEqual(ours[name].default, p.default, name)

    def test_exports(self):
        from jax_mila import dot_product_attention
        self.assertIs(dot_product_attention, attention_api.dot_product_attention)


class FallbackTest(parameterized.TestCase):
    """Fallback calls return jax's result exactly (the device is made to refuse the kernel, so
    that calls the kernel would take fall back on a GPU too)."""

    def setUp(self):
        super().setUp()
        _registry.reset_fallback_log()
        refuse = mock.patch.object(attention_api, "device_unsupported_reason",
                                   return_value="no kernel (test)")
        refuse.start()
        self.addCleanup(refuse.stop)

    @parameterized.named_parameters(
        ("d64_plain", 64, jnp.float32, dict()),
        ("d128_causal_gqa", 128, jnp.bfloat16, dict(is_causal=True)),
        ("d256_noncausal", 256, jnp.bfloat16, dict()),
        ("d512_symmetric_window", 512, jnp.bfloat16, dict(local_window_size=5)),
        ("d256_causal_window", 256, jnp.bfloat16, dict(is_causal=True,
                                                        local_window_size=(4, 2))),
        ("d256_causal_f32", 256, jnp.float32, dict(is_causal=True)),
        ("d128_scale", 128, jnp.bfloat16, dict(is_causal=True, scale=0.3)),
    )
    def test_same_as_jax(self, d, dtype, kwargs):
        seed = _seed()
        b, t, s, n, kh = 2, 37, 29, 6, 2
        q, k, v = _qkv(seed, b, t, s, n, kh, d, dtype)
        rng = np.random.default_rng(seed)
        extras = (
            dict(),
            dict(mask=jnp.asarray(rng.random((b, 1, t, s)) < 0.7)),
            dict(bias=jnp.asarray(rng.normal(size=(1, n, t, s)), dtype)),
            dict(query_seq_lengths=jnp.asarray([5, 37], jnp.int32),
                 key_value_seq_lengths=jnp.asarray([29, 3], jnp.int32)),
        )
        for i, extra in enumerate(extras):
            # Eager, like jax's own call here (the two share its per-op compilations).
            kw = dict(kwargs, return_residual=bool(i % 2), **extra)
            got = jax_mila.dot_product_attention(q, k, v, **kw)
            want = jax.nn.dot_product_attention(q, k, v, **kw)
            self.assertEqual(len(jax.tree.leaves(got)), 1 + i % 2)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                self.assertEqual(g.dtype, w.dtype)
                np.testing.assert_array_equal(_f32(g), _f32(w), f"seed={seed} {sorted(kw)}")

    def test_three_dim_inputs(self):
        q, k, v = _qkv(_seed(), 1, 21, 21, 4, 2, 128)
        got = jax_mila.dot_product_attention(q[0], k[0], v[0], is_causal=True)
        want = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
        np.testing.assert_array_equal(_f32(got), _f32(want))

    def test_logged_once_per_reason(self):
        q, k, v = _qkv(_seed(), 1, 8, 8, 2, 2, 128)
        with self.assertLogs("jax_mila", logging.INFO) as logs:
            for _ in range(3):
                jax_mila.dot_product_attention(q, k, v, is_causal=True)
            logging.getLogger("jax_mila").info("end")
        mine = [r for r in logs.output if "dot_product_attention falls back" in r]
        self.assertLen(mine, 1, logs.output)
        self.assertIn("head_dim=128", mine[0])
        self.assertIn("jax.nn.dot_product_attention", mine[0])
        self.assertIn((OP, "head_dim=128 (the kernels take head_dim in (256, 512))"),
                      _registry.logged_fallbacks())

    def test_implementation_passes_through(self):
        q, k, v = _qkv(_seed(), 1, 8, 8, 2, 2, 128)
        with mock.patch.object(jax.nn, "dot_product_attention",
                               wraps=jax.nn.dot_product_attention) as spy:
            jax_mila.dot_product_attention(q, k, v, implementation="xla")
        self.assertEqual(spy.call_args.kwargs["implementation"], "xla")


class KernelPathTest(_Compare):
    """implementation="mila": the flash_attention op under the plan (CPU: its reference)."""

    @parameterized.named_parameters(*KERNEL_CASES)
    def test_against_oracle(self, *case):
        def fn(*args, **kwargs):
            return jax_mila.dot_product_attention(*args, implementation="mila", **kwargs)

        self.check_against_oracle(fn, case, _seed())

    def test_under_jit_with_traced_lengths(self):
        case = (2, 97, 97, 4, 2, 256, dict(is_causal=True), "same")

        @jax.jit
        def fn(q, k, v, query_seq_lengths, key_value_seq_lengths):
            # Under jit the lengths are tracers; one array passed as both takes the kernel path.
            return jax_mila.dot_product_attention(
                q, k, v, is_causal=True, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=query_seq_lengths, return_residual=True,
                implementation="mila")

        def call(q, k, v, *, return_residual, query_seq_lengths, key_value_seq_lengths, **kw):
            # (check_against_oracle jits this again; fn's lengths are its own arguments)
            return fn(q, k, v, query_seq_lengths, key_value_seq_lengths)

        self.check_against_oracle(call, case, _seed())

    def test_three_dim_inputs(self):
        q, k, v = _qkv(_seed(), 1, 21, 21, 4, 2, 256)
        got = jax_mila.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                             implementation="mila")
        want = jax_mila.dot_product_attention(q, k, v, is_causal=True, implementation="mila")
        self.assertEqual(got.shape, q[0].shape)
        np.testing.assert_array_equal(_f32(got), _f32(want[0]))

    def test_runs_the_op(self):
        q, k, v = _qkv(_seed(), 1, 16, 16, 2, 1, 256)
        with mock.patch.object(ffi, "flash_attention", wraps=ffi.flash_attention) as spy:
            jax_mila.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 9),
                                           implementation="mila")
        spy.assert_called_once()
        self.assertEqual(spy.call_args.kwargs["window"], 4)
        self.assertIs(spy.call_args.kwargs["causal"], True)

    def test_default_takes_kernel_where_the_device_can(self):
        """With a device that can run the kernel (mocked), the default call runs the op."""
        q, k, v = _qkv(_seed(), 1, 16, 16, 2, 1, 256)
        with mock.patch.object(attention_api, "device_unsupported_reason", return_value=None), \
                mock.patch.object(ffi, "flash_attention", wraps=ffi.flash_attention) as spy:
            got = jax_mila.dot_product_attention(q, k, v, is_causal=True)
        spy.assert_called_once()
        want = jax_mila.dot_product_attention(q, k, v, is_causal=True, implementation="mila")
        np.testing.assert_array_equal(_f32(got), _f32(want))

    def test_gradients_are_jax(self):
        seed = _seed()
        q, k, v = _qkv(seed, 2, 33, 33, 4, 2, 256)
        ql = jnp.asarray([20, 33], jnp.int32)

        def loss(attn, **kw):
            def f(q, k, v):
                o = attn(q, k, v, is_causal=True, local_window_size=(8, 0),
                         query_seq_lengths=ql, key_value_seq_lengths=ql, **kw)
                return jnp.sum(o.astype(jnp.float32) * jnp.arange(o.shape[-1]))
            return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

        got = jax.jit(lambda: loss(jax_mila.dot_product_attention, implementation="mila"))()
        want = jax.jit(lambda: loss(jax.nn.dot_product_attention))()
        for g, w in zip(got, want):
            if testing.has_cuda():  # one computation in two programs: XLA may fuse it apart
                self.assertLess(testing.rel_fro_err(_f32(g), _f32(w)), 1e-2, f"seed={seed}")
            else:
                np.testing.assert_array_equal(_f32(g), _f32(w), f"seed={seed}")


class PlanTest(parameterized.TestCase):
    """kernel_plan: which calls the op computes exactly as jax defines them."""

    def plan(self, d=256, dtype=jnp.bfloat16, t=64, s=64, n=4, kh=2, b=2, **kw):
        q = jax.ShapeDtypeStruct((b, t, n, d), dtype)
        k = jax.ShapeDtypeStruct((b, s, kh, d), dtype)
        return attention_api.kernel_plan(q, k, k, **kw)

    @parameterized.named_parameters(
        ("causal", dict(is_causal=True), None),
        ("causal_int_window", dict(is_causal=True, local_window_size=5), 6),
        ("causal_right_side_ignored", dict(is_causal=True, local_window_size=(5, 3)), 6),
        ("right_zero_is_causal", dict(local_window_size=(5, 0)), 6),
        ("window_zero", dict(is_causal=True, local_window_size=(0, 0)), 1),
        ("window_hides_nothing", dict(is_causal=True, local_window_size=(63, 0)), None),
        ("window_hides_one", dict(is_causal=True, local_window_size=(62, 0)), 63),
    )
    def test_windows(self, kwargs, window):
        plan, reason = self.plan(**kwargs)
        self.assertIsNone(reason)
        self.assertEqual(plan.window, window)
        self.assertFalse(plan.zero_rows)

    def test_default_scale(self):
        plan, _ = self.plan(d=512, is_causal=True)
        self.assertAlmostEqual(plan.scale, 512**-0.5)
        plan, _ = self.plan(is_causal=True, scale=1.0)
        self.assertEqual(plan.scale, 1.0)

    @parameterized.named_parameters(
        ("non_causal", dict(), "non-causal"),
        ("symmetric_window", dict(local_window_size=4), "non-causal"),
        ("right_window", dict(local_window_size=(4, 1)), "non-causal"),
        ("negative_window", dict(is_causal=True, local_window_size=(-1, 0)), "negative"),
        ("bias", dict(is_causal=True, bias=jnp.zeros((1, 4, 64, 64))), "bias"),
        ("mask", dict(is_causal=True, mask=jnp.ones((1, 1, 64, 64), bool)), "mask"),
        ("d64", dict(is_causal=True, d=64), "head_dim=64"),
        ("d128", dict(is_causal=True, d=128), "head_dim=128"),
        ("float32", dict(is_causal=True, dtype=jnp.float32), "dtype float32"),
        ("float16", dict(is_causal=True, dtype=jnp.float16), "dtype float16"),
        ("groups_32", dict(is_causal=True, n=32, kh=1), "32 query heads over 1 KV heads"),
        ("scale_inf", dict(is_causal=True, scale=float("inf")), "scale"),
        ("scale_string", dict(is_causal=True, scale="1"), "scale"),
        ("empty", dict(is_causal=True, t=0), "empty"),
        ("window_leaves_rows_without_keys", dict(is_causal=True, local_window_size=(3, 0),
                                                 t=64, s=60), "see no key"),
    )
    def test_reasons(self, kwargs, fragment):
        plan, reason = self.plan(**kwargs)
        self.assertIsNone(plan)
        self.assertIn(fragment, reason)

    def test_traced_scale(self):
        seen = []

        @jax.jit
        def f(scale):
            seen.append(self.plan(is_causal=True, scale=scale))
            return scale

        f(1.0)
        self.assertIsNone(seen[0][0])
        self.assertIn("traced", seen[0][1])

    def test_lengths(self):
        ql = jnp.asarray([10, 64], jnp.int32)
        plan, reason = self.plan(is_causal=True, query_seq_lengths=ql)
        self.assertIsNone(reason)
        self.assertTrue(plan.zero_rows)
        # One array for both: the key limit hides nothing a valid row sees.
        plan, reason = self.plan(is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=ql)
        self.assertIsNone(reason)
        # Concrete key lengths: fine where they cover every key a valid row sees.
        plan, reason = self.plan(is_causal=True, query_seq_lengths=ql,
                                 key_value_seq_lengths=jnp.asarray([10, 64], jnp.int32))
        self.assertIsNone(reason)
        plan, reason = self.plan(is_causal=True, query_seq_lengths=ql,
                                 key_value_seq_lengths=jnp.asarray([9, 64], jnp.int32))
        self.assertIn("key_value_seq_lengths shorter", reason)
        plan, reason = self.plan(is_causal=True,
                                 key_value_seq_lengths=jnp.asarray([64, 63], jnp.int32))
        self.assertIn("key_value_seq_lengths shorter", reason)
        # Query rows that are all padding need no keys.
        plan, reason = self.plan(is_causal=True, query_seq_lengths=jnp.asarray([0, 5], jnp.int32),
                                 key_value_seq_lengths=jnp.asarray([0, 5], jnp.int32))
        self.assertIsNone(reason)
        # A window leaves rows past S + left without keys unless query lengths stop before them.
        window = dict(is_causal=True, local_window_size=(3, 0), t=64, s=60)
        plan, reason = self.plan(query_seq_lengths=jnp.asarray([63, 10], jnp.int32), **window)
        self.assertIsNone(reason)
        plan, reason = self.plan(query_seq_lengths=jnp.asarray([64, 10], jnp.int32), **window)
        self.assertIn("see no key", reason)

    def test_traced_lengths(self):
        out = {}

        @jax.jit
        def f(ql, kvl):
            out["kv_alone"] = self.plan(is_causal=True, key_value_seq_lengths=kvl)
            out["both_distinct"] = self.plan(is_causal=True, query_seq_lengths=ql,
                                             key_value_seq_lengths=kvl)
            out["same"] = self.plan(is_causal=True, query_seq_lengths=ql,
                                    key_value_seq_lengths=ql)
            out["q_only"] = self.plan(is_causal=True, query_seq_lengths=ql)
            out["q_window"] = self.plan(is_causal=True, query_seq_lengths=ql,
                                        local_window_size=(3, 0), t=64, s=60)
            return ql

        lengths = jnp.asarray([10, 64], jnp.int32)
        f(lengths, lengths)
        self.assertIn("traced key_value_seq_lengths", out["kv_alone"][1])
        self.assertIn("traced key_value_seq_lengths", out["both_distinct"][1])
        self.assertIsNone(out["same"][1])
        self.assertIsNone(out["q_only"][1])
        self.assertIn("see no key", out["q_window"][1])


class DispatchTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        _registry.reset_fallback_log()

    def test_device_reason_without_gpu(self):
        if testing.has_cuda():
            self.skipTest("a CUDA device is present")
        q = jax.ShapeDtypeStruct((1, 8, 2, 256), jnp.bfloat16)
        self.assertIn("no CUDA device", attention_api.device_unsupported_reason(q, q))

    def test_device_reasons_mocked(self):
        q512 = jax.ShapeDtypeStruct((1, 8, 2, 512), jnp.bfloat16)
        not_built = _registry.OpStatus("flash_attention", False, "not built here")
        with mock.patch.object(attention_api, "cuda_capabilities", return_value=((9, 0),)), \
                mock.patch.object(attention_api, "status", return_value=not_built):
            self.assertEqual(attention_api.device_unsupported_reason(q512, q512),
                             "not built here")
        built = _registry.OpStatus("flash_attention", True, "built")
        with mock.patch.object(attention_api, "cuda_capabilities", return_value=((8, 9),)), \
                mock.patch.object(attention_api, "status", return_value=built), \
                mock.patch.object(attention_api.ffi_attention, "_target",
                                  return_value="jax_mila_flash_attention_d512"):
            self.assertIn("shared memory",
                          attention_api.device_unsupported_reason(q512, q512))
        with mock.patch.object(attention_api, "cuda_capabilities", return_value=((9, 0),)), \
                mock.patch.object(attention_api, "status", return_value=built), \
                mock.patch.object(attention_api.ffi_attention, "_target",
                                  return_value="jax_mila_flash_attention_d512_sm90"):
            self.assertIsNone(attention_api.device_unsupported_reason(q512, q512))

    def test_device_fallback_is_logged_and_exact(self):
        q, k, v = _qkv(_seed(), 1, 16, 16, 2, 1, 256)
        with mock.patch.object(attention_api, "device_unsupported_reason",
                               return_value="no GPU (test)"), \
                mock.patch.object(ffi, "flash_attention") as op:
            got = jax_mila.dot_product_attention(q, k, v, is_causal=True)
        op.assert_not_called()
        np.testing.assert_array_equal(
            _f32(got), _f32(jax.nn.dot_product_attention(q, k, v, is_causal=True)))
        self.assertIn((OP, "no GPU (test)"), _registry.logged_fallbacks())

    def test_mila_refuses_what_the_kernels_cannot_take(self):
        q, k, v = _qkv(_seed(), 1, 16, 16, 2, 1, 128)
        with self.assertRaisesRegex(ValueError, "implementation='mila'.*head_dim=128"):
            jax_mila.dot_product_attention(q, k, v, is_causal=True, implementation="mila")
        q, k, v = _qkv(_seed(), 1, 16, 16, 2, 1, 256)
        with self.assertRaisesRegex(ValueError, "non-causal"):
            jax_mila.dot_product_attention(q, k, v, implementation="mila")

    def test_bad_implementation(self):
        q, k, v = _qkv(_seed(), 1, 4, 4, 2, 1, 256)
        with self.assertRaisesRegex(ValueError, "implementation='triton'.*supported"):
            jax_mila.dot_product_attention(q, k, v, implementation="triton")

    @parameterized.named_parameters(
        ("value_shape", lambda q, k, v: (q, k, v[:, :-1]), {}),
        ("query_head_dim", lambda q, k, v: (q[..., :128], k, v), {}),
        ("dtype_mix", lambda q, k, v: (q.astype(jnp.float32), k, v), {}),
        ("heads_not_multiple", lambda q, k, v: (q[:, :, :3], k, v), {}),
        ("lengths_int16", lambda q, k, v: (q, k, v),
         dict(query_seq_lengths=np.array([3], np.int16))),
        ("lengths_shape", lambda q, k, v: (q, k, v),
         dict(query_seq_lengths=jnp.array([3, 4], jnp.int32))),
    )
    def test_errors_are_jax(self, change, kwargs):
        """Bad arguments raise jax's ValueError, also where the kernel path would apply."""
        q, k, v = _qkv(_seed(), 1, 8, 8, 4, 2, 256)
        args = change(q, k, v)
        with self.assertRaises(ValueError) as theirs:
            jax.nn.dot_product_attention(*args, is_causal=True, **kwargs)
        for impl in (None, "mila"):
            with self.assertRaises(ValueError) as ours:
                jax_mila.dot_product_attention(*args, is_causal=True, implementation=impl,
                                               **kwargs)
            self.assertEqual(str(ours.exception), str(theirs.exception))


class GpuTest(_Compare):
    """On a GPU with the kernel built: the default call runs the kernel."""

    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "flash_attention")

    @parameterized.named_parameters(*KERNEL_CASES)
    def test_default_runs_kernel(self, *case):
        b, t, s, n, kh, d = case[:6]
        q = jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((b, s, kh, d), jnp.bfloat16)
        reason = attention_api.device_unsupported_reason(q, k)
        if reason is not None:
            self.skipTest(reason)
        self.check_against_oracle(jax_mila.dot_product_attention, case, _seed())
        self.assertEqual([f for f in _registry.logged_fallbacks()
                          if f[0] in (OP, "flash_attention")], [])


if __name__ == "__main__":
    absltest.main()
