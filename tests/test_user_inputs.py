"""Inputs a user really sends: environment knobs, nn.Attention's arguments, token ids, a GPU
that jax does not use, converts that are killed or fail, and a config whose MXFP4 format
version is not the tensors' (CPU; the embedded checkpoint; no transformers needed)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from safetensors import safe_open
from safetensors.flax import load_file, save_file

from jax_mila import _env, _selftest, ffi, gemma4, nn
from jax_mila.engine import plan as gemma4_plan
from jax_mila.gemma4 import mxfp4_names
from jax_mila.gemma4.convert import STAGING_TAG, convert
from jax_mila.gemma4.loader import CheckpointError
from jax_mila.gemma4.model import check_input_ids

EMBEDDED = str(gemma4.embedded_checkpoint())
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env(**values):
    """os.environ without any JAX_MILA_* variable, plus ``values``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_MILA_")}
    env.update(values)
    return mock.patch.dict(os.environ, env, clear=True)


class EnvKnobTest(parameterized.TestCase):

    def test_disable_names_variable_value_and_the_ops(self):
        with _clean_env(JAX_MILA_DISABLE="flash"), self.assertRaisesRegex(
                _env.EnvError, r"JAX_MILA_DISABLE='flash' names unknown ops \['flash'\] "
                               r"\(supported: a comma-separated list of \[.*'w4a8_matmul'"):
            ffi._registry.disabled_ops()
        with _clean_env():
            self.assertEqual(ffi._registry.disabled_ops(), frozenset())
        with _clean_env(JAX_MILA_DISABLE=" w4a8_matmul , all"):
            self.assertEqual(ffi._registry.disabled_ops(), frozenset(ffi.OPS))

    def test_every_knob_read_in_the_package_is_known(self):
        # A JAX_MILA_* name that appears in the package or the kernels but not in _env.KNOBS
        # would be read without a check.
        read = set()
        for root in ("jax_mila", "csrc"):
            for folder, _, files in os.walk(os.path.join(REPO, root)):
                for f in files:
                    if f.endswith((".py", ".cu", ".cc", ".h", ".cuh")):
                        with open(os.path.join(folder, f)) as fh:
                            text = fh.read()
                        read |= set(re.findall(r"getenv\(\"(JAX_MILA_\w+)\"\)", text))
                        read |= set(re.findall(r"environ\.get\(\"(JAX_MILA_\w+)\"", text))
                        read |= set(re.findall(r"_ENV = \"(JAX_MILA_\w+)\"", text))
        self.assertIn("JAX_MILA_DISABLE", read)  # the scan sees the registry's knob
        self.assertEqual(read - set(_env.KNOBS), set())


