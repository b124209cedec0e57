"""Command line of jax_mila.

    python -m jax_mila generate [--model PATH] [--prompt TEXT ... | --prompt-ids 2,17,5 ... | --length N]
                                [--new-tokens 32] [--block 16] [--ignore-eos]
                                [--dtype bfloat16] [--backend auto] [--chunk-size N]
    python -m jax_mila prefill  [the same options but --new-tokens]
    python -m jax_mila selftest
    python -m jax_mila bench prefill [--seqs 8192 --backends mila,reference ...]
    python -m jax_mila bench decode [--prompts 4096 --batches 1,8 ...]
    python -m jax_mila bench attention|gemm|quantize [args]   (source checkout only)
    python -m jax_mila convert --model SRC --out DST [--quantize w4a8|none]

prefill / generate take ``--quantize w4a8`` (MXFP4 weights x FP8 activations; a checkpoint
written by ``convert`` is loaded in that format automatically). ``convert`` writes SRC's text
decoder to DST with MXFP4 linear weights (see jax_mila/gemma4/convert.py); the other towers
are not copied.

--prompt and --prompt-ids may be repeated: the prompts run as one batch, each of its own
length (right padded; gemma4.prefill's ``lengths``), and each continues from its own end.

--chunk-size N runs the prompt in chunks of N tokens (one compiled step, cache donated, a
progress bar over the chunks); by default a prompt longer than a chunk sized from the free
device memory (2048 tokens where the device reports none) is chunked, a shorter one runs in
one call.

generate stops at the checkpoint's EOS ids (config.json's eos_token_id, and
generation_config.json's) unless --ignore-eos, and streams the tokens as they come, --block
decode steps at a time: as text where the checkpoint has a tokenizer.json, else as ids.

Without --model the small embedded checkpoint (random weights) is used, so the commands run
anywhere, CPU included; they print the tokens, the prefill / decode throughput, the time to
first token and the peak device memory (allocator statistics; not reported on CPU).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

log = logging.getLogger("jax_mila")

PROG = "python -m jax_mila"


def _token_ids(text: str) -> list[int]:
    """--prompt-ids' value: comma- or space-separated integers, at least one (argparse names the
    flag in the error; the vocabulary is checked once the model is loaded)."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given (expected e.g. 2,17,5)")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma- or space-separated integer ids, got {text!r}") from None


def _prompt_ids(args, vocab_size: int):
    """(ids [B, S] int32, lengths [B] or None, tokenizer or None): one row per --prompt or
    --prompt-ids given (each may be repeated), right padded with id 0 to the longest; lengths
    None where every row has the same length."""
    import numpy as np

    tokenizer = None
    if args.prompt_ids is not None:
        rows = args.prompt_ids
        bad = sorted({t for row in rows for t in row if not 0 <= t < vocab_size})
        if bad:
            sys.exit(f"--prompt-ids: {bad} outside the vocabulary [0, {vocab_size})")
    elif args.prompt is not None:
        tokenizer = _tokenizer(args.model)
        rows = [tokenizer.encode(text).ids for text in args.prompt]
        empty = [i for i, row in enumerate(rows) if not row]
        if empty:
            sys.exit(f"--prompt: prompt {empty[0]} encodes to no tokens")
    else:
        rng = np.random.default_rng(args.seed)  # synthetic prompt: BOS then random ids
        ids = rng.integers(3, vocab_size, size=(1, args.length), dtype=np.int32)
        ids[:, 0] = 2
        return ids, None, None
    lengths = np.asarray([len(row) for row in rows], np.int32)
    ids = np.zeros((len(rows), lengths.max()), np.int32)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    return ids, None if (lengths == lengths[0]).all() else lengths, tokenizer


def _tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"--prompt needs {path}; pass token ids with --prompt-ids instead")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("--prompt needs the `tokenizers` package (pip install tokenizers)")
    return Tokenizer.from_file(path)


def _optional_tokenizer(model_dir: str):
    """The checkpoint's tokenizer for showing the output, or None (no tokenizer.json, or no
    `tokenizers` package)."""
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path) if os.path.isfile(path) else None


