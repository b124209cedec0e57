"""Gemma4MLP's fused GEGLU quantization: in a bf16 W4A8 model, gelu_tanh(gate) * up is quantized
for down_proj by one op (quantize_geglu) and multiplied by down_proj.matmul_quantized. Which
configurations take that path, and that it gives the unfused expression's output (bit for bit
on the reference ops; on a GPU the kernel's tanh moves rare FP8 codes by one step)."""

from __future__ import annotations

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import ffi, reference
from jax_mila.gemma4.mlp import Gemma4MLP, gelu_tanh
from jax_mila.parallel import Layout
import testing  # tests/testing.py

HIDDEN, INTERMEDIATE = 256, 512


def _mlp(*, dtype=jnp.bfloat16, quantize="w4a8", backend="auto", hidden=HIDDEN,
         intermediate=INTERMEDIATE):
    seed = int.from_bytes(os.urandom(4), "little")
    return Gemma4MLP(hidden, intermediate, backend=backend, dtype=dtype, param_dtype=jnp.float32,
                     quantize=quantize, rngs=nnx.Rngs(seed))


def _x(shape=(2, 9, HIDDEN), dtype=jnp.bfloat16):
    key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
    return (jax.random.normal(key, shape, jnp.float32) * 2).astype(dtype)


def _unfused(m, x):
    return m.down_proj(gelu_tanh(m.gate_proj(x)) * m.up_proj(x))


def _jitted_definition(m, x):
    """_unfused jitted with XLA's excess precision off, so that it keeps every bf16 rounding:
    the reference for the jitted op. The eager expression is not (XLA:CPU's fused float32 gelu
    can round differently from op-by-op execution, and that moved one FP8 code of h in 3 of 180
    cases), nor is the expression jitted with the default (it skips the roundings of h: most
    outputs differ); against this one the jitted op agreed bit for bit in 180 of 180."""
    graph, state = nnx.split(m)
    run = jax.jit(lambda state, x: _unfused(nnx.merge(graph, state), x),
                  compiler_options={"xla_allow_excess_precision": False})
    return run(state, x)


class FusedGegluMlpTest(parameterized.TestCase):

    def assert_same_output(self, got, want, backend):
        self.assertEqual(got.dtype, want.dtype)
        self.assertEqual(got.shape, want.shape)
        if backend != "reference" and testing.has_cuda():
            self.assertLess(testing.rel_fro_err(got, want), 1e-2)
        else:
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    @parameterized.parameters("auto", "reference")
    def test_bf16_w4a8_takes_the_fused_path(self, backend):
        m, x = _mlp(backend=backend), _x()
        self.assertTrue(m.fuses_geglu())
        ops = reference if backend == "reference" else ffi
        with mock.patch.object(ops, "quantize_geglu", wraps=ops.quantize_geglu) as fused, \
                mock.patch.object(ops, "quantize_activations",
                                  wraps=ops.quantize_activations) as plain:
            got = m(x)
        fused.assert_called_once()
        self.assertEqual(plain.call_count, 2)  # gate_proj's and up_proj's inputs only
        self.assert_same_output(got, _unfused(m, x), backend)

    def test_under_jit_and_other_ranks(self):
        m = _mlp()
        for shape in ((2, 9, HIDDEN), (5, HIDDEN), (HIDDEN,)):
            x = _x(shape)
            got = nnx.jit(lambda m, x: m(x))(m, x)
            self.assertEqual(got.shape, shape)
            self.assert_same_output(got, _jitted_definition(m, x), "auto")

    @parameterized.named_parameters(
        ("float32_model", dict(dtype=jnp.float32)),
        ("dense", dict(quantize=None)),
        # 200 -> 128: down_proj stays dense (in_features % 128), gate/up are W4A8.
        ("dense_down_proj", dict(hidden=128, intermediate=200)),
    )
    def test_other_models_keep_the_unfused_expression(self, kwargs):
        m = _mlp(**kwargs)
        x = _x((3, m.gate_proj.in_features), m.gate_proj.dtype)
        self.assertFalse(m.fuses_geglu())
        with mock.patch.object(ffi, "quantize_geglu") as fused:
            got = m(x)
        fused.assert_not_called()
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(_unfused(m, x), np.float32))

    def test_mixed_backends_and_tensor_parallelism_keep_the_unfused_expression(self):
        m = _mlp()
        self.assertTrue(m.fuses_geglu())
        self.assertFalse(m.fuses_geglu(Layout(heads_axis="heads")))
        m.down_proj.backend = "reference"
        self.assertFalse(m.fuses_geglu())


if __name__ == "__main__":
    absltest.main()
