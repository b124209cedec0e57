"""Random-weight models (gemma4.random_init), the prefill benchmark and `python -m jax_mila
bench` / prefill's printed stats, on CPU with tiny configs."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest, parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mila.__main__ import main as cli
from jax_mila.bench import prefill as bench
from jax_mila.bench import trace
from jax_mila.engine import plan
from jax_mila.gemma4 import prefill, random_init
from jax_mila.gemma4.loader import quantized_linears
from jax_mila.quant.mxfp4 import check_kernel_invariant, dequantize_mxfp4

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def run_cli(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(list(argv))
    return out.getvalue()


class RandomInitTest(parameterized.TestCase):

    def test_linears_are_mxfp4_and_no_dense_copy_is_kept(self):
        seed = int(np.random.default_rng().integers(1 << 30))
        model = random_init.random_model("embedded", seed=seed)
        cfg = model.config
        linears = list(quantized_linears(model))
        # 6 layers x (q, k, v, o, gate, up, down); full layers are K=V (no v_proj).
        expected = sum(7 - (s.layer_type == "full_attention" and cfg.attention_k_eq_v) for s in cfg.layers)
        self.assertLen(linears, expected, msg=f"seed {seed}")
        for path, linear in linears:
            self.assertFalse(hasattr(linear, "kernel"), msg=f"{path}: dense kernel kept")
            w = linear.mxfp4
            self.assertEqual(w.shape, (linear.out_features, linear.in_features), msg=str(path))
            self.assertTrue(check_kernel_invariant(w), msg=f"{path}, seed {seed}")
            std = float(jnp.std(dequantize_mxfp4(w)))
            self.assertBetween(std * linear.in_features**0.5, 0.8, 1.2, msg=f"{path}, seed {seed}")
        # The only 2-D dense parameter is the embedding; the rest are norms / scalars of ones.
        for path, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param) and var[...].ndim >= 2:
                self.assertEqual(path, ("embed_tokens", "weight"))
            elif isinstance(var, nnx.Param):
                np.testing.assert_array_equal(np.asarray(var[...], np.float32), 1.0, err_msg=str(path))
        emb = model.embed_tokens.weight[...]
        self.assertEqual(emb.shape, (cfg.vocab_size, cfg.hidden_size))
        self.assertEqual(emb.dtype, jnp.bfloat16)
        self.assertBetween(float(jnp.std(emb.astype(jnp.float32))), 0.95, 1.05)
        self.assertEqual(random_init.weight_bytes(model),
                         sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model))))

    def test_row_blocks_are_distinct_and_seeded(self):
        # Small blocks: a [256, 128] weight in 16 row blocks; each block must get its own draw.
        with mock.patch.object(random_init, "BLOCK_VALUES", 16 * 128):
            random_init._mxfp4.clear_cache()
            w = random_init._mxfp4(jax.random.key(3), 256, 128)
            again = random_init._mxfp4(jax.random.key(3), 256, 128)
            other = random_init._mxfp4(jax.random.key(4), 256, 128)
            e = random_init._normal(jax.random.key(3), (64, 32), 1.0, jnp.dtype(jnp.bfloat16))
        random_init._mxfp4.clear_cache()
        random_init._normal.clear_cache()
        self.assertEqual(random_init._rows_per_block(256, 128), 256)
        packed = np.asarray(w.packed)
        self.assertTrue(check_kernel_invariant(w))
        blocks = packed.reshape(16, 16, 64)
        self.assertLen({b.tobytes() for b in blocks}, 16)
        np.testing.assert_array_equal(packed, np.asarray(again.packed))
        self.assertFalse(np.array_equal(packed, np.asarray(other.packed)))
        rows = np.asarray(e, np.float32).reshape(4, 16, 32)
        self.assertLen({r.tobytes() for r in rows}, 4)

    def test_fp8_embedding_dense_linears_and_prefill(self):
        model = random_init.random_model("embedded", quantize=None, embed_dtype="float8_e4m3fn",
                                         backend="reference")
        self.assertEqual(model.embed_tokens.weight[...].dtype, jnp.float8_e4m3fn)
        self.assertEmpty(list(quantized_linears(model)))
        k = model.layers[0].mlp.gate_proj.kernel[...]
        self.assertEqual(k.dtype, jnp.bfloat16)
        self.assertBetween(float(jnp.std(k.astype(jnp.float32))) * k.shape[0]**0.5, 0.9, 1.1)
        logits, cache = prefill(model, jnp.full((1, 40), 7, jnp.int32), chunk_size=16)
        self.assertEqual(logits.shape, (1, model.config.vocab_size))
        self.assertTrue(bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32)))))
        np.testing.assert_array_equal(cache.length, 40)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "embed_dtype=float16"):
            random_init.random_model("embedded", embed_dtype="float16")
        with self.assertRaisesRegex(FileNotFoundError, "no model card for 'nope'"):
            random_init.random_model("nope")
        with self.assertRaisesRegex(ValueError, "quantize='int4'"):
            random_init.random_model("embedded", quantize="int4")

    def test_12b_shapes_abstractly(self):
        # The real 12B card, built abstractly: 5.4 GiB of MXFP4 linears + a 1.9 GiB bf16 table.
        model = nnx.eval_shape(lambda: random_init.random_model("12b"))
        nbytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
        self.assertBetween(nbytes / 2**30, 7.0, 7.5)
        self.assertLen(list(quantized_linears(model)), 48 * 7 - 8)  # full layers: K=V, no v_proj


class ChunkSizeTest(absltest.TestCase):

    def test_memory_limit_caps_the_free_memory(self):
        model = random_init.random_model("embedded")
        def chunk(limit, in_use, **kwargs):
            stats = dict(bytes_limit=limit, bytes_in_use=in_use)
            gpu = mock.Mock(memory_stats=mock.Mock(return_value=stats))
            with mock.patch.object(jax, "devices", return_value=[gpu]):
                return plan.default_chunk_size(model, 1, 64, **kwargs)

        self.assertEqual(chunk(2**34, 0), plan.MAX_CHUNK)
        # A budget below the device's limit plans exactly as a device of that size would.
        for budget, in_use in ((2**24, 0), (2**25, 2**24), (2**23, 2**20)):
            capped = chunk(2**34, in_use, memory_limit=budget)
            self.assertEqual(capped, chunk(budget, in_use), msg=f"budget {budget}, in use {in_use}")
            self.assertLess(capped, plan.MAX_CHUNK)
        self.assertEqual(chunk(2**34, 0, memory_limit=2**40), plan.MAX_CHUNK)  # the device's limit wins


def _trace(events, threads, starts=None):
    """events: (pid, tid, name, dur); starts: their "ts" (default 0 each)."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    meta += [{"ph": "M", "pid": p, "tid": t, "name": "thread_name", "args": {"name": n}}
             for (p, t), n in threads.items()]
    starts = starts or [0] * len(events)
    return {"traceEvents": meta + [{"ph": "X", "pid": p, "tid": t, "name": n, "ts": ts, "dur": d}
                                   for (p, t, n, d), ts in zip(events, starts)]}


