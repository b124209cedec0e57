"""Fidelity of the kernel path against the reference path on the same weights.

``run(size, tokens=...)`` returns one result dict (``format_table`` prints it);
scripts/fidelity.py is its command line (``python3 scripts/fidelity.py --help``). Three checks:
- final logits of a full forward over ``tokens`` random tokens: cosine similarity per
  position (mean, min), top-1 agreement, max |error|, relative Frobenius error;
- every decoder layer's output: relative Frobenius error against the reference, so it shows
  whether the error compounds with depth or stays at the bf16 level;
- the last logits of a chunked ``prefill`` on the kernel path against the reference's full
  forward, and greedy ``generate`` continuing from a kernel prefill against the reference
  path's greedy tokens on the embedded checkpoint (W4A8 linears: its head dims, 32 and 64,
  have no attention kernel, so attention falls back there and says so in the log).

The reference model is the kernel model with every module's ``backend`` set to "reference"
(``with_backend``): the weights are the same arrays, so any difference is the kernels'.
On a machine without the kernels (CPU) both paths are the reference and every error is 0.

``noise_floor=True`` (one more reference forward) adds what those errors are measured against:
the reference path against itself with every W4A8 quantizer input's elements moved by one bf16
ulp at a fixed rate (``NOISE_FLOOR_RATE``, jax_mila.nn.noise). That is the form in which any
float32-level difference between the paths (accumulation order and precision in the GEMM,
another tanh in the GeGLU) reaches the FP8 codes, so it gives each layer's error a scale: how
far such noise alone carries the model by that depth. Reported per layer, for the final logits
and, where greedy tokens differ, as the largest logit difference it makes at that position.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila.engine import forward, generate, prefill
from jax_mila import ffi
from jax_mila.ffi import _registry
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.model import Gemma4ForCausalLM
from jax_mila.gemma4.paths import embedded_checkpoint, model_card
from jax_mila.nn import noise


SIZES = ("tiny", "12b", "e2b", "e4b", "26b-a4b", "31b")
# Every element: the largest perturbation of that kind (every quantizer input one bf16 ulp off),
# so a path that differs from the reference only below bf16 resolution should stay near or
# under the floor. Measured on the tiny model (CPU, 40 tokens, seeds 0, 7, 331020728): three
# draws differ by < 5% per layer (at a rate of 1e-3, layer 0 ranges over 2e-4..1.5e-3), and a
# lower rate lowers mainly the first layers: the drift feeds itself through re-quantization
# (layer 0: 1.2e-3 at rate 1e-3, 8.3e-3 at 1; layer 5: 1.7e-2 and 2.5e-2).
NOISE_FLOOR_RATE = 1.0


# ---- models --------------------------------------------------------------------------------

def model_config(size: str, layers: int | None = None) -> Gemma4Config:
    """The text config of a released size ("tiny": the embedded checkpoint's), optionally cut
    to its first ``layers`` layers (the layer pattern is kept, so 12 layers of 12B hold two
    global layers)."""
    path = embedded_checkpoint() / "config.json" if size == "tiny" else model_card(size)
    with open(path) as f:
        raw = json.load(f)
    if layers is not None:
        text = raw.get("text_config", raw)
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise ValueError(f"--layers must be in [1, {text['num_hidden_layers']}], got {layers}")
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
        text["num_kv_shared_layers"] = 0
        if "per_layer_config" in text:
            text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items()
                                        if int(k) < layers}
    return Gemma4Config.from_dict(raw)


def random_model(cfg: Gemma4Config, *, dtype=jnp.bfloat16, quantize="w4a8", backend="mila",
                 seed: int = 0) -> Gemma4ForCausalLM:
    """A random-weight model of ``cfg``, built on the default device.

    Uses jax_mila.gemma4.random_init (weights generated on the GPU without a float32 copy of
    the model) where it exists, else the modules' own initializers inside one nnx.jit."""
    try:
        from jax_mila.gemma4 import random_init  # written alongside benchmarks/prefill.py
    except ImportError:
        random_init = None
    if random_init is not None and hasattr(random_init, "random_model"):
        return random_init.random_model(cfg, dtype=dtype, quantize=quantize, backend=backend,
                                        seed=seed)
    build = nnx.jit(lambda: Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend,
                                              quantize=quantize, rngs=nnx.Rngs(seed)))
    return build()


def with_backend(model: Gemma4ForCausalLM, backend: str) -> Gemma4ForCausalLM:
    """The same model (the same weight arrays, no copy) with every module's backend set."""
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, state)
    for _, node in nnx.iter_graph(other):
        if isinstance(node, nnx.Module) and isinstance(getattr(node, "backend", None), str):
            node.backend = backend
    return other


