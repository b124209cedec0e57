"""jax_mila.nn.noise: one-ulp moves of the W4A8 quantizer inputs (the probe behind
tests/test_parallel_tensor.py's W4A8 bound and fidelity's noise floor), on CPU.

- one_ulp moves the chosen elements by exactly one bf16 ulp (bit pattern +-1 in magnitude),
  both ways, at the asked rate, never to inf or NaN, and leaves the rest bit-identical;
- perturb is the identity outside quantizer_noise, and each quantizer call inside it draws its
  own subset;
- a W4A8 Linear and the fused GeGLU MLP see the noise at their quantizer, and the MLP's probe
  path forms exactly what quantize_geglu quantizes (with the moves switched off, the outputs
  are bit-identical);
- a bf16 decoder whose norms and quantizers run fused (add_rms_norm_quantize) runs them
  unfused under the noise, so the q/k/v and gate/up inputs are perturbed too, and with the
  moves switched off computes the same logits bit for bit.
"""

from __future__ import annotations

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from jax_mila import nn
from jax_mila.gemma4 import fidelity
from jax_mila.gemma4.mlp import Gemma4MLP
from jax_mila.nn import noise

SEED = int.from_bytes(os.urandom(4), "little") % 2**31


def _bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16)).astype(np.int32)


class OneUlpTest(absltest.TestCase):

    def test_moves_a_rate_of_elements_by_one_ulp(self):
        x = (3 * jax.random.normal(jax.random.key(SEED), (512, 512))).astype(jnp.bfloat16)
        y = noise.one_ulp(x, jax.random.key(SEED + 1), 0.1)
        bx, by = _bits(x), _bits(y)
        moved = bx != by
        msg = f"seed {SEED}"
        # 26214 expected; 5 standard deviations (~150) either way
        self.assertBetween(int(moved.sum()), 26214 - 800, 26214 + 800, msg)
        np.testing.assert_array_equal(bx & 0x8000, by & 0x8000, msg)  # signs kept
        step = (by & 0x7FFF) - (bx & 0x7FFF)
        self.assertTrue(np.all(np.abs(step[moved]) == 1), msg)
        self.assertBetween(float(np.mean(step[moved] > 0)), 0.45, 0.55, msg)

    def test_edges_stay_finite(self):
        big = float(jnp.finfo(jnp.bfloat16).max)
        x = jnp.array([0.0, -0.0, big, -big, 1.0], jnp.bfloat16)
        for k in range(8):
            y = np.asarray(noise.one_ulp(x, jax.random.key(k), 1.0), np.float32)
            self.assertTrue(np.all(np.isfinite(y)), y)
            self.assertTrue(np.all(np.abs(y) <= big), y)

    def test_refuses_other_dtypes_and_rates(self):
        with self.assertRaisesRegex(ValueError, "bf16"):
            noise.one_ulp(jnp.zeros(4, jnp.float32), jax.random.key(0), 0.5)
        with self.assertRaisesRegex(ValueError, "rate"):
            with noise.quantizer_noise(jax.random.key(0), 0.0):
                pass


class PerturbTest(absltest.TestCase):

    def test_identity_outside_and_a_new_subset_per_call_inside(self):
        x = jnp.linspace(-4, 4, 4096, dtype=jnp.float32).astype(jnp.bfloat16).reshape(8, 512)
        self.assertIs(noise.perturb(x), x)
        self.assertFalse(noise.active())
        with noise.quantizer_noise(jax.random.key(SEED), 0.5):
            self.assertTrue(noise.active())
            a, b = noise.perturb(x), noise.perturb(x)
        self.assertFalse(noise.active())
        self.assertTrue(np.any(_bits(a) != _bits(x)))
        self.assertTrue(np.any(_bits(a) != _bits(b)), "two calls drew the same subset")


class ModelSeesTheNoiseTest(absltest.TestCase):

    def test_w4a8_linear(self):
        layer = nn.Linear(256, 128, quantize="w4a8", backend="reference", dtype=jnp.bfloat16,
                          rngs=nnx.Rngs(SEED))
        x = jax.random.normal(jax.random.key(SEED), (16, 256), jnp.bfloat16)
        clean = layer(x)
        with noise.quantizer_noise(jax.random.key(SEED + 1), 1.0):
            noisy = layer(x)
        self.assertTrue(np.any(np.asarray(noisy != clean)), f"seed {SEED}")
        np.testing.assert_array_equal(layer(x), clean)

    def test_fused_geglu_mlp_quantizes_the_same_input(self):
        mlp = Gemma4MLP(256, 512, backend="reference", dtype=jnp.bfloat16,
                        param_dtype=jnp.bfloat16, quantize="w4a8", rngs=nnx.Rngs(SEED))
        self.assertTrue(mlp.fuses_geglu())
        x = jax.random.normal(jax.random.key(SEED), (16, 256), jnp.bfloat16)
        clean = mlp(x)
        with noise.quantizer_noise(jax.random.key(SEED + 1), 1.0):
            noisy = mlp(x)
        self.assertTrue(np.any(np.asarray(noisy != clean)), f"seed {SEED}")
        # The probe's path with its moves switched off: reference.geglu, then the quantizer.
        with mock.patch.object(noise, "one_ulp", lambda x, key, rate: x), \
                noise.quantizer_noise(jax.random.key(SEED + 1), 1.0):
            np.testing.assert_array_equal(mlp(x), clean)

    def test_fused_norms_run_unfused_under_the_noise(self):
        cfg = fidelity.model_config("tiny", layers=2)
        model = fidelity.random_model(cfg, quantize="w4a8", backend="reference", seed=SEED)
        layer = model.layers[0]
        self.assertTrue(layer.fuses_input_norm(jnp.bfloat16))
        self.assertTrue(layer.fuses_pre_feedforward_norm(jnp.bfloat16, jnp.bfloat16))
        ids = jax.random.randint(jax.random.key(SEED), (1, 24), 3, cfg.vocab_size, jnp.int32)
        graphdef, state = nnx.split(model)

        @jax.jit
        def noisy(state, key):
            with noise.quantizer_noise(key, 1.0):
                self.assertFalse(layer.fuses_input_norm(jnp.bfloat16))  # traced under the noise
                return nnx.merge(graphdef, state)(ids)

        clean = jax.jit(lambda s: nnx.merge(graphdef, s)(ids))(state)
        key = jax.random.key(SEED + 1)
        self.assertTrue(np.any(np.asarray(noisy(state, key) != clean)), f"seed {SEED}")
        with mock.patch.object(noise, "one_ulp", lambda x, key, rate: x):
            noisy.clear_cache()
            np.testing.assert_array_equal(noisy(state, key), clean, f"seed {SEED}")
        # Every W4A8 projection's input went through the probe: the attention's input projections
        # (q, k, and v where the layer has one) and o, gate, up, down in each layer.
        seen = []
        real = noise.perturb
        with mock.patch.object(noise, "perturb", lambda x: seen.append(x.shape) or real(x)):
            noisy.clear_cache()
            noisy(state, key)
        expected = sum(len(l.self_attn.input_projections()) + 4 for l in model.layers)
        self.assertLen(seen, expected)


if __name__ == "__main__":
    absltest.main()