class TraceTest(absltest.TestCase):

    def test_buckets_stream_kernels_only(self):
        threads = {(1, 7): "Stream #7(Compute)", (1, 8): "XLA Ops", (2, 1): "python3"}
        events = [(1, 7, "void Flash512Kernel<64, 2, 2>(AttentionParams, int)", 1000),
                  (1, 7, "FlashAttentionD256Kernel(AttentionParams)", 500),
                  (1, 7, "w4a8_wgmma_kernel(W4A8Args)", 2000),
                  (1, 7, "void quantize_rows_kernel<4>(uint4 const*, ...)", 250),
                  (1, 7, "sm90_xmma_gemm_bf16bf16_bf16f32", 300),
                  (1, 7, "loop_add_fusion", 100),
                  (1, 8, "custom-call.3", 9000),      # the same time under HLO names: skipped
                  (2, 1, "w4a8_wgmma_kernel", 9000)]  # host: skipped
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "plugins", "profile", "run", "perfetto_trace.json.gz")
            os.makedirs(os.path.dirname(path))
            with gzip.open(path, "wt") as f:
                json.dump(_trace(events, threads), f)
            self.assertEqual(trace.find_trace(d), path)
            split = trace.split_by_op(path)
        self.assertEqual(split["kernels"], 6)
        self.assertAlmostEqual(split["attn global (flash d512)"], 1.0)
        self.assertAlmostEqual(split["attn local (flash d256)"], 0.5)
        self.assertAlmostEqual(split["w4a8 gemm"], 2.0)
        self.assertAlmostEqual(split["act quantize"], 0.25)
        self.assertAlmostEqual(split["xla gemm"], 0.3)
        self.assertAlmostEqual(split["other"], 0.1)
        self.assertAlmostEqual(split["total"], 4.15)
        self.assertEqual(list(split["per_device"]), ["/device:GPU:0"])
        self.assertAlmostEqual(split["per_device"]["/device:GPU:0"]["total"], 4.15)
        self.assertEqual(split["top_other"], [["loop_add_fusion", 0.1]])

    def test_split_per_device(self):
        # Two devices: the sum and each device's own split; NCCL kernels are collectives.
        threads = {(1, 7): "Stream #7(Compute)", (3, 7): "Stream #7(Compute)"}
        events = [(1, 7, "w4a8_wgmma_ws_kernel", 2000), (3, 7, "w4a8_wgmma_ws_kernel", 1000),
                  (3, 7, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 700),
                  (1, 7, "loop_multiply_fusion_2", 300), (3, 7, "loop_multiply_fusion_2", 200),
                  (3, 7, "input_reduce_fusion", 400)]
        trace_json = _trace(events, threads)
        trace_json["traceEvents"].append(
            {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:1"}})
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.trace.json.gz")
            with gzip.open(path, "wt") as f:
                json.dump(trace_json, f)
            split = trace.split_by_op(path)
        self.assertAlmostEqual(split["w4a8 gemm"], 3.0)
        self.assertAlmostEqual(split["collectives (nccl)"], 0.7)
        gpu0, gpu1 = split["per_device"]["/device:GPU:0"], split["per_device"]["/device:GPU:1"]
        self.assertAlmostEqual(gpu0["total"], 2.3)
        self.assertAlmostEqual(gpu1["total"], 2.3)
        self.assertAlmostEqual(gpu1["collectives (nccl)"], 0.7)
        self.assertEqual(split["top_other"], [["loop_multiply_fusion_2", 0.5],
                                              ["input_reduce_fusion", 0.4]])

    def test_hopper_kernel_names(self):
        # The sm_90a kernels (csrc/*_sm90/, w4a8_sm90_ws.cu) land in the same buckets as the
        # portable ones: the D=256 one was counted as "other" in one H200 run before this.
        for name, bucket in (
                ("void mila::(anonymous namespace)::Flash256Sm90Kernel<2>(CUtensorMap_st, "
                 "CUtensorMap_st, CUtensorMap_st, mila::AttentionParams, int)",
                 "attn local (flash d256)"),
                ("void mila::(anonymous namespace)::Flash512Sm90Kernel<1>(CUtensorMap_st, "
                 "CUtensorMap_st, CUtensorMap_st, mila::AttentionParams, int)",
                 "attn global (flash d512)"),
                ("void mila::(anonymous namespace)::ws::w4a8_wgmma_ws_kernel<__nv_bfloat16>"
                 "(CUtensorMap_st, CUtensorMap_st, mila::W4A8Args)", "w4a8 gemm")):
            self.assertEqual(trace.bucket_of(name), bucket, name)

    def test_timeline_idle_gaps(self):
        # Two streams of one device; b overlaps a (counted once), then gaps of 3 us, 50 us and
        # 2 ms; the host line is not a device stream.
        threads = {(1, 7): "Stream #7(Compute)", (1, 8): "Stream #8(Compute)", (2, 1): "python3"}
        events = [(1, 7, "a", 100), (1, 8, "b", 50), (1, 7, "c", 10), (1, 8, "d", 20),
                  (1, 7, "e", 30), (2, 1, "host", 10000)]
        starts = [0, 80, 133, 193, 2213, 0]
        t = trace.timeline(_trace(events, threads, starts))
        self.assertEqual(list(t), ["/device:GPU:0"])
        gpu = t["/device:GPU:0"]
        self.assertAlmostEqual(gpu["span_ms"], 2.243)
        self.assertAlmostEqual(gpu["busy_ms"], (130 + 10 + 20 + 30) / 1e3)
        self.assertAlmostEqual(gpu["idle_ms"], (3 + 50 + 2000) / 1e3)
        self.assertEqual([n for n, _ in gpu["gaps"].values()], [1, 0, 1, 0, 1])
        self.assertAlmostEqual(gpu["gaps"][">1ms"][1], 2.0)
        # The kernel before a gap is the one that ended last (b, not the longer-started a).
        self.assertEqual(gpu["top_gaps"][0][1:3], ["d", "e"])
        self.assertEqual(gpu["top_gaps"][2][1:3], ["b", "c"])
        # What the host did meanwhile: the host span covers every gap whole.
        self.assertEqual([[n, round(ms, 6)] for n, ms in gpu["top_gaps"][0][3]], [["host", 2.0]])
        self.assertEqual([[n, round(ms, 6)] for n, ms in gpu["top_gaps"][1][3]], [["host", 0.05]])
        # Gaps of 20 us or more, by the kernel they end at (the 3 us one is left out).
        self.assertEqual([g[:2] for g in gpu["idle_before"]], [["e", 1], ["d", 1]])
        self.assertAlmostEqual(gpu["idle_before"][0][2], 2.0)

    def test_host_events_during_a_gap(self):
        # A 2 ms device gap (100 -> 2100 us): the dispatch that covers it whole, the launch
        # nested in it, a span that only begins inside it (partial overlap), one after it and
        # the device's own derived line (not host work) are told apart.
        threads = {(1, 7): "Stream #7(Compute)", (1, 8): "XLA Ops", (2, 1): "python3",
                   (2, 2): "tf_XLAEigen"}
        events = [(1, 7, "a", 100), (1, 7, "b", 10), (1, 8, "custom-call", 3000),
                  (2, 1, "PjitFunction(step)", 2500), (2, 2, "ExecuteOnStream", 800),
                  (2, 1, "flatten", 1000), (2, 1, "later", 500)]
        starts = [0, 2100, 0, 0, 1000, 1600, 2200]
        gap = trace.timeline(_trace(events, threads, starts))["/device:GPU:0"]["top_gaps"][0]
        self.assertAlmostEqual(gap[0], 2.0)
        self.assertEqual([n for n, _ in gap[3]], ["PjitFunction(step)", "ExecuteOnStream",
                                                   "flatten"])
        self.assertEqual([round(ms, 6) for _, ms in gap[3]], [2.0, 0.8, 0.5])

    def test_no_device_events(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.trace.json.gz")
            with gzip.open(path, "wt") as f:
                json.dump(_trace([(2, 1, "op", 5)], {(2, 1): "python3"}), f)
            self.assertIsNone(trace.split_by_op(path))
            self.assertEqual(trace.find_trace(d), path)
        self.assertIsNone(trace.find_trace(tempfile.gettempdir() + "/no_such_dir_x"))


class BenchTest(absltest.TestCase):

    @pytest.mark.slow
    def test_cpu_run_mila_and_reference(self):
        with tempfile.TemporaryDirectory() as out, mock.patch.dict(os.environ, {"OUT": out}):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                rows = bench.main(["--model", "embedded", "--seqs", "48,32", "--backends",
                                   "mila,reference", "--reps", "1", "--chunk-size", "32",
                                   "--no-profile", "--memory-plan"])
            with open(os.path.join(out, "prefill.json")) as f:
                saved = json.load(f)
        text = text.getvalue()
        self.assertLen(rows, 4)
        for r in rows:
            self.assertEqual(r["status"], "ok", msg=str(r))
            self.assertTrue(r["finite"], msg=str(r))
            self.assertGreater(r["tokens_per_s"], 0)
            self.assertEqual(r["chunk"], 32)
            self.assertGreater(r["cache_bytes"], 0)
            self.assertGreater(r["weights_bytes"], 0)
            if r["seq"] > 32:  # one chunk: no chunk step to plan
                self.assertGreater(r["plan_temp_bytes"], 0)
        self.assertEqual(saved["rows"], json.loads(json.dumps(rows)))
        self.assertIn("| seq | mila tok/s | reference tok/s | mila/reference |", text)
        self.assertRegex(text, r"\| 48 \| [\d,]+ \| [\d,]+ \| [\d.]+x \|")
        self.assertNotIn("op split", text)

    def test_cpu_run_with_prefills_own_chunk(self):
        # --chunk-size prefill: gemma4.prefill(chunk_size=None), its own plan per length (2048
        # on a device without memory figures), so a 48-token prompt is one chunk of 48.
        with tempfile.TemporaryDirectory() as out, mock.patch.dict(os.environ, {"OUT": out}):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                rows = bench.main(["--model", "embedded", "--seqs", "48", "--backends", "mila",
                                   "--reps", "1", "--chunk-size", "prefill", "--no-profile"])
        self.assertLen(rows, 1)
        self.assertEqual(rows[0]["status"], "ok", msg=str(rows[0]))
        self.assertTrue(rows[0]["finite"])
        self.assertEqual(rows[0]["chunk"], 48)
        self.assertIn("mila: chunk prefill (", text.getvalue())

    @absltest.skipUnless(HAVE_TORCH, "needs torch and transformers")
    def test_cpu_run_transformers(self):
        with contextlib.redirect_stdout(io.StringIO()):
            rows = bench.main(["--model", "embedded", "--seqs", "24", "--backends", "transformers",
                               "--reps", "1", "--transformers-device", "cpu"])
        self.assertLen(rows, 1)
        self.assertEqual(rows[0]["status"], "ok", msg=str(rows[0]))
        self.assertTrue(rows[0]["finite"])
        self.assertGreater(rows[0]["cache_bytes"], 0)

    def test_worker_crash_is_reported_per_length(self):
        with contextlib.redirect_stdout(io.StringIO()):
            rows = bench.main(["--model", "embedded", "--seqs", "16", "--backends", "mila",
                               "--reps", "1", "--quantize", "w4a8", "--embed-dtype", "bfloat16",
                               "--no-profile", "--seed", "-1"])  # numpy refuses a negative seed
        self.assertLen(rows, 1)
        self.assertTrue(rows[0]["status"].startswith("not run (worker exited"), msg=str(rows[0]))

    def test_worker_imports_the_parents_package_not_the_working_directorys(self):
        # A checkout as the working directory, its package shadowing the installed one: the
        # worker must import the jax_mila this process runs (the decoy would exit 3).
        with tempfile.TemporaryDirectory() as cwd:
            os.makedirs(os.path.join(cwd, "jax_mila", "bench"))
            for init in ("jax_mila/__init__.py", "jax_mila/bench/__init__.py"):
                with open(os.path.join(cwd, init), "w") as f:
                    f.write("import sys\nprint('DECOY jax_mila')\nsys.exit(3)\n")
            old = os.getcwd()
            os.chdir(cwd)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    rows = bench.main(["--model", "embedded", "--seqs", "16", "--backends",
                                       "mila", "--reps", "1", "--no-profile", "--seed", "-1"])
            finally:
                os.chdir(old)
        self.assertLen(rows, 1)
        self.assertIn("worker exited 1", rows[0]["status"])  # the real worker's seed error
        self.assertNotIn("DECOY", rows[0]["status"])

    def test_report_ratios_and_failures(self):
        rows = [dict(backend="mila", seq=8, status="ok", tokens_per_s=300.0, median_s=0.1,
                     first_s=1.0, chunk=8, peak_bytes=3 * 2**30, weights_bytes=2**30,
                     cache_bytes=2**29, activations_bytes=3 * 2**29),
                dict(backend="reference", seq=8, status="ok", tokens_per_s=100.0, median_s=0.3,
                     first_s=1.0, chunk=8),
                dict(backend="reference", seq=16, status="OOM")]
        text = bench.report(rows, ["mila", "reference"], [8, 16])
        self.assertIn("| 8 | 300 | 100 | 3.00x |", text)
        self.assertIn("| 16 | - | OOM | - |", text)
        self.assertIn("| mila | 8 | 8 | 100.0 | 1.0 | 3.00 GiB | 1.00 GiB | 0.50 GiB | 1.50 GiB | 196608 |", text)
        self.assertIn("| reference | 8 | 8 | 300.0 | 1.0 | n/a | n/a | n/a | n/a | n/a |", text)

    def test_summary_line_flags_non_finite_logits(self):
        row = dict(backend="mila", seq=8, status="ok", tokens_per_s=300.0, median_s=0.1,
                   times_s=[0.1], first_s=1.0, finite=True)
        self.assertNotIn("NOT FINITE", bench._summary(row))
        self.assertIn("LOGITS NOT FINITE", bench._summary(dict(row, finite=False)))

    def test_bad_arguments_exit(self):
        for argv in (["--backends", "mila,jax"], ["--seqs", "0"], ["--chunk-size", "x"],
                     ["--chunk-size", "0"]):
            with self.assertRaises(SystemExit, msg=str(argv)), \
                    contextlib.redirect_stderr(io.StringIO()):
                bench.main(argv)


class CliTest(absltest.TestCase):

    def test_prefill_prints_ttft_and_memory(self):
        text = run_cli("prefill", "--length", "40", "--chunk-size", "16", "--dtype", "float32")
        self.assertRegex(text, r"prefill: 40 tokens in .* tokens/s \(first call incl\. compile "
                               r"[\d.]+ s, chunks of 16\)")
        self.assertRegex(text, r"time to first token: [\d.]+ ms")
        if jax.devices()[0].platform == "cpu":  # XLA:CPU keeps no allocator statistics
            self.assertRegex(text, r"peak device memory: n/a on cpu .*; weights [\d.]+ MiB, KV cache [\d.]+ MiB")
        else:
            self.assertRegex(text, r"peak device memory: [\d.]+ [MG]iB \(weights [\d.]+ MiB, KV cache "
                                   r"[\d.]+ MiB, activations\+workspace -?[\d.]+ [MG]iB")
        text = run_cli("prefill", "--length", "8")
        self.assertIn("one call (auto chunk 2048)", text)

    def test_bench_subcommand(self):
        with contextlib.redirect_stdout(io.StringIO()):
            rows = cli(["bench", "prefill", "--model", "embedded", "--seqs", "8", "--backends",
                        "reference", "--reps", "1", "--no-profile"])
        self.assertIsNone(rows)
        err = io.StringIO()
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(err):
            cli(["bench", "nope"])
        self.assertIn("invalid choice: 'nope'", err.getvalue())

    def test_bench_usage_names_the_command_line(self):
        err = io.StringIO()
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(err):
            cli(["bench"])
        self.assertIn("python -m jax_mila bench: error: the following arguments are required: "
                      "BENCHMARK", err.getvalue())
        self.assertNotIn("bench_args", err.getvalue())
        out = io.StringIO()
        with self.assertRaises(SystemExit), contextlib.redirect_stdout(out):
            cli(["bench", "prefill", "--help"])
        self.assertTrue(out.getvalue().startswith("usage: python -m jax_mila bench prefill "))
        err = io.StringIO()
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(err):
            cli(["bench", "prefill", "--seqs", "0"])
        self.assertIn("python -m jax_mila bench prefill: error: --seqs", err.getvalue())
        # A kernel benchmark needs no arguments. (As from a source checkout: an installed
        # package has no benchmarks/ beside it, see the next test.)
        with mock.patch("subprocess.call", return_value=0) as call, \
                mock.patch("os.path.isfile", return_value=True), self.assertRaises(SystemExit):
            cli(["bench", "attention"])
        self.assertEqual(call.call_args.args[0][2:], [])

    def test_kernel_bench_outside_a_checkout(self):
        err = io.StringIO()
        with mock.patch("os.path.isfile", return_value=False), \
                self.assertRaises(SystemExit), contextlib.redirect_stderr(err):
            cli(["bench", "gemm"])
        self.assertIn("not installed with the package; run benchmarks/gemm.py", err.getvalue())


if __name__ == "__main__":
    absltest.main()
