"""W4A8 GEMM (jax_mila.ffi.w4a8_matmul): the pure-JAX reference and trace-time validation on
CPU, and the CUDA kernels (wgmma on sm_90a, mma.sync on sm_89+) against the reference on GPU.

Under compute-sanitizer (detected from the injected library) only the small GPU cases run.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi, quant, reference
from jax_mila.ffi import w4a8 as w4a8_module
import testing  # tests/testing.py


KERNELS = ["auto", "mma_sync", "wgmma", "wgmma_ws", "wgmma_ws_dp", "wgmma_ws_cluster",
           "wgmma_ws_e4m3", "wgmma_ws_e4m3_cluster"]
HOPPER_KERNELS = tuple(KERNELS[2:])  # sm_90a only


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@functools.cache
def _under_compute_sanitizer() -> bool:
    if "sanitizer" in os.environ.get("CUDA_INJECTION64_PATH", "").lower():
        return True
    try:
        with open("/proc/self/maps") as f:
            return "sanitizer" in f.read().lower()
    except OSError:
        return False


def _operands(m, n, k, seed, *, lead=None, w_scale=None):
    """bf16 activations -> (x_fp8, x_scale) through quantize_activations; an MXFP4 weight."""
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (lead or (m,)) + (k,), jnp.float32) * 3.0
    w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
    if w_scale is not None:  # per-channel magnitudes spanning many binades
        w = w * jnp.exp2(jax.random.randint(kc, (n, 1), -w_scale, w_scale + 1).astype(jnp.float32))
    xq, xs = ffi.quantize_activations(x.astype(jnp.bfloat16))
    return xq, xs, quant.quantize_mxfp4(w)


def _conversion_order_output(seed: int) -> np.ndarray:
    """wgmma_ws's float32 and bf16 outputs (as float32) for a few shapes, concatenated: what
    test_conversion_orders_agree_bitwise compares across processes."""
    outs = []
    for m, n, k in ((97, 264, 384), (300, 264, 1664), (1, 8, 128)):
        xq, xs, w = _operands(m, n, k, seed + m)
        for dtype in (jnp.float32, jnp.bfloat16):
            y = ffi.w4a8_matmul(xq, xs, w, out_dtype=dtype, kernel="wgmma_ws")
            outs.append(np.asarray(y, np.float32).ravel())
    return np.concatenate(outs)


def _exact_product(xq, xs, w):
    """float64 (x_fp8 * x_scale) @ dequantize(w).T on the host: a path independent of JAX."""
    x64 = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)[..., None]
    w64 = np.asarray(quant.dequantize_mxfp4(w), np.float64)
    return x64 @ w64.T


class W4A8ReferenceTest(parameterized.TestCase):
    """CPU: the reference GEMM and the wrapper's validation (same on every platform)."""

    @parameterized.parameters((1, 8, 128), (97, 264, 384), (33, 128, 1024))
    def test_reference_matches_float64_product(self, m, n, k):
        xq, xs, w = _operands(m, n, k, _seed())
        want = _exact_product(xq, xs, w)
        got32 = reference.w4a8_matmul(xq, xs, w, out_dtype=jnp.float32)
        self.assertLess(testing.rel_fro_err(got32, want), 1e-5)
        got16 = reference.w4a8_matmul(xq, xs, w)
        self.assertEqual(got16.dtype, jnp.bfloat16)
        self.assertLess(testing.rel_fro_err(got16, want), 4e-3)  # bf16 rounding: ~1.7e-3

    def test_wrapper_leading_dims_and_jit(self):
        xq, xs, w = _operands(None, 64, 256, _seed(), lead=(2, 5))
        y = jax.jit(ffi.w4a8_matmul)(xq, xs, w)
        self.assertEqual(y.shape, (2, 5, 64))
        # The same op on the flattened rows (the CUDA kernel on a GPU, the reference on CPU):
        # the leading dimensions may only be reshaped away, never change a value.
        flat = ffi.w4a8_matmul(xq.reshape(10, 256), xs.reshape(10), w)
        np.testing.assert_array_equal(np.asarray(y).reshape(10, 64), np.asarray(flat))

    def test_reference_flushes_blocks_that_break_the_invariant(self):
        # A hand-made weight whose block 1 is 12 exponents below the channel's: zero there.
        q = quant.quantize_mxfp4(jnp.ones((8, 128), jnp.float32))
        scales = np.asarray(q.scales).copy()
        scales[:, 1] = scales[:, 0] - 12
        bad = quant.MXFP4Weight(q.packed, jnp.asarray(scales), q.channel_exp)
        self.assertFalse(quant.check_kernel_invariant(bad))
        deq = np.asarray(quant.dequantize_mxfp4(bad, kernel_semantics=True))
        np.testing.assert_array_equal(deq[:, 32:64], 0.0)
        np.testing.assert_array_equal(deq[:, :32], 1.0)

    def _good(self, m=4, n=64, k=256):
        return _operands(m, n, k, 0)

    def test_rejects_unsupported_k(self):
        xq = jnp.zeros((4, 96), jnp.float8_e4m3fn)
        xs = jnp.ones((4,), jnp.float32)
        w = quant.MXFP4Weight(jnp.zeros((64, 48), jnp.uint8), jnp.zeros((64, 3), jnp.uint8),
                              jnp.zeros((64,), jnp.uint8))
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: w: .*K % 128 == 0"):
            ffi.w4a8_matmul(xq, xs, w)

    def test_rejects_unsupported_n(self):
        xq, xs, _ = self._good()
        w = quant.quantize_mxfp4(jnp.ones((100, 256), jnp.float32))
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: w: N=100 is not supported"):
            ffi.w4a8_matmul(xq, xs, w)

    def test_rejects_empty_weights(self):
        xq, xs, _ = self._good()
        w = quant.MXFP4Weight(jnp.zeros((0, 128), jnp.uint8), jnp.zeros((0, 8), jnp.uint8),
                              jnp.zeros((0,), jnp.uint8))
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: w: N=0 output channels"):
            ffi.w4a8_matmul(xq, xs, w)

    def test_explicit_wgmma_kernels_need_sm90a_code_on_sm90(self):
        # Named explicitly, a wgmma kernel must fail at trace time where it cannot run: a build
        # without sm_90a code would hand a Hopper GPU an empty PTX-JIT kernel (output never
        # written), and other GPUs have no wgmma. Without a GPU the reference runs instead.
        xq, xs, w = self._good()
        built = mock.Mock(return_value=mock.Mock(kernel=True))
        cases = [("80-real,89-real", ((9, 0),), "needs sm_90a code, and this build has "
                  "JAX_MILA_CUDA_ARCHS='80-real,89-real'"),
                 ("80-real,89-real,90a", ((8, 9),), r"runs on compute capability 9.0 only; "
                  r"this process has GPUs of \[\(8, 9\)\]"),
                 ("80-real,89-real,90a", ((9, 0), (8, 9)), "runs on compute capability 9.0")]
        for archs, caps, pattern in cases:
            for kernel in HOPPER_KERNELS:
                with self.subTest(archs=archs, caps=caps, kernel=kernel), \
                     mock.patch.multiple(w4a8_module, status=built,
                                         build_info=mock.Mock(return_value={"cuda_archs": archs}),
                                         cuda_capabilities=mock.Mock(return_value=caps)), \
                     self.assertRaisesRegex(ValueError, f"kernel: '{kernel}' {pattern}"):
                    ffi.w4a8_matmul(xq, xs, w, kernel=kernel)
        with mock.patch.multiple(w4a8_module, status=built,
                                 build_info=mock.Mock(return_value={"cuda_archs": "80-real"}),
                                 cuda_capabilities=mock.Mock(return_value=())):
            ffi.w4a8_matmul(xq, xs, w, kernel="wgmma_ws")  # no GPU: the reference

    def test_rejects_bad_arguments(self):
        xq, xs, w = self._good()
        cases = [
            (dict(x_fp8=xq.astype(jnp.bfloat16)), r"x_fp8: dtype bfloat16 is not supported"),
            (dict(x_scale=xs.astype(jnp.bfloat16)), r"x_scale: dtype bfloat16"),
            (dict(x_scale=xs[:3]), r"x_scale: shape \[3\] must be x_fp8's leading shape \[4\]"),
            (dict(x_fp8=xq[:, :128]), r"x_fp8: K=128 .* must equal the weight's K=256"),
            (dict(x_fp8=xq[:0], x_scale=xs[:0]), r"x_fp8: empty arrays"),
            (dict(out_dtype=jnp.float16), r"out_dtype: float16 is not supported"),
            (dict(kernel="cutlass"), r"kernel: 'cutlass' is not one of"),
            (dict(w=w.packed), r"w: expected a jax_mila.quant.MXFP4Weight"),
        ]
        for override, pattern in cases:
            args = dict(x_fp8=xq, x_scale=xs, w=w)
            args.update(override)
            kwargs = {k: args.pop(k) for k in ("out_dtype", "kernel") if k in args}
            with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
                ffi.w4a8_matmul(args["x_fp8"], args["x_scale"], args["w"], **kwargs)

    def test_sm80_devices_route_to_the_reference(self):
        # With the kernel "built" and a GPU older than sm_89 in the process, the call must trace
        # to the reference (no custom call in the jaxpr) rather than fail inside the handler.
        from jax_mila.ffi import _registry
        forced = lambda op, target=None: _registry.OpStatus(op, True, "forced by the test")
        xq, xs, w = self._good()
        with mock.patch.object(_registry, "status", forced), \
             mock.patch.object(_registry, "cuda_capabilities", return_value=((8, 0),)):
            # A fresh lambda: make_jaxpr caches traces per function, and mocks do not show.
            jaxpr = str(jax.make_jaxpr(lambda *a: ffi.w4a8_matmul(*a))(xq, xs, w))
            y = ffi.w4a8_matmul(xq, xs, w)
        self.assertNotIn("jax_mila_w4a8_matmul", jaxpr)
        np.testing.assert_array_equal(np.asarray(y),
                                      np.asarray(reference.w4a8_matmul(xq, xs, w)))

    def test_stream_k_workspace_size(self):
        # One 128 KiB float32 slot per SM (+ 4 KiB of flags) where wgmma_ws may run ("auto",
        # "wgmma_ws", "wgmma_ws_cluster" and the expanding variants); a token elsewhere; an
        # H200's 132 SMs when the devices do not say. The e4m3 variants and "auto" with room
        # for the expanded weights (variant 8) add N x K bytes and 256 to align them.
        slot, flags = 128 * 256 * 4, 4096
        variant = w4a8_module.KERNELS
        devices = [mock.Mock(core_count=132), mock.Mock(core_count=148)]
        n, k = 264, 384
        with mock.patch.object(w4a8_module.jax, "devices", return_value=devices):
            for kernel in ("auto", "wgmma_ws", "wgmma_ws_cluster"):
                self.assertEqual(w4a8_module._workspace_bytes(variant[kernel], n, k),
                                 flags + 148 * slot)
            for kernel in ("mma_sync", "wgmma", "wgmma_ws_dp"):
                self.assertEqual(w4a8_module._workspace_bytes(variant[kernel], n, k), 16)
            for v in (variant["wgmma_ws_e4m3"], variant["wgmma_ws_e4m3_cluster"], 8):
                self.assertEqual(w4a8_module._workspace_bytes(v, n, k),
                                 flags + 148 * slot + n * k + 256)
        with mock.patch.object(w4a8_module.jax, "devices", side_effect=RuntimeError("no cuda")):
            self.assertEqual(w4a8_module._workspace_bytes(0), flags + 132 * slot)

    @mock.patch.dict(os.environ, {"JAX_MILA_W4A8_CLUSTER": ""})
    def test_auto_expands_from_expand_min_rows_on_sm90(self):
        # "auto" goes to the handler as variant 8 (room for the expanded weights) from
        # EXPAND_MIN_ROWS rows up when a GPU is 9.0 and the build has sm_90a code; as 0 below,
        # on other GPUs (no N x K scratch where mma_sync runs), and with EXPAND_MIN_ROWS = None.
        big = w4a8_module.EXPAND_MIN_ROWS
        with mock.patch.object(w4a8_module, "build_info", return_value={"cuda_archs": "90a"}):
            for caps, small_v, big_v in ((((9, 0),), 0, 8), (((9, 0), (8, 9)), 0, 8),
                                         (((8, 9),), 0, 0)):
                with self.subTest(caps=caps), \
                     mock.patch.object(w4a8_module, "cuda_capabilities", return_value=caps):
                    self.assertEqual(w4a8_module._variant("auto", big - 1), small_v)
                    self.assertEqual(w4a8_module._variant("auto", big), big_v)
                    self.assertEqual(w4a8_module._variant("wgmma_ws_cluster", big), 5)
            with mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((9, 0),)), \
                 mock.patch.object(w4a8_module, "EXPAND_MIN_ROWS", None):
                self.assertEqual(w4a8_module._variant("auto", 1 << 20), 0)
                self.assertEqual(w4a8_module.auto_kernel(1 << 20), "wgmma_ws_cluster")

    @mock.patch.dict(os.environ, {"JAX_MILA_W4A8_CLUSTER": ""})
    def test_auto_picks_wgmma_only_on_sm90_with_sm90a_code(self):
        # (build archs, GPUs) -> (auto_kernel(), the handler's variant for "auto"). Variant 0
        # lets the handler pick wgmma_ws_cluster per 9.0 device; without sm_90a code it must be
        # mma_sync (1).
        cases = [("80-real,89-real,90a", ((9, 0),), "wgmma_ws_cluster", 0),
                 ("90a-real", ((9, 0), (9, 0)), "wgmma_ws_cluster", 0),
                 ("80-real,89-real,90a", ((8, 9),), "mma_sync", 0),
                 ("80-real,89-real,90a", ((9, 0), (8, 9)), "mma_sync", 0),
                 ("80-real,89-real", ((9, 0),), "mma_sync", 1),
                 ("80-real,89-real,90", ((9, 0),), "mma_sync", 1),
                 ("", (), "mma_sync", 1)]
        for archs, caps, kernel, variant in cases:
            with self.subTest(archs=archs, caps=caps), \
                 mock.patch.object(w4a8_module, "build_info", return_value={"cuda_archs": archs}), \
                 mock.patch.object(w4a8_module, "cuda_capabilities", return_value=caps):
                self.assertEqual(w4a8_module.auto_kernel(), kernel)
                self.assertEqual(w4a8_module.auto_kernel(w4a8_module.EXPAND_MIN_ROWS),
                                 kernel.replace("_ws", "_ws_e4m3"))
                self.assertEqual(w4a8_module._variant("auto"), variant)
                # From EXPAND_MIN_ROWS rows: room for the expanded weights (8) wherever a 9.0
                # GPU could run them; the handler still picks per device.
                self.assertEqual(w4a8_module._variant("auto", w4a8_module.EXPAND_MIN_ROWS),
                                 8 if variant == 0 and (9, 0) in caps else variant)
                self.assertEqual(w4a8_module._variant("mma_sync"), 1)
                self.assertEqual(w4a8_module._variant("wgmma"), 2)
                self.assertEqual(w4a8_module._variant("wgmma_ws"), 3)
        with mock.patch.object(w4a8_module, "AUTO_WGMMA_ON_SM90", False), \
             mock.patch.object(w4a8_module, "build_info", return_value={"cuda_archs": "90a"}), \
             mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((9, 0),)):
            self.assertEqual(w4a8_module.auto_kernel(), "mma_sync")
            self.assertEqual(w4a8_module._variant("auto"), 1)

    def test_cluster_knob_names_the_hopper_auto_kernel(self):
        # The handler reads JAX_MILA_W4A8_CLUSTER once per process (exactly "1": wgmma_ws);
        # auto_kernel() must name what it runs, so that the tests hold "auto" to its bounds.
        hopper = dict(build_info=mock.Mock(return_value={"cuda_archs": "90a"}),
                      cuda_capabilities=mock.Mock(return_value=((9, 0),)))
        cases = (("1", "wgmma_ws"), ("2", "wgmma_ws_cluster"), ("", "wgmma_ws_cluster"),
                 (" 1", "wgmma_ws_cluster"), (None, "wgmma_ws_cluster"))
        big_m = w4a8_module.EXPAND_MIN_ROWS
        for value, kernel in cases:
            env = {k: v for k, v in os.environ.items() if k != "JAX_MILA_W4A8_CLUSTER"}
            if value is not None:
                env["JAX_MILA_W4A8_CLUSTER"] = value
            with self.subTest(value=value), mock.patch.dict(os.environ, env, clear=True), \
                 mock.patch.multiple(w4a8_module, **hopper):
                self.assertEqual(w4a8_module.auto_kernel(), kernel)
                self.assertEqual(w4a8_module.auto_kernel(big_m - 1), kernel)
                self.assertEqual(w4a8_module.auto_kernel(big_m), kernel.replace("_ws", "_ws_e4m3"))



