"""The entry points: forward, prefill (the chunk loop), decode and greedy generate.

``prefill`` runs the prompt (positions 0..S-1), in one call or in chunks, and returns the last
position's logits and the cache; ``generate`` continues greedily one token per step from that
cache. The decode steps use the same positions, window and masks as a full re-run, so the
tokens equal those of re-running the full sequence at every step (the parity suite checks
this).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
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


def forward(model, input_ids, mesh=None, *, heads_axis: str | None = "heads",
            seq_axis: str | None = None) -> jax.Array:
    """Jitted ``model(input_ids)``: logits [B, S, vocab]; compiles once per input shape.

    ``mesh``: run it on a jax.sharding.Mesh instead, heads split over ``heads_axis``, the
    sequence over ``seq_axis`` (either may be None, not both; engine.sharded.forward)."""
    if mesh is not None:
        return sharded.forward(model, input_ids, mesh, heads_axis=heads_axis, seq_axis=seq_axis)
    return jitted.forward_step(*jitted.model_args(model), model.check_input_ids(input_ids))


def prefill(model, input_ids, *, chunk_size: int | None = None,
            max_cache_len: int | None = None, progress: bool = False, kv_cache_dtype=None,
            mesh=None, tp_axis: str = "heads", seq_axis: str = "seq",
            seq_segments: int | None = None, piece_layers: int | None = pieces.PIECE_LAYERS):
    """Runs the prompt [B, S]; returns (logits of the last position [B, vocab], KVCache).

    ``max_cache_len`` (default S) is the number of positions the cache can hold in total,
    prompt included; sliding layers keep only a ring of ``sliding_window`` positions.

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
    max_len = length if max_cache_len is None else _check_count("max_cache_len", max_cache_len)
    if max_len < length:
        raise ValueError(f"max_cache_len={max_len} is shorter than the prompt ({length})")
    chunk_size = _check_count("chunk_size", chunk_size, allow_none=True)
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
        if kv_cache_dtype is None and mesh is None and not in_pieces:
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
    for start, width in chunks:
        valid = jnp.int32(min(width, length - start))
        first = {"first": True} if first_own and start == 0 else {}
        out, cache = step(state, cache, padded[:, start:start + width], valid, **first)
        if progress:  # otherwise the bar would count asynchronous dispatches, not finished chunks
            out.block_until_ready()
    # Each step returns the last real token's hidden state; its logits once, here. The mesh
    # head is looked up only now (its weight specs walk the model), while the chunks run.
    if in_pieces:
        structure, state = jitted.model_args(model)
    if mesh is None:
        return jitted.head_fn(model)(structure, state, out), cache
    return sharded.head(model, state, mesh, tp_axis=tp)(state, out), cache


def decode(model, token, cache, steps: int):
    """Feeds ``token`` [B] (the token at position cache.length) and then its own greedy
    choices for ``steps`` steps. Returns (the ``steps`` new tokens [B, steps], cache).
    The cache passed in is donated (do not reuse it)."""
    steps = _check_count("steps", steps)
    token = model.check_input_ids(token, name="token", rank=1)
    batch = cache.keys[next(i for i, k in enumerate(cache.keys) if k is not None)].shape[0]
    if token.shape[0] != batch:
        raise ValueError(f"decode: token has batch {token.shape[0]}, the cache {batch}")
    if cache.seq_layout:
        raise ValueError(f"decode takes a cache in position order; this one is sharded by "
                         f"position (seq_layout {cache.seq_layout}, a context-parallel prefill): "
                         "pass it through jax_mila.parallel.cache_in_position_order")
    needed = int(cache.length) + steps
    if needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {steps} decode steps from "
                         f"length {int(cache.length)} need {needed} (pass a larger max_cache_len)")
    return jitted.decode_steps(*jitted.model_args(model), cache, token, steps)


def generate(model, input_ids, max_new_tokens: int, *, cache=None, logits=None,
             chunk_size: int | None = None, progress: bool = False,
             kv_cache_dtype=None) -> jax.Array:
    """Greedy continuation of ``input_ids`` [B, S]: returns the new token ids [B, max_new_tokens].

    Without ``cache``, runs ``prefill`` first (sized for S + max_new_tokens; ``chunk_size``,
    ``progress`` and ``kv_cache_dtype`` are passed to it). To continue an
    existing prefill, pass its ``logits`` and ``cache`` (its capacity must cover the new
    tokens; it is donated). There is no early stop at EOS: exactly max_new_tokens come back.
    """
    max_new_tokens = _check_count("max_new_tokens", max_new_tokens)
    ids = model.check_input_ids(input_ids)
    if (cache is None) != (logits is None):
        raise ValueError("pass both the cache and the last logits of a prefill, or neither")
    if cache is None:
        logits, cache = prefill(model, ids, chunk_size=chunk_size, progress=progress,
                                max_cache_len=ids.shape[1] + max_new_tokens,
                                kv_cache_dtype=kv_cache_dtype)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if max_new_tokens == 1:
        return first[:, None]
    rest, _ = decode(model, first, cache, max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest], axis=1)
