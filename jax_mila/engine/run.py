"""The entry points: forward, prefill (the chunk loop), decode and greedy generate.

``prefill`` runs the prompt (positions 0..S-1), in one call or in chunks, and returns the last
position's logits and the cache; ``generate`` continues greedily one token per step from that
cache. The decode steps use the same positions, window and masks as a full re-run, so the
tokens equal those of re-running the full sequence at every step (the parity suite checks
this). ``decode`` runs the steps in blocks, one compiled program each (jitted.decode_steps),
hands each block's tokens out as it arrives and stops at stop tokens between blocks.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila.engine import jitted, pieces, plan, sharded
from jax_mila.ffi._checks import is_int
from jax_mila.parallel import chunked


def _check_count(name: str, value, *, allow_none: bool = False) -> int | None:
    """``value`` as an int >= 1 (None where allowed); ValueError naming ``name`` otherwise
    (2.5, "4" and True are refused, not coerced)."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got "
                         f"{value!r}")
    return int(value)


def check_lengths(lengths, batch: int, width: int) -> np.ndarray | None:
    """``lengths`` (None, or one prompt length per row: a list, tuple, NumPy or jax array of
    integers, shape [batch], each in [1, width]) as int32 [batch]; None where it is None.
    ValueError naming ``lengths``, what it got and what is supported otherwise. Values are
    needed on the host (they set the chunks' real tokens): a traced array is refused."""
    if lengths is None:
        return None
    if isinstance(lengths, jax.core.Tracer):
        raise ValueError("lengths must be concrete (a list or an array of ints), got a traced "
                         "value: prefill runs its chunks from the host")
    if isinstance(lengths, (str, bytes)) or is_int(lengths):
        raise ValueError(f"lengths must be a sequence of {batch} ints (one per row of "
                         f"input_ids), got {lengths!r}")
    try:
        host = np.asarray(lengths)
    except (TypeError, ValueError):
        raise ValueError(f"lengths must be a sequence of {batch} ints (one per row of "
                         f"input_ids), got {lengths!r}") from None
    if host.dtype == bool or not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {host.dtype} ({lengths!r}); "
                         "supported: an int array or a list of ints, shape [B]")
    if host.shape != (batch,):
        raise ValueError(f"lengths must have shape [B] = [{batch}] (one per row of input_ids "
                         f"[{batch}, {width}]), got shape {list(host.shape)}")
    bad = [(i, int(n)) for i, n in enumerate(host.tolist()) if not 1 <= n <= width]
    if bad:
        raise ValueError(f"lengths: each must be in [1, {width}] (1 <= length <= the prompt's "
                         f"width S); got (row, length) {bad[:10]}")
    return host.astype(np.int32)


def forward(model, input_ids, mesh=None, *, heads_axis: str | None = "heads",
            seq_axis: str | None = None) -> jax.Array:
    """Jitted ``model(input_ids)``: logits [B, S, vocab]; compiles once per input shape.

    ``mesh``: run it on a jax.sharding.Mesh instead, heads split over ``heads_axis``, the
    sequence over ``seq_axis`` (either may be None, not both; engine.sharded.forward)."""
    if mesh is not None:
        return sharded.forward(model, input_ids, mesh, heads_axis=heads_axis, seq_axis=seq_axis)
    return jitted.forward_step(*jitted.model_args(model), model.check_input_ids(input_ids))


