"""A small Llama-style decoder in plain flax.nnx, made faster by two jax_mila calls.

The model (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, bf16) knows nothing of jax_mila.
Its attention layers call ``attention_fn(q, k, v, is_causal=True, ...)``, by default
``jax.nn.dot_product_attention``; the drop-in is

    set_attention(model, jax_mila.dot_product_attention)   # FlashAttention kernels (D 256/512)
    report = jax_mila.nn.swap_linears(model)               # nnx.Linear -> W4A8 (MXFP4 weights)

The script runs one prefill (all positions, logits for the last 64) three ways on the same
weights and prints the time of each and its difference from the first:

  baseline   jax.nn.dot_product_attention (--attention-impl: cuDNN on a GPU) + bf16 nnx.Linear
  attention  jax_mila.dot_product_attention (the same implementation where the kernels do not
             apply, e.g. head dim 128) + bf16 nnx.Linear
  w4a8       jax_mila.dot_product_attention + W4A8 linears (swap_linears)

Benchmark on one GPU (the issue's target: 16K tokens, head dim 256, >= 1.5x the baseline):
    python3 examples/llama_dropin.py --tokens 16384 --head-dims 256
Mixed head dims (layers cycle through the list), a sliding window, another size:
    python3 examples/llama_dropin.py --head-dims 128,256 --window 4096 --hidden 2048 --layers 4
CPU smoke run (tiny sizes, reference paths; tests/test_example_llama_dropin.py runs it):
    python3 examples/llama_dropin.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

try:
    import jax_mila
except ImportError:  # not installed: run from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax_mila
from jax_mila.ffi import _registry

# ---- the model: plain flax.nnx, no jax_mila -------------------------------------------------


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, dtype, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta: float = 10000.0):
    """Rotary embedding of x [B, T, N, H], half-split layout (Hugging Face Llama)."""
    h = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos, sin = (f(angles)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = (p.astype(jnp.float32) for p in jnp.split(x, 2, axis=-1))
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, *, window, attention_fn,
                 implementation, dtype, rngs):
        lin = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(hidden, heads * head_dim, **lin)
        self.k_proj = nnx.Linear(hidden, kv_heads * head_dim, **lin)
        self.v_proj = nnx.Linear(hidden, kv_heads * head_dim, **lin)
        self.o_proj = nnx.Linear(heads * head_dim, hidden, **lin)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.window = window
        self.attention_fn, self.implementation = attention_fn, implementation

    def __call__(self, x, positions):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        # A window of W tokens: each query sees itself and the W - 1 before it.
        window = None if self.window is None else (self.window - 1, 0)
        o = self.attention_fn(q, k, v, is_causal=True, local_window_size=window,
                              implementation=self.implementation)
        return self.o_proj(o.reshape(b, t, self.heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, hidden, intermediate, *, dtype, rngs):
        lin = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden, intermediate, **lin)
        self.up_proj = nnx.Linear(hidden, intermediate, **lin)
        self.down_proj = nnx.Linear(intermediate, hidden, **lin)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg, head_dim, *, attention_fn, rngs):
        dt = cfg.dtype
        self.input_norm = RMSNorm(cfg.hidden, dtype=dt)
        self.attn = Attention(cfg.hidden, cfg.heads, cfg.kv_heads, head_dim, window=cfg.window,
                              attention_fn=attention_fn, implementation=cfg.implementation,
                              dtype=dt, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden, dtype=dt)
        self.mlp = MLP(cfg.hidden, cfg.intermediate, dtype=dt, rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.attn(self.input_norm(x), positions)
        return x + self.mlp(self.post_attention_norm(x))


# Positions whose logits the prefill returns (the last ones): what the comparison's KL and top-1
# agreement average over, so that top-1 is a rate and not one coin toss per row.
SCORED_POSITIONS = 64


class Decoder(nnx.Module):
    """Returns (logits of the last SCORED_POSITIONS positions [B, P, vocab] float32, final normed
    hidden states)."""

    def __init__(self, cfg, *, attention_fn=jax.nn.dot_product_attention, rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, dtype=cfg.dtype, param_dtype=cfg.dtype,
                               rngs=rngs)
        self.layers = nnx.List([
            Block(cfg, cfg.head_dims[i % len(cfg.head_dims)], attention_fn=attention_fn,
                  rngs=rngs) for i in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, dtype=cfg.dtype)
        self.lm_head = nnx.Linear(cfg.hidden, cfg.vocab, use_bias=False, dtype=cfg.dtype,
                                  param_dtype=cfg.dtype, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        positions = jnp.arange(ids.shape[1])
        for layer in self.layers:
            h = layer(h, positions)
        h = self.norm(h)
        return self.lm_head(h[:, -SCORED_POSITIONS:]).astype(jnp.float32), h


def set_attention(model: nnx.Module, attention_fn) -> None:
    """Points every attention layer of `model` at `attention_fn`."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Attention):
            module.attention_fn = attention_fn


# ---- the benchmark ----------------------------------------------------------------------------

SIZES = dict(tokens=16384, batch=1, hidden=4096, layers=8, heads=16, kv_heads=4, head_dims="256",
             intermediate=14336, vocab=32000, reps=10)
