"""Activation quantizer: reference properties and validation (CPU), kernel parity (GPU); the
same for quantize_geglu, the quantizer of gelu_tanh(gate) * up, and for add_rms_norm_quantize,
the quantizer of a decoder layer's RMS norms, each against a numpy interval oracle."""

import functools
import os
import re
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi, reference
from jax_mila.gemma4.mlp import gelu_tanh
from jax_mila.nn.norm import rms_norm
import testing  # tests/testing.py

E4M3_MAX = 448.0


def fresh_key():
    return jax.random.key(int.from_bytes(os.urandom(4), "little"))


def random_rows(shape, scale=3.0):
    return (jax.random.normal(fresh_key(), shape, jnp.float32) * scale).astype(jnp.bfloat16)


def e4m3_steps(q_a, q_b):
    """Distance between two e4m3 arrays in units of the local e4m3 spacing."""
    a = np.asarray(q_a, np.float32)
    b = np.asarray(q_b, np.float32)
    spacing = np.maximum(np.abs(b) * 2.0**-3, 2.0**-9)
    return np.abs(a - b) / spacing


class ReferenceTest(parameterized.TestCase):
    def test_round_trip_within_one_step(self):
        x = random_rows((37, 4096))
        q, s = reference.quantize_activations(x)
        x_hat = reference.dequantize_activations(q, s)
        xf = np.asarray(x, np.float32)
        step = np.asarray(s)[:, None] * np.maximum(np.abs(np.asarray(q, np.float32)) * 2.0**-3,
                                                   2.0**-9)
        self.assertTrue(np.all(np.abs(np.asarray(x_hat) - xf) <= step))

    def test_row_max_saturates_to_448(self):
        x = random_rows((16, 256), scale=1e4)
        q, s = reference.quantize_activations(x)
        qf = np.abs(np.asarray(q, np.float32))
        np.testing.assert_array_equal(qf.max(axis=1), np.full(16, E4M3_MAX))
        np.testing.assert_array_equal(
            np.asarray(s), np.abs(np.asarray(x, np.float32)).max(1) * np.float32(1 / 448))

    def test_zero_and_tiny_rows_dequantize_to_exact_zeros(self):
        x = random_rows((4, 64)).at[1].set(0).at[2].set(jnp.bfloat16(1e-38))
        q, s = reference.quantize_activations(x)
        self.assertEqual(float(s[1]), 1.0)
        self.assertEqual(float(s[2]), 1.0)
        x_hat = np.asarray(reference.dequantize_activations(q, s))
        np.testing.assert_array_equal(x_hat[1:3], 0.0)
        self.assertTrue(np.all(np.isfinite(x_hat)))

    def test_large_magnitudes_stay_finite(self):
        x = jnp.full((2, 32), jnp.finfo(jnp.bfloat16).max, jnp.bfloat16).at[1, ::2].multiply(-1)
        q, s = reference.quantize_activations(x)
        self.assertTrue(np.all(np.isfinite(np.asarray(q, np.float32))))
        self.assertTrue(np.all(np.isfinite(np.asarray(s))))
        np.testing.assert_array_equal(np.abs(np.asarray(q, np.float32)), E4M3_MAX)

    def test_dtypes_and_shapes(self):
        x = random_rows((2, 3, 48))
        q, s = ffi.quantize_activations(x)
        self.assertEqual(q.dtype, jnp.float8_e4m3fn)
        self.assertEqual(s.dtype, jnp.float32)
        self.assertEqual(q.shape, (2, 3, 48))
        self.assertEqual(s.shape, (2, 3))

    def test_wrapper_under_jit_matches_reference(self):
        x = random_rows((5, 32))
        q, s = jax.jit(ffi.quantize_activations)(x)
        q_ref, s_ref = reference.quantize_activations(x)
        np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_ref, np.float32))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


class ValidationTest(parameterized.TestCase):
    @parameterized.named_parameters(
        dict(testcase_name="float32", x=jax.ShapeDtypeStruct((4, 32), jnp.float32),
             pattern="x: dtype float32 is not supported.*bfloat16"),
        dict(testcase_name="rank1", x=jax.ShapeDtypeStruct((32,), jnp.bfloat16),
             pattern="x: expected rank >= 2"),
        dict(testcase_name="k_not_multiple_of_16", x=jax.ShapeDtypeStruct((4, 30), jnp.bfloat16),
             pattern="x: K=30 .*multiple of 16"),
        dict(testcase_name="empty", x=jax.ShapeDtypeStruct((0, 32), jnp.bfloat16),
             pattern="x: empty arrays are not supported"),
        # Abstract, never allocated: the kernels index rows in int32.
        dict(testcase_name="rows_past_int32", x=jax.ShapeDtypeStruct((2**31, 16), jnp.bfloat16),
             pattern=r"x: 2147483648 rows of K=16 are not supported"),
    )
    def test_bad_input_raises_at_trace_time(self, x, pattern):
        with self.assertRaisesRegex(ValueError, "jax_mila.quantize_activations: " + pattern):
            jax.eval_shape(ffi.quantize_activations, x)


class KernelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "quantize_activations")

    def assert_matches_reference(self, x, q, s):
        q_ref, s_ref = reference.quantize_activations(x)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
        steps = e4m3_steps(q, q_ref)
        self.assertLessEqual(float(steps.max()), 1.0, "more than one e4m3 step from reference")

    @parameterized.named_parameters(
        dict(testcase_name="one_row", shape=(1, 16)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="gemma_down_proj", shape=(1024, 15360)),
        dict(testcase_name="longer_than_register_cache", shape=(9, 40000)),
    )
    def test_matches_reference_with_poisoned_outputs(self, shape):
        x = random_rows(shape).reshape(-1, shape[-1]).at[0].set(0).reshape(shape)
        q, s = testing.call_with_poisoned_outputs(ffi.quantize_activations, x)
        self.assert_matches_reference(x, q, s)

    def test_large_magnitudes(self):
        x = random_rows((8, 512), scale=1e30)
        self.assert_matches_reference(x, *jax.jit(ffi.quantize_activations)(x))

    def test_vmap(self):
        x = random_rows((3, 7, 64))
        q, s = jax.vmap(ffi.quantize_activations)(x)
        self.assertEqual(q.shape, x.shape)
        self.assert_matches_reference(x, q, s)

    def test_cpp_rejects_what_python_would(self):
        # Bypass the wrapper's checks: the handler must answer with an error, not crash.
        x = random_rows((4, 24))
        call = jax.ffi.ffi_call("jax_mila_quantize_activations",
                                (jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                                 jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)))
        with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT.*K=24.*multiple of 16"):
            jax.block_until_ready(jax.jit(call)(x))

    def test_inside_cuda_graph(self):
        """Runs in a child process with XLA command buffers (CUDA graphs) forced on for custom
        calls, and checks from XLA's dumps that the call was put into a command buffer."""
        with tempfile.TemporaryDirectory() as dump:
            script = textwrap.dedent("""
                import jax, jax.numpy as jnp, numpy as np
                from jax_mila import ffi, reference
                x = (jax.random.normal(jax.random.key(1), (97, 2816)) * 3).astype(jnp.bfloat16)
                f = jax.jit(lambda x: ffi.quantize_activations(x * 2))
                for _ in range(3):
                    q, s = f(x)
                q_ref, s_ref = reference.quantize_activations(x * 2)
                assert np.array_equal(np.asarray(s), np.asarray(s_ref))
                d = np.abs(np.asarray(q, np.float32) - np.asarray(q_ref, np.float32))
                assert np.all(d <= np.maximum(np.abs(np.asarray(q_ref, np.float32)) / 8, 2**-9))
                print("CHILD OK")
            """)
            testing.assert_child_ok_in_cuda_graphs(self, script, f"--xla_dump_to={dump}")
            # Newer XLA forms command buffers on the thunk sequence, after HLO optimisation,
            # so look through every dump (HLO and thunk sequences alike).
            dumped = ""
            for root, _, files in os.walk(dump):
                for name in files:
                    with open(os.path.join(root, name), errors="replace") as f:
                        dumped += f.read()
            if not re.search(r"command.?buffer", dumped, re.IGNORECASE):
                self.skipTest("results are correct with command buffers enabled, but this XLA "
                              "left no trace of forming one in its dumps, so graph capture of "
                              "the call is unverified here")

# ---- quantize_geglu --------------------------------------------------------------------------

# Every result is held against jax_mila.reference.bounds' interval oracle: per element, the codes
# any admitted implementation (a float32 tanh within testing.GEGLU_TANH_ERROR of the exact one, the
# two bf16 roundings, the row quantization) could produce given the row's scale; per row, the
# scales. All elements and rows must pass, on every backend, for the reference and the kernel.


def geglu_inputs(shape, gate_scale=2.0, up_scale=1.0):
    k1, k2 = jax.random.split(fresh_key())
    gate = (jax.random.normal(k1, shape, jnp.float32) * gate_scale).astype(jnp.bfloat16)
    up = (jax.random.normal(k2, shape, jnp.float32) * up_scale).astype(jnp.bfloat16)
    return gate, up


def saturated_gate(shape):
    """Gate values where tanh's argument is beyond +-20 (gate 0 or |gate| in [8, 64]): the
    oracle's interval is then one bf16 h per element, gate * up or ~0."""
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    mag = jax.random.uniform(k1, shape, jnp.float32, 8.0, 64.0)
    sign = jnp.where(jax.random.bernoulli(k2, 0.5, shape), 1.0, -1.0)
    zero = jax.random.bernoulli(k3, 0.1, shape)
    return jnp.where(zero, 0.0, mag * sign).astype(jnp.bfloat16)


