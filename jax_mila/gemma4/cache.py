"""KVCache: the per-layer keys and values kept between prefill and decode steps.

Layout, per layer that computes its own K/V (KV-shared layers own no entry; they read their
source layer's view):
- full-attention layers: [B, max_len, Hkv, D], slot j holds position j;
- sliding layers: a ring of R = min(window, max_len) slots, slot (p % R) holds position p, so
  local memory is bounded by the window however long the sequence gets.

Prefill chunks attend through the position-offset contract of jax_mila.ffi.flash_attention
(key j at kv_offset + j), so each view they read is contiguous in position: a full layer's
buffer itself (kv_offset 0; unwritten slots hold positions after every query, which causal
masking hides), a ring layer's slab of ring and chunk (``chunk_update``).

Decode steps read the buffers where they lie, through jax_mila.ffi.decode_attention: per row,
its valid length (kv_len [B], the step's token included) says which slots count, and a ring
(ring=True) is read in place, slot s holding the newest position p < kv_len with p % R == s;
``decode_update`` only writes the step's keys, it never copies a ring into position order.
A ring smaller than the window (the capacity is below it) never wraps: it is read as a full
layer's buffer with the window.

Rows of a batch may hold different lengths (``KVCache.length`` [B]: a prefill given
``lengths``, right padding): a row's slots past its length hold padding or nothing, which
decode_attention's kv_len hides, and a ring only ever receives a row's real keys.

Chunked prefill (``chunk_update``) processes T > 1 tokens at positions p .. p+T-1 per step; see
there for the slab a ring layer attends over.

Storage: the model's dtype, or for full-attention layers optionally float8_e4m3fn
(``empty(..., full_dtype=...)``): those are the buffers that grow with the sequence. K and V
are RMS-normed (K then rotated) before they are cached, so their values sit far inside e4m3's
range and are stored without a scale; attention reads them back in the model's dtype. The
rings of sliding layers are bounded by the window and stay in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mila.parallel.chunked import owned_segments


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Pytree of per-layer K/V buffers (None for KV-shared layers) and the filled lengths.

    ``length`` is int32 [B]: row b holds positions 0 .. length[b] - 1, so length[b] is the
    position of its next token. Rows of one prefill share it unless the prefill was given
    ``lengths`` (prompts of different lengths, right padded); decode steps advance every row
    by one. ``max_len`` (static) is the capacity of full-layer buffers.
    ``seq_layout`` (static): () when slot j of a full-layer buffer holds position j; (devices,
    segments) when a context-parallel prefill sharded those buffers by position in zig-zag
    segments (``sharded_chunk_update``, jax_mila.parallel.chunked; its
    ``cache_in_position_order`` undoes it).
    """

    keys: tuple
    values: tuple
    length: jax.Array
    max_len: int = dataclasses.field(metadata=dict(static=True), default=0)
    seq_layout: tuple = dataclasses.field(metadata=dict(static=True), default=())


def ring_size(window: int, max_len: int) -> int:
    return min(window, max_len)


FULL_LAYER_DTYPES = (None, "float8_e4m3fn")  # None: the model's dtype


def empty(cfg, batch: int, max_len: int, dtype, *, full_dtype=None, seq_layout=()) -> KVCache:
    """A zero cache of capacity ``max_len``, every row at length 0 (the start of a chunked
    prefill);
    full-attention layers' buffers in ``full_dtype`` when given (see the module docstring);
    ``seq_layout`` as in KVCache (the buffers' shapes do not change with it)."""
    if full_dtype is not None and jnp.dtype(full_dtype) == jnp.dtype(dtype):
        full_dtype = None
    if full_dtype is not None and jnp.dtype(full_dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"kv cache dtype for full-attention layers: {full_dtype!r} is not "
                         f"supported (supported: the model's dtype, or 'float8_e4m3fn')")
    keys, values, length = _zero_buffers(cfg, batch, max_len, jnp.dtype(dtype),
                                         None if full_dtype is None else jnp.dtype(full_dtype))
    return KVCache(keys=keys, values=values, length=length, max_len=max_len,
                   seq_layout=tuple(seq_layout))