TINY = dict(tokens=97, batch=2, hidden=128, layers=2, heads=4, kv_heads=2, head_dims="128,256",
            intermediate=256, vocab=256, reps=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help=f"CPU-sized defaults: {', '.join(f'{k}={v}' for k, v in TINY.items())}")
    size = lambda name, kind, what: p.add_argument(  # noqa: E731
        f"--{name.replace('_', '-')}", type=kind, default=None,
        help=f"{what} (default {SIZES[name]}; --tiny: {TINY[name]})")
    size("tokens", int, "prompt length T")
    size("batch", int, "batch size B")
    size("hidden", int, "hidden size")
    size("layers", int, "decoder layers")
    size("heads", int, "query heads")
    size("kv_heads", int, "KV heads (GQA: heads %% kv_heads == 0)")
    size("head_dims", str, "head dim per layer, cycled over the layers (e.g. 128,256)")
    size("intermediate", int, "MLP intermediate size")
    size("vocab", int, "vocabulary size")
    size("reps", int, "timed runs (median, after a warm-up run that compiles)")
    p.add_argument("--window", type=int, default=None,
                   help="sliding window W: each query sees itself and W - 1 earlier tokens")
    p.add_argument("--attention-impl", default="auto", choices=("auto", "xla", "cudnn"),
                   help="jax.nn.dot_product_attention's implementation in the baseline and "
                        "where jax_mila's kernels do not apply (auto: cudnn on a GPU, else "
                        "jax's default, XLA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.head_dims = tuple(int(d) for d in str(args.head_dims).split(","))
    if args.attention_impl == "auto":
        args.attention_impl = "cudnn" if jax.default_backend() == "gpu" else None
    return args


class Config:
    def __init__(self, args):
        self.hidden, self.layers, self.heads = args.hidden, args.layers, args.heads
        self.kv_heads, self.head_dims = args.kv_heads, args.head_dims
        self.intermediate, self.vocab, self.window = args.intermediate, args.vocab, args.window
        self.implementation = args.attention_impl
        self.dtype = jnp.bfloat16


def _time(model, ids, reps):
    """(outputs, median seconds) of the jitted prefill; the first call compiles."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    out = jax.block_until_ready(run(state, ids))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run(state, ids))
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _compare(out, base) -> dict:
    """Differences from the baseline: relative Frobenius error of the final hidden states and of
    the scored positions' logits, KL(baseline || this) of their softmax (nats, mean over the
    positions) and the fraction of positions whose top-1 token agrees."""
    (logits, hidden), (logits0, hidden0) = out, base

    def rel(a, b):
        a, b = a.astype(jnp.float32).ravel(), b.astype(jnp.float32).ravel()
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    p0 = jax.nn.log_softmax(logits0, -1)
    p1 = jax.nn.log_softmax(logits, -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(p0) * (p0 - p1), -1)))
    top1 = float(jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(logits0, -1)))
    return dict(hidden_rel_err=rel(hidden, hidden0), logits_rel_err=rel(logits, logits0),
                kl_nats=kl, top1_agree=top1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = Config(args)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}); B={args.batch} "
          f"T={args.tokens} hidden={cfg.hidden} layers={cfg.layers} heads={cfg.heads}/"
          f"{cfg.kv_heads} head_dims={cfg.head_dims} intermediate={cfg.intermediate} "
          f"window={cfg.window} attention implementation={cfg.implementation!r}")
    model = Decoder(cfg, rngs=nnx.Rngs(args.seed))
    ids = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.tokens), 0,
                             cfg.vocab)
    tokens = args.batch * args.tokens
    _registry.reset_fallback_log()

    rows = {}
    base, seconds = _time(model, ids, args.reps)
    rows["baseline"] = dict(seconds=seconds)

    set_attention(model, jax_mila.dot_product_attention)
    out, seconds = _time(model, ids, args.reps)
    rows["attention"] = dict(seconds=seconds, **_compare(out, base))

    report = jax_mila.nn.swap_linears(model)
    out, seconds = _time(model, ids, args.reps)
    rows["w4a8"] = dict(seconds=seconds, **_compare(out, base))

    print(report)
    fallbacks = [f"{op}: {reason}" for op, reason in _registry.logged_fallbacks()]
    print("not on kernels:" + ("".join(f"\n  {f}" for f in fallbacks) if fallbacks else " none"))
    t0 = rows["baseline"]["seconds"]
    print(f"\n| run | ms | tokens/s | speed-up | hidden rel. err | logits rel. err | "
          f"KL (nats) | top-1 |\n|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        diff = ("| - | - | - | - |" if name == "baseline" else
                f"| {r['hidden_rel_err']:.4f} | {r['logits_rel_err']:.4f} | {r['kl_nats']:.2e} "
                f"| {r['top1_agree']:.3f} |")
        print(f"| {name} | {1e3 * r['seconds']:.2f} | {tokens / r['seconds']:,.0f} | "
              f"{t0 / r['seconds']:.2f}x {diff}")
    result = dict(device=device.device_kind, args={k: v for k, v in vars(args).items()},
                  runs=rows, swapped=len(report.swapped), kept=[str(e) for e in report.kept],
                  fallbacks=fallbacks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