def every_bf16_gate(up_value=1.0):
    """Every finite bf16 value as a gate, in rows of 256, and a constant up."""
    g = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    g = g[np.isfinite(g.astype(np.float32))]
    g = g[: g.size // 256 * 256].reshape(-1, 256)
    return jnp.asarray(g), jnp.full(g.shape, up_value, jnp.bfloat16)


def assert_admissible(testcase, gate, up, got, what="result"):
    problem = testing.geglu_quantization_problem(gate, up, *got)
    testcase.assertIsNone(problem, f"{what}: {problem}")


class GegluOracleTest(parameterized.TestCase):
    """The oracle itself: its tanh bound holds for the implementations it admits, and it
    rejects wrong ones."""

    def test_backend_tanh_is_within_the_bound(self):
        # XLA's float32 tanh on this backend (on a GPU: the one jax.nn.gelu uses there), on
        # every 7th float32 in [2^-12, 20) (odd; x below 4e-4 and +-1 from 20 on are exact).
        lo = np.float32(2.0**-12).view(np.int32)
        hi = np.float32(20.0).view(np.int32)
        x = np.arange(lo, hi, 7, dtype=np.int32).view(np.float32)
        t = np.asarray(jax.jit(jnp.tanh)(jnp.asarray(x)), np.float64)
        err = np.abs(t - np.tanh(x.astype(np.float64)))
        i = int(np.argmax(err))
        self.assertLessEqual(err[i], testing.GEGLU_TANH_ERROR,
                             f"tanh({x[i]!r}) is {err[i]:.3g} off (2^{np.log2(err[i]):.2f})")

    def test_kernel_gelu_formula_is_admitted(self):
        # quantize_geglu_kernel.cu's gelu_tanh emulated in numpy on every finite bf16 gate, with
        # ex2.approx and rcp.approx each 4 ulp off either way (their specified errors are 2 and
        # 1 ulp): every value must lie in the oracle's gelu interval.
        f32 = np.float32
        x = every_bf16_gate()[0].reshape(-1).astype(np.float32)
        x = np.asarray(x)
        fma = lambda a, b, c: (a.astype(np.float64) * b.astype(np.float64)  # noqa: E731
                               + c.astype(np.float64)).astype(f32)
        lo, hi = testing.geglu_gelu_interval(x)
        with np.errstate(over="ignore", under="ignore"):
            p = fma(np.full_like(x, f32(0.044715)), x * x, np.ones_like(x))
            z = np.minimum((x * f32(-2.302208198144325)) * p, f32(64))
            for e_ulps in (-4, 0, 4):
                e = (np.exp2(z.astype(np.float64)) * (1 + e_ulps * 2.0**-23)).astype(f32)
                d = f32(1) + np.where(e < f32(2.0**-126), f32(0), e)
                for r_ulps in (-4, 0, 4):
                    r = ((1 / d.astype(np.float64)) * (1 + r_ulps * 2.0**-23)).astype(f32)
                    r = fma(r, fma(-d, r, np.ones_like(d)), r)
                    gelu = x * r
                    outside = np.flatnonzero((gelu < lo) | (gelu > hi))
                    self.assertEqual(outside.size, 0,
                                     f"ex2 {e_ulps:+d} ulp, rcp {r_ulps:+d} ulp: gelu({x[outside[:3]]})"
                                     f" = {gelu[outside[:3]]} outside [{lo[outside[:3]]}, "
                                     f"{hi[outside[:3]]}]")

    def _wrong(self, gate, up, how):
        g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
        a = jax.nn.gelu(g32, approximate=True)
        if how == "no_bf16_rounding_of_gelu":
            h = (a * u32).astype(jnp.bfloat16)
        elif how == "erf_gelu":
            h = (jax.nn.gelu(g32, approximate=False).astype(jnp.bfloat16).astype(jnp.float32)
                 * u32).astype(jnp.bfloat16)
        elif how == "tanh_off_by_2^-12":
            t = jnp.tanh(0.7978845608028654 * (g32 + 0.044715 * g32**3)) - 2.0**-12
            a = (g32 * (0.5 * (1 + t))).astype(jnp.bfloat16).astype(jnp.float32)
            h = (a * u32).astype(jnp.bfloat16)
        else:
            raise ValueError(how)
        return reference.quantize_activations(h)

    @parameterized.parameters("no_bf16_rounding_of_gelu", "erf_gelu", "tanh_off_by_2^-12")
    def test_rejects_a_wrong_formula(self, how):
        gate, up = geglu_inputs((97, 2816))
        problem = testing.geglu_quantization_problem(gate, up, *self._wrong(gate, up, how))
        self.assertIsNotNone(problem)
        self.assertRegex(problem, "codes outside their interval")

    def test_rejects_one_code_one_step_off(self):
        gate, up = geglu_inputs((7, 256))
        q, s = reference.quantize_geglu(gate, up)
        qf = np.asarray(q, np.float32)
        # An element of modest size with one admissible h whose scaled value sits near its code,
        # far from the e4m3 midpoints: one admissible code.
        h_lo, h_hi = testing.geglu_h_interval(gate, up)
        x = h_lo / np.asarray(s, np.float64)[:, None]
        central = np.abs(x / np.where(qf == 0, 1, qf) - 1) < 2.0**-6
        r, c = np.argwhere((np.abs(qf) > 1) & (np.abs(qf) < 200) & (h_lo == h_hi) & central)[0]
        for direction in (-1, 1):
            bits = np.asarray(q).view(np.uint8).astype(np.int32)
            bits[r, c] += direction      # the next e4m3 magnitude down or up (same sign)
            bits = bits.astype(np.uint8)
            wrong = jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn))
            problem = testing.geglu_quantization_problem(gate, up, wrong, s)
            self.assertIsNotNone(problem)
            self.assertIn(f"[{r}, {c}]", problem)

    def test_rejects_a_scale_one_ulp_off(self):
        gate, up = geglu_inputs((7, 256))
        q, s = reference.quantize_geglu(gate, up)
        s = np.asarray(s).copy()
        s[3] = np.nextafter(s[3], np.float32(np.inf))
        problem = testing.geglu_quantization_problem(gate, up, q, s)
        self.assertIsNotNone(problem)
        self.assertIn("row 3", problem)

    def test_saturated_intervals_are_single_codes(self):
        # Where tanh saturates the oracle leaves next to no slack: one admissible h for gate >= 8
        # and codes that a step up takes out of their intervals (but at e4m3 midpoints hit
        # exactly, where the scale's division may round either way).
        gate = saturated_gate((16, 1024))
        _, up = geglu_inputs((16, 1024))
        q, s = reference.quantize_geglu(gate, up)
        h_lo, h_hi = testing.geglu_h_interval(gate, up)
        # gate >= 8: h = bf16(gate * up) only; gate <= -8: |h| < 64 |up| 2^-21, code 0.
        nonneg = np.asarray(gate, np.float32) >= 0
        self.assertTrue(np.all(h_lo[nonneg] == h_hi[nonneg]))
        # Every code below 448 in magnitude one step larger: each of those must be caught.
        bits = np.asarray(q).view(np.uint8).copy()
        movable = (bits & 0x7F) < 0x7E
        bits[movable] += 1
        problem = testing.geglu_quantization_problem(
            gate, up, jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn)), s, max_listed=0)
        self.assertIsNotNone(problem)
        caught = int(re.search(r"(\d+) of \d+ codes outside", problem).group(1))
        self.assertGreater(caught, 0.99 * movable.sum())


class GegluReferenceTest(parameterized.TestCase):
    @parameterized.named_parameters(
        dict(testcase_name="one_row", shape=(1, 16)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),   # 352 chunks: not a multiple of 256
        dict(testcase_name="six_chunks", shape=(5, 48)),
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="wide_gate", shape=(33, 1024), gate_scale=3.0, up_scale=3.0),
    )
    def test_matches_oracle(self, shape, gate_scale=2.0, up_scale=1.0):
        gate, up = geglu_inputs(shape, gate_scale, up_scale)
        assert_admissible(self, gate, up, reference.quantize_geglu(gate, up))

    def test_matches_oracle_under_jit(self):
        # Under jit XLA may fold f32 -> bf16 -> f32 convert pairs (on GPU by default): the
        # reference's roundings must survive it.
        gate, up = geglu_inputs((97, 2816))
        assert_admissible(self, gate, up, jax.jit(reference.quantize_geglu)(gate, up))

    def test_every_bf16_gate(self):
        for up_value in (1.0, -0.375):
            gate, up = every_bf16_gate(up_value)
            assert_admissible(self, gate, up, reference.quantize_geglu(gate, up), f"up {up_value}")

    def test_saturated_gelu(self):
        gate = saturated_gate((97, 2816))
        _, up = geglu_inputs((97, 2816))
        assert_admissible(self, gate, up, reference.quantize_geglu(gate, up))

    def test_zero_rows(self):
        gate, up = geglu_inputs((5, 64))
        gate = gate.at[1].set(0).at[3].set(-100)      # gelu_tanh(-100) = -0
        up = up.at[2].set(0).at[4].set(jnp.bfloat16(1e-38))
        q, s = reference.quantize_geglu(gate, up)
        np.testing.assert_array_equal(np.asarray(s)[1:], 1.0)
        np.testing.assert_array_equal(np.asarray(q, np.float32)[1:], 0.0)
        self.assertNotEqual(float(s[0]), 1.0)
        assert_admissible(self, gate, up, (q, s))

    def test_large_magnitudes(self):
        gate = saturated_gate((4, 256)).astype(jnp.float32) * 1e13   # |gate|^3 overflows float32
        gate = gate.astype(jnp.bfloat16)
        _, up = geglu_inputs((4, 256), up_scale=1e15)
        q, s = reference.quantize_geglu(gate, up)
        self.assertTrue(np.all(np.isfinite(np.asarray(q, np.float32))))
        self.assertTrue(np.all(np.isfinite(np.asarray(s))))
        self.assertEqual(float(np.abs(np.asarray(q, np.float32)).max()), E4M3_MAX)
        assert_admissible(self, gate, up, (q, s))

    def test_is_the_quantizer_of_the_models_expression(self):
        gate, up = geglu_inputs((13, 256))
        q, s = reference.quantize_geglu(gate, up)
        q_ref, s_ref = reference.quantize_activations(gelu_tanh(gate) * up)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
        np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_ref, np.float32))

    def test_dtypes_and_shapes(self):
        gate, up = geglu_inputs((2, 3, 48))
        q, s = ffi.quantize_geglu(gate, up)
        self.assertEqual(q.dtype, jnp.float8_e4m3fn)
        self.assertEqual(s.dtype, jnp.float32)
        self.assertEqual(q.shape, (2, 3, 48))
        self.assertEqual(s.shape, (2, 3))

    def test_wrapper_under_jit_is_admissible(self):
        gate, up = geglu_inputs((5, 32))
        assert_admissible(self, gate, up, jax.jit(ffi.quantize_geglu)(gate, up))


