"""W4A8 GEMMs (jax_mila.ffi.w4a8_matmul, grouped_w4a8_matmul): the pure-JAX references,
trace-time validation and kernel dispatch on CPU, and the CUDA kernels (wgmma_ws on sm_90a,
mma.sync and the decode GEMV on sm_89+) against the references on GPU.

Under compute-sanitizer (detected from the injected library) only the small GPU cases run.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_mila import ffi, quant, reference
from jax_mila.ffi import w4a8 as w4a8_module
import testing  # tests/testing.py


KERNELS = ["auto", "mma_sync", "wgmma_ws", "wgmma_ws_e4m3"]
HOPPER_KERNELS = tuple(KERNELS[2:])  # sm_90a only
GROUPED_KERNELS = ["auto", "mma_sync", "wgmma_ws"]


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


def _operands(m, n, k, seed, *, lead=None, w_scale=None, x_mag=3.0):
    """bf16 activations -> (x_fp8, x_scale) through quantize_activations; an MXFP4 weight."""
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (lead or (m,)) + (k,), jnp.float32) * x_mag
    w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
    if w_scale is not None:  # per-channel magnitudes spanning many binades
        w = w * jnp.exp2(jax.random.randint(kc, (n, 1), -w_scale, w_scale + 1).astype(jnp.float32))
    xq, xs = ffi.quantize_activations(x.astype(jnp.bfloat16))
    return xq, xs, quant.quantize_mxfp4(w)


def _grouped_operands(sizes, n, k, seed, *, m=None):
    """Rows for experts of the given sizes (sorted, M = sum or ``m``), MXFP4 experts [E, N, K]."""
    e = len(sizes)
    m = int(sum(sizes)) if m is None else m
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32) * 3.0
    w = jax.random.normal(kw, (e, n, k), jnp.float32) / np.sqrt(k)
    xq, xs = ffi.quantize_activations(x.astype(jnp.bfloat16))
    return xq, xs, quant.quantize_mxfp4(w), jnp.asarray(sizes, jnp.int32)


def _exact_product(xq, xs, w):
    """float64 (x_fp8 * x_scale) @ dequantize(w)[:, :K].T on the host: a path independent of JAX."""
    x64 = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)[..., None]
    w64 = np.asarray(quant.dequantize_mxfp4(w), np.float64)[:, : xq.shape[-1]]
    return x64 @ w64.T


def _exact_grouped(xq, xs, w, sizes):
    """float64 grouped product, row by row from each row's expert (rows past the groups: 0)."""
    x64 = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)[:, None]
    w64 = np.asarray(quant.dequantize_mxfp4(w), np.float64)[..., : xq.shape[-1]]
    out = np.zeros((x64.shape[0], w64.shape[1]))
    start = 0
    for e, size in enumerate(np.maximum(np.asarray(sizes), 0)):
        end = min(start + int(size), x64.shape[0])
        out[start:end] = x64[start:end] @ w64[e].T
        start = end
    return out


