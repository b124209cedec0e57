"""Activation quantizer bandwidth: the CUDA kernel against XLA's fusion of the reference.

Bytes moved per call = 2*M*K (bf16 read) + M*K (e4m3 written) + 4*M (scales), counted against
the H200's 4.8 TB/s. Target (issue 2): >= 80% of it at M=16384, K=15360.

    python benchmarks/quantize.py [--shapes 16384x15360,16384x3840]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from _bench import markdown_table, median_seconds_per_call, write_json  # noqa: E402

from jax_mila import ffi, reference  # noqa: E402

HBM_BYTES_PER_S = 4.8e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x15360,16384x3840,16384x21504,1024x3840")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; kernel: {ffi.status('quantize_activations')}")
    rows, records = [], []
    for spec in args.shapes.split(","):
        m, k = (int(v) for v in spec.split("x"))
        keys = jax.random.split(jax.random.key(0), 3)
        inputs = [(jax.random.normal(kk, (m, k), jnp.bfloat16),) for kk in keys]
        nbytes = 3 * m * k + 4 * m
        result = {"M": m, "K": k}
        for name, op in (("jax_mila", ffi.quantize_activations),
                         ("xla", reference.quantize_activations)):
            t = median_seconds_per_call(op, inputs)
            result[name] = {"us": t * 1e6, "TB/s": nbytes / t / 1e12}
        rows.append([f"{m}x{k}", f"{result['jax_mila']['us']:.1f}",
                     f"{result['jax_mila']['TB/s']:.2f}",
                     f"{100 * result['jax_mila']['TB/s'] * 1e12 / HBM_BYTES_PER_S:.0f}%",
                     f"{result['xla']['us']:.1f}", f"{result['xla']['TB/s']:.2f}"])
        records.append(result)
        del inputs
    write_json("quantize", records)
    print(markdown_table(["M x K", "jax_mila us", "jax_mila TB/s", "of 4.8 TB/s", "XLA us",
                          "XLA TB/s"], rows))


if __name__ == "__main__":
    main()
