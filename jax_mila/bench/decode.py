"""End-to-end Gemma 4 decode: tokens/s after a prompt, against the bound HBM sets.

    python3 benchmarks/decode.py [--model 12b] [--prompts 4096,65536] [--batches 1,8]
        [--steps 128] [--backends mila,reference,transformers] [--kv-cache-dtype float8_e4m3fn]
    (also: python -m jax_mila bench decode [same options])

Per backend one worker process (the device to itself), per (prompt, batch) point: a random
prompt [batch, prompt] is prefilled into a cache of prompt + steps + 1 positions (untimed),
then ``gemma4.decode`` runs ``steps`` greedy steps as one compiled program (no stop tokens,
one block: the loop the engine runs when nothing streams). The first decode compiles; each
timed rep prefills a fresh cache (the decode donates it) and times the decode alone to its
last token on the host. tokens/s = batch x steps / the median decode time.

The bound: each step reads every weight once and the cache's keys and values (the part in
use); bytes / a device-to-device copy's bandwidth measured in the same worker (read + write of
1 GiB, device time, median) is the time a step cannot beat. Reported: ms per step, tokens/s and that
bound's tokens/s at batch 1 (fraction = measured / bound).

Op split (default on; --no-profile skips it): one more decode per point under jax.profiler;
per step, GPU kernel time by op (jax_mila/bench/trace.py's buckets), the device's busy and idle
time and the kernels launched: where a step's time goes beside the bound.

transformers: HF Gemma4ForCausalLM (bf16 weights, sdpa, ``cache_implementation="static"``),
``generate(do_sample=False)``; decode time = generate of steps + 1 new tokens minus generate
of 1 (its prefill and first token). CUDA only, skipped with the reason otherwise.

Prints the table last; writes $OUT/decode.json when OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

from jax_mila.bench import prefill as _prefill
from jax_mila.bench import timing, trace

GiB = 2**30
BACKENDS = ("mila", "reference", "transformers")
DEFAULT_PROMPTS = (4096, 65536)
DEFAULT_BATCHES = (1, 8)
MODULE = "jax_mila.bench.decode"


def _points(spec: dict) -> list[tuple[int, int]]:
    return [(p, b) for p in sorted(spec["prompts"]) for b in sorted(spec["batches"])]


def _copy_bandwidth() -> float | None:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write, device time: the copy the
    GEMV benchmark holds its kernels against); None on CPU."""
    seconds = timing.copy_device_seconds(GiB)
    return None if seconds is None else 2 * GiB / seconds


def _cache_bytes_read(cache, length: int) -> int:
    """Bytes a decode step reads of ``cache`` at ``length`` positions: full layers their first
    ``length`` slots, rings all of theirs."""
    total = 0
    for k in list(cache.keys) + list(cache.values):
        if k is None:
            continue
        per_slot = k.nbytes // k.shape[1]
        total += per_slot * min(k.shape[1], length)
    return total