def _timed(fn, *args, **kwargs):
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def _run(args, parser) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_mila import gemma4
    from jax_mila._selftest import gpu_install_hint
    from jax_mila.engine.run import DEFAULT_BLOCK

    hint = gpu_install_hint()
    if hint:  # a warning: running on the CPU may be what the user wants
        log.warning("%s: warning: %s", PROG, hint)

    args.model = _model_dir(parser, os.fspath(args.model or gemma4.embedded_checkpoint()))
    quantize, stored = _quantize_arg(args.quantize), _stored_format(args.model)
    if stored is not None and args.quantize is None:
        quantize = "w4a8"  # a converted checkpoint exists only in MXFP4
    elif stored is not None and quantize != "w4a8":  # from_pretrained's hint speaks Python
        _fail(parser, f"--model {args.model}: the checkpoint holds MXFP4 weights (written by "
                      f"convert); load it with --quantize w4a8 (got --quantize {args.quantize})")
    try:
        model = gemma4.from_pretrained(args.model, dtype=jnp.dtype(args.dtype),
                                       backend=args.backend, quantize=quantize)
    except (gemma4.loader.CheckpointError, ValueError, OSError) as e:
        _fail(parser, f"--model {args.model}: {_without_path(e, args.model)}")
    cfg = model.config
    ids, lengths, tokenizer = _prompt_ids(args, cfg.vocab_size)
    batch, length = ids.shape
    tokens_in = batch * length if lengths is None else int(lengths.sum())  # real prompt tokens
    new = args.new_tokens if args.command == "generate" else 0
    _warn_past_max_positions(cfg, length, new)
    print(f"model {args.model} ({cfg.model_type}, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}), {args.dtype}, backend {args.backend}, weights "
          f"{quantize or 'dense'}, device {jax.devices()[0]}")
    if batch == 1:
        print(f"prompt: {length} tokens" + (f": {ids[0].tolist()}" if length <= 32 else ""))
    for row in range(batch if batch > 1 else 0):
        n = length if lengths is None else int(lengths[row])
        print(f"prompt {row}: {n} tokens" + (f": {ids[row, :n].tolist()}" if n <= 32 else ""))

    cap = length + new
    chunking = dict(chunk_size=args.chunk_size, max_cache_len=cap,
                    kv_cache_dtype=args.kv_cache_dtype, lengths=lengths)
    (logits, cache), t_first = _timed(gemma4.prefill, model, ids, progress=True, **chunking)
    del logits, cache  # one cache alive at a time, so the peak below is one prefill's
    (logits, cache), t_prefill = _timed(gemma4.prefill, model, ids, progress=True, **chunking)
    print(f"prefill: {tokens_in} tokens in {t_prefill * 1e3:.1f} ms = {tokens_in / t_prefill:,.0f} "
          f"tokens/s (first call incl. compile {t_first:.2f} s, {_chunking(model, batch, length, cap, args)})")
    print(f"time to first token: {t_prefill * 1e3:.1f} ms (the prefill ends with the first new "
          f"token's logits)")
    print(_memory_line(model, cache))
    if new == 0:
        if batch == 1:
            print(f"next token: {int(jnp.argmax(logits[0]))}")
        else:
            print(f"next tokens (one per prompt): {np.asarray(jnp.argmax(logits, -1)).tolist()}")
        return
    stop = () if args.ignore_eos else cfg.eos_token_id
    block = min(args.block or DEFAULT_BLOCK, max(new - 1, 1))
    decoding = dict(stop_tokens=stop, block=block)
    if new > 1:  # compile (and run) the decode blocks once, then decode a fresh prefill's cache
        _, t_compile = _timed(gemma4.generate, model, ids, new, logits=logits, cache=cache,
                              **decoding)
        logits, cache = gemma4.prefill(model, ids, **chunking)
        jax.block_until_ready(cache)
    tokenizer = tokenizer or _optional_tokenizer(args.model)
    printer = _TokenPrinter(tokenizer)
    print("generated" + (" (prompt 0)" if batch > 1 else "") + ": ", end="", flush=True)
    tokens = gemma4.generate(model, ids, new, logits=logits, cache=cache, stream=printer,
                             **decoding)
    printer.finish()
    print()
    rows = [_until_stop(row, stop) for row in np.asarray(tokens).tolist()]
    out = rows[0]
    stopped = f", stopped at EOS {out[-1]}" if out[-1] in stop else ""
    steps = len(out) - 1
    if steps:
        t_decode = printer.last - printer.first
        print(f"decode: {steps} steps in {t_decode * 1e3:.1f} ms = {batch * steps / t_decode:,.1f} "
              f"tokens/s (blocks of {block} steps{stopped}; first call incl. compile "
              f"{t_compile:.2f} s)")
        print(f"throughput: prefill {tokens_in / t_prefill:,.0f} tokens/s, decode "
              f"{batch * steps / t_decode:,.1f} tokens/s (batch {batch})")
    elif stopped:
        print(f"decode: no steps (the first token is EOS {out[0]})")
    for row, out in enumerate(rows):
        name = f" (prompt {row})" if batch > 1 else ""
        print(f"generated ids{name}: {out}")
        if tokenizer is not None:
            print(_generated_text(tokenizer, out))


