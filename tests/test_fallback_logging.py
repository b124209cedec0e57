"""Every op that does not run on its kernel says why, once per (op, reason), at trace time.

On this CPU machine the kernels never run, so the GPU-only reasons (kill switch, kernel not
built, compute capability) are reached by patching the registry's view of the devices; the
calls still lower on CPU (lax.platform_dependent's default branch).
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

from jax_mila import ffi, nn
from jax_mila.ffi import _registry
from jax_mila.gemma4 import fidelity
from jax_mila.gemma4.model import Gemma4ForCausalLM

SEED = int.from_bytes(os.urandom(4), "little")


def _fallback_lines(output, op=None):
    return [line for line in output if "falls back to" in line and (op is None or f"jax_mila.{op} " in line)]


def _tiny_model(backend="mila", quantize="w4a8", seed=SEED):
    cfg = fidelity.model_config("tiny")
    return Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16, backend=backend, quantize=quantize,
                             rngs=nnx.Rngs(seed))


class ModelFallbackLoggingTest(parameterized.TestCase):
    """Runs as if the process had no GPU (also on a GPU machine), so the expected reasons are
    the same everywhere."""

    def setUp(self):
        super().setUp()
        _registry.reset_fallback_log()
        self.enter_context(mock.patch.object(_registry, "cuda_capabilities", return_value=()))

    def test_tiny_model_logs_each_fallback_once_not_per_layer_or_call(self):
        model = _tiny_model()
        ids = jax.random.randint(jax.random.key(SEED), (2, 11), 3, 2048, jnp.int32)
        with self.assertLogs("jax_mila", logging.INFO) as logs:
            model(ids)                       # eager: every layer traces its ops
            jax.jit(lambda i: model(i))(ids[:, :7])   # another trace, another length
            model(ids[:1])
        lines = _fallback_lines(logs.output)
        msg = f"seed {SEED}: {lines}"
        self.assertLen(lines, len(set(lines)), msg)  # no (op, reason) twice
        # The embedded config's two head dims have no attention kernel: one line each, though
        # there are 4 + 2 layers of them and three traces; the W4A8 ops fall back because
        # there is no GPU here, one line per op (quantize_geglu: the bf16 MLPs quantize
        # down_proj's input in one op; add_rms_norm_quantize: the layers' norms before q/k/v
        # and gate/up).
        self.assertLen(_fallback_lines(lines, "flash_attention"), 2, msg)
        self.assertTrue(any("head_dim=32" in line for line in lines), msg)
        self.assertTrue(any("head_dim=64" in line for line in lines), msg)
        # The same two head dims keep the q/k norms and RoPE unfused (no rms_norm_rope kernel):
        # one line each, not one per layer or per q and k.
        norm_rope = _fallback_lines(lines, "rms_norm_rope")
        self.assertLen(norm_rope, 2, msg)
        self.assertTrue(all("the unfused norm and RoPE" in line for line in norm_rope), msg)
        for op in ("quantize_activations", "quantize_geglu", "add_rms_norm_quantize",
                   "w4a8_matmul"):
            self.assertLen(_fallback_lines(lines, op), 1, msg)
            self.assertIn("no CUDA device", _fallback_lines(lines, op)[0], msg)
        # Logged at INFO on a machine without GPUs (WARNING where kernels were expected).
        self.assertTrue(all(line.startswith("INFO:") for line in lines), msg)

    def test_reference_backend_logs_no_fallback(self):
        model = _tiny_model(backend="reference")
        ids = jax.random.randint(jax.random.key(SEED), (1, 5), 3, 2048, jnp.int32)
        with self.assertLogs("jax_mila", logging.INFO) as logs:
            model(ids)
            logging.getLogger("jax_mila").info("marker")
        self.assertEqual(_fallback_lines(logs.output), [], f"seed {SEED}")

    @parameterized.named_parameters(
        ("head_dim", dict(d=128), "head_dim=128"),
        ("dtype", dict(dtype=jnp.float16), "dtype float16"),
        ("groups", dict(hq=34, hkv=2), "34 query heads over 2 KV heads"))
    def test_attention_config_fallbacks_name_the_reason_and_match_the_reference(self, cfg, why):
        d, dtype = cfg.get("d", 256), cfg.get("dtype", jnp.bfloat16)
        hq, hkv, window = cfg.get("hq", 4), cfg.get("hkv", 2), cfg.get("window", None)
        ks = jax.random.split(jax.random.key(SEED), 3)
        q = jax.random.normal(ks[0], (1, 5, hq, d), dtype)
        k, v = (jax.random.normal(kk, (1, 5, hkv, d), dtype) for kk in ks[1:])
        attn = nn.Attention(scale=1.0, backend="mila")
        with mock.patch.object(ffi, "flash_attention", side_effect=AssertionError("called")):
            with self.assertLogs("jax_mila", logging.INFO) as logs:
                got = attn(q, k, v, window=window)
                attn(q[:, :3], k[:, :3], v[:, :3], window=window)  # other length: same reason
        lines = _fallback_lines(logs.output, "flash_attention")
        self.assertLen(lines, 1, f"seed {SEED}: {logs.output}")
        self.assertIn(why, lines[0])
        ref = nn.Attention(scale=1.0, backend="reference")(q, k, v, window=window)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))

    def test_ffi_still_raises_for_unsupported_input(self):
        q = jnp.zeros((1, 4, 2, 64), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "head_dim=64 is not supported"):
            ffi.flash_attention(q, q, q, causal=True)
        with self.assertRaisesRegex(ValueError, "window"):
            ffi.flash_attention(jnp.zeros((1, 4, 2, 256), jnp.bfloat16),
                                *(jnp.zeros((1, 4, 2, 256), jnp.bfloat16),) * 2, window=0,
                                causal=True)


class DispatchFallbackLoggingTest(parameterized.TestCase):
    """The ffi layer's reasons, with the registry pretending to see GPUs."""

    def setUp(self):
        super().setUp()
        _registry.reset_fallback_log()
        self.enter_context(mock.patch.dict(os.environ, {_registry.DISABLE_ENV: ""}))

    def _qkv(self, d):
        ks = jax.random.split(jax.random.key(SEED), 3)
        return [jax.random.normal(kk, (1, 6, 2, d), jnp.bfloat16) for kk in ks]

    def _run_twice(self, d=256):
        q, k, v = self._qkv(d)
        with self.assertLogs("jax_mila", logging.INFO) as logs:
            a = ffi.flash_attention(q, k, v, causal=True, window=3)
            jax.jit(lambda *x: ffi.flash_attention(*x, causal=True, window=3))(q, k, v)
            logging.getLogger("jax_mila").info("marker")
        return a, _fallback_lines(logs.output, "flash_attention")

    def test_no_gpu(self):
        with mock.patch.object(_registry, "cuda_capabilities", return_value=()):
            _, lines = self._run_twice()
        self.assertLen(lines, 1)
        self.assertIn("no CUDA device", lines[0])

    def test_kill_switch_is_a_warning_on_a_gpu(self):
        os.environ[_registry.DISABLE_ENV] = "flash_attention"
        with mock.patch.object(_registry, "cuda_capabilities", return_value=((9, 0),)):
            _, lines = self._run_twice()
        self.assertLen(lines, 1)
        self.assertTrue(lines[0].startswith("WARNING:"), lines)
        self.assertIn(f"disabled by {_registry.DISABLE_ENV}", lines[0])

    def test_kernel_not_built(self):
        not_built = _registry.OpStatus("flash_attention", False, "this build has no kernel for it")
        with mock.patch.object(_registry, "cuda_capabilities", return_value=((9, 0),)), \
                mock.patch.object(_registry, "status", return_value=not_built):
            _, lines = self._run_twice()
        self.assertLen(lines, 1)
        self.assertIn("this build has no kernel for it", lines[0])

    def test_d512_on_a_gpu_without_the_shared_memory(self):
        built = _registry.OpStatus("flash_attention", True, "built")
        with mock.patch.object(_registry, "cuda_capabilities", return_value=((8, 9),)), \
                mock.patch.object(_registry, "status", return_value=built):
            out, lines = self._run_twice(d=512)
        self.assertLen(lines, 1)
        self.assertIn("D=512 kernel needs", lines[0])
        self.assertIn("(8, 9)", lines[0])
        q, k, v = self._qkv(512)
        ref = ffi.flash_attention(q, k, v, causal=True, window=3)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))

    def test_each_op_and_reason_is_its_own_line(self):
        self.assertTrue(_registry.log_fallback("w4a8_matmul", "r1"))
        self.assertFalse(_registry.log_fallback("w4a8_matmul", "r1"))
        self.assertTrue(_registry.log_fallback("w4a8_matmul", "r2"))
        self.assertTrue(_registry.log_fallback("flash_attention", "r1"))


if __name__ == "__main__":
    absltest.main()
