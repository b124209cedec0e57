"""The op registry, the kill switch and the selftest, on whatever device is present."""

import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest

import jax_mila
from jax_mila import _selftest, ffi
from jax_mila.ffi import _registry
import testing  # tests/testing.py


class RegistryTest(absltest.TestCase):
    def test_available_reports_every_op_with_a_reason(self):
        status = ffi.available()
        self.assertEqual(set(status), set(ffi.OPS))
        for op, st in status.items():
            self.assertEqual(st.op, op)
            self.assertTrue(st.reason)

    def test_kill_switch_all(self):
        with mock.patch.dict(os.environ, {ffi.DISABLE_ENV: "all"}):
            for st in ffi.available().values():
                self.assertFalse(st.kernel)
                self.assertIn(ffi.DISABLE_ENV, st.reason)

    def test_kill_switch_named_op_leaves_the_others(self):
        with mock.patch.dict(os.environ, {ffi.DISABLE_ENV: " quantize_activations , "}):
            self.assertFalse(ffi.status("quantize_activations").kernel)
            self.assertNotIn(ffi.DISABLE_ENV, ffi.status("flash_attention").reason)

    def test_kill_switch_rejects_unknown_names(self):
        with mock.patch.dict(os.environ, {ffi.DISABLE_ENV: "quantise"}):
            with self.assertRaisesRegex(ValueError, "unknown ops \\['quantise'\\]"):
                ffi.available()

    def test_disabled_op_lowers_without_custom_call(self):
        x = jnp.ones((4, 32), jnp.bfloat16)
        with mock.patch.dict(os.environ, {ffi.DISABLE_ENV: "quantize_activations"}):
            hlo = jax.jit(ffi.quantize_activations).lower(x).as_text()
        self.assertNotIn("jax_mila_quantize_activations", hlo)

    def test_unknown_op_and_target(self):
        with self.assertRaisesRegex(ValueError, "unknown op"):
            ffi.status("gemm")
        with self.assertRaisesRegex(ValueError, "not a target"):
            ffi.status("flash_attention", "jax_mila_quantize_activations")

    def test_registration_happens_once(self):
        first = _registry._registered_targets()
        self.assertIs(first, _registry._registered_targets())


class PackageTest(absltest.TestCase):
    def test_import_exposes_the_subpackages_lazily(self):
        """BUILD.md's install check, `import jax_mila; jax_mila.ffi.available()`, in a fresh
        process: `import jax_mila` alone imports neither jax nor the CUDA extension."""
        code = ("import sys, jax_mila\n"
                "assert 'jax' not in sys.modules, 'import jax_mila imported jax'\n"
                "ffi = jax_mila.ffi\n"
                "assert 'jax_mila._jax_mila_cuda' not in sys.modules, 'extension loaded on import'\n"
                "assert set(ffi.available()) == set(ffi.OPS)\n"
                "assert jax_mila.gemma4.prefill and jax_mila.reference and jax_mila.quant and jax_mila.nn\n"
                "assert not hasattr(jax_mila, 'nope')\n")
        root = os.path.dirname(os.path.dirname(os.path.abspath(jax_mila.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, run.stderr)


class SelftestTest(absltest.TestCase):
    def test_selftest_reports_every_op(self):
        results = jax_mila.selftest(verbose=False)
        ops = {r.op.split("[")[0] for r in results}
        self.assertEqual(ops, set(ffi.OPS))
        if not testing.has_cuda():
            self.assertTrue(all(r.outcome == "REFERENCE ONLY" for r in results))
        else:
            self.assertFalse([r for r in results if r.outcome in ("MISMATCH", "ERROR")])

    def test_selftest_checks_the_hopper_attention_kernels_apart(self):
        # On Hopper ffi.flash_attention routes to the sm90 kernels: the selftest checks those
        # and, with the routing pinned, the portable ones, each under its own name.
        with mock.patch.object(_registry, "cuda_capabilities", lambda: ((9, 0),)):
            targets = [t for t, _ in _selftest._checks()["flash_attention"]]
        self.assertEqual(targets, ["jax_mila_flash_attention_d256",
                                   "jax_mila_flash_attention_d256_sm90",
                                   "jax_mila_flash_attention_d512",
                                   "jax_mila_flash_attention_d512_sm90",
                                   "jax_mila_flash_attention_d512_sm90_rotary_keys"])
        with mock.patch.object(_registry, "cuda_capabilities", lambda: ((8, 9),)):
            targets = [t for t, _ in _selftest._checks()["flash_attention"]]
        self.assertEqual(targets, ["jax_mila_flash_attention_d256", "jax_mila_flash_attention_d512"])

    def test_selftest_refuses_a_kernel_the_routing_does_not_reach(self):
        # A check pinned to the sm90 kernel where routing cannot pick it (not built here, or
        # not a cc 9.0 device) must say so instead of checking another kernel under its name.
        from jax_mila.ffi import attention

        with mock.patch.object(attention, "_registered_targets", lambda: frozenset()):
            problem = _selftest._attention_case(256, attention.D256_SM90_TARGET)()
        self.assertIn("routes this call to jax_mila_flash_attention_d256,", problem)


if __name__ == "__main__":
    absltest.main()
