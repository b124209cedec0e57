"""Host time of one chunked prefill, phase by phase: what the device waits for before its
first kernel (taking the model apart for the jitted step, the step's argument handling) and
how long each chunk's dispatch takes against the device's time per chunk.

    python3 scripts/host_overhead.py [--model 12b] [--seq 32768] [--chunk 4096] [--reps 3] [--small]
    python3 scripts/host_overhead.py --arg-sweep [--reps 3]

Two ways of passing the model to the chunk step, side by side:
- graph: nnx.split(model) -> (GraphDef, State), the GraphDef a static argument that jit hashes
  and compares at every call;
- tree: jitted.model_args(model), what prefill passes: the model's pytree treedef
  (static, cheap to hash) and its array leaves, one flatten per prefill call.
"prepare" is the per-call cost of taking the model apart; the dispatch columns are each chunk's
step call, until it returns (the device runs asynchronously).

The prefill benchmark's device timeline (jax_mila.bench.trace.timeline) shows the first
chunk's dispatch as one idle gap; this script names its parts. Diagnostic, not a benchmark:
every number is a best-of-reps host wall time. ``--small`` keeps the card's layers but shrinks
the widths (hidden 256, MLP 512, vocab 1024), so it runs on a CPU: host costs scale with the
number of modules and arrays, not their sizes. ``--arg-sweep`` times only the dispatch of a
jit against its number of array arguments (the chunk step takes the 12B as 1,322), with and
without a donated argument, to tell per-argument cost from the step's own launch.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila import gemma4
from jax_mila.engine import jitted
from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4 import random_init
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.paths import model_card

SMALL_WIDTHS = dict(hidden_size=256, intermediate_size=512, vocab_size=1024)


def _best_ms(fn, reps: int):
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best, out


def _config(name: str, small: bool):
    if not small:
        return name
    with open(model_card(name)) as f:
        raw = json.load(f)
    raw.get("text_config", raw).update(SMALL_WIDTHS)
    return Gemma4Config.from_dict(raw)


def _chunks(model, step, prepare, ids, chunk: int):
    """One prefill's chunks: (prepare ms, dispatch ms per chunk, total ms until the last one's
    hidden state)."""
    cache = kv.empty(model.config, ids.shape[0], ids.shape[1], model.dtype)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    structure, weights = prepare()
    prepared = time.perf_counter()
    dispatch = []
    for c in range(ids.shape[1] // chunk):
        t = time.perf_counter()
        last, cache = step(structure, weights, cache, ids[:, c * chunk:(c + 1) * chunk],
                           jnp.int32(chunk))
        dispatch.append(1e3 * (time.perf_counter() - t))
    jax.block_until_ready(last)
    return 1e3 * (prepared - t0), dispatch, 1e3 * (time.perf_counter() - t0)


def arg_sweep(reps: int, counts=(1, 64, 256, 1322, 2644)) -> None:
    """Host ms of one call of a jit taking n arrays (each read once, one small output), the
    same arrays every call, after a warm-up call; "donated": a fresh 4 MiB first argument
    (its creation included) donated and returned, as the chunk step does with its cache."""
    print("| arrays | dispatch ms | until done ms | donated: dispatch ms | until done ms |")
    print("|---|---|---|---|---|")
    for n in counts:
        arrays = [jnp.full((256,), i, jnp.float32) for i in range(n)]
        plain = jax.jit(lambda *xs: sum(x[0] for x in xs))
        donated = jax.jit(lambda c, *xs: (c + 1, sum(x[0] for x in xs)), donate_argnums=0)
        jax.block_until_ready(plain(*arrays))
        jax.block_until_ready(donated(jnp.zeros((1 << 20,)), *arrays))
        row = []
        for fn in (lambda: plain(*arrays), lambda: donated(jnp.zeros((1 << 20,)), *arrays)):
            best_dispatch, best_done = float("inf"), float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                out = fn()
                dispatched = time.perf_counter()
                jax.block_until_ready(out)
                best_dispatch = min(best_dispatch, dispatched - t)
                best_done = min(best_done, time.perf_counter() - t)
            row += [f"{1e3 * best_dispatch:.2f}", f"{1e3 * best_done:.2f}"]
        print(f"| {n} | " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="12b")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--small", action="store_true", help="the card's layers, CPU-sized widths")
    p.add_argument("--arg-sweep", action="store_true",
                   help="only the dispatch time of a jit against its number of array arguments")
    args = p.parse_args()
    if args.arg_sweep:
        arg_sweep(args.reps)
        return

    model = random_init.random_model(_config(args.model, args.small), quantize="w4a8")
    ids = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size,
                                                        (1, args.seq), dtype=np.int32))
    jax.block_until_ready(gemma4.prefill(model, ids, chunk_size=args.chunk))  # compile

    split_ms, (graphdef, state) = _best_ms(lambda: nnx.split(model), args.reps)
    hash_ms, _ = _best_ms(lambda: hash(graphdef), args.reps)
    other, _ = nnx.split(model)
    eq_ms, _ = _best_ms(lambda: graphdef == other, args.reps)
    flatten_ms, _ = _best_ms(lambda: jax.tree.flatten(state), args.reps)
    args_ms, (treedef, leaves) = _best_ms(lambda: jitted.model_args(model), args.reps)
    tree_mode = isinstance(treedef, jax.tree_util.PyTreeDef)
    tree_hash_ms, _ = _best_ms(lambda: hash(treedef), args.reps)
    other, _ = jitted.model_args(model)
    tree_eq_ms, _ = _best_ms(lambda: treedef == other, args.reps)
    print(f"| nnx.split | {split_ms:.1f} ms | leaves {len(jax.tree.leaves(state))} |")
    print(f"| hash(graphdef) | {hash_ms:.1f} ms | |")
    print(f"| graphdef == graphdef (a jit cache hit) | {eq_ms:.1f} ms | |")
    print(f"| flatten state | {flatten_ms:.1f} ms | |")
    print(f"| model_args ({'tree' if tree_mode else 'graph: no tree mode here'}) "
          f"| {args_ms:.1f} ms | leaves {len(jax.tree.leaves(leaves))} |")
    print(f"| hash(treedef) | {tree_hash_ms:.2f} ms | |")
    print(f"| treedef == treedef | {tree_eq_ms:.2f} ms | |")

    step = jitted.chunk_step_fn(model)
    paths = {"graph": lambda: nnx.split(model), "tree": lambda: jitted.model_args(model)}
    _chunks(model, step, paths["graph"], ids, args.chunk)  # compiles the graph path's step
    for rep in range(args.reps):
        for name, prepare in paths.items():
            prep, dispatch, total = _chunks(model, step, prepare, ids, args.chunk)
            print(f"| rep {rep} {name}: prepare {prep:.1f} ms, step dispatch per chunk | "
                  + " ".join(f"{d:.1f}" for d in dispatch) + f" ms | total {total:.1f} ms |")


if __name__ == "__main__":
    main()
