"""rms_norm_rope, the fused per-head RMS norm + RoPE of the attention layers: the reference against
the float64 interval oracle (jax_mila.reference.bounds.norm_rope_problem), the oracle against
wrong implementations, validation, where the Gemma 4 attention layers take the op (CPU); the
kernel against the oracle with poisoned outputs (GPU). Inputs are fresh random values every run;
each test prints its seed."""

import functools
import logging
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import Mesh

from jax_mila import ffi, gemma4, nn, reference
from jax_mila.ffi import _registry
from jax_mila.gemma4 import rope
from jax_mila.gemma4.config import RopeSpec
from jax_mila.gemma4.rope import apply_rope, rope_tables
from jax_mila.nn.norm import rms_norm
import testing  # tests/testing.py

EPS = 1e-6


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def norm_rope_inputs(shape, *, seed, x_scale=3.0, weight_dtype=jnp.bfloat16, tables="random"):
    """x bf16 ``shape`` = [..., T, H, D], a checkpoint-like weight (1 + a perturbation, some
    negative), and cos / sin [T, D]: Gemma 4's tables at positions from a random offset
    (``tables="gemma"``), or random values in [-1, 1] whose two halves differ (``"random"``:
    a kernel reading the other half's entry would be caught)."""
    t, d = shape[-3], shape[-1]
    kx, kw, kc, ks, kp = jax.random.split(jax.random.key(seed), 5)
    x = (jax.random.normal(kx, shape, jnp.float32) * x_scale).astype(jnp.bfloat16)
    weight = (1 + 0.5 * jax.random.normal(kw, (d,), jnp.float32)).astype(weight_dtype)
    if tables == "gemma":
        offset = jax.random.randint(kp, (), 0, 1 << 15)
        spec = RopeSpec(theta=1e4, head_dim=d, rotated=d // 2)
        cos, sin = rope_tables(spec, offset + jnp.arange(t, dtype=jnp.int32), jnp.bfloat16)
    else:
        cos = jax.random.uniform(kc, (t, d), jnp.float32, -1, 1).astype(jnp.bfloat16)
        sin = jax.random.uniform(ks, (t, d), jnp.float32, -1, 1).astype(jnp.bfloat16)
    return x, weight, cos, sin


def with_zero_row(x):
    """x with its first (token, head) row all zeros: its norm must be zeros, not NaN."""
    return x.reshape(-1, x.shape[-1]).at[0].set(0).reshape(x.shape)


def assert_admissible(testcase, x, weight, cos, sin, out, what="", eps=EPS):
    problem = testing.norm_rope_problem(x, weight, cos, sin, out, eps=eps)
    testcase.assertIsNone(problem, f"{what} {list(x.shape)}: {problem}")


# Odd sizes: T = 1 and 97, H = 1, 8 and 16, both head dims, leading batch dims.
ODD_SHAPES = [
    dict(testcase_name=f"t{t}_h{h}_d{d}", shape=(t, h, d))
    for t in (1, 97) for h in (1, 8, 16) for d in (256, 512)
] + [
    dict(testcase_name="batch_d256", shape=(2, 33, 3, 256)),
    dict(testcase_name="two_batch_dims_d512", shape=(2, 3, 5, 2, 512)),
]


class ReferenceTest(parameterized.TestCase):
    @parameterized.named_parameters(*ODD_SHAPES)
    def test_matches_oracle(self, shape):
        seed = fresh_seed()
        for tables in ("random", "gemma"):
            x, w, cos, sin = norm_rope_inputs(shape, seed=seed, tables=tables)
            x = with_zero_row(x)
            out = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
            assert_admissible(self, x, w, cos, sin, out, f"seed {seed} {tables}")
            first = np.asarray(out, np.float32).reshape(-1, shape[-1])[0]
            np.testing.assert_array_equal(first, 0.0, f"seed {seed}: the zero row")

    @parameterized.named_parameters(
        dict(testcase_name="bf16_weight", weight_dtype=jnp.bfloat16),
        dict(testcase_name="f32_weight", weight_dtype=jnp.float32),
    )
    def test_weight_dtypes(self, weight_dtype):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((33, 4, 256), seed=seed, weight_dtype=weight_dtype)
        if weight_dtype == jnp.float32:  # not bf16 values: the weight is used in float32
            w = w * (1 + 2.0**-12)
        out = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
        assert_admissible(self, x, w, cos, sin, out, f"seed {seed}")

    @parameterized.parameters(256, 512)
    def test_large_magnitudes(self, d):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((97, 8, d), seed=seed, x_scale=1e4)
        out = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
        assert_admissible(self, x, w, cos, sin, out, f"seed {seed}")

    def test_eps_matters_where_the_mean_square_is_small(self):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((17, 4, 256), seed=seed, x_scale=1e-3)
        for eps in (1e-6, 1e-5):
            out = reference.rms_norm_rope(x, w, cos, sin, eps=eps)
            assert_admissible(self, x, w, cos, sin, out, f"seed {seed} eps {eps}", eps=eps)
        other = reference.rms_norm_rope(x, w, cos, sin, eps=1e-6)
        self.assertIsNotNone(testing.norm_rope_problem(x, w, cos, sin, other, eps=1e-5))

    def test_jit_keeps_the_rounding_of_the_normed_values(self):
        # Under jit XLA deletes f32 -> bf16 -> f32 convert pairs; the reference rounds n with
        # reduce_precision so that jit cannot skip it. On CPU jit and op-by-op sum the squares
        # in the same order, so their bits agree; XLA's GPU fusions may sum them in another
        # order (a rare bf16 step of n, as the kernel's own order), so there both must be
        # admissible results of the op.
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((97, 8, 512), seed=seed)
        fn = functools.partial(reference.rms_norm_rope, eps=EPS)
        jitted, eager = jax.jit(fn)(x, w, cos, sin), fn(x, w, cos, sin)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(jitted, np.float32),
                                          np.asarray(eager, np.float32), err_msg=f"seed {seed}")
        for name, out in (("jit", jitted), ("op by op", eager)):
            problem = testing.norm_rope_problem(x, w, cos, sin, out, eps=EPS)
            self.assertIsNone(problem, f"{name}, seed {seed}: {problem}")

    def test_one_rounding_fewer_than_the_unfused_layers(self):
        # The unfused model rounds x * cos, rotate_half(x) * sin and their sum to bf16; the op
        # rounds once. Both are within 2^-6 of the terms' magnitudes of each other, and the
        # unfused result is NOT an admissible result of the op (that is the oracle's point).
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((97, 8, 256), seed=seed, tables="gemma")
        fused = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
        n = rms_norm(x[None], w, EPS)[0]
        unfused = apply_rope(n[None], cos, sin)[0]
        nf = np.asarray(n, np.float64)
        rot = np.concatenate([-nf[..., 128:], nf[..., :128]], axis=-1)
        terms = (np.abs(nf * np.asarray(cos, np.float64)[:, None])
                 + np.abs(rot * np.asarray(sin, np.float64)[:, None]))
        diff = np.abs(np.asarray(fused, np.float64) - np.asarray(unfused, np.float64))
        self.assertTrue(np.all(diff <= 2.0**-6 * terms), f"seed {seed}")
        self.assertGreater(np.mean(diff > 0), 0.01, f"seed {seed}: the roundings differ")
        self.assertIsNotNone(testing.norm_rope_problem(x, w, cos, sin, unfused, eps=EPS))

    def test_wrapper_is_the_reference_on_cpu(self):
        if testing.has_cuda():
            self.skipTest("the wrapper runs the kernel here (KernelTest)")
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((2, 9, 3, 256), seed=seed)
        want = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
        for fn in (ffi.rms_norm_rope, jax.jit(ffi.rms_norm_rope, static_argnames="eps")):
            got = fn(x, w, cos, sin, eps=EPS)
            self.assertEqual((got.shape, got.dtype), (x.shape, jnp.bfloat16))
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    def test_vmap_over_x(self):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((3, 7, 2, 256), seed=seed)
        got = jax.vmap(lambda x: ffi.rms_norm_rope(x, w, cos, sin, eps=EPS))(x)
        assert_admissible(self, x, w, cos, sin, got, f"seed {seed}")