class W4A8ReferenceTest(parameterized.TestCase):
    """CPU: the reference GEMMs and the wrappers' validation (same on every platform)."""

    @parameterized.parameters((1, 8, 128), (97, 264, 384), (33, 128, 1024), (5, 16, 704),
                              (7, 24, 2112), (3, 8, 32))
    def test_reference_matches_float64_product(self, m, n, k):
        # K not a multiple of 128 (704, 2112: the 26B's): the weight is stored padded.
        xq, xs, w = _operands(m, n, k, _seed())
        self.assertEqual(w.shape, (n, quant.padded_k(k)))
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

    @parameterized.named_parameters(
        dict(testcase_name="random", sizes=(10, 0, 25, 15, 7)),
        dict(testcase_name="one_expert_takes_all", sizes=(0, 0, 97, 0)),
        dict(testcase_name="single_rows", sizes=(1, 1, 1)),
        # groups of several reference steps (256 rows), the last one partial
        dict(testcase_name="groups_of_several_steps", sizes=(300, 0, 513, 1)),
    )
    def test_grouped_reference_matches_float64_product(self, sizes):
        xq, xs, w, gs = _grouped_operands(sizes, 24, 704, _seed())
        got = reference.grouped_w4a8_matmul(xq, xs, w, gs, out_dtype=jnp.float32)
        self.assertLess(testing.rel_fro_err(got, _exact_grouped(xq, xs, w, gs)), 1e-5)

    def test_grouped_reference_clamps_like_the_kernels(self):
        # Traced sizes that a caller got wrong: negative sizes count as 0, groups end at row M,
        # rows past the last group are zeros (the kernels' documented reading).
        xq, xs, w, _ = _grouped_operands((3, 3, 3), 16, 128, _seed(), m=9)
        for sizes in ((4, -2, 20), (2, 2, 2), (0, 0, 0)):
            gs = jnp.asarray(sizes, jnp.int32)
            got = jax.jit(functools.partial(reference.grouped_w4a8_matmul,
                                            out_dtype=jnp.float32))(xq, xs, w, gs)
            covered = min(int(np.maximum(np.asarray(sizes), 0).sum()), 9)
            with self.subTest(sizes=sizes):
                if covered:
                    self.assertLess(testing.rel_fro_err(
                        got[:covered], _exact_grouped(xq, xs, w, gs)[:covered]), 1e-5)
                np.testing.assert_array_equal(np.asarray(got)[covered:], 0.0)

    def test_grouped_reference_memory_is_linear_in_the_rows(self):
        # XLA expands jax.lax.ragged_dot into a product over every group: [M, E, K] float32, 256
        # MiB here. The reference runs expert by expert: its temporaries are about its operands
        # and its output (the sm_80 path and the fallback of the 26B-A4B's experts).
        m, e, k, n = 4096, 64, 256, 128
        xq, xs, w, gs = _grouped_operands((m // e,) * e, n, k, _seed())
        fn = jax.jit(functools.partial(reference.grouped_w4a8_matmul, out_dtype=jnp.float32))
        stats = fn.lower(xq, xs, w, gs).compile().memory_analysis()
        self.assertIsNotNone(stats)
        self.assertLess(stats.temp_size_in_bytes, 4 * (m + 256) * k * 4)

    def test_grouped_equals_dense_per_expert(self):
        xq, xs, w, gs = _grouped_operands((5, 0, 11), 32, 256, _seed())
        got = np.asarray(ffi.grouped_w4a8_matmul(xq, xs, w, gs, out_dtype=jnp.float32))
        # The dense kernel the grouped call runs ("auto" would take the GEMV for these few rows,
        # which sums in another order).
        kernel = w4a8_module.auto_kernel(16, grouped=True)
        start = 0
        for e, size in enumerate((5, 0, 11)):
            we = jax.tree.map(lambda a: a[e], w)
            dense = ffi.w4a8_matmul(xq[start:start + size], xs[start:start + size], we,
                                    out_dtype=jnp.float32, kernel=kernel) if size else None
            if size:
                np.testing.assert_array_equal(got[start:start + size], np.asarray(dense))
            start += size

    def _good(self, m=4, n=64, k=256):
        return _operands(m, n, k, 0)

    def test_rejects_k_that_does_not_fit_the_weight(self):
        xq, xs, w = self._good()
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: x_fp8: K=96 .*stored K=256: K must "
                                                r"be a multiple of 32 in \(128, 256\]"):
            ffi.w4a8_matmul(xq[:, :96], xs, w)
        with self.assertRaisesRegex(ValueError, r"x_fp8: K=240 .*multiple of 32"):
            ffi.w4a8_matmul(jnp.zeros((4, 240), jnp.float8_e4m3fn), xs, w)

    def test_rejects_unsupported_stored_k(self):
        xq = jnp.zeros((4, 96), jnp.float8_e4m3fn)
        xs = jnp.ones((4,), jnp.float32)
        w = quant.MXFP4Weight(jnp.zeros((64, 48), jnp.uint8), jnp.zeros((64, 3), jnp.uint8),
                              jnp.zeros((64,), jnp.uint8))
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: w: .*Kp % 128 == 0"):
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
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: w: N=0 is not supported"):
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
            (dict(x_fp8=xq[:0], x_scale=xs[:0]), r"x_fp8: empty arrays"),
            (dict(out_dtype=jnp.float16), r"out_dtype: float16 is not supported"),
            (dict(kernel="cutlass"), r"kernel: 'cutlass' is not one of"),
            (dict(w=w.packed), r"w: expected a jax_mila.quant.MXFP4Weight"),
            (dict(w=jax.tree.map(lambda a: a[None], w)), r"w: w.packed: expected \[N, Kp/2\]"),
        ]
        for override, pattern in cases:
            args = dict(x_fp8=xq, x_scale=xs, w=w)
            args.update(override)
            kwargs = {k: args.pop(k) for k in ("out_dtype", "kernel") if k in args}
            with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
                ffi.w4a8_matmul(args["x_fp8"], args["x_scale"], args["w"], **kwargs)

    def test_grouped_rejects_bad_arguments(self):
        xq, xs, w, gs = _grouped_operands((3, 2, 4), 16, 128, 0)
        cases = [
            (dict(group_sizes=gs[:2]), r"group_sizes: shape \[2\] must be \[E\] = \[3\]"),
            (dict(group_sizes=gs.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.uint32)),
             r"group_sizes: dtype .* is not supported \(supported: int32\)"),
            (dict(group_sizes=jnp.asarray([3, -1, 4], jnp.int32)), r"group_sizes: negative sizes"),
            (dict(group_sizes=jnp.asarray([3, 5, 4], jnp.int32)),
             r"group_sizes: the sizes add up to 12 rows, more than x_fp8's M=9"),
            (dict(w=jax.tree.map(lambda a: a[0], w)), r"w: w.packed: expected rank 3"),
            (dict(x_fp8=xq.reshape(3, 3, 128)), r"x_fp8: expected rank 2"),
            (dict(kernel="wgmma_ws_e4m3"), r"kernel: 'wgmma_ws_e4m3' takes dense calls only"),
            (dict(x_scale=xs[:4]), r"x_scale: shape \[4\]"),
        ]
        for override, pattern in cases:
            args = dict(x_fp8=xq, x_scale=xs, w=w, group_sizes=gs)
            args.update(override)
            kernel = args.pop("kernel", "auto")
            with self.subTest(pattern=pattern), self.assertRaisesRegex(
                    ValueError, "grouped_w4a8_matmul: " + pattern):
                ffi.grouped_w4a8_matmul(args["x_fp8"], args["x_scale"], args["w"],
                                        args["group_sizes"], kernel=kernel)
        many = quant.MXFP4Weight(jnp.zeros((1025, 8, 64), jnp.uint8),
                                 jnp.zeros((1025, 8, 4), jnp.uint8), jnp.zeros((1025, 8), jnp.uint8))
        with self.assertRaisesRegex(ValueError, r"w: E=1025 experts are not supported"):
            ffi.grouped_w4a8_matmul(xq, xs, many, jnp.zeros((1025,), jnp.int32))

    def test_grouped_traced_sizes_do_not_recompile(self):
        # The routing changes every step; the sizes are device values, read by the kernel.
        xq, xs, w, _ = _grouped_operands((4, 4, 4), 16, 128, _seed())
        fn = jax.jit(ffi.grouped_w4a8_matmul)
        for sizes in ((4, 4, 4), (0, 12, 0), (1, 2, 9)):
            gs = jnp.asarray(sizes, jnp.int32)
            np.testing.assert_allclose(np.asarray(fn(xq, xs, w, gs), np.float32),
                                       _exact_grouped(xq, xs, w, gs), rtol=2e-2, atol=2e-2)
        self.assertEqual(fn._cache_size(), 1)

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

    def test_workspace_sizes(self):
        # Dense: one 128 KiB float32 slot per SM (+ 4 KiB of flags) where wgmma_ws may run, plus
        # N x Kp + 256 where the e4m3 instance may run ("wgmma_ws_e4m3", and "auto" from
        # EXPAND_MIN_ROWS rows on a 9.0 GPU); a token for mma_sync; an H100/H200's 132 SMs when
        # the devices do not say. Grouped: the tile list, sized for 128-row tiles.
        slot, flags = 128 * 256 * 4, 4096
        v = w4a8_module.KERNELS
        devices = [mock.Mock(core_count=132), mock.Mock(core_count=148)]
        n, kp, big = 264, 384, w4a8_module.EXPAND_MIN_ROWS
        size = w4a8_module._dense_workspace_bytes
        with mock.patch.object(w4a8_module.jax, "devices", return_value=devices), \
             mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((9, 0),)):
            self.assertEqual(size(v["wgmma_ws"], big, n, kp), flags + 148 * slot)
            self.assertEqual(size(v["auto"], big - 1, n, kp), flags + 148 * slot)
            self.assertEqual(size(v["auto"], big, n, kp), flags + 148 * slot + n * kp + 256)
            self.assertEqual(size(v["wgmma_ws_e4m3"], 1, n, kp), flags + 148 * slot + n * kp + 256)
            self.assertEqual(size(v["mma_sync"], big, n, kp), 16)
        with mock.patch.object(w4a8_module.jax, "devices", side_effect=RuntimeError("no cuda")), \
             mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((8, 9),)):
            self.assertEqual(size(v["auto"], big, n, kp), flags + 132 * slot)
        self.assertEqual(w4a8_module._grouped_workspace_bytes(1000, 128), 16 + 16 * (8 + 128))

    def test_auto_picks_wgmma_only_on_sm90_with_sm90a_code(self):
        # (build archs, GPUs) -> (auto_kernel(m), the handlers' variant for "auto") above the
        # GEMV's rows. Variant 0 lets the handler pick per 9.0 device; without sm_90a code it
        # must be mma_sync (1). Dense calls of 1-16 rows name the GEMV (4) on every build.
        big = w4a8_module.EXPAND_MIN_ROWS
        rows = w4a8_module.GEMV_MAX_ROWS + 1
        cases = [("80-real,89-real,90a", ((9, 0),), "wgmma_ws", 0),
                 ("90a-real", ((9, 0), (9, 0)), "wgmma_ws", 0),
                 ("80-real,89-real,90a", ((8, 9),), "mma_sync", 0),
                 ("80-real,89-real,90a", ((9, 0), (8, 9)), "mma_sync", 0),
                 ("80-real,89-real", ((9, 0),), "mma_sync", 1),
                 ("80-real,89-real,90", ((9, 0),), "mma_sync", 1),
                 ("", (), "mma_sync", 1)]
        for archs, caps, kernel, variant in cases:
            with self.subTest(archs=archs, caps=caps), \
                 mock.patch.object(w4a8_module, "build_info", return_value={"cuda_archs": archs}), \
                 mock.patch.object(w4a8_module, "cuda_capabilities", return_value=caps):
                self.assertEqual(w4a8_module.auto_kernel(rows), kernel)
                self.assertEqual(w4a8_module.auto_kernel(big - 1), kernel)
                self.assertEqual(w4a8_module.auto_kernel(big), kernel.replace("_ws", "_ws_e4m3"))
                self.assertEqual(w4a8_module.auto_kernel(big, grouped=True), kernel)
                for m in (1, 3, 16):
                    self.assertEqual(w4a8_module.auto_kernel(m), "gemv")
                    self.assertEqual(w4a8_module.auto_kernel(m, grouped=True), kernel)
                    self.assertEqual(w4a8_module._variant("auto", m), 4)
                    self.assertEqual(w4a8_module._variant("auto", m, grouped=True), variant)
                self.assertEqual(w4a8_module._variant("auto", rows), variant)
                self.assertEqual(w4a8_module._variant("mma_sync", 1), 1)
                self.assertEqual(w4a8_module._variant("wgmma_ws", 1), 2)
                self.assertEqual(w4a8_module._variant("wgmma_ws_e4m3", 1), 3)
                self.assertEqual(w4a8_module._variant("gemv", 1), 4)

    # The GEMV's plans as the C++ rule computes them (csrc/w4a8/w4a8_kernel.h,
    # W4A8GemvMakePlan, compiled with g++ and printed): (N, Kp, M, SMs) -> (tiles, splits, kc,
    # rows8) and the scratch it needs. jax_mila.ffi.w4a8._gemv_plan is its copy that sizes the
    # scratch (the handler falls back to the fewest splits where a scratch is smaller).
    GEMV_PLANS = [
        ((3840, 15360, 1, 132), (30, 8, 15, 8), 983296),     # 12B down: one wave of 240 CTAs
        ((3840, 15360, 16, 132), (30, 8, 15, 16), 1966336),
        ((15360, 3840, 1, 132), (120, 2, 15, 8), 983552),    # 12B gate
        ((512, 3840, 1, 132), (4, 30, 1, 8), 491776),        # 12B global k: a group a CTA
        ((21504, 5376, 1, 132), (168, 1, 42, 8), 0),         # 31B gate: N alone fills a wave
        ((21504, 5376, 16, 132), (168, 3, 14, 16), 4129536),  # past a wave: the cost rule
        ((5376, 21504, 16, 132), (42, 12, 14, 16), 4129024),
        ((5376, 21504, 1, 132), (42, 6, 28, 8), 1032448),
        ((16384, 5376, 16, 132), (128, 2, 21, 16), 2097664),
        ((5376, 21504, 16, 0), (42, 8, 21, 16), 2752768),    # no SM count: the fewest splits
        ((8, 128, 1, 132), (1, 1, 1, 8), 0),
        ((24, 768, 3, 132), (1, 6, 1, 8), 24832),
        ((264, 2176, 16, 132), (3, 17, 1, 16), 418048),
        ((32768, 256, 1, 132), (256, 1, 2, 8), 0),
        ((21504, 5376, 16, 148), (168, 3, 14, 16), 4129536),
        ((3840, 15360, 1, 148), (30, 9, 14, 8), 1106176),
        ((2048, 5376, 9, 78), (16, 9, 5, 16), 1179904),
    ]

    # With cluster split-K (a Hopper process with sm_90a code): at most 8 splits, no scratch,
    # unless the fewest splits already exceed 8 (K of 24576 at 16 rows: the counters). N a
    # tuple: one launch of several weights (the 12B's sliding q, k, v: 4096 + 2048 + 2048).
    # CAPS: the CTAs clusters of each size fit at once, as a device reports them (an H100, by
    # ncu: 79 clusters of 3, 62 of 4, 30 of 8, where a GPC's SMs do not divide into clusters;
    # the other sizes made up): the plan takes fewer splits rather than a second wave.
    CAPS = {2: 264, 3: 237, 4: 248, 5: 240, 6: 240, 7: 231, 8: 240}
    GEMV_CLUSTER_PLANS = [
        ((3840, 15360, 1, 132), (30, 8, 15, 8), 0),
        ((3840, 15360, 16, 132), (30, 8, 15, 16), 0),
        ((15360, 3840, 1, 132), (120, 2, 15, 8), 0),
        ((512, 3840, 1, 132), (4, 8, 4, 8), 0),
        ((21504, 5376, 16, 132), (168, 3, 14, 16), 0),
        ((5376, 21504, 16, 132), (42, 8, 21, 16), 0),
        ((5376, 21504, 1, 132), (42, 6, 28, 8), 0),
        ((264, 2176, 16, 132), (3, 6, 3, 16), 0),
        ((264, 2176, 3, 132), (3, 6, 3, 8), 0),
        ((136, 24576, 16, 132), (2, 96, 2, 16), 1573120),
        ((136, 24576, 16, 0), (2, 9, 22, 16), 147712),
        (((8192, 2048, 2048), 3840, 1, 132), (96, 2, 15, 8), 0),
        (((4096, 2048, 2048), 3840, 1, 132), (64, 4, 8, 8), 0),
        (((4096, 2048, 2048), 3840, 1, 132, CAPS), (64, 3, 10, 8), 0),  # 256 CTAs > 248
        (((3840,), 4096, 1, 132, CAPS), (30, 8, 4, 8), 0),               # 240 CTAs fit
        (((15360, 15360), 3840, 1, 132, CAPS), (240, 1, 30, 8), 0),
    ]

    def test_gemv_plan_is_the_handlers(self):
        for (n, kp, m, sms), plan, workspace in self.GEMV_PLANS:
            with self.subTest(n=n, kp=kp, m=m, sms=sms):
                self.assertEqual(w4a8_module._gemv_plan(n, kp, m, sms), plan)
                self.assertEqual(w4a8_module._gemv_workspace_bytes(n, kp, m, sms), workspace)
        for (n, kp, m, sms, *caps), plan, workspace in self.GEMV_CLUSTER_PLANS:
            with self.subTest(n=n, kp=kp, m=m, sms=sms, cluster=True, caps=caps):
                self.assertEqual(w4a8_module._gemv_plan(n, kp, m, sms, cluster=True,
                                                        cluster_slots=caps[0] if caps else None),
                                 plan)
                self.assertEqual(w4a8_module._gemv_workspace_bytes(n, kp, m, sms, cluster=True),
                                 workspace)

    def test_gemv_plan_covers_k_once_and_fits(self):
        # Every plan: splits of kc groups that cover the K groups once with none empty, kc within
        # the shared memory of its rows, one wave where the fewest splits allow it, the fewest
        # splits without an SM count.
        for n, kp, m, sms in itertools.product((8, 24, 512, 3840, 21504, 40000),
                                               (128, 768, 3840, 6144, 15360, 21504, 65536),
                                               (1, 8, 9, 16), (0, 58, 132)):
            for cluster in (False, True):
                tiles, splits, kc, rows8 = w4a8_module._gemv_plan(n, kp, m, sms, cluster)
                groups, kc_max = kp // 128, (47 if m <= 8 else 23)
                s_min = -(-groups // kc_max)
                with self.subTest(n=n, kp=kp, m=m, sms=sms, cluster=cluster):
                    self.assertEqual((tiles, rows8), (-(-n // 128), 8 if m <= 8 else 16))
                    self.assertTrue((splits - 1) * kc < groups <= splits * kc)
                    self.assertLessEqual(kc, kc_max)
                    self.assertGreaterEqual(splits, s_min)
                    if cluster and s_min <= 8:
                        self.assertLessEqual(splits, 8)
                    if sms == 0:
                        self.assertEqual(splits, s_min)
                    elif tiles * s_min <= 2 * sms:
                        self.assertLessEqual(tiles * splits, 2 * sms)

    def test_gemv_workspace_sizes(self):
        # "gemv", and "auto" up to 16 rows: the plan's split-K scratch for the process's SMs
        # (the most of its devices), at least a 16-byte token; from 17 rows "auto" is wgmma_ws.
        v, size = w4a8_module.KERNELS, w4a8_module._dense_workspace_bytes
        devices = [mock.Mock(core_count=148), mock.Mock(core_count=132)]
        slot, flags = 128 * 256 * 4, 4096
        without_sm90a = mock.Mock(return_value={"cuda_archs": "80-real,89-real"})
        with mock.patch.object(w4a8_module.jax, "devices", return_value=devices), \
             mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((9, 0),)), \
             mock.patch.object(w4a8_module, "build_info", without_sm90a):
            self.assertEqual(size(v["gemv"], 16, 21504, 5376), 4129536)
            self.assertEqual(size(v["auto"], 16, 21504, 5376), 4129536)
            self.assertEqual(size(v["gemv"], 1, 21504, 5376), 16)
            self.assertEqual(size(v["gemv"], 1, 3840, 15360), 1106176)
            self.assertEqual(size(v["auto"], 17, 21504, 5376), flags + 148 * slot)
        with mock.patch.object(w4a8_module.jax, "devices", side_effect=RuntimeError("no cuda")), \
             mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((9, 0),)), \
             mock.patch.object(w4a8_module, "build_info", without_sm90a):
            self.assertEqual(size(v["gemv"], 1, 3840, 15360), 983296)  # 132 SMs assumed
        # Hopper with sm_90a code: cluster split-K needs no scratch, except past 8 splits.
        with_sm90a = mock.Mock(return_value={"cuda_archs": "80-real,89-real,90a"})
        with mock.patch.object(w4a8_module.jax, "devices", return_value=devices), \
             mock.patch.object(w4a8_module, "cuda_capabilities", return_value=((9, 0),)), \
             mock.patch.object(w4a8_module, "build_info", with_sm90a):
            self.assertEqual(size(v["gemv"], 16, 21504, 5376), 16)
            self.assertEqual(size(v["gemv"], 1, 3840, 15360), 16)
            self.assertEqual(size(v["gemv"], 16, 136, 24576),
                             w4a8_module._gemv_workspace_bytes(136, 24576, 16, 148))
            self.assertGreater(size(v["gemv"], 16, 136, 24576), 16)

    def _traced_variant(self, x_fp8, x_scale, w, archs="80-real,89-real,90a", **kwargs):
        """The `variant` (and scratch bytes) of the custom call that w4a8_matmul traces to with
        the kernel built and one 9.0 GPU of 132 SMs (mocked: the trace needs no GPU)."""
        from jax_mila.ffi import _registry
        forced = lambda op, target=None: _registry.OpStatus(op, True, "forced by the test")  # noqa: E731
        with mock.patch.object(_registry, "status", forced), \
             mock.patch.object(_registry, "cuda_capabilities", return_value=((9, 0),)), \
             mock.patch.multiple(w4a8_module, cuda_capabilities=mock.Mock(return_value=((9, 0),)),
                                 build_info=mock.Mock(return_value={"cuda_archs": archs})), \
             mock.patch.object(w4a8_module.jax, "devices",
                               return_value=[mock.Mock(core_count=132)]):
            jaxpr = str(jax.make_jaxpr(lambda *a: ffi.w4a8_matmul(*a, **kwargs))(
                x_fp8, x_scale, w))
        variants = re.findall(r"\('variant', np\.int64\((\d+)\)\)", jaxpr)
        self.assertEqual(len(variants), 1, jaxpr)
        scratch = re.findall(r"ShapedArray\(uint8\[(\d+)\]\)", jaxpr)
        return int(variants[0]), int(scratch[0])

    def test_many_traces_to_one_gemv_launch(self):
        # w4a8_matmul_many on a (mocked) Hopper process: up to 3 weights of one stored K in one
        # jax_mila_w4a8_gemv call (clusters: the 16-byte token scratch), a fourth weight in the
        # next; from 17 rows one w4a8_matmul per weight; a weight that does not fit x's K fails.
        from jax_mila.ffi import _registry
        forced = lambda op, target=None: _registry.OpStatus(op, True, "forced by the test")  # noqa: E731
        w = [quant.quantize_mxfp4(jnp.ones((n, 2112), jnp.float32)) for n in (264, 136, 8, 16)]
        w_other = quant.quantize_mxfp4(jnp.ones((24, 3840), jnp.float32))
        with mock.patch.object(_registry, "status", forced), \
             mock.patch.object(_registry, "cuda_capabilities", return_value=((9, 0),)), \
             mock.patch.multiple(w4a8_module, cuda_capabilities=mock.Mock(return_value=((9, 0),)),
                                 build_info=mock.Mock(return_value={"cuda_archs": "90a"})), \
             mock.patch.object(w4a8_module.jax, "devices",
                               return_value=[mock.Mock(core_count=132)]):
            for rows, weights, gemv_calls, matmul_calls in (
                    (3, w[:3], 1, 0), (16, w, 2, 0), (1, [w[0], w_other, w[1]], 0, 0),
                    (1, w[:1], 0, 1), (17, w[:3], 0, 3)):
                xq = jnp.zeros((rows, 2112), jnp.float8_e4m3fn)
                xs = jnp.ones((rows,), jnp.float32)
                fn = lambda x, s: ffi.w4a8_matmul_many(x, s, weights)  # noqa: E731
                with self.subTest(rows=rows, weights=len(weights)):
                    if any(x is w_other for x in weights):
                        with self.assertRaisesRegex(ValueError, "K"):
                            jax.make_jaxpr(fn)(xq, xs)
                        continue
                    jaxpr = str(jax.make_jaxpr(fn)(xq, xs))
                    self.assertEqual(jaxpr.count("jax_mila_w4a8_gemv"), gemv_calls, jaxpr)
                    self.assertEqual(jaxpr.count("jax_mila_w4a8_matmul"), matmul_calls, jaxpr)
                    if gemv_calls:
                        self.assertIn("uint8[16]", jaxpr)

    def test_many_on_the_reference_is_each_weights_product(self):
        xq, xs, w1 = _operands(5, 264, 2112, _seed())
        _, _, w2 = _operands(5, 136, 2112, _seed() + 1)
        got = ffi.w4a8_matmul_many(xq, xs, [w1, w2], out_dtype=jnp.float32)
        for y, w in zip(got, (w1, w2)):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(
                reference.w4a8_matmul(xq, xs, w, out_dtype=jnp.float32)))
        for bad, pattern in (([], "weights: expected a non-empty sequence of MXFP4Weight"),
                             ([w1, np.zeros((4, 4))], "weights: expected a non-empty sequence"),
                             ([w1, quant.quantize_mxfp4(jnp.ones((8, 3840)))], "K")):
            with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
                ffi.w4a8_matmul_many(xq, xs, bad)

    def test_auto_traces_to_the_gemv_for_1_to_16_rows(self):
        # The choice by rows happens at trace time (the rows are static): 1-16 rows -> variant
        # 4 with the plan's scratch, leading dims counted as rows; 17 -> the GEMM ("auto", which
        # the handler resolves per device; mma_sync on a build without sm_90a code).
        w = quant.quantize_mxfp4(jnp.ones((264, 2112), jnp.float32))
        for lead in ((1,), (3,), (16,), (2, 8), (17,)):
            xq = jnp.zeros(lead + (2112,), jnp.float8_e4m3fn)
            xs = jnp.ones(lead, jnp.float32)
            m = int(np.prod(lead))
            with self.subTest(lead=lead):
                variant, scratch = self._traced_variant(xq, xs, w)
                if m <= 16:
                    self.assertEqual(variant, w4a8_module.KERNELS["gemv"])
                    self.assertEqual(scratch, max(16, w4a8_module._gemv_workspace_bytes(
                        264, 2176, m, 132, cluster=True)))
                    self.assertEqual(scratch, 16)  # the splits are clusters
                else:
                    self.assertEqual(variant, w4a8_module.KERNELS["auto"])
                    self.assertEqual(self._traced_variant(xq, xs, w, archs="80-real,89-real")[0],
                                     w4a8_module.KERNELS["mma_sync"])
        xq, xs = jnp.zeros((3, 2112), jnp.float8_e4m3fn), jnp.ones((3,), jnp.float32)
        self.assertEqual(self._traced_variant(xq, xs, w, kernel="gemv")[0], 4)
        self.assertEqual(self._traced_variant(xq, xs, w, kernel="mma_sync")[0], 1)

    def test_gemv_register_layout_emulated(self):
        # The GEMV's per-lane arithmetic replayed in numpy on one warp tile (16 weight rows, 8
        # activation rows, 3 groups of K): its table constants read from the kernel source,
        # word -> fp16 high bytes (the prmt conversion of ptx.cuh), the byte permutes into
        # fp16x2, the A/B fragment registers each lane passes to mma.sync.m16n8k16 placed where
        # PTX's fragment layout puts them, the epilogue's 2^(channel_exp - 127). It must equal
        # the product of the dequantized weights: a wrong table, sign, k order or fragment
        # slot is an O(1) error. (The GPU tests run the kernel itself.)
        src = open(os.path.join(testing.REPO, "csrc/w4a8/w4a8_gemv.cu")).read()
        const = {name: int(re.search(rf"constexpr uint32_t {name} = (0x[0-9A-Fa-f]+)u;",
                                     src).group(1), 16)
                 for name in ("kLutLo", "kLutHi", "kStepLo", "kStepHi")}
        shift = int(re.search(r"constexpr int kChannelShift = (\d+);", src).group(1))
        perm = [int(v, 16) for v in re.findall(r"prmt\((?:lo|hi), 0u, (0x[0-9a-f]+)u\)", src)]
        self.assertEqual(len(perm), 4)
        mask = 0xFFFFFFFF

        def prmt(a, b, sel):  # sel nibbles < 8: plain byte selection from {b, a}
            src_bytes = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF
                                                                   for i in range(4)]
            return sum(src_bytes[(sel >> 4 * i) & 7] << 8 * i for i in range(4))

        def halves(v):  # fp16x2 register -> (low, high) values
            return np.array([v & 0xFFFF, v >> 16], np.uint16).view(np.float16).astype(np.float64)

        def pair(a, b):
            h = np.array([a, b], np.float16).view(np.uint16)
            return int(h[0]) | int(h[1]) << 16

        rng = np.random.default_rng(_seed())
        n, k, rows = 16, 384, 8
        w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-20, 21, (n, 1)))
        w[:, 32:64] *= 2.0 ** -11  # a block at the exponent floor
        q = quant.quantize_mxfp4(jnp.asarray(w, jnp.float32))
        packed, scales, chexp = (np.asarray(a) for a in (q.packed, q.scales, q.channel_exp))
        x = jax.random.normal(jax.random.key(_seed()), (rows, k), jnp.float32) * 5
        xq, xs = ffi.quantize_activations(x.astype(jnp.bfloat16))
        x8 = np.asarray(xq.astype(jnp.float32), np.float64)
        acc = np.zeros((n, rows))  # D[weight row, activation row]
        for j, b in itertools.product(range(k // 128), range(4)):
            a_mat, b_mat = np.zeros((2, 16, 16)), np.zeros((2, 16, 8))
            for g, qq in itertools.product(range(8), range(4)):
                h = []
                for row in (g, g + 8):
                    off = 64 * j + 16 * qq + 4 * b
                    word = int.from_bytes(packed[row, off:off + 4].tobytes(), "little")
                    e, r = int(scales[row, 4 * j + b]), int(chexp[row])
                    lut_lo = (e * const["kStepLo"] + const["kLutLo"] - r * const["kStepLo"]) & mask
                    lut_hi = (e * const["kStepHi"] + const["kLutHi"] - r * const["kStepHi"]) & mask
                    mag = word & 0x77777777
                    lo = prmt(lut_lo, lut_hi, mag & 0xFFFF) | (word & 0x80808080)
                    hi = prmt(lut_lo, lut_hi, mag >> 16) | ((word << 4) & 0x80808080)
                    h.append([prmt(lo, 0, perm[0]), prmt(lo, 0, perm[1]),
                              prmt(hi, 0, perm[2]), prmt(hi, 0, perm[3])])
                k0 = 128 * j + 32 * b
                xv = x8[g, [k0 + 4 * qq + d for d in (0, 1, 2, 3, 16, 17, 18, 19)]]
                xb = [pair(*xv[0:2]), pair(*xv[2:4]), pair(*xv[4:6]), pair(*xv[6:8])]
                for t in range(2):  # the two mmas of a block: a_lo/b_lo, a_hi/b_hi
                    a = [h[0][2 * t], h[1][2 * t], h[0][2 * t + 1], h[1][2 * t + 1]]
                    a_mat[t, g, 2 * qq:2 * qq + 2] = halves(a[0])
                    a_mat[t, g + 8, 2 * qq:2 * qq + 2] = halves(a[1])
                    a_mat[t, g, 2 * qq + 8:2 * qq + 10] = halves(a[2])
                    a_mat[t, g + 8, 2 * qq + 8:2 * qq + 10] = halves(a[3])
                    b_mat[t, 2 * qq:2 * qq + 2, g] = halves(xb[2 * t])
                    b_mat[t, 2 * qq + 8:2 * qq + 10, g] = halves(xb[2 * t + 1])
            acc += a_mat[0] @ b_mat[0] + a_mat[1] @ b_mat[1]
        got = acc.T * np.exp2(chexp.astype(np.float64) - shift) * np.asarray(xs, np.float64)[:, None]
        self.assertLess(testing.rel_fro_err(got, _exact_product(xq, xs, q)), 1e-12)

    def test_gemv_rejects_what_it_cannot_take(self):
        xq, xs, w = _operands(17, 64, 256, 0)
        with self.assertRaisesRegex(ValueError, r"w4a8_matmul: kernel: 'gemv' takes 1 to 16 "
                                                r"rows, x_fp8 has 17"):
            ffi.w4a8_matmul(xq, xs, w, kernel="gemv")
        with self.assertRaisesRegex(ValueError, r"kernel: 'gemv' takes 1 to 16 rows, x_fp8 has "
                                                r"18 \(shape \[3, 6, 256\]\)"):
            ffi.w4a8_matmul(jnp.zeros((3, 6, 256), jnp.float8_e4m3fn),
                            jnp.ones((3, 6), jnp.float32), w, kernel="gemv")
        xg, sg, wg, gs = _grouped_operands((3, 2), 16, 128, 0)
        with self.assertRaisesRegex(ValueError, r"grouped_w4a8_matmul: kernel: 'gemv' takes "
                                                r"dense calls only"):
            ffi.grouped_w4a8_matmul(xg, sg, wg, gs, kernel="gemv")
        # Where it can: 16 rows through the wrapper (the reference without a GPU).
        ffi.w4a8_matmul(xq[:16], xs[:16], w, kernel="gemv")


# Relative Frobenius error bound (float32 output, against the float32 reference or the float64
# product) per kernel. mma_sync accumulates in float32: 2e-6. wgmma_ws: Hopper's FP8 wgmma adds
# at ~14 bits (truncated), so the kernel promotes every 256-long K chunk into float32 registers;
# expected ~1e-4 at any K. 4e-4 holds it with margin while an unpromoted kernel (1.6e-3 at
# K=15360, measured on the H200) fails test_accuracy_k15360; the e4m3 instance adds the same
# products in the same order.
# gemv: fp16 mma.sync with float32 accumulation of exact products, split-K partials added in
# float32: as mma_sync.
F32_TOL = {"mma_sync": 2e-6, "gemv": 2e-6, **{kernel: 4e-4 for kernel in HOPPER_KERNELS}}
K15360_TOL = {"mma_sync": 1e-5, "gemv": 1e-5, **{kernel: 4e-4 for kernel in HOPPER_KERNELS}}


def _resolve(kernel: str, m: int | None, *, grouped: bool = False) -> str:
    """The kernel that `kernel` runs for m rows ("auto": m must be given, but for grouped
    calls, which never take the GEMV)."""
    if kernel != "auto":
        return kernel
    if m is None and not grouped:
        raise ValueError("kernel='auto' resolves by the rows: pass m")
    return w4a8_module.auto_kernel(m or 1, grouped=grouped)


class _KernelTestBase(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "w4a8_matmul")
        if testing.compute_capability() < (8, 9):
            self.skipTest("FP8 mma needs compute capability >= 8.9")

    def _require(self, kernel, m=None, *, grouped=False):
        if kernel in HOPPER_KERNELS and testing.compute_capability() != (9, 0):
            self.skipTest(f"{kernel} needs compute capability 9.0 (sm_90a)")
        return _resolve(kernel, m, grouped=grouped)

    def _assert_close(self, got, want32, resolved, tol, what):
        """float32 `want32`; `got` float32 (relative Frobenius error under `tol`) or bf16."""
        self.assertTrue(bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))),
                        f"non-finite (poison left?) {what}")
        err = testing.rel_fro_err(got, want32)
        self.assertLess(err, tol if got.dtype == jnp.float32 else 4e-3, what)
        if got.dtype == jnp.bfloat16:  # every element within bf16 rounding of the truth
            w32 = np.asarray(want32)
            # plus, for wgmma, its FP8 accumulation error (~1e-4 of the RMS, Gaussian-like:
            # 2e-3 of the RMS is far in the tail; an indexing bug is O(1))
            rms = float(np.sqrt(np.mean(w32.astype(np.float64) ** 2)))
            atol = (1e-6 * float(np.abs(w32).max()) if resolved in ("mma_sync", "gemv")
                    else 2e-3 * rms)
            np.testing.assert_allclose(np.asarray(got, np.float32), w32, rtol=8e-3, atol=atol,
                                       err_msg=what)