# ---- comparisons ---------------------------------------------------------------------------

def _hidden_and_layers(graphdef, state, ids):
    """(hidden states, every layer's output, every MoE layer's expert indices [L_moe, T, k])."""
    model = nnx.merge(graphdef, state)
    h, _, layers, routing = model.hidden_states(ids, return_layers=True, return_routing=True)
    return h, layers, routing


def routing_agreement(got, want) -> dict:
    """How often two paths chose the same experts: per MoE layer, the fraction of tokens whose
    top-k sets are equal (order aside) and the mean fraction of each token's k experts in both
    sets. ``got``, ``want``: [L_moe, T, k] expert indices."""
    got, want = np.asarray(got), np.asarray(want)
    if got.size == 0:
        return {}
    same = np.sort(got, axis=-1) == np.sort(want, axis=-1)
    shared = (got[..., :, None] == want[..., None, :]).any(-1).mean(-1)  # [L, T]
    return dict(sets_equal=[float(x) for x in same.all(-1).mean(-1)],
                experts_shared=[float(x) for x in shared.mean(-1)],
                sets_equal_all_layers=float(same.all(-1).mean()))


_hidden = jax.jit(_hidden_and_layers, static_argnames=("graphdef",))


@functools.partial(jax.jit, static_argnames=("graphdef", "rate"))
def _noisy_hidden(graphdef, state, ids, key, rate):
    """_hidden with the quantizer noise traced in; the key is an argument, so one compile (and
    never _hidden's noise-free cache entry: the noise exists only while this traces)."""
    with noise.quantizer_noise(key, rate):
        return _hidden_and_layers(graphdef, state, ids)


@functools.partial(jax.jit, static_argnames=("graphdef", "rate"))
def _noisy_forward(graphdef, state, ids, key, rate):
    """The logits of ``ids`` (generate.forward's) under the quantizer noise."""
    with noise.quantizer_noise(key, rate):
        return nnx.merge(graphdef, state)(ids)


@jax.jit
def _layer_errors(got, want):
    """Relative Frobenius error of each layer's output [L, ...] (one layer at a time)."""
    def one(pair):
        g, w = (x.astype(jnp.float32) for x in pair)
        return jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30)
    return jax.lax.map(one, (got, want))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logit_stats(graphdef, state, h_got, h_want):
    """Per-row statistics of the logits of two hidden-state blocks [R, H]."""
    model = nnx.merge(graphdef, state)
    g = model.logits(h_got).astype(jnp.float32)
    w = model.logits(h_want).astype(jnp.float32)
    cos = jnp.sum(g * w, -1) / jnp.maximum(jnp.linalg.norm(g, axis=-1) * jnp.linalg.norm(w, axis=-1),
                                           1e-30)
    return dict(cos=cos, top1=jnp.argmax(g, -1) == jnp.argmax(w, -1),
                max_abs=jnp.max(jnp.abs(g - w), -1), err2=jnp.sum((g - w) ** 2, -1),
                ref2=jnp.sum(w * w, -1))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, state, h):
    return nnx.merge(graphdef, state).logits(h).astype(jnp.float32)


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def _logit_summary(graphdef, state, h_got, h_want, logit_rows: int) -> dict:
    """Final-logit statistics of two hidden-state blocks [rows, H], ``logit_rows`` rows at a
    time: [T, vocab] float32 twice would be 17 GB at 8K x 262144."""
    rows = h_got.shape[0]
    block = min(logit_rows, rows)
    stats = []
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        # A short last block is padded by repeating rows so every block compiles once.
        idx = np.minimum(np.arange(start, start + block), rows - 1)
        s = _logit_stats(graphdef, state, h_got[idx], h_want[idx])
        stats.append({k: np.asarray(v)[: stop - start] for k, v in s.items()})
    cat = {k: np.concatenate([s[k] for s in stats]) for k in stats[0]}
    return dict(
        cosine_mean=float(cat["cos"].mean()), cosine_min=float(cat["cos"].min()),
        top1_agreement=float(cat["top1"].mean()), max_abs_err=float(cat["max_abs"].max()),
        rel_err=float(np.sqrt(cat["err2"].sum() / max(cat["ref2"].sum(), 1e-300))),
        positions=int(rows))