def _until_stop(tokens: list[int], stop) -> list[int]:
    """A row of generate's tokens up to and including its first stop token (the pad ids after
    it are the batch's, not the row's)."""
    ends = [i for i, t in enumerate(tokens) if t in stop]
    return tokens[:ends[0] + 1] if ends else tokens


class _TokenPrinter:
    """The ``stream`` callback of the generate command: prints row 0 of each block of tokens
    as it arrives, as text where a tokenizer is given (an id it has no token for as [id]),
    else as ids; records when the first and the last block came.

    Text is decoded from the ids since the last line break printed (a token's text can depend
    on its neighbours), and held back while it ends in a cut character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.line, self.shown = tokenizer, [], ""
        self.first = self.last = None

    def __call__(self, tokens) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last
        new = [int(t) for t in tokens[0]]
        if self.tokenizer is None:
            print(" ".join(map(str, new)), end=" ", flush=True)
            return
        self.line += new
        text = self._text()
        if not text.endswith("\ufffd"):  # else a character is cut between tokens: wait
            self._show(text)

    def finish(self) -> None:
        """Prints what is held back."""
        if self.tokenizer is not None:
            self._show(self._text())

    def _show(self, text: str) -> None:
        print(text[len(self.shown):] if text.startswith(self.shown) else text, end="", flush=True)
        self.shown = text
        if text.endswith("\n"):
            self.line, self.shown = [], ""

    def _text(self) -> str:
        parts, run = [], []
        for t in self.line:
            if self.tokenizer.id_to_token(t) is None:
                parts += [self.tokenizer.decode(run), f"[{t}]"]
                run = []
            else:
                run.append(t)
        return "".join(parts + [self.tokenizer.decode(run)])


def _generated_text(tokenizer, ids: list[int]) -> str:
    """The decoded text, and the ids the tokenizer has no token for: it drops them silently,
    and a tokenizer smaller than the model's vocabulary (the embedded checkpoint's: 674 of
    2048) would otherwise print '' for a random model's output."""
    text = f"generated text: {tokenizer.decode(ids)!r}"
    unknown = sorted({t for t in ids if tokenizer.id_to_token(t) is None})
    if unknown:
        text += (f" (ids {unknown} not shown: the tokenizer ({tokenizer.get_vocab_size()} "
                 "tokens) has no token for them)")
    return text


def _warn_past_max_positions(cfg, length: int, new: int) -> None:
    """A warning, not an error, when the prompt and the new tokens pass the config's
    max_position_embeddings: RoPE runs past it (long context beyond the config's value is a
    legitimate use; transformers only warns too), but the model may not be trained that far."""
    total = length + new
    if total <= cfg.max_position_embeddings:
        return
    positions = (f"the prompt ({length} tokens) + --new-tokens {new} = {total} positions" if new
                 else f"the prompt's {length} positions")
    log.warning("%s: warning: %s pass the model's max_position_embeddings (%d, its config.json); "
                "running anyway, but the model may not have been trained that far",
                PROG, positions, cfg.max_position_embeddings)


def _chunking(model, batch, length, cap, args) -> str:
    from jax_mila.engine.plan import default_chunk_size

    if args.chunk_size:
        return (f"chunks of {args.chunk_size}" if length > args.chunk_size
                else f"one chunk of {length} (chunk size {args.chunk_size})")
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


def _model_dir(parser, path: str) -> str:
    """``path`` when it is a directory, else the same error from every subcommand."""
    if not os.path.exists(path):
        _fail(parser, f"--model {path}: does not exist (expected a checkpoint directory)")
    if not os.path.isdir(path):
        _fail(parser, f"--model {path}: not a directory (expected a checkpoint directory, "
                      "holding config.json)")
    return path


def _without_path(error, path: str) -> str:
    """The message of a loader error, without the checkpoint path it starts with (the CLI
    names the path after --model already)."""
    return str(error).removeprefix(f"{path}: ")


def _stored_format(path):
    from jax_mila.gemma4 import mxfp4_names

    try:
        return mxfp4_names.checkpoint_format(path)
    except (OSError, ValueError):
        return None  # from_pretrained reports it


