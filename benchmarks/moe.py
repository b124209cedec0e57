"""The 26B-A4B's expert GEMMs: grouped W4A8 (jax_mila.ffi.grouped_w4a8_matmul) against XLA's
jax.lax.ragged_dot (bf16) and a per-expert loop of cuBLASLt FP8 GEMMs (torch._scaled_mm,
row-wise scales, replayed from a CUDA graph so that launch gaps do not count), in one process.

T tokens, each routed to the top-k of E experts (k distinct experts per token: "random" draws
them uniformly, "skewed" from Zipf-like expert popularities, p_e ~ 1 / (e + 1)), give R = T k
rows sorted by expert. TFLOP/s count only the routed rows: 2 R N K. gate_up: [R, H] -> [R, 2I];
down: [R, I] -> [R, H] (I = 704 is stored padded to 768 in MXFP4; the K of the count is 704).
Every path gets its operands prepared (quantized, sorted); times are medians of --trials trials
of --calls calls after warm-up. The expert branch as the model runs it (routing, gather,
quantizers, both GEMMs, the weighted sum back in token order: jax_mila.gemma4.moe.Gemma4Experts)
is timed with --layer. Tables last; JSON to $OUT/moe.json.

    python benchmarks/moe.py [--tokens 8192,32768,65536] [--routing random,skewed]
                             [--paths mila,ragged_dot,torch] [--layer]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.55")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_mila import ffi, quant  # noqa: E402

PATHS = ("mila", "ragged_dot", "torch")


def routing_sizes(tokens: int, experts: int, top_k: int, kind: str, seed: int) -> np.ndarray:
    """Rows per expert when each of `tokens` picks `top_k` distinct experts (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    logp = np.zeros(experts) if kind == "random" else -np.log(np.arange(1, experts + 1))
    sizes = np.zeros(experts, np.int64)
    for start in range(0, tokens, 8192):  # in slices: tokens x experts floats at a time
        n = min(8192, tokens - start)
        scores = logp + rng.gumbel(size=(n, experts))
        top = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
        sizes += np.bincount(top.ravel(), minlength=experts)
    return sizes


def _median_time(fn, calls: int, trials: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


@functools.partial(jax.jit, static_argnames=("shape",))
def _random_mxfp4(key, shape):
    w = jax.random.normal(key, shape, jnp.float32) * shape[-1] ** -0.5
    return quant.quantize_mxfp4(w, check_finite=False)


def _operands(rows: int, n: int, k: int, experts: int, seed: int):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(kx, (rows, k), jnp.float32) * 3).astype(jnp.bfloat16)
    xq, xs = jax.jit(ffi.quantize_activations)(x)
    w = _random_mxfp4(kw, (experts, n, k))
    return x, xq, xs, w


def time_mila(xq, xs, w, sizes, calls, trials):
    fn = jax.jit(ffi.grouped_w4a8_matmul)
    return _median_time(lambda: fn(xq, xs, w, sizes), calls, trials)


def time_ragged_dot(x, w, sizes, calls, trials):
    wb = jnp.swapaxes(quant.dequantize_mxfp4(w, jnp.bfloat16, k=x.shape[1]), 1, 2)  # [E, K, N]
    fn = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32)
                 .astype(jnp.bfloat16))
    return _median_time(lambda: fn(x, wb, sizes), calls, trials)


