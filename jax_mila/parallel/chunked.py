"""Context parallelism inside the chunked prefill: a `seq` mesh axis of P devices shares each
chunk's tokens, and the full-attention layers' KV cache is sharded by position.

Each chunk of C tokens (C a multiple of P) is cut into P contiguous slices of C / P tokens;
device d runs the embedding, norms, projections, MLP (and MoE, PLE) of positions
pos + d C/P .. pos + (d+1) C/P - 1 only. Only attention needs other devices' tokens:

Full-attention layers. The cache of capacity M is cut into n = P x S contiguous segments of
L = M / n positions (S = segments per device, even), dealt out zig-zag in rounds of 2P:
in round r device d owns segments 2Pr + d and 2Pr + 2P-1-d, so at every point of the prompt
each device holds about 1/P of the filled positions (the causal work of every chunk is
balanced to within about one segment, and so is memory) and 1/P of the buffer in all. A
device's local buffer [B, M/P, H, D] is its segments in increasing position order. Per layer
and chunk: the chunk's K/V and Q are all-gathered; each device writes the chunk's K/V into
the slots of the segments it owns (a scatter whose other indices drop) and attends all C
queries to its whole block in one kernel call (the segments' true positions as a vector
kv_offset, jax_mila.ffi.flash_attention; causal: unfilled slots lie after every query and
future segments cost only skipped tiles; a device with no visible key for a row returns zeros
with lse -inf). Its result is weighted by its share of the total over all devices (an
all-gather of [P, B, H, C] floats: exp(lse_part - lse_total)), and one psum_scatter in the
model's dtype leaves each device the rows of its own C / P queries.

Sliding-window layers. The ring of the last R = W positions is small and kept replicated.
When a device's slice holds at least R keys (C/P >= R, as in long prompts), the devices
exchange only halos: one all-gather of each slice's last R real keys gives every device the R
keys before its own queries and the ring's new contents (`_ring_halo_update`). Shorter slices
all-gather the chunk's K/V and every device applies the same ring update
(jax_mila.gemma4.cache.chunk_update). Each device attends its own queries over a slab of the
keys before its slice and the slice itself.

The step runs inside `jax.shard_map` under `chunked_context_parallel(axis, segments)`, which
is what the model's layers look at (jax_mila.gemma4.model / attention); `sharded_chunk_step`
builds it, with tensor parallelism over a second axis if asked (jax_mila.parallel.tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_mila.ffi._checks import is_int
from jax_mila.parallel._scope import TraceScope

# Segments per device: more balance the causal work of each chunk better (2 devices, 128K,
# chunk 4096: 94% of ideal at 8, 97% at 16, 98.5% at 32; chunk 8192: 100% at 32;
# docs/notes_parallel.md). The kernel walks them in one call, so more cost only a few
# integer operations per CTA and segment, and capacity rounds up to a multiple of P x S.
DEFAULT_SEGMENTS = 32

_STATE = TraceScope("jax_mila_chunked_context_parallel")


@dataclasses.dataclass(frozen=True)
class _State:
    axis: str
    segments: int


def chunked_context_parallel(axis: str, segments: int = DEFAULT_SEGMENTS):
    """Within this context (tracing a chunk step inside shard_map, the chunk's tokens split
    over `axis`), the model takes its positions from the split, writes full-attention K/V into
    the position-sharded cache and merges attention across the axis."""
    return _STATE.bound(_State(axis, segments))


def active_axis() -> str | None:
    state = _STATE.get()
    return None if state is None else state.axis


# ------------------------------------------------------------------------------ the layout

def check_segments(segments: int) -> None:
    if not is_int(segments) or segments < 2 or segments % 2:
        raise ValueError(f"context parallel: segments per device must be an even int >= 2 "
                         f"(zig-zag pairs), got {segments!r}")


def capacity(max_len: int, devices: int, segments: int = DEFAULT_SEGMENTS) -> int:
    """The cache capacity a position-sharded cache uses for `max_len`: rounded up to a
    multiple of devices x segments (the extra slots are never written)."""
    n = devices * segments
    return -(-max_len // n) * n


def owned_segments(device, devices: int, segments: int):
    """Segments of `device` (an int or a traced index) in increasing position order."""
    out = []
    for r in range(segments // 2):
        out += [2 * devices * r + device, 2 * devices * r + 2 * devices - 1 - device]
    return out


def slot_positions(max_len: int, devices: int, segments: int = DEFAULT_SEGMENTS) -> np.ndarray:
    """Position held by each slot of the global buffer (device blocks one after the other)."""
    if max_len % (devices * segments):
        raise ValueError(f"context parallel: capacity {max_len} is not a multiple of "
                         f"devices x segments = {devices * segments}")
    length = max_len // (devices * segments)
    return np.concatenate([np.arange(s * length, (s + 1) * length)
                           for d in range(devices) for s in owned_segments(d, devices, segments)])


def cache_in_position_order(cache):
    """A KVCache from a context-parallel prefill with its full-attention buffers put back in
    position order (slot j = position j, as one device's prefill leaves them); gathers the
    whole cache, for tests and for handing the cache to single-device code."""
    if not cache.seq_layout:
        return cache
    devices, segments = cache.seq_layout
    inverse = np.argsort(slot_positions(cache.max_len, devices, segments))

    def reorder(buf):
        if buf is None or buf.shape[1] != cache.max_len:
            return buf  # KV-shared layers, rings
        return jnp.asarray(jax.device_get(buf))[:, inverse]

    return dataclasses.replace(cache, keys=tuple(map(reorder, cache.keys)),
                               values=tuple(map(reorder, cache.values)), seq_layout=())


# ------------------------------------------------------------------- inside the chunk step

def local_positions(offset, local_len: int) -> jax.Array:
    """Positions of this device's slice of the chunk that starts at `offset`."""
    i = jax.lax.axis_index(active_axis())
    return offset + i * local_len + jnp.arange(local_len, dtype=jnp.int32)


def last_real_token(h, valid):
    """h [B, C/P, H] of every device -> the hidden state of the chunk's token `valid` - 1
    (on the device whose slice holds it), replicated: [B, H]."""
    axis, t = active_axis(), h.shape[1]
    local = valid - 1 - jax.lax.axis_index(axis) * t
    mine = (local >= 0) & (local < t)
    pick = jax.lax.dynamic_index_in_dim(h, jnp.clip(local, 0, t - 1), axis=1, keepdims=False)
    return jax.lax.psum(jnp.where(mine, pick, jnp.zeros_like(pick)), axis)


def chunk_update(k_buf, v_buf, k, v, pos, valid, *, ring: bool):
    """Like jax_mila.gemma4.cache.chunk_update for this device's k, v [B, C/P, H, D] (the
    chunk's tokens pos + d C/P ..); returns (k_buf, v_buf, k_view, v_view, kv_offset) where
    the view is what `attention` takes: the ring + chunk slab (sliding layers) or this
    device's block of the position-sharded buffer (full layers, kv_offset unused)."""
    from jax_mila.gemma4 import cache as kv  # noqa: PLC0415 - gemma4 imports this package

    state = _STATE.get()
    k, v = k.astype(k_buf.dtype), v.astype(v_buf.dtype)
    if ring and k.shape[1] >= k_buf.shape[1]:
        return _ring_halo_update(k_buf, v_buf, k, v, pos, valid, state.axis)
    # Invariant over the axis: every device gets the same chunk, so the replicated ring
    # stays replicated (and shard_map can check it).
    gather = lambda x: jax.lax.all_gather(x, state.axis, axis=1, tiled=True,  # noqa: E731
                                          to="invarying")
    k, v = gather(k), gather(v)  # [B, C, H, D]
    if ring:  # slices shorter than the ring: the same update on every device
        return kv.chunk_update(k_buf, v_buf, k, v, pos, valid, ring=True)
    devices = jax.lax.axis_size(state.axis)
    local_len = k_buf.shape[1]
    length = local_len // state.segments
    c = k.shape[1]
    p = pos + jnp.arange(c, dtype=jnp.int32)
    seg, within = p // length, p % length
    # Out of range, hence dropped: local_len + i (distinct, as kv.set_rows requires).
    dropped = local_len + jnp.arange(c, dtype=jnp.int32)
    slot = dropped
    for j, s in enumerate(owned_segments(jax.lax.axis_index(state.axis), devices,
                                         state.segments)):
        slot = jnp.where(seg == s, j * length + within, slot)
    slot = jnp.where(jnp.arange(c) < valid, slot, dropped)  # padding is never written
    k_buf, v_buf = kv.set_rows(k_buf, slot, k), kv.set_rows(v_buf, slot, v)
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

    Returns what cache.chunk_update returns, for this device's queries: the slab is the R
    keys before the slice (device 0: the old ring in position order) then the slice, rolled
    left by R - n (n real keys before the slice: min(pos, R) on device 0, R elsewhere) so the
    unwritten ring slots sit after every query; the ring is written in place."""
    from jax_mila.gemma4 import cache as kv  # noqa: PLC0415 - gemma4 imports this package

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
    # ring before it writes the buffer in place (cache.chunk_update says why that matters).
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
    # >= size: out of range, dropped (distinct, as kv.set_rows requires).
    slots = jnp.where(c >= 0, (pos + c) % size, size + jnp.arange(size, dtype=jnp.int32))
    k_buf = kv.set_rows(k_buf, slots, jnp.take(k_tails, src, axis=1, mode="clip"))
    v_buf = kv.set_rows(v_buf, slots, jnp.take(v_tails, src, axis=1, mode="clip"))
    # Attention reads the views only once the ring is written (cache.chunk_update says why).
    # A barrier's outputs vary over the axis if any input does, so the replicated ring goes in
    # as a varying copy of itself, only to order the two.
    ring = jax.lax.pcast((k_buf, v_buf), axis, to="varying")
    k_view, v_view, _ = jax.lax.optimization_barrier((k_view, v_view, ring))
    return k_buf, v_buf, k_view, v_view, (pos + i * t - n).astype(jnp.int32)


def attention(q, k, v, kv_offset, attn, *, window, pos):
    """This device's queries q [B, C/P, Hq, D] (positions pos + d C/P ..) over the view from
    `chunk_update`; `attn` is an nn.Attention (backend and scale)."""
    state = _STATE.get()
    axis, t = state.axis, q.shape[1]
    i = jax.lax.axis_index(axis)
    if window is not None:
        return attn(q, k, v, window=window, q_offset=pos + i * t, kv_offset=kv_offset)
    devices = jax.lax.axis_size(axis)
    q_all = jax.lax.all_gather(q, axis, axis=1, tiled=True)  # [B, C, Hq, D]
    length = k.shape[1] // state.segments
    starts = jnp.stack([jnp.asarray(s, jnp.int32) * length  # the segments' first positions
                        for s in owned_segments(i, devices, state.segments)])
    # One call over the whole local block: the kernel walks the segments itself (a vector
    # kv_offset, jax_mila.ffi.flash_attention), so no partial per segment is written, sliced
    # or merged. Per-segment calls merged in a loop cost the 31B at 128K on two H200s 0.44 s
    # a device of merges and slices (docs/performance.md, seventh round).
    o, lse = attn(q_all, k, v, q_offset=pos, kv_offset=starts, return_lse=True)
    # This device's share of the total over all devices, exp(lse - total), summed over the
    # devices in the model's dtype (as the tensor-parallel all-reduces are): half the bytes of
    # float32 on the wire and in the workspace; one more rounding for bf16 models.
    total = _logsumexp(jax.lax.all_gather(lse, axis))
    out = _share(o, lse, total).astype(q.dtype)
    return jax.lax.psum_scatter(out, axis, scatter_dimension=1, tiled=True)  # own C/P rows


def _share(o, lse, total):
    """A partial result o [B, C, Hq, D] (normalized over its own keys, log-sum-exp lse
    [B, Hq, C]) as its share of a softmax over more keys (log-sum-exp `total`): o * exp(lse -
    total) in float32, 0 where lse is -inf (no visible key: never NaN, whatever o holds)."""
    safe = jnp.where(jnp.isneginf(total), 0.0, total)
    w = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))  # [B, Hq, C]
    w = jnp.transpose(w, (0, 2, 1))[..., None]  # [B, C, Hq, 1]
    return jnp.where(w > 0, o.astype(jnp.float32) * w, 0.0)


def _logsumexp(x):
    """log-sum-exp over axis 0 of float32 lse values, -inf where all are -inf (no NaN)."""
    m = jnp.max(x, axis=0)
    safe = jnp.where(jnp.isneginf(m), 0.0, m)
    s = jnp.sum(jnp.where(jnp.isneginf(x), 0.0, jnp.exp(x - safe)), axis=0)
    return jnp.where(s > 0, safe + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)


# -------------------------------------------------------------------------- the jitted step

def _named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def cache_specs(cache, cfg, *, seq_axis: str | None, tp_axis: str | None, tp_size: int = 1):
    """PartitionSpecs of a KVCache: full-attention buffers split by position over `seq_axis`,
    rings replicated over it; K/V heads split over `tp_axis` like their k_proj."""
    def layer_spec(spec, buf):
        if buf is None:
            return None
        heads = tp_axis if tp_axis is not None and spec.num_kv_heads % tp_size == 0 else None
        seq = seq_axis if not spec.is_sliding else None
        # Trailing Nones dropped, as the step's outputs report their specs: equal shardings
        # on the first chunk's cache and the later ones', so the step compiles once.
        if heads is not None:
            return P(None, seq, heads)
        return P() if seq is None else P(None, seq)

    keys = tuple(layer_spec(s, k) for s, k in zip(cfg.layers, cache.keys))
    values = tuple(layer_spec(s, v) for s, v in zip(cfg.layers, cache.values))
    return dataclasses.replace(cache, keys=keys, values=values, length=P())


def check_mesh(mesh, tp_axis: str | None, seq_axis: str | None):
    """(tp_axis, seq_axis) with the ones `mesh` does not have set to None; refuses a mesh
    that has neither."""
    names = tuple(mesh.axis_names)
    tp = tp_axis if tp_axis in names else None
    seq = seq_axis if seq_axis in names else None
    if tp is None and seq is None:
        raise ValueError(f"prefill over a mesh: its axes {names} include neither tp_axis="
                         f"{tp_axis!r} (heads) nor seq_axis={seq_axis!r} (sequence)")
    return tp, seq


def _weight_specs(model, state, mesh, tp_axis: str | None):
    """(tensor-parallel size, the weights' PartitionSpecs): split over `tp_axis` as
    jax_mila.parallel.tensor lays them out, replicated otherwise."""
    from jax_mila.parallel import tensor  # noqa: PLC0415

    if tp_axis is None:
        return 1, jax.tree.map(lambda _: P(), state)
    cfg, tp_size = model.config, mesh.shape[tp_axis]
    tensor.check_config(cfg, tp_size)
    return tp_size, tensor.param_specs(state, axis=tp_axis, axis_size=tp_size,
                                       num_kv_heads_of_layer=lambda i: cfg.layers[i].num_kv_heads)


def _compile_options(model):
    """The single-device step's compile options (generate.py: no XLA autotuning on the kernel
    backend, whose scratch would set the peak), so one and N devices compare like for like."""
    generate = importlib.import_module("jax_mila.gemma4.generate")
    return None if model.backend == "reference" else getattr(generate, "_NO_AUTOTUNE", None)


def _cached(key, build):
    fn = _STEPS.get(key)
    if fn is None:
        fn = build()
        if len(_STEPS) >= _MAX_STEPS:
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[key] = fn
    return fn


def sharded_chunk_step(model, state, make_cache, mesh, *, tp_axis: str | None,
                       seq_axis: str | None, segments: int = DEFAULT_SEGMENTS):
    """The chunked-prefill step over `mesh`: returns (step, state, cache) with the weights
    placed on the mesh (split over `tp_axis`, replicated over `seq_axis`), the zero cache that
    `make_cache()` describes (jax_mila.gemma4.cache.empty, never called whole) created in its
    shards (`cache_specs`), and step(state, cache, ids, valid) -> (the last real token's hidden
    state [B, H], replicated; cache), the cache donated. `sharded_head` turns that state into
    logits once per prompt. With `seq_axis`, the cache needs seq_layout=(devices, segments)
    and the chunk length must be a multiple of the devices on that axis.

    The cache is made shard by shard because built whole and then placed, every position of
    it would first sit on one device: on two H200s that set the fuller device's peak (12B at
    262K: 14.3 GiB, against 11.5 on the other)."""
    from flax import nnx  # noqa: PLC0415

    # The module (jax_mila.gemma4 exports a function of the same name); it imports us.
    generate = importlib.import_module("jax_mila.gemma4.generate")
    from jax_mila.parallel import tensor  # noqa: PLC0415

    cfg = model.config
    graphdef = nnx.graphdef(model)
    tp_size, specs = _weight_specs(model, state, mesh, tp_axis)
    abstract = jax.eval_shape(make_cache)
    if seq_axis is not None:
        check_segments(segments)
        want = (mesh.shape[seq_axis], segments)
        if tuple(abstract.seq_layout) != want:
            raise ValueError(f"context parallel: the cache's seq_layout {abstract.seq_layout} "
                             f"is not (devices, segments) = {want}")
    cspecs = cache_specs(abstract, cfg, seq_axis=seq_axis, tp_axis=tp_axis, tp_size=tp_size)
    state = jax.device_put(state, _named(mesh, specs))  # a no-op for arrays already there
    cache = jax.tree.map(lambda a, sharding: jnp.zeros(a.shape, a.dtype, device=sharding),
                         abstract, _named(mesh, cspecs))

    def build():
        tokens = P(None, seq_axis) if seq_axis is not None else P()

        def body(state, cache, ids, valid):
            with contextlib.ExitStack() as stack:
                if tp_axis is not None:
                    stack.enter_context(tensor.tensor_parallel(tp_axis))
                if seq_axis is not None:
                    stack.enter_context(chunked_context_parallel(seq_axis, segments))
                return generate.chunk_hidden(nnx.merge(graphdef, state), cache, ids, valid)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, cspecs, tokens, P()),
                                     out_specs=(P(), cspecs)), donate_argnums=1,
                       compiler_options=_compile_options(model))

    key = (graphdef, mesh, tp_axis, seq_axis, segments, _hashable(specs), _hashable(cspecs),
           model.backend)
    return _cached(key, build), state, cache


def sharded_head(model, state, mesh, *, tp_axis: str | None):
    """head(state, last) -> the logits [B, vocab] of `sharded_chunk_step`'s last hidden state
    (final norm, output head, softcap), with the weights as that step placed them; once per
    prompt, as on one device: the head reads the whole vocabulary's weights, 1.25 ms a chunk
    for the 12B on an H200 when every chunk computed it."""
    from flax import nnx  # noqa: PLC0415

    from jax_mila.parallel import tensor  # noqa: PLC0415

    graphdef = nnx.graphdef(model)
    _, specs = _weight_specs(model, state, mesh, tp_axis)

    def build():
        def body(state, last):
            with contextlib.ExitStack() as stack:
                if tp_axis is not None:
                    stack.enter_context(tensor.tensor_parallel(tp_axis))
                return nnx.merge(graphdef, state).logits(last)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P()),
                       compiler_options=_compile_options(model))

    return _cached(("head", graphdef, mesh, tp_axis, _hashable(specs), model.backend), build)


# One jitted step (and head) per model structure, mesh and layout, kept across prefill calls: a
# new jax.jit object per call would retrace and recompile every prompt (jit caches per function).
_STEPS: dict = {}
_MAX_STEPS = 16


def _hashable(specs):
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))
    return tuple(leaves), treedef