def _jnp_rope(n, cos, sin, sign=1.0):
    half = n.shape[-1] // 2
    rot = jnp.concatenate([-sign * n[..., half:], sign * n[..., :half]], axis=-1)
    return n * cos[:, None] + rot * sin[:, None]


class OracleTest(parameterized.TestCase):
    """The oracle rejects each one-mistake variant of the definition (in float32 jnp)."""

    @parameterized.named_parameters(
        dict(testcase_name="normed_values_not_rounded", mistake="no_n_rounding"),
        dict(testcase_name="rotate_half_sign_flipped", mistake="sign"),
        dict(testcase_name="weight_as_one_plus_w", mistake="one_plus_w"),
        dict(testcase_name="other_half_of_the_tables", mistake="swap_tables"),
        dict(testcase_name="next_token_tables", mistake="shift_tables"),
    )
    def test_rejects(self, mistake):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((9, 4, 256), seed=seed)
        f32 = jnp.float32
        wf = w.astype(f32) + (1 if mistake == "one_plus_w" else 0)
        n = rms_norm(x.astype(f32), wf, EPS)
        if mistake != "no_n_rounding":
            n = n.astype(jnp.bfloat16).astype(f32)
        c, s = cos.astype(f32), sin.astype(f32)
        if mistake == "swap_tables":
            c, s = jnp.roll(c, 128, axis=-1), jnp.roll(s, 128, axis=-1)
        if mistake == "shift_tables":
            c, s = jnp.roll(c, 1, axis=0), jnp.roll(s, 1, axis=0)
        out = _jnp_rope(n, c, s, sign=-1.0 if mistake == "sign" else 1.0).astype(jnp.bfloat16)
        self.assertIsNotNone(testing.norm_rope_problem(x, w, cos, sin, out, eps=EPS),
                             f"seed {seed}")

    def test_rejects_nan_and_shape(self):
        x, w, cos, sin = norm_rope_inputs((3, 2, 256), seed=fresh_seed())
        out = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
        self.assertIn("NaN", testing.norm_rope_problem(x, w, cos, sin, out.at[1, 1, 7].set(jnp.nan),
                                                       eps=EPS))
        self.assertIn("out:", testing.norm_rope_problem(x, w, cos, sin, out[:2], eps=EPS))


