"""Host time of one chunked prefill, phase by phase: what the device waits for before its
first kernel (splitting the model into graph and state, the jitted step's argument handling)
and how long each chunk's dispatch takes against the device's time per chunk.

    python3 scripts/host_overhead.py [--model 12b] [--seq 32768] [--chunk 4096] [--reps 3]

The prefill benchmark's device timeline (jax_mila.bench.trace.timeline) shows the first
chunk's dispatch as one idle gap; this script names its parts. Diagnostic, not a benchmark:
every number is a best-of-reps host wall time.
"""

from __future__ import annotations

import argparse
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4 import random_init

generate = importlib.import_module("jax_mila.gemma4.generate")


def _best_ms(fn, reps: int):
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="12b")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    model = random_init.random_model(args.model, quantize="w4a8")
    ids = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size,
                                                        (1, args.seq), dtype=np.int32))
    jax.block_until_ready(generate.prefill(model, ids, chunk_size=args.chunk))  # compile

    split_ms, (graphdef, state) = _best_ms(lambda: nnx.split(model), args.reps)
    hash_ms, _ = _best_ms(lambda: hash(graphdef), args.reps)
    other, _ = nnx.split(model)
    eq_ms, _ = _best_ms(lambda: graphdef == other, args.reps)
    flatten_ms, _ = _best_ms(lambda: jax.tree.flatten(state), args.reps)
    print(f"| nnx.split | {split_ms:.1f} ms | leaves {len(jax.tree.leaves(state))} |")
    print(f"| hash(graphdef) | {hash_ms:.1f} ms | |")
    print(f"| graphdef == graphdef (a jit cache hit) | {eq_ms:.1f} ms | |")
    print(f"| flatten state | {flatten_ms:.1f} ms | |")

    step = generate.chunk_step_fn(model)
    chunks = args.seq // args.chunk
    for rep in range(args.reps):
        cache = kv.empty(model.config, 1, args.seq, model.dtype)
        jax.block_until_ready(cache)
        dispatch = []
        t0 = time.perf_counter()
        for c in range(chunks):
            t = time.perf_counter()
            logits, cache = step(graphdef, state, cache, ids[:, c * args.chunk:(c + 1) * args.chunk],
                                 jnp.int32(args.chunk))
            dispatch.append(1e3 * (time.perf_counter() - t))
        jax.block_until_ready(logits)
        total = 1e3 * (time.perf_counter() - t0)
        print(f"| rep {rep}: step dispatch per chunk | "
              + " ".join(f"{d:.1f}" for d in dispatch) + f" ms | total {total:.1f} ms |")


if __name__ == "__main__":
    main()