def time_torch(xq, xs, w, sizes_np, calls, trials):
    """A loop of torch._scaled_mm over the experts (each group padded to 16 rows, as
    _scaled_mm needs), its weights as e4m3 with per-channel scales, captured once in a CUDA
    graph and replayed."""
    import torch

    k = xq.shape[1]
    k16 = -(-k // 16) * 16
    wf = np.asarray(jax.device_get(quant.dequantize_mxfp4(w, jnp.float32, k=k)))  # [E, N, K]
    scale_b = np.maximum(np.abs(wf).max(axis=2), 1e-30) / 448.0  # [E, N]
    dev = torch.device("cuda")
    wq = torch.from_numpy(wf / scale_b[..., None]).to(dev).to(torch.float8_e4m3fn)
    sb = torch.from_numpy(scale_b.astype(np.float32)).to(dev)
    x8 = torch.from_numpy(np.asarray(jax.device_get(xq.astype(jnp.float32)))).to(dev)
    x8 = x8.to(torch.float8_e4m3fn)
    sa = torch.from_numpy(np.asarray(jax.device_get(xs))).to(dev)
    groups, start = [], 0
    for e, size in enumerate(sizes_np.tolist()):
        if size:
            rows = -(-size // 16) * 16
            a = torch.zeros((rows, k16), dtype=torch.float8_e4m3fn, device=dev)
            a[:size, :k] = x8[start:start + size]
            s = torch.ones((rows, 1), dtype=torch.float32, device=dev)
            s[:size, 0] = sa[start:start + size]
            b = torch.zeros((wq.shape[1], k16), dtype=torch.float8_e4m3fn, device=dev)
            b[:, :k] = wq[e]
            groups.append((a, b.t(), s, sb[e].reshape(1, -1)))
        start += size

    def loop():
        return [torch._scaled_mm(a, b, scale_a=s, scale_b=t, out_dtype=torch.bfloat16)
                for a, b, s, t in groups]

    loop()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start_ev = torch.cuda.Event(enable_timing=True)
        end_ev = torch.cuda.Event(enable_timing=True)
        start_ev.record()
        for _ in range(calls):
            graph.replay()
        end_ev.record()
        torch.cuda.synchronize()
        times.append(start_ev.elapsed_time(end_ev) / 1e3 / calls)
    del graph, groups, wq, x8
    torch.cuda.empty_cache()
    return statistics.median(times)


def time_layer(tokens, hidden, inter, experts, top_k, kind, seed, calls, trials):
    """The expert branch of one layer as the model runs it, on routing of the given kind."""
    from flax import nnx

    from jax_mila.gemma4.moe import Gemma4Experts

    layer = nnx.eval_shape(lambda: Gemma4Experts(hidden, experts, inter, backend="auto",
                                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                 quantize="w4a8", rngs=nnx.Rngs(0)))
    kg, kd, kx = jax.random.split(jax.random.key(seed), 3)
    layer.gate_up_proj.set_mxfp4(_random_mxfp4(kg, (experts, 2 * inter, hidden)))
    layer.down_proj.set_mxfp4(_random_mxfp4(kd, (experts, hidden, inter)))
    rng = np.random.default_rng(seed)
    logp = np.zeros(experts) if kind == "random" else -np.log(np.arange(1, experts + 1))
    idx = np.argpartition(-(logp + rng.gumbel(size=(tokens, experts))), top_k - 1,
                          axis=1)[:, :top_k].astype(np.int32)
    weights = jnp.full((tokens, top_k), 1.0 / top_k, jnp.float32)
    x = (jax.random.normal(kx, (tokens, hidden), jnp.float32)).astype(jnp.bfloat16)
    graphdef, state = nnx.split(layer)
    fn = jax.jit(lambda s, a, b, c: nnx.merge(graphdef, s)(a, b, c))
    return _median_time(lambda: fn(state, x, weights, jnp.asarray(idx)), calls, trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768,65536",
                        help="comma-separated token counts (rows = tokens x top-k)")
    parser.add_argument("--routing", default="random,skewed", help="random, skewed or both")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"from {PATHS}")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--layer", action="store_true",
                        help="also time the whole expert branch (Gemma4Experts)")
    parser.add_argument("--max-ragged-bytes", type=float, default=30e9,
                        help="skip ragged_dot where XLA's dense expansion (rows x E x K x 2 "
                             "bytes) would exceed this")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            parser.error(f"--paths: unknown path {p!r} (known: {PATHS})")
    if "torch" in paths:
        try:
            import torch  # noqa: F401
            if not torch.cuda.is_available():
                raise ImportError("no CUDA device for torch")
        except ImportError as e:
            print(f"torch path skipped: {e}")
            paths.remove("torch")
    print(f"device: {jax.devices()[0].device_kind}; {ffi.status('grouped_w4a8_matmul')}")

    e, h, i = args.experts, args.hidden, args.intermediate
    gemms = {"gate_up": (2 * i, h), "down": (h, i)}
    rows, results = [], []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for kind in args.routing.split(","):
            sizes_np = routing_sizes(tokens, e, args.top_k, kind, seed=tokens)
            sizes = jnp.asarray(sizes_np, jnp.int32)
            r = int(sizes_np.sum())
            for name, (n, k) in gemms.items():
                flop = 2.0 * r * n * k
                x, xq, xs, w = _operands(r, n, k, e, seed=tokens + n)
                line = {"tokens": tokens, "routing": kind, "gemm": name, "rows": r,
                        "max_group": int(sizes_np.max()), "n": n, "k": k}
                for path in paths:
                    try:
                        if path == "mila":
                            t = time_mila(xq, xs, w, sizes, args.calls, args.trials)
                        elif path == "ragged_dot":
                            if r * e * k * 2 > args.max_ragged_bytes:
                                line[path] = "skipped (dense expansion too large)"
                                continue
                            t = time_ragged_dot(x, w, sizes, args.calls, args.trials)
                        else:
                            t = time_torch(xq, xs, w, sizes_np, args.calls, args.trials)
                    except Exception as ex:  # noqa: BLE001 -- out of memory etc.: say so, go on
                        line[path] = f"failed: {type(ex).__name__}: {str(ex)[:120]}"
                        continue
                    line[path] = {"ms": t * 1e3, "tflops": flop / t / 1e12}
                results.append(line)
                cells = []
                for path in paths:
                    v = line.get(path)
                    cells.append(f"{v['tflops']:.0f} ({v['ms']:.2f} ms)" if isinstance(v, dict)
                                 else str(v))
                rows.append([tokens, kind, name, r, line["max_group"], *cells])
                print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
                del x, xq, xs, w
            if args.layer:
                t = time_layer(tokens, h, i, e, args.top_k, kind, tokens, args.calls, args.trials)
                flop = 2.0 * tokens * args.top_k * 3 * h * i
                results.append({"tokens": tokens, "routing": kind, "gemm": "layer",
                                "ms": t * 1e3, "gemm_tflops": flop / t / 1e12})
                print(f"| {tokens} | {kind} | expert branch | {tokens * args.top_k} | - | "
                      f"{flop / t / 1e12:.0f} ({t * 1e3:.2f} ms) |", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "results": results}, f, indent=1)
    header = ["tokens", "routing", "GEMM", "rows", "largest group"] + \
             [f"{p} TFLOP/s (ms)" for p in paths]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