class GegluValidationTest(parameterized.TestCase):
    BF16 = jnp.bfloat16

    @parameterized.named_parameters(
        dict(testcase_name="gate_float32", gate=((4, 32), jnp.float32), up=((4, 32), BF16),
             pattern="gate: dtype float32 is not supported.*bfloat16"),
        dict(testcase_name="up_float16", gate=((4, 32), BF16), up=((4, 32), jnp.float16),
             pattern="up: dtype float16 is not supported.*bfloat16"),
        dict(testcase_name="rank1", gate=((32,), BF16), up=((32,), BF16),
             pattern="gate: expected rank >= 2"),
        dict(testcase_name="k_not_multiple_of_16", gate=((4, 24), BF16), up=((4, 24), BF16),
             pattern=r"gate: K=24 .*multiple of 16"),
        dict(testcase_name="shapes_differ", gate=((4, 32), BF16), up=((4, 48), BF16),
             pattern=r"up: shape \[4, 48\] must equal gate's shape \[4, 32\]"),
        dict(testcase_name="transposed", gate=((32, 16), BF16), up=((16, 32), BF16),
             pattern=r"up: shape \[16, 32\] must equal gate's shape \[32, 16\]"),
        dict(testcase_name="empty", gate=((0, 32), BF16), up=((0, 32), BF16),
             pattern="gate: empty arrays are not supported"),
    )
    def test_bad_input_raises_at_trace_time(self, gate, up, pattern):
        gate, up = jax.ShapeDtypeStruct(*gate), jax.ShapeDtypeStruct(*up)
        with self.assertRaisesRegex(ValueError, "jax_mila.quantize_geglu: " + pattern):
            jax.eval_shape(ffi.quantize_geglu, gate, up)


class GegluKernelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "quantize_geglu")

    @parameterized.named_parameters(
        dict(testcase_name="one_row", shape=(1, 16)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="gemma_12b", shape=(1024, 15360)),   # 256 threads, 8 chunks each
        dict(testcase_name="gemma_31b", shape=(256, 21504)),    # 512 threads, 6 chunks each
        dict(testcase_name="k_32768", shape=(9, 32768)),        # 512 threads, 8 chunks each
        dict(testcase_name="longer_than_register_cache", shape=(9, 40000)),
    )
    def test_matches_oracle_with_poisoned_outputs(self, shape):
        gate, up = geglu_inputs(shape)
        if gate.size > shape[-1]:
            gate = gate.reshape(-1, shape[-1]).at[0].set(0).reshape(shape)   # a zero row
        got = testing.call_with_poisoned_outputs(ffi.quantize_geglu, gate, up)
        assert_admissible(self, gate, up, got, "kernel")

    def test_every_bf16_gate(self):
        for up_value in (1.0, -0.375):
            gate, up = every_bf16_gate(up_value)
            assert_admissible(self, gate, up, jax.jit(ffi.quantize_geglu)(gate, up),
                              f"kernel, up {up_value}")

    @parameterized.named_parameters(
        dict(testcase_name="cached", shape=(97, 2816)),
        dict(testcase_name="uncached", shape=(5, 40000)),
    )
    def test_saturated_gelu(self, shape):
        gate = saturated_gate(shape)
        _, up = geglu_inputs(shape)
        got = testing.call_with_poisoned_outputs(ffi.quantize_geglu, gate, up)
        assert_admissible(self, gate, up, got, "kernel")

    def test_large_magnitudes(self):
        gate = (saturated_gate((8, 512)).astype(jnp.float32) * 1e13).astype(jnp.bfloat16)
        _, up = geglu_inputs((8, 512), up_scale=1e15)
        assert_admissible(self, gate, up, jax.jit(ffi.quantize_geglu)(gate, up), "kernel")

    def test_vmap(self):
        gate, up = geglu_inputs((3, 7, 64))
        q, s = jax.vmap(ffi.quantize_geglu)(gate, up)
        self.assertEqual(q.shape, gate.shape)
        assert_admissible(self, gate, up, (q, s), "kernel")

    @parameterized.named_parameters(
        dict(testcase_name="k_not_multiple_of_16", gate=(4, 24), up=(4, 24),
             pattern="K=24.*multiple of 16"),
        dict(testcase_name="shapes_differ", gate=(4, 32), up=(4, 48),
             pattern=r"up: shape \[4, 48\] must equal gate's shape \[4, 32\]"),
    )
    def test_cpp_rejects_what_python_would(self, gate, up, pattern):
        # Bypass the wrapper's checks: the handler must answer with an error, not crash.
        gate = jnp.zeros(gate, jnp.bfloat16)
        up = jnp.zeros(up, jnp.bfloat16)
        call = jax.ffi.ffi_call("jax_mila_quantize_geglu",
                                (jax.ShapeDtypeStruct(gate.shape, jnp.float8_e4m3fn),
                                 jax.ShapeDtypeStruct(gate.shape[:-1], jnp.float32)))
        with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT.*quantize_geglu.*" + pattern):
            jax.block_until_ready(jax.jit(call)(gate, up))


# ---- add_rms_norm_quantize -------------------------------------------------------------------

# Held against jax_mila.reference.bounds' interval oracle like quantize_geglu: per element, the h
# and the codes any admitted implementation (the sum of squares in any order, r within a few ulp,
# the bf16 roundings of the definition) could produce; per row, the scales.

EPS = 1e-6  # Gemma 4's rms_norm_eps


