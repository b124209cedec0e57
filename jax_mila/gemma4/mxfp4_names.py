"""How MXFP4 (W4A8) weights are stored in a safetensors checkpoint -- the one place that
defines it (the loader reads it, ``python -m jax_mila convert`` writes it).

A linear weight ``<name>.weight`` (PyTorch [out, in], bf16) becomes three uint8 tensors

    <name>.weight_mxfp4_packed       [out, Kp / 2]   e2m1 codes, kernel order
    <name>.weight_mxfp4_scales       [out, Kp / 32]  e8m0 block exponents
    <name>.weight_mxfp4_channel_exp  [out]           per-channel reference exponent

i.e. the fields of jax_mila.quant.MXFP4Weight with N = out, K = in, stored over Kp =
padded_k(in) (the layout is documented in jax_mila/quant/mxfp4.py; [out, in] is already MXFP4's
[N, K], so nothing is transposed). The experts' 3-D tensors (``<name>`` =
``...experts.gate_up_proj`` [E, 2I, H], ``...experts.down_proj`` [E, H, I]) become
``<name>_mxfp4_packed`` [E, out, Kp / 2] and so on, with the expert dimension leading.
Every other tensor keeps its name, shape and dtype. config.json gains a top-level

    "jax_mila_quantization": {"format": "mxfp4", "version": 2}

so a loader can tell before reading any tensor that the checkpoint is quantized. The version
is that of the packed bytes (jax_mila.quant.mxfp4.FORMAT_VERSION); version 1 checkpoints
(each code's sign in its own nibble) are still read, their packed
bytes converted while loading (jax_mila.quant.packed_from_version).

Each safetensors file holding MXFP4 tensors also records their version in its metadata,
``{"jax_mila_mxfp4_version": "2"}``: versions 1 and 2 differ only in where the sign bits sit,
so the bytes cannot tell which they are, and a config.json that names the other version (a
config copied from another checkpoint, or edited) would load them as a different model. The
loader refuses a file whose record disagrees with config.json; files written before the
record existed are read as config.json says.
"""

from __future__ import annotations

import json
import os

from jax_mila.quant.mxfp4 import BLOCK, FORMAT_VERSION, padded_k

FIELDS = ("packed", "scales", "channel_exp")  # MXFP4Weight's fields
SUFFIX = ".weight"
CONFIG_KEY = "jax_mila_quantization"
FORMAT = {"format": "mxfp4", "version": FORMAT_VERSION}
READ_VERSIONS = (1, FORMAT_VERSION)  # versions checkpoint_format accepts
METADATA_KEY = "jax_mila_mxfp4_version"  # safetensors metadata of files with MXFP4 tensors


def tensor_names(weight_name: str) -> dict[str, str]:
    """``model.layers.0.mlp.up_proj.weight`` (or an expert tensor's name,
    ``model.layers.0.experts.down_proj``) -> {field: checkpoint tensor name}."""
    return {f: f"{weight_name}_mxfp4_{f}" for f in FIELDS}


def is_mxfp4_tensor(name: str) -> bool:
    """Whether ``name`` is one of the three tensors of an MXFP4 weight."""
    return any(name.endswith(f"_mxfp4_{f}") for f in FIELDS)


def expected_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Shapes of the three tensors of a [..., out, in] weight."""
    *lead, out_features, in_features = shape
    kp = padded_k(in_features)
    return {"packed": (*lead, out_features, kp // 2),
            "scales": (*lead, out_features, kp // BLOCK),
            "channel_exp": (*lead, out_features)}


def checkpoint_format(path: str | os.PathLike) -> dict | None:
    """The ``jax_mila_quantization`` entry of a checkpoint's config.json (None if dense)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    entry = config.get(CONFIG_KEY)
    if entry is not None and (not isinstance(entry, dict) or entry.get("format") != "mxfp4" or
                              entry.get("version") not in READ_VERSIONS or len(entry) != 2):
        raise ValueError(f"{path}: {CONFIG_KEY}={entry!r} is not a format this version reads "
                         f"(supported: format 'mxfp4', version in {list(READ_VERSIONS)})")
    return entry