def _struct(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


class ValidationTest(parameterized.TestCase):
    @parameterized.named_parameters(
        dict(testcase_name="head_dim_128", x=_struct((4, 2, 128)),
             pattern=r"x: head dim D=128 \(last dim of \[4, 2, 128\]\) is not supported "
                     r"\(supported: 256, 512\)"),
        dict(testcase_name="x_float32", x=_struct((4, 2, 256), jnp.float32),
             pattern="x: dtype float32 is not supported.*bfloat16"),
        dict(testcase_name="x_rank_2", x=_struct((4, 256)), pattern=r"x: expected rank >= 3"),
        dict(testcase_name="x_empty", x=_struct((0, 2, 256)),
             pattern="x: empty arrays are not supported"),
        dict(testcase_name="weight_shape", w=_struct((512,), jnp.float32),
             pattern=r"weight: shape \[512\] must be \[256\]"),
        dict(testcase_name="weight_dtype", w=_struct((256,), jnp.float16),
             pattern="weight: dtype float16 is not supported.*bfloat16, float32"),
        dict(testcase_name="cos_length", cos=_struct((5, 256)),
             pattern=r"cos: shape \[5, 256\] must be \[4, 256\] \(\[T, D\] of x\[4, 2, 256\]"),
        dict(testcase_name="cos_head_dim", cos=_struct((4, 512)),
             pattern=r"cos: shape \[4, 512\] must be \[4, 256\]"),
        dict(testcase_name="cos_batched", cos=_struct((1, 4, 256)),
             pattern=r"cos: shape \[1, 4, 256\] must be \[4, 256\]"),
        dict(testcase_name="sin_dtype", sin=_struct((4, 256), jnp.float32),
             pattern="sin: dtype float32 is not supported.*bfloat16"),
        dict(testcase_name="eps_zero", eps=0.0, pattern=r"eps: 0.0 is not supported.*> 0"),
        dict(testcase_name="eps_array", eps=np.ones(2), pattern="eps: must be a static Python"),
        # The kernels take eps as float32: 1e-50 would reach them as 0, 1e300 as inf.
        dict(testcase_name="eps_below_float32", eps=1e-50, pattern="eps: 1e-50 is not supported"),
        dict(testcase_name="eps_above_float32", eps=1e300, pattern="eps: 1e[+]300 is not supported"),
        dict(testcase_name="eps_bool", eps=True, pattern="eps: must be a static Python number, "
             "got bool"),
        dict(testcase_name="eps_string", eps="1e-6", pattern="eps: must be a static Python "
             "number, got str"),
    )
    def test_bad_input_raises_at_trace_time(self, pattern, x=None, w=None, cos=None, sin=None,
                                            eps=EPS):
        # "is None", not "or": a struct of size 0 is falsy.
        x = _struct((4, 2, 256)) if x is None else x
        w = _struct((256,), jnp.float32) if w is None else w
        cos = _struct((4, 256)) if cos is None else cos
        sin = _struct((4, 256)) if sin is None else sin
        with self.assertRaisesRegex(ValueError, "jax_mila.rms_norm_rope: " + pattern):
            jax.eval_shape(lambda x, w, c, s: ffi.rms_norm_rope(x, w, c, s, eps=eps),
                           x, w, cos, sin)

    def test_traced_eps_is_refused(self):
        x, w, cos, sin = norm_rope_inputs((2, 1, 256), seed=0)
        with self.assertRaisesRegex(ValueError, "eps: must be a static Python number"):
            jax.jit(lambda e: ffi.rms_norm_rope(x, w, cos, sin, eps=e))(1e-6)


S, F = "sliding_attention", "full_attention"
# The kernel's head dims at toy width: 3 layers with their own K/V (q and k through the op, v
# not: a weightless norm and no RoPE) and one KV-shared layer (q only).
KERNEL_DIMS = dict(
    model_type="gemma4_text", vocab_size=61, hidden_size=64, intermediate_size=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=[S, F, S, F], num_kv_shared_layers=1, sliding_window=3,
    hidden_size_per_layer_input=0, final_logit_softcapping=30.0)


def kernel_dims_model(backend, seed, dtype=jnp.bfloat16):
    cfg = gemma4.Gemma4Config.from_dict(KERNEL_DIMS)
    return gemma4.Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend, rngs=nnx.Rngs(seed))


