"""End-to-end Gemma 4 prefill: tokens/s, peak device memory and where the time goes.

    python3 benchmarks/prefill.py [--model 12b] [--seqs 4096,8192,16384,32768,65536]
        [--backends mila,reference,transformers] [--chunk-size 32768|auto|prefill]
        [--memory-budget-gib 12]
        [--reps 3] [--embed-dtype bfloat16|float8_e4m3fn] [--no-profile] [--devices 1,2]
    (also: python -m jax_mila bench prefill [same options])

Devices (``--devices 1,2``): each count runs in its own worker process; N > 1 runs the same
random model (built replicated on every device: each draws its own copy) through
``gemma4.prefill(mesh=...)`` over a "seq" mesh axis of N devices (context parallelism,
jax_mila.engine.sharded; the chunk is rounded up to a multiple of N). Peak memory is then
per device (every device's allocator peak; the tables show the largest), the KV cache per
device (its largest shard), and a scaling table compares each N with the same run's N = 1
point (speedup, efficiency = speedup / N).

Model: ``--model`` is a model card ("12b", "embedded", ...) or a directory with config.json;
random weights made on the device (jax_mila.gemma4.random_init: MXFP4 linears, bf16 or FP8
embedding). Backends, each in its own process, one after the other (so each has the device
to itself and the allocator's peak belongs to it alone):
- mila: ``backend="auto"`` (the kernels on a GPU), W4A8 linears;
- reference: ``backend="reference"`` (XLA attention / dots), the same W4A8 weights;
- transformers: HF Gemma4(Unified)ForCausalLM from the same config.json, bf16 weights,
  attn_implementation="sdpa", ``model(ids, use_cache=True, logits_to_keep=1)``; on CUDA only
  (``--transformers-device cpu`` to run it on CPU, for tiny configs). Skipped, with the
  reason, when torch / transformers are missing.

Per length (ascending): one first call (compile included: "first"), --warmup more, then --reps
timed calls, each a separate ``gemma4.prefill`` synchronised at its end (median reported;
time to first token = that prefill time, the logits of the last position are its output).
Every JAX call is dispatched separately (no batching of runs into one program).
Chunked prefill with one chunk size for all lengths (``--chunk-size``, default 32768; "auto":
``default_chunk_size`` for the longest length under --memory-budget-gib), min(chunk, length).
"prefill": what ``gemma4.prefill`` does by default (``chunk_size=None``: its own plan per length,
without a budget; a prompt within it runs as one chunk, in layer pieces where they apply, else
one-shot), the call a user makes without choosing a chunk.

Memory: the allocator's ``peak_bytes_in_use`` (torch: max_memory_allocated), which JAX cannot
reset; the lengths run in ascending order with the same chunk, so each step's peak is at
least the previous one's and the reading after a length is that length's peak (a reading
equal to the previous one is marked as an upper bound). It includes the first call's compile
(XLA autotuning scratch). Breakdown: weights = bytes of the model's arrays, KV cache = bytes
of the cache prefill returns, activations/workspace = peak - weights - cache. With
--memory-plan, XLA's own plan for one chunk step (temporary buffers of the compiled step, from
its memory analysis) is printed beside it: steady-state activations, without compile scratch;
for --devices N > 1, the context-parallel step's plan per device.

Op split (--profile, default on): one more prefill under jax.profiler; GPU kernel time by
name (jax_mila.bench.trace: flash d512 = global attention, d256 = local, w4a8 / activation
quantize = the linears, XLA gemm, other). Not available on CPU.

Prints the tables last; writes everything to $OUT/prefill.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from jax_mila.bench import timing

GiB = 2**30
BACKENDS = ("mila", "reference", "transformers")
DEFAULT_SEQS = (4096, 8192, 16384, 32768, 65536)
# A fixed default chunk: the one gemma4.prefill itself picks on an H200 when no memory budget
# is given (default_chunk_size clamps the free memory's plan to MAX_CHUNK). Measured on the H200
# (docs/performance.md), 12B at 32K / 64K: 4096 -> 16384 is +3.5% / +2.1% tokens/s (fewer
# chunks: fewer launches and last waves, GEMMs at M = 16384), 16384 -> 32768 +0.4-0.8% more, at
# 11.01 / 11.53 GiB peak, inside the 12 GiB budget. default_chunk_size under that budget
# (--chunk-size auto) plans smaller chunks (16384 at 32K, 8192 at 64K): it keeps half the free
# memory as a margin. Each worker prints what auto would pick.
DEFAULT_CHUNK = 32768
OWN_CHUNK = "prefill"  # --chunk-size prefill: gemma4.prefill's own choice (chunk_size=None)
RESULT = "RESULT "  # worker -> parent: one JSON object per line after this prefix


# ---------------------------------------------------------------------------------- workers

def _timed_runs(run, warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `run` (which waits for its result) after `warmup`
    untimed ones; each result is dropped before the next call, so one cache is alive at a time."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return times


def _emit(row: dict) -> None:
    print(RESULT + json.dumps(row), flush=True)


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory"))


def _jax_worker(spec: dict) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jax_mila import gemma4
    from jax_mila.bench import trace as trace_mod
    from jax_mila.engine import plan
    from jax_mila.gemma4 import random_init

    n_dev = spec.get("devices", 1)
    if len(jax.devices()) < n_dev:
        raise SystemExit(f"{spec['backend']}: --devices {n_dev} but only {len(jax.devices())} "
                         f"visible: {jax.devices()}")
    devs = jax.devices()[:n_dev]
    dev = devs[0]
    mesh, sharding = None, None
    if n_dev > 1:  # context parallelism: weights replicated, each chunk split over "seq"
        from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

        mesh = Mesh(np.array(devs), ("seq",))
        sharding = NamedSharding(mesh, PartitionSpec())

    def peaks():
        """peak_bytes_in_use of every device of the run (None where not reported)."""
        return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devs]

    def peak():
        values = [p for p in peaks() if p is not None]
        return max(values) if values else None

    backend = "auto" if spec["backend"] == "mila" else "reference"
    t0 = time.perf_counter()
    model = random_init.random_model(spec["model"], backend=backend, quantize=spec["quantize"],
                                     embed_dtype=spec["embed_dtype"], seed=spec["seed"],
                                     sharding=sharding)
    jax.block_until_ready(nnx.state(model))
    weights, init_peak = random_init.weight_bytes(model), peak()
    where = dev if n_dev == 1 else f"{n_dev} devices (replicated; seq axis)"
    print(f"{spec['backend']}: model built on {where} in {time.perf_counter() - t0:.1f} s, "
          f"weights {_gib(weights)}", flush=True)
    seqs = sorted(spec["seqs"])
    auto = plan.default_chunk_size(model, 1, seqs[-1], memory_limit=int(spec["memory_budget_gib"] * GiB))
    own = spec["chunk_size"] == OWN_CHUNK
    chunk = None if own else spec["chunk_size"] or auto
    print(f"{spec['backend']}: chunk {OWN_CHUNK if own else chunk} (--chunk-size auto would "
          f"plan {auto}: default_chunk_size under {spec['memory_budget_gib']} GiB for "
          f"{seqs[-1]} tokens)", flush=True)
    rng = np.random.default_rng(spec["seed"])
    previous_peak = init_peak
    for length in seqs:
        planned = plan.default_chunk_size(model, 1, length) if own else chunk
        row_chunk = -(-min(planned, length) // n_dev) * n_dev  # the seq axis splits each chunk
        row = dict(backend=spec["backend"], seq=length, chunk=row_chunk, weights_bytes=weights,
                   init_peak_bytes=init_peak, device=str(dev), devices=n_dev)
        ids = jnp.asarray(rng.integers(3, model.config.vocab_size, (1, length), dtype=np.int32))
        mesh_kw = {} if mesh is None else dict(mesh=mesh, seq_segments=spec.get("seq_segments"))

        def run():
            out = gemma4.prefill(model, ids, chunk_size=None if own else row["chunk"],
                                   kv_cache_dtype=spec.get("kv_cache_dtype"), **mesh_kw)
            jax.block_until_ready(out)
            return out

        try:
            t = time.perf_counter()
            out = run()
            row["first_s"] = time.perf_counter() - t
            # Per device: a position-sharded buffer counts its largest shard.
            row["cache_bytes"] = sum(max(int(s.data.nbytes) for s in x.addressable_shards)
                                     for x in jax.tree.leaves(out[1]))
            row["finite"] = bool(jnp.all(jnp.isfinite(out[0].astype(jnp.float32))))
            del out  # never two caches alive at once: the peak is one prefill's
            times = _timed_runs(run, spec["warmup"], spec["reps"])
            row["times_s"] = times
            row["median_s"] = statistics.median(times)
            row["tokens_per_s"] = length / row["median_s"]
            p = peak()
            if n_dev > 1:
                row["peak_bytes_per_device"] = peaks()
            if p is not None:
                row["peak_bytes"] = p
                row["peak_is_upper_bound"] = previous_peak is not None and p <= previous_peak
                row["activations_bytes"] = p - weights - row["cache_bytes"]
                row["activation_bytes_per_token"] = row["activations_bytes"] / row["chunk"]
                previous_peak = p
            if spec.get("memory_plan") and (row["chunk"] < length or n_dev > 1):
                row["plan_temp_bytes"] = _chunk_step_temp_bytes(
                    model, row["chunk"], length, spec.get("kv_cache_dtype"),
                    mesh=mesh, segments=spec.get("seq_segments"))
            if spec["profile"]:
                row["split_ms"], row["split_note"] = _profile(run, trace_mod)
                if n_dev > 1 and row["split_ms"]:
                    row["split_note"] += f" (summed over the {n_dev} devices)"
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 -- reported per point, the run goes on
            row["status"] = "OOM" if _is_oom(e) else f"error: {type(e).__name__}: {str(e)[:300]}"
        _emit(row)


def _chunk_step_temp_bytes(model, chunk: int, length: int, kv_cache_dtype,
                           mesh=None, segments: int | None = None) -> int | None:
    """XLA's own plan for one chunk step: the bytes of its temporary buffers (activations and
    workspace, weights and cache excluded), from the compiled executable's memory analysis.
    The allocator's peak also holds what the first call's compile needed (autotuning scratch);
    this does not, so the two together say which of them sets the peak. With `mesh` (a "seq"
    axis): the context-parallel step, per device."""
    import jax  # noqa: PLC0415 - the worker imports jax lazily (the parent never does)
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from jax_mila.engine import jitted, sharded  # noqa: PLC0415
    from jax_mila.gemma4 import cache as kv  # noqa: PLC0415
    from jax_mila.parallel import chunked  # noqa: PLC0415

    ids = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    valid = jax.ShapeDtypeStruct((), jnp.int32)
    if mesh is not None:
        segments = chunked.DEFAULT_SEGMENTS if segments is None else segments
        devices = mesh.shape["seq"]
        # A real cache, made in its shards as prefill makes it; the caller measured the peak.
        make = functools.partial(kv.empty, model.config, 1, chunked.capacity(length, devices, segments),
                                 model.dtype, full_dtype=kv_cache_dtype, seq_layout=(devices, segments))
        step, state, cache = sharded.chunk_step(model, nnx.state(model), make, mesh,
                                                tp_axis=None, seq_axis="seq", segments=segments)
        analysis = step.lower(state, cache, ids, valid).compile().memory_analysis()
        del cache
        return None if analysis is None else int(analysis.temp_size_in_bytes)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    cache = jax.eval_shape(lambda: kv.empty(model.config, 1, length, model.dtype,
                                            full_dtype=kv_cache_dtype))
    structure, weights = jitted.model_args(model)  # what prefill passes the step
    lowered = jitted.chunk_step_fn(model).lower(structure, abstract(weights), cache, ids, valid)
    analysis = lowered.compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def _profile(run, trace_mod, what: str = "prefill"):
    """(kernel ms by bucket, note) of one ``run()`` (a ``what``) under jax.profiler."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                del_me = run()
                del del_me
        except Exception as e:  # noqa: BLE001 -- the profiler is optional
            return None, f"profiler failed: {type(e).__name__}: {str(e)[:200]}"
        path = trace_mod.find_trace(d)
        if path is None:
            return None, "no trace file written"
        split = trace_mod.split_by_op(path)
    if split is None:
        return None, "no device kernels in the trace (CPU run, or the profiler saw no GPU)"
    return split, f"GPU kernel time by name from jax.profiler (one extra {what})"


