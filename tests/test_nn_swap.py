"""jax_mila.nn.swap_linears and jax_mila.nn.Linear's optional bias, on CPU (reference paths).

- Each swapped layer holds exactly quantize_mxfp4 of the original kernel (transposed to [N, K])
  and the original bias variable; its output equals an oracle built from other parts (the
  layer's quantizer, dequantize_mxfp4, a float32 product, the bias: to 1e-6 on CPU, within the
  W4A8 kernel's summation-order error on a GPU), and it stays within the format's documented
  error of the dense layer (relative Frobenius < 0.15 on Gaussian weights,
  tests/test_nn_quantized_linear.py; > 0.05, so a layer left dense fails).
- Nested modules (attributes, nnx.List, nnx.Dict, list / dict held as nnx.data), shared layers
  (one module reachable twice stays one module), shared kernel variables (one set of MXFP4
  variables), biases, LinearGeneral as a plain product (multi-axis in/out flattened), and the
  layers left alone with their reasons (shape, subclass, custom dot_general, batch / other
  axes, tuple, abstract weights, NaN); strict mode raises naming them and changes nothing.
- The swapped model runs under nnx.jit and survives nnx.split / merge.
- Linear(use_bias=True): dense and W4A8, rounded once; no bias attribute without it.
"""

from __future__ import annotations

import logging
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import ffi, nn, quant, reference
import testing  # tests/testing.py
from jax_mila.ffi import _registry
from jax_mila.nn import swap as swap_mod
from jax_mila.nn.linear import MXFP4Param


def _key():
    return jax.random.key(int.from_bytes(os.urandom(4), "little"))


def _gaussian_linear(cls, *args, key, bias=True, dtype=None, param_dtype=jnp.float32, **kw):
    """An nnx layer with N(0, 1/K) kernel and a nonzero bias."""
    layer = cls(*args, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                rngs=nnx.Rngs(params=key), **kw)
    k1, k2 = jax.random.split(key)
    shape = layer.kernel.get_value().shape
    fan_in = int(np.prod(layer.in_features))
    layer.kernel.set_value((jax.random.normal(k1, shape) * fan_in**-0.5).astype(param_dtype))
    if bias:
        layer.bias.set_value(jax.random.normal(k2, layer.bias.get_value().shape)
                             .astype(param_dtype))
    return layer


def _oracle(x, kernel, bias, dtype, backend="auto"):
    """W4A8 product from parts: FP8 rows (by the quantizer a layer of `backend` calls: the CUDA
    one may sit one e4m3 step from the reference on a few values) x dequantized MXFP4 of kernel
    [K, N] (+ bias), float32, rounded once to dtype."""
    k, n = kernel.shape
    rows = x.astype(jnp.bfloat16).reshape(-1, k)
    quantizer = (reference if backend == "reference" else ffi).quantize_activations
    q, s = quantizer(rows)
    w = quant.dequantize_mxfp4(quant.quantize_mxfp4(jnp.asarray(kernel, jnp.float32).T),
                               jnp.float32, kernel_semantics=True)
    acc = jnp.einsum("mk,nk->mn", q.astype(jnp.float32), w,
                     precision=jax.lax.Precision.HIGHEST) * s[:, None]
    if bias is not None:
        acc = acc + jnp.asarray(bias, jnp.float32).reshape(n)
    return acc.astype(dtype).reshape(*x.shape[:-1], n)


def _assert_matches_oracle(test, got, want, backend="auto", msg=""):
    """Equal up to float32 rounding on the reference paths; on a GPU's W4A8 kernel within its
    summation-order error (tests/test_nn_quantized_linear.py: ~1e-4 for the wgmma kernels)."""
    got32, want32 = (np.asarray(jnp.asarray(t, jnp.float32)) for t in (got, want))
    if backend != "reference" and testing.has_cuda():
        tol = 4e-4 if jnp.dtype(got.dtype) == jnp.dtype(jnp.float32) else 4e-3
        test.assertLess(testing.rel_fro_err(got32, want32), tol, msg)
    else:
        np.testing.assert_allclose(got32, want32, rtol=1e-6, atol=1e-6, err_msg=msg)