def compare_forward(kernel_model, reference_model, ids, *, logit_rows: int = 1024,
                    prefill_chunk: int | None = None, noise_key=None) -> dict:
    """Kernel path vs reference path on ``ids`` [1, T]; see the module docstring. With
    ``noise_key``, also the noise floor: the reference under NOISE_FLOOR_RATE quantizer noise
    against the reference (``noise_floor_*``)."""
    ids = jnp.asarray(ids, jnp.int32)
    out = {}
    t0 = time.perf_counter()
    gk, sk = nnx.split(kernel_model)
    hk, lk, rk = jax.block_until_ready(_hidden(gk, sk, ids))
    out["kernel_forward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    gr, sr = nnx.split(reference_model)
    hr, lr, rr = jax.block_until_ready(_hidden(gr, sr, ids))
    out["reference_forward_s"] = time.perf_counter() - t0
    out["layer_rel_err"] = [float(e) for e in np.asarray(_layer_errors(lk, lr))]
    if rk.size:
        out["routing"] = routing_agreement(rk, rr)
    del lk
    h_r = hr.reshape(-1, hr.shape[-1])
    if noise_key is not None:
        # After the kernel's layers are freed: the 12B at 8K holds 3 GB of them per path.
        t0 = time.perf_counter()
        hn, ln, rn = jax.block_until_ready(_noisy_hidden(gr, sr, ids, noise_key,
                                                         NOISE_FLOOR_RATE))
        out["noise_floor_forward_s"] = time.perf_counter() - t0
        out["noise_floor_rate"] = NOISE_FLOOR_RATE
        out["noise_floor_layer_rel_err"] = [float(e) for e in np.asarray(_layer_errors(ln, lr))]
        if rn.size:
            out["noise_floor_routing"] = routing_agreement(rn, rr)
        del ln
        h_n = hn.reshape(-1, hn.shape[-1])
        out["noise_floor_logits"] = _logit_summary(gr, sr, h_n, h_r, logit_rows)
    del lr
    out["logits"] = _logit_summary(gr, sr, hk.reshape(-1, hk.shape[-1]), h_r, logit_rows)
    if prefill_chunk is not None:
        # The production path: chunked prefill on the kernels, last position's logits.
        want_last = np.asarray(_logits(gr, sr, h_r[-1:]))[0]
        t0 = time.perf_counter()
        got_last, _ = prefill(kernel_model, ids, chunk_size=prefill_chunk)
        got_last = np.asarray(jax.block_until_ready(got_last).astype(jnp.float32))[0]
        out["kernel_chunked_prefill_s"] = time.perf_counter() - t0
        c = out["chunked_prefill_last_logits"] = dict(
            chunk=prefill_chunk, cosine=_cos(got_last, want_last),
            max_abs_err=float(np.abs(got_last - want_last).max()),
            top1_equal=bool(got_last.argmax() == want_last.argmax()))
        if not c["top1_equal"]:
            noisy_last = (np.asarray(_logits(gr, sr, h_n[-1:]))[0] if noise_key is not None
                          else None)
            c["divergence"] = divergence(want_last, got_last, int(want_last.argmax()),
                                         int(got_last.argmax()), noise_logits=noisy_last)
    return out


def compare_generate(path=None, *, prompt_tokens: int = 48, new_tokens: int = 32,
                     chunk: int = 16, quantize="w4a8", seed: int = 0, noise_key=None) -> dict:
    """Greedy tokens after a chunked kernel prefill vs the reference path's, on a checkpoint
    (default: the embedded one). With ``noise_key``, a mismatch's divergence also holds the
    noise floor's largest logit difference at that position."""
    from jax_mila.gemma4.loader import from_pretrained

    path = embedded_checkpoint() if path is None else path
    kernel = from_pretrained(path, dtype=jnp.bfloat16, backend="mila", quantize=quantize)
    reference = with_backend(kernel, "reference")
    vocab = kernel.config.vocab_size
    ids = jax.random.randint(jax.random.key(seed), (1, prompt_tokens), 3, vocab, jnp.int32)
    logits, cache = prefill(kernel, ids, chunk_size=chunk,
                            max_cache_len=prompt_tokens + new_tokens)
    got = np.asarray(generate(kernel, ids, new_tokens, cache=cache, logits=logits))[0]
    want = np.asarray(generate(reference, ids, new_tokens))[0]
    diff = np.flatnonzero(got != want)
    out = dict(checkpoint=str(path), quantize=quantize, prompt_tokens=prompt_tokens,
               prefill_chunk=chunk, new_tokens=new_tokens, equal=bool(diff.size == 0),
               first_mismatch=int(diff[0]) if diff.size else None,
               kernel_tokens=got.tolist(), reference_tokens=want.tolist())
    if diff.size:
        # Both paths' logits over the common prefix, at the first token they disagree on: a
        # near-tie (margins inside the paths' logit difference) or a real divergence.
        k = int(diff[0])
        prefix = jnp.concatenate([ids, jnp.asarray(want[None, :k], jnp.int32)], axis=1)
        last = lambda m: np.asarray(forward(m, prefix)[0, -1].astype(jnp.float32))  # noqa: E731
        noisy = None
        if noise_key is not None:
            noisy = np.asarray(_noisy_forward(*nnx.split(reference), prefix, noise_key,
                                              NOISE_FLOOR_RATE)[0, -1].astype(jnp.float32))
        out["divergence"] = divergence(last(reference), last(kernel), int(want[k]), int(got[k]),
                                       noise_logits=noisy)
    return out


def divergence(ref_logits, kernel_logits, ref_token: int, kernel_token: int,
               noise_logits=None) -> dict:
    """How far apart the two paths are where their greedy tokens first differ: each path's
    margin for its own token over the other's, the largest logit difference there, and whether
    that is a near tie: the reference prefers its token by no more than the two paths already
    differ by on some logit at that position, so the flip is inside the numerical noise
    between them (FP8 activations rounding differently on the two paths) rather than a sign
    of a wrong kernel.

    ``noise_logits``: the reference's logits there under the noise floor's perturbation. Adds
    their largest difference from the reference's and the reference's margin in units of it
    (``margin_over_noise_floor``): at most 1, the noise alone moves some logit by as much as
    the margin, so a flip is inside what float32-level noise at the quantizers does; the kernel
    path's noise is a calibrated multiple of the floor's (tests/test_fidelity.py)."""
    ref, ker = np.asarray(ref_logits, np.float64), np.asarray(kernel_logits, np.float64)
    out = dict(reference_margin=float(ref[ref_token] - ref[kernel_token]),
               kernel_margin=float(ker[kernel_token] - ker[ref_token]),
               max_abs_logit_diff=float(np.abs(ker - ref).max()))
    out["near_tie"] = out["reference_margin"] <= out["max_abs_logit_diff"]
    if noise_logits is not None:
        floor = float(np.abs(np.asarray(noise_logits, np.float64) - ref).max())
        out["noise_floor_max_abs_logit_diff"] = floor
        # A margin of 0 is inside any floor, 0 as well; a positive one over a 0 floor is not.
        out["margin_over_noise_floor"] = (out["reference_margin"] / floor if floor > 0 else
                                          0.0 if out["reference_margin"] <= 0 else float("inf"))
    return out


# ---- report --------------------------------------------------------------------------------

def _layer_rows(errs) -> list[str]:
    return [f"  layers {i:2d}-{min(i + 8, len(errs)) - 1:2d}: "
            + " ".join(f"{e:.2e}" for e in errs[i:i + 8]) for i in range(0, len(errs), 8)]


def _divergence_line(d: dict) -> str:
    line = (f"the reference prefers its token by {d['reference_margin']:.4g} logits, the kernel "
            f"path its own by {d['kernel_margin']:.4g}; largest logit difference "
            f"{d['max_abs_logit_diff']:.4g}: "
            + ("a near tie (the reference's margin is inside the paths' logit difference)"
               if d["near_tie"] else "DIVERGED (the reference's margin exceeds every logit "
               "difference between the paths)"))
    if "noise_floor_max_abs_logit_diff" in d:
        line += (f"; the noise floor moves a logit there by up to "
                 f"{d['noise_floor_max_abs_logit_diff']:.4g} (margin / that: "
                 f"{d['margin_over_noise_floor']:.3g})")
    return line


def format_table(result: dict) -> str:
    f, lg = result["forward"], result["forward"]["logits"]
    lines = [f"model {result['model']} ({result['layers']} layers, quantize={result['quantize']}), "
             f"{result['tokens']} tokens, seed {result['seed']}, device {result['device']}",
             f"  final logits: cosine mean {lg['cosine_mean']:.6f} min {lg['cosine_min']:.6f}, "
             f"top-1 agreement {lg['top1_agreement']:.4%}, max |err| {lg['max_abs_err']:.4g}, "
             f"rel err {lg['rel_err']:.3g}",
             "  rel err of each layer's output (kernel vs reference), 8 layers a row:"]
    lines += _layer_rows(f["layer_rel_err"])
    if "noise_floor_layer_rel_err" in f:
        nl = f["noise_floor_logits"]
        lines.append(f"  noise floor (reference vs itself, every quantizer input's elements one "
                     f"bf16 ulp off at rate {f['noise_floor_rate']:g}), the same errors:")
        lines += _layer_rows(f["noise_floor_layer_rel_err"])
        lines.append(f"  noise floor final logits: cosine min {nl['cosine_min']:.6f}, top-1 "
                     f"agreement {nl['top1_agreement']:.4%}, max |err| {nl['max_abs_err']:.4g}, "
                     f"rel err {nl['rel_err']:.3g}")
    for key, what in (("routing", "kernel vs reference"), ("noise_floor_routing", "noise floor")):
        if key in f:
            r = f[key]
            lines.append(f"  expert choices ({what}): top-k sets equal for "
                         f"{r['sets_equal_all_layers']:.4%} of token-layers; per MoE layer "
                         + " ".join(f"{x:.4f}" for x in r["sets_equal"]))
    if "chunked_prefill_last_logits" in f:
        c = f["chunked_prefill_last_logits"]
        lines.append(f"  chunked prefill ({c['chunk']}/chunk) last logits: cosine {c['cosine']:.6f}, "
                     f"max |err| {c['max_abs_err']:.4g}, top-1 equal {c['top1_equal']}")
        if "divergence" in c:
            lines.append("    there " + _divergence_line(c["divergence"]))
    lines.append(f"  time: kernel forward {f['kernel_forward_s']:.1f} s, reference forward "
                 f"{f['reference_forward_s']:.1f} s (compile included)"
                 + (f", noise floor forward {f['noise_floor_forward_s']:.1f} s"
                    if "noise_floor_forward_s" in f else "")
                 + (f"; device peak {result['peak_gib']:.1f} GiB" if result.get("peak_gib") else ""))
    if "generate" in result:
        g = result["generate"]
        lines.append(f"  greedy generate ({g['new_tokens']} tokens after a {g['prefill_chunk']}-token-"
                     f"chunk kernel prefill of {g['prompt_tokens']}, embedded checkpoint, "
                     f"quantize={g['quantize']}): "
                     + ("equal to the reference" if g["equal"]
                        else f"DIFFERS from token {g['first_mismatch']}"))
        if "divergence" in g:
            lines.append("    there, one-shot forwards over the common prefix: "
                         + _divergence_line(g["divergence"]))
    lines += [f"  kernel: {v}" for v in result.get("kernels", {}).values()]
    lines += [f"  fallback: {v}" for v in result.get("fallbacks", [])]
    # "| " rows: what scripts/gpu_round.sh shows of a benchmark's output.
    return "\n".join("| " + line for line in lines)


def run(size: str = "12b", *, tokens: int = 8192, layers: int | None = None,
        quantize: str | None = "w4a8", seed: int = 0, logit_rows: int = 1024,
        prefill_chunk: int = 2048, generate_tokens: int = 32,
        noise_floor: bool = False) -> dict:
    """The three checks (module docstring) on a random-weight model of ``size`` (one of SIZES)
    cut to its first ``layers`` layers: a result dict (``format_table`` prints it; JSON-ready).
    ``prefill_chunk`` 0 skips the chunked-prefill check, ``generate_tokens`` 0 the generate
    check; ``noise_floor`` adds the noise floor."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {SIZES}")
    cfg = model_config(size, layers)
    kernel = random_model(cfg, quantize=quantize, backend="mila", seed=seed)
    reference = with_backend(kernel, "reference")
    ids = jax.random.randint(jax.random.key(seed + 1), (1, tokens), 3, cfg.vocab_size,
                             jnp.int32)
    chunk = min(prefill_chunk, tokens) or None

    def noise_key(use: int):
        """The noise floor's key for one of its uses (0: the forward, 1: generate)."""
        return jax.random.fold_in(jax.random.key(seed), use) if noise_floor else None

    result = dict(model=size, layers=cfg.num_hidden_layers, tokens=tokens,
                  quantize=quantize or "none", seed=seed, device=str(jax.devices()[0]),
                  random_init=("jax_mila.gemma4.random_init" if _has_random_init()
                               else "nnx initializers"),
                  forward=compare_forward(kernel, reference, ids, logit_rows=logit_rows,
                                          prefill_chunk=chunk, noise_key=noise_key(0)))
    del kernel, reference
    if generate_tokens:
        result["generate"] = compare_generate(new_tokens=generate_tokens, seed=seed,
                                              quantize=quantize, noise_key=noise_key(1))
    stats = jax.devices()[0].memory_stats() or {}
    result["peak_gib"] = (stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats
                          else None)
    result["kernels"] = {op: str(st) for op, st in ffi.available().items()}
    result["fallbacks"] = [f"{op}: {why}" for op, why in _registry.logged_fallbacks()]
    return result


def _has_random_init() -> bool:
    try:
        from jax_mila.gemma4 import random_init
    except ImportError:
        return False
    return hasattr(random_init, "random_model")