class AttentionArgumentsTest(parameterized.TestCase):

    def _qkv(self, hq=4, hkv=2, d=16, dtype=jnp.float32):
        key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
        k1, k2 = jax.random.split(key)
        return (jax.random.normal(k1, (1, 7, hq, d), dtype),
                jax.random.normal(k2, (1, 7, hkv, d), dtype),
                jax.random.normal(k2, (1, 7, hkv, d), dtype))

    @parameterized.product(backend=("auto", "reference"), window=(0, -3, 2.0, True))
    def test_window_below_one_is_refused(self, backend, window):
        q, k, v = self._qkv()
        with self.assertRaisesRegex(ValueError, r"^jax_mila\.nn\.Attention: window: must be None "
                                                rf"or an int in \[1, 2\^31 - 1\], got {window!r}"):
            nn.Attention(scale=1.0, backend=backend)(q, k, v, window=window)

    @parameterized.product(backend=("auto", "reference"), heads=((3, 2), (4, 3), (2, 4)))
    def test_query_heads_not_a_multiple_of_kv_heads_is_refused(self, backend, heads):
        q, k, v = self._qkv(*heads)
        with self.assertRaisesRegex(ValueError, rf"nn\.Attention: k: Hq={heads[0]} query heads "
                                                rf"over Hkv={heads[1]} KV heads is not supported "
                                                r"\(Hq must be a multiple of Hkv\)"):
            nn.Attention(scale=1.0, backend=backend)(q, k, v)

    def test_other_arguments_are_checked_as_the_ffi_checks_them(self):
        q, k, v = self._qkv()
        attn = nn.Attention(scale=1.0)
        for call, pattern in (
                (lambda: attn(q[0], k, v), r"q: expected rank 4"),
                (lambda: attn(q, k, v[:, :3]), r"v: shape \[1, 3, 2, 16\] must equal k's"),
                (lambda: attn(q, k, v, q_offset=1.5), r"q_offset: must be an integer scalar"),
                (lambda: attn(q, k, v, kv_offset=np.int64(2**31)), r"kv_offset: 2147483648 is out of range"),
                (lambda: nn.Attention(scale=float("nan"))(q, k, v), r"scale: must be None or a number")):
            with self.assertRaisesRegex(ValueError, r"jax_mila\.nn\.Attention: " + pattern):
                call()

    def test_valid_calls_still_match_the_reference(self):
        q, k, v = self._qkv(hq=6, hkv=2)   # 3 query heads per KV head, window 1
        got = nn.Attention(scale=0.5)(q, k, v, window=1, q_offset=2, kv_offset=2)
        # window 1: each query sees only its own key -> the output is that key's value.
        want = jnp.repeat(v, 3, axis=2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


class TokenIdsTest(absltest.TestCase):

    def test_empty_batch_is_refused_before_any_device_work(self):
        model = gemma4.from_pretrained(EMBEDDED, dtype=jnp.float32)
        for fn in (gemma4.prefill, gemma4.forward, lambda m, i: gemma4.generate(m, i, 2)):
            with self.assertRaisesRegex(ValueError, r"input_ids: an empty batch is not supported "
                                                    r"\(B >= 1\), got shape \[0, 5\]"):
                fn(model, np.zeros((0, 5), np.int32))

    def test_check_input_ids_takes_a_token_vector(self):
        got = check_input_ids(np.array([3, 60]), 61, name="token", rank=1)
        self.assertEqual((got.dtype, got.shape), (jnp.int32, (2,)))
        for ids, pattern in ((np.array([3, 61]), r"token: \[61\] outside the vocabulary \[0, 61\)"),
                             (jnp.array([-2, 5]), r"token: \[-2\] outside the vocabulary"),
                             (np.zeros((0,), np.int32), r"token: an empty batch"),
                             (np.array([[3]]), r"token must be int32 \[B\], got shape \[1, 1\]"),
                             (np.array([1.0]), r"token must be integer token ids, got dtype float")):
            with self.assertRaisesRegex(ValueError, pattern):
                check_input_ids(ids, 61, name="token", rank=1)


class EngineArgumentsTest(absltest.TestCase):
    """decode / prefill / generate: counts that must be ints >= 1 are refused, not coerced;
    decode's token is a checked [B] vector; a chunk longer than the prompt is not padded."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model = gemma4.from_pretrained(EMBEDDED, dtype=jnp.float32)
        cls.ids = np.random.default_rng(0).integers(
            0, cls.model.config.vocab_size, (1, 10)).astype(np.int32)

    def _cache(self, extra=8):
        return gemma4.prefill(self.model, self.ids, max_cache_len=self.ids.shape[1] + extra)

    def test_decode_refuses_bad_steps_and_tokens(self):
        vocab = self.model.config.vocab_size
        for steps, pattern in ((-3, r"steps must be an int >= 1, got -3"),
                               (0, r"steps must be an int >= 1, got 0"),
                               (2.5, r"steps must be an int >= 1, got 2.5"),
                               (True, r"steps must be an int >= 1, got True")):
            _, cache = self._cache()
            with self.assertRaisesRegex(ValueError, pattern):
                gemma4.decode(self.model, np.array([3], np.int32), cache, steps)
        for token, pattern in ((np.array([vocab], np.int32),
                                rf"token: \[{vocab}\] outside the vocabulary \[0, {vocab}\)"),
                               (np.array([[3]], np.int32), r"token must be int32 \[B\]"),
                               (np.array([3, 4], np.int32), r"token has batch 2, the cache 1")):
            _, cache = self._cache()
            with self.assertRaisesRegex(ValueError, pattern):
                gemma4.decode(self.model, token, cache, 2)

    def test_counts_are_not_coerced(self):
        for kwargs, pattern in ((dict(chunk_size=2.5), r"chunk_size must be an int >= 1 or None, "
                                                       r"got 2.5"),
                                (dict(chunk_size="4"), r"chunk_size .* got '4'"),
                                (dict(chunk_size=True), r"chunk_size .* got True"),
                                (dict(chunk_size=0), r"chunk_size .* got 0"),
                                (dict(max_cache_len=12.0), r"max_cache_len must be an int >= 1")):
            with self.assertRaisesRegex(ValueError, pattern):
                gemma4.prefill(self.model, self.ids, **kwargs)
        with self.assertRaisesRegex(ValueError, r"max_new_tokens must be an int >= 1, got 1.5"):
            gemma4.generate(self.model, self.ids, 1.5)
        gemma4.prefill(self.model, self.ids, chunk_size=np.int64(4))  # a NumPy int is an int

    def test_a_chunk_longer_than_the_prompt_is_not_padded(self):
        # 10 tokens with chunk_size 100000 run as one chunk of 10 (padding to the chunk would
        # compute 100000 positions); the result is the default path's.
        spans = []
        real = gemma4_plan.chunk_spans
        with mock.patch.object(gemma4_plan, "chunk_spans",
                               side_effect=lambda *a, **k: spans.append(real(*a, **k)) or spans[-1]):
            got, cache = gemma4.prefill(self.model, self.ids, chunk_size=100_000)
        self.assertEqual(spans, [[10]])
        self.assertEqual(int(cache.max_len), 10)
        want, _ = gemma4.prefill(self.model, self.ids)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


class GpuInstallHintTest(absltest.TestCase):

    def _hint(self, *, evidence="/proc/driver/nvidia/version", gpus=(), versions=None, env=None,
              cuda="13.0.48"):
        versions = {"jaxlib": jax.__version__, **(versions or {})}
        with mock.patch.object(_selftest, "nvidia_gpu_evidence", return_value=evidence), \
                mock.patch.object(_selftest, "_jax_gpus", return_value=list(gpus)), \
                mock.patch.object(_selftest, "_version", side_effect=versions.get), \
                mock.patch("jax_mila.ffi._registry.build_info", return_value={"cuda_version": cuda}), \
                mock.patch.dict(os.environ, env or {}):  # restores what the loop below pops
            for name in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"):
                if name not in (env or {}):
                    os.environ.pop(name, None)
            return _selftest.gpu_install_hint()

    def test_no_gpu_or_a_used_gpu_gives_none(self):
        self.assertIsNone(self._hint(evidence=None))
        self.assertIsNone(self._hint(gpus=["cuda:0"]))

    def test_cpu_only_jax_gets_the_install_command(self):
        hint = self._hint()
        self.assertIn("an NVIDIA GPU is present (/proc/driver/nvidia/version) but jax", hint)
        self.assertIn("no jax CUDA plugin is installed", hint)
        self.assertIn(f'python3 -m pip install "jax[cuda13]=={jax.__version__}"', hint)
        hint = self._hint(cuda="12.8.93")
        self.assertIn(f'"jax[cuda12]=={jax.__version__}"', hint)

    def test_mismatched_plugin_and_environment(self):
        hint = self._hint(versions={"jax-cuda13-plugin": "0.0.1"})
        self.assertIn("jax-cuda13-plugin 0.0.1 does not match jaxlib", hint)
        hint = self._hint(versions={"jax-cuda13-plugin": jax.__version__})
        self.assertIn("its backend did not start", hint)
        self.assertIn("update the NVIDIA driver", hint)
        self.assertIn("Fix: unset JAX_PLATFORMS", self._hint(env={"JAX_PLATFORMS": "cpu"}))
        self.assertIn("Fix: unset CUDA_VISIBLE_DEVICES",
                      self._hint(env={"CUDA_VISIBLE_DEVICES": "-1"}))

    def test_evidence_is_a_driver_file_or_nvidia_smi(self):
        with mock.patch.object(_selftest.os.path, "exists", return_value=False), \
                mock.patch.object(_selftest.shutil, "which", return_value="/usr/bin/nvidia-smi"):
            self.assertEqual(_selftest.nvidia_gpu_evidence(), "/usr/bin/nvidia-smi on PATH")
        with mock.patch.object(_selftest.os.path, "exists", return_value=False), \
                mock.patch.object(_selftest.shutil, "which", return_value=None):
            self.assertIsNone(_selftest.nvidia_gpu_evidence())


def _ids():
    return np.asarray([[2, 7, 11, 100, 5, 9, 33, 4]], np.int32)


class ConvertTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def _leftovers(self, dst):
        parent, name = os.path.split(dst)
        return sorted(e for e in os.listdir(parent) if e.startswith(f".{name}{STAGING_TAG}"))

    def test_killed_convert_leaves_no_checkpoint_and_the_next_cleans_up(self):
        dst = os.path.join(self.tmp, "out")
        # A real SIGKILL once the first shard is written (no exception handler runs).
        script = textwrap.dedent(f"""
            import os, signal
            from jax_mila.gemma4 import convert as c
            flush = c._ShardWriter.flush
            def dying_flush(self):
                flush(self)
                if self.shards:
                    os.kill(os.getpid(), signal.SIGKILL)
            c._ShardWriter.flush = dying_flush
            c.convert({EMBEDDED!r}, {dst!r}, shard_bytes=64 << 10, progress=False)
        """)
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
        self.assertEqual(proc.returncode, -signal.SIGKILL, proc.stderr.decode()[-2000:])
        self.assertFalse(os.path.exists(dst))   # nothing half-written where the checkpoint goes
        self.assertLen(self._leftovers(dst), 1)
        # An older convert's hidden partial shard inside dst is cleaned too.
        os.makedirs(dst)
        with open(os.path.join(dst, ".jax_mila_shard_00000.safetensors"), "wb") as f:
            f.write(b"partial")
        convert(EMBEDDED, dst, progress=False)
        self.assertEqual(self._leftovers(dst), [])
        self.assertEqual(sorted(os.listdir(dst)), ["config.json", "model.safetensors", "tokenizer.json"])
        got = gemma4.forward(gemma4.from_pretrained(dst, dtype=jnp.float32, quantize="w4a8"), _ids())
        want = gemma4.forward(gemma4.from_pretrained(EMBEDDED, dtype=jnp.float32, quantize="w4a8"), _ids())
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_failed_convert_leaves_nothing(self):
        src = os.path.join(self.tmp, "src")
        os.makedirs(src)
        tensors = load_file(os.path.join(EMBEDDED, "model.safetensors"))
        name = "model.layers.4.post_feedforward_layernorm.weight"   # a dense, copied tensor
        tensors[name] = tensors[name].at[3].set(jnp.nan)
        save_file(tensors, os.path.join(src, "model.safetensors"))
        with open(os.path.join(EMBEDDED, "config.json")) as f, \
                open(os.path.join(src, "config.json"), "w") as g:
            g.write(f.read())
        dst = os.path.join(self.tmp, "out")
        for quantize in ("w4a8", None):
            with self.subTest(quantize=quantize), self.assertRaisesRegex(
                    CheckpointError, rf"tensor {re.escape(name)} contains 1 NaN/inf value"):
                convert(src, dst, quantize=quantize, shard_bytes=64 << 10, progress=False)
            self.assertFalse(os.path.exists(dst))
            self.assertEqual(self._leftovers(dst), [])

    def test_existing_folder_keeps_its_files(self):
        dst = os.path.join(self.tmp, "out")
        os.makedirs(dst)
        with open(os.path.join(dst, "README"), "w") as f:
            f.write("mine")
        # Shards a convert killed while moving its files in left beside them.
        with open(os.path.join(dst, "model-00007-of-00009.safetensors"), "wb") as f:
            f.write(b"stale")
        summary = convert(EMBEDDED, dst, shard_bytes=64 << 10, progress=False)
        names = sorted(os.listdir(dst))
        self.assertIn("README", names)
        self.assertNotIn("model-00007-of-00009.safetensors", names)
        self.assertEqual(sorted(summary["files"]), sorted(
            os.path.join(dst, n) for n in names if n.startswith("model-")))
        self.assertEqual(self._leftovers(dst), [])
        gemma4.from_pretrained(dst, quantize="w4a8")
        with self.assertRaisesRegex(CheckpointError, "refusing to overwrite"):
            convert(EMBEDDED, dst, progress=False)


class FormatVersionTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tmp = tempfile.TemporaryDirectory()
        cls.converted = os.path.join(cls._tmp.name, "converted")
        convert(EMBEDDED, cls.converted, progress=False)

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()
        super().tearDownClass()

    def _with_config(self, d, change):
        for name in os.listdir(self.converted):
            with open(os.path.join(self.converted, name), "rb") as f, \
                    open(os.path.join(d, name), "wb") as g:
                g.write(f.read())
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        change(config)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)

    def test_converted_files_record_the_version(self):
        with safe_open(os.path.join(self.converted, "model.safetensors"), "flax") as f:
            self.assertEqual(f.metadata()[mxfp4_names.METADATA_KEY], "2")
        dense = os.path.join(self._tmp.name, "dense")
        convert(EMBEDDED, dense, quantize=None, progress=False)
        with safe_open(os.path.join(dense, "model.safetensors"), "flax") as f:
            self.assertNotIn(mxfp4_names.METADATA_KEY, f.metadata())

    def test_config_naming_another_version_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            self._with_config(d, lambda c: c[mxfp4_names.CONFIG_KEY].update(version=1))
            with self.assertRaisesRegex(CheckpointError, re.escape(
                    f"{d}/model.safetensors: its MXFP4 tensors are of format version 2 "
                    f"(safetensors metadata {mxfp4_names.METADATA_KEY}), but config.json's "
                    f"{mxfp4_names.CONFIG_KEY} says version 1")):
                gemma4.from_pretrained(d, quantize="w4a8")

    def test_config_without_the_entry_reads_the_recorded_version(self):
        with tempfile.TemporaryDirectory() as d:
            self._with_config(d, lambda c: c.pop(mxfp4_names.CONFIG_KEY))
            got = gemma4.forward(gemma4.from_pretrained(d, dtype=jnp.float32, quantize="w4a8"), _ids())
        want = gemma4.forward(gemma4.from_pretrained(self.converted, dtype=jnp.float32,
                                                     quantize="w4a8"), _ids())
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_unknown_recorded_version_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            self._with_config(d, lambda c: None)
            path = os.path.join(d, "model.safetensors")
            tensors = load_file(path)
            save_file(tensors, path, metadata={"format": "pt", mxfp4_names.METADATA_KEY: "7"})
            with self.assertRaisesRegex(CheckpointError, r"format version '7' .*which this "
                                                         r"version does not read \(supported: \[1, 2\]\)"):
                gemma4.from_pretrained(d, quantize="w4a8")


if __name__ == "__main__":
    absltest.main()
