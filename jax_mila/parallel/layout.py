"""Layout: how one traced step's work lies over the mesh, as the engine tells the model.

The engine (jax_mila.engine) builds one Layout for each step it traces, inside jax.shard_map
for a mesh, and passes it down through the model (Gemma4ForCausalLM.hidden_states, run_layers)
into the layers. The layers ask it what depends on the split instead of reading global state:
the positions of their tokens, how to attend (and merge attention across devices), which
collective ends a tensor-parallel block, and its axes (nn.Linear's row-parallel quantizer takes
heads_axis; the attention layer picks the cache update from seq_split). ``Layout()`` is one
device, the default everywhere.

- heads_axis: tensor parallelism (jax_mila.parallel.tensor): heads and MLP columns split over
  that axis; row-parallel outputs are all-reduced over it.
- seq_axis with seq_split "zigzag": a whole sequence (the model's mode "full") in zig-zag order
  over that axis (jax_mila.parallel.context): ring attention for causal layers, a halo exchange
  for sliding windows.
- seq_axis with seq_split "chunk": a prefill chunk (mode "chunk") in contiguous slices over that
  axis, the full-attention cache sharded by position in ``segments`` zig-zag segments per
  device (jax_mila.parallel.chunked).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mila.parallel import chunked, context, tensor

ZIGZAG = "zigzag"
CHUNK = "chunk"
SEQ_SPLITS = (None, ZIGZAG, CHUNK)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axes and context-parallel split of a step (static: hashable, compared by value)."""

    heads_axis: str | None = None
    seq_axis: str | None = None
    seq_split: str | None = None
    segments: int = 0  # per device, seq_split "chunk" only

    def __post_init__(self):
        if self.seq_split not in SEQ_SPLITS:
            raise ValueError(f"Layout: seq_split={self.seq_split!r} (supported: {SEQ_SPLITS})")
        if (self.seq_axis is None) != (self.seq_split is None):
            raise ValueError(f"Layout: seq_axis={self.seq_axis!r} and seq_split="
                             f"{self.seq_split!r}: name both or neither")
        if self.seq_split == CHUNK:
            chunked.check_segments(self.segments)
        elif self.segments:
            raise ValueError(f"Layout: segments={self.segments!r} is for seq_split 'chunk' only")
        if self.heads_axis is not None and self.heads_axis == self.seq_axis:
            raise ValueError(f"Layout: one axis {self.heads_axis!r} for heads and sequence")

    def positions(self, offset, t: int) -> jax.Array:
        """Positions [t] of this device's t tokens of a step that starts at `offset`."""
        if self.seq_split == ZIGZAG:
            return context.zigzag_positions(t, self.seq_axis)
        if self.seq_split == CHUNK:
            return chunked.slice_positions(offset, t, self.seq_axis)
        return offset + jnp.arange(t, dtype=jnp.int32)

    def reduce(self, x: jax.Array) -> jax.Array:
        """A row-parallel projection's partial sums, all-reduced over heads_axis (or x)."""
        return tensor.reduce_partial_sums(x, self.heads_axis)

    def kv_heads_for_local_queries(self, k, v, *, num_heads: int, num_kv_heads: int,
                                   local_q_heads: int):
        """The K/V heads this device's query heads read (jax_mila.parallel.tensor)."""
        return tensor.kv_heads_for_local_queries(k, v, axis=self.heads_axis, num_heads=num_heads,
                                                 num_kv_heads=num_kv_heads,
                                                 local_q_heads=local_q_heads)

    def attend(self, q, k, v, attn, *, window, q_offset, kv_offset):
        """This device's queries q over the K/V view k, v (from the cache update, or the
        layer's own k, v without a cache) through `attn` (an nn.Attention), merged across
        seq_axis where the sequence is split."""
        if self.seq_split == ZIGZAG:
            return context.layer_attention(q, k, v, attn, window=window, axis=self.seq_axis)
        if self.seq_split == CHUNK:
            return chunked.attention(q, k, v, kv_offset, attn, window=window, pos=q_offset,
                                     axis=self.seq_axis, segments=self.segments)
        return attn(q, k, v, window=window, q_offset=q_offset, kv_offset=kv_offset)

    def attend_cache(self, q, k, v, attn, *, kv_len, window, ring: bool):
        """A decode step's queries q over the cache buffers k, v as they lie (attn.decode:
        per-row lengths ``kv_len`` [B], a ring read in place). Per device: under tensor
        parallelism each device holds its heads' queries and cache; a cache split by position
        (seq_axis) is not decoded (decode takes a cache in position order)."""
        if self.seq_split is not None:
            raise ValueError(f"decode attention over a cache split by position is not "
                             f"supported (Layout seq_split={self.seq_split!r})")
        return attn.decode(q, k, v, kv_len, window=window, ring=ring)

    def last_real_token(self, h: jax.Array, valid) -> jax.Array:
        """The hidden state [B, H] of token `valid` - 1 of a chunk whose states h [B, T, H]
        this device holds (its slice of them with seq_split "chunk"), on every device.
        ``valid`` [B] (rows of different lengths; not with a seq_split): row b's token
        valid[b] - 1, the chunk's first for a row with none in it."""
        if self.seq_split == CHUNK:
            return chunked.last_real_token(h, valid, self.seq_axis)
        if jnp.ndim(valid) == 1:
            index = jnp.clip(valid - 1, 0, h.shape[1] - 1)[:, None, None]
            return jnp.take_along_axis(h, index, axis=1)[:, 0]
        return jax.lax.dynamic_index_in_dim(h, valid - 1, axis=1, keepdims=False)


SINGLE_DEVICE = Layout()
