"""The Hopper D=512 flash attention (csrc/flash512_sm90/, targets *_d512_sm90 and
*_d512_sm90_rotary_keys).

CPU: jax_mila.ffi.attention routes D=512 calls to it when the target is built, every GPU has
compute capability 9.0 and Hq / Hkv divides its 64-row tile.
GPU (cc 9.0, built with JAX_MILA_KERNELS=...;flash512_sm90): the new kernel against the
mma.sync kernel (its oracle) on the same inputs, called through both FFI targets directly,
so that routing cannot make the comparison vacuous. The full contract suite
(tests/test_flash_attention.py) runs both: its default D=512 class through this kernel, its
MmaSync class with the Hopper target unmapped (attention._SM90_TARGETS); the test here also
proves that the default really routes to the new target and that unmapping routes away.
The rotary-keys instance (rotary_keys_only=64: scores from K's rotated columns and V's others)
is held to the mma.sync kernel given the substituted keys (reference.keys_except_rotary).
"""

from __future__ import annotations

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi, reference
from jax_mila.ffi import attention
import testing  # tests/testing.py

SM90 = attention.D512_SM90_TARGET
ROTARY = attention.D512_SM90_ROTARY_KEYS_TARGET
MMA = "jax_mila_flash_attention_d512"


def _shapes(hq, hkv):
    return (jax.ShapeDtypeStruct((1, 8, hq, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 8, hkv, 512), jnp.bfloat16))


class RoutingTest(parameterized.TestCase):
    def _target(self, caps, registered, hq=16, hkv=1):
        with mock.patch.object(attention, "cuda_capabilities", lambda: caps), \
                mock.patch.object(attention, "_registered_targets",
                                  lambda: frozenset(registered)):
            return attention._target(*_shapes(hq, hkv))

    def test_hopper_routes_to_sm90(self):
        self.assertEqual(self._target(((9, 0),), {MMA, SM90}), SM90)

    @parameterized.named_parameters(
        ("_not_built", ((9, 0),), {MMA}, 16, 1),
        ("_ampere", ((8, 0),), {MMA, SM90}, 16, 1),
        ("_mixed_gpus", ((9, 0), (8, 0)), {MMA, SM90}, 16, 1),
        ("_no_gpu", (), {MMA, SM90}, 16, 1),
        ("_groups_not_dividing_64", ((9, 0),), {MMA, SM90}, 12, 4),
    )
    def test_otherwise_the_mma_sync_kernel(self, caps, registered, hq, hkv):
        self.assertEqual(self._target(caps, registered, hq, hkv), MMA)

    def test_target_is_a_known_flash_attention_target(self):
        for target in (SM90, ROTARY):
            ffi.status("flash_attention", target)  # raises ValueError for an unknown target

    def _route(self, caps, registered, r, hq=16, hkv=1):
        q = jnp.zeros((1, 8, hq, 512), jnp.bfloat16)
        k = jnp.ones((1, 8, hkv, 512), jnp.bfloat16)
        v = jnp.full((1, 8, hkv, 512), 2, jnp.bfloat16)
        with mock.patch.object(attention, "cuda_capabilities", lambda: caps), \
                mock.patch.object(attention, "_registered_targets", lambda: frozenset(registered)):
            target, keys, r_out = attention._route(q, k, v, r)
        return target, np.asarray(keys[0, 0, 0], np.float32), r_out

    def test_rotary_keys_route_to_their_kernel_with_the_raw_keys(self):
        target, keys, r = self._route(((9, 0),), {MMA, SM90, ROTARY}, 64)
        self.assertEqual((target, r), (ROTARY, 64))
        np.testing.assert_array_equal(keys, 1.0)  # k itself: the kernel picks the columns

    @parameterized.named_parameters(
        ("_other_width", ((9, 0),), {MMA, SM90, ROTARY}, 32, SM90),
        ("_ampere", ((8, 0),), {MMA, SM90, ROTARY}, 64, MMA),
        ("_not_built", ((9, 0),), {MMA}, 64, MMA),
    )
    def test_otherwise_the_substituted_keys(self, caps, registered, r, expected):
        target, keys, r_out = self._route(caps, registered, r)
        self.assertEqual((target, r_out), (expected, None))
        col = np.arange(512) % 256
        np.testing.assert_array_equal(keys, np.where(col < r, 1.0, 2.0))

    def test_without_rotary_keys_nothing_changes(self):
        target, keys, r = self._route(((9, 0),), {MMA, SM90, ROTARY}, None)
        self.assertEqual((target, r), (SM90, None))
        np.testing.assert_array_equal(keys, 1.0)


