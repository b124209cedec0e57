"""A prefill chunk's step in pieces of consecutive decoder layers, one jitted call each.

Why: one jitted chunk step takes the whole model as arguments (the 12B: 1,322 arrays). Before
the device can start the first chunk, the host must take the model apart (a pytree flatten)
and dispatch that call, while the GPU idles. In pieces, the host only flattens and dispatches
the first piece (the embedding and FIRST_PIECE_LAYERS layers) before the device has work; the
other pieces are flattened and dispatched while it runs.

A piece reads the embedding (the first piece) and its layers' weights, takes the hidden state
of the piece before it (the first: the chunk's token ids) and its layers' cache entries
(donated), and returns the hidden state (the last piece: the last real token's, as
jitted.chunk_hidden does) and the new entries. The model provides the pieces' modules and the
function that runs them (piece_modules, piece_runner), each layer exactly as its
hidden_states(mode="chunk") runs it, so the pieces compute what the one-step chunk does.
Models whose layers read more than their own cache entry and the previous hidden state
(runs_in_pieces() False: per-layer embeddings, KV-shared layers) keep the one-step chunk, as
does every mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_mila.engine import jitted
from jax_mila.parallel.layout import SINGLE_DEVICE

FIRST_PIECE_LAYERS = 2  # what the host takes apart and dispatches before the device has work
# The other pieces: each is a dispatch per chunk (hidden behind the device) and a boundary
# where one executable ends before the next starts. Larger pieces lose less at the boundaries;
# the host keeps ahead as long as it takes a piece apart and dispatches it faster than the
# device runs the one before (docs/performance.md).
PIECE_LAYERS = 6


def applies(model) -> bool:
    """Whether the prefill loop may run this model's single-device chunks in pieces: its
    layers allow it (model.runs_in_pieces()) and flax flattens its modules to their arrays
    (else jitted.model_args takes the nnx.split path, and so does the one-step chunk)."""
    if not model.runs_in_pieces():
        return False
    try:
        leaves = jax.tree.leaves(model.piece_modules(0, 1))
    except Exception:  # noqa: BLE001 -- any flatten failure means graph mode
        return False
    return bool(leaves) and all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or
                                hasattr(x, "__array__") for x in leaves)


def bounds(num_layers: int, piece_layers: int = PIECE_LAYERS) -> list[tuple[int, int]]:
    """Layer ranges [start, stop) of the pieces: FIRST_PIECE_LAYERS, then ``piece_layers``
    each."""
    if piece_layers < 1:
        raise ValueError(f"piece_layers={piece_layers}: a piece needs at least one layer")
    out, start, size = [], 0, FIRST_PIECE_LAYERS
    while start < num_layers:
        stop = min(start + size, num_layers)
        out.append((start, stop))
        start, size = stop, piece_layers
    return out


def _piece(run, structure, weights, x, entries, lengths, valid, max_len, last, first):
    """Layers of one piece on x (token ids for the first piece, else the hidden state)."""
    h, new_entries = run(jax.tree.unflatten(structure, weights), x, entries, lengths=lengths,
                         valid=valid, max_len=max_len, first_chunk=first)
    if last:
        h = SINGLE_DEVICE.last_real_token(h, valid)
    return h, new_entries


_STATIC = ("run", "structure", "max_len", "last", "first")


@functools.cache
def _piece_jit(kernels: bool, donate_hidden: bool):
    """The piece's jit: the cache entries donated (updated in place), and the hidden state
    where the piece returns one of its shape (not the first piece, whose x is the token ids,
    nor the last, which returns one row), so XLA writes the new hidden state over the old:
    otherwise both are live across the piece. The kernel backend compiles as the chunk steps
    do, without XLA's autotuner."""
    donate = ("x", "entries") if donate_hidden else ("entries",)
    return jax.jit(_piece, static_argnames=_STATIC, donate_argnames=donate,
                   compiler_options=jitted.NO_AUTOTUNE if kernels else None)


class ChunkPieces:
    """The pieces of one model for one prefill call: each piece's weights are taken from the
    model once, when the first chunk dispatches that piece (so the first chunk's later pieces
    are taken apart while the device runs its earlier ones), and reused by later chunks."""

    def __init__(self, model, piece_layers: int = PIECE_LAYERS):
        self._model = model
        self._bounds = bounds(len(model.layers), piece_layers)
        self._args: list = [None] * len(self._bounds)
        self._run = model.piece_runner()
        self._kernels = jitted.compile_options(model) is not None

    def _piece_args(self, i: int):
        if self._args[i] is None:
            leaves, structure = jax.tree.flatten(self._model.piece_modules(*self._bounds[i]))
            self._args[i] = (structure, leaves)
        return self._args[i]

    def step(self, _state, cache, input_ids, valid, *, first: bool = False):
        """One chunk, as the one-step chunk step (whose first argument, the model's arrays, it
        does not take): (the last real token's hidden state [B, H], the cache with the chunk's
        keys and values, length + valid). ``valid``, ``first``: as that step's."""
        keys, values = list(cache.keys), list(cache.values)
        x = input_ids
        for i, (start, stop) in enumerate(self._bounds):
            structure, weights = self._piece_args(i)
            entries = tuple((keys[j], values[j]) for j in range(start, stop))
            last = stop == len(keys)
            run = _piece_jit(self._kernels, donate_hidden=0 < start and not last)
            x, new = run(self._run, structure, weights, x, entries, cache.length, valid,
                         max_len=cache.max_len, last=last, first=first)
            for j, (k, v) in zip(range(start, stop), new):
                keys[j], values[j] = k, v
        return x, dataclasses.replace(cache, keys=tuple(keys), values=tuple(values),
                                      length=cache.length + valid)