def _jax_worker(spec: dict) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jax_mila import gemma4
    from jax_mila.gemma4 import random_init

    backend = "auto" if spec["backend"] == "mila" else "reference"
    model = random_init.random_model(spec["model"], backend=backend, quantize=spec["quantize"],
                                     seed=spec["seed"])
    jax.block_until_ready(nnx.state(model))
    weights = random_init.weight_bytes(model)
    bandwidth = _copy_bandwidth()
    print(f"{spec['backend']}: model on {jax.devices()[0]}, weights {weights / GiB:.2f} GiB, "
          f"copy bandwidth {bandwidth / 1e12 if bandwidth else float('nan'):.2f} TB/s", flush=True)
    rng = np.random.default_rng(spec["seed"])
    steps = spec["steps"]
    for prompt, batch in _points(spec):
        row = dict(backend=spec["backend"], prompt=prompt, batch=batch, steps=steps,
                   weights_bytes=weights, device=str(jax.devices()[0]),
                   copy_bytes_per_s=bandwidth)
        ids = jnp.asarray(rng.integers(3, model.config.vocab_size, (batch, prompt), np.int32))

        def prefilled():
            logits, cache = gemma4.prefill(model, ids, max_cache_len=prompt + steps + 1,
                                           kv_cache_dtype=spec.get("kv_cache_dtype"))
            first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return jax.block_until_ready((first, cache))

        def decode_time():
            first, cache = prefilled()
            t = time.perf_counter()
            tokens, cache = gemma4.decode(model, first, cache, steps)
            np.asarray(tokens)  # on the host: the tokens a user gets
            return time.perf_counter() - t, cache

        try:
            row["first_s"], cache = decode_time()
            row["cache_bytes_read"] = _cache_bytes_read(cache, prompt + steps // 2)
            del cache
            times = [decode_time()[0] for _ in range(spec["reps"])]
            row["times_s"], row["median_s"] = times, statistics.median(times)
            row["ms_per_step"] = 1e3 * row["median_s"] / steps
            row["tokens_per_s"] = batch * steps / row["median_s"]
            if bandwidth:
                bound_s = (weights + row["cache_bytes_read"]) / bandwidth
                row["bound_tokens_per_s"] = batch / bound_s
            if spec.get("profile"):
                first, cache = prefilled()
                row["split_ms"], row["split_note"] = _prefill._profile(
                    lambda: np.asarray(gemma4.decode(model, first, cache, steps)[0]), trace,
                    what="decode")
                del first, cache
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 -- reported per point
            row["status"] = ("OOM" if _prefill._is_oom(e)
                             else f"error: {type(e).__name__}: {str(e)[:300]}")
        _prefill._emit(row)


def _torch_worker(spec: dict) -> None:
    import torch

    base = dict(backend="transformers", steps=spec["steps"])
    if not torch.cuda.is_available():
        for prompt, batch in _points(spec):
            _prefill._emit(dict(base, prompt=prompt, batch=batch,
                                status="skipped: torch.cuda not available"))
        return
    from jax_mila.gemma4.random_init import _config_path

    model, cfg = _prefill._hf_model(_config_path(spec["model"]), "cuda")
    gen = torch.Generator().manual_seed(spec["seed"])
    steps = spec["steps"]
    for prompt, batch in _points(spec):
        row = dict(base, prompt=prompt, batch=batch, device="cuda")
        ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=gen).to("cuda")

        def generate(new):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               cache_implementation="static")
            torch.cuda.synchronize()
            return time.perf_counter() - t

        try:
            generate(steps + 1), generate(1)   # compile / warm up both
            times = [generate(steps + 1) - generate(1) for _ in range(spec["reps"])]
            row["times_s"], row["median_s"] = times, statistics.median(times)
            row["ms_per_step"] = 1e3 * row["median_s"] / steps
            row["tokens_per_s"] = batch * steps / row["median_s"]
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            row["status"] = ("OOM" if _prefill._is_oom(e)
                             else f"error: {type(e).__name__}: {str(e)[:300]}")
        _prefill._emit(row)


def _summary(row: dict) -> str:
    head = f"{row['backend']:>12} prompt {row['prompt']:>6} batch {row['batch']:>2}"
    if row.get("status") != "ok":
        return f"{head}: {row.get('status')}"
    bound = (f" (bound {row['bound_tokens_per_s']:,.0f})" if row.get("bound_tokens_per_s")
             else "")
    return f"{head}: {row['tokens_per_s']:,.1f} tok/s{bound}, {row['ms_per_step']:.2f} ms/step"


def report(rows: list[dict]) -> str:
    table = []
    for r in rows:
        if r.get("status") != "ok":
            table.append([r["backend"], r["prompt"], r["batch"], r.get("status", "?")[:60],
                          "-", "-", "-"])
            continue
        bound = r.get("bound_tokens_per_s")
        table.append([r["backend"], r["prompt"], r["batch"], f"{r['tokens_per_s']:,.1f}",
                      f"{r['ms_per_step']:.2f}", f"{bound:,.0f}" if bound else "-",
                      f"{100 * r['tokens_per_s'] / bound:.0f}%" if bound else "-"])
    text = _prefill._table(["backend", "prompt", "batch", "tokens/s", "ms/step",
                            "HBM bound tokens/s", "of bound"], table)
    return text + _split_report(rows)