def _rel(a, b):
    a, b = (np.asarray(jnp.asarray(t, jnp.float32)) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Inner(nnx.Module):
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = _gaussian_linear(nnx.Linear, 256, 384, key=k1)
        self.down = _gaussian_linear(nnx.Linear, 384, 256, key=k2, bias=False)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Nested(nnx.Module):
    """Linears at every kind of place the walk must find."""

    def __init__(self, key):
        ks = jax.random.split(key, 8)
        self.blocks = nnx.List([Inner(ks[0]), Inner(ks[1])])
        self.heads = nnx.Dict({"a": _gaussian_linear(nnx.Linear, 256, 128, key=ks[2])})
        self.extra = nnx.data([_gaussian_linear(nnx.Linear, 256, 256, key=ks[3])])
        self.table = nnx.data({"z": _gaussian_linear(nnx.Linear, 256, 256, key=ks[4])})
        self.odd = _gaussian_linear(nnx.Linear, 256, 12, key=ks[5])  # N % 8 != 0: kept

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.table["z"](self.extra[0](x))
        return self.heads["a"](x), self.odd(x)


class SwapTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        _registry.reset_fallback_log()

    def check_swapped(self, new, old_kernel, old_bias_var, dtype, x, backend="auto"):
        """new holds old's weights as MXFP4 and old's bias variable; its output is the oracle's."""
        self.assertIsInstance(new, nn.Linear)
        self.assertEqual(new.quantize, "w4a8")
        k, n = old_kernel.shape
        want = quant.quantize_mxfp4(jnp.asarray(old_kernel, jnp.float32).T)
        for field in ("packed", "scales", "channel_exp"):
            np.testing.assert_array_equal(getattr(new.mxfp4, field), getattr(want, field))
        if old_bias_var is None:
            self.assertFalse(new.use_bias)
        else:
            self.assertIs(new.bias, old_bias_var)
        bias = None if old_bias_var is None else old_bias_var.get_value()
        self.assertEqual(new.backend, backend)
        got = new(x)
        self.assertEqual(got.dtype, jnp.dtype(dtype))
        _assert_matches_oracle(self, got, _oracle(x, old_kernel, bias, dtype, backend), backend)

    def test_nested_modules(self):
        key = _key()
        model = Nested(key)
        x = jax.random.normal(jax.random.fold_in(key, 1), (3, 5, 256))
        dense_out = model(x)
        olds = {
            "blocks.0.up": model.blocks[0].up, "blocks.0.down": model.blocks[0].down,
            "blocks.1.up": model.blocks[1].up, "blocks.1.down": model.blocks[1].down,
            "heads.a": model.heads["a"], "extra.0": model.extra[0], "table.z": model.table["z"],
        }
        before = {p: (m.kernel.get_value(), m.bias) for p, m in olds.items()}
        with self.assertLogs("jax_mila", logging.INFO) as logs:
            report = nn.swap_linears(model)
        self.assertIn("swap_linears: 7 of 8 linears now W4A8; kept: odd: out_features=12",
                      "\n".join(logs.output))
        self.assertEqual(sorted(e.path for e in report.swapped), sorted(olds))
        self.assertEqual([e.path for e in report.kept], ["odd"])
        self.assertIn("out_features=12", report.kept[0].reason)
        self.assertIsInstance(model.odd, nnx.Linear)
        new = {"blocks.0.up": model.blocks[0].up, "blocks.0.down": model.blocks[0].down,
               "blocks.1.up": model.blocks[1].up, "blocks.1.down": model.blocks[1].down,
               "heads.a": model.heads["a"], "extra.0": model.extra[0],
               "table.z": model.table["z"]}
        xin = jax.random.normal(jax.random.fold_in(key, 2), (7, 256))
        for path, (kernel, bias) in before.items():
            xp = xin if kernel.shape[0] == 256 else jnp.tile(xin, (1, 2))[:, :kernel.shape[0]]
            self.check_swapped(new[path], kernel, bias, jnp.float32, xp)
        # The whole model under nnx.jit, and through split / merge.
        out = nnx.jit(lambda m, x: m(x))(model, x)
        graphdef, state = nnx.split(model)
        out2 = nnx.merge(graphdef, state)(x)
        for a, b in zip(out, out2):  # jitted vs eager: float32 summation order only
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        rel = _rel(out[0], dense_out[0])
        self.assertLess(rel, 0.5)  # four W4A8 layers deep, ~0.12 each
        self.assertGreater(rel, 0.05)

    def test_single_layer_error_is_the_formats(self):
        key = _key()
        holder = nnx.Dict({"l": _gaussian_linear(nnx.Linear, 256, 128, key=key, bias=False)})
        x = jax.random.normal(jax.random.fold_in(key, 1), (21, 256))
        dense = holder["l"](x)
        nn.swap_linears(holder)
        rel = _rel(holder["l"](x), dense)
        self.assertLess(rel, 0.15)
        self.assertGreater(rel, 0.05)

    def test_shared_layer(self):
        class Tied(nnx.Module):
            def __init__(self, key):
                self.a = _gaussian_linear(nnx.Linear, 128, 128, key=key)
                self.b = self.a
                self.many = nnx.List([self.a, _gaussian_linear(nnx.Linear, 128, 128,
                                                               key=jax.random.fold_in(key, 1))])

        model = Tied(_key())
        kernel, bias = model.a.kernel.get_value(), model.a.bias
        report = nn.swap_linears(model)
        self.assertLen(report.entries, 2)
        self.assertEqual(report.entries[0].paths, ("a", "b", "many.0"))
        self.assertIs(model.a, model.b)
        self.assertIs(model.a, model.many[0])
        self.assertIsNot(model.a, model.many[1])
        self.check_swapped(model.a, kernel, bias, jnp.float32,
                           jax.random.normal(_key(), (4, 128)))
        # One copy of the shared weights in the state.
        packed = [v for _, v in nnx.iter_graph(model) if isinstance(v, MXFP4Param)]
        self.assertLen(packed, 6)

    def test_shared_kernel_variable(self):
        key = _key()
        a = _gaussian_linear(nnx.Linear, 128, 256, key=key, bias=False)
        b = nnx.Linear(128, 256, use_bias=True, rngs=nnx.Rngs(0))
        b.kernel = a.kernel  # tied weights, separate modules (b has a bias)
        holder = nnx.List([a, b])
        nn.swap_linears(holder)
        for field in ("packed", "scales", "channel_exp"):
            self.assertIs(getattr(holder[0], field), getattr(holder[1], field))
        self.assertFalse(holder[0].use_bias)
        self.assertTrue(holder[1].use_bias)
        x = jax.random.normal(key, (3, 128))
        np.testing.assert_allclose(np.asarray(holder[1](x) - holder[0](x)),
                                   np.broadcast_to(np.asarray(b.bias.get_value()), (3, 256)),
                                   rtol=1e-5, atol=1e-5)

    @parameterized.named_parameters(
        ("bf16", jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
        ("param_bf16_dtype_none", None, jnp.bfloat16, None, jnp.bfloat16),
        ("f32", None, jnp.float32, None, jnp.float32),
        ("preferred", jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
    )
    def test_dtypes(self, dtype, param_dtype, preferred, want):
        key = _key()
        layer = _gaussian_linear(nnx.Linear, 128, 128, key=key, dtype=dtype,
                                 param_dtype=param_dtype, preferred_element_type=preferred)
        kernel, bias = layer.kernel.get_value(), layer.bias
        holder = nnx.List([layer])
        nn.swap_linears(holder, backend="reference")
        self.assertEqual(holder[0].backend, "reference")
        self.check_swapped(holder[0], kernel, bias, want,
                           jax.random.normal(key, (5, 128)).astype(param_dtype),
                           backend="reference")

    def test_linear_general(self):
        key = _key()
        ks = jax.random.split(key, 6)
        model = nnx.Dict({
            "single": _gaussian_linear(nnx.LinearGeneral, 256, 128, key=ks[0]),
            "split_out": _gaussian_linear(nnx.LinearGeneral, 256, (4, 64), key=ks[1]),
            "merge_in": _gaussian_linear(nnx.LinearGeneral, (4, 64), 128, axis=(-2, -1),
                                         key=ks[2]),
            "positive_axis": _gaussian_linear(nnx.LinearGeneral, 256, 128, axis=2, key=ks[3]),
            "reversed_axes": _gaussian_linear(nnx.LinearGeneral, (4, 64), 128, axis=(-1, -2),
                                              key=ks[4]),
            "batched": _gaussian_linear(nnx.LinearGeneral, 256, 128, axis=-1,
                                        batch_axis={0: 3}, key=ks[5]),
        })
        x = jax.random.normal(key, (3, 5, 256))
        xs = jax.random.normal(key, (3, 5, 4, 64))
        dense = {"single": model["single"](x), "split_out": model["split_out"](x),
                 "merge_in": model["merge_in"](xs)}
        kernels = {k: (model[k].kernel.get_value(), model[k].bias.get_value()) for k in dense}
        report = nn.swap_linears(model)
        self.assertEqual({e.path: e.swapped for e in report.entries},
                         {"batched": False, "merge_in": True, "positive_axis": False,
                          "reversed_axes": False, "single": True, "split_out": True})
        reasons = {e.path: e.reason for e in report.kept}
        self.assertIn("batch axes", reasons["batched"])
        self.assertIn("axis=(2,)", reasons["positive_axis"])
        self.assertIn("axis=(-1, -2)", reasons["reversed_axes"])
        self.assertIsInstance(model["single"], nn.Linear)
        self.assertIsInstance(model["split_out"], nn.ReshapedLinear)
        self.assertIsInstance(model["merge_in"], nn.ReshapedLinear)
        for name, inp in (("single", x), ("split_out", x), ("merge_in", xs)):
            got = model[name](inp)
            self.assertEqual(got.shape, dense[name].shape, name)
            kernel, bias = kernels[name]
            k = int(np.prod(kernel.shape)) // int(np.prod(bias.shape))
            flat_in = inp.reshape(*inp.shape[:2], k)
            want = _oracle(flat_in, kernel.reshape(k, -1), bias, jnp.float32)
            _assert_matches_oracle(self, got.reshape(want.shape), want, msg=name)
            self.assertLess(_rel(got, dense[name]), 0.15, name)
        with self.assertRaisesRegex(ValueError, "does not end in"):
            model["merge_in"](x)

    def test_kept_layers_and_reasons(self):
        key = _key()

        class Holder(nnx.Module):
            def __init__(self):
                self.small_k = _gaussian_linear(nnx.Linear, 100, 128, key=key)
                self.lora = nnx.LoRALinear(128, 128, lora_rank=2, rngs=nnx.Rngs(0))
                self.custom = nnx.Linear(128, 128, dot_general=lambda *a, **k:
                                         jax.lax.dot_general(*a, **k), rngs=nnx.Rngs(0))
                self.promote = nnx.Linear(128, 128, promote_dtype=lambda t, dtype: t,
                                          rngs=nnx.Rngs(0))
                self.tup = nnx.data((nnx.Linear(128, 128, rngs=nnx.Rngs(0)),))
                self.nan = nnx.Linear(128, 128, rngs=nnx.Rngs(0))
                self.nan.kernel.set_value(self.nan.kernel.get_value().at[3, 4].set(jnp.nan))
                self.ok = nnx.Linear(128, 128, rngs=nnx.Rngs(0))

        model = Holder()
        report = nn.swap_linears(model)
        reasons = {e.path: e.reason for e in report.kept}
        self.assertEqual(set(reasons), {"small_k", "lora", "custom", "promote", "tup.0", "nan"})
        self.assertIn("in_features=100", reasons["small_k"])
        self.assertIn("LoRALinear subclasses nnx.Linear", reasons["lora"])
        self.assertIn("custom dot_general", reasons["custom"])
        self.assertIn("custom promote_dtype", reasons["promote"])
        self.assertIn("tuple", reasons["tup.0"])
        self.assertIn("NaN", reasons["nan"])
        self.assertEqual([e.path for e in report.swapped], ["ok"])
        for name in ("small_k", "custom", "promote", "nan"):
            self.assertIsInstance(getattr(model, name), nnx.Linear, name)
        self.assertIsInstance(model.lora, nnx.LoRALinear)
        self.assertIsInstance(model.tup[0], nnx.Linear)
        self.assertIn("tup.0 (Linear 128 -> 128): kept (it is held in a tuple", str(report))

    def test_abstract_model(self):
        model = nnx.eval_shape(lambda: nnx.Dict({"l": nnx.Linear(128, 128, rngs=nnx.Rngs(0))}))
        report = nn.swap_linears(model)
        self.assertIn("not concrete", report.kept[0].reason)

    def test_strict(self):
        key = _key()
        model = Nested(key)
        layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
        with self.assertRaisesRegex(ValueError, r"strict=True.*odd \(Linear\): out_features=12 "
                                                r"is not a multiple of 8"):
            nn.swap_linears(model, strict=True)
        # Nothing changed.
        self.assertEqual([m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)],
                         layers)
        self.assertFalse(any(isinstance(m, nn.Linear) for _, m in nnx.iter_modules(model)))
        # A model every layer of which swaps passes strict mode.
        holder = nnx.List([_gaussian_linear(nnx.Linear, 128, 128, key=key)])
        self.assertLen(nn.swap_linears(holder, strict=True).swapped, 1)

    def test_uses_the_linear_modules_shape_rule(self):
        holder = nnx.List([nnx.Linear(128, 128, rngs=nnx.Rngs(0))])
        with mock.patch.object(swap_mod, "w4a8_unsupported_reason",
                               return_value="not today") as rule:
            report = nn.swap_linears(holder)
        rule.assert_called_once_with(128, 128)
        self.assertEqual(report.kept[0].reason, "not today")

    @parameterized.named_parameters(
        ("quantize_none", dict(quantize=None), "quantize=None"),
        ("quantize_int8", dict(quantize="int8"), "quantize='int8'"),
        ("backend", dict(backend="cuda"), "backend='cuda'"),
    )
    def test_bad_arguments(self, kwargs, fragment):
        with self.assertRaisesRegex(ValueError, fragment):
            nn.swap_linears(nnx.List([nnx.Linear(128, 128, rngs=nnx.Rngs(0))]), **kwargs)

    def test_bad_models(self):
        with self.assertRaisesRegex(ValueError, "itself a linear layer"):
            nn.swap_linears(nnx.Linear(128, 128, rngs=nnx.Rngs(0)))
        with self.assertRaisesRegex(ValueError, "flax.nnx Module, got dict"):
            nn.swap_linears({"a": nnx.Linear(128, 128, rngs=nnx.Rngs(0))})


class LinearBiasTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        k1, k2, k3 = jax.random.split(_key(), 3)
        self.kernel = jax.random.normal(k1, (256, 128)) * 256**-0.5
        self.bias = jax.random.normal(k2, (128,))
        self.x = jax.random.normal(k3, (3, 7, 256))

    def test_no_bias_attribute_without_it(self):
        for quantize in (None, "w4a8"):
            layer = nn.Linear(256, 128, quantize=quantize)
            self.assertFalse(layer.use_bias)
            self.assertNotIn("bias", vars(layer))
            self.assertNotIn("bias", nnx.state(layer))
        self.assertIn("bias", nnx.state(nn.Linear(256, 128, use_bias=True)))

    def test_dense(self):
        layer = nn.Linear(256, 128, use_bias=True, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(np.asarray(layer.bias.get_value()), np.zeros(128))
        layer.kernel.set_value(self.kernel)
        layer.bias.set_value(self.bias)
        want = np.einsum("bti,io->bto", np.asarray(self.x, np.float64),
                         np.asarray(self.kernel, np.float64)) + np.asarray(self.bias)
        np.testing.assert_allclose(np.asarray(layer(self.x)), want, rtol=1e-5, atol=1e-5)

    @parameterized.named_parameters(("f32", jnp.float32), ("bf16", jnp.bfloat16))
    def test_w4a8_rounds_once(self, dtype):
        layer = nn.Linear.quantize_from(self.kernel, bias=self.bias, dtype=dtype)
        self.assertEqual(layer.quantize, "w4a8")
        want = _oracle(self.x, self.kernel, self.bias, dtype)
        got = layer(self.x)
        self.assertEqual(got.dtype, jnp.dtype(dtype))
        _assert_matches_oracle(self, got, want)
        # The pre-quantized entry point adds it too.
        q, s = ffi.quantize_activations(self.x.astype(jnp.bfloat16).reshape(-1, 256))
        np.testing.assert_array_equal(
            np.asarray(nn.project(layer, nn.QuantizedRows(q.reshape(3, 7, 256),
                                                          s.reshape(3, 7))), np.float32),
            np.asarray(got, np.float32))
        self.assertIsInstance(nnx.jit(lambda m, x: m(x))(layer, self.x), jax.Array)

    def test_quantize_from_checks_bias_shape(self):
        with self.assertRaisesRegex(ValueError, r"bias of shape \[64\]"):
            nn.Linear.quantize_from(self.kernel, bias=self.bias[:64])

    def test_dense_fallback_shape_keeps_bias(self):
        kernel = self.kernel[:100]  # K = 100: the kernels cannot take it
        layer = nn.Linear.quantize_from(kernel, bias=self.bias)
        self.assertIsNone(layer.quantize)
        np.testing.assert_allclose(np.asarray(layer(self.x[..., :100])),
                                   np.asarray(self.x[..., :100] @ kernel + self.bias),
                                   rtol=1e-5, atol=1e-5)

    def test_refused_on_a_row_parallel_layer(self):
        layer = nn.Linear(256, 128, use_bias=True)
        with self.assertRaisesRegex(ValueError, "a bias on a row-parallel layer"):
            layer(self.x, row_parallel_axis="heads")


if __name__ == "__main__":
    absltest.main()
