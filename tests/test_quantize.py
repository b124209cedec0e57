"""Activation quantizer: reference properties and validation (CPU), kernel parity (GPU); the
same for quantize_geglu, the quantizer of gelu_tanh(gate) * up, against a numpy oracle."""

import os
import re
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi, reference, testing
from jax_mila.gemma4.mlp import gelu_tanh

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
            env = dict(os.environ)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                                " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                                " --xla_gpu_graph_min_graph_size=1"
                                f" --xla_dump_to={dump}")
            res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                 text=True, timeout=300)
            self.assertIn("CHILD OK", res.stdout, res.stderr[-3000:])
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

# Every result is held against jax_mila.testing's interval oracle: per element, the codes any
# admitted implementation (a float32 tanh within testing.GEGLU_TANH_ERROR of the exact one, the
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


if __name__ == "__main__":
    absltest.main()
