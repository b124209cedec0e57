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

# The kernel's tanh (CUDA tanhf) and the reference's (XLA's) differ by an ulp or a few. Where
# tanh is near -1 (gate below about -3), 1 + tanh cancels and that moves a share of those
# gelu values by one bf16 step; they are small next to the row's amax, so after quantization
# about 1e-4 of the codes differ, by one e4m3 step (measured against the numpy oracle below:
# up to 8e-5 over 30 draws of 97 x 2816; no scale differed in 2,910 rows). A row whose largest
# element moved gets a scale one bf16 step away.
GEGLU_CODE_FRACTION = 1e-3
GEGLU_ROW_FRACTION = 1e-2


def geglu_inputs(shape, gate_scale=2.0, up_scale=1.0):
    k1, k2 = jax.random.split(fresh_key())
    gate = (jax.random.normal(k1, shape, jnp.float32) * gate_scale).astype(jnp.bfloat16)
    up = (jax.random.normal(k2, shape, jnp.float32) * up_scale).astype(jnp.bfloat16)
    return gate, up


def saturated_gate(shape):
    """Gate values where every float32 tanh is exactly +-1 (|argument| > 20: gate 0 or |gate| in
    [8, 64]), so gelu_tanh(gate) is gate or -0 in any implementation and h = bf16(gate * up) is
    exact: the kernel must then match bit for bit."""
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    mag = jax.random.uniform(k1, shape, jnp.float32, 8.0, 64.0)
    sign = jnp.where(jax.random.bernoulli(k2, 0.5, shape), 1.0, -1.0)
    zero = jax.random.bernoulli(k3, 0.1, shape)
    return jnp.where(zero, 0.0, mag * sign).astype(jnp.bfloat16)


