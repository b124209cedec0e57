"""The steps over a mesh: the forward pass of a whole sequence, and the chunked prefill's step
and output head, inside jax.shard_map.

Each step is given a jax.sharding.Mesh and the names of its axes: heads split over one
(tensor parallelism: the weights laid out by jax_mila.parallel.tensor.param_specs), the tokens
over another (context parallelism: a whole sequence in zig-zag order, jax_mila.parallel.context,
or each prefill chunk in contiguous slices with the full-attention cache sharded by position,
jax_mila.parallel.chunked), or both. The step builds the jax_mila.parallel.Layout that says so
and passes it to the model it runs (hidden_states(..., layout=...)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_mila.engine import jitted
from jax_mila.parallel import chunked, context, tensor
from jax_mila.parallel.layout import CHUNK, ZIGZAG, Layout


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
    if tp_axis is None:
        return 1, jax.tree.map(lambda _: P(), state)
    cfg, tp_size = model.config, mesh.shape[tp_axis]
    tensor.check_config(cfg, tp_size)
    return tp_size, tensor.param_specs(
        state, axis=tp_axis, axis_size=tp_size,
        num_kv_heads_of_layer=lambda i: cfg.layers[i].num_kv_heads,
        intermediate_of_layer=lambda i: cfg.layers[i].intermediate_size)


def _named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


# ------------------------------------------------------------------ a whole sequence (no cache)

def forward(model, input_ids, mesh, *, heads_axis: str | None = "heads",
            seq_axis: str | None = None):
    """Logits [B, S, vocab] of `model(input_ids)`, computed on `mesh`. Either axis may be None
    (not split); mesh axes named by neither replicate. With `seq_axis`, S must be a multiple of
    2 x its size, and every sliding window must fit in one chunk (S / (2 x size) >= W - 1)."""
    if heads_axis is None and seq_axis is None:
        raise ValueError("forward over a mesh: name heads_axis, seq_axis or both")
    ids = model.check_input_ids(input_ids)
    graphdef, state = nnx.split(model)
    _, specs = _weight_specs(model, state, mesh, heads_axis)
    tokens = P() if seq_axis is None else P(None, seq_axis)
    if seq_axis is not None:
        ids = ids[:, context.zigzag_order(ids.shape[1], mesh.shape[seq_axis])]
    layout = Layout(heads_axis=heads_axis, seq_axis=seq_axis,
                    seq_split=None if seq_axis is None else ZIGZAG)

    def body(state, ids):
        model = nnx.merge(graphdef, state)
        h, _ = model.hidden_states(ids, layout=layout)
        return model.logits(h)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, tokens), out_specs=tokens))
    logits = run(state, ids)
    if seq_axis is not None:
        logits = logits[:, context.zigzag_inverse(ids.shape[1], mesh.shape[seq_axis])]
    return logits


# ------------------------------------------------------------------------ the chunked prefill

def chunk_step(model, state, make_cache, mesh, *, tp_axis: str | None,
               seq_axis: str | None, segments: int = chunked.DEFAULT_SEGMENTS):
    """The chunked-prefill step over `mesh`: returns (step, state, cache) with the weights
    placed on the mesh (split over `tp_axis`, replicated over `seq_axis`), the zero cache that
    `make_cache()` describes (model.empty_cache, never called whole) created in its shards
    (chunked.cache_specs), and step(state, cache, ids, valid) -> (the last real token's hidden
    state [B, H], replicated; cache), the cache donated. `head` turns that state into logits
    once per prompt. With `seq_axis`, the cache needs seq_layout=(devices, segments) and the
    chunk length must be a multiple of the devices on that axis.

    The cache is made shard by shard because built whole and then placed, every position of
    it would first sit on one device and set that device's peak."""
    cfg = model.config
    graphdef = nnx.graphdef(model)
    tp_size, specs = _weight_specs(model, state, mesh, tp_axis)
    abstract = jax.eval_shape(make_cache)
    if seq_axis is not None:
        chunked.check_segments(segments)
        want = (mesh.shape[seq_axis], segments)
        if tuple(abstract.seq_layout) != want:
            raise ValueError(f"context parallel: the cache's seq_layout {abstract.seq_layout} "
                             f"is not (devices, segments) = {want}")
    cspecs = chunked.cache_specs(abstract, cfg, seq_axis=seq_axis, tp_axis=tp_axis,
                                 tp_size=tp_size)
    state = jax.device_put(state, _named(mesh, specs))  # a no-op for arrays already there
    cache = jax.tree.map(lambda a, sharding: jnp.zeros(a.shape, a.dtype, device=sharding),
                         abstract, _named(mesh, cspecs))
    layout = Layout(heads_axis=tp_axis, seq_axis=seq_axis,
                    seq_split=None if seq_axis is None else CHUNK,
                    segments=0 if seq_axis is None else segments)

    def build():
        tokens = P(None, seq_axis) if seq_axis is not None else P()

        def body(state, cache, ids, valid):
            return jitted.chunk_hidden(nnx.merge(graphdef, state), cache, ids, valid,
                                      layout=layout)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, cspecs, tokens, P()),
                                     out_specs=(P(), cspecs)), donate_argnums=1,
                       compiler_options=jitted.compile_options(model))

    key = (graphdef, mesh, layout, _hashable(specs), _hashable(cspecs), model.backend)
    return _cached(key, build), state, cache


def head(model, state, mesh, *, tp_axis: str | None):
    """head(state, last) -> the logits [B, vocab] of `chunk_step`'s last hidden state (final
    norm, output head, softcap), with the weights as that step placed them; once per prompt,
    as on one device: the head reads the whole vocabulary's weights."""
    graphdef = nnx.graphdef(model)
    _, specs = _weight_specs(model, state, mesh, tp_axis)

    def build():
        def body(state, last):
            return nnx.merge(graphdef, state).logits(last)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P()),
                       compiler_options=jitted.compile_options(model))

    return _cached(("head", graphdef, mesh, tp_axis, _hashable(specs), model.backend), build)


# One jitted step (and head) per model structure, mesh and layout, kept across prefill calls: a
# new jax.jit object per call would retrace and recompile every prompt (jit caches per function).
_STEPS: dict = {}
_MAX_STEPS = 16


def _cached(key, build):
    fn = _STEPS.get(key)
    if fn is None:
        fn = build()
        if len(_STEPS) >= _MAX_STEPS:
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[key] = fn
    return fn


def _hashable(specs):
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))
    return tuple(leaves), treedef