def _convert(args, parser) -> None:
    from jax_mila.gemma4.convert import convert
    from jax_mila.gemma4.loader import CheckpointError

    _model_dir(parser, args.model)
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
END_TO_END_BENCHES = ("prefill", "decode")


def _bench(args, parser) -> None:
    """Runs a benchmark.

    prefill, decode: jax_mila.bench.prefill / jax_mila.bench.decode (ship with the package), e.g.
        python -m jax_mila bench prefill --seqs 8192 --backends mila,reference
        python -m jax_mila bench decode --prompts 4096 --batches 1,8
    attention / gemm / quantize: the kernel benchmarks, benchmarks/<name>.py, which live in the
    source repository only (not installed); run from a source checkout, or run the script."""
    import subprocess

    import jax_mila

    if args.which in END_TO_END_BENCHES:
        import importlib

        bench = importlib.import_module(f"jax_mila.bench.{args.which}")
        bench.main(args.bench_args, prog=f"{PROG} bench {args.which}")
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
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("prefill", "run the prompt once and time it"),
                        ("generate", "prefill, then greedy decoding")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", help="checkpoint directory (default: the embedded checkpoint)")
        group = p.add_mutually_exclusive_group()
        group.add_argument("--prompt", action="append",
                           help="text (needs tokenizer.json in the checkpoint); repeat it for a "
                                "batch of prompts, of any lengths")
        group.add_argument("--prompt-ids", type=_token_ids, action="append",
                           help="comma- or space-separated token ids; repeat it for a batch of "
                                "prompts, of any lengths")
        group.add_argument("--length", type=int, default=64, help="synthetic prompt length (default 64)")
        if name == "generate":  # prefill generates nothing: there it would be ignored
            p.add_argument("--new-tokens", type=int, default=32,
                           help="at most this many tokens to generate (default 32)")
            p.add_argument("--block", type=int, default=None,
                           help="decode steps per compiled call; the tokens are shown block by "
                                "block (default 16, jax_mila.engine.run.DEFAULT_BLOCK)")
            p.add_argument("--ignore-eos", action="store_true",
                           help="do not stop at the checkpoint's EOS ids: always --new-tokens")
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
    p = sub.add_parser("bench", help="benchmarks: prefill, decode (end to end), or a kernel "
                                     "benchmark",
                       description=_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=END_TO_END_BENCHES + KERNEL_BENCHES, metavar="BENCHMARK",
                   help="prefill, decode: Gemma 4 end to end (jax_mila.bench.<name>); attention, "
                        "gemm, quantize: benchmarks/<name>.py of a source checkout")
    rest = p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS",
                          help="passed to the benchmark (e.g. --seqs 8192 --backends "
                               "mila,reference; BENCHMARK --help lists them)")
    rest.required = False  # argparse marks REMAINDER required, but `bench attention` needs none
    p = sub.add_parser("convert", help="write a checkpoint's text decoder with MXFP4 weights")
    p.add_argument("--model", required=True, help="source checkpoint directory (single file or sharded)")
    p.add_argument("--out", required=True, help="output directory (created; must not hold a checkpoint)")
    p.add_argument("--quantize", choices=("w4a8", "none"), default="w4a8",
                   help="weight format of the linears (default w4a8; none copies them dense)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    from jax_mila import _env
    from jax_mila.ffi._registry import disabled_ops

    try:
        disabled_ops()  # JAX_MILA_DISABLE, checked before any work
        _main(args, parser)
    except _env.EnvError as e:  # a JAX_MILA_* variable: one line, no traceback
        _fail(parser, str(e))


def _main(args, parser) -> None:
    if args.command == "convert":
        _convert(args, parser)
        return
    if args.command == "bench":
        _bench(args, parser)
        return
    if args.command == "selftest":
        import jax_mila
        from jax_mila._selftest import gpu_install_hint

        results = jax_mila.selftest(verbose=True)
        failed = [r for r in results if r.outcome in ("MISMATCH", "ERROR")]
        sys.exit(1 if failed or gpu_install_hint() else 0)  # a GPU left unused fails too
    if args.command == "generate" and args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    if args.seed < 0:  # numpy's seeds are non-negative
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.length is not None and args.length < 1:
        parser.error("--length must be >= 1")
    if args.chunk_size is not None and args.chunk_size < 1:
        parser.error("--chunk-size must be >= 1")
    if getattr(args, "block", None) is not None and args.block < 1:
        parser.error("--block must be >= 1")
    _run(args, parser)


if __name__ == "__main__":
    main()
