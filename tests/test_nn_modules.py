"""jax_mila.nn: Linear, RMSNorm, Embed and Attention against plain formulas and the
reference attention; backend and quantize validation; the kernel/reference fallback rule."""

from __future__ import annotations

import logging
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from jax_mila import ffi, nn, reference


def fresh_key():
    return jax.random.key(int.from_bytes(os.urandom(4), "little"))


class LinearTest(parameterized.TestCase):

    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_matches_matmul_with_flax_layout(self, dtype):
        lin = nn.Linear(7, 5, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(fresh_key()))
        self.assertEqual(lin.kernel.shape, (7, 5))
        x = jax.random.normal(fresh_key(), (2, 3, 7)).astype(dtype)
        want = np.asarray(x, np.float32) @ np.asarray(lin.kernel[...], np.float32)
        got = lin(x)
        self.assertEqual(got.dtype, dtype)
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol)

    def test_rejects_unknown_backend_and_quantize(self):
        with self.assertRaisesRegex(ValueError, "backend='gpu' is not supported"):
            nn.Linear(2, 2, backend="gpu")
        with self.assertRaisesRegex(ValueError, "quantize='int4' is not supported"):
            nn.Linear(2, 2, quantize="int4")


class NormTest(absltest.TestCase):

    def test_weight_multiplies_directly_no_one_plus(self):
        norm = nn.RMSNorm(6, eps=1e-6)
        norm.weight[...] = jnp.arange(6, dtype=jnp.float32) * 0.5   # includes a zero weight
        x = jax.random.normal(fresh_key(), (4, 6)) * 3.0
        xn = np.asarray(x)
        want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * (np.arange(6) * 0.5)
        np.testing.assert_allclose(np.asarray(norm(x)), want, rtol=1e-5, atol=1e-6)
        self.assertTrue(np.all(np.asarray(norm(x))[:, 0] == 0))

    def test_without_scale_and_dtype(self):
        norm = nn.RMSNorm(8, with_scale=False)
        self.assertFalse(hasattr(norm, "weight"))
        x = (jax.random.normal(fresh_key(), (3, 8)) * 100).astype(jnp.bfloat16)
        y = norm(x)
        self.assertEqual(y.dtype, jnp.bfloat16)
        np.testing.assert_allclose(np.sqrt((np.asarray(y, np.float32) ** 2).mean(-1)), 1.0, rtol=1e-2)