def numpy_oracle(gate, up):
    """quantize_geglu in numpy float32 with ml_dtypes' roundings, independent of the reference:
    tanh correctly rounded (float64, then float32), the rest of the formula in float32."""
    bf16, f32 = ml_dtypes.bfloat16, np.float32
    g = np.asarray(gate, np.float32)
    u = np.asarray(up, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        inner = f32(np.sqrt(2 / np.pi)) * (g + f32(0.044715) * (g * g * g))
        t = np.tanh(inner.astype(np.float64)).astype(f32)
        a = (g * (f32(0.5) * (f32(1) + t))).astype(bf16).astype(f32)
        h = (a * u).astype(bf16).astype(f32)
    amax = np.abs(h).max(axis=-1)
    zero_row = amax < f32(2.0**-112)
    safe = np.where(zero_row, f32(1), amax)
    inv = np.where(zero_row, f32(0), f32(448) / safe)
    scale = np.where(zero_row, f32(1), safe * f32(1 / 448))
    q = np.clip(h * inv[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


class GegluReferenceTest(parameterized.TestCase):
    def assert_agrees(self, got, want, **fractions):
        problem = testing.quantization_mismatch(*got, *want, **fractions)
        self.assertIsNone(problem, problem)

    @parameterized.named_parameters(
        dict(testcase_name="one_row", shape=(1, 16)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),   # 352 chunks: not a multiple of 256
        dict(testcase_name="six_chunks", shape=(5, 48)),
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="wide_gate", shape=(33, 1024), gate_scale=3.0, up_scale=3.0),
    )
    def test_matches_numpy_oracle(self, shape, gate_scale=2.0, up_scale=1.0):
        gate, up = geglu_inputs(shape, gate_scale, up_scale)
        self.assert_agrees(reference.quantize_geglu(gate, up), numpy_oracle(gate, up),
                           code_fraction=GEGLU_CODE_FRACTION, row_fraction=GEGLU_ROW_FRACTION)

    def test_saturated_gelu_matches_oracle_exactly(self):
        gate = saturated_gate((97, 2816))
        _, up = geglu_inputs((97, 2816))
        self.assert_agrees(reference.quantize_geglu(gate, up), numpy_oracle(gate, up))

    def test_zero_rows(self):
        gate, up = geglu_inputs((5, 64))
        gate = gate.at[1].set(0).at[3].set(-100)      # gelu_tanh(-100) = -0
        up = up.at[2].set(0).at[4].set(jnp.bfloat16(1e-38))
        q, s = reference.quantize_geglu(gate, up)
        np.testing.assert_array_equal(np.asarray(s)[1:], 1.0)
        np.testing.assert_array_equal(np.asarray(q, np.float32)[1:], 0.0)
        self.assertNotEqual(float(s[0]), 1.0)
        self.assert_agrees((q, s), numpy_oracle(gate, up))

    def test_large_magnitudes(self):
        gate = saturated_gate((4, 256)).astype(jnp.float32) * 1e13   # |gate|^3 overflows float32
        _, up = geglu_inputs((4, 256), up_scale=1e15)
        q, s = reference.quantize_geglu(gate.astype(jnp.bfloat16), up)
        self.assertTrue(np.all(np.isfinite(np.asarray(q, np.float32))))
        self.assertTrue(np.all(np.isfinite(np.asarray(s))))
        self.assertEqual(float(np.abs(np.asarray(q, np.float32)).max()), E4M3_MAX)
        self.assert_agrees((q, s), numpy_oracle(gate.astype(jnp.bfloat16), up))

    def test_is_the_quantizer_of_the_models_expression(self):
        gate, up = geglu_inputs((13, 256))
        q, s = reference.quantize_geglu(gate, up)
        q_ref, s_ref = reference.quantize_activations(gelu_tanh(gate) * up)
        self.assert_agrees((q, s), (q_ref, s_ref))

    def test_dtypes_and_shapes(self):
        gate, up = geglu_inputs((2, 3, 48))
        q, s = ffi.quantize_geglu(gate, up)
        self.assertEqual(q.dtype, jnp.float8_e4m3fn)
        self.assertEqual(s.dtype, jnp.float32)
        self.assertEqual(q.shape, (2, 3, 48))
        self.assertEqual(s.shape, (2, 3))

    def test_wrapper_under_jit_matches_reference(self):
        gate, up = geglu_inputs((5, 32))
        got = jax.jit(ffi.quantize_geglu)(gate, up)
        self.assert_agrees(got, reference.quantize_geglu(gate, up))

    def test_oracle_comparison_can_fail(self):
        # The bounds above must not hide a wrong formula: the exact gelu (erf) instead of the
        # tanh approximation moves far more codes than allowed.
        gate, up = geglu_inputs((97, 2816))
        a = jax.nn.gelu(gate.astype(jnp.float32), approximate=False).astype(jnp.bfloat16)
        wrong = reference.quantize_activations((a.astype(jnp.float32) * up).astype(jnp.bfloat16))
        self.assertIsNotNone(testing.quantization_mismatch(
            *wrong, *numpy_oracle(gate, up), code_fraction=GEGLU_CODE_FRACTION,
            row_fraction=GEGLU_ROW_FRACTION))


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

    def assert_matches_reference(self, gate, up, got, exact=False):
        """Against the CUDA quantizer applied to XLA's h (the same quantization code, so only
        the gelu can differ: bit-exact where it cannot), and against the whole reference (whose
        quantizer may also sit one e4m3 step from the CUDA one on a few values, KernelTest)."""
        h = reference.geglu(gate, up)
        fractions = dict(code_fraction=GEGLU_CODE_FRACTION, row_fraction=GEGLU_ROW_FRACTION)
        for name, want, allowed in (
                ("CUDA quantize_activations(reference.geglu)", ffi.quantize_activations(h),
                 {} if exact else fractions),
                ("reference.quantize_geglu", reference.quantize_geglu(gate, up),
                 dict(code_fraction=GEGLU_CODE_FRACTION) if exact else fractions)):
            problem = testing.quantization_mismatch(*got, *want, **allowed)
            self.assertIsNone(problem, f"against {name}: {problem}")

    @parameterized.named_parameters(
        dict(testcase_name="one_row", shape=(1, 16)),
        dict(testcase_name="odd_rows", shape=(97, 2816)),
        dict(testcase_name="leading_dims", shape=(3, 5, 48)),
        dict(testcase_name="gemma_12b", shape=(1024, 15360)),
        dict(testcase_name="gemma_31b", shape=(256, 21504)),    # the 16-chunk register cache
        dict(testcase_name="longer_than_register_cache", shape=(9, 40000)),
    )
    def test_matches_reference_with_poisoned_outputs(self, shape):
        gate, up = geglu_inputs(shape)
        if gate.size > shape[-1]:
            gate = gate.reshape(-1, shape[-1]).at[0].set(0).reshape(shape)   # a zero row
        got = testing.call_with_poisoned_outputs(ffi.quantize_geglu, gate, up)
        self.assert_matches_reference(gate, up, got)

    @parameterized.named_parameters(
        dict(testcase_name="cached", shape=(97, 2816)),
        dict(testcase_name="uncached", shape=(5, 40000)),
    )
    def test_saturated_gelu_is_bit_exact(self, shape):
        gate = saturated_gate(shape)
        _, up = geglu_inputs(shape)
        got = testing.call_with_poisoned_outputs(ffi.quantize_geglu, gate, up)
        self.assert_matches_reference(gate, up, got, exact=True)

    def test_large_magnitudes(self):
        gate = (saturated_gate((8, 512)).astype(jnp.float32) * 1e13).astype(jnp.bfloat16)
        _, up = geglu_inputs((8, 512), up_scale=1e15)
        self.assert_matches_reference(gate, up, jax.jit(ffi.quantize_geglu)(gate, up), exact=True)

    def test_vmap(self):
        gate, up = geglu_inputs((3, 7, 64))
        q, s = jax.vmap(ffi.quantize_geglu)(gate, up)
        self.assertEqual(q.shape, gate.shape)
        self.assert_matches_reference(gate, up, (q, s))

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
