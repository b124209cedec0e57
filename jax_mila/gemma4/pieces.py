"""The chunked prefill's step in pieces of consecutive decoder layers, one jitted call each.

Why: one jitted chunk step takes the whole model as arguments (the 12B: 1,322 arrays). Before
the device can start the first chunk, the host must take the model apart (a pytree flatten,
~6 ms on the H200's host) and dispatch that call (7-13 ms, growing faster than the argument
count). The GPU idles through both, 25-28 ms of a 32K prefill's ~1,005 ms
(docs/performance.md, twenty-first round). In pieces, the host only flattens and dispatches
the first piece (the embedding and FIRST_PIECE_LAYERS layers) before the device has work; the
other pieces are flattened and dispatched while it runs.

A piece reads the embedding (the first piece) and its layers' weights, takes the hidden state
of the piece before it (the first: the chunk's token ids) and its layers' cache entries
(donated), and returns the hidden state (the last piece: the last real token's, as
generate.chunk_hidden does) and the new entries. Each layer runs exactly as
Gemma4ForCausalLM.hidden_states(mode="chunk") runs it (both through model.run_layers), so the
pieces compute what the one-step chunk does. Models with per-layer embeddings or KV-shared
layers keep the one-step path (a layer there reads more than its own entry and the previous
hidden state), as does every mesh.
JAX_MILA_PREFILL_ONE_STEP=1 (read per prefill call) keeps it too, for A/B timing.
"""

from __future__ import annotations

import functools
import importlib
import os

import jax
import jax.numpy as jnp

from jax_mila.gemma4.cache import KVCache
from jax_mila.gemma4.model import Gemma4ForCausalLM, run_layers
from jax_mila.gemma4.rope import rope_tables

ONE_STEP_ENV = "JAX_MILA_PREFILL_ONE_STEP"
FIRST_PIECE_LAYERS = 2  # what the host takes apart and dispatches before the device has work
# The other pieces: each is a dispatch per chunk (hidden behind the device) and a boundary
# where one executable ends before the next starts. 12B at chunk 16384 (docs/performance.md,
# twenty-first round): -16.2 ms at 32K and -8.8 ms at 64K against one step, which fits ~24 ms
# of host time saved and ~0.4 ms lost per boundary. Larger pieces would lose less; the host
# keeps ahead as long as it takes a piece apart and dispatches it faster than the device runs
# the one before (2 layers: ~40 ms at chunk 16384). JAX_MILA_PREFILL_PIECE_LAYERS (read per
# prefill call) overrides it, for A/B timing.
PIECE_LAYERS = 6
PIECE_LAYERS_ENV = "JAX_MILA_PREFILL_PIECE_LAYERS"


def applies(model: Gemma4ForCausalLM) -> bool:
    """Whether ``generate.prefill`` runs this model's single-device chunks in pieces: not with
    per-layer embeddings or KV-shared layers, nor where flax does not flatten modules to their
    arrays (generate.model_args then takes the nnx.split path, and so does the one-step chunk)."""
    cfg = model.config
    if (os.environ.get(ONE_STEP_ENV) == "1" or cfg.has_ple or cfg.num_kv_shared_layers
            or not len(model.layers)):
        return False
    try:
        leaves = jax.tree.leaves(model.layers[0].input_layernorm)
    except Exception:  # noqa: BLE001 -- any flatten failure means graph mode
        return False
    return bool(leaves) and all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or
                                hasattr(x, "__array__") for x in leaves)


def bounds(num_layers: int, piece_layers: int | None = None) -> list[tuple[int, int]]:
    """Layer ranges [start, stop) of the pieces: FIRST_PIECE_LAYERS, then ``piece_layers``
    each (default: JAX_MILA_PREFILL_PIECE_LAYERS if set, else PIECE_LAYERS)."""
    if piece_layers is None:
        piece_layers = int(os.environ.get(PIECE_LAYERS_ENV, PIECE_LAYERS))
    if piece_layers < 1:
        raise ValueError(f"{PIECE_LAYERS_ENV}={piece_layers}: a piece needs at least one layer")
    out, start, size = [], 0, FIRST_PIECE_LAYERS
    while start < num_layers:
        stop = min(start + size, num_layers)
        out.append((start, stop))
        start, size = stop, piece_layers
    return out