class W4A8KernelTest(_KernelTestBase):
    """GPU: the dense kernels against the reference (poisoned outputs, odd sizes). Every test
    runs for "auto" (held to the bounds of the kernel it resolves to), "mma_sync", "wgmma_ws" and
    "wgmma_ws_e4m3" (the last two: compute capability 9.0 only)."""

    def _check(self, m, n, k, kernel, *, w_scale=None, seed=None):
        resolved = self._require(kernel, m)
        seed = _seed() if seed is None else seed
        xq, xs, w = _operands(m, n, k, seed, w_scale=w_scale)
        want32 = reference.w4a8_matmul(xq, xs, w, out_dtype=jnp.float32)
        for out_dtype in (jnp.float32, jnp.bfloat16):
            fn = functools.partial(ffi.w4a8_matmul, out_dtype=out_dtype, kernel=kernel)
            got = testing.call_with_poisoned_outputs(fn, xq, xs, w)
            self.assertEqual(got.dtype, out_dtype)
            self.assertEqual(got.shape, (m, n))
            self._assert_close(got, want32, resolved, F32_TOL[resolved],
                               f"m={m} n={n} k={k} {kernel} {jnp.dtype(out_dtype).name} "
                               f"seed={seed}")

    @parameterized.product(
        kernel=KERNELS,
        mnk=[(1, 256, 128), (97, 384, 256), (257, 264, 512), (300, 136, 384), (130, 264, 704),
             (33, 256, 2112), (5, 8, 32)],
    )
    def test_small(self, kernel, mnk):
        # K = 704, 2112, 32: weights stored padded to 768, 2176, 128; the activations' last K
        # tile is read past K as zeros.
        self._check(*mnk, kernel)

    @parameterized.parameters(*KERNELS)
    def test_channel_scales_over_many_binades(self, kernel):
        self._check(130, 512, 256, kernel, w_scale=40)

    @parameterized.parameters(*KERNELS)
    def test_exact_on_blocks_at_the_exponent_floor(self, kernel):
        # Every block 0..11 exponents below the channel's, every code: exactness of the e4m3
        # conversion (a wrong exponent or sign shows as a large error, not a rounding one).
        resolved = self._require(kernel, 96)
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
        resolved = self._require(kernel, 512)
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
        # Promotion makes the error a property of 256-long chunks: K=15360 must be no worse than
        # a few times K=256 (unpromoted it grew ~16x).
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
        # On a 132-SM GPU (other GPUs cut these differently, as correctly):
        # 1 tile pair of 32 K tiles: pieces of 8, each tile one owner and three later pieces;
        dict(testcase_name="few_tiles_long_k", mnk=(100, 136, 4096)),
        # runs of 8 that cross tiles of 13 K tiles (an odd count, a one-tile chain at a piece's
        # end); N and M tails in the split tiles;
        dict(testcase_name="odd_pieces", mnk=(300, 264, 1664)),
        # one whole wave, then the rest split along K; K = 2112 is stored padded.
        dict(testcase_name="wave_then_stream_k", mnk=(1100, 3848, 2112)),
    )
    def test_stream_k(self, mnk):
        # wgmma_ws splits the last wave's tile pairs along K (csrc/w4a8/w4a8_sm90_ws.cu,
        # "schedule"); the e4m3 instance keeps the scratch's stream-K part before its expanded
        # weights. Both against the reference.
        for kernel in HOPPER_KERNELS:
            self._check(*mnk, kernel)

    def test_expanded_weights_agree_bitwise(self):
        # The e4m3 instance takes the bytes wgmma_ws converts each weight word into, through
        # shared memory instead of registers, and adds the same products in the same order into
        # each output (a wgmma's N only groups output columns; the tiles are 192 activation rows
        # instead of 256). Where no tile is split along K (K <= 1024: a piece must save more than
        # 8 K tiles), equal bit for bit. M = EXPAND_MIN_ROWS is where "auto" starts to expand.
        self._require("wgmma_ws_e4m3")
        seed = _seed()
        shapes = [(97, 264, 384), (1, 8, 128), (1000, 520, 1024), (77, 136, 704)]
        if not _under_compute_sanitizer():
            shapes += [(8389, 2056, 384), (w4a8_module.EXPAND_MIN_ROWS, 520, 512)]
        for m, n, k in shapes:
            xq, xs, w = _operands(m, n, k, seed + m)
            for dtype in (jnp.float32, jnp.bfloat16):
                want = ffi.w4a8_matmul(xq, xs, w, out_dtype=dtype, kernel="wgmma_ws")
                got = np.asarray(testing.call_with_poisoned_outputs(
                    functools.partial(ffi.w4a8_matmul, out_dtype=dtype, kernel="wgmma_ws_e4m3"),
                    xq, xs, w), np.float32)
                np.testing.assert_array_equal(got, np.asarray(want, np.float32),
                                              err_msg=f"m={m} n={n} k={k} "
                                                      f"{jnp.dtype(dtype).name} seed={seed}")
                if m >= w4a8_module.EXPAND_MIN_ROWS:  # "auto" expands here
                    auto = ffi.w4a8_matmul(xq, xs, w, out_dtype=dtype)
                    np.testing.assert_array_equal(np.asarray(auto, np.float32), got)

    def test_handlers_refuse_what_the_wrappers_would(self):
        # The custom calls past every Python check: the handlers answer INVALID_ARGUMENT naming
        # the argument (no launch): a workspace without room for the expanded weights, K that
        # does not fit the stored K, a grouped call's E that disagrees with group_sizes, the e4m3
        # instance on a grouped call.
        self._require("wgmma_ws_e4m3")
        xq, xs, w = _operands(64, 136, 256, _seed())
        v = w4a8_module.KERNELS
        out = jax.ShapeDtypeStruct((64, 136), jnp.bfloat16)

        def dense(x, variant, workspace):
            call = jax.ffi.ffi_call("jax_mila_w4a8_matmul",
                                    (out, jax.ShapeDtypeStruct((workspace,), jnp.uint8)))
            return call(x, xs, w.packed, w.scales, w.channel_exp, variant=np.int64(variant))

        with self.assertRaisesRegex(Exception, r"workspace: .* needs at least"):
            jax.block_until_ready(dense(xq, v["wgmma_ws_e4m3"], 136 * 256 + 255))
        with self.assertRaisesRegex(Exception, r"x_fp8, w: K=96 does not fit"):
            jax.block_until_ready(dense(xq[:, :96], v["wgmma_ws"], 1 << 22))
        xg, sg, wg, gs = _grouped_operands((30, 34), 136, 256, _seed())

        def grouped(sizes, variant):
            call = jax.ffi.ffi_call("jax_mila_grouped_w4a8_matmul",
                                    (out, jax.ShapeDtypeStruct((1 << 16,), jnp.uint8)))
            return call(xg, sg, wg.packed, wg.scales, wg.channel_exp, sizes,
                        variant=np.int64(variant))

        with self.assertRaisesRegex(Exception, r"w.packed: expected \[E, N, Kp/2\] with E = 3"):
            jax.block_until_ready(grouped(jnp.asarray([30, 34, 0], jnp.int32), v["wgmma_ws"]))
        with self.assertRaisesRegex(Exception, r"grouped calls convert the weights in registers"):
            jax.block_until_ready(grouped(gs, v["wgmma_ws_e4m3"]))

    @parameterized.parameters(*KERNELS)
    def test_more_tiles_than_sms(self, kernel):
        # 33 x 17 output tiles of wgmma_ws (256 x 128) on 132 SMs: every CTA of the persistent
        # kernel runs several tiles (the mbarrier phases and the epilogue buffers carry over
        # between them), with an M tail (8389 = 32 * 256 + 197) and an N tail (2056 = 16 * 128 +
        # 8) in the raster.
        if _under_compute_sanitizer():
            self.skipTest("large case: skipped under compute-sanitizer")
        self._check(8389, 2056, 384, kernel)