# One jitted call makes every layer's buffers: made one jnp.zeros at a time, each buffer costs
# the host a scalar upload and a broadcast dispatch while the device sits idle at the start of
# every prefill.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _zero_buffers(cfg, batch: int, max_len: int, dtype, full_dtype):
    keys, values = [], []
    for spec in cfg.layers:
        if spec.is_kv_shared:
            keys.append(None), values.append(None)
            continue
        slots = ring_size(cfg.sliding_window, max_len) if spec.is_sliding else max_len
        shape = (batch, slots, spec.num_kv_heads, spec.head_dim)
        buf = dtype if spec.is_sliding or full_dtype is None else full_dtype
        keys.append(jnp.zeros(shape, buf)), values.append(jnp.zeros(shape, buf))
    return tuple(keys), tuple(values), jnp.zeros((batch,), jnp.int32)


def prefill_entry(k: jax.Array, v: jax.Array, *, ring: int | None, max_len: int):
    """Cache buffers for a prompt's k, v [B, S, H, D] at positions 0..S-1 (S static)."""
    return _prefill_buffer(k, ring, max_len), _prefill_buffer(v, ring, max_len)


def _prefill_buffer(x: jax.Array, ring: int | None, max_len: int) -> jax.Array:
    b, s, h, d = x.shape
    if ring is None:
        return jnp.zeros((b, max_len, h, d), x.dtype).at[:, :s].set(x)
    if s < ring:
        return jnp.zeros((b, ring, h, d), x.dtype).at[:, :s].set(x)
    # The last `ring` positions s-ring .. s-1 go to slots (p % ring): a static roll.
    return jnp.roll(x[:, s - ring:], (s - ring) % ring, axis=1)


