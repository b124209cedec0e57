"""The attention layers' q/k norm + RoPE: rms_norm_rope (one kernel) against what it replaces,
XLA's fusions of apply_rope(rms_norm(x, w), cos, sin) (a norm pass and a RoPE pass).

Bytes per call, counted for both columns: 2 * 2 * rows * D (x read, the result written) +
2 * 2 * T * D (cos and sin read once per token) + 4 * D (the weight). The unfused pair moves
the normed x twice more (written by the norm, read by the RoPE).

Shapes are [T, H, D] of one 4096-token prefill chunk of the 12B: the sliding layers' q and k
(16 and 8 heads of 256) and the global layers' q and k (16 heads and 1 head of 512).

Times are device time per call (the kernels' durations in a jax.profiler trace, host gaps
excluded), and TB/s comes from them: these ops take a few us, less than JAX's per-call
dispatch on the H200, so wall time per call measured dispatch (about 70 us for both columns).
The wall times stay in the table, labelled dispatch-bound, to show the difference. On a CPU
the trace holds no device kernels: the device columns print "-".

    python benchmarks/norm_rope.py [--shapes 4096x16x256,4096x8x256,4096x16x512,4096x1x512]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_mila import ffi
from jax_mila.bench.timing import cell, markdown_table, tb_per_s, time_per_call, write_json
from jax_mila.gemma4.config import RopeSpec
from jax_mila.gemma4.rope import apply_rope, rope_tables
from jax_mila.nn.norm import rms_norm

HBM_BYTES_PER_S = 4.8e12
EPS = 1e-6


def _shapes(spec: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in spec.split(",") if s]


def _inputs(t, h, d, n=3):
    """``n`` fresh x [1, T, H, D] (several, so that L2 does not serve repeats) with one weight
    and one pair of Gemma 4 tables."""
    keys = jax.random.split(jax.random.key(0), n + 1)
    w = (1 + 0.3 * jax.random.normal(keys[0], (d,), jnp.float32)).astype(jnp.bfloat16)
    cos, sin = rope_tables(RopeSpec(theta=1e4, head_dim=d, rotated=d // 2),
                           jnp.arange(t, dtype=jnp.int32), jnp.bfloat16)
    return [(jax.random.normal(k, (1, t, h, d), jnp.bfloat16), w, cos, sin) for k in keys[1:]]


def fused(x, w, cos, sin):
    return ffi.rms_norm_rope(x, w, cos, sin, eps=EPS)


def unfused(x, w, cos, sin):  # what Gemma4Attention computed before the op
    return apply_rope(rms_norm(x, w, EPS), cos, sin)


def _row(t, h, d, result) -> list[str]:
    fused, xla = result["jax_mila"], result["xla"]
    speed_up = (None if fused["device_us"] is None or xla["device_us"] is None
                else xla["device_us"] / fused["device_us"])
    share = None if fused["TB/s"] is None else 100 * fused["TB/s"] * 1e12 / HBM_BYTES_PER_S
    return [f"{t}x{h}x{d}", cell(fused["device_us"]), cell(fused["TB/s"], ".2f"),
            cell(share, ".0f", "%"), cell(xla["device_us"]), cell(xla["TB/s"], ".2f"),
            cell(speed_up, ".2f", "x"), cell(fused["wall_us"]), cell(xla["wall_us"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x16x256,4096x8x256,4096x16x512,4096x1x512",
                        help="T x H x D of each case")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; kernel: {ffi.status('rms_norm_rope')}")
    rows, records = [], []
    for t, h, d in _shapes(args.shapes):
        inputs = _inputs(t, h, d)
        nbytes = 4 * t * h * d + 4 * t * d + 4 * d
        result = {"T": t, "H": h, "D": d}
        for name, op in (("jax_mila", fused), ("xla", unfused)):
            timing = time_per_call(op, inputs)
            result[name] = {**timing, "TB/s": tb_per_s(nbytes, timing["device_us"])}
        records.append(result)
        rows.append(_row(t, h, d, result))
        del inputs
    write_json("norm_rope", records)
    print("rms_norm_rope (fused) vs XLA's rms_norm then apply_rope; us: device time per call; "
          "TB/s of the fused op's bytes in device time for both; wall us: dispatch-bound wall "
          "time per call")
    print(markdown_table(["T x H x D", "fused us", "fused TB/s", "of 4.8 TB/s", "XLA us",
                          "XLA TB/s", "speed-up", "fused wall us (dispatch-bound)",
                          "XLA wall us (dispatch-bound)"], rows))


if __name__ == "__main__":
    main()
