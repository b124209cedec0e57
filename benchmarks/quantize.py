"""Activation quantizer bandwidth: the CUDA kernel against XLA's fusion of the reference; and
the fused GEGLU quantizer (quantize_geglu) against what it replaces in a bf16 W4A8 MLP, XLA's
fusion of gelu_tanh(g) * u followed by our quantize_activations.

Bytes moved per call = 2*M*K (bf16 read) + M*K (e4m3 written) + 4*M (scales), counted against
the H200's 4.8 TB/s. Target (issue 2): >= 80% of it at M=16384, K=15360. For quantize_geglu
both columns count the fused op's bytes, 2*2*M*K (gate and up read) + M*K + 4*M, so their TB/s
compare like their times (the unfused pair really moves 9*M*K: it writes and re-reads h).

add_rms_norm_quantize (the decoder layer's norms fused with the quantizer of the W4A8
projections after them) against XLA's norm fusions followed by our quantize_activations, both
columns counting the fused op's bytes:
- with a branch (h + post_attention_layernorm(a) -> pre_feedforward_layernorm -> gate/up):
  2*2*M*K (x and the branch read) + 2*M*K (h written) + M*K (q) + 4*M;
- without (input_layernorm -> q/k/v): 2*M*K + M*K + 4*M.
The unfused pairs move at least 2*M*K more each (the normed rows written and read back), and
more where XLA reads a row once for its sum of squares and again to normalize it.

Times are device time per call (the kernels' durations in a jax.profiler trace, host gaps
excluded), and TB/s comes from them: the smaller shapes take less than JAX's per-call dispatch
on the H200, so wall time per call had a floor of about 20 us (seen at 4096 rows) that was
dispatch, not the kernels. The wall times stay in the tables, labelled dispatch-bound, to show
the difference. On a CPU the trace holds no device kernels: the device columns print "-".

    python benchmarks/quantize.py [--shapes 16384x15360,16384x3840] [--geglu-shapes 4096x15360]
                                  [--norm-shapes 4096x3840,16384x3840]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_mila import ffi, reference
from jax_mila.bench.timing import cell, markdown_table, tb_per_s, time_per_call, write_json
from jax_mila.gemma4.mlp import gelu_tanh
from jax_mila.nn.norm import rms_norm

HBM_BYTES_PER_S = 4.8e12


def _shapes(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in spec.split(",") if s]


def _unfused_geglu(g, u):
    return ffi.quantize_activations(gelu_tanh(g) * u)


EPS = 1e-6


def _norm_weights(k):
    """bf16 norm weights of a checkpoint (1 + a perturbation)."""
    w = 1 + 0.3 * jax.random.normal(jax.random.key(7), (2, k), jnp.float32)
    return w.astype(jnp.bfloat16)


def _norm_candidates(k):
    wb, wn = _norm_weights(k)
    fused_branch = lambda x, a: ffi.add_rms_norm_quantize(  # noqa: E731
        x, a, branch_weight=wb, norm_weight=wn, eps=EPS)

    def unfused_branch(x, a):   # what Gemma4DecoderLayer computed before the op
        h = x + rms_norm(a, wb, EPS)
        return (h,) + ffi.quantize_activations(rms_norm(h, wn, EPS))

    fused = lambda x: ffi.add_rms_norm_quantize(x, norm_weight=wn, eps=EPS)  # noqa: E731
    unfused = lambda x: ffi.quantize_activations(rms_norm(x, wn, EPS))  # noqa: E731
    return ([("jax_mila", fused_branch), ("xla_then_jax_mila", unfused_branch)],
            [("jax_mila", fused), ("xla_then_jax_mila", unfused)])


def _timed_rows(shapes, n_inputs, candidates, nbytes_of):
    """One row per shape: device time and TB/s of each (name, op) on `n_inputs` fresh bf16
    [M, K] arrays per call, then their dispatch-bound wall times; all candidates in the same
    run."""
    rows, records = [], []
    for m, k in shapes:
        keys = jax.random.split(jax.random.key(0), 3 * n_inputs)
        inputs = [tuple(jax.random.normal(kk, (m, k), jnp.bfloat16)
                        for kk in keys[n_inputs * i:n_inputs * (i + 1)]) for i in range(3)]
        nbytes = nbytes_of(m, k)
        result = {"M": m, "K": k}
        for name, op in candidates:
            timing = time_per_call(op, inputs)
            result[name] = {**timing, "TB/s": tb_per_s(nbytes, timing["device_us"])}
        first, second = (result[name] for name, _ in candidates)
        share = None if first["TB/s"] is None else 100 * first["TB/s"] * 1e12 / HBM_BYTES_PER_S
        rows.append([f"{m}x{k}", cell(first["device_us"]), cell(first["TB/s"], ".2f"),
                     cell(share, ".0f", "%"), cell(second["device_us"]),
                     cell(second["TB/s"], ".2f"), cell(first["wall_us"]),
                     cell(second["wall_us"])])
        records.append(result)
        del inputs
    return rows, records


def _header(first: str, second: str) -> list[str]:
    return ["M x K", f"{first} us", f"{first} TB/s", "of 4.8 TB/s", f"{second} us",
            f"{second} TB/s", f"{first} wall us (dispatch-bound)",
            f"{second} wall us (dispatch-bound)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x15360,16384x3840,16384x21504,1024x3840")
    parser.add_argument("--geglu-shapes", default="4096x15360,16384x15360,16384x21504",
                        help="M x K of quantize_geglu (empty: skip)")
    parser.add_argument("--norm-shapes", default="4096x3840,16384x3840",
                        help="M x K of add_rms_norm_quantize (empty: skip)")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; kernel: {ffi.status('quantize_activations')}; "
          f"{ffi.status('quantize_geglu')}; {ffi.status('add_rms_norm_quantize')}")
    rows, records = _timed_rows(
        _shapes(args.shapes), 1,
        [("jax_mila", ffi.quantize_activations), ("xla", reference.quantize_activations)],
        lambda m, k: 3 * m * k + 4 * m)
    geglu_rows, geglu_records = _timed_rows(
        _shapes(args.geglu_shapes), 2,
        [("jax_mila", ffi.quantize_geglu), ("xla_then_jax_mila", _unfused_geglu)],
        lambda m, k: 5 * m * k + 4 * m)
    norm_rows, norm_records, norm_only_rows, norm_only_records = [], [], [], []
    for m, k in _shapes(args.norm_shapes):
        branch, alone = _norm_candidates(k)
        r, rec = _timed_rows([(m, k)], 2, branch, lambda m, k: 7 * m * k + 4 * m)
        norm_rows += r
        norm_records += rec
        r, rec = _timed_rows([(m, k)], 1, alone, lambda m, k: 3 * m * k + 4 * m)
        norm_only_rows += r
        norm_only_records += rec
    write_json("quantize", records)
    if geglu_records:
        write_json("quantize_geglu", geglu_records)
    if norm_records:
        write_json("add_rms_norm_quantize",
                   {"branch": norm_records, "no_branch": norm_only_records})
    print("us: device time per call; TB/s from it; wall us: dispatch-bound wall time per call")
    print(markdown_table(_header("jax_mila", "XLA"), rows))
    if geglu_rows:
        print()
        print("quantize_geglu (fused) vs XLA gelu_tanh(g) * u then quantize_activations; "
              "TB/s of the fused op's bytes for both")
        print(markdown_table(_header("fused", "XLA + quantize"), geglu_rows))
    for title, rows_ in (("with a branch: h = x + rms_norm(a), quantize(rms_norm(h)); XLA: the "
                          "add and both norms, then quantize_activations", norm_rows),
                         ("without: quantize(rms_norm(x)); XLA: the norm, then "
                          "quantize_activations", norm_only_rows)):
        if rows_:
            print()
            print(f"add_rms_norm_quantize (fused) {title}; TB/s of the fused op's bytes for both")
            print(markdown_table(_header("fused", "XLA + quantize"), rows_))


if __name__ == "__main__":
    main()
