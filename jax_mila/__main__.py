"""Command line of jax_mila.

    python -m jax_mila generate [--model PATH] [--prompt TEXT | --prompt-ids 2,17,5 | --length N]
                                [--new-tokens 32] [--dtype bfloat16] [--backend auto]
                                [--chunk-size N]
    python -m jax_mila prefill  [same options]
    python -m jax_mila selftest
    python -m jax_mila bench prefill [--seqs 8192 --backends mila,reference ...]
    python -m jax_mila bench attention|gemm|quantize [args]   (source checkout only)
    python -m jax_mila convert --model SRC --out DST [--quantize w4a8|none]

prefill / generate take ``--quantize w4a8`` (MXFP4 weights x FP8 activations; a checkpoint
written by ``convert`` is loaded in that format automatically). ``convert`` writes SRC's text
decoder to DST with MXFP4 linear weights (see jax_mila/gemma4/convert.py); the other towers
are not copied.

--chunk-size N runs the prompt in chunks of N tokens (one compiled step, cache donated, a
progress bar over the chunks); by default a prompt longer than a chunk sized from the free
device memory (2048 tokens where the device reports none) is chunked, a shorter one runs in
one call.

Without --model the small embedded checkpoint (random weights) is used, so the commands run
anywhere, CPU included; they print the tokens, the prefill / decode throughput, the time to
first token and the peak device memory (allocator statistics; not reported on CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _prompt_ids(args, vocab_size: int):
    import numpy as np

    if args.prompt_ids:
        ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            sys.exit(f"--prompt-ids: {bad} outside the vocabulary [0, {vocab_size})")
        return np.asarray([ids], np.int32), None
    if args.prompt is not None:
        tokenizer = _tokenizer(args.model)
        return np.asarray([tokenizer.encode(args.prompt).ids], np.int32), tokenizer
    rng = np.random.default_rng(args.seed)  # synthetic prompt: BOS then random ids
    ids = rng.integers(3, vocab_size, size=(1, args.length), dtype=np.int32)
    ids[:, 0] = 2
    return ids, None


def _tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"--prompt needs {path}; pass token ids with --prompt-ids instead")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("--prompt needs the `tokenizers` package (pip install tokenizers)")
    return Tokenizer.from_file(path)


def _timed(fn, *args, **kwargs):
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def _run(args) -> None:
    import jax
    import jax.numpy as jnp

    from jax_mila import gemma4

    args.model = os.fspath(args.model or gemma4.embedded_checkpoint())
    quantize = _quantize_arg(args.quantize)
    if args.quantize is None and os.path.isdir(args.model) and _stored_format(args.model) is not None:
        quantize = "w4a8"  # a converted checkpoint exists only in MXFP4
    try:
        model = gemma4.from_pretrained(args.model, dtype=jnp.dtype(args.dtype),
                                       backend=args.backend, quantize=quantize)
    except gemma4.loader.CheckpointError as e:
        sys.exit(f"--model {args.model}: {e}")
    cfg = model.config
    ids, tokenizer = _prompt_ids(args, cfg.vocab_size)
    batch, length = ids.shape
    new = args.new_tokens if args.command == "generate" else 0
    print(f"model {args.model} ({cfg.model_type}, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}), {args.dtype}, backend {args.backend}, weights "
          f"{quantize or 'dense'}, device {jax.devices()[0]}")
    print(f"prompt: {length} tokens" + (f": {ids[0].tolist()}" if length <= 32 else ""))

    cap = length + new
    chunking = dict(chunk_size=args.chunk_size, max_cache_len=cap,
                    kv_cache_dtype=args.kv_cache_dtype)
    (logits, cache), t_first = _timed(gemma4.prefill, model, ids, progress=True, **chunking)
    del logits, cache  # one cache alive at a time, so the peak below is one prefill's
    (logits, cache), t_prefill = _timed(gemma4.prefill, model, ids, progress=True, **chunking)
    print(f"prefill: {length} tokens in {t_prefill * 1e3:.1f} ms = {batch * length / t_prefill:,.0f} "
          f"tokens/s (first call incl. compile {t_first:.2f} s, {_chunking(model, batch, length, cap, args)})")
    print(f"time to first token: {t_prefill * 1e3:.1f} ms (the prefill ends with the first new "
          f"token's logits)")
    print(_memory_line(model, cache))
    if new == 0:
        print(f"next token: {int(jnp.argmax(logits[0]))}")
        return
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    steps = new - 1
    if steps:
        _, t_compile = _timed(gemma4.decode, model, first, cache, steps)   # compile + run
        logits, cache = gemma4.prefill(model, ids, **chunking)               # fresh cache (donated)
        (rest, _), t_decode = _timed(gemma4.decode, model, first, cache, steps)
        tokens = jnp.concatenate([first[:, None], rest], axis=1)
        print(f"decode: {steps} steps in {t_decode * 1e3:.1f} ms = {batch * steps / t_decode:,.1f} "
              f"tokens/s (first call incl. compile {t_compile:.2f} s)")
    else:
        tokens = first[:, None]
    out = tokens[0].tolist()
    print(f"generated ids: {out}")
    if tokenizer is not None:
        print(f"generated text: {tokenizer.decode(out)!r}")


def _chunking(model, batch, length, cap, args) -> str:
    from jax_mila.gemma4.generate import default_chunk_size

    if args.chunk_size:
        return f"chunks of {args.chunk_size}"
    size = default_chunk_size(model, batch, cap)
    return f"chunks of {size} (auto)" if length > size else f"one call (auto chunk {size})"


def _memory_line(model, cache) -> str:
    """Peak device memory from the allocator (JAX cannot reset it: it covers the whole process,
    compiles included), with the weights and the KV cache it holds."""
    import jax

    from jax_mila.gemma4.random_init import weight_bytes

    weights = weight_bytes(model)
    cache_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(cache))
    parts = f"weights {_size(weights)}, KV cache {_size(cache_bytes)}"
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    if "peak_bytes_in_use" not in stats:
        return f"peak device memory: n/a on {jax.devices()[0].platform} (no allocator statistics); {parts}"
    peak = stats["peak_bytes_in_use"]
    return (f"peak device memory: {_size(peak)} ({parts}, activations+workspace "
            f"{_size(peak - weights - cache_bytes)}; allocator peak of the process)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


def _quantize_arg(value):
    return None if value in (None, "none") else value


def _stored_format(path):
    from jax_mila.gemma4 import mxfp4_names

    try:
        return mxfp4_names.checkpoint_format(path)
    except (OSError, ValueError):
        return None  # from_pretrained reports it


def _convert(args, parser) -> None:
    from jax_mila.gemma4.convert import convert
    from jax_mila.gemma4.loader import CheckpointError

    if not os.path.isdir(args.model):
        _fail(parser, f"--model {args.model}: not a directory")
    try:
        summary = convert(args.model, args.out, quantize=_quantize_arg(args.quantize),
                          progress=not args.quiet)
    except (CheckpointError, ValueError, OSError) as e:
        _fail(parser, str(e))
    ratio = summary["mxfp4_bytes"] / max(summary["dense_bytes_of_quantized"], 1)
    print(f"wrote {args.out}: {summary['tensors']} tensors ({summary['quantized']} linear weights "
          f"as MXFP4, {ratio:.3f} of their dense size) in {len(summary['files'])} file(s), "
          f"{summary['bytes_written'] / 2**20:,.1f} MiB")


KERNEL_BENCHES = ("attention", "gemm", "quantize")


def _bench(args, parser) -> None:
    """Runs a benchmark.

    prefill: jax_mila.bench.prefill (ships with the package), e.g.
        python -m jax_mila bench prefill --seqs 8192 --backends mila,reference
    attention / gemm / quantize: the kernel benchmarks, benchmarks/<name>.py, which live in the
    source repository only (not installed); run from a source checkout, or run the script."""
    import subprocess

    import jax_mila

    if args.which == "prefill":
        from jax_mila.bench import prefill

        prefill.main(args.bench_args)
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(jax_mila.__file__)))
    script = os.path.join(repo, "benchmarks", f"{args.which}.py")
    if not os.path.isfile(script):
        _fail(parser, f"bench {args.which}: the kernel benchmarks are not installed with the "
                      f"package; run benchmarks/{args.which}.py from a source checkout of jax_mila "
                      f"(looked for {script})")
    sys.exit(subprocess.call([sys.executable, script] + list(args.bench_args)))


def _fail(parser, message: str):
    """One line on stderr, exit status 2 (argparse's convention for bad arguments)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jax_mila", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("prefill", "run the prompt once and time it"),
                        ("generate", "prefill, then greedy decoding")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", help="checkpoint directory (default: the embedded checkpoint)")
        group = p.add_mutually_exclusive_group()
        group.add_argument("--prompt", help="text (needs tokenizer.json in the checkpoint)")
        group.add_argument("--prompt-ids", help="comma- or space-separated token ids")
        group.add_argument("--length", type=int, default=64, help="synthetic prompt length (default 64)")
        p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
        p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
        p.add_argument("--backend", default="auto", choices=("auto", "mila", "reference"))
        p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompt")
        p.add_argument("--chunk-size", type=int, default=None,
                       help="prefill in chunks of N tokens (default: sized from free device memory)")
        p.add_argument("--quantize", choices=("none", "w4a8"), default=None,
                       help="weight format (default: dense, or as stored in a converted checkpoint)")
        p.add_argument("--kv-cache-dtype", choices=("float8_e4m3fn",), default=None,
                       help="store the full-attention layers' K/V in FP8 (default: the model dtype)")
    sub.add_parser("selftest", help="run each op once against its reference (jax_mila.selftest)")
    p = sub.add_parser("bench", help="benchmarks: prefill (end to end), or a kernel benchmark",
                       description=_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=("prefill",) + KERNEL_BENCHES,
                   help="prefill: Gemma 4 end to end (jax_mila.bench.prefill); the others: "
                        "benchmarks/<name>.py of a source checkout")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="passed to the benchmark (e.g. --seqs 8192 --backends mila,reference)")
    p = sub.add_parser("convert", help="write a checkpoint's text decoder with MXFP4 weights")
    p.add_argument("--model", required=True, help="source checkpoint directory (single file or sharded)")
    p.add_argument("--out", required=True, help="output directory (created; must not hold a checkpoint)")
    p.add_argument("--quantize", choices=("w4a8", "none"), default="w4a8",
                   help="weight format of the linears (default w4a8; none copies them dense)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "convert":
        _convert(args, parser)
        return
    if args.command == "bench":
        _bench(args, parser)
        return
    if args.command == "selftest":
        import jax_mila

        results = jax_mila.selftest(verbose=True)
        failed = [r for r in results if r.outcome in ("MISMATCH", "ERROR")]
        sys.exit(1 if failed else 0)
    if args.command == "generate" and args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    if args.length is not None and args.length < 1:
        parser.error("--length must be >= 1")
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error("--chunk-size must be >= 1")
    _run(args)


if __name__ == "__main__":
    main()
