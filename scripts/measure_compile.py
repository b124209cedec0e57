"""Measures trace/lower/compile time of the Gemma 4 forward for released configs, with
abstract weights (nothing is allocated). Usage:

    python scripts/measure_compile.py 12b 31b [--seq 2048] [--dtype bfloat16] [--what forward prefill decode] [--no-compile]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import gemma4
from jax_mila.engine.jitted import decode_steps, forward_step, model_args, prefill_step


def measure(size: str, seq: int, dtype, compile_: bool, what: str) -> dict:
    cfg = gemma4.Gemma4Config.from_pretrained(gemma4.model_card(size))
    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: gemma4.Gemma4ForCausalLM(cfg, dtype=dtype, backend="auto"))
    structure, weights = model_args(model)  # what forward / prefill / decode pass their step
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    t1 = time.perf_counter()
    if what == "forward":
        lowered = forward_step.lower(structure, weights, ids)
    elif what == "prefill":
        lowered = prefill_step.lower(structure, weights, ids, seq)
    else:  # decode: a scan of 8 greedy steps over a cache sized for seq positions
        _, cache = jax.eval_shape(lambda w, x: prefill_step(structure, w, x, seq), weights,
                                  jax.ShapeDtypeStruct((1, seq - 8), jnp.int32))
        token = jax.ShapeDtypeStruct((1,), jnp.int32)
        lowered = decode_steps.lower(structure, weights, cache, token, 8)
    t2 = time.perf_counter()
    row = dict(size=size, what=what, layers=cfg.num_hidden_layers, seq=seq,
               build_s=round(t1 - t0, 2), lower_s=round(t2 - t1, 2))
    if compile_:
        lowered.compile()
        row["compile_s"] = round(time.perf_counter() - t2, 2)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sizes", nargs="+")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--what", choices=("forward", "prefill", "decode"), nargs="+", default=["forward"])
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    print(f"backend: {jax.default_backend()}")
    for size in a.sizes:
        for what in a.what:
            print(measure(size, a.seq, jnp.dtype(a.dtype), not a.no_compile, what), flush=True)


if __name__ == "__main__":
    main()
