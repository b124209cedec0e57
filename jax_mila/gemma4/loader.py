"""Loads Hugging Face safetensors checkpoints of Gemma 4 into Gemma4ForCausalLM.

- Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
- Finds the text decoder under ``model.language_model.`` (multimodal checkpoints) or
  ``model.`` (text-only Gemma4ForCausalLM); skips vision / audio towers and the unused
  k_proj / v_proj / k_norm that KV-shared layers still carry in released checkpoints.
- Builds the model abstractly (nnx.eval_shape: no weights are allocated), then fills each
  parameter from its tensor one at a time (PyTorch [out, in] -> Flax [in, out] transposed once,
  cast to the model dtype), so host memory never holds two full copies of the weights.
- Every parameter must come from the checkpoint: a missing or mis-shaped tensor raises
  CheckpointError naming the tensor, the expected and the found shape.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.model import Gemma4ForCausalLM

log = logging.getLogger("jax_mila")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PREFIXES = ("model.language_model.", "model.")
# Tensors of KV-shared layers that released checkpoints still contain but no computation uses.
_SHARED_LAYER_UNUSED = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj\.weight|v_proj\.weight|k_norm\.weight|v_norm\.weight)$")


class CheckpointError(ValueError):
    """A checkpoint does not provide a tensor the model needs, or provides it mis-shaped."""


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def _checkpoint_name(path: tuple, prefix: str) -> tuple[str, tuple[int, ...] | None]:
    """HF tensor name of a parameter path, and the axis permutation from HF to Flax layout."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if leaf == "kernel":  # nn.Linear: torch [out, in] -> [in, out]
        parts[-1], perm = "weight", (1, 0)
    elif parts[-2:] in (["experts", "gate_up_proj"], ["experts", "down_proj"]):  # [E, out, in] -> [E, in, out]
        perm = (0, 2, 1)
    else:
        perm = None
    name = ".".join(parts)
    return (name if name.startswith("lm_head.") else prefix + name), perm


def load_weights(model: Gemma4ForCausalLM, path: str | os.PathLike) -> Gemma4ForCausalLM:
    """Fills every parameter of ``model`` (abstract or not) from the checkpoint at ``path``."""
    path = os.fspath(path)
    files = _tensor_files(path)
    prefix = next((p for p in PREFIXES if any(n.startswith(p + "embed_tokens.") for n in files)), None)
    if prefix is None:
        raise CheckpointError(f"{path}: no embed_tokens.weight under any of {PREFIXES}")
    dtype = model.dtype
    used = set()
    with contextlib.ExitStack() as stack:
        handles = {}
        for param_path, var in nnx.iter_graph(model):
            if not isinstance(var, nnx.Param):
                continue
            name, perm = _checkpoint_name(param_path, prefix)
            expected = tuple(var.get_value().shape)
            hf_shape = expected if perm is None else tuple(expected[i] for i in perm)
            if name not in files:
                raise CheckpointError(f"{path}: tensor {name} is missing (expected shape {list(hf_shape)})")
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="flax"))
            tensor = handles[file].get_tensor(name)
            if tuple(tensor.shape) != hf_shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {list(tensor.shape)}, "
                                      f"expected {list(hf_shape)}")
            value = tensor if perm is None else jnp.transpose(tensor, perm)
            var.set_value(value.astype(var.get_value().dtype))
            del tensor, value
            used.add(name)
    _report_unused(files, used, prefix, model.config)
    return model


def _report_unused(files, used, prefix, cfg: Gemma4Config) -> None:
    other_towers = skipped_shared = 0
    unexpected = []
    for name in files:
        if name in used:
            continue
        if not name.startswith(prefix) or (prefix == "model." and name.startswith(
                ("model.vision", "model.audio", "model.embed_vision", "model.embed_audio"))):
            other_towers += name != "lm_head.weight"  # tied head copies are expected too
            continue
        m = _SHARED_LAYER_UNUSED.match(name[len(prefix):])
        if m and int(m.group(1)) >= cfg.first_kv_shared_layer:
            skipped_shared += 1
        else:
            unexpected.append(name)
    log.info("gemma4 loader: %d tensors loaded, %d of other towers and %d unused KV-shared "
             "k/v tensors skipped", len(used), other_towers, skipped_shared)
    if unexpected:
        log.warning("gemma4 loader: %d decoder tensors the model does not use: %s",
                    len(unexpected), ", ".join(sorted(unexpected)[:10]))


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16, backend: str = "auto",
                    quantize=None) -> Gemma4ForCausalLM:
    """Loads a Gemma 4 text decoder from a Hugging Face checkpoint directory.

    ``dtype``: parameter and activation dtype (bf16 like the released weights, or float32 for
    parity). ``backend``: "auto", "mila" (jax_mila kernels where they apply) or "reference".
    ``quantize``: weight format of the linears; only None (dense) exists yet.
    """
    cfg = Gemma4Config.from_pretrained(path)
    model = nnx.eval_shape(lambda: Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend,
                                                     quantize=quantize, rngs=nnx.Rngs(0)))
    return load_weights(model, path)
