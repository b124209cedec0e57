"""Tensor parallelism over a `heads` mesh axis (Megatron layout), for the Gemma 4 decoder.

Each attention layer's query heads are split across the axis (q_proj column-parallel), its K/V
heads too where there are at least as many as devices (else k_proj / v_proj are replicated and
every device computes the K/V heads its query heads read), and o_proj is row-parallel; the MLP
is split column- (gate, up) then row-wise (down). A row-parallel projection leaves partial sums,
so each block ends in one all-reduce (`reduce_partial_sums`). Everything else is replicated.

MXFP4 weights shard exactly: a column split cuts whole output channels (rows of the packed
codes, block exponents and channel exponents), a row split cuts the contraction into 128-wide
groups (the packed codes and block exponents along K; the channel exponent stays whole), so a
device holds only its slice and computes what the single-device kernel computes on it.

The model runs inside `jax.shard_map` with the specs from `param_specs`; the layers learn the
axis from the jax_mila.parallel.Layout they are given (its heads_axis).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jax_mila.quant.mxfp4 import GROUP as W4A8_K_GROUP

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
KV_PROJECTIONS = ("k_proj", "v_proj")


def reduce_partial_sums(x: jax.Array, axis: str | None) -> jax.Array:
    """All-reduce over `axis` of a row-parallel projection's partial sums (identity for None)."""
    return x if axis is None else jax.lax.psum(x, axis)


def kv_heads_for_local_queries(k, v, *, axis: str | None, num_heads: int, num_kv_heads: int,
                               local_q_heads: int):
    """The K/V heads this device's query heads read.

    Without TP, or with the KV heads split like the query heads, that is all of k, v. With the
    KV heads replicated (fewer than the devices, e.g. the 12B's single global KV head), device
    r's query heads [r * Hq/tp, (r + 1) * Hq/tp) all read KV head r * (Hq/tp) // G
    (G = Hq / Hkv; `param_specs` replicates only where tp is a multiple of Hkv), cut out here."""
    tp = num_heads // local_q_heads
    if tp == 1 or k.shape[2] * tp == num_kv_heads:
        return k, v
    if axis is None or k.shape[2] != num_kv_heads or tp % num_kv_heads:
        raise ValueError(f"tensor parallel: {local_q_heads} of {num_heads} query heads over "
                         f"{k.shape[2]} of {num_kv_heads} KV heads on heads axis {axis!r} (KV "
                         "heads must be split evenly or replicated with tp a multiple of them)")
    group = num_heads // num_kv_heads
    head = jax.lax.axis_index(axis) * local_q_heads // group
    pick = lambda x: jax.lax.dynamic_slice_in_dim(x, head, 1, axis=2)  # noqa: E731
    return pick(k), pick(v)


def _leaf_spec(names: list[str], shape: tuple, axis: str, axis_size: int, split_kv: bool,
               in_features: int | None = None) -> P:
    module = next((n for n in reversed(names) if n.endswith("_proj")), None)
    leaf = names[-1]
    if module is None or (module in KV_PROJECTIONS and not split_kv):
        return P()
    column = module in COLUMN_PARALLEL
    if module not in COLUMN_PARALLEL + ROW_PARALLEL:
        return P()
    if leaf == "kernel":  # dense [in, out]
        return P(None, axis) if column else P(axis, None)
    if leaf in ("packed", "scales"):  # MXFP4 [out, K / 2] and [out, K / 32]
        # A row-parallel slice must keep whole K groups of the stored weight, and the stored K
        # must be the layer's own (not padded past in_features), or the slices of the weight
        # would not line up with those of the activations.
        if not column and leaf == "packed" and in_features not in (None, 2 * shape[-1]):
            raise ValueError(f"tensor parallel over {axis_size} devices: {'.'.join(names[:-1])} "
                             f"has K={in_features}, stored padded to {2 * shape[-1]}; its W4A8 "
                             f"weight cannot be split along K (K must be a multiple of "
                             f"{W4A8_K_GROUP})")
        if not column and leaf == "packed" and (2 * shape[-1]) % (axis_size * W4A8_K_GROUP):
            raise ValueError(f"tensor parallel over {axis_size} devices: {'.'.join(names[:-1])} "
                             f"has K={2 * shape[-1]}; its W4A8 slices need K / {axis_size} to be "
                             f"a multiple of {W4A8_K_GROUP}")
        return P(axis, None) if column else P(None, axis)
    if leaf == "channel_exp":  # [out]
        return P(axis) if column else P()
    raise ValueError(f"tensor parallel: no sharding rule for parameter {'.'.join(names)} "
                     f"(shape {list(shape)})")


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_specs(state, *, axis: str, axis_size: int, num_kv_heads_of_layer,
                intermediate_of_layer=None):
    """PartitionSpecs for an nnx.State of Gemma4ForCausalLM: `num_kv_heads_of_layer(i)` gives
    layer i's KV heads (K/V projections split only where they divide by `axis_size`),
    `intermediate_of_layer(i)` its MLP width (down_proj's K)."""

    def spec(path, leaf):
        names = [p for p in path if p not in ("", "value")]  # nnx.Variable's own levels
        split_kv, in_features = False, None
        if "layers" in names:
            layer = int(names[names.index("layers") + 1])
            split_kv = num_kv_heads_of_layer(layer) % axis_size == 0
            if "down_proj" in names and intermediate_of_layer is not None:
                in_features = intermediate_of_layer(layer)
        return _leaf_spec(names, tuple(getattr(leaf, "shape", ())), axis, axis_size, split_kv,
                          in_features)

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec(tuple(_key_name(k) for k in path), leaf),
        state)


def check_config(cfg, axis_size: int) -> None:
    """Raises ValueError naming what a `axis_size`-way head split cannot take."""
    def fail(what):
        raise ValueError(f"tensor parallel over {axis_size} devices: {what}")

    if cfg.enable_moe_block:
        fail("MoE layers are not split yet (run the MoE models on one device per replica)")
    if cfg.has_ple:
        fail("per-layer embeddings (PLE) are not split yet")
    if cfg.num_attention_heads % axis_size:
        fail(f"{cfg.num_attention_heads} query heads do not divide evenly")
    for i, spec in enumerate(cfg.layers):
        if spec.num_kv_heads % axis_size and axis_size % spec.num_kv_heads:
            fail(f"layer {i}: {spec.num_kv_heads} KV heads neither divide by the devices nor "
                 "divide them")
        if spec.intermediate_size % axis_size:
            fail(f"layer {i}: MLP width {spec.intermediate_size} does not divide evenly")