def norm_inputs(shape, *, x_scale=3.0, weight_dtype=jnp.bfloat16, seed=None):
    """x, branch, branch_weight, norm_weight for add_rms_norm_quantize. The branch's rows have
    RMS from 1e-4 to 30 (log-uniform): rows whose mean square is below eps (1e-6), where a
    wrong eps shows, up to rows that dominate x; the weights are far from 1 and of both signs."""
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = np.random.default_rng(seed)
    k = shape[-1]
    rows = int(np.prod(shape[:-1]))
    row_rms = np.exp(rng.uniform(np.log(1e-4), np.log(30.0), (rows, 1)))
    bf16 = lambda a: jnp.asarray(np.asarray(a, np.float32)).astype(jnp.bfloat16)  # noqa: E731
    x = bf16(rng.standard_normal(shape) * x_scale)
    branch = bf16((rng.standard_normal((rows, k)) * row_rms).reshape(shape))
    wb = jnp.asarray(rng.uniform(-1.0, 3.0, k).astype(np.float32)).astype(weight_dtype)
    wn = jnp.asarray(rng.uniform(-1.0, 3.0, k).astype(np.float32)).astype(weight_dtype)
    return x, branch, wb, wn


def norm_problem(x, branch, got, wb, wn, eps=EPS, **kwargs):
    return testing.add_rms_norm_quantization_problem(x, branch, got, branch_weight=wb,
                                                     norm_weight=wn, eps=eps, **kwargs)


def assert_norm_admissible(testcase, x, branch, got, wb, wn, what="result", eps=EPS):
    problem = norm_problem(x, branch, got, wb, wn, eps)
    testcase.assertIsNone(problem, f"{what}: {problem}")


def unfused_norms(x, branch, wb, wn, eps=EPS):
    """What the decoder layer computes without the op (jax_mila/gemma4/model.py): rms_norm and
    the bf16 add, then nn.Linear's quantizer of the normed bf16 rows."""
    def linear_input(y):  # nn.Linear._w4a8: bf16 rows, the quantizer, the leading shape back
        q, s = reference.quantize_activations(y.astype(jnp.bfloat16).reshape(-1, y.shape[-1]))
        return q.reshape(y.shape), s.reshape(y.shape[:-1])

    if branch is None:
        return linear_input(rms_norm(x, wn, eps))
    h = x + rms_norm(branch, wb, eps)
    return (h,) + linear_input(rms_norm(h, wn, eps))


def _wrong_norms(x, branch, wb, wn, how, eps=EPS):
    """add_rms_norm_quantize with one mistake, in float32 jnp."""
    f32 = jnp.float32
    bf16 = lambda v: v.astype(jnp.bfloat16).astype(f32)  # noqa: E731 - convert pairs stay on CPU

    def norm(v, w, which):
        e = {"eps_times_10": 10 * eps, "no_eps": 0.0}.get(how, eps)
        y = v * jnp.power(jnp.mean(v * v, axis=-1, keepdims=True) + e, -0.5)
        w = w.astype(f32)
        return y * (1 + w if how == f"one_plus_w_{which}" else w)

    if branch is None:
        h = x.astype(f32)
    else:
        n = norm(branch.astype(f32), wb, "branch")
        h_exact = x.astype(f32) + (n if how == "no_rounding_of_n" else bf16(n))
        h = h_exact if how == "no_rounding_of_h" else bf16(h_exact)
    y = norm(h, wn, "norm")
    q, s = reference.quantize_activations(y if how == "no_rounding_of_y" else bf16(y))
    if branch is None:
        return q, s
    return bf16(h_exact).astype(jnp.bfloat16), q, s


class NormOracleTest(parameterized.TestCase):
    """The oracle itself: the rsqrt bound holds for the backend's, the correct definition passes
    it, and it rejects wrong implementations."""

    def test_backend_rsqrt_is_within_the_bound(self):
        # rms_norm's jnp.power(t, -0.5) under jit (XLA may make it an rsqrt), and lax.rsqrt, on
        # every 61st float32 in [2^-20, 2^20).
        lo, hi = np.float32(2.0**-20).view(np.int32), np.float32(2.0**20).view(np.int32)
        t = np.arange(lo, hi, 61, dtype=np.int32).view(np.float32)
        exact = 1 / np.sqrt(t.astype(np.float64))
        ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
        for name, fn in (("pow", lambda v: jnp.power(v, -0.5)), ("rsqrt", jax.lax.rsqrt)):
            r = np.asarray(jax.jit(fn)(jnp.asarray(t)), np.float64)
            err = np.abs(r - exact) / ulp
            i = int(np.argmax(err))
            self.assertLessEqual(err[i], testing.NORM_RSQRT_ULPS,
                                 f"{name}({t[i]!r}) is {err[i]:.2f} ulp off")

    @parameterized.named_parameters(("branch", True), ("no_branch", False))
    def test_admits_the_definition_with_float64_sums(self, with_branch):
        # The definition with the sums of squares exact (float64), then float32 as specified:
        # another order than XLA's, which the oracle must admit.
        x, branch, wb, wn = norm_inputs((33, 3840))
        branch = branch if with_branch else None

        def norm(v, w):
            v64 = np.asarray(v, np.float64)
            t = np.float32(np.float32((v64 * v64).sum(-1, keepdims=True)) / np.float32(v.shape[-1]))
            r = np.float32(1 / np.sqrt(np.float64(t + np.float32(EPS))))
            y = (np.asarray(v, np.float32) * r) * np.asarray(w, np.float32)
            return y.astype(ml_dtypes.bfloat16).astype(np.float32)

        if with_branch:
            h = (np.asarray(x, np.float32) + norm(branch, wb)).astype(ml_dtypes.bfloat16)
            q, s = reference.quantize_activations(jnp.asarray(norm(h, wn)))
            got = (jnp.asarray(h), q, s)
        else:
            got = reference.quantize_activations(jnp.asarray(norm(x, wn)))
        assert_norm_admissible(self, x, branch, got, wb, wn)

    @parameterized.parameters(
        *[(how, True) for how in ("eps_times_10", "no_eps", "one_plus_w_branch",
                                  "one_plus_w_norm", "no_rounding_of_n", "no_rounding_of_h",
                                  "no_rounding_of_y")],
        *[(how, False) for how in ("eps_times_10", "no_eps", "one_plus_w_norm",
                                   "no_rounding_of_y")])
    def test_rejects_a_wrong_implementation(self, how, with_branch):
        x, branch, wb, wn = norm_inputs((97, 2816))
        if not with_branch:
            x, branch = branch, None  # rows of every RMS, as the norm's input
        self.assertIsNone(norm_problem(x, branch, _wrong_norms(x, branch, wb, wn, "none"),
                                       wb, wn))
        self.assertIsNotNone(norm_problem(x, branch, _wrong_norms(x, branch, wb, wn, how), wb, wn),
                             how)

    def _one_admissible(self, x, branch, wb, wn):
        h, q, s = reference.add_rms_norm_quantize(x, branch, branch_weight=wb, norm_weight=wn,
                                                  eps=EPS)
        y_lo, y_hi = testing.rms_norm_interval(h, wn, EPS)
        qf = np.asarray(q, np.float32)
        xs = y_lo / (np.asarray(s, np.float64)[:, None])
        central = np.abs(xs / np.where(qf == 0, 1, qf) - 1) < 2.0**-6
        r, c = np.argwhere((np.abs(qf) > 1) & (np.abs(qf) < 200) & (y_lo == y_hi) & central)[0]
        return (h, q, s), r, c

    def test_rejects_one_code_one_step_off(self):
        x, branch, wb, wn = norm_inputs((7, 256))
        (h, q, s), r, c = self._one_admissible(x, branch, wb, wn)
        for direction in (-1, 1):
            bits = np.asarray(q).view(np.uint8).astype(np.int32)
            bits[r, c] += direction      # the next e4m3 magnitude down or up (same sign)
            wrong = jnp.asarray(bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn))
            problem = norm_problem(x, branch, (h, wrong, s), wb, wn)
            self.assertIsNotNone(problem)
            self.assertIn(f"[{r}, {c}]", problem)

    def test_rejects_h_one_ulp_off(self):
        x, branch, wb, wn = norm_inputs((7, 256))
        (h, q, s), _, _ = self._one_admissible(x, branch, wb, wn)
        h_lo, h_hi = testing.add_rms_norm_h_interval(x, branch, wb, EPS)
        r, c = np.argwhere((h_lo == h_hi) & (np.abs(h_lo) > 1e-3))[0]
        for direction in (-1, 1):
            bits = np.asarray(h).view(np.uint16).astype(np.int32)
            bits[r, c] += direction      # the next bf16 magnitude down or up (same sign)
            wrong = jnp.asarray(bits.astype(np.uint16).view(ml_dtypes.bfloat16))
            problem = norm_problem(x, branch, (wrong, q, s),
                                   wb, wn)
            self.assertIsNotNone(problem)
            self.assertRegex(problem, rf"elements of h outside their interval: \[{r}, {c}\]")

    @parameterized.named_parameters(("branch", True), ("no_branch", False))
    def test_rejects_a_scale_one_ulp_off(self, with_branch):
        x, branch, wb, wn = norm_inputs((7, 256))
        branch = branch if with_branch else None
        got = list(reference.add_rms_norm_quantize(x, branch, branch_weight=wb if with_branch
                                                   else None, norm_weight=wn, eps=EPS))
        s = np.asarray(got[-1]).copy()
        s[3] = np.nextafter(s[3], np.float32(np.inf))
        got[-1] = s
        problem = norm_problem(x, branch, tuple(got), wb, wn)
        self.assertIsNotNone(problem)
        self.assertIn("row 3", problem)


