"""Prefill attention speed on the Gemma 4 12B shapes: jax_mila kernels vs XLA and cuDNN.

  python benchmarks/attention.py [--only d256|d512|d256,d256_causal] [--seqs 8192,32768] [--reps 7]

Shapes (T = S, B = 1, q_offset = kv_offset = 0, Gemma scale 1.0):
  d512: global layers, Hq=16, Hkv=1, D=512, causal,          S = 4K, 8K, 16K, 32K, 64K
  d256: local layers,  Hq=16, Hkv=8, D=256, causal, W=1024,  S = 8K, 32K, 64K
  d256_causal (only on request): the d256 shape without a window, S = 8K, 16K

d512 also times "mila_rk": the same call with rotary_keys_only=64 (Gemma 4's K=V global layers:
the scores read K only in RoPE's rotated columns, V in the others; Hopper's rotary-keys kernel).

FLOPs = 4 * D * Hq * B * (number of visible (query, key) pairs): the FA convention, so causal
counts the unmasked half and a sliding window only the pairs inside it. Time: median of
--reps timed runs after a warm-up, each ended by jax.block_until_ready. Baselines:
jax.nn.dot_product_attention with implementation="xla" ("OOM" when it does not fit) and
"cudnn" (with local_window_size=(W-1, 0) for the window; "unsupported" where cuDNN refuses,
e.g. D=512). Prints a markdown table last; writes the rows to $OUT/attention.json if OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi

CONFIGS = {
    "d512": dict(d=512, hq=16, hkv=1, window=None, seqs=(4096, 8192, 16384, 32768, 65536),
                 rotary=64),
    "d256": dict(d=256, hq=16, hkv=8, window=1024, seqs=(8192, 32768, 65536), rotary=None),
    # Not a Gemma layer: the local shape without a window, to compare with published
    # FA2/cuDNN causal d=256 numbers (e.g. FA2 ~297 TFLOP/s on H100).
    "d256_causal": dict(d=256, hq=16, hkv=8, window=None, seqs=(8192, 16384), rotary=None),
}
SCALE = 1.0


def visible_pairs(t, s, causal, window, q_offset=0, kv_offset=0) -> int:
    """Number of (query, key) pairs that the mask lets through."""
    qpos = q_offset + np.arange(t, dtype=np.int64)
    hi = np.full(t, s - 1, np.int64)  # last visible key index per row
    lo = np.zeros(t, np.int64)
    if causal:
        hi = np.minimum(hi, qpos - kv_offset)
    if window is not None:
        lo = np.maximum(lo, qpos - kv_offset - window + 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def time_fn(fn, args, reps):
    """Median seconds per call. Each timed run issues `inner` calls back to back (enough for
    ~20 ms) and blocks once, so host dispatch does not pollute millisecond kernels."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, min(50, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def is_oom(e: Exception) -> bool:
    m = str(e)
    return "RESOURCE_EXHAUSTED" in m or "out of memory" in m.lower() or "Out of memory" in m


def bench_one(name, d, hq, hkv, window, s, reps, skip_xla, rotary=None):
    b, t = 1, s
    key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
    kq, kk, kv = jax.random.split(key, 3)
    # Gemma normalises q and k (RMSNorm) and uses scale 1.0: unit-RMS rows / sqrt(D) keeps
    # the logits O(1) so no path hits an unrealistic overflow regime.
    q = (jax.random.normal(kq, (b, t, hq, d)) * d**-0.5).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d)).astype(jnp.bfloat16)
    flops = 4 * d * hq * b * visible_pairs(t, s, True, window)
    row = dict(config=name, B=b, T=t, S=s, Hq=hq, Hkv=hkv, D=d, window=window, causal=True,
               gflop=flops / 1e9)

    impls = {
        "mila": jax.jit(lambda q, k, v: ffi.flash_attention(q, k, v, scale=SCALE, causal=True,
                                                            window=window)),
        "mila_rk": jax.jit(lambda q, k, v: ffi.flash_attention(
            q, k, v, scale=SCALE, causal=True, window=window, rotary_keys_only=rotary)),
        "xla": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=SCALE, is_causal=True, implementation="xla",
            local_window_size=None if window is None else (window - 1, 0))),
        "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=SCALE, is_causal=True, implementation="cudnn",
            local_window_size=None if window is None else (window - 1, 0))),
    }
    for impl, fn in impls.items():
        if impl == "mila_rk" and rotary is None:
            row[f"{impl}_ms"], row[f"{impl}_tflops"] = None, "-"
            continue
        if impl == "xla" and skip_xla:
            row[f"{impl}_ms"], row[f"{impl}_tflops"] = None, "skipped"
            continue
        try:
            sec = time_fn(fn, (q, k, v), reps)
            row[f"{impl}_ms"] = sec * 1e3
            row[f"{impl}_tflops"] = flops / sec / 1e12
        except Exception as e:  # noqa: BLE001  (report the failure kind, keep benchmarking)
            kind = "OOM" if is_oom(e) else "unsupported" if impl == "cudnn" else "error"
            row[f"{impl}_ms"], row[f"{impl}_tflops"] = None, kind
            print(f"  {name} S={s} {impl}: {kind}: {str(e).splitlines()[0][:160]}", flush=True)
        print(f"  {name} S={s} {impl}: {row[f'{impl}_tflops']}", flush=True)
        jax.clear_caches()
    return row


def fmt(x, digits=1):
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help=f"comma-separated configs among {sorted(CONFIGS)} "
                                   "(default: d512 and d256)")
    ap.add_argument("--seqs", help="comma-separated sequence lengths (default: the config's)")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per point (>= 5)")
    ap.add_argument("--skip-xla", action="store_true", help="leave out the XLA baseline")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error("--reps must be >= 5")
    print(f"devices: {jax.devices()}; flash_attention: {ffi.status('flash_attention')}",
          flush=True)

    names = args.only.split(",") if args.only else ["d512", "d256"]
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"--only: unknown config(s) {unknown}; known: {sorted(CONFIGS)}")
    rows = []
    for name in names:
        cfg = CONFIGS[name]
        seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else cfg["seqs"]
        for s in seqs:
            rows.append(bench_one(name, cfg["d"], cfg["hq"], cfg["hkv"], cfg["window"], s,
                                  args.reps, args.skip_xla, cfg["rotary"]))

    print("\n| config | S | Hq/Hkv | D | window | mila ms | mila TFLOP/s | mila rotary-keys "
          "TFLOP/s | cudnn ms | cudnn TFLOP/s | xla ms | xla TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['S']} | {r['Hq']}/{r['Hkv']} | {r['D']} | {r['window']} | "
              f"{fmt(r['mila_ms'], 3)} | {fmt(r['mila_tflops'])} | {fmt(r['mila_rk_tflops'])} | "
              f"{fmt(r['cudnn_ms'], 3)} | "
              f"{fmt(r['cudnn_tflops'])} | {fmt(r['xla_ms'], 3)} | {fmt(r['xla_tflops'])} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