class GroupedW4A8KernelTest(_KernelTestBase):
    """GPU: the grouped kernels against the reference: random and skewed routing, empty experts,
    groups that are not tile multiples, K stored padded, rows past the groups, poisoned outputs."""

    def _check(self, sizes, n, k, kernel, *, m=None, seed=None):
        resolved = self._require(kernel, grouped=True)
        seed = _seed() if seed is None else seed
        xq, xs, w, gs = _grouped_operands(sizes, n, k, seed, m=m)
        want32 = reference.grouped_w4a8_matmul(xq, xs, w, gs, out_dtype=jnp.float32)
        for out_dtype in (jnp.float32, jnp.bfloat16):
            fn = functools.partial(ffi.grouped_w4a8_matmul, out_dtype=out_dtype, kernel=kernel)
            got = testing.call_with_poisoned_outputs(fn, xq, xs, w, gs)
            self.assertEqual(got.shape, (xq.shape[0], n))
            self._assert_close(got, want32, resolved, F32_TOL[resolved],
                               f"sizes={sizes} n={n} k={k} {kernel} "
                               f"{jnp.dtype(out_dtype).name} seed={seed}")

    @parameterized.product(
        kernel=GROUPED_KERNELS,
        case=[((97,), 136, 256), ((5, 0, 300, 1, 0, 64), 264, 704), ((0, 0, 513), 128, 384),
              ((256, 256, 255, 257), 8, 128), ((1,) * 9, 1408, 2816)],
    )
    def test_small(self, kernel, case):
        self._check(*case, kernel)

    @parameterized.parameters(*GROUPED_KERNELS)
    def test_rows_past_the_groups_are_zeros(self, kernel):
        # The sizes add up to fewer rows than x has (traced sizes: the kernel's reading).
        self._require(kernel, grouped=True)
        xq, xs, w, _ = _grouped_operands((40, 20), 64, 256, _seed(), m=100)
        gs = jnp.asarray([40, 20], jnp.int32)
        fn = jax.jit(functools.partial(ffi.grouped_w4a8_matmul, out_dtype=jnp.float32,
                                       kernel=kernel))
        got = np.asarray(testing.call_with_poisoned_outputs(fn, xq, xs, w, gs))
        np.testing.assert_array_equal(got[60:], 0.0)
        self.assertLess(testing.rel_fro_err(got[:60], _exact_grouped(xq, xs, w, gs)[:60]),
                        F32_TOL[_resolve(kernel, None, grouped=True)])

    @parameterized.parameters(*GROUPED_KERNELS)
    def test_moe_26b_shapes(self, kernel):
        # The 26B-A4B's expert GEMMs (128 experts, gate_up 2816 -> 1408, down 704 -> 2816) on
        # 1024 tokens x top-8, random and skewed routing (half the rows on one expert).
        if _under_compute_sanitizer():
            self.skipTest("large case: skipped under compute-sanitizer")
        rng = np.random.default_rng(_seed())
        for skew in (False, True):
            p = np.full(128, 1.0)
            if skew:
                p[rng.integers(128)] = 127.0
            sizes = tuple(rng.multinomial(8192, p / p.sum()))
            for n, k in ((1408, 2816), (2816, 704)):
                with self.subTest(skew=skew, n=n, k=k):
                    self._check(sizes, n, k, kernel)

    def test_single_expert_equals_dense_bitwise(self):
        # One expert's rows go through the same wgmmas in the same order as the dense wgmma_ws
        # (K <= 1024: no stream-K split), so the outputs are equal bit for bit.
        self._require("wgmma_ws")
        seed = _seed()
        for m, n, k in ((300, 264, 384), (1, 8, 704), (2049, 1408, 1024)):
            xq, xs, w, gs = _grouped_operands((m,), n, k, seed + m)
            dense_w = jax.tree.map(lambda a: a[0], w)
            for dtype in (jnp.float32, jnp.bfloat16):
                want = ffi.w4a8_matmul(xq, xs, dense_w, out_dtype=dtype, kernel="wgmma_ws")
                got = ffi.grouped_w4a8_matmul(xq, xs, w, gs, out_dtype=dtype, kernel="wgmma_ws")
                np.testing.assert_array_equal(np.asarray(got, np.float32),
                                              np.asarray(want, np.float32),
                                              err_msg=f"m={m} n={n} k={k} seed={seed}")

    def test_routing_changes_without_recompiling(self):
        self._require("auto", grouped=True)
        xq, xs, w, _ = _grouped_operands((100, 100, 100), 136, 256, _seed())
        fn = jax.jit(ffi.grouped_w4a8_matmul)
        for sizes in ((100, 100, 100), (0, 300, 0), (299, 0, 1), (3, 7, 11)):
            gs = jnp.asarray(sizes, jnp.int32)
            got = fn(xq, xs, w, gs)
            want = reference.grouped_w4a8_matmul(xq, xs, w, gs)
            self.assertLess(testing.rel_fro_err(got, want), 4e-3, sizes)
        self.assertEqual(fn._cache_size(), 1)