def _piece(structure, weights, x, entries, offset, valid, rope, dtype, max_len, last, first):
    """Layers of one piece on x (token ids for the first piece, else the hidden state)."""
    embed, layers = jax.tree.unflatten(structure, weights)
    h = embed(x) if embed is not None else x
    positions = offset + jnp.arange(h.shape[1], dtype=jnp.int32)
    tables = {layer_type: rope_tables(spec, positions, dtype) for layer_type, spec in rope}
    h, new_entries, _ = run_layers(layers, h, tables, entries, offset=offset, mode="chunk",
                                   max_len=max_len, valid=valid, first_chunk=first)
    if last:
        h = jax.lax.dynamic_index_in_dim(h, valid - 1, axis=1, keepdims=False)
    return h, tuple(new_entries)


_STATIC = ("structure", "rope", "dtype", "max_len", "last", "first")


@functools.cache
def _jitted(kernels: bool, donate_hidden: bool):
    """The piece's jit: the cache entries donated (updated in place), and the hidden state
    where the piece returns one of its shape (not the first piece, whose x is the token ids,
    nor the last, which returns one row), so XLA writes the new hidden state over the old:
    otherwise both are live across the piece (12B, chunk 32768: 0.23 GiB each). The kernel
    backend compiles as generate's chunk steps do, without XLA's autotuner."""
    # The module (gemma4.generate is also the function), imported here: it imports this one.
    generate = importlib.import_module("jax_mila.gemma4.generate")
    donate = ("x", "entries") if donate_hidden else ("entries",)
    options = generate._NO_AUTOTUNE if kernels else None
    return jax.jit(_piece, static_argnames=_STATIC, donate_argnames=donate,
                   compiler_options=options)


class ChunkPieces:
    """The pieces of one model for one prefill call: each piece's weights are taken from the
    model once, when the first chunk dispatches that piece (so the first chunk's later pieces
    are taken apart while the device runs its earlier ones), and reused by later chunks."""

    def __init__(self, model: Gemma4ForCausalLM):
        self._model = model
        self._bounds = bounds(len(model.layers))
        self._args: list = [None] * len(self._bounds)
        self._rope = tuple(sorted(model.config.rope.items()))
        self._kernels = model.backend != "reference"

    def _piece_args(self, i: int):
        if self._args[i] is None:
            start, stop = self._bounds[i]
            modules = (self._model.embed_tokens if start == 0 else None,
                       tuple(self._model.layers[start:stop]))
            leaves, structure = jax.tree.flatten(modules)
            self._args[i] = (structure, leaves)
        return self._args[i]

    def step(self, _state, cache: KVCache, input_ids, valid, *, first: bool = False):
        """One chunk, as generate's chunk step (whose first argument, the model's arrays, it
        does not take): (the last real token's hidden state [B, H], the cache with the chunk's
        keys and values, length + valid). ``first``: as generate's step."""
        keys, values = list(cache.keys), list(cache.values)
        x = input_ids
        for i, (start, stop) in enumerate(self._bounds):
            structure, weights = self._piece_args(i)
            entries = tuple((keys[j], values[j]) for j in range(start, stop))
            last = stop == len(keys)
            run = _jitted(self._kernels, donate_hidden=0 < start and not last)
            x, new = run(structure, weights, x, entries, cache.length, valid, rope=self._rope,
                         dtype=self._model.dtype, max_len=cache.max_len, last=last, first=first)
            for j, (k, v) in zip(range(start, stop), new):
                keys[j], values[j] = k, v
        return x, KVCache(keys=tuple(keys), values=tuple(values), length=cache.length + valid,
                          max_len=cache.max_len, seq_layout=cache.seq_layout)