class NormReferenceTest(parameterized.TestCase):
    @parameterized.named_parameters(
        dict(testcase_name="one_row", shape=(1, 16)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),
        dict(testcase_name="gemma_12b", shape=(33, 3840)),
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="f32_weights", shape=(17, 1536), weight_dtype=jnp.float32),
    )
    def test_matches_oracle(self, shape, weight_dtype=jnp.bfloat16):
        x, branch, wb, wn = norm_inputs(shape, weight_dtype=weight_dtype)
        got = reference.add_rms_norm_quantize(x, branch, branch_weight=wb, norm_weight=wn,
                                              eps=EPS)
        assert_norm_admissible(self, x, branch, got, wb, wn)
        got = reference.add_rms_norm_quantize(branch, norm_weight=wn, eps=EPS)
        assert_norm_admissible(self, branch, None, got, wb, wn, "no branch")

    def test_under_jit_without_excess_precision(self):
        # With xla_allow_excess_precision off, XLA keeps every bf16 rounding: the jitted
        # reference is the definition on every backend.
        x, branch, wb, wn = norm_inputs((97, 2816))
        fn = jax.jit(functools.partial(reference.add_rms_norm_quantize, eps=EPS),
                     compiler_options={"xla_allow_excess_precision": False})
        assert_norm_admissible(self, branch, None, fn(branch, norm_weight=wn), wb, wn)
        assert_norm_admissible(self, x, branch, fn(x, branch, branch_weight=wb, norm_weight=wn),
                               wb, wn)

    def test_under_jit(self):
        # With XLA's default excess precision the jitted reference (the unfused layers'
        # expression, bit for bit: below) may skip bf16 roundings inside a fusion: on the CPU XLA
        # computes the second norm from h before its rounding; on the H200, XLA:GPU also takes
        # the amax and the codes from the normed rows before theirs (scales of amax 6.989 where
        # the rounded rows' amax is 7.0). The jitted result is then not the definition's, but a
        # skipped rounding moves a normed value by at most one bf16 step (2^-7 relative): every
        # scale stays within that of the definition's and every code within one e4m3 step. The
        # returned h is rounded, and admissible.
        x, branch, wb, wn = norm_inputs((97, 2816))
        fn = jax.jit(functools.partial(reference.add_rms_norm_quantize, eps=EPS))
        definition = functools.partial(reference.add_rms_norm_quantize, eps=EPS)  # eager
        for what, got, want in (
                ("no branch", fn(branch, norm_weight=wn), definition(branch, norm_weight=wn)),
                ("with a branch", fn(x, branch, branch_weight=wb, norm_weight=wn)[1:],
                 definition(x, branch, branch_weight=wb, norm_weight=wn)[1:])):
            (q, s), (q0, s0) = ([np.asarray(v, np.float32) for v in r] for r in (got, want))
            np.testing.assert_allclose(s, s0, rtol=2.0**-7, atol=0, err_msg=what)
            step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(q0), 2.0**-6))) - 3)
            self.assertTrue(np.all(np.abs(q - q0) <= step), f"{what}: codes more than a step off")
        h = fn(x, branch, branch_weight=wb, norm_weight=wn)[0]
        h_lo, h_hi = testing.add_rms_norm_h_interval(x, branch, wb, EPS)
        hv = np.asarray(h, np.float32)
        self.assertTrue(np.all((hv >= h_lo) & (hv <= h_hi)))

    @parameterized.named_parameters(("eager", False), ("jit", True))
    def test_is_the_models_unfused_expression_bit_for_bit(self, jit):
        # On this backend's XLA the reference is the layers' rms_norm, bf16 add and quantizer.
        for weight_dtype in (jnp.bfloat16, jnp.float32):
            x, branch, wb, wn = norm_inputs((2, 13, 256), weight_dtype=weight_dtype)
            fused = functools.partial(reference.add_rms_norm_quantize, eps=EPS)
            unfused = unfused_norms
            if jit:
                fused, unfused = jax.jit(fused), jax.jit(unfused)
            for want, got in ((unfused(x, branch, wb, wn), fused(x, branch, branch_weight=wb,
                                                                 norm_weight=wn)),
                              (unfused(x, None, None, wn), fused(x, norm_weight=wn))):
                self.assertEqual(len(want), len(got))
                for a, b in zip(want, got):
                    self.assertEqual(a.dtype, b.dtype)
                    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                  np.asarray(b, np.float32))

    def test_zero_and_tiny_rows(self):
        x, branch, wb, wn = norm_inputs((5, 64))
        x = x.at[1].set(0).at[2].set(0)
        branch = branch.at[1].set(0).at[3].set(0)
        h, q, s = reference.add_rms_norm_quantize(x, branch, branch_weight=wb, norm_weight=wn,
                                                  eps=EPS)
        self.assertEqual(float(s[1]), 1.0)           # x and branch zero: h = 0, a zero row
        np.testing.assert_array_equal(np.asarray(q, np.float32)[1], 0.0)
        np.testing.assert_array_equal(np.asarray(h, np.float32)[3], np.asarray(x, np.float32)[3])
        assert_norm_admissible(self, x, branch, (h, q, s), wb, wn)

    def test_large_magnitudes(self):
        x, branch, wb, wn = norm_inputs((8, 512), x_scale=1e15)  # squares summed near 1e33
        got = reference.add_rms_norm_quantize(x, branch * 1e10, branch_weight=wb,
                                              norm_weight=wn, eps=EPS)
        self.assertTrue(np.all(np.isfinite(np.asarray(got[1], np.float32))))
        assert_norm_admissible(self, x, branch * 1e10, got, wb, wn)

    def test_dtypes_and_shapes(self):
        x, branch, wb, wn = norm_inputs((2, 3, 48))
        h, q, s = ffi.add_rms_norm_quantize(x, branch, branch_weight=wb, norm_weight=wn, eps=EPS)
        self.assertEqual((h.dtype, q.dtype, s.dtype),
                         (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32))
        self.assertEqual((h.shape, q.shape, s.shape), ((2, 3, 48), (2, 3, 48), (2, 3)))
        q, s = ffi.add_rms_norm_quantize(x, norm_weight=wn, eps=EPS)
        self.assertEqual((q.shape, s.shape), ((2, 3, 48), (2, 3)))

    def test_wrapper_under_jit(self):
        # The kernel where it runs (the definition: the oracle), else the reference, which under
        # jit is the unfused layers' expression as XLA computes it (see test_under_jit).
        x, branch, wb, wn = norm_inputs((5, 32))
        fn = jax.jit(functools.partial(ffi.add_rms_norm_quantize, eps=EPS))
        assert_norm_admissible(self, x, None, fn(x, norm_weight=wn), wb, wn)
        got = fn(x, branch, branch_weight=wb, norm_weight=wn)
        if testing.has_cuda() and ffi.status("add_rms_norm_quantize").kernel:
            assert_norm_admissible(self, x, branch, got, wb, wn)
        else:
            want = jax.jit(functools.partial(reference.add_rms_norm_quantize, eps=EPS))(
                x, branch, branch_weight=wb, norm_weight=wn)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