def set_rows(buf: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """buf [B, S, H, D] with rows [B, n, H, D] written at slots [n] along S; slots >= S are
    dropped. The caller promises that the slots are distinct, the dropped ones included (make
    them S + i, not S): with that promise XLA:GPU writes the rows with plain stores. Without it
    a scatter must allow for two writes to one slot and emits atomic exchanges, which for 16-bit
    elements are compare-and-swap loops on 32-bit words, several times slower."""
    return buf.at[:, slots].set(rows, mode="drop", unique_indices=True)


def set_rows_per_row(buf: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """set_rows with each row's own slots: rows [B, n, H, D] written at slots [B, n]; slots of
    a row distinct (dropped ones included), as set_rows asks."""
    b = jnp.arange(buf.shape[0], dtype=jnp.int32)[:, None]
    return buf.at[b, slots].set(rows, mode="drop", unique_indices=True)


def chunk_start(length: jax.Array) -> jax.Array:
    """The position of a prefill chunk on a cache of row lengths ``length`` [B]: every row's
    chunk tokens sit at the same positions (right padding), after the longest row's tokens so
    far (a row whose prompt ended in an earlier chunk only gets padding, never cached)."""
    return jnp.max(length).astype(jnp.int32)


def decode_reads_ring(slots: int, window: int | None) -> bool:
    """Whether decode reads a layer's buffer of ``slots`` as a ring (decode_attention's
    ``ring``): a sliding layer's ring of a whole window. A ring cut to a capacity below the
    window never wraps (every position is below the capacity): slot s holds position s, as in
    a full layer's buffer, and the window still applies."""
    return window is not None and slots >= window


def decode_update(k_buf, v_buf, k, v, length, *, ring: bool):
    """Writes one step's k, v [B, 1, H, D] of every row at its own position ``length`` [B]
    (traced int32; slot length[b] % R in a ring of R slots) and returns (k_buf, v_buf).

    One scatter per buffer with one (row, slot) pair per row, all distinct (set_rows' note);
    a position past a full layer's capacity is dropped (decode checks the capacity first).
    Nothing is copied: attention reads the ring in place (decode_attention's ``ring``)."""
    if k.shape[1] != 1:
        raise ValueError(f"decode steps take one token at a time, got k{list(k.shape)}")
    size = k_buf.shape[1]
    slot = length % size if ring else length
    rows = jnp.arange(k_buf.shape[0], dtype=jnp.int32)

    def write(buf, x):
        return buf.at[rows, slot].set(x[:, 0].astype(buf.dtype), mode="drop",
                                      unique_indices=True)

    return write(k_buf, k), write(v_buf, v)


def chunk_update(k_buf, v_buf, k, v, pos, valid, *, ring: bool, first: bool = False):
    """One prefill chunk: k, v [B, T, H, D] at positions pos .. pos+T-1 (pos traced), of which
    the first ``valid`` (traced) are real tokens and the rest padding of the last chunk.
    ``valid`` is a scalar, or [B] when the rows' prompts have different lengths (then row b's
    first valid[b] tokens are real, possibly none). Returns (k_buf, v_buf, k_view, v_view,
    kv_offset), the view and kv_offset in flash_attention's position contract.

    ``first`` (static): the caller promises pos == 0, the prompt's first chunk on an empty
    cache. A ring layer then attends over the chunk's own keys, as a one-shot prefill does: the
    slab below would only append R zeros, and cost a pass over R + T rows to build.

    Padding is never written (its scatter indices are out of range, mode="drop"), so the cache
    after the chunk holds exactly what a one-shot prefill of the real tokens would.

    Full layers: the chunk goes to slots pos .. pos+valid-1 and attention reads the whole buffer
    (kv_offset 0); unwritten slots and the chunk's padding lie after every real query. With
    valid [B] the slots go up to the longest row's: a shorter row's padding lands past its
    length, where causality hides it from its real queries and decode's kv_len from its
    decode steps (each step overwrites the slot it reads first).

    Rings of R slots: the chunk needs positions pos-W+1 .. pos+T-1 and the ring holds the last
    n = min(pos, R) positions before the chunk (R = W, or R = capacity < W and then the ring
    holds every earlier position). The view is a slab of static length R + T that reads
    [n ring keys in position order][T chunk keys][R - n zeros], positions pos-n .. with
    kv_offset pos-n, so the rows past the chunk sit after every query where causality hides
    them (the ring's never-written slots, at their true negative positions, would be inside
    the window). Traced shifts keep one compiled step for all chunks.

    The ring is then written in place: the chunk's last min(valid, R) real keys go to their
    slots (p % R), the values taken from the materialized view (where chunk key i sits at
    n + i). Read from the view, the write depends on the view's read of the old ring, so XLA
    can order the two and update the donated buffer in place. Written from k itself (no such
    dependency), or computed whole from the slab into a fresh buffer, the context-parallel
    step keeps a new ring per layer that XLA copies into the output at the end of the step,
    all of them live at the step's peak."""
    t, size = k.shape[1], k_buf.shape[1]
    k, v = k.astype(k_buf.dtype), v.astype(v_buf.dtype)
    i = jnp.arange(t, dtype=jnp.int32)
    per_row = jnp.ndim(valid) == 1
    if not ring:
        written = jnp.max(valid) if per_row else valid
        slots = jnp.where(i < written, pos + i, size + i)  # >= size: dropped (all distinct)
        k_buf, v_buf = set_rows(k_buf, slots, k), set_rows(v_buf, slots, v)
        return k_buf, v_buf, k_buf, v_buf, jnp.int32(0)
    if first:  # pos == 0: the ring is empty and the chunk is its own view
        n, k_view, v_view = 0, k, v
    else:
        n = jnp.minimum(pos, size)
        row = jnp.arange(size + t, dtype=jnp.int32)  # view row j holds position pos - n + j

        def slab(buf, x):
            # [n ring keys in position order][T chunk keys][R - n zeros] as one elementwise
            # select of two gathers, which XLA fuses into a single pass (read R + T rows, write
            # R + T). Concatenating the position-ordered ring with the chunk and rolling the
            # result (a traced roll is a concatenate plus a dynamic slice) writes and reads the
            # R + T rows twice.
            ring_keys = jnp.take(buf, (row + pos - n) % size, axis=1, mode="clip")
            chunk_keys = jnp.take(x, jnp.clip(row - n, 0, t - 1), axis=1, mode="clip")
            j = row[None, :, None, None]
            return jnp.where(j < n, ring_keys,
                             jnp.where(j < n + t, chunk_keys, jnp.zeros((), x.dtype)))

        # Materialized (the barrier keeps XLA from fusing a second read of the old ring into
        # the write below): attention needs these buffers anyway.
        k_view, v_view = jax.lax.optimization_barrier((slab(k_buf, k), slab(v_buf, v)))

    # Only the last min(valid, R) real tokens reach the ring, so the scatter takes m = min(T, R)
    # rows (chunk tokens valid-m .. valid-1; those before token 0 are dropped), not T. The
    # slots are distinct (m <= R consecutive positions; the dropped ones R + j).
    m = min(t, size)
    j = jnp.arange(m, dtype=jnp.int32)
    if per_row:
        # The same per row, from its own valid[b]: a row's padding never reaches its ring (it
        # would overwrite the row's last real keys); [B, m] slots, distinct within each row.
        src = valid[:, None] - m + j[None, :]
        slots = jnp.where(src >= 0, (pos + src) % size, size + j[None, :])
        rows = (n + jnp.maximum(src, 0))[:, :, None, None]
        k_buf = set_rows_per_row(k_buf, slots, jnp.take_along_axis(k_view, rows, axis=1))
        v_buf = set_rows_per_row(v_buf, slots, jnp.take_along_axis(v_view, rows, axis=1))
    else:
        src = valid - m + j  # chunk token of update row j
        slots = jnp.where(src >= 0, (pos + src) % size, size + j)
        rows = n + jnp.maximum(src, 0)  # where chunk token src sits in the view
        k_buf = set_rows(k_buf, slots, jnp.take(k_view, rows, axis=1))
        v_buf = set_rows(v_buf, slots, jnp.take(v_view, rows, axis=1))
    # Attention reads the views only once the ring is written: the writes feed nothing but the
    # step's outputs, so XLA:GPU's scheduler would put every layer's at the end of the step,
    # each holding its chunk K/V until then. Full layers need no barrier: their view is the
    # written buffer.
    k_buf, v_buf, k_view, v_view = jax.lax.optimization_barrier((k_buf, v_buf, k_view, v_view))
    return k_buf, v_buf, k_view, v_view, (pos - n).astype(jnp.int32)


# ------------------------------------------- a chunk split over a mesh axis (context parallel)

def sharded_chunk_update(k_buf, v_buf, k, v, pos, valid, *, ring: bool, axis: str,
                         segments: int):
    """``chunk_update`` for a chunk split over the mesh axis ``axis`` in contiguous slices
    (context parallelism inside the chunked prefill, jax_mila.parallel.chunked): k, v
    [B, C/P, H, D] are this device's slice, the chunk's tokens pos + d C/P ..; a full layer's
    k_buf, v_buf are this device's block of a cache sharded by position in ``segments``
    zig-zag segments per device (KVCache.seq_layout), a ring is replicated. Returns
    (k_buf, v_buf, k_view, v_view, kv_offset) where the view is what
    jax_mila.parallel.chunked.attention takes: the ring + chunk slab (sliding layers) or this
    device's block of the position-sharded buffer (full layers, kv_offset unused)."""
    k, v = k.astype(k_buf.dtype), v.astype(v_buf.dtype)
    if ring and k.shape[1] >= k_buf.shape[1]:
        return _ring_halo_update(k_buf, v_buf, k, v, pos, valid, axis)
    # Invariant over the axis: every device gets the same chunk, so the replicated ring
    # stays replicated (and shard_map can check it).
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True,  # noqa: E731
                                          to="invarying")
    k, v = gather(k), gather(v)  # [B, C, H, D]
    if ring:  # slices shorter than the ring: the same update on every device
        return chunk_update(k_buf, v_buf, k, v, pos, valid, ring=True)
    devices = jax.lax.axis_size(axis)
    local_len = k_buf.shape[1]
    length = local_len // segments
    c = k.shape[1]
    p = pos + jnp.arange(c, dtype=jnp.int32)
    seg, within = p // length, p % length
    # Out of range, hence dropped: local_len + i (distinct, as set_rows requires).
    dropped = local_len + jnp.arange(c, dtype=jnp.int32)
    slot = dropped
    for j, s in enumerate(owned_segments(jax.lax.axis_index(axis), devices, segments)):
        slot = jnp.where(seg == s, j * length + within, slot)
    slot = jnp.where(jnp.arange(c) < valid, slot, dropped)  # padding is never written
    k_buf, v_buf = set_rows(k_buf, slot, k), set_rows(v_buf, slot, v)
    return k_buf, v_buf, k_buf, v_buf, jnp.int32(0)


def _ring_halo_update(k_buf, v_buf, k, v, pos, valid, axis):
    """A sliding layer's ring of R slots when each device's slice k, v [B, t, H, D] of the
    chunk holds at least R keys (t >= R). Each device sends only its slice's last R real
    keys (its tail), and one all-gather of the P tails gives every device both things it
    needs: the halo of its queries (the R keys before its slice: the previous device's tail)
    and the ring's new contents (the chunk's last R real keys: in the last tail that holds
    real keys, or split between it and the one before). A device receives (P - 1) R keys per
    layer instead of the chunk's (P - 1) t, and since every device gathers the same tails,
    the ring stays replicated without a reduction.

    Returns what chunk_update returns, for this device's queries: the slab is the R
    keys before the slice (device 0: the old ring in position order) then the slice, rolled
    left by R - n (n real keys before the slice: min(pos, R) on device 0, R elsewhere) so the
    unwritten ring slots sit after every query; the ring is written in place."""
    i = jax.lax.axis_index(axis)
    t, size = k.shape[1], k_buf.shape[1]

    def tail_end(d):  # one past device d's last real key in its slice, at least R
        return jnp.clip(valid - d * t, size, t)

    def gather_tails(x):  # [B, P R, H, D]: device d's tail at d R ..
        mine = jax.lax.dynamic_slice_in_dim(x, tail_end(i) - size, size, axis=1)
        return jax.lax.all_gather(mine, axis, axis=1, tiled=True, to="invarying")

    k_tails, v_tails = gather_tails(k), gather_tails(v)
    # The old ring in position order (pos-R .. pos-1) and the tails, materialized together:
    # the ring writes below take their values from this barrier's tails, so XLA reads the old
    # ring before it writes the buffer in place (chunk_update says why that matters).
    # Every input is the same on all devices, so the outputs stay invariant over the axis.
    k_ring, v_ring, k_tails, v_tails = jax.lax.optimization_barrier(
        (jnp.roll(k_buf, -(pos % size), axis=1), jnp.roll(v_buf, -(pos % size), axis=1),
         k_tails, v_tails))
    n = jnp.where(i == 0, jnp.minimum(pos, size), size)

    def slab(ring, x, tails):
        # On device i > 0 the previous tail is the R keys before the slice whenever one of
        # the slice's queries is real (valid > i t); otherwise none of its rows is used.
        halo = jax.lax.dynamic_slice_in_dim(tails, jnp.maximum(i - 1, 0) * size, size, axis=1)
        before = jnp.where(i == 0, ring, halo)
        return jnp.roll(jnp.concatenate([before, x], axis=1), -(size - n), axis=1)

    k_view, v_view = slab(k_ring, k, k_tails), slab(v_ring, v, v_tails)

    # The chunk's last R real keys, c = valid - R .. valid - 1 (those before the chunk stay):
    # key c is in device d = c // t's tail, which starts at d t + tail_end(d) - R.
    c = valid - size + jnp.arange(size, dtype=jnp.int32)
    d = jnp.maximum(c, 0) // t
    src = d * size + c - d * t - (tail_end(d) - size)
    # >= size: out of range, dropped (distinct, as set_rows requires).
    slots = jnp.where(c >= 0, (pos + c) % size, size + jnp.arange(size, dtype=jnp.int32))
    k_buf = set_rows(k_buf, slots, jnp.take(k_tails, src, axis=1, mode="clip"))
    v_buf = set_rows(v_buf, slots, jnp.take(v_tails, src, axis=1, mode="clip"))
    # Attention reads the views only once the ring is written (chunk_update says why).
    # A barrier's outputs vary over the axis if any input does, so the replicated ring goes in
    # as a varying copy of itself, only to order the two.
    ring = jax.lax.pcast((k_buf, v_buf), axis, to="varying")
    k_view, v_view, _ = jax.lax.optimization_barrier((k_view, v_view, ring))
    return k_buf, v_buf, k_view, v_view, (pos + i * t - n).astype(jnp.int32)
