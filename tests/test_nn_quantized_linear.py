"""nn.Linear(quantize="w4a8"): MXFP4 weights x FP8 activations, on CPU (the reference path).

- accuracy against the dense layer on Gaussian weights and activations (the expected error of
  the format, not of an implementation: MXFP4's e2m1 has one mantissa bit, ~12% relative
  Frobenius error on Gaussian weights (jax_mila/ffi/w4a8.py), FP8 e4m3 activations add ~2-3%;
  measured 0.115-0.125 over seeds at K=256, N=128, M=21). Bound 0.15; and > 0.05, so a layer
  that silently stayed dense fails too;
- bit-exact agreement with the composition quantize_activations -> dequantize_mxfp4 ->
  float32 product (both backends; the GPU kernel sums in another order, so there it is 1e-5);
- shapes the kernel cannot take stay dense with one log line; jit; the MXFP4 arrays are not
  nnx.Param (optimizers never see them); constructing from a dense kernel;
- matmul_quantized (the product after the quantizer, for pre-quantized activations) is the
  layer's own second half, and refuses dense layers and mismatched shapes.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import ffi, nn, quant, reference
from jax_mila.ffi import _registry as ffi_registry
from jax_mila.nn import linear as linear_mod
from jax_mila.nn.linear import MXFP4Param
import testing  # tests/testing.py

K, N = 256, 128
LEAD = (3, 7)  # M = 21 rows, not a tile multiple


def _key():
    return jax.random.key(int.from_bytes(os.urandom(4), "little"))


def _composition(x, w: quant.MXFP4Weight, dtype, quantize_activations):
    """The W4A8 product built from the parts: FP8 rows x dequantized MXFP4, float32. The rows
    are quantized by the quantizer the layer uses (the CUDA one may sit one e4m3 step from the
    reference on a few values, tests/test_quantize.py), so only the GEMM is compared here."""
    rows = x.astype(jnp.bfloat16).reshape(-1, x.shape[-1])
    q, s = quantize_activations(rows)
    wf = quant.dequantize_mxfp4(w, jnp.float32, k=x.shape[-1], kernel_semantics=True)
    acc = jnp.einsum("mk,nk->mn", q.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32) * s[:, None]
    out = dtype if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32
    return acc.astype(out).reshape(*x.shape[:-1], w.shape[0]).astype(dtype)


class QuantizedLinearTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        ffi_registry.reset_fallback_log()
        k1, k2 = jax.random.split(_key())
        self.kernel = jax.random.normal(k1, (K, N), jnp.float32) * K**-0.5   # [in, out]
        self.x = jax.random.normal(k2, LEAD + (K,), jnp.float32)

    @parameterized.product(dtype=[jnp.float32, jnp.bfloat16], backend=["auto", "reference"])
    def test_error_vs_dense_is_the_formats(self, dtype, backend):
        q = nn.Linear.quantize_from(self.kernel, backend=backend, dtype=dtype)
        self.assertEqual(q.quantize, "w4a8")
        dense = nn.Linear(K, N, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        dense.kernel.set_value(self.kernel.astype(jnp.bfloat16))
        got = q(self.x.astype(dtype))
        self.assertEqual(got.dtype, dtype)
        self.assertEqual(got.shape, LEAD + (N,))
        err = testing.rel_fro_err(got, dense(self.x))
        print(f"w4a8 vs dense bf16 ({jnp.dtype(dtype).name}, {backend}): rel Frobenius {err:.4f}")
        self.assertLess(err, 0.15)
        self.assertGreater(err, 0.05)

    @parameterized.product(dtype=[jnp.float32, jnp.bfloat16], backend=["auto", "reference"])
    def test_equals_the_reference_composition(self, dtype, backend):
        q = nn.Linear.quantize_from(self.kernel, backend=backend, dtype=dtype)
        x = self.x.astype(dtype)
        quantizer = (ffi.quantize_activations if backend == "auto"
                     else reference.quantize_activations)
        want = _composition(x, q.mxfp4, dtype, quantizer)
        got = q(x)
        if backend == "auto" and testing.has_cuda():  # the kernel: float32 summation order
            # (on Hopper "auto" is a wgmma kernel: FP8 accumulation, ~1e-4; jax_mila/ffi/w4a8.py)
            from jax_mila.ffi import w4a8 as w4a8_module
            f32_tol = (1e-5 if w4a8_module.auto_kernel(int(np.prod(LEAD))) == "mma_sync"
                       else 4e-4)
            self.assertLess(testing.rel_fro_err(got, want),
                            f32_tol if dtype == jnp.float32 else 4e-3)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_stores_the_mxfp4_of_the_transposed_kernel(self):
        q = nn.Linear.quantize_from(self.kernel)
        want = quant.quantize_mxfp4(self.kernel.T)
        for field in linear_mod.MXFP4_FIELDS:
            var = getattr(q, field)
            self.assertIsInstance(var, MXFP4Param)
            self.assertNotIsInstance(var, nnx.Param)
            np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(getattr(want, field)))
        self.assertEqual(q.packed.shape, (N, K // 2))
        self.assertEqual(q.scales.shape, (N, K // 32))
        self.assertEqual(q.channel_exp.shape, (N,))
        self.assertFalse(hasattr(q, "kernel"))
        self.assertEmpty(jax.tree.leaves(nnx.state(q, nnx.Param)))  # optimizers see nothing
        self.assertLen(jax.tree.leaves(nnx.state(q, MXFP4Param)), 3)

    @parameterized.parameters(96, 704)
    def test_k_not_a_multiple_of_128_is_stored_padded(self, k):
        # in_features a multiple of 32 (the 26B's 2112 and 704): W4A8, the weight stored over
        # padded_k(in) with zeros past in; the product equals the composition on the first K.
        kernel = jax.random.normal(_key(), (k, N), jnp.float32) * k**-0.5
        q = nn.Linear.quantize_from(kernel, backend="reference", dtype=jnp.float32)
        self.assertEqual(q.quantize, "w4a8")
        self.assertEqual(q.packed.shape, (N, quant.padded_k(k) // 2))
        x = jax.random.normal(_key(), LEAD + (k,), jnp.float32)
        want = _composition(x, q.mxfp4, jnp.float32, reference.quantize_activations)
        np.testing.assert_array_equal(np.asarray(q(x)), np.asarray(want))
        with self.assertRaisesRegex(ValueError, rf"expected \[{N}, {quant.padded_k(k)}\]"):
            q.set_mxfp4(quant.quantize_mxfp4(jnp.pad(kernel.T, ((0, 0), (0, 128)))))

    def test_random_init_is_a_valid_quantized_weight(self):
        q = nn.Linear(K, N, quantize="w4a8", rngs=nnx.Rngs(3))
        self.assertTrue(quant.check_kernel_invariant(q.mxfp4))
        self.assertEqual(q(self.x).shape, LEAD + (N,))

    def test_rank1_input_and_jit(self):
        q = nn.Linear.quantize_from(self.kernel, dtype=jnp.float32)
        got = nnx.jit(lambda m, x: m(x))(q, self.x[0, 0])
        self.assertEqual(got.shape, (N,))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(q(self.x[0, 0])))
        jitted = jax.jit(lambda x: q(x))(self.x)
        np.testing.assert_array_equal(np.asarray(jitted), np.asarray(q(self.x)))

    @parameterized.named_parameters(
        ("in_not_32", 200, 64, "in_features=200 is not a multiple of 32"),
        ("out_not_8", 256, 100, "out_features=100 is not a multiple of 8"),
    )
    def test_unsupported_shape_stays_dense_and_says_why(self, fin, fout, why):
        with self.assertLogs("jax_mila", "INFO") as logs:
            layer = nnx.eval_shape(lambda: nn.Linear(fin, fout, quantize="w4a8", rngs=nnx.Rngs(0)))
            nnx.eval_shape(lambda: nn.Linear(fin, fout, quantize="w4a8", rngs=nnx.Rngs(0)))
        self.assertIsNone(layer.quantize)
        self.assertEqual(layer.kernel.shape, (fin, fout))
        self.assertLen(logs.output, 1)  # once per shape, not once per layer
        self.assertIn(f"Linear {fin} -> {fout} stays dense", logs.output[0])
        self.assertIn(why, logs.output[0])

    def test_quantize_from_unsupported_shape_keeps_the_kernel(self):
        kernel = self.kernel[:200, :64]
        with self.assertLogs("jax_mila", "INFO"):
            layer = nn.Linear.quantize_from(kernel)
        self.assertIsNone(layer.quantize)
        x = self.x[..., :200]
        want = jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(want), rtol=1e-5, atol=1e-5)

    def test_quantize_from_refuses_nonfinite(self):
        with self.assertRaisesRegex(ValueError, "NaN/inf"):
            nn.Linear.quantize_from(self.kernel.at[3, 5].set(jnp.nan))

    def test_set_mxfp4_checks_the_shape(self):
        q = nn.Linear.quantize_from(self.kernel)
        with self.assertRaisesRegex(ValueError, r"does not fit Linear 256 -> 128"):
            q.set_mxfp4(quant.quantize_mxfp4(self.kernel))  # [128, 256]: not transposed

    @parameterized.product(dtype=[jnp.float32, jnp.bfloat16], backend=["auto", "reference"])
    def test_matmul_quantized_is_the_layer_after_its_quantizer(self, dtype, backend):
        layer = nn.Linear.quantize_from(self.kernel, backend=backend, dtype=dtype)
        quantizer = ffi if backend == "auto" else reference
        q, s = quantizer.quantize_activations(self.x.astype(jnp.bfloat16))
        got = layer.matmul_quantized(q, s)
        self.assertEqual(got.shape, LEAD + (N,))
        self.assertEqual(got.dtype, dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(layer(self.x.astype(dtype))))

    def test_matmul_quantized_refuses_dense_layers_and_wrong_shapes(self):
        q, s = reference.quantize_activations(self.x.astype(jnp.bfloat16))
        dense = nn.Linear(K, N)
        with self.assertRaisesRegex(ValueError, "Linear 256 -> 128: matmul_quantized needs a "
                                                "quantize='w4a8' layer; this one is dense"):
            dense.matmul_quantized(q, s)
        layer = nn.Linear.quantize_from(self.kernel)
        with self.assertRaisesRegex(ValueError, r"got q\[3, 7, 128\] .*expected q \[\.\.\., 256\]"):
            layer.matmul_quantized(q[..., :128], s)
        with self.assertRaisesRegex(ValueError, r"scale\[3\]"):
            layer.matmul_quantized(q, s[:, 0])

    @parameterized.parameters(1, 21)
    def test_project_many_is_each_projection(self, rows):
        # nn.project_many of QuantizedRows: one w4a8_matmul_many (on a GPU with 1-16 rows, one
        # GEMV launch), each result equal to nn.project's; a layer with a bias (float32 product)
        # or a plain activation falls back to nn.project one by one.
        k3, k4 = jax.random.split(_key())
        layers = [nn.Linear.quantize_from(self.kernel),
                  nn.Linear.quantize_from(jax.random.normal(k3, (K, 64)) * K**-0.5),
                  nn.Linear.quantize_from(jax.random.normal(k4, (K, 40)) * K**-0.5,
                                          bias=jnp.ones((40,)))]
        x = self.x.reshape(-1, K)[:rows].astype(jnp.bfloat16)
        q = nn.QuantizedRows(*ffi.quantize_activations(x))
        for group in (layers[:2], layers):
            got = nn.project_many(group, q)
            self.assertLen(got, len(group))
            for y, layer in zip(got, group):
                want = nn.project(layer, q)
                self.assertEqual((y.shape, y.dtype), (want.shape, want.dtype))
                np.testing.assert_allclose(np.asarray(y, np.float32),
                                           np.asarray(want, np.float32), rtol=1e-5, atol=1e-5)
        for y, layer in zip(nn.project_many(layers, x), layers):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(layer(x)))
        with self.assertRaisesRegex(ValueError, r"matmul_quantized got q\[\d+, 128\]"):
            nn.project_many(layers[:2], nn.QuantizedRows(q.q[:, :128], q.scale))

    def test_unknown_mode_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"quantize='w8a8' is not supported \(supported: \(None, 'w4a8'\)"):
            nn.Linear(K, N, quantize="w8a8")


if __name__ == "__main__":
    absltest.main()