class NormValidationTest(parameterized.TestCase):
    BF16, F32 = jnp.bfloat16, jnp.float32

    @parameterized.named_parameters(
        dict(testcase_name="x_float32", x=((4, 32), F32), pattern="x: dtype float32 is not "
             "supported.*bfloat16"),
        dict(testcase_name="rank1", x=((32,), BF16), wn=((32,), BF16),
             pattern="x: expected rank >= 2"),
        dict(testcase_name="k_not_multiple_of_16", x=((4, 24), BF16), wn=((24,), BF16),
             pattern=r"x: K=24 .*multiple of 16"),
        dict(testcase_name="empty", x=((0, 32), BF16), pattern="x: empty arrays are not supported"),
        dict(testcase_name="branch_float16", branch=((4, 32), jnp.float16), wb=((32,), BF16),
             pattern="branch: dtype float16 is not supported.*bfloat16"),
        dict(testcase_name="branch_shape", branch=((4, 48), BF16), wb=((32,), BF16),
             pattern=r"branch: shape \[4, 48\] must equal x's shape \[4, 32\]"),
        dict(testcase_name="branch_without_weight", branch=((4, 32), BF16),
             pattern="branch_weight: required with a branch"),
        dict(testcase_name="weight_without_branch", wb=((32,), BF16),
             pattern="branch_weight: given without a branch"),
        dict(testcase_name="norm_weight_shape", wn=((1, 32), BF16),
             pattern=r"norm_weight: shape \[1, 32\] must be \[32\]"),
        dict(testcase_name="branch_weight_shape", branch=((4, 32), BF16), wb=((48,), F32),
             pattern=r"branch_weight: shape \[48\] must be \[32\]"),
        dict(testcase_name="norm_weight_float16", wn=((32,), jnp.float16),
             pattern="norm_weight: dtype float16 is not supported.*bfloat16, float32"),
        dict(testcase_name="eps_zero", eps=0.0, pattern="eps: 0.0 is not supported.*> 0"),
        dict(testcase_name="eps_nan", eps=float("nan"), pattern="eps: nan is not supported"),
        dict(testcase_name="eps_array", eps=np.ones(3), pattern="eps: must be a static Python "
             "number.*ndarray"),
        dict(testcase_name="eps_below_float32", eps=1e-50, pattern="eps: 1e-50 is not supported"),
        dict(testcase_name="eps_bool", eps=False, pattern="eps: must be a static Python number"),
    )
    def test_bad_input_raises_at_trace_time(self, pattern, x=((4, 32), BF16), branch=None,
                                            wb=None, wn=((32,), BF16), eps=EPS):
        sds = lambda a: None if a is None else jax.ShapeDtypeStruct(*a)  # noqa: E731
        with self.assertRaisesRegex(ValueError, "jax_mila.add_rms_norm_quantize: " + pattern):
            jax.eval_shape(lambda x, b, wb, wn: ffi.add_rms_norm_quantize(
                x, b, branch_weight=wb, norm_weight=wn, eps=eps),
                sds(x), sds(branch), sds(wb), sds(wn))

    def test_traced_eps_is_refused(self):
        x, _, _, wn = norm_inputs((4, 32))
        with self.assertRaisesRegex(ValueError, "eps: must be a static Python number"):
            jax.jit(lambda e: ffi.add_rms_norm_quantize(x, norm_weight=wn, eps=e))(1e-6)


class NormKernelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "add_rms_norm_quantize")

    def check(self, x, branch, wb, wn, what="kernel", eps=EPS):
        fn = functools.partial(ffi.add_rms_norm_quantize, eps=eps)
        got = testing.call_with_poisoned_outputs(
            lambda x, b, wb, wn: fn(x, b, branch_weight=wb, norm_weight=wn), x, branch, wb, wn)
        assert_norm_admissible(self, x, branch, got, wb, wn, what, eps)
        got = testing.call_with_poisoned_outputs(lambda x, wn: fn(x, norm_weight=wn), x, wn)
        assert_norm_admissible(self, x, None, got, wb, wn, f"{what}, no branch", eps)

    @parameterized.named_parameters(
        # Configurations (rms_norm_quantize_kernel.cu's launch(); n = K / 8 chunks a row):
        # warps per row x chunks a lane, without / with a branch.
        dict(testcase_name="one_row", shape=(1, 16)),            # 1 x 1, 2 of 32 lanes
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),        # n=352: 1 x 12 / 2 x 8
        dict(testcase_name="e2b", shape=(301, 1536)),            # n=192: 1 x 8
        dict(testcase_name="k_2048", shape=(33, 2048)),          # n=256: 1 x 8, the largest
        dict(testcase_name="k_2064", shape=(33, 2064)),          # n=258: 1 x 12 / 2 x 8
        dict(testcase_name="gemma_12b", shape=(1024, 3840)),     # n=480: 1 x 15 / 2 x 8
        dict(testcase_name="k_3856", shape=(65, 3856)),          # n=482: 2 x 8
        dict(testcase_name="k_4096", shape=(65, 4096)),          # n=512: 2 x 8, the largest
        dict(testcase_name="k_4112", shape=(65, 4112)),          # n=514: 2 x 12
        dict(testcase_name="gemma_31b", shape=(257, 5376)),      # n=672: 2 x 12
        dict(testcase_name="k_6160", shape=(33, 6160)),          # n=770: 2 x 16
        dict(testcase_name="k_8192", shape=(33, 8192)),          # n=1024: 2 x 16, the largest
        dict(testcase_name="longer_than_register_cache", shape=(9, 9008)),
        dict(testcase_name="many_rows", shape=(20000, 128)),     # rows > grid: groups stride
        dict(testcase_name="many_rows_two_warps", shape=(3000, 4096)),  # 2 x 8, rows > grid
        dict(testcase_name="f32_weights", shape=(97, 2816), weight_dtype=jnp.float32),
    )
    def test_matches_oracle_with_poisoned_outputs(self, shape, weight_dtype=jnp.bfloat16):
        x, branch, wb, wn = norm_inputs(shape, weight_dtype=weight_dtype)
        if x.size > shape[-1]:   # a zero row of x and branch, one of the branch alone
            def zero(a, rows):
                return a.reshape(-1, shape[-1]).at[rows].set(0).reshape(shape)
            x, branch = zero(x, 0), zero(branch, np.array([0, -1]))
        self.check(x, branch, wb, wn)

    def test_eps_is_the_attribute(self):
        x, branch, wb, wn = norm_inputs((97, 256))
        self.check(x, branch, wb, wn, "eps 1e-5", eps=1e-5)

    def test_large_magnitudes(self):
        x, branch, wb, wn = norm_inputs((8, 512), x_scale=1e15)
        self.check(x, branch * 1e10, wb, wn)

    def test_mostly_the_references_bits(self):
        # Only near-ties of the bf16 roundings may differ (the sum's order, the rsqrt).
        x, branch, wb, wn = norm_inputs((1024, 3840))
        got = jax.jit(functools.partial(ffi.add_rms_norm_quantize, eps=EPS))(
            x, branch, branch_weight=wb, norm_weight=wn)
        want = reference.add_rms_norm_quantize(x, branch, branch_weight=wb, norm_weight=wn,
                                               eps=EPS)
        for name, a, b in zip(("h", "q", "scale"), got, want):
            same = np.mean(np.asarray(a, np.float32) == np.asarray(b, np.float32))
            self.assertGreater(same, 0.99, name)

    def test_inside_cuda_graph(self):
        """In a child process with XLA command buffers (CUDA graphs) forced on for custom calls:
        the handler's occupancy query (the strided grid) and launch under capture."""
        script = textwrap.dedent("""
            import sys, functools
            sys.path.insert(0, %r)
            import jax, jax.numpy as jnp
            from jax_mila import ffi
            import testing
            from test_quantize import norm_inputs, EPS
            x, branch, wb, wn = norm_inputs((4096, 384), seed=3)
            fn = functools.partial(ffi.add_rms_norm_quantize, eps=EPS)
            f = jax.jit(lambda x, b: fn(x * 2, b, branch_weight=wb, norm_weight=wn))
            for _ in range(3):
                got = f(x, branch)
            p = testing.add_rms_norm_quantization_problem(x * 2, branch, got, branch_weight=wb,
                                                          norm_weight=wn, eps=EPS)
            assert p is None, p
            print("CHILD OK")
        """ % os.path.dirname(os.path.abspath(__file__)))
        testing.assert_child_ok_in_cuda_graphs(self, script)

    def test_vmap(self):
        x, branch, wb, wn = norm_inputs((3, 7, 64))
        fn = functools.partial(ffi.add_rms_norm_quantize, eps=EPS)
        got = jax.vmap(lambda x, b: fn(x, b, branch_weight=wb, norm_weight=wn))(x, branch)
        assert_norm_admissible(self, x, branch, got, wb, wn)

    @parameterized.named_parameters(
        dict(testcase_name="k_not_multiple_of_16", x=(4, 24), w=24, pattern="K=24.*multiple of 16"),
        dict(testcase_name="branch_shape", x=(4, 32), branch=(4, 48), w=32,
             pattern=r"branch: shape \[4, 48\] must equal x's shape \[4, 32\]"),
        dict(testcase_name="weight_shape", x=(4, 32), w=48,
             pattern=r"norm_weight: shape \[48\] must be \[32\]"),
        dict(testcase_name="eps", x=(4, 32), w=32, eps=-1.0, pattern="eps: -1.* > 0"),
    )
    def test_cpp_rejects_what_python_would(self, x, w, pattern, branch=None, eps=EPS):
        # Bypass the wrapper's checks: the handler must answer with an error, not crash.
        x = jnp.zeros(x, jnp.bfloat16)
        wn = jnp.ones((w,), jnp.float32)
        out = (jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
        if branch is None:
            call = jax.ffi.ffi_call("jax_mila_rms_norm_quantize", out)
            args = (x, wn)
        else:
            call = jax.ffi.ffi_call("jax_mila_add_rms_norm_quantize",
                                    (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),) + out)
            args = (x, jnp.zeros(branch, jnp.bfloat16), wn, wn)
        with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT.*add_rms_norm_quantize.*"
                                               + pattern):
            jax.block_until_ready(jax.jit(lambda *a: call(*a, eps=np.float32(eps)))(*args))


if __name__ == "__main__":
    absltest.main()