class W4A8GemvTest(_KernelTestBase):
    """GPU: the decode GEMV (kernel="gemv", and "auto" for 1-16 rows) against the float64
    product of the dequantized operands on the host (a path independent of the kernel and of
    the JAX reference): fresh random inputs, poisoned outputs, M from 1 to 16, N of a partial
    tile (8, 24, 136, 4104), K not a multiple of 128, large magnitudes, split-K on and off,
    bitwise repeatability."""

    def _plan(self, m, n, k):
        return w4a8_module._gemv_plan(n, quant.padded_k(k), m, w4a8_module._sms(),
                                      w4a8_module._gemv_clusters())

    def _check(self, m, n, k, *, kernel="gemv", w_scale=None, x_mag=3.0, seed=None):
        self.assertEqual(self._require(kernel, m), "gemv")
        seed = _seed() if seed is None else seed
        xq, xs, w = _operands(m, n, k, seed, w_scale=w_scale, x_mag=x_mag)
        want = _exact_product(xq, xs, w)
        tol = (K15360_TOL if k >= 8192 else F32_TOL)["gemv"]
        outs = {}
        for out_dtype in (jnp.float32, jnp.bfloat16):
            fn = functools.partial(ffi.w4a8_matmul, out_dtype=out_dtype, kernel=kernel)
            got = testing.call_with_poisoned_outputs(fn, xq, xs, w)
            self.assertEqual(got.dtype, out_dtype)
            self.assertEqual(got.shape, (m, n))
            self._assert_close(got, want, "gemv", tol,
                               f"m={m} n={n} k={k} {kernel} {jnp.dtype(out_dtype).name} "
                               f"plan={self._plan(m, n, k)} seed={seed}")
            outs[out_dtype] = got
        return xq, xs, w, outs

    @parameterized.product(m=[1, 3, 8, 9, 16],
                           nk=[(8, 128), (24, 2112), (136, 704), (264, 96), (520, 1024),
                               (4104, 384)])
    def test_shapes(self, m, nk):
        # K = 2112, 704, 96: stored padded to 2176, 768, 128 (zeros past K, read as zeros);
        # N = 4104: 32 whole tiles of 128 and one of 8 (7 idle warps, masked rows).
        self._check(m, *nk)

    @parameterized.parameters(1, 16)
    def test_split_k_on_and_off(self, m):
        # N = 32768 fills a wave without splitting K (256 tiles on up to 2 x 128 slots: on 128
        # SMs or more, or one split past a wave on fewer); N = 264 and 12B's down split it.
        cases = [((32768, 256), False), ((264, 2112), True), ((3840, 15360), True)]
        if _under_compute_sanitizer():
            cases = cases[1:2]
        if m == 16:
            # More than 8 splits at the fewest (192 groups of K, 23 a CTA): the arrival
            # counters, on Hopper too.
            cases.append(((136, 24576), True))
        for (n, k), split in cases:
            _, splits, _, _ = self._plan(m, n, k)
            self.assertEqual(splits > 1, split, (n, k, splits))
            self._check(m, n, k)

    def test_bitwise_repeatable(self):
        # Split-K partials are added by whichever CTA of a tile arrives last, in split order:
        # the same bits every run.
        shapes = [(16, 264, 2112), (1, 512, 3840)]
        if not _under_compute_sanitizer():
            shapes += [(1, 3840, 15360), (16, 5376, 21504)]
        seed = _seed()
        for m, n, k in shapes:
            xq, xs, w = _operands(m, n, k, seed + m + n)
            self.assertGreater(self._plan(m, n, k)[1], 1)
            for dtype in (jnp.float32, jnp.bfloat16):
                fn = functools.partial(ffi.w4a8_matmul, out_dtype=dtype, kernel="gemv")
                first = np.asarray(testing.call_with_poisoned_outputs(fn, xq, xs, w), np.float32)
                for _ in range(2):
                    again = np.asarray(jax.jit(fn)(xq, xs, w), np.float32)
                    np.testing.assert_array_equal(again, first, err_msg=f"m={m} n={n} k={k}")

    @parameterized.parameters(1, 5, 16)
    def test_many_weights_one_launch(self, m):
        # w4a8_matmul_many: three weights of one K in one launch (N of 33 tiles + 8 columns,
        # 4 + 8, 1 + 8: every weight ends in a partial tile), each result against its own exact
        # product, bitwise repeatable; two weights.
        seed = _seed()
        xq, xs, w1 = _operands(m, 4104, 2112, seed)
        _, _, w2 = _operands(m, 520, 2112, seed + 1)
        _, _, w3 = _operands(m, 136, 2112, seed + 2)
        jaxpr = str(jax.make_jaxpr(lambda x, s: ffi.w4a8_matmul_many(x, s, [w1, w2, w3]))(xq, xs))
        self.assertEqual(jaxpr.count("jax_mila_w4a8_gemv"), 1, jaxpr)
        for weights in ([w1, w2, w3], [w2, w3]):
            for dtype in (jnp.float32, jnp.bfloat16):
                fn = functools.partial(ffi.w4a8_matmul_many, weights=weights, out_dtype=dtype)
                got = testing.call_with_poisoned_outputs(lambda x, s: fn(x, s), xq, xs)
                tol = F32_TOL["gemv"] if dtype == jnp.float32 else 4e-3
                for y, w in zip(got, weights):
                    self.assertEqual((y.shape, y.dtype), ((m, w.shape[0]), dtype))
                    self.assertLess(testing.rel_fro_err(y, _exact_product(xq, xs, w)), tol,
                                    f"m={m} n={w.shape[0]} {jnp.dtype(dtype).name} seed={seed}")
            again = jax.jit(lambda x, s: ffi.w4a8_matmul_many(x, s, weights))(xq, xs)
            first = jax.jit(lambda x, s: ffi.w4a8_matmul_many(x, s, weights))(xq, xs)
            for a, b in zip(again, first):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def test_large_magnitudes(self):
        # Channel scales over 81 binades and activations of 1e4 (x_scale ~ 80): the fp16
        # operands stay exact (the scales are applied in float32 after the sums).
        for m in (1, 16):
            self._check(m, 520, 2112, w_scale=40, x_mag=1e4)

    def test_exact_on_blocks_at_the_exponent_floor(self):
        # Every block 0..11 exponents below its channel's, every code: the fp16 table's shift
        # by the block offset (4 d in the high byte) must stay exact down to d = -11.
        rng = np.random.default_rng(_seed())
        n, k, m = 136, 512, 16
        codes = rng.integers(0, 16, (n, k))
        drop = rng.integers(0, 12, (n, k // 32))
        drop[:, 0] = 0
        w = quant.E2M1_VALUES[codes] * np.exp2(-np.repeat(drop, 32, axis=1))
        w[:, 0] = 6.0
        q = quant.quantize_mxfp4(jnp.asarray(w, jnp.float32))
        np.testing.assert_array_equal(np.asarray(quant.dequantize_mxfp4(q)), w.astype(np.float32))
        x = jax.random.normal(jax.random.key(_seed()), (m, k), jnp.float32).astype(jnp.bfloat16)
        xq, xs = ffi.quantize_activations(x)
        got = ffi.w4a8_matmul(xq, xs, q, out_dtype=jnp.float32, kernel="gemv")
        self.assertLess(testing.rel_fro_err(got, _exact_product(xq, xs, q)), F32_TOL["gemv"])

    def test_zero_rows_and_zero_channels(self):
        x = jnp.zeros((16, 256), jnp.bfloat16).at[1:].set(1.0)
        xq, xs = ffi.quantize_activations(x)
        wz = quant.quantize_mxfp4(jnp.zeros((136, 256)).at[1:].set(0.5))
        y = np.asarray(ffi.w4a8_matmul(xq, xs, wz, out_dtype=jnp.float32, kernel="gemv"))
        np.testing.assert_array_equal(y[0], 0.0)
        np.testing.assert_array_equal(y[:, 0], 0.0)
        np.testing.assert_allclose(y[1:, 1:], 128.0, rtol=1e-6)

    def test_auto_runs_the_gemv_for_decode_rows(self):
        # "auto" from 1 to 16 rows is the GEMV (the same plan: the same bits), with leading
        # dimensions counted as rows.
        seed = _seed()
        for lead in ((1,), (7,), (16,), (2, 8)):
            xq, xs, w = _operands(None, 520, 2112, seed, lead=lead)
            m = int(np.prod(lead))
            self.assertEqual(w4a8_module.auto_kernel(m), "gemv")
            auto = np.asarray(jax.jit(ffi.w4a8_matmul)(xq, xs, w), np.float32)
            gemv = np.asarray(ffi.w4a8_matmul(xq.reshape(m, -1), xs.reshape(m), w,
                                              kernel="gemv"), np.float32)
            self.assertEqual(auto.shape, lead + (520,))
            np.testing.assert_array_equal(auto.reshape(m, 520), gemv)
            self.assertLess(testing.rel_fro_err(auto.reshape(m, 520), _exact_product(
                xq.reshape(m, -1), xs.reshape(m), w)), 4e-3)  # bf16 output

    def test_inside_cuda_graph(self):
        """In a child process with XLA command buffers (CUDA graphs) forced on for custom calls:
        the split-K memset and launch captured once and replayed with new activations (the
        counters must be zeroed again by each replay, or the second call's sums go wrong)."""
        script = textwrap.dedent("""
            import sys
            sys.path.insert(0, %r)
            import jax, jax.numpy as jnp, numpy as np
            from jax_mila import ffi
            from test_w4a8 import _operands, _exact_product
            import testing
            from jax_mila.ffi import w4a8
            _, _, w = _operands(1, 264, 2112, 5)
            assert w4a8._gemv_plan(264, 2176, 3, w4a8._sms())[1] > 1
            f = jax.jit(lambda x, s, w: ffi.w4a8_matmul(x, s * 1.0, w, out_dtype=jnp.float32,
                                                        kernel="gemv"))
            for seed in range(4):
                xq, xs, _ = _operands(3, 8, 2112, 100 + seed)
                err = testing.rel_fro_err(f(xq, xs, w), _exact_product(xq, xs, w))
                assert err < 2e-6, (seed, err)
            print("CHILD OK")
        """ % os.path.dirname(os.path.abspath(__file__)))
        testing.assert_child_ok_in_cuda_graphs(self, script)

    def test_handler_refuses_what_the_wrapper_would(self):
        # The custom call past every Python check: INVALID_ARGUMENT, no launch.
        xq, xs, w = _operands(17, 136, 6144, _seed())
        v = w4a8_module.KERNELS["gemv"]

        def dense(x, s, workspace):
            out = jax.ShapeDtypeStruct((x.shape[0], 136), jnp.float32)
            call = jax.ffi.ffi_call("jax_mila_w4a8_matmul",
                                    (out, jax.ShapeDtypeStruct((workspace,), jnp.uint8)))
            return call(x, s, w.packed, w.scales, w.channel_exp, variant=np.int64(v))

        with self.assertRaisesRegex(Exception, r"variant=4: the GEMV takes 1 to 16 rows, x_fp8 "
                                               r"has M=17"):
            jax.block_until_ready(dense(xq, xs, 1 << 22))
        # 192 groups of K at 16 rows: 9 splits at least (23 fit a CTA), more than a cluster
        # takes, so the scratch must hold their partials on every GPU.
        xq, xs, w = _operands(16, 136, 24576, _seed())
        need = w4a8_module._gemv_workspace_bytes(136, 24576, 16, 0)
        self.assertGreater(need, 16)
        with self.assertRaisesRegex(Exception, r"workspace: 16 bytes; variant 4 needs at least "
                                               f"{need}"):
            jax.block_until_ready(dense(xq, xs, 16))
        got = dense(xq, xs, need)[0]  # the fewest splits, where that is all there is
        self.assertLess(testing.rel_fro_err(got, _exact_product(xq, xs, w)), K15360_TOL["gemv"])
        # The GEMV of several weights: its arrays in triples, one output each.
        many = jax.ffi.ffi_call("jax_mila_w4a8_gemv",
                                (jax.ShapeDtypeStruct((16, 136), jnp.float32),
                                 jax.ShapeDtypeStruct((1 << 22,), jnp.uint8)))
        with self.assertRaisesRegex(Exception, r"w4a8_gemv: weights: expected 1 to 3 "
                                               r"\(packed, scales, channel_exp\) triples"):
            jax.block_until_ready(many(xq, xs, w.packed, w.scales))
        two = jax.ffi.ffi_call("jax_mila_w4a8_gemv",
                               (jax.ShapeDtypeStruct((16, 136), jnp.float32),
                                jax.ShapeDtypeStruct((16, 136), jnp.bfloat16),
                                jax.ShapeDtypeStruct((1 << 22,), jnp.uint8)))
        with self.assertRaisesRegex(Exception, r"w4a8_gemv \(weight 1\): out: bfloat16; every "
                                               r"output of a launch must have the first's dtype"):
            jax.block_until_ready(two(xq, xs, *(2 * [w.packed, w.scales, w.channel_exp])))
        xg, sg, wg, gs = _grouped_operands((3, 2), 136, 256, _seed())
        call = jax.ffi.ffi_call("jax_mila_grouped_w4a8_matmul",
                                (jax.ShapeDtypeStruct((5, 136), jnp.float32),
                                 jax.ShapeDtypeStruct((1 << 16,), jnp.uint8)))
        with self.assertRaisesRegex(Exception, r"variant=4: the GEMV takes dense calls only"):
            jax.block_until_ready(call(xg, sg, wg.packed, wg.scales, wg.channel_exp, gs,
                                       variant=np.int64(v)))


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
