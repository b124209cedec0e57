"""Kernel path against reference path on the same random weights: final logits, every layer's
output, a chunked prefill's last logits and greedy generate (jax_mila.gemma4.fidelity).

    python3 scripts/fidelity.py --model 12b --tokens 8192          # GPU: the 12B shapes at 8K
    python3 scripts/fidelity.py --model tiny --tokens 64           # CPU smoke run
    python3 scripts/fidelity.py --seeds 20                         # calibration sweep

One run prints a table (rows start with "| ", what scripts/gpu_round.sh shows) and writes
the result as JSON (--out, default $OUT/fidelity.json); exit status 1 when greedy generate
differs from the reference path. On a machine without the kernels both paths are the reference
and every error is 0.

--seeds N runs tests/test_fidelity.py's tiny configuration (ARGS below) for N seeds from
--first and prints one markdown row each, then the largest ratios to the noise floor: what that
test's NOISE_MULTIPLE must cover on a GPU. The other options are ignored then.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile

import numpy as np

from jax_mila import ffi
from jax_mila.gemma4 import fidelity

# tests/test_fidelity.py's arguments (its ARGS), to which --seeds adds --seed and --out per run.
ARGS = ["--model", "tiny", "--tokens", "40", "--logit-rows", "16", "--prefill-chunk", "16",
        "--generate-tokens", "6", "--noise-floor"]
HEADER = ("| seed | max kernel layer err | max floor layer err | max kernel/floor (layer) | "
          "cosine min kernel / floor | chunked top-1 equal | generate equal | "
          "near tie / margins |\n|---|---|---|---|---|---|---|---|")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="12b", choices=fidelity.SIZES)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=None, help="first N layers only (default: all)")
    p.add_argument("--quantize", default="w4a8", choices=["w4a8", "none"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-rows", type=int, default=1024, help="rows per logits block")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="chunk of the kernel prefill compared at the last position (0: skip)")
    p.add_argument("--generate-tokens", type=int, default=32, help="0: skip the generate check")
    p.add_argument("--noise-floor", action="store_true",
                   help="also the reference against itself under one-ulp quantizer noise (one "
                        "more reference forward; see fidelity.NOISE_FLOOR_RATE)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/fidelity.json)")
    p.add_argument("--seeds", type=int, default=None,
                   help="calibration sweep: this many seeds of the test's tiny run, a row each")
    p.add_argument("--first", type=int, default=0, help="the sweep's first seed (default 0)")
    return p


def run_once(args) -> int:
    """One fidelity run: its table on stdout, its JSON at --out; 1 when generate differs."""
    result = fidelity.run(args.model, tokens=args.tokens, layers=args.layers,
                          quantize=None if args.quantize == "none" else args.quantize,
                          seed=args.seed, logit_rows=args.logit_rows,
                          prefill_chunk=args.prefill_chunk,
                          generate_tokens=args.generate_tokens, noise_floor=args.noise_floor)
    print(fidelity.format_table(result))
    out = args.out or os.path.join(os.environ.get("OUT", "."), "fidelity.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0 if result.get("generate", {}).get("equal", True) else 1


def run_seed(seed: int) -> dict:
    """The test's tiny run for one seed: its JSON (its printed table swallowed), with its rc."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fidelity.json")
        with contextlib.redirect_stdout(io.StringIO()):
            rc = run_once(_parser().parse_args(ARGS + ["--seed", str(seed), "--out", out]))
        with open(out) as f:
            result = json.load(f)
    result["rc"] = rc
    return result


def _margins(d: dict) -> str:
    return (f"{'near tie' if d['near_tie'] else 'DIVERGED'}: margin {d['reference_margin']:.3g}, "
            f"paths {d['max_abs_logit_diff']:.3g}, floor {d['noise_floor_max_abs_logit_diff']:.3g}"
            f" (margin/floor {d['margin_over_noise_floor']:.2f})")


def row(seed: int, result: dict) -> tuple[str, dict]:
    """The markdown row of one seed's result, and the ratios NOISE_MULTIPLE must cover."""
    f, g = result["forward"], result["generate"]
    err = np.asarray(f["layer_rel_err"])
    floor = np.asarray(f["noise_floor_layer_rel_err"])
    ratio = err / np.maximum(floor, 1e-30)
    worst = int(ratio.argmax())
    cos, floor_cos = f["logits"]["cosine_min"], f["noise_floor_logits"]["cosine_min"]
    c = f["chunked_prefill_last_logits"]
    flips = [(name, check["divergence"]) for name, check in (("chunked", c), ("generate", g))
             if "divergence" in check]
    cells = [str(seed), f"{err.max():.3e}", f"{floor.max():.3e}", f"{ratio[worst]:.3f} ({worst})",
             f"{cos:.6f} / {floor_cos:.6f}", str(c["top1_equal"]), str(g["equal"]),
             "; ".join(f"{name} {_margins(d)}" for name, d in flips)]
    # The test bounds 1 - cos by the multiple squared: in the multiple's units, the square root.
    need = dict(layer=float(ratio[worst]),
                cosine=float(np.sqrt(max(1 - cos, 0) / max(1 - floor_cos, 1e-30))),
                margin=max([d["margin_over_noise_floor"] for _, d in flips], default=0.0))
    return "| " + " | ".join(cells) + " |", need


def sweep(first: int, count: int) -> int:
    """--seeds: a row per seed of the test's tiny run, then the ratios NOISE_MULTIPLE covers."""
    print(f"jax_mila from {os.path.dirname(fidelity.__file__)}; kernels: "
          + "; ".join(str(st) for st in ffi.available().values()) + "\n")
    print(HEADER, flush=True)
    needs = []
    for seed in range(first, first + count):
        line, need = row(seed, run_seed(seed))
        needs.append(need)
        print(line, flush=True)
    print(f"\nover {len(needs)} seeds, the largest kernel/floor ratio per layer "
          f"{max(n['layer'] for n in needs):.3f}, sqrt((1 - cos) / (1 - floor cos)) "
          f"{max(n['cosine'] for n in needs):.3f}, margin/floor at a flip "
          f"{max(n['margin'] for n in needs):.3f}: what tests/test_fidelity.py NOISE_MULTIPLE "
          "must cover")
    return 0


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.seeds is not None:
        if args.seeds < 1:
            p.error(f"--seeds must be >= 1, got {args.seeds}")
        return sweep(args.first, args.seeds)
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    try:
        fidelity.model_config(args.model, args.layers)  # --layers within the model's
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_once(args)


if __name__ == "__main__":
    sys.exit(main())