# (name, B, T, S, Hq, Hkv, causal, window, q_offset, kv_offset, scale): never tile multiples.
CASES = (
    ("gemma_causal_t1000", 1, 1000, 1000, 16, 1, True, 0, 0, 0, 1.0),
    ("gemma_tail_queries", 1, 97, 1000, 16, 1, True, 0, 903, 0, 1.0),
    ("window100_b2_gqa4", 2, 300, 333, 8, 2, True, 100, 0, 0, 0.05),
    ("noncausal_gqa1", 1, 130, 200, 2, 2, False, 0, 0, 0, 0.05),
    ("masked_rows_gqa2", 1, 40, 70, 2, 1, True, 0, 0, 30, 0.1),
    # Any finite scale is in the contract: a negative one turns the row maxima into minima of
    # the raw scores (the kernels scale before taking them).
    ("negative_scale_gqa16", 1, 100, 100, 16, 1, True, 0, 0, 0, -0.05),
)


class Sm90VersusMmaSyncGpuTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "flash_attention", SM90)
        testing.skip_unless_kernel(self, "flash_attention", MMA)
        if testing.compute_capability() != (9, 0):
            self.skipTest("the sm90 kernel runs on compute capability 9.0 only")

    @parameterized.named_parameters(*[(f"_{c[0]}",) + c[1:] for c in CASES])
    def test_matches_mma_sync_kernel(self, b, t, s, hq, hkv, causal, window, qo, ko, scale):
        seed = int.from_bytes(os.urandom(4), "little")
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        q = jax.random.normal(kq, (b, t, hq, 512), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (b, s, hkv, 512), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (b, s, hkv, 512), jnp.float32).astype(jnp.bfloat16)
        kw = dict(scale=scale, causal=causal, window=window)
        # Poisoned outputs: an element the sm90 kernel never writes stays NaN and fails below.
        call = testing.attention_target_call
        o1, l1 = testing.call_with_poisoned_outputs(lambda *a: call(SM90, *a, **kw), q, k, v, qo, ko)
        o0, l0 = jax.jit(lambda *a: call(MMA, *a, **kw))(q, k, v, qo, ko)
        o1, l1, o0, l0 = (np.asarray(x, np.float32) for x in (o1, l1, o0, l0))
        msg = f"seed={seed}"
        self.assertTrue(np.isfinite(o1).all(), msg)
        np.testing.assert_array_equal(np.isneginf(l1), np.isneginf(l0), msg)
        fin = np.isfinite(l0)
        # Both are fp32-accumulated with bf16 P: they differ by summation order and P rounding.
        np.testing.assert_allclose(l1[fin], l0[fin], atol=2e-3, rtol=1e-4, err_msg=msg)
        self.assertLess(float(np.abs(o1 - o0).max()), 2e-2 * max(1.0, float(np.abs(o0).max())),
                        msg)
        # Not vacuous: the inputs give non-trivial outputs.
        self.assertGreater(float(np.abs(o0).max()), 1e-3, msg)

    @parameterized.named_parameters(*[(f"_{c[0]}",) + c[1:] for c in CASES])
    def test_rotary_keys_match_mma_sync_on_the_substituted_keys(self, b, t, s, hq, hkv, causal,
                                                                window, qo, ko, scale):
        seed = int.from_bytes(os.urandom(4), "little")
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        q = jax.random.normal(kq, (b, t, hq, 512), jnp.float32).astype(jnp.bfloat16)
        # Large and shifted keys outside the rotated columns: were the kernel to read them
        # there, the scores (and outputs) would be far from the oracle's.
        k = (4 * jax.random.normal(kk, (b, s, hkv, 512), jnp.float32) + 3).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (b, s, hkv, 512), jnp.float32).astype(jnp.bfloat16)
        kw = dict(scale=scale, causal=causal, window=window)
        call = testing.attention_target_call
        o1, l1 = testing.call_with_poisoned_outputs(lambda *a: call(ROTARY, *a, **kw),
                                                    q, k, v, qo, ko)
        k_eff = reference.keys_except_rotary(k, v, 64)
        o0, l0 = jax.jit(lambda *a: call(MMA, *a, **kw))(q, k_eff, v, qo, ko)
        o2, _ = jax.jit(lambda *a: call(MMA, *a, **kw))(q, k, v, qo, ko)
        o1, l1, o0, l0, o2 = (np.asarray(x, np.float32) for x in (o1, l1, o0, l0, o2))
        msg = f"seed={seed}"
        self.assertTrue(np.isfinite(o1).all(), msg)
        np.testing.assert_array_equal(np.isneginf(l1), np.isneginf(l0), msg)
        fin = np.isfinite(l0)
        np.testing.assert_allclose(l1[fin], l0[fin], atol=2e-3, rtol=1e-4, err_msg=msg)
        tol = 2e-2 * max(1.0, float(np.abs(o0).max()))
        self.assertLess(float(np.abs(o1 - o0).max()), tol, msg)
        self.assertGreater(float(np.abs(o0).max()), 1e-3, msg)
        # Not vacuous: attention over the raw k is another result (on rows that see > 1 key).
        self.assertGreater(float(np.abs(o2 - o0).max()), 10 * tol, msg)

    def test_rotary_keys_with_rising_scores(self):
        # The lazy row maximum's regime (sf::OnlineSoftmaxLazy, slack 8 in log2 units): every
        # query's scores rise along the keys, ~1.4 (log2) per 64-key tile, so the maximum stays
        # put for several tiles while P grows toward 2^8, then moves; ties to the oracle as above.
        seed = int.from_bytes(os.urandom(4), "little")
        t, s, hq = 97, 1000, 16
        q = jnp.zeros((1, t, hq, 512), jnp.float32).at[..., 0].set(1.0).astype(jnp.bfloat16)
        rising = 0.015 * jnp.arange(s, dtype=jnp.float32)
        k = jnp.zeros((1, s, 1, 512), jnp.float32).at[0, :, 0, 0].set(rising).astype(jnp.bfloat16)
        v = jax.random.normal(jax.random.key(seed), (1, s, 1, 512), jnp.float32).astype(jnp.bfloat16)
        qo, ko = s - t, 0
        kw = dict(scale=1.0, causal=True, window=0)
        call = testing.attention_target_call
        o1, l1 = testing.call_with_poisoned_outputs(lambda *a: call(ROTARY, *a, **kw),
                                                    q, k, v, qo, ko)
        k_eff = reference.keys_except_rotary(k, v, 64)
        o0, l0 = jax.jit(lambda *a: call(MMA, *a, **kw))(q, k_eff, v, qo, ko)
        o1, l1, o0, l0 = (np.asarray(x, np.float32) for x in (o1, l1, o0, l0))
        msg = f"seed={seed}"
        # Not vacuous: from the first tile to the last key the scores rise by more than twice
        # the slack, so the maximum moves and stays put in between.
        scores = np.asarray(k[0, :, 0, 0], np.float32) * np.log2(np.e)
        self.assertGreater(scores.max() - scores[:64].max(), 16.0)
        self.assertTrue(np.isfinite(o1).all(), msg)
        np.testing.assert_allclose(l1, l0, atol=2e-3, rtol=1e-4, err_msg=msg)
        self.assertLess(float(np.abs(o1 - o0).max()), 2e-2 * max(1.0, float(np.abs(o0).max())),
                        msg)

    @parameterized.named_parameters(("_default", {}, True), ("_unmapped", {512: None}, False))
    def test_routing_reaches_the_hlo(self, targets, sm90):
        q = jnp.zeros((1, 8, 16, 512), jnp.bfloat16)
        with mock.patch.dict(attention._SM90_TARGETS, targets):
            hlo = jax.jit(lambda q: ffi.flash_attention(q, q[:, :, :1], q[:, :, :1], scale=1.0,
                                                        causal=True)).lower(q).as_text()
        (self.assertIn if sm90 else self.assertNotIn)(SM90, hlo)
        self.assertIn(SM90 if sm90 else MMA, hlo)


if __name__ == "__main__":
    absltest.main()