# Relative Frobenius error bound (float32 output, against the float32 reference or the float64
# product) per kernel. mma_sync accumulates in float32: 2e-6. wgmma: Hopper's FP8 wgmma adds at
# ~14 bits (truncated), so the kernel promotes every 128-long K chunk into float32 registers;
# expected ~1e-4 at any K. 4e-4 holds it with margin while the unpromoted kernel (1.6e-3 at
# K=15360, measured on the H200) fails test_accuracy_k15360. wgmma_ws: the same promotion over
# 256-long chunks (passed both bounds on the H200); the e4m3 variants add the same products in the
# same order.
F32_TOL = {"mma_sync": 2e-6, **{kernel: 4e-4 for kernel in HOPPER_KERNELS}}
K15360_TOL = {"mma_sync": 1e-5, **{kernel: 4e-4 for kernel in HOPPER_KERNELS}}


def _resolve(kernel: str, m: int = 1) -> str:
    return w4a8_module.auto_kernel(m) if kernel == "auto" else kernel


class W4A8KernelTest(parameterized.TestCase):
    """GPU: the CUDA kernels against the reference (poisoned outputs, odd sizes). Every test
    runs for "auto" (held to the bounds of the kernel it resolves to), "mma_sync", "wgmma" and
    "wgmma_ws" (the last two: compute capability 9.0 only)."""

    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "w4a8_matmul")
        if testing.compute_capability() < (8, 9):
            self.skipTest("FP8 mma needs compute capability >= 8.9")

    def _require(self, kernel, m=1):
        if kernel in HOPPER_KERNELS and testing.compute_capability() != (9, 0):
            self.skipTest(f"{kernel} needs compute capability 9.0 (sm_90a)")
        return _resolve(kernel, m)

    def _check(self, m, n, k, kernel, *, w_scale=None, seed=None):
        resolved = self._require(kernel, m)
        seed = _seed() if seed is None else seed
        xq, xs, w = _operands(m, n, k, seed, w_scale=w_scale)
        want32 = reference.w4a8_matmul(xq, xs, w, out_dtype=jnp.float32)
        for out_dtype, tol in ((jnp.float32, F32_TOL[resolved]), (jnp.bfloat16, 4e-3)):
            fn = functools.partial(ffi.w4a8_matmul, out_dtype=out_dtype, kernel=kernel)
            got = testing.call_with_poisoned_outputs(fn, xq, xs, w)
            self.assertEqual(got.dtype, out_dtype)
            self.assertEqual(got.shape, (m, n))
            self.assertTrue(bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))),
                            f"non-finite (poison left?) m={m} n={n} k={k} {kernel} seed={seed}")
            err = testing.rel_fro_err(got, want32)
            self.assertLess(err, tol, f"m={m} n={n} k={k} {kernel} {out_dtype} seed={seed}")
            if out_dtype == jnp.bfloat16:  # every element within bf16 rounding of the truth
                w32 = np.asarray(want32)
                # plus, for wgmma, its FP8 accumulation error (~1e-4 of the RMS, Gaussian-like:
                # 2e-3 of the RMS is far in the tail; an indexing bug is O(1))
                atol = (1e-6 * float(np.abs(w32).max()) if resolved == "mma_sync"
                        else 2e-3 * float(np.sqrt(np.mean(w32.astype(np.float64) ** 2))))
                np.testing.assert_allclose(np.asarray(got, np.float32), w32, rtol=8e-3,
                                           atol=atol, err_msg=f"{kernel} seed={seed}")

    @parameterized.product(
        kernel=KERNELS,
        mnk=[(1, 256, 128), (97, 384, 256), (257, 264, 512), (300, 136, 384)],
    )
    def test_small(self, kernel, mnk):
        self._check(*mnk, kernel)

    @parameterized.parameters(*KERNELS)
    def test_channel_scales_over_many_binades(self, kernel):
        self._check(130, 512, 256, kernel, w_scale=40)

    @parameterized.parameters(*KERNELS)
    def test_exact_on_blocks_at_the_exponent_floor(self, kernel):
        # Every block 0..11 exponents below the channel's, every code: exactness of the e4m3
        # conversion (a wrong exponent or sign shows as a large error, not a rounding one).
        resolved = self._require(kernel)
        rng = np.random.default_rng(_seed())
        n, k, m = 64, 512, 96
        codes = rng.integers(0, 16, (n, k))
        drop = rng.integers(0, 12, (n, k // 32))
        drop[:, 0] = 0
        w = quant.E2M1_VALUES[codes] * np.exp2(-np.repeat(drop, 32, axis=1))
        w[:, 0] = 6.0  # pins block 0's exponent at the channel's
        q = quant.quantize_mxfp4(jnp.asarray(w, jnp.float32))
        np.testing.assert_array_equal(np.asarray(quant.dequantize_mxfp4(q)), w.astype(np.float32))
        x = jax.random.normal(jax.random.key(_seed()), (m, k), jnp.float32).astype(jnp.bfloat16)
        xq, xs = ffi.quantize_activations(x)
        got = ffi.w4a8_matmul(xq, xs, q, out_dtype=jnp.float32, kernel=kernel)
        self.assertLess(testing.rel_fro_err(got, _exact_product(xq, xs, q)), F32_TOL[resolved])

    def test_zero_rows_and_zero_channels(self):
        # Row 0 of x and channel 0 of w are zero: exact zeros out (no NaN from 0 * scale).
        x = jnp.zeros((64, 256), jnp.bfloat16).at[1:].set(1.0)
        xq, xs = ffi.quantize_activations(x)
        wz = quant.quantize_mxfp4(jnp.zeros((128, 256)).at[1:].set(0.5))
        kernels = KERNELS if testing.compute_capability() == (9, 0) else ["auto", "mma_sync"]
        for kernel in kernels:
            y = np.asarray(ffi.w4a8_matmul(xq, xs, wz, out_dtype=jnp.float32, kernel=kernel))
            np.testing.assert_array_equal(y[0], 0.0)
            np.testing.assert_array_equal(y[:, 0], 0.0)
            np.testing.assert_allclose(y[1:, 1:], 128.0, rtol=1e-6)

    def test_jit_and_leading_dims(self):
        xq, xs, w = _operands(None, 256, 384, _seed(), lead=(3, 41))
        y = jax.jit(ffi.w4a8_matmul)(xq, xs, w)
        want = reference.w4a8_matmul(xq, xs, w)
        self.assertEqual(y.shape, (3, 41, 256))
        self.assertLess(testing.rel_fro_err(y, want), 4e-3)

    @parameterized.parameters(*KERNELS)
    def test_accuracy_k15360(self, kernel):
        # The stated accuracy: relative Frobenius error against the float64 product of the
        # dequantized operands, at Gemma 4 12B's down_proj K. For wgmma this is the test that
        # needs the fp32 promotion: without it the FP8 accumulation error grows with K (1.6e-3).
        resolved = self._require(kernel)
        if _under_compute_sanitizer():
            self.skipTest("large case: skipped under compute-sanitizer")
        seed = _seed()
        xq, xs, w = _operands(512, 768, 15360, seed)
        want = _exact_product(xq, xs, w)
        e32 = testing.rel_fro_err(testing.call_with_poisoned_outputs(
            functools.partial(ffi.w4a8_matmul, out_dtype=jnp.float32, kernel=kernel), xq, xs, w),
            want)
        e16 = testing.rel_fro_err(ffi.w4a8_matmul(xq, xs, w, kernel=kernel), want)
        print(f"\n[w4a8 accuracy K=15360 {kernel} ({resolved})] rel Frobenius error: "
              f"float32 out {e32:.2e}, bf16 out {e16:.2e}")
        self.assertLess(e32, K15360_TOL[resolved], f"{kernel} seed={seed}")
        self.assertLess(e16, 3e-3, f"{kernel} seed={seed}")  # bf16 output rounding: ~1.7e-3

    @parameterized.parameters(*HOPPER_KERNELS)
    def test_wgmma_error_does_not_grow_with_k(self, kernel):
        # Promotion makes the error a property of 128- (wgmma) or 256-long (wgmma_ws) chunks:
        # K=15360 must be no worse than a few times K=256 (unpromoted it grew ~16x: ~1e-4 at
        # K=256, 1.6e-3 at K=15360).
        self._require(kernel)
        if _under_compute_sanitizer():
            self.skipTest("large case: skipped under compute-sanitizer")
        errs = {}
        for k in (256, 15360):
            seed = _seed()
            xq, xs, w = _operands(512, 768, k, seed)
            got = ffi.w4a8_matmul(xq, xs, w, out_dtype=jnp.float32, kernel=kernel)
            errs[k] = testing.rel_fro_err(got, _exact_product(xq, xs, w))
        print(f"\n[w4a8 {kernel}] rel Frobenius error K=256 {errs[256]:.2e}, "
              f"K=15360 {errs[15360]:.2e}")
        self.assertLess(errs[15360], 3 * errs[256] + 1e-6, errs)

    def test_large_m(self):
        if _under_compute_sanitizer():
            self.skipTest("large case: skipped under compute-sanitizer")
        for kernel in KERNELS:
            if kernel not in HOPPER_KERNELS or testing.compute_capability() == (9, 0):
                self._check(16500, 256, 256, kernel)

    @parameterized.named_parameters(
        # On an H200 (132 SMs; other GPUs cut these differently, as correctly):
        # 2 tiles of 32 K tiles: 8 CTAs of 8, each tile one owner and three later pieces;
        dict(testcase_name="few_tiles_long_k", mnk=(100, 136, 4096)),
        # 6 tiles of 13 K tiles (an odd count): runs of 8 that cross tiles, so a CTA's first
        # piece (5 K tiles: a one-tile chain at its end) feeds one tile and its second owns the
        # next; N and M tails in the split tiles;
        dict(testcase_name="odd_pieces", mnk=(300, 264, 1664)),
        # 155 tiles: one whole wave on every SM, then the other 23 tiles' 16 K tiles in runs of 8
        # over 46 CTAs.
        dict(testcase_name="wave_then_stream_k", mnk=(1100, 3848, 2048)),
    )
    def test_stream_k(self, mnk):
        # wgmma_ws splits the last wave's tiles along K (csrc/w4a8/w4a8_sm90_ws.cu, "schedule");
        # wgmma_ws_dp runs the same kernel on whole tiles; wgmma_ws_cluster splits the tile
        # pairs of its 2-CTA clusters; the e4m3 variants keep the scratch's stream-K part
        # before their expanded weights. All against the reference.
        for kernel in ("wgmma_ws", "wgmma_ws_dp", "wgmma_ws_cluster", "wgmma_ws_e4m3",
                       "wgmma_ws_e4m3_cluster"):
            self._check(*mnk, kernel)

    def test_cluster_agrees_bitwise_on_whole_tiles(self):
        # wgmma_ws_cluster computes each weight tile with the same wgmmas in the same order as
        # wgmma_ws; only the activations' way into shared memory (half of each stage multicast
        # by each CTA of a pair) and the tile-to-CTA assignment differ. With K <= 1024 neither
        # splits a tile along K (a piece must save more than 8 K tiles), so the outputs must be
        # equal bit for bit. N = 264 is 3 weight tiles: the second CTA of the last pair has
        # only rows past N; (8389, 2056) has 33 x 9 pairs, several per cluster, with M and N
        # tails; M = 1 leaves 255 of the 256 multicast rows zero-filled.
        self._require("wgmma_ws_cluster")
        seed = _seed()
        shapes = [(97, 264, 384), (1, 8, 128), (1000, 520, 1024)]
        if not _under_compute_sanitizer():
            shapes.append((8389, 2056, 384))
        for m, n, k in shapes:
            xq, xs, w = _operands(m, n, k, seed + m)
            for dtype in (jnp.float32, jnp.bfloat16):
                want = ffi.w4a8_matmul(xq, xs, w, out_dtype=dtype, kernel="wgmma_ws")
                got = testing.call_with_poisoned_outputs(
                    functools.partial(ffi.w4a8_matmul, out_dtype=dtype,
                                      kernel="wgmma_ws_cluster"), xq, xs, w)
                np.testing.assert_array_equal(
                    np.asarray(got, np.float32), np.asarray(want, np.float32),
                    err_msg=f"m={m} n={n} k={k} {jnp.dtype(dtype).name} seed={seed}")

    def test_expanded_weights_agree_bitwise(self):
        # The e4m3 variants take the bytes the others convert each weight word into, through
        # shared memory instead of registers, and add the same products in the same order into
        # each output (a wgmma's N only groups output columns; the tiles are 192 activation rows
        # instead of 256). Where no tile is split along K (K <= 1024: a piece must save more
        # than 8 K tiles; the split points depend on the tile count), equal bit for bit. M tails
        # of both tilings; M = 4096 is where "auto" starts to expand.
        self._require("wgmma_ws_e4m3")
        seed = _seed()
        shapes = [(97, 264, 384), (1, 8, 128), (1000, 520, 1024)]
        if not _under_compute_sanitizer():
            shapes += [(8389, 2056, 384), (w4a8_module.EXPAND_MIN_ROWS, 520, 512)]
        pairs = (("wgmma_ws", "wgmma_ws_e4m3"), ("wgmma_ws_cluster", "wgmma_ws_e4m3_cluster"))
        for m, n, k in shapes:
            xq, xs, w = _operands(m, n, k, seed + m)
            for dtype in (jnp.float32, jnp.bfloat16):
                got = {}
                for converted, expanded in pairs:
                    want = ffi.w4a8_matmul(xq, xs, w, out_dtype=dtype, kernel=converted)
                    got[expanded] = np.asarray(testing.call_with_poisoned_outputs(
                        functools.partial(ffi.w4a8_matmul, out_dtype=dtype, kernel=expanded),
                        xq, xs, w), np.float32)
                    np.testing.assert_array_equal(
                        got[expanded], np.asarray(want, np.float32),
                        err_msg=f"{expanded} m={m} n={n} k={k} {jnp.dtype(dtype).name} "
                                f"seed={seed}")
                if m >= w4a8_module.EXPAND_MIN_ROWS:  # "auto" expands here
                    auto = ffi.w4a8_matmul(xq, xs, w, out_dtype=dtype)
                    np.testing.assert_array_equal(np.asarray(auto, np.float32),
                                                  got[_resolve("auto", m)])

    def test_handler_refuses_a_workspace_without_room_for_the_expanded_weights(self):
        # The wrapper sizes the scratch; the handler checks it again (an ffi::Error naming the
        # workspace, no launch) when a caller of the custom call gives an expanding variant
        # less: the e4m3 kernels, and "auto" with room for the expanded weights (8).
        self._require("wgmma_ws_e4m3")
        xq, xs, w = _operands(64, 136, 256, _seed())
        for variant in (w4a8_module.KERNELS["wgmma_ws_e4m3"],
                        w4a8_module.KERNELS["wgmma_ws_e4m3_cluster"], 8):
            call = jax.ffi.ffi_call(
                "jax_mila_w4a8_matmul",
                (jax.ShapeDtypeStruct((64, 136), jnp.bfloat16),
                 jax.ShapeDtypeStruct((136 * 256 + 255,), jnp.uint8)))  # N x K + 256 needed
            with self.subTest(variant=variant), \
                 self.assertRaisesRegex(Exception, r"workspace: .*needs at least N x K"):
                jax.block_until_ready(call(xq, xs, w.packed, w.scales, w.channel_exp,
                                           variant=np.int64(variant)))

    def test_conversion_orders_agree_bitwise(self):
        # wgmma_ws converts a chain's weights before its wgmmas; JAX_MILA_W4A8_WS_CONVERT=
        # interleaved (read once per process) converts each block just before its first-half
        # wgmma. The same wgmmas run in the same order either way: the outputs must be equal
        # bit for bit (a split tile included: (300, 264, 1664) is cut by stream-K).
        self._require("wgmma_ws")
        seed = _seed()
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "interleaved.npy")
            env = dict(os.environ, JAX_MILA_W4A8_WS_CONVERT="interleaved")
            code = (f"import sys; sys.path[:0] = {sys.path!r}; import numpy as np; "
                    f"import test_w4a8 as t; np.save({out!r}, t._conversion_order_output({seed}))")
            subprocess.run([sys.executable, "-c", code], env=env, check=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
            np.testing.assert_array_equal(_conversion_order_output(seed), np.load(out),
                                          err_msg=f"seed={seed}")

    @parameterized.parameters(*KERNELS)
    def test_more_tiles_than_sms(self, kernel):
        # 33 x 17 = 561 output tiles of wgmma_ws (256 x 128) on 132 SMs: every CTA of the
        # persistent kernel runs several tiles (the mbarrier phases and the epilogue buffers
        # carry over between them), with an M tail (8389 = 32 * 256 + 197) and an N tail
        # (2056 = 16 * 128 + 8) in the raster.
        if _under_compute_sanitizer():
            self.skipTest("large case: skipped under compute-sanitizer")
        self._check(8389, 2056, 384, kernel)


class W4A8BuildWithoutSm90aTest(absltest.TestCase):
    """GPU, a build whose architectures lack sm_90a (e.g. JAX_MILA_CUDA_ARCHS="80-real;89" or
    "80"), on a compute capability 9.0 device; skipped on every other build. Such a build's PTX,
    JIT-compiled for the device, gives the wgmma kernels (and, from compute_80 PTX, the mma.sync
    kernel) an empty body: the handler itself must refuse them instead of returning an unwritten
    output, and "auto" must run mma.sync where its code allows."""

    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "w4a8_matmul")
        if testing.compute_capability() != (9, 0) or w4a8_module._wgmma_built():
            self.skipTest("needs a 9.0 GPU and a build without sm_90a code")
        # PTX the device can JIT into a working mma.sync kernel: an arch >= 89 with its PTX
        # (not "-real", which is machine code for that arch alone).
        archs = w4a8_module.build_info()["cuda_archs"].split(",")
        self.fp8_ptx = any(not a.endswith("-real") and a.split("-")[0].isdigit()
                           and int(a.split("-")[0]) >= 89 for a in archs)
        self.xq, self.xs, self.w = _operands(97, 64, 256, _seed())

    def _direct(self, variant):
        """The custom call with `variant`, past every Python check."""
        return testing.call_with_poisoned_outputs(
            lambda *a: w4a8_module._kernel(jnp.float32, variant, *a),
            self.xq, self.xs, self.w.packed, self.w.scales, self.w.channel_exp)

    def test_handler_refuses_the_wgmma_variants(self):
        for name in HOPPER_KERNELS:
            with self.subTest(kernel=name), \
                 self.assertRaisesRegex(Exception, "UNIMPLEMENTED.*need sm_90a code"):
                jax.block_until_ready(self._direct(w4a8_module.KERNELS[name]))

    def test_auto_and_mma_sync_run_from_compute_89_code_or_are_refused(self):
        want = reference.w4a8_matmul(self.xq, self.xs, self.w, out_dtype=jnp.float32)
        for name in ("auto", "mma_sync"):
            with self.subTest(kernel=name):
                if self.fp8_ptx:
                    got = self._direct(w4a8_module.KERNELS[name])
                    self.assertLess(testing.rel_fro_err(got, want), F32_TOL["mma_sync"])
                else:
                    with self.assertRaisesRegex(
                            Exception, "UNIMPLEMENTED.*(compute_89|no code for this device)"):
                        jax.block_until_ready(self._direct(w4a8_module.KERNELS[name]))


if __name__ == "__main__":
    absltest.main()