def rel_err(a, b):
    return testing.rel_fro_err(np.asarray(a, np.float32), np.asarray(b, np.float32))


class ModelTest(parameterized.TestCase):
    """Where the attention layers take the op: backends with kernels, bf16, head dims 256/512."""

    def test_norm_rope_helper_on_each_backend(self):
        seed = fresh_seed()
        x, _, cos, sin = norm_rope_inputs((1, 9, 4, 256), seed=seed, tables="gemma")
        norm = nn.RMSNorm(256, eps=EPS, param_dtype=jnp.bfloat16)
        norm.weight[...] = 1 + 0.5 * jax.random.normal(jax.random.key(seed), (256,), jnp.bfloat16)
        fused = rope.norm_rope(norm, x, cos, sin, backend="mila")
        want = reference.rms_norm_rope(x, norm.weight[...], cos, sin, eps=EPS)
        if not testing.has_cuda():  # the op's CPU path is its reference, bit for bit
            np.testing.assert_array_equal(np.asarray(fused, np.float32),
                                          np.asarray(want, np.float32))
        assert_admissible(self, x[0], norm.weight[...], cos, sin, fused[0], f"seed {seed}")
        with mock.patch.object(ffi, "rms_norm_rope", side_effect=AssertionError("called")):
            two_step = rope.norm_rope(norm, x, cos, sin, backend="reference")
        np.testing.assert_array_equal(np.asarray(two_step, np.float32),
                                      np.asarray(apply_rope(norm(x), cos, sin), np.float32))

    @parameterized.named_parameters(
        dict(testcase_name="head_dim_128", d=128, dtype=jnp.bfloat16, why="head_dim=128"),
        dict(testcase_name="float32", d=256, dtype=jnp.float32, why="dtype float32"),
    )
    def test_unsupported_calls_stay_unfused_and_say_why(self, d, dtype, why):
        _registry.reset_fallback_log()
        x, _, cos, sin = norm_rope_inputs((1, 5, 2, 256), seed=fresh_seed())
        x, cos, sin = x[..., :d].astype(dtype), cos[:, :d].astype(dtype), sin[:, :d].astype(dtype)
        norm = nn.RMSNorm(d, eps=EPS)
        with mock.patch.object(ffi, "rms_norm_rope", side_effect=AssertionError("called")):
            with self.assertLogs("jax_mila", logging.INFO) as logs:
                got = rope.norm_rope(norm, x, cos, sin, backend="mila")
                rope.norm_rope(norm, x[:, :3], cos[:3], sin[:3], backend="mila")
        lines = [line for line in logs.output if "jax_mila.rms_norm_rope falls back" in line]
        self.assertLen(lines, 1, logs.output)
        self.assertIn(why, lines[0])
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(apply_rope(norm(x), cos, sin), np.float32))

    def test_kernel_backends_fuse_q_and_k_not_v(self):
        seed = fresh_seed()
        model = kernel_dims_model("auto", seed)
        ids = jax.random.randint(jax.random.key(seed), (2, 7), 3, 61, jnp.int32)
        with mock.patch.object(ffi, "rms_norm_rope", wraps=ffi.rms_norm_rope) as fused:
            logits = model(ids)
        # q and k of the three layers with K/V, q of the shared one.
        self.assertEqual(fused.call_count, 3 * 2 + 1)
        dims = sorted(call.args[0].shape[-1] for call in fused.call_args_list)
        self.assertEqual(dims, [256] * 4 + [512] * 3)
        ref = kernel_dims_model("reference", seed)
        with mock.patch.object(ffi, "rms_norm_rope", side_effect=AssertionError("called")):
            want = ref(ids)
        # bf16 noise (the op's single rounding, moved through 4 layers), not a wrong layer.
        self.assertLess(rel_err(logits, want), 0.05, f"seed {seed}")

    def test_prefill_chunks_and_decode(self):
        seed = fresh_seed()
        model = kernel_dims_model("auto", seed)
        ids = jax.random.randint(jax.random.key(seed), (1, 11), 3, 61, jnp.int32)
        with mock.patch.object(ffi, "rms_norm_rope", wraps=ffi.rms_norm_rope) as fused:
            one, cache = gemma4.prefill(model, ids, max_cache_len=16)
            chunked, _ = gemma4.prefill(model, ids, chunk_size=4, max_cache_len=16)
            new = gemma4.generate(model, ids, 3, cache=cache, logits=one)
        self.assertGreater(fused.call_count, 0)
        self.assertEqual(new.shape, (1, 3))
        self.assertLess(rel_err(chunked, one), 0.05, f"seed {seed}")

    def test_context_and_tensor_parallel_paths(self):
        if len(jax.devices("cpu")) < 4:
            self.skipTest("needs 4 CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
        seed = fresh_seed()
        model = kernel_dims_model("auto", seed)
        ids = jax.random.randint(jax.random.key(seed), (1, 12), 3, 61, jnp.int32)
        want = model(ids)
        mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("seq", "heads"))
        with mock.patch.object(ffi, "rms_norm_rope", wraps=ffi.rms_norm_rope) as fused:
            full = gemma4.forward(model, ids, mesh, heads_axis="heads", seq_axis="seq")
            one, _ = gemma4.prefill(model, ids, chunk_size=4, max_cache_len=16)
            chunks, _ = gemma4.prefill(model, ids, chunk_size=4, max_cache_len=16, mesh=mesh,
                                       seq_segments=2)
        self.assertGreater(fused.call_count, 0)
        self.assertLess(rel_err(full, want), 0.05, f"seed {seed}")
        self.assertLess(rel_err(chunks, one), 0.05, f"seed {seed}")


class KernelTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        testing.skip_unless_kernel(self, "rms_norm_rope")

    def check(self, x, w, cos, sin, what, eps=EPS):
        fn = functools.partial(ffi.rms_norm_rope, eps=eps)
        got = testing.call_with_poisoned_outputs(fn, x, w, cos, sin)
        assert_admissible(self, x, w, cos, sin, got, what, eps)
        return got

    @parameterized.named_parameters(
        *ODD_SHAPES,
        # More rows than one block (16 of D=256, 8 of D=512) and a partial last block; the
        # 12B's sliding-layer q at 4096 tokens.
        dict(testcase_name="partial_last_block_d256", shape=(37, 3, 256)),
        dict(testcase_name="partial_last_block_d512", shape=(37, 3, 512)),
        dict(testcase_name="gemma_12b_q", shape=(4096, 16, 256)),
        dict(testcase_name="gemma_12b_global_k", shape=(1, 4096, 1, 512)),
    )
    def test_matches_oracle_with_poisoned_outputs(self, shape):
        seed = fresh_seed()
        for tables in ("random", "gemma"):
            x, w, cos, sin = norm_rope_inputs(shape, seed=seed, tables=tables)
            x = with_zero_row(x)
            got = self.check(x, w, cos, sin, f"seed {seed} {tables}")
            first = np.asarray(got, np.float32).reshape(-1, shape[-1])[0]
            np.testing.assert_array_equal(first, 0.0, f"seed {seed}: the zero row")

    @parameterized.parameters(256, 512)
    def test_large_magnitudes_and_f32_weights(self, d):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((97, 8, d), seed=seed, x_scale=1e4,
                                          weight_dtype=jnp.float32)
        self.check(x, w * (1 + 2.0**-12), cos, sin, f"seed {seed}")

    def test_eps_is_the_attribute(self):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((97, 4, 256), seed=seed, x_scale=1e-3)
        self.check(x, w, cos, sin, f"seed {seed} eps 1e-5", eps=1e-5)

    def test_mostly_the_references_bits(self):
        # Only near-ties of n's bf16 rounding may differ (the sum's order, the rsqrt).
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((1024, 16, 256), seed=seed, tables="gemma")
        got = jax.jit(functools.partial(ffi.rms_norm_rope, eps=EPS))(x, w, cos, sin)
        want = reference.rms_norm_rope(x, w, cos, sin, eps=EPS)
        same = np.mean(np.asarray(got, np.float32) == np.asarray(want, np.float32))
        self.assertGreater(same, 0.99, f"seed {seed}")

    def test_vmap(self):
        seed = fresh_seed()
        x, w, cos, sin = norm_rope_inputs((3, 7, 2, 512), seed=seed)
        got = jax.vmap(lambda x: ffi.rms_norm_rope(x, w, cos, sin, eps=EPS))(x)
        assert_admissible(self, x, w, cos, sin, got, f"seed {seed}")

    @parameterized.named_parameters(
        dict(testcase_name="head_dim", x=(4, 2, 128), w=128, cos=(4, 128),
             pattern=r"x: head dim D=128"),
        dict(testcase_name="rank", x=(4, 256), w=256, cos=(4, 256),
             pattern="x: expected rank >= 3"),
        dict(testcase_name="weight_shape", x=(4, 2, 256), w=512, cos=(4, 256),
             pattern=r"weight: shape \[512\] must be \[256\]"),
        dict(testcase_name="cos_shape", x=(4, 2, 256), w=256, cos=(5, 256),
             pattern=r"cos: shape \[5, 256\] must be \[4, 256\]"),
        dict(testcase_name="eps", x=(4, 2, 256), w=256, cos=(4, 256), eps=-1.0,
             pattern=r"eps: -1.* > 0"),
    )
    def test_cpp_rejects_what_python_would(self, x, w, cos, pattern, eps=EPS):
        # Bypass the wrapper's checks: the handler must answer with an error, not crash.
        x = jnp.zeros(x, jnp.bfloat16)
        call = jax.ffi.ffi_call(ffi.norm_rope.TARGET, _struct(x.shape))
        args = (x, jnp.ones((w,), jnp.float32), jnp.zeros(cos, jnp.bfloat16),
                jnp.zeros(cos, jnp.bfloat16))
        with self.assertRaisesRegex(Exception, "INVALID_ARGUMENT.*rms_norm_rope.*" + pattern):
            jax.block_until_ready(jax.jit(lambda *a: call(*a, eps=np.float32(eps)))(*args))


if __name__ == "__main__":
    absltest.main()