def _split_report(rows: list[dict]) -> str:
    """The profiled decode of each point, per step: GPU kernel time by op, the device's busy
    and idle time (idle: launch latency and waits between kernels), kernels launched."""
    profiled = [r for r in rows if r.get("status") == "ok" and r.get("split_ms")]
    notes = sorted({r["split_note"] for r in rows if r.get("split_note") and not r.get("split_ms")})
    text = []
    if profiled:
        columns = trace.buckets_used([r["split_ms"] for r in profiled])
        table, heaviest = [], []
        for r in profiled:
            ms, steps = r["split_ms"], r["steps"]
            device = next(iter((ms.get("timeline") or {}).values()), {})

            def us(total_ms, steps=steps):
                return f"{1e3 * total_ms / steps:.0f}"
            table.append([r["backend"], r["prompt"], r["batch"], f"{ms['kernels'] / steps:.0f}",
                          us(device["busy_ms"]) if device else "-",
                          us(device["idle_ms"]) if device else "-"] +
                         [us(ms[c]) for c in columns])
            heaviest += [f"{r['backend']} {r['prompt']} x{r['batch']}: {name[:90]} "
                         f"{1e3 * t / steps:.1f} us/step" for name, t in ms.get("top_other", ())]
        text += ["", "GPU time per decode step, us (one profiled decode; busy: kernels, idle: "
                     "the device waiting between them)",
                 _prefill._table(["backend", "prompt", "batch", "kernels/step", "busy", "idle"]
                                 + columns, table)]
        if heaviest:
            text += ["", 'Heaviest kernels in "other"'] + heaviest
    text += [f"op split: {n}" for n in notes]
    return "\n".join([""] + text) if text else ""


def _parse(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="12b", help="model card or directory (default 12b)")
    p.add_argument("--prompts", default=",".join(map(str, DEFAULT_PROMPTS)),
                   help="prompt lengths, comma-separated")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)),
                   help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed (default 128)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    p.add_argument("--reps", type=int, default=3, help="timed runs per point (default 3)")
    p.add_argument("--quantize", choices=("w4a8", "none"), default="w4a8")
    p.add_argument("--kv-cache-dtype", choices=("float8_e4m3fn",), default=None,
                   help="full-attention layers' K/V in FP8 (jax_mila backends)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the op split (one more decode per point under jax.profiler)")
    args = p.parse_args(argv)
    try:
        args.prompts = sorted({int(s) for s in args.prompts.split(",") if s.strip()})
        args.batches = sorted({int(s) for s in args.batches.split(",") if s.strip()})
    except ValueError as e:
        p.error(f"--prompts / --batches: {e}")
    if not args.prompts or min(args.prompts) < 1 or not args.batches or min(args.batches) < 1:
        p.error(f"--prompts and --batches must be positive, got {args.prompts}, {args.batches}")
    if args.steps < 1 or args.reps < 1:
        p.error(f"--steps and --reps must be >= 1, got {args.steps}, {args.reps}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad or not args.backends:
        p.error(f"--backends: {bad or 'empty'} (supported: {','.join(BACKENDS)})")
    return args


def main(argv=None, *, prog: str = "benchmarks/decode.py") -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _prefill.serve_worker(argv, _jax_worker, _torch_worker):
        return []
    args = _parse(argv, prog)
    print(f"decode benchmark: model {args.model}, prompts {args.prompts}, batches "
          f"{args.batches}, {args.steps} steps, backends {args.backends}", flush=True)
    rows = []
    for backend in args.backends:
        spec = dict(backend=backend, model=args.model, prompts=args.prompts,
                    batches=args.batches, steps=args.steps, reps=args.reps,
                    quantize=None if args.quantize == "none" else args.quantize,
                    kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                    profile=args.profile)
        expected = [dict(prompt=p, batch=b) for p, b in _points(spec)]
        if backend == "transformers":
            missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
            if missing:
                rows += [dict(backend=backend, **e, status=f"skipped: {', '.join(missing)} "
                                                           f"not installed") for e in expected]
                continue
        rows += _prefill.run_worker(spec, args.timeout, module=MODULE, expected=expected,
                                    summary=_summary)
    print()
    print(report(rows))
    timing.write_json("decode", dict(args=vars(args), rows=rows))
    return rows


if __name__ == "__main__":
    main()