def prefill(model, input_ids, *, lengths=None, chunk_size: int | None = None,
            max_cache_len: int | None = None, progress: bool = False, kv_cache_dtype=None,
            mesh=None, tp_axis: str = "heads", seq_axis: str = "seq",
            seq_segments: int | None = None, piece_layers: int | None = pieces.PIECE_LAYERS):
    """Runs the prompt [B, S]; returns (logits of the last position [B, vocab], KVCache).

    ``lengths`` (None: every row is S tokens long): prompts of different lengths, right
    padded: row b's prompt is input_ids[b, :lengths[b]] and what follows is padding (any ids
    in the vocabulary). A list, tuple or array of ints of shape [B], each in [1, S]
    (``check_lengths``). Row b's logits are then those of its position lengths[b] - 1 and
    its cache holds lengths[b] positions (cache.length[b]), as if it had been prefilled
    alone: padding comes after every real query (causal), is never written to a ring and,
    in a full layer, only past the row's length, where decode never reads it. The prompt then
    runs through the chunked step (per-row real tokens), cut to max(lengths) columns; not
    with context parallelism (``seq_axis``) yet.

    ``max_cache_len`` (default S; with ``lengths``, the longest) is the number of positions
    the cache can hold in total, prompt included; sliding layers keep only a ring of
    ``sliding_window`` positions.

    ``chunk_size``: the prompt runs in chunks of that many tokens, each one jitted step that
    updates the (donated) cache, so activation memory is bounded by the chunk, not the prompt.
    The last chunk is padded to chunk_size (padding is never written to the cache and comes
    after every real query), so one compiled step serves every chunk and prompt length; a
    prompt no longer than chunk_size runs as one chunk of its own length.
    None: ``plan.default_chunk_size``; a prompt that fits in one such chunk runs as one chunk
    without padding (compiled per prompt length: in layer pieces where they apply, else in one
    call); a longer one ends in a chunk of the tokens left, padded only up to a power of two
    (``plan.chunk_spans``): one more compiled step per such tail size, against up to a whole
    chunk of padding (at 32768 tokens a chunk, a 33K prompt would otherwise compute 64K).
    ``progress`` shows a tqdm bar over the chunks.

    ``kv_cache_dtype="float8_e4m3fn"`` stores the full-attention layers' K/V (the part of the
    cache that grows with the sequence) in FP8, half the bytes (accuracy: docs/design/model.md);
    the prompt then always runs through the chunked step.

    ``mesh``: a jax.sharding.Mesh with a ``tp_axis`` axis, a ``seq_axis`` axis or both (axes
    named by neither replicate); the prompt then always runs through the chunked step.
    - ``tp_axis``: tensor parallelism (query heads, MLP and their weights split over that
      axis, jax_mila.parallel.tensor; the cache comes back sharded the same way).
    - ``seq_axis``: context parallelism (jax_mila.parallel.chunked): each chunk's tokens are
      split over that axis (the chunk size must be a multiple of its devices; the default
      chunk size is rounded up to one), weights are replicated over it, and the
      full-attention layers' cache is sharded by position in ``seq_segments`` zig-zag
      segments per device (default chunked.DEFAULT_SEGMENTS), so each device holds 1/devices
      of it. The capacity is rounded up to a multiple of devices x segments, and the cache
      comes back in that layout (``cache.seq_layout``; decode does not take it yet;
      jax_mila.parallel.cache_in_position_order gathers it back to positions).

    ``piece_layers``: on one device, where the model allows it, each chunk runs as pieces of
    that many consecutive layers (after a first piece of pieces.FIRST_PIECE_LAYERS), one
    jitted call each, so the host dispatches the first piece before it has taken the whole
    model apart (jax_mila.engine.pieces); None runs each chunk as one jitted step."""
    ids = model.check_input_ids(input_ids)
    batch, length = ids.shape
    lengths = check_lengths(lengths, batch, length)
    if max_cache_len is not None:
        max_cache_len = _check_count("max_cache_len", max_cache_len)
    chunk_size = _check_count("chunk_size", chunk_size, allow_none=True)
    if lengths is not None:
        if mesh is not None and seq_axis in mesh.axis_names:
            raise ValueError(f"lengths with context parallelism (mesh axis seq_axis="
                             f"{seq_axis!r}) is not supported yet; pass prompts of one "
                             "length, or a mesh without that axis")
        # Columns past the longest prompt are padding of every row: never run.
        length = int(lengths.max())
        ids = ids[:, :length]
        if (lengths == length).all():
            lengths = None  # one length: the batch runs as any other
    max_len = length if max_cache_len is None else max_cache_len
    if max_len < length:
        raise ValueError(f"max_cache_len={max_len} is shorter than the prompt ({length})")
    if piece_layers is not None and (not isinstance(piece_layers, int) or piece_layers < 1):
        raise ValueError(f"piece_layers must be an int >= 1 or None, got {piece_layers!r}")
    tp, seq, devices = None, None, 1
    if mesh is not None:
        tp, seq = sharded.check_mesh(mesh, tp_axis, seq_axis)
        devices = mesh.shape[seq] if seq is not None else 1
        segments = chunked.DEFAULT_SEGMENTS if seq_segments is None else seq_segments
        chunked.check_segments(segments)
        if chunk_size is not None and chunk_size % devices:
            raise ValueError(f"chunk_size={chunk_size}: context parallelism over {devices} "
                             f"devices ({seq_axis!r}) needs a multiple of {devices}")
    size = plan.default_chunk_size(model, batch, max_len) if chunk_size is None else chunk_size
    in_pieces = mesh is None and piece_layers is not None and pieces.applies(model)
    if length <= size:
        # One unpadded chunk. Where the layer pieces apply it runs in them, as longer prompts
        # do (the one-shot call would expose the whole model's flatten and dispatch before
        # the device starts).
        if kv_cache_dtype is None and mesh is None and not in_pieces and lengths is None:
            return jitted.prefill_step(*jitted.model_args(model), ids, max_len)
        size = length  # one chunk, through the chunked step
    size = -(-size // devices) * devices  # a chosen size, rounded up for the seq axis
    spans = plan.chunk_spans(length, size, short_tail=chunk_size is None, multiple=devices)
    padded = jnp.pad(ids, ((0, 0), (0, sum(spans) - length)))  # pad id 0, never cached
    layout = ()
    if seq is not None:
        max_len, layout = chunked.capacity(max_len, devices, segments), (devices, segments)
    make_cache = functools.partial(model.empty_cache, batch, max_len, full_dtype=kv_cache_dtype,
                                   seq_layout=layout)
    if in_pieces:
        # Layer pieces: the host takes apart and dispatches only the first piece before the
        # device starts; the head's weights are taken after the chunks.
        cache, state = make_cache(), None
        step = pieces.ChunkPieces(model, piece_layers).step
    elif mesh is None:
        cache = make_cache()
        structure, state = jitted.model_args(model)  # once per call: the weights as they are now
        step = functools.partial(jitted.chunk_step_fn(model), structure)
    else:
        step, state, cache = sharded.chunk_step(model, nnx.state(model), make_cache, mesh,
                                                tp_axis=tp, seq_axis=seq, segments=segments)
    # The first chunk starts on an empty cache: its sliding layers can attend over the chunk's
    # own keys rather than a slab of ring and chunk (cache.chunk_update's `first`). That step
    # compiles on its own, so it runs only where no later chunk has the first one's width
    # (one chunk, or whole chunks and a shorter tail) and would have shared its compile.
    first_own = mesh is None and spans[0] not in spans[1:]
    chunks = zip(itertools.accumulate(spans[:-1], initial=0), spans)  # (start, width)
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, total=len(spans), unit="chunk",
                      desc=f"prefill ({size} tokens/chunk)")
    last = None
    for start, width in chunks:
        first = {"first": True} if first_own and start == 0 else {}
        if lengths is None:
            valid = jnp.int32(min(width, length - start))
        else:  # each row's real tokens in this chunk (0 once its prompt has ended)
            row_valid = np.clip(lengths - start, 0, width).astype(np.int32)
            valid = jnp.asarray(row_valid)
        out, cache = step(state, cache, padded[:, start:start + width], valid, **first)
        if lengths is not None and last is not None:
            # A row's last real token is in the last chunk where it has any.
            out = jnp.where(jnp.asarray(row_valid > 0)[:, None], out, last)
        last = out
        if progress:  # otherwise the bar would count asynchronous dispatches, not finished chunks
            out.block_until_ready()
    # Each step returns the last real token's hidden state; its logits once, here. The mesh
    # head is looked up only now (its weight specs walk the model), while the chunks run.
    if in_pieces:
        structure, state = jitted.model_args(model)
    if mesh is None:
        return jitted.head_fn(model)(structure, state, out), cache
    return sharded.head(model, state, mesh, tp_axis=tp)(state, out), cache


