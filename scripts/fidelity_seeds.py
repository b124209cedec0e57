"""tests/test_fidelity.py's tiny fidelity run for many seeds, one markdown row each: what
calibrates the test's NOISE_MULTIPLE (the kernel path's per-layer error in units of the noise
floor) on a GPU.

    python3 scripts/fidelity_seeds.py --seeds 20            # seeds 0..19
    python3 scripts/fidelity_seeds.py --seeds 8 --first 331020728

Columns: the largest per-layer error of the kernel path and of the noise floor, the largest
per-layer ratio of the two (and its layer), the kernel's and the floor's worst logit cosine,
whether the chunked prefill's top-1 and greedy generate equal the reference's, and, where a
greedy pick differs, the reference's margin, the paths' largest logit difference and the
noise floor's there (near tie: margin <= the paths' difference; margin / floor: what
NOISE_MULTIPLE must cover). A last line gives the largest of each over the seeds. On a CPU the
kernel path is the reference: every ratio is 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

import numpy as np

try:  # the installed package: it holds the built CUDA extension
    from jax_mila.gemma4 import fidelity
    if not hasattr(fidelity, "NOISE_FLOOR_RATE"):
        raise ImportError("an install older than the noise floor")
except ImportError:  # not installed, or older: the checkout (no kernels unless built in place)
    for name in [m for m in sys.modules if m == "jax_mila" or m.startswith("jax_mila.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jax_mila.gemma4 import fidelity

# The test's arguments (tests/test_fidelity.py ARGS), --seed and --out added per run.
ARGS = ["--model", "tiny", "--tokens", "40", "--logit-rows", "16", "--prefill-chunk", "16",
        "--generate-tokens", "6", "--noise-floor"]
HEADER = ("| seed | max kernel layer err | max floor layer err | max kernel/floor (layer) | "
          "cosine min kernel / floor | chunked top-1 equal | generate equal | "
          "near tie / margins |\n|---|---|---|---|---|---|---|---|")


def run_seed(seed: int) -> dict:
    """fidelity.main's JSON for one seed (its printed table swallowed), with its rc."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fidelity.json")
        with contextlib.redirect_stdout(io.StringIO()):
            rc = fidelity.main(ARGS + ["--seed", str(seed), "--out", out])
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="how many seeds")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    args = p.parse_args(argv)
    # Which package runs, and with which kernels: a stale install falls back to the checkout,
    # which has none unless built in place (then every ratio is 0).
    print(f"jax_mila from {os.path.dirname(fidelity.__file__)}; kernels: "
          + "; ".join(str(st) for st in fidelity.ffi.available().values()) + "\n")
    print(HEADER, flush=True)
    needs = []
    for seed in range(args.first, args.first + args.seeds):
        line, need = row(seed, run_seed(seed))
        needs.append(need)
        print(line, flush=True)
    print(f"\nover {len(needs)} seeds, the largest kernel/floor ratio per layer "
          f"{max(n['layer'] for n in needs):.3f}, sqrt((1 - cos) / (1 - floor cos)) "
          f"{max(n['cosine'] for n in needs):.3f}, margin/floor at a flip "
          f"{max(n['margin'] for n in needs):.3f}: what tests/test_fidelity.py NOISE_MULTIPLE "
          "must cover")
    return 0


if __name__ == "__main__":
    sys.exit(main())
