"""The Hopper D=256 flash attention (csrc/flash256_sm90/, target *_d256_sm90).

CPU: jax_mila.ffi.attention routes D=256 calls to it when the target is built, every GPU has
compute capability 9.0 and Hq / Hkv divides a consumer's 64 rows.
GPU (cc 9.0, a build whose architectures include 90a): the new kernel against the mma.sync
kernel (its oracle) on the same inputs, called through both FFI targets directly, so that
routing cannot make the comparison vacuous. The full contract suite
(tests/test_flash_attention.py) runs both kernels: its default D=256 class through this one,
its MmaSync class with the Hopper target unmapped (attention._SM90_TARGETS).
"""

from __future__ import annotations

import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi
from jax_mila.ffi import attention
import testing  # tests/testing.py

SM90 = attention.D256_SM90_TARGET
MMA = "jax_mila_flash_attention_d256"


def _shapes(hq, hkv):
    return (jax.ShapeDtypeStruct((1, 8, hq, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 8, hkv, 256), jnp.bfloat16))


class RoutingTest(parameterized.TestCase):
    def _target(self, caps, registered, hq=16, hkv=8):
        with mock.patch.object(attention, "cuda_capabilities", lambda: caps), \
                mock.patch.object(attention, "_registered_targets",
                                  lambda: frozenset(registered)):
            return attention._target(*_shapes(hq, hkv))

    @parameterized.named_parameters(("_gemma_g2", 16, 8), ("_g1", 4, 4), ("_g16", 16, 1))
    def test_hopper_routes_to_sm90(self, hq, hkv):
        self.assertEqual(self._target(((9, 0),), {MMA, SM90}, hq, hkv), SM90)

    @parameterized.named_parameters(
        ("_not_built", ((9, 0),), {MMA}, 16, 8),
        ("_ampere", ((8, 0),), {MMA, SM90}, 16, 8),
        ("_mixed_gpus", ((9, 0), (8, 0)), {MMA, SM90}, 16, 8),
        ("_no_gpu", (), {MMA, SM90}, 16, 8),
        ("_groups_not_dividing_64", ((9, 0),), {MMA, SM90}, 12, 4),
    )
    def test_otherwise_the_mma_sync_kernel(self, caps, registered, hq, hkv):
        self.assertEqual(self._target(caps, registered, hq, hkv), MMA)

    def test_unmapping_one_head_dim_leaves_the_other(self):
        # The tests' way to run the mma.sync kernel on Hopper: each head dim has its own entry.
        d512 = ("jax_mila_flash_attention_d512", attention.D512_SM90_TARGET)
        with mock.patch.object(attention, "cuda_capabilities", lambda: ((9, 0),)), \
                mock.patch.object(attention, "_registered_targets",
                                  lambda: frozenset({MMA, SM90, *d512})):
            q = jax.ShapeDtypeStruct((1, 8, 16, 512), jnp.bfloat16)
            k = jax.ShapeDtypeStruct((1, 8, 1, 512), jnp.bfloat16)
            with mock.patch.dict(attention._SM90_TARGETS, {512: None}):
                self.assertEqual(attention._target(q, k), d512[0])
                self.assertEqual(attention._target(*_shapes(16, 8)), SM90)
            with mock.patch.dict(attention._SM90_TARGETS, {256: None}):
                self.assertEqual(attention._target(q, k), d512[1])
                self.assertEqual(attention._target(*_shapes(16, 8)), MMA)

    def test_target_is_a_known_flash_attention_target(self):
        ffi.status("flash_attention", SM90)  # raises ValueError for an unknown target


# (name, B, T, S, Hq, Hkv, causal, window, q_offset, kv_offset, scale): never tile multiples.
# A CTA holds 128 packed rows (two consumers of 64) and streams 64-key tiles through 2 stages.
CASES = (
    # Gemma 4 local layer: G = 2, W = 1024; ~18 tiles a CTA, so the ring's parities wrap.
    ("gemma_w1024_t2500", 1, 2500, 2500, 16, 8, True, 1024, 0, 0, 1.0),
    # Queries at the end of a longer key range (T < S), window W = 1024.
    ("w1024_tail_queries", 1, 700, 2000, 16, 8, True, 1024, 1300, 0, 1.0),
    # W = 1, G = 1: each consumer sees keys the other does not (both skip a tile of the CTA's).
    ("window1_gqa1", 1, 333, 333, 2, 2, True, 1, 0, 0, 0.0625),
    ("window5_b2_gqa8", 2, 197, 197, 8, 1, True, 5, 0, 0, 0.0625),
    ("window100_tail_gqa4", 1, 133, 1000, 8, 2, True, 100, 867, 0, 0.0625),
    ("window100_b2_gqa2", 2, 300, 333, 4, 2, True, 100, 0, 0, 0.05),
    # No window: causal (long key range, offsets) and not causal.
    ("causal_tail_gqa16", 1, 97, 1000, 16, 1, True, 0, 903, 0, 1.0),
    ("noncausal_gqa2", 1, 130, 200, 4, 2, False, 0, 0, 0, 0.05),
    # kv_offset > q_offset: the first 30 positions see no key (zeros, lse -inf); the window
    # then masks rows whose keys all lie below it.
    ("masked_rows_gqa2", 1, 90, 150, 4, 2, True, 0, 0, 30, 0.1),
    ("masked_rows_window_gqa8", 1, 70, 100, 8, 1, True, 7, 0, 40, 0.1),
    # More work items (M tiles x KV heads x batch) than an H200 has SMs (132): each persistent
    # CTA runs several items, so the Q and K/V ring phases carry over from item to item, with
    # one-tile items and skipped tiles (W = 1) or item sizes that vary (causal, offsets).
    ("many_items_window1_b2_gqa1", 2, 3000, 3000, 4, 4, True, 1, 0, 0, 0.0625),
    ("many_items_causal_offsets_gqa4", 1, 1500, 2100, 16, 4, True, 0, 600, 0, 0.0625),
    # Four rounds of the tile scheduler on 132 SMs (504 items), the last one odd (reversed)
    # and partial.
    ("four_rounds_causal_gqa2", 1, 4000, 4000, 16, 8, True, 0, 0, 0, 0.0625),
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
        q = jax.random.normal(kq, (b, t, hq, 256), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (b, s, hkv, 256), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (b, s, hkv, 256), jnp.float32).astype(jnp.bfloat16)
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
        # Fully masked rows are exact zeros in both.
        np.testing.assert_array_equal(o1[np.broadcast_to(
            np.isneginf(l0).transpose(0, 2, 1)[..., None], o1.shape)], 0.0, msg)
        # Not vacuous: the inputs give non-trivial outputs, and some rows see keys.
        self.assertGreater(float(np.abs(o0).max()), 1e-3, msg)
        self.assertTrue(fin.any(), msg)

    def test_routing_reaches_the_hlo(self):
        q = jnp.zeros((1, 8, 16, 256), jnp.bfloat16)
        k = jnp.zeros((1, 8, 8, 256), jnp.bfloat16)

        def lowered():
            # A fresh function each time: jit caches traces per function, and the route is
            # chosen when the call is traced.
            def fn(q, k):
                return ffi.flash_attention(q, k, k, scale=1.0, causal=True, window=4)

            return jax.jit(fn).lower(q, k).as_text()

        self.assertIn(SM90, lowered())
        with mock.patch.dict(attention._SM90_TARGETS, {256: None}):
            hlo = lowered()
        self.assertNotIn(SM90, hlo)
        self.assertIn(MMA, hlo)


if __name__ == "__main__":
    absltest.main()
