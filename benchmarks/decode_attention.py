"""Decode attention speed on Gemma 4 decode shapes: jax_mila.ffi.decode_attention (the kernel)
against the current path (the ring rolled into position order, the cache cast to bf16, then
flash_attention), with the bandwidth of a device-to-device copy measured in the same run.

  python benchmarks/decode_attention.py [--only 12b_global,31b_sliding] [--lens 4096,131072]
                                        [--batches 1,8] [--dtypes bf16,fp8] [--tokens 1]

Shapes (T new tokens per row, every row at kv_len, Gemma scale 1.0):
  12b_global:  Hq=16, Hkv=1,  D=512, rotary_keys_only=64 (K=V), cache of kv_len slots
  31b_global:  Hq=32, Hkv=4,  D=512, rotary_keys_only=64 (K=V), cache of kv_len slots
  12b_sliding: Hq=16, Hkv=8,  D=256, window 1024, a ring of 1024 + T - 1 slots
  31b_sliding: Hq=32, Hkv=16, D=256, window 1024, a ring of 1024 + T - 1 slots
"bytes" is what the kernel must read from the cache: per row and KV head, the visible keys
times (V's D columns + K's 2 r rotated columns, or all D without rotary_keys_only) times the
cache's element size; GB/s = bytes / device time; "of copy" divides that by the copy's
bandwidth (a jitted x + 1 over --copy-mib (1 GiB) of bf16: bytes read + written per second). Device time:
kernel time per call from a profiler trace (jax_mila/bench/timing.py), wall time beside it.
Prints a markdown table; writes the rows to $OUT/decode_attention.json if OUT is set.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi
from jax_mila.bench import timing

CONFIGS = {
    "12b_global": dict(hq=16, hkv=1, d=512, window=None, rotary=64),
    "31b_global": dict(hq=32, hkv=4, d=512, window=None, rotary=64),
    "12b_sliding": dict(hq=16, hkv=8, d=256, window=1024, rotary=None),
    "31b_sliding": dict(hq=32, hkv=16, d=256, window=1024, rotary=None),
}
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def cache_bytes(cfg, b, t, kv_len, itemsize) -> int:
    """Bytes of K and V a step must read (see the module doc)."""
    keys = kv_len if cfg["window"] is None else min(kv_len, cfg["window"] + t - 1)
    k_cols = cfg["d"] if cfg["rotary"] is None else 2 * cfg["rotary"]
    return b * cfg["hkv"] * keys * (cfg["d"] + k_cols) * itemsize


def copy_gb_per_s(nbytes: int) -> float:
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    t = timing.time_per_call(lambda x: x + jnp.bfloat16(1), [(x,)])
    us = t["device_us"] or t["wall_us"]
    return 2 * nbytes / us / 1e3


def make_inputs(cfg, b, t, kv_len, dtype, seed=0):
    rng = np.random.default_rng(seed)
    s = kv_len if cfg["window"] is None else cfg["window"] + t - 1
    q = jnp.asarray(rng.standard_normal((b, t, cfg["hq"], cfg["d"]), np.float32), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(seed), (b, s, cfg["hkv"], cfg["d"]), jnp.bfloat16).astype(dtype)
    v = jax.random.normal(jax.random.key(seed + 1), (b, s, cfg["hkv"], cfg["d"]),
                          jnp.bfloat16).astype(dtype)
    return q, k, v, jnp.full((b,), kv_len, jnp.int32)


def kernel_op(cfg):
    ring = cfg["window"] is not None

    def op(q, k, v, kv_len):
        return ffi.decode_attention(q, k, v, kv_len, scale=1.0, window=cfg["window"], ring=ring,
                                    rotary_keys_only=cfg["rotary"])
    return op


def current_op(cfg, kv_len):
    """The path before the kernel: every row at the same kv_len (flash_attention takes scalar
    offsets), the ring rolled into position order, an FP8 cache cast to bf16 first."""

    def op(q, k, v, n):
        del n
        t, s = q.shape[1], k.shape[1]
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        if cfg["window"] is not None:  # oldest slot first: positions kv_len - S .. kv_len - 1
            shift = kv_len % s
            k, v = jnp.roll(k, -shift, axis=1), jnp.roll(v, -shift, axis=1)
            kv_offset = kv_len - s
        else:
            kv_offset = 0
        return ffi.flash_attention(q, k, v, scale=1.0, causal=True, window=cfg["window"],
                                   q_offset=kv_len - t, kv_offset=kv_offset,
                                   rotary_keys_only=cfg["rotary"])
    return op


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--lens", default="4096,65536,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the reference copy")
    args = parser.parse_args(argv)
    t = args.tokens
    copy = copy_gb_per_s(args.copy_mib << 20)
    print(f"device: {jax.devices()[0].device_kind}; copy {copy:.0f} GB/s (read + write)",
          file=sys.stderr)
    rows = []
    for name in args.only.split(","):
        cfg = CONFIGS[name]
        for dname in args.dtypes.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                for kv_len in (int(x) for x in args.lens.split(",")):
                    inputs = make_inputs(cfg, b, t, kv_len, DTYPES[dname])
                    nbytes = cache_bytes(cfg, b, t, kv_len, np.dtype(DTYPES[dname]).itemsize)
                    row = dict(config=name, dtype=dname, batch=b, tokens=t, kv_len=kv_len,
                               bytes=nbytes, copy_gb_s=copy)
                    for path, op in (("mila", kernel_op(cfg)), ("current", current_op(cfg, kv_len))):
                        try:
                            tm = timing.time_per_call(op, [inputs])
                        except Exception as e:  # noqa: BLE001 - an OOM or a refusal is a cell
                            row[path] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                            continue
                        us = tm["device_us"] or tm["wall_us"]
                        row[path] = dict(device_us=tm["device_us"], wall_us=tm["wall_us"],
                                         gb_s=nbytes / us / 1e3)
                    rows.append(row)
                    del inputs
    header = ["shape", "cache", "B", "kv_len", "MB read", "mila us", "GB/s", "of copy",
              "current us", "speedup"]
    table = []
    for r in rows:
        m, c = r.get("mila", {}), r.get("current", {})
        m_us = m.get("device_us") or m.get("wall_us")
        c_us = c.get("device_us") or c.get("wall_us")
        table.append([r["config"], r["dtype"], r["batch"], r["kv_len"],
                      timing.cell(r["bytes"] / 1e6, ".1f"),
                      timing.cell(m_us, ".1f") if m_us else m.get("error", "-"),
                      timing.cell(m.get("gb_s"), ".0f"),
                      timing.cell(m["gb_s"] / copy if m.get("gb_s") else None, ".2f"),
                      timing.cell(c_us, ".1f") if c_us else c.get("error", "-"),
                      timing.cell(c_us / m_us if m_us and c_us else None, ".2f", "x")])
    print(timing.markdown_table(header, table))
    timing.write_json("decode_attention", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