class EmbedTest(absltest.TestCase):

    def test_scale_rounded_to_dtype(self):
        emb = nn.Embed(4, 3840, scale=3840**0.5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        emb.weight[...] = jnp.ones((4, 3840), jnp.bfloat16)
        self.assertEqual(float(emb(jnp.array([1]))[0, 0]), 62.0)   # bf16(61.97) as HF
        emb32 = nn.Embed(4, 8, scale=3840**0.5)
        emb32.weight[...] = jnp.ones((4, 8))
        self.assertAlmostEqual(float(emb32(jnp.array([0]))[0, 0]), 3840**0.5, places=4)


class AttentionTest(parameterized.TestCase):

    def _qkv(self, d, dtype, t=9, s=9, hq=4, hkv=2):
        q = jax.random.normal(fresh_key(), (2, t, hq, d)).astype(dtype)
        k = jax.random.normal(fresh_key(), (2, s, hkv, d)).astype(dtype)
        v = jax.random.normal(fresh_key(), (2, s, hkv, d)).astype(dtype)
        return q, k, v

    @parameterized.product(backend=("auto", "mila", "reference"), d=(16, 256), window=(None, 3))
    def test_matches_reference(self, backend, d, window):
        q, k, v = self._qkv(d, jnp.bfloat16)
        attn = nn.Attention(scale=1.0, backend=backend)
        got = attn(q, k, v, window=window, q_offset=0, kv_offset=0)
        want = reference.flash_attention(q, k, v, scale=1.0, causal=True, window=window)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=2e-2, rtol=2e-2)

    def test_window_edge_and_offsets(self):
        """Query at position p sees keys p-W+1 .. p: a one-hot value at each key position."""
        w, s = 3, 8
        q = jnp.zeros((1, 1, 1, 16), jnp.float32)          # uniform scores
        k = jnp.zeros((1, s, 1, 16), jnp.float32)
        v = jnp.eye(s, 16, dtype=jnp.float32)[None, :, None, :]
        attn = nn.Attention(scale=1.0, backend="reference")
        out = attn(q, k, v, window=w, q_offset=12, kv_offset=5)   # keys at positions 5..12
        seen = np.nonzero(np.asarray(out)[0, 0, 0] > 0)[0] + 5
        np.testing.assert_array_equal(seen, [10, 11, 12])

    @parameterized.parameters(
        ("auto", 256, jnp.bfloat16, True), ("mila", 512, jnp.bfloat16, True),
        ("reference", 256, jnp.bfloat16, False), ("auto", 256, jnp.float32, False),
        ("mila", 64, jnp.bfloat16, False))
    def test_routing_to_the_ffi(self, backend, d, dtype, via_ffi):
        q, k, v = self._qkv(d, dtype, t=2, s=2)
        calls = []

        def fake_ffi(*args, **kwargs):
            calls.append(kwargs)
            return reference.flash_attention(*args, **kwargs)

        with mock.patch.object(ffi, "flash_attention", fake_ffi):
            nn.Attention(scale=1.0, backend=backend)(q, k, v, window=2, q_offset=3, kv_offset=3)
        self.assertEqual(bool(calls), via_ffi)
        if via_ffi:
            self.assertEqual(calls[0], dict(scale=1.0, causal=True, window=2, q_offset=3, kv_offset=3))

    @parameterized.product(backend=("auto", "mila", "reference"),
                           case=((16, jnp.float32, 3), (256, jnp.bfloat16, 64),
                                 (512, jnp.bfloat16, 64), (512, jnp.bfloat16, 0)))
    def test_rotary_keys_only_reads_v_outside_the_rotated_columns(self, backend, case):
        d, dtype, r = case
        q, k, v = self._qkv(d, dtype, hq=4, hkv=1)
        attn = nn.Attention(scale=None, backend=backend, rotary_keys_only=r)
        self.assertEqual(attn.rotary_keys_only, r)
        got, got_lse = attn(q, k, v, window=5, q_offset=2, kv_offset=2, return_lse=True)
        keys = reference.keys_except_rotary(k, v, r)
        col = np.arange(d) % (d // 2)
        np.testing.assert_array_equal(np.asarray(keys[..., col < r], np.float32),
                                      np.asarray(k[..., col < r], np.float32))
        np.testing.assert_array_equal(np.asarray(keys[..., col >= r], np.float32),
                                      np.asarray(v[..., col >= r], np.float32))
        want, want_lse = reference.flash_attention(q, keys, v, causal=True, window=5, q_offset=2,
                                                   kv_offset=2, return_lse=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=2e-2, rtol=1e-3)
        # The flag matters (k and v differ outside the rotated columns): plain attention differs.
        plain = nn.Attention(scale=None, backend=backend)(q, k, v, window=5, q_offset=2,
                                                         kv_offset=2)
        self.assertGreater(float(jnp.max(jnp.abs(plain.astype(jnp.float32) - want))), 0.1)

    @parameterized.parameters(("mila", 512, jnp.bfloat16, True), ("auto", 16, jnp.float32, False),
                              ("reference", 256, jnp.bfloat16, False))
    def test_rotary_keys_only_reaches_the_ffi_and_the_reference(self, backend, d, dtype, via_ffi):
        q, k, v = self._qkv(d, dtype, t=2, s=2)
        with mock.patch.object(ffi, "flash_attention", wraps=ffi.flash_attention) as to_ffi, \
                mock.patch.object(reference, "flash_attention",
                                  wraps=reference.flash_attention) as to_ref:
            nn.Attention(scale=1.0, backend=backend, rotary_keys_only=8)(q, k, v, window=2)
        self.assertEqual(to_ffi.called, via_ffi)
        first = (to_ffi if via_ffi else to_ref).call_args_list[0]
        self.assertEqual(first.kwargs["rotary_keys_only"], 8)

    def test_rotary_keys_only_is_validated(self):
        self.assertIsNone(nn.Attention(scale=1.0).rotary_keys_only)
        for bad in (-1, True, 1.5, "64"):
            with self.assertRaisesRegex(ValueError, "rotary_keys_only"):
                nn.Attention(scale=1.0, rotary_keys_only=bad)

    def test_fallback_is_logged_once(self):
        q, k, v = self._qkv(24, jnp.float32)
        attn = nn.Attention(scale=1.0, backend="auto")
        with self.assertLogs("jax_mila", level=logging.INFO) as logs:
            attn(q, k, v)
            logging.getLogger("jax_mila").info("marker")
        self.assertTrue(any("head_dim=24" in line for line in logs.output))
        with self.assertLogs("jax_mila", level=logging.INFO) as logs:
            attn(q, k, v)
            logging.getLogger("jax_mila").info("marker")
        self.assertFalse(any("head_dim=24" in line for line in logs.output))


if __name__ == "__main__":
    absltest.main()