# Decode steps per block where decode picks the size (stop tokens or a stream, no block given):
# tokens reach the host every 16 steps, at most two blocks run past the last stop, and the
# host's work on a block (about 0.25 ms on a CPU host, docs/api.md) is a small part of 16 steps.
DEFAULT_BLOCK = 16


def _stop_ids(model, stop_tokens) -> np.ndarray:
    """``stop_tokens`` (None, one id or a sequence of ids) as int32 ids in the vocabulary,
    padded with -1 (matches nothing) to a multiple of 8, so the usual lists share one compile
    of the decode block."""
    if stop_tokens is None:
        ids = []
    elif is_int(stop_tokens):
        ids = [stop_tokens]
    else:
        try:
            ids = list(stop_tokens)
        except TypeError:
            raise ValueError(f"stop_tokens must be None, a token id or a sequence of token ids, "
                             f"got {stop_tokens!r}") from None
    if not all(is_int(t) for t in ids):
        raise ValueError(f"stop_tokens must be integer token ids, got {stop_tokens!r}")
    vocab = model.config.vocab_size
    bad = sorted({int(t) for t in ids if not 0 <= t < vocab})
    if bad:
        raise ValueError(f"stop_tokens: {bad} outside the vocabulary [0, {vocab})")
    out = np.full(max(8, -(-len(ids) // 8) * 8), -1, np.int32)
    out[:len(ids)] = ids
    return out


def _pad_id(model, stop: np.ndarray) -> int:
    """What a finished row emits: the config's pad_token_id, else its first stop id."""
    pad = model.config.pad_token_id
    return int(pad) if pad is not None else int(stop[0]) if stop[0] >= 0 else 0


def _finished(tokens: np.ndarray, stop: np.ndarray, done: np.ndarray):
    """(done after ``tokens`` [B, n], the columns up to the last row's stop token): a row is done
    once it has emitted a stop id; columns after every row is done hold only pad ids."""
    ids = stop[stop >= 0]
    if not ids.size:
        return done, tokens.shape[1]
    hits = (tokens[:, :, None] == ids).any(axis=2)
    now = done | hits.any(axis=1)
    if not now.all():
        return now, tokens.shape[1]
    ends = np.where(done, 0, hits.argmax(axis=1) + 1)  # rows done before this block need none
    return now, int(ends.max())


def _decode_blocks(model, token, cache, steps: int, block: int, stop: np.ndarray, pad: int,
                   done: np.ndarray, drain: bool):
    """Generator behind decode: yields each block's tokens (NumPy [B, n]) as they reach the host,
    with the number of its columns up to the last stop token (n while some row runs on), and
    returns the cache.

    The host keeps one block in flight: it dispatches block k+1 before it waits for block k's
    tokens, so the device does not wait for the host between blocks. After block k, in which
    every row has stopped, it dispatches nothing more; block k+1, already running, holds only
    pad tokens: ``drain`` waits for it and yields it (its positions are in the returned cache),
    else it is left to finish unseen. The weights are taken apart once, not per block."""
    sizes = [block] * (steps // block) + ([steps % block] if steps % block else [])
    structure, weights = jitted.model_args(model)
    stop_dev, pad_dev, dev_done = jnp.asarray(stop), jnp.int32(pad), jnp.asarray(done)
    in_flight, stopped = [], False
    for size in sizes:
        out, token, cache, dev_done = jitted.decode_steps(
            structure, weights, cache, token, dev_done, stop_dev, pad_dev, size)
        in_flight.append(out)
        if len(in_flight) == 2:
            tokens = np.asarray(in_flight.pop(0))
            done, keep = _finished(tokens, stop, done)
            yield tokens, keep
            if done.all():
                stopped = True
                break
    if in_flight and (drain or not stopped):
        tokens = np.asarray(in_flight.pop())
        yield tokens, _finished(tokens, stop, done)[1]
    return cache


def decode(model, token, cache, steps: int, *, stop_tokens=None, block: int | None = None,
           stream=None):
    """Feeds ``token`` [B] (row b's token at its position cache.length[b]: rows of a prefill
    given ``lengths`` each continue from their own end) and then its own greedy choices for up
    to ``steps`` steps. Returns (the new tokens [B, n], cache), n the steps
    run: the returned cache holds n more positions. The cache passed in is donated (do not
    reuse it).

    ``stop_tokens`` (None, an id or a sequence of ids, e.g. ``model.config.eos_token_id``):
    a row ends with the first one it emits, then emits the pad id (config.pad_token_id; the
    first stop id where the config has none) until the batch ends; the rows of a batch decode
    together, each stopping on its own. Decoding ends after the block in which every row has
    stopped and the block already dispatched behind it (pad ids only), so then n < steps.
    None (the default): no stop, n = steps.

    ``block``: the device runs ``block`` steps per compiled call (one compiled program per
    block size, and one for a shorter last block; the cache is donated from block to block,
    no host round trip within a block). The host copies each block's tokens back, hands them
    out and decides whether to go on, while the next block runs: it keeps one block in
    flight. ``stream(tokens)`` is called with each block's tokens as they arrive (NumPy int32
    [B, k], without the columns after every row has stopped). None: one block of ``steps``
    where nothing can end early and nothing streams, else DEFAULT_BLOCK. A block costs the
    host one dispatch and one copy of its tokens (docs/api.md gives the overhead measured per
    token); smaller blocks hand tokens out sooner and run fewer steps past a stop (up to two
    blocks).

    Rows not stopped get exactly the tokens of ``steps`` plain greedy steps, whatever the
    block."""
    steps = _check_count("steps", steps)
    block = _check_count("block", block, allow_none=True)
    _check_stream(stream)
    token = model.check_input_ids(token, name="token", rank=1)
    stop = _stop_ids(model, stop_tokens)
    _check_cache(cache, token.shape[0], steps)
    blocks, cache = _run_blocks(model, token, cache, steps, block, stop,
                                np.zeros(token.shape[0], bool), stream, drain=True)
    return jnp.asarray(np.concatenate(blocks, axis=1)), cache


def _check_stream(stream) -> None:
    if stream is not None and not callable(stream):
        raise ValueError(f"stream must be None or a callable taking each block's tokens, got "
                         f"{stream!r}")


def _check_cache(cache, batch: int, steps: int) -> None:
    """ValueError unless ``cache`` suits ``steps`` decode steps of a [batch] token."""
    cache_batch = cache.keys[next(i for i, k in enumerate(cache.keys) if k is not None)].shape[0]
    if batch != cache_batch:
        raise ValueError(f"decode: token has batch {batch}, the cache {cache_batch}")
    if cache.seq_layout:
        raise ValueError(f"decode takes a cache in position order; this one is sharded by "
                         f"position (seq_layout {cache.seq_layout}, a context-parallel prefill): "
                         "pass it through jax_mila.parallel.cache_in_position_order")
    longest = int(np.max(np.asarray(cache.length)))
    needed = longest + steps
    if needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {steps} decode steps from "
                         f"length {longest} need {needed} (pass a larger max_cache_len)")


def _run_blocks(model, token, cache, steps, block, stop, done, stream, *, drain):
    """Runs _decode_blocks to its end: (the blocks' tokens, the cache), each block handed to
    ``stream`` as it arrives, without the columns after the last stop token."""
    if block is None:
        block = steps if stream is None and (stop < 0).all() else DEFAULT_BLOCK
    gen = _decode_blocks(model, token, cache, steps, min(block, steps), stop,
                         _pad_id(model, stop), done, drain)
    blocks = []
    while True:
        try:
            tokens, keep = next(gen)
        except StopIteration as end:
            return blocks, end.value
        blocks.append(tokens)
        if stream is not None and keep:
            stream(tokens[:, :keep])


def generate(model, input_ids, max_new_tokens: int, *, lengths=None, cache=None,
             logits=None, chunk_size: int | None = None, progress: bool = False,
             kv_cache_dtype=None, stop_tokens=None, block: int | None = None,
             stream=None) -> jax.Array:
    """Greedy continuation of ``input_ids`` [B, S]: returns the new token ids [B, n].

    Without ``cache``, runs ``prefill`` first (sized for S + max_new_tokens; ``lengths``,
    ``chunk_size``, ``progress`` and ``kv_cache_dtype`` are passed to it). To continue an
    existing prefill, pass its ``logits`` and ``cache`` (its capacity must cover the new
    tokens; it is donated); its rows' lengths are the cache's, so ``lengths`` is then refused.

    ``lengths`` (prompts of different lengths, right padded; prefill says what it takes):
    row b continues from its own end, input_ids[b, :lengths[b]], as if generated alone.

    ``stop_tokens`` (e.g. ``model.config.eos_token_id``: EOS, and <turn|> for an
    instruction-tuned checkpoint): a row ends with the first one it emits; the rows of a batch
    decode together and each stops on its own. n is the longest row's length; a shorter row
    is its tokens up to and including its stop token, then pad ids (config.pad_token_id). None
    (the default): no stop, n = max_new_tokens, the fixed count that benchmarks and parity
    checks rely on.

    ``stream(tokens)`` is called with the tokens as they arrive, NumPy int32 [B, k]: the
    prefill's token [B, 1], then each decode block (``block`` steps, chosen as in ``decode``,
    which tells what a block costs); together they are the result.
    """
    max_new_tokens = _check_count("max_new_tokens", max_new_tokens)
    block = _check_count("block", block, allow_none=True)
    _check_stream(stream)
    ids = model.check_input_ids(input_ids)
    stop = _stop_ids(model, stop_tokens)
    if (cache is None) != (logits is None):
        raise ValueError("pass both the cache and the last logits of a prefill, or neither")
    if cache is not None and lengths is not None:
        raise ValueError("lengths is for generate's own prefill; a cache passed in holds its "
                         "rows' lengths already (pass lengths to the prefill that made it)")
    if cache is None:
        logits, cache = prefill(model, ids, lengths=lengths, chunk_size=chunk_size,
                                progress=progress, max_cache_len=ids.shape[1] + max_new_tokens,
                                kv_cache_dtype=kv_cache_dtype)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    steps = max_new_tokens - 1
    if steps:  # before the first token is handed out
        _check_cache(cache, first.shape[0], steps)
    head = np.asarray(first)[:, None]
    done, _ = _finished(head, stop, np.zeros(head.shape[0], bool))
    if stream is not None:
        stream(head)
    if not steps or done.all():
        return jnp.asarray(head)
    # The cache is not handed back: the block in flight after the last stop is not waited for.
    blocks, _ = _run_blocks(model, first, cache, steps, block, stop, done, stream, drain=False)
    tokens = np.concatenate([head] + blocks, axis=1)
    hits = np.isin(tokens, stop[stop >= 0])
    if hits.any(axis=1).all():  # every row stopped: drop the columns after the last stop
        tokens = tokens[:, :int((hits.argmax(axis=1) + 1).max())]
    return jnp.asarray(tokens)
