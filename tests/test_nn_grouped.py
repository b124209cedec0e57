"""nn.GroupedLinear (experts over rows sorted by expert) and the 26B's expert branch
(jax_mila.gemma4.moe), on CPU (the reference path; GPU runs take the kernels, within their
documented error): dense and W4A8 experts against per-row products from a different code path,
the routing's permutation, fused and unfused quantizers, and the expert branch against a
per-token loop."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import nn, quant, reference
from jax_mila.ffi import _registry as ffi_registry
from jax_mila.gemma4 import moe
from jax_mila.nn.linear import quantized_ops
import testing  # tests/testing.py

E, IN, OUT = 5, 96, 64  # IN = 96: stored padded to 128 under W4A8


def _key():
    return jax.random.key(int.from_bytes(os.urandom(4), "little"))


def _expert_of_rows(sizes, rows):
    ex = np.repeat(np.arange(len(sizes)), np.maximum(np.asarray(sizes), 0))[:rows]
    return np.concatenate([ex, np.full(rows - len(ex), -1)])


class GroupedLinearTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        ffi_registry.reset_fallback_log()
        self.sizes = jnp.asarray([7, 0, 13, 1, 9], jnp.int32)
        self.x = jax.random.normal(_key(), (30, IN), jnp.float32)

    def test_dense_is_each_rows_expert(self):
        layer = nn.GroupedLinear(IN, OUT, E, rngs=nnx.Rngs(1))
        self.assertEqual(layer.kernel.shape, (E, IN, OUT))
        with jax.default_matmul_precision("highest"):  # not TF32 on a GPU
            got = np.asarray(layer(self.x, self.sizes))
        w = np.asarray(layer.kernel[...], np.float64)
        ex = _expert_of_rows(self.sizes, 30)
        want = np.einsum("mi,mio->mo", np.asarray(self.x, np.float64), w[ex])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    @parameterized.parameters("auto", "reference")
    def test_w4a8_equals_the_per_row_composition(self, backend):
        layer = nn.GroupedLinear(IN, OUT, E, quantize="w4a8", backend=backend,
                                 rngs=nnx.Rngs(2))
        self.assertEqual(layer.quantize, "w4a8")
        self.assertEqual(layer.packed.shape, (E, OUT, 64))  # [E, out, padded_k(96) / 2]
        self.assertTrue(quant.check_kernel_invariant(layer.mxfp4))
        self.assertEmpty(jax.tree.leaves(nnx.state(layer, nnx.Param)))
        got = np.asarray(layer(self.x, self.sizes), np.float64)
        # The layer's own quantizer: on a GPU the kernel's, which may sit one e4m3 step from the
        # reference's (its contract, tests/test_quantize.py); this test is about the product.
        q, s = quantized_ops(backend).quantize_activations(self.x.astype(jnp.bfloat16))
        xf = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)[:, None]
        wf = np.asarray(quant.dequantize_mxfp4(layer.mxfp4, k=IN), np.float64)
        ex = _expert_of_rows(self.sizes, 30)
        want = np.einsum("mk,mnk->mn", xf, wf[ex])
        tol = 4e-4 if testing.has_cuda() and backend == "auto" else 1e-5
        self.assertLess(testing.rel_fro_err(got, want), tol)
        # matmul_quantized is the second half of the same call.
        np.testing.assert_array_equal(np.asarray(layer.matmul_quantized(q, s, self.sizes)),
                                      np.asarray(layer(self.x, self.sizes)))

    def test_unsupported_shape_stays_dense_and_says_why(self):
        with self.assertLogs("jax_mila", "INFO") as logs:
            layer = nn.GroupedLinear(100, OUT, E, quantize="w4a8", rngs=nnx.Rngs(0))
        self.assertIsNone(layer.quantize)
        self.assertIn("GroupedLinear 100 -> 64 stays dense (in_features=100 is not a multiple "
                      "of 32", logs.output[0])
        with self.assertRaisesRegex(ValueError, "matmul_quantized needs a quantize='w4a8' layer"):
            layer.matmul_quantized(jnp.zeros((3, 100), jnp.float8_e4m3fn),
                                   jnp.ones((3,), jnp.float32), self.sizes)

    def test_set_mxfp4_checks_the_shape(self):
        layer = nn.GroupedLinear(IN, OUT, E, quantize="w4a8", rngs=nnx.Rngs(0))
        with self.assertRaisesRegex(ValueError, r"expected \[5, 64, 128\]"):
            layer.set_mxfp4(quant.quantize_mxfp4(jnp.ones((E - 1, OUT, IN))))
        with self.assertRaisesRegex(ValueError, "num_experts=0"):
            nn.GroupedLinear(IN, OUT, 0)


class ExpertsTest(parameterized.TestCase):
    """The 26B's expert branch (routing by a stable sort, grouped projections, weighted sum back
    in token order) against a per-token loop over the chosen experts."""

    def test_route_is_a_stable_sort_and_its_inverse(self):
        idx = jnp.asarray(np.random.default_rng(0).integers(0, 6, (50, 3)), jnp.int32)
        order, sizes, inverse = moe.route(idx, 6)
        flat = np.asarray(idx).ravel()
        np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
        np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=6))
        np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(150))

    @parameterized.parameters(None, "w4a8")
    def test_equals_a_per_token_loop(self, quantize):
        h, i, e, k, t = 128, 64, 6, 2, 23
        experts = moe.Gemma4Experts(h, e, i, backend="reference", dtype=jnp.float32,
                                    param_dtype=jnp.float32, quantize=quantize,
                                    rngs=nnx.Rngs(3))
        x = jax.random.normal(_key(), (t, h), jnp.float32)
        rng = np.random.default_rng(1)
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
        idx[:5] = [0, 1]  # expert 5 may get nothing; 0 and 1 get several
        weights = jnp.asarray(rng.random((t, k)), jnp.float32)
        def precision():  # not TF32 on a GPU
            return jax.default_matmul_precision("highest")

        with precision():
            got = np.asarray(experts(x, weights, jnp.asarray(idx)))
        gu, down = experts.gate_up_proj, experts.down_proj
        want = np.zeros((t, h))
        for tok in range(t):
            for j in range(k):
                one = jnp.asarray(np.eye(e, dtype=np.int32)[idx[tok, j]])  # 1 row, 1 expert
                with precision():
                    g = gu(x[tok:tok + 1], one)
                    act = jax.nn.gelu(g[:, :i], approximate=True) * g[:, i:]
                    want[tok] += float(weights[tok, j]) * np.asarray(down(act, one))[0]
        self.assertLess(testing.rel_fro_err(got, want), 1e-5 if quantize is None else 5e-2)

    def test_fused_quantizers_compute_what_the_layers_do(self):
        # bf16 W4A8 experts: the GeGLU and down's quantizer as one quantize_geglu, the input's
        # quantizer once per token (rows gathered after it): on the reference backend equal
        # bit for bit to quantizing the gathered rows and the product inside each layer.
        h, i, e, k, t = 128, 64, 4, 2, 17
        experts = moe.Gemma4Experts(h, e, i, backend="reference", dtype=jnp.bfloat16,
                                    param_dtype=jnp.bfloat16, quantize="w4a8", rngs=nnx.Rngs(4))
        self.assertTrue(experts.fuses_geglu())
        x = jax.random.normal(_key(), (t, h), jnp.float32).astype(jnp.bfloat16)
        idx = jnp.asarray(np.random.default_rng(2).integers(0, e, (t, k)), jnp.int32)
        weights = jnp.full((t, k), 0.5, jnp.float32)
        got = experts(x, weights, idx)
        order, sizes, inverse = moe.route(idx, e)
        gu = experts.gate_up_proj(x[order // k], sizes)
        y = experts.down_proj(moe.gelu_tanh(gu[:, :i]) * gu[:, i:], sizes)
        want = jnp.sum(y[inverse].reshape(t, k, h).astype(jnp.float32) * weights[..., None],
                       axis=1).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        q, s = reference.quantize_activations(x)
        np.testing.assert_array_equal(
            np.asarray(experts(nn.QuantizedRows(q, s), weights, idx), np.float32),
            np.asarray(got, np.float32))


if __name__ == "__main__":
    absltest.main()
