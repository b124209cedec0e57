"""A Gemma 4 model with random weights made on the device, tensor by tensor (benchmarks).

    model = random_model("12b", quantize="w4a8")        # a model card name, directory or config

Why not ``Gemma4ForCausalLM(cfg, rngs=...)``: that draws every weight in float32 and (with
quantize="w4a8") quantizes it inside the constructor, and jax.random draws a [262144, 3840]
embedding through a uint32 buffer twice its size; the transient peaks would dwarf the
12 GiB the 12B model must prefill in. Here the model is built abstractly (nnx.eval_shape,
like the checkpoint loader), then each parameter is filled by one jitted call that draws it
in row blocks (``lax.map``: only one block of float32 values exists at a time) and, for W4A8
linears, quantizes each block with the loader's ``quantize_mxfp4`` (per-row blocks of 32, so
row blocks quantize exactly like the whole weight). No dense copy of a quantized linear is
ever kept; the device peak while building stays at the final weights plus one row block.

Values: linears and MoE experts N(0, in^-0.5) (Flax [in, out]), embeddings N(0, 1), norm
weights, router scales and layer scalars 1 (the constructors' values). The embedding can be
stored as FP8 e4m3 (``embed_dtype``) to halve its memory; lookups and the tied head cast it
to the model dtype.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import nn
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.loader import quantized_linears, weight_shape
from jax_mila.gemma4.model import Gemma4ForCausalLM
from jax_mila.quant.mxfp4 import MXFP4Weight, quantize_mxfp4

BLOCK_VALUES = 1 << 24  # float32 values drawn per row block (64 MiB)
EMBED_DTYPES = ("bfloat16", "float8_e4m3fn")


def _rows_per_block(rows: int, cols: int) -> int:
    """The largest divisor of ``rows`` whose block holds at most BLOCK_VALUES values."""
    cap = max(1, BLOCK_VALUES // max(cols, 1))
    return max(d for d in range(1, min(rows, cap) + 1) if rows % d == 0) if rows > cap else rows


def _place(x, sharding):
    """Inside the jitted draws: the result laid out as ``sharding`` (None: the default
    device). With a replicated sharding XLA partitions the draw itself, so every device draws
    the same values from the same key and no device ever holds another's copy."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@functools.partial(jax.jit, static_argnames=("shape", "std", "dtype", "sharding"))
def _normal(key, shape, std, dtype, sharding=None):
    """N(0, std) of ``shape`` in ``dtype``, drawn over the leading axis in row blocks."""
    rows, rest = shape[0], shape[1:]
    cols = 1
    for d in rest:
        cols *= d
    block = _rows_per_block(rows, cols)

    def draw(i):
        x = jax.random.normal(jax.random.fold_in(key, i), (block,) + rest, jnp.float32)
        return (x * std).astype(dtype)

    return _place(jax.lax.map(draw, jnp.arange(rows // block)).reshape(shape), sharding)


@functools.partial(jax.jit, static_argnames=("out_features", "in_features", "sharding"))
def _mxfp4(key, out_features, in_features, sharding=None):
    """A random [out, in] weight N(0, in^-0.5), quantized to MXFP4 block by block."""
    block = _rows_per_block(out_features, in_features)

    def draw(i):
        w = jax.random.normal(jax.random.fold_in(key, i), (block, in_features), jnp.float32)
        q = quantize_mxfp4(w * in_features**-0.5, check_finite=False)
        return q.packed, q.scales, q.channel_exp

    packed, scales, channel_exp = jax.lax.map(draw, jnp.arange(out_features // block))
    packed, scales, channel_exp = _place((packed.reshape(out_features, -1),
                                          scales.reshape(out_features, -1),
                                          channel_exp.reshape(out_features)), sharding)
    return MXFP4Weight(packed, scales, channel_exp)


def _config_path(config) -> str:
    """config.json of a model card name ("12b", "embedded"), a directory or a config.json."""
    from jax_mila.gemma4.paths import model_card

    path = os.fspath(config)
    if not os.path.exists(path):
        path = os.fspath(model_card(path))  # FileNotFoundError listing the cards
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    return path


def _config(config) -> Gemma4Config:
    if isinstance(config, Gemma4Config):
        return config
    return Gemma4Config.from_pretrained(os.path.dirname(_config_path(config)))


def random_model(config, *, dtype=jnp.bfloat16, backend: str = "auto", quantize="w4a8",
                 embed_dtype=None, seed: int = 0, sharding=None) -> Gemma4ForCausalLM:
    """Gemma4ForCausalLM of ``config`` (a Gemma4Config, a checkpoint directory, a config.json
    or a model card name such as "12b") with random weights made on the default device.

    ``quantize``: None (dense linears in ``dtype``) or "w4a8" (MXFP4, see jax_mila.nn.Linear).
    ``embed_dtype``: storage of the embedding tables, default ``dtype``; "float8_e4m3fn"
    halves it (values N(0, 1) are well inside e4m3's range).
    ``sharding``: where every array is made, e.g. ``NamedSharding(mesh, P())`` to replicate
    the model on every device of a mesh (context parallelism): each device draws its own
    copy, so building it never needs more memory on one device than one copy; the values
    equal those of the default (single-device) build."""
    nn.check_quantize(quantize)
    cfg = _config(config)
    embed_dtype = jnp.dtype(dtype if embed_dtype is None else embed_dtype)
    if embed_dtype.name not in EMBED_DTYPES + (jnp.dtype(dtype).name,):
        raise ValueError(f"embed_dtype={embed_dtype.name} is not supported (supported: "
                         f"{EMBED_DTYPES} or the model dtype)")
    model = nnx.eval_shape(lambda: Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend,
                                                     quantize=quantize, rngs=nnx.Rngs(0)))
    key = jax.random.key(seed)
    count = 0
    for _, linear in quantized_linears(model):
        *lead, out_features, in_features = weight_shape(linear)  # experts: [E, out, in]
        w = _mxfp4(jax.random.fold_in(key, count), math.prod(lead) * out_features, in_features,
                   sharding)
        linear.set_mxfp4(jax.tree.map(lambda a: a.reshape(*lead, out_features, *a.shape[1:]), w))
        count += 1
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for name, var in vars(node).items():
            if not isinstance(var, nnx.Param):
                continue
            shape, param_dtype = tuple(var.get_value().shape), var.get_value().dtype
            if isinstance(node, nn.Embed):
                value = _normal(jax.random.fold_in(key, count), shape, 1.0, embed_dtype,
                                sharding)
            elif len(shape) >= 2:  # dense linears and experts: Flax [(E,) in, out]
                value = _normal(jax.random.fold_in(key, count), shape, shape[-2] ** -0.5,
                                jnp.dtype(param_dtype), sharding)
            else:  # norm weights, router scales, layer scalars: the constructors' ones
                value = jnp.ones(shape, param_dtype)
                value = value if sharding is None else jax.device_put(value, sharding)
            var.set_value(value)
            count += 1
    return model


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of every array the model holds (MXFP4 codes, dense parameters)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "nbytes"))