def _hf_model(config_path: str, device: str):
    import torch
    import transformers

    with open(config_path) as f:
        raw = json.load(f)
    text = dict(raw.get("text_config", raw))
    kind = text.pop("model_type", "gemma4_text")
    if kind.startswith("gemma4_unified"):
        config_cls, model_cls = transformers.Gemma4UnifiedTextConfig, transformers.Gemma4UnifiedForCausalLM
    else:
        config_cls, model_cls = transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM
    for key in ("_comment", "architectures", "dtype", "torch_dtype"):
        text.pop(key, None)
    cfg = config_cls(**text)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to(torch.bfloat16).eval(), cfg


def _torch_worker(spec: dict) -> None:
    import torch

    base = {"backend": "transformers"}
    device = "cuda" if torch.cuda.is_available() else spec["transformers_device"]
    if device == "cuda" and not torch.cuda.is_available():
        for length in spec["seqs"]:
            _emit(dict(base, seq=length, status="skipped: torch.cuda not available"))
        return
    from jax_mila.gemma4.random_init import _config_path

    t0 = time.perf_counter()
    model, cfg = _hf_model(_config_path(spec["model"]), device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    print(f"transformers: model built on {device} in {time.perf_counter() - t0:.1f} s, "
          f"weights {_gib(weights)}", flush=True)
    gen = torch.Generator().manual_seed(spec["seed"])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for length in sorted(spec["seqs"]):
        row = dict(base, seq=length, weights_bytes=weights, device=device)
        ids = torch.randint(3, cfg.vocab_size, (1, length), generator=gen).to(device)

        def run():
            with torch.inference_mode():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            sync()
            return out

        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            out = run()
            row["first_s"] = time.perf_counter() - t
            row["cache_bytes"] = _hf_cache_bytes(out.past_key_values)
            row["finite"] = bool(torch.isfinite(out.logits.float()).all())
            del out
            times = _timed_runs(run, spec["warmup"], spec["reps"])
            row["times_s"], row["median_s"] = times, statistics.median(times)
            row["tokens_per_s"] = length / row["median_s"]
            if device == "cuda":
                row["peak_bytes"] = torch.cuda.max_memory_allocated()
                if row["cache_bytes"] is not None:
                    row["activations_bytes"] = row["peak_bytes"] - weights - row["cache_bytes"]
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 -- reported per point
            row["status"] = "OOM" if _is_oom(e) else f"error: {type(e).__name__}: {str(e)[:300]}"
        _emit(row)


def _hf_cache_bytes(cache) -> int | None:
    try:
        layers = getattr(cache, "layers", None)
        if layers is not None:
            tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        else:
            tensors = [t for kv in cache for t in kv]
        return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))
    except Exception:  # noqa: BLE001 -- the cache classes change between versions
        return None


