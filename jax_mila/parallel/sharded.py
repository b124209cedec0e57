"""The Gemma 4 forward pass over a mesh: heads split over one axis (tensor parallelism,
jax_mila.parallel.tensor), the sequence over another (context parallelism in zig-zag order,
jax_mila.parallel.context), or both at once."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_mila.parallel import context, tensor


def forward(model, input_ids, mesh, *, heads_axis: str | None = "heads",
            seq_axis: str | None = None):
    """Logits [B, S, vocab] of `model(input_ids)`, computed on `mesh`. Either axis may be None
    (not split); mesh axes named by neither replicate. With `seq_axis`, S must be a multiple of
    2 x its size, and every sliding window must fit in one chunk (S / (2 x size) >= W - 1)."""
    from flax import nnx  # noqa: PLC0415

    if heads_axis is None and seq_axis is None:
        raise ValueError("forward over a mesh: name heads_axis, seq_axis or both")
    cfg = model.config
    ids = jnp.asarray(input_ids, jnp.int32)
    graphdef, state = nnx.split(model)
    if heads_axis is not None:
        size = mesh.shape[heads_axis]
        tensor.check_config(cfg, size)
        specs = tensor.param_specs(state, axis=heads_axis, axis_size=size,
                                   num_kv_heads_of_layer=lambda i: cfg.layers[i].num_kv_heads)
    else:
        specs = jax.tree.map(lambda _: P(), state)
    tokens = P() if seq_axis is None else P(None, seq_axis)
    if seq_axis is not None:
        order = context.zigzag_order(ids.shape[1], mesh.shape[seq_axis])
        ids = ids[:, order]

    def body(state, ids):
        with _contexts(heads_axis, seq_axis):
            return nnx.merge(graphdef, state)(ids)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, tokens), out_specs=tokens))
    logits = run(state, ids)
    if seq_axis is not None:
        logits = logits[:, context.zigzag_inverse(ids.shape[1], mesh.shape[seq_axis])]
    return logits


def _contexts(heads_axis, seq_axis) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if heads_axis is not None:
        stack.enter_context(tensor.tensor_parallel(heads_axis))
    if seq_axis is not None:
        stack.enter_context(context.context_parallel(seq_axis))
    return stack