# ----------------------------------------------------------------------------------- parent

def serve_worker(argv, jax_worker, torch_worker) -> bool:
    """The child side of :func:`run_worker`: for ``argv`` = ["--worker", SPEC JSON], runs the
    spec's backend (transformers: ``torch_worker``, else ``jax_worker``) and returns True;
    False for any other command line."""
    if argv[:1] != ["--worker"]:
        return False
    spec = json.loads(argv[1])
    (torch_worker if spec["backend"] == "transformers" else jax_worker)(spec)
    return True


def run_worker(spec: dict, timeout: float, *, module: str = "jax_mila.bench.prefill",
               expected: list[dict] | None = None, summary=None) -> list[dict]:
    """Runs one backend of benchmark ``module`` (``python -m module --worker SPEC``) in a child
    process; returns its rows, each JSON line after RESULT. ``expected``: the points (dicts of
    the keys that identify a row) that must come back; a missing one is returned marked with
    why (timeout, exit status, the last lines). Default: one per spec["seqs"] (prefill)."""
    import jax_mila

    if expected is None:
        extra = {} if spec.get("devices", 1) == 1 else dict(devices=spec["devices"])
        expected = [dict(seq=s, **extra) for s in spec["seqs"]]
    summary = summary or _summary
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with nothing held back
    root = os.path.dirname(os.path.dirname(os.path.abspath(jax_mila.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # -P: the working directory does not go first on the child's path. From a checkout whose
    # package is installed (built), `-m` would otherwise import the checkout's jax_mila, which
    # has no compiled extension, and time the reference path instead of the kernels.
    cmd = [sys.executable, "-P", "-m", module, "--worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    rows, tail = [], []
    try:
        for line in proc.stdout:
            if line.startswith(RESULT):
                row = json.loads(line[len(RESULT):])
                rows.append(row)
                print(f"  {summary(row)}", flush=True)
            else:
                tail = (tail + [line.rstrip()])[-5:]
                if line.startswith(spec["backend"]) or "Traceback" in line:
                    print(f"  {line.rstrip()}", flush=True)
        proc.wait()
        if proc.returncode:
            print("  " + "\n  ".join(tail), flush=True)
    finally:
        timer.cancel()
    timed_out = proc.returncode is not None and proc.returncode < 0
    why = f"timed out after {timeout:.0f} s" if timed_out else f"worker exited {proc.returncode}"
    for point in expected:
        if not any(all(r.get(k) == v for k, v in point.items()) for r in rows):
            rows.append(dict(backend=spec["backend"], **point,
                             status=f"not run ({why}): {' | '.join(tail[-2:])[:300]}"))
    return rows


def _summary(row: dict) -> str:
    head = f"{_label(row):>12} {row['seq']:>6}"
    if row.get("status") != "ok":
        return f"{head}: {row.get('status')}"
    peak = f", peak {_gib(row.get('peak_bytes'))}" if row.get("peak_bytes") else ""
    # In the log too: a later run of the script in the same output folder replaces the JSON.
    finite = "" if row.get("finite", True) else ", LOGITS NOT FINITE"
    return (f"{head}: {row['tokens_per_s']:,.0f} tok/s (median {row['median_s'] * 1e3:.1f} ms of "
            f"{len(row['times_s'])}; first call {row['first_s']:.1f} s){peak}{finite}")


def _gib(x) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if abs(x) >= GiB / 10 else f"{x / 2**20:.2f} MiB"


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _label(row: dict) -> str:
    """The series a row belongs to: its backend, with the device count when above one."""
    n = row.get("devices", 1)
    return row["backend"] if n == 1 else f"{row['backend']} x{n}"


def _series(rows: list[dict], backends: list[str]) -> list[str]:
    out = []
    for b in backends:
        counts = sorted({r.get("devices", 1) for r in rows if r["backend"] == b}) or [1]
        out += [_label(dict(backend=b, devices=n)) for n in counts]
    return out


def scaling(rows: list[dict], backends: list[str], seqs: list[int]) -> list[list]:
    """Rows of the multi-device table: each N > 1 point against the same run's N = 1 point
    (speedup, efficiency = speedup / N) with the per-device peaks of both."""
    by = {(r["backend"], r.get("devices", 1), r["seq"]): r for r in rows}
    out = []
    for b in backends:
        for n in sorted({r.get("devices", 1) for r in rows if r["backend"] == b} - {1}):
            for s in seqs:
                r, one = by.get((b, n, s), {}), by.get((b, 1, s), {})
                if r.get("status") != "ok":
                    if r:
                        out.append([b, s, n, r.get("status", "?").split(":")[0]] + ["-"] * 5)
                    continue
                ok1 = one.get("status") == "ok"
                speed = r["tokens_per_s"] / one["tokens_per_s"] if ok1 else None
                per_dev = r.get("peak_bytes_per_device") or []
                out.append([b, s, n, f"{r['tokens_per_s']:,.0f}",
                            f"{one['tokens_per_s']:,.0f}" if ok1 else "-",
                            f"{speed:.2f}x" if speed else "-",
                            f"{100 * speed / n:.0f}%" if speed else "-",
                            " / ".join(_gib(p) for p in per_dev) or _gib(r.get("peak_bytes")),
                            _gib(one.get("peak_bytes")) if ok1 else "-"])
    return out


def report(rows: list[dict], backends: list[str], seqs: list[int]) -> str:
    """The markdown tables: throughput, memory breakdown, op split; with several device
    counts (--devices) also the scaling table. A series is a backend on N devices
    ("mila x2"), plain backend names for one device."""
    by = {(_label(r), r["seq"]): r for r in rows}
    multi = scaling(rows, backends, seqs)
    backends = _series(rows, backends)

    def cell(b, s):
        r = by.get((b, s))
        if r is None:
            return "-"
        if r.get("status") != "ok":
            return r.get("status", "?").split(":")[0]
        return f"{r['tokens_per_s']:,.0f}"

    header = ["seq"] + [f"{b} tok/s" for b in backends]
    ratios = [(a, b) for a, b in (("mila", "reference"), ("mila", "transformers"))
              if a in backends and b in backends]
    header += [f"{a}/{b}" for a, b in ratios]
    out_rows = []
    for s in seqs:
        line = [s] + [cell(b, s) for b in backends]
        for a, b in ratios:
            ra, rb = by.get((a, s), {}), by.get((b, s), {})
            ok = ra.get("status") == "ok" and rb.get("status") == "ok"
            line.append(f"{ra['tokens_per_s'] / rb['tokens_per_s']:.2f}x" if ok else "-")
        out_rows.append(line)
    text = ["Prefill throughput (median; 1 sequence)", _table(header, out_rows), ""]
    if multi:
        text += ["Context parallelism (seq axis): scaling against the same run's one-device "
                 "point; peak per device (allocator statistics of every device)",
                 _table(["backend", "seq", "devices", "tok/s", "tok/s on 1", "speedup",
                         "scaling efficiency", "peak per device", "peak on 1"], multi), ""]

    mem = []
    for b in backends:
        for s in seqs:
            r = by.get((b, s))
            if r is None or r.get("status") != "ok":
                continue
            bound = " (<=)" if r.get("peak_is_upper_bound") else ""
            mem.append([b, s, r.get("chunk", "-"), f"{r['median_s'] * 1e3:.1f}", f"{r['first_s']:.1f}",
                        _gib(r.get("peak_bytes")) + bound, _gib(r.get("weights_bytes")),
                        _gib(r.get("cache_bytes")), _gib(r.get("activations_bytes")),
                        "n/a" if r.get("activations_bytes") is None or not r.get("chunk")
                        else f"{r['activations_bytes'] / r['chunk'] / 1024:.0f}",
                        _gib(r.get("plan_temp_bytes")) if r.get("plan_temp_bytes") else "-"])
    text += ["Time to first token and peak device memory (allocator statistics)",
             _table(["backend", "seq", "chunk", "TTFT ms", "first call s", "peak", "weights",
                     "KV cache", "activations+workspace", "per chunk token KiB",
                     "XLA plan: chunk step temp"], mem), ""]

    from jax_mila.bench.trace import GAP_CLASSES, buckets_used

    columns = buckets_used([r["split_ms"] for r in rows if r.get("split_ms")])

    def shares(ms):
        return [f"{ms['total']:.1f}"] + [
            f"{ms[k]:.1f} ({100 * ms[k] / max(ms['total'], 1e-9):.0f}%)" for k in columns]

    split, heaviest, notes = [], [], set()
    for b in backends:
        for s in seqs:
            r = by.get((b, s), {})
            if r.get("split_ms"):
                ms = r["split_ms"]
                split.append([b, s] + shares(ms))
                per_device = ms.get("per_device") or {}
                if len(per_device) > 1:  # each device's own time: the slowest sets the pace
                    split += [[f"{b} GPU{d.rsplit(':', 1)[-1]}", s] + shares(own)
                              for d, own in per_device.items()]
                heaviest += [f"{b} {s}: {name[:80]} {t:.1f} ms"
                             for name, t in ms.get("top_other", ())]
            elif r.get("split_note"):
                notes.add(r["split_note"])
    if split:
        text += ["GPU kernel time by op, ms per prefill (share of kernel time; a series on N "
                 "devices: their sum, then each device)",
                 _table(["backend", "seq", "kernels"] + columns, split)]
    if heaviest:
        text += ["", "Heaviest kernels in \"other\" (summed over devices)"] + heaviest
    idle, longest = [], []
    for b in backends:
        for s in seqs:
            for device, t in ((by.get((b, s), {}).get("split_ms") or {}).get("timeline") or {}).items():
                gpu = device.rsplit(":", 1)[-1]
                idle.append([b, s, gpu, f"{t['span_ms']:.1f}", f"{t['busy_ms']:.1f}",
                             f"{t['idle_ms']:.1f}"] +
                            [f"{n} / {ms:.1f}" for n, ms in t["gaps"].values()])
                for ms, before, after, *host in t["top_gaps"][:3]:
                    longest.append(f"{b} {s} GPU{gpu}: {ms:.2f} ms after {before[:60]} before "
                                   f"{after[:60]}")
                    longest += [f"    host: {name[:80]} {hms:.2f} ms"
                                for name, hms in (host[0] if host else [])]
                longest += [f"{b} {s} GPU{gpu}: {count} gaps >= 20 us, {ms:.1f} ms in all, "
                            f"before {name[:60]}" for name, count, ms in t.get("idle_before", [])[:5]]
    if idle:
        text += ["", "Device timeline of the profiled prefill, ms (idle = span - busy: launch "
                 "latency and host waits; gaps: count / ms)",
                 _table(["backend", "seq", "GPU", "span", "busy", "idle"] +
                        [f"gaps {label}" for label, _ in GAP_CLASSES], idle)]
        text += ["Longest gaps"] + longest
    for n in sorted(notes):
        text.append(f"op split: {n}")
    return "\n".join(text)


def _parse(argv, prog="benchmarks/prefill.py"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="12b", help="model card name or directory with config.json (default 12b)")
    p.add_argument("--seqs", default=",".join(map(str, DEFAULT_SEQS)), help="prompt lengths, comma-separated")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    p.add_argument("--chunk-size", default=str(DEFAULT_CHUNK),
                   help=f"tokens per prefill chunk, auto (default_chunk_size under "
                        f"--memory-budget-gib) or {OWN_CHUNK} (gemma4.prefill's own choice, "
                        f"chunk_size=None); default {DEFAULT_CHUNK}")
    p.add_argument("--memory-budget-gib", type=float, default=12.0,
                   help="device memory --chunk-size auto plans for (default 12)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per point (default 3)")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs after the first call (default 0)")
    p.add_argument("--quantize", choices=("w4a8", "none"), default="w4a8", help="linears (default w4a8)")
    p.add_argument("--embed-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the op split")
    p.add_argument("--devices", default="1",
                   help="device counts, comma-separated (default 1): N > 1 runs the prefill "
                        "context-parallel over N devices (a 'seq' mesh axis, weights replicated), "
                        "each count in its own process; with 1 in the list, scaling is printed")
    p.add_argument("--seq-segments", type=int, default=None,
                   help="cache segments per device for N > 1 (even; default "
                        "jax_mila.parallel.chunked.DEFAULT_SEGMENTS)")
    p.add_argument("--kv-cache-dtype", choices=("float8_e4m3fn",), default=None,
                   help="full-attention layers' K/V in FP8 (jax_mila backends)")
    p.add_argument("--memory-plan", action="store_true",
                   help="also print XLA's temp-buffer plan of one chunk step (one more compile)")
    p.add_argument("--transformers-device", choices=("cuda", "cpu"), default="cuda",
                   help="where transformers runs when torch has no CUDA (default: skip it)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per backend (default 900)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.seqs = sorted({int(s) for s in args.seqs.split(",") if s.strip()})
        if args.chunk_size == "auto":
            args.chunk_size = None
        elif args.chunk_size != OWN_CHUNK:
            args.chunk_size = int(args.chunk_size)
        args.devices = sorted({int(s) for s in args.devices.split(",") if s.strip()})
    except ValueError as e:
        p.error(f"--seqs / --chunk-size / --devices: {e}")
    if not args.devices or min(args.devices) < 1:
        p.error(f"--devices must be positive counts, got {args.devices}")
    if args.seq_segments is not None and (args.seq_segments < 2 or args.seq_segments % 2):
        p.error(f"--seq-segments must be an even number >= 2, got {args.seq_segments}")
    if not args.seqs or min(args.seqs) < 1:
        p.error(f"--seqs must be positive lengths, got {args.seqs}")
    if isinstance(args.chunk_size, int) and args.chunk_size < 1:
        p.error(f"--chunk-size must be >= 1, auto or {OWN_CHUNK}, got {args.chunk_size}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad or not args.backends:
        p.error(f"--backends: {bad or 'empty'} (supported: {','.join(BACKENDS)})")
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps}, {args.warmup}")
    return args


def main(argv=None, *, prog: str = "benchmarks/prefill.py") -> list[dict]:
    """Runs the benchmark on ``argv`` (default sys.argv[1:]); ``prog``: the command its usage
    and errors name (`python -m jax_mila bench prefill` when run from there)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if serve_worker(argv, _jax_worker, _torch_worker):
        return []
    args = _parse(argv, prog)
    from jax_mila.gemma4.random_init import _config_path

    try:
        config = _config_path(args.model)
    except (FileNotFoundError, OSError) as e:
        sys.exit(f"--model {args.model}: {e}")
    print(f"prefill benchmark: model {args.model} ({config}), seqs {args.seqs}, backends "
          f"{args.backends}, chunk {args.chunk_size or 'auto'}, reps {args.reps}", flush=True)
    rows = []
    for backend in args.backends:
        if backend == "transformers":
            missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
            if missing:
                rows += [dict(backend=backend, seq=s, status=f"skipped: {', '.join(missing)} not installed")
                         for s in args.seqs]
                continue
        for n in args.devices:
            if n > 1 and backend == "transformers":
                rows += [dict(backend=backend, seq=s, devices=n,
                              status="skipped: transformers runs on one device here")
                         for s in args.seqs]
                continue
            spec = dict(backend=backend, model=args.model, seqs=args.seqs,
                        chunk_size=args.chunk_size, memory_budget_gib=args.memory_budget_gib,
                        reps=args.reps, warmup=args.warmup,
                        quantize=None if args.quantize == "none" else args.quantize,
                        embed_dtype=args.embed_dtype, profile=args.profile, seed=args.seed,
                        memory_plan=args.memory_plan, kv_cache_dtype=args.kv_cache_dtype,
                        transformers_device=args.transformers_device, devices=n,
                        seq_segments=args.seq_segments)
            t = time.perf_counter()
            rows += run_worker(spec, args.timeout)
            print(f"  {_label(spec)}: {time.perf_counter() - t:.0f} s", flush=True)
    print()
    print(report(rows, args.backends, args.seqs))
    timing.write_json("prefill", dict(args=vars(args), rows=rows))
    return rows


if __name__ == "__main__":
    main()
