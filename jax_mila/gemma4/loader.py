"""Loads Hugging Face safetensors checkpoints of Gemma 4 into Gemma4ForCausalLM.

- Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
- Finds the text decoder under ``model.language_model.`` (multimodal checkpoints) or
  ``model.`` (text-only Gemma4ForCausalLM); skips vision / audio towers and the unused
  k_proj / v_proj / k_norm that KV-shared layers still carry in released checkpoints.
- Builds the model abstractly (nnx.eval_shape: no weights are allocated), then fills each
  parameter from its tensor one at a time (PyTorch [out, in] -> Flax [in, out] transposed once,
  cast to the model dtype), so host memory never holds two full copies of the weights.
- ``quantize="w4a8"``: linears and experts the W4A8 kernels can take are quantized to MXFP4 as
  each tensor is read (or read as stored from a converted checkpoint; names in mxfp4_names.py).
- Every parameter must come from the checkpoint: a missing or mis-shaped tensor raises
  CheckpointError naming the tensor, the expected and the found shape; so does a dense weight
  stored in a dtype other than FLOAT_DTYPES or holding NaN / inf, an MXFP4 tensor file whose
  recorded format version is not config.json's, and a file that is missing, truncated or not
  safetensors (naming the file).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jax_mila import nn
from jax_mila.gemma4 import mxfp4_names
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.model import Gemma4ForCausalLM
from jax_mila.quant.mxfp4 import FORMAT_VERSION, MXFP4Weight, packed_from_version, quantize_mxfp4

log = logging.getLogger("jax_mila")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PREFIXES = ("model.language_model.", "model.")
# Tensors of KV-shared layers that released checkpoints still contain but no computation uses.
_SHARED_LAYER_UNUSED = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj\.weight|v_proj\.weight|k_norm\.weight|v_norm\.weight)$")


# Model dtypes from_pretrained takes: the released weights' bf16, and float32 for parity (what
# the README, the CLI and the tests use; no test runs the model in any other dtype).
DTYPES = ("bfloat16", "float32")


# Dtypes a dense weight may be stored in (it is cast to the model's dtype); anything else, an
# integer tensor where a weight goes above all, is refused rather than cast.
FLOAT_DTYPES = ("bfloat16", "float16", "float32")


class CheckpointError(ValueError):
    """A checkpoint does not provide a tensor the model needs, provides it mis-shaped, in a
    dtype that is no weight's, with NaN / inf values, or in a file that cannot be read."""


def _open(file: str, stack: contextlib.ExitStack | None = None):
    """safe_open(file), or CheckpointError naming the file when it is missing, truncated or
    not a safetensors file (safetensors' own error names neither the file nor the fix)."""
    try:
        handle = safe_open(file, framework="flax")
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); the file is "
                              "truncated or corrupt: download or convert it again") from None
    return handle if stack is None else stack.enter_context(handle)


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (expected JSON with a "
                                  f"'weight_map' of tensor name -> file; {type(e).__name__}: "
                                  f"{e})") from None
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: file not found (listed in {index})")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _checkpoint_name(path: tuple, prefix: str) -> tuple[str, tuple[int, ...] | None]:
    """HF tensor name of a parameter path, and the axis permutation from HF to Flax layout."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if leaf == "kernel" and len(parts) >= 3 and parts[-3] == "experts":
        # nn.GroupedLinear: HF's raw parameter experts.<proj> [E, out, in] -> [E, in, out]
        parts, perm = parts[:-1], (0, 2, 1)
    elif leaf == "kernel":  # nn.Linear: torch [out, in] -> [in, out]
        parts[-1], perm = "weight", (1, 0)
    else:
        perm = None
    name = ".".join(parts)
    return (name if name.startswith("lm_head.") else prefix + name), perm


def find_prefix(path: str, files: dict[str, str]) -> str:
    """The decoder's tensor-name prefix ("model.language_model." or "model.")."""
    prefix = next((p for p in PREFIXES if any(n.startswith(p + "embed_tokens.") for n in files)), None)
    if prefix is None:
        raise CheckpointError(f"{path}: no embed_tokens.weight under any of {PREFIXES}")
    return prefix


def linear_weight_name(module_path: tuple, prefix: str) -> str:
    """HF name of the weight of the nn.Linear (``...weight``) or nn.GroupedLinear (the raw
    expert tensor, ``...experts.down_proj``) at ``module_path``."""
    return _checkpoint_name(tuple(module_path) + ("kernel",), prefix)[0]


def weight_shape(module) -> tuple[int, ...]:
    """The HF shape of a linear's ([out, in]) or experts' ([E, out, in]) weight."""
    if isinstance(module, nn.GroupedLinear):
        return (module.num_experts, module.out_features, module.in_features)
    return (module.out_features, module.in_features)


def quantized_linears(model: Gemma4ForCausalLM):
    """(module path, module) of every nn.Linear and nn.GroupedLinear of ``model`` that holds an
    MXFP4 weight."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nn.Linear, nn.GroupedLinear)) and node.quantize == "w4a8":
            yield path, node


def dense_params(model: Gemma4ForCausalLM):
    """(parameter path, nnx.Param) of every dense parameter of ``model``."""
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            yield path, var


class _Reader:
    """Reads tensors by name from a checkpoint's files, keeping each file open once."""

    def __init__(self, path: str, files: dict[str, str], stack: contextlib.ExitStack):
        self.path, self.files, self.stack, self.handles = path, files, stack, {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = _open(file, self.stack)
        return self.handles[file]

    def metadata(self, name: str) -> dict[str, str]:
        """The safetensors metadata of the file holding tensor ``name``."""
        return self._handle(name).metadata() or {}

    def read(self, name: str, expected: tuple[int, ...], dtype=None):
        """The tensor ``name``; CheckpointError naming it when missing, not of shape
        ``expected``, or not of ``dtype`` (None: a dense weight, any of FLOAT_DTYPES)."""
        if name not in self.files:
            raise CheckpointError(f"{self.path}: tensor {name} is missing (expected shape {list(expected)})")
        try:
            tensor = self._handle(name).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{self.files[name]}: tensor {name} cannot be read ({e}); the "
                                  "file is truncated or corrupt: download or convert it "
                                  "again") from None
        if tuple(tensor.shape) != tuple(expected):
            raise CheckpointError(f"{self.path}: tensor {name} has shape {list(tensor.shape)}, "
                                  f"expected {list(expected)}")
        allowed = FLOAT_DTYPES if dtype is None else (jnp.dtype(dtype).name,)
        if jnp.dtype(tensor.dtype).name not in allowed:
            raise CheckpointError(f"{self.path}: tensor {name} has dtype "
                                  f"{jnp.dtype(tensor.dtype).name} (supported: "
                                  f"{', '.join(allowed)})")
        return tensor


def check_finite(path: str, name: str, value) -> None:
    """CheckpointError naming tensor ``name`` when ``value`` holds NaN or inf (such a weight
    loads and runs, and every logit downstream of it is NaN)."""
    if bool(jnp.all(jnp.isfinite(value))):
        return
    host = np.asarray(value, np.float32)
    bad = np.argwhere(~np.isfinite(host))
    raise CheckpointError(f"{path}: tensor {name} contains {len(bad)} NaN/inf value(s) (in "
                          f"{jnp.dtype(value.dtype).name}), first at index "
                          f"{tuple(int(i) for i in bad[0])}; refusing to load it")


def check_mxfp4_version(reader: _Reader, name: str, version: int, configured: bool) -> None:
    """CheckpointError when the file holding MXFP4 tensor ``name`` records (convert writes it in
    the safetensors metadata, mxfp4_names.METADATA_KEY) another format version than
    ``version``, the one config.json gives (``configured``) or the current one (config.json
    without the entry). The packed bytes of versions 1 and 2 differ only in where each sign
    bit sits, so nothing in the tensors themselves tells them apart: read as the wrong version
    they load into another model without any error. Files with no record (written before it)
    are read as config.json says."""
    recorded = reader.metadata(name).get(mxfp4_names.METADATA_KEY)
    if recorded is None:
        return
    file = reader.files[name]
    if recorded not in {str(v) for v in mxfp4_names.READ_VERSIONS}:
        raise CheckpointError(f"{file}: its MXFP4 tensors are of format version {recorded!r} "
                              f"(safetensors metadata {mxfp4_names.METADATA_KEY}), which this "
                              f"version does not read (supported: {list(mxfp4_names.READ_VERSIONS)})")
    if int(recorded) != version:
        said = (f"config.json's {mxfp4_names.CONFIG_KEY} says version {version}" if configured
                else f"config.json has no {mxfp4_names.CONFIG_KEY} entry (read as version {version})")
        raise CheckpointError(
            f"{file}: its MXFP4 tensors are of format version {recorded} (safetensors metadata "
            f"{mxfp4_names.METADATA_KEY}), but {said}; read as version {version} they would load "
            f"as a different model. Put {{\"format\": \"mxfp4\", \"version\": {recorded}}} in "
            f"config.json's {mxfp4_names.CONFIG_KEY}, or convert the checkpoint again")


def read_mxfp4(reader: _Reader, weight_name: str, shape: tuple[int, ...],
               version: int = FORMAT_VERSION, configured: bool = True):
    """The MXFP4 weight of ``weight_name`` (HF shape [out, in], or [E, out, in] for experts):
    read as stored when the checkpoint holds its three MXFP4 tensors (written by convert;
    ``version``: the checkpoint's format version, older packed bytes are converted;
    ``configured``: whether config.json gave it, see check_mxfp4_version), else quantized from
    the dense tensor. Returns (MXFP4Weight, names of the tensors read)."""
    names = mxfp4_names.tensor_names(weight_name)
    if any(n in reader for n in names.values()):
        if names["packed"] in reader:
            check_mxfp4_version(reader, names["packed"], version, configured)
        shapes = mxfp4_names.expected_shapes(shape)
        fields = {f: reader.read(names[f], shapes[f], jnp.uint8) for f in mxfp4_names.FIELDS}
        fields["packed"] = packed_from_version(fields["packed"], version)
        # Cheap consistency check (the kernel scales every block against channel_exp): catches
        # tensors mixed up between layers or written by something else than quantize_mxfp4.
        if not bool(jnp.all(fields["channel_exp"] == jnp.max(fields["scales"], axis=-1))):
            raise CheckpointError(f"{reader.path}: {names['channel_exp']} is not the row maximum of "
                                  f"{names['scales']}; not a valid MXFP4 weight")
        return MXFP4Weight(**fields), list(names.values())
    dense = reader.read(weight_name, shape)
    try:
        return quantize_mxfp4(dense, name=weight_name), [weight_name]
    except ValueError as e:  # NaN / inf in the checkpoint
        raise CheckpointError(f"{reader.path}: {e}") from None


def load_weights(model: Gemma4ForCausalLM, path: str | os.PathLike) -> Gemma4ForCausalLM:
    """Fills every parameter of ``model`` (abstract or not) from the checkpoint at ``path``.

    Quantized linears (``quantize="w4a8"``) take their MXFP4 tensors as stored, or quantize the
    dense tensor when the checkpoint has none -- one tensor at a time, so the dense model is
    never materialised."""
    path = os.fspath(path)
    files = _tensor_files(path)
    prefix = find_prefix(path, files)
    try:
        stored = mxfp4_names.checkpoint_format(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    except FileNotFoundError:  # no config.json: MXFP4 tensors, if any, are of this version
        stored = None
    version = FORMAT_VERSION if stored is None else stored["version"]
    used = set()
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, files, stack)
        for module_path, linear in quantized_linears(model):
            name = linear_weight_name(module_path, prefix)
            w, names = read_mxfp4(reader, name, weight_shape(linear), version,
                                  configured=stored is not None)
            linear.set_mxfp4(w)
            used.update(names)
            del w
        for param_path, var in dense_params(model):
            name, perm = _checkpoint_name(param_path, prefix)
            expected = tuple(var.get_value().shape)
            hf_shape = expected if perm is None else tuple(expected[i] for i in perm)
            if name not in reader and name.endswith(mxfp4_names.SUFFIX) and \
                    mxfp4_names.tensor_names(name)["packed"] in reader:
                raise CheckpointError(
                    f"{path}: tensor {name} is stored as MXFP4 ({mxfp4_names.tensor_names(name)['packed']}, "
                    f"...), but the model wants it dense; load this checkpoint with quantize='w4a8'")
            tensor = reader.read(name, hf_shape)
            value = tensor.astype(var.get_value().dtype)
            # After the cast (float32 values past bf16's range too), before the transpose (the
            # index it names is the checkpoint's).
            check_finite(path, name, value)
            var.set_value(value if perm is None else jnp.transpose(value, perm))
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


def check_dtype(dtype) -> None:
    """Raises ValueError naming ``dtype`` unless it is one of DTYPES (anything else would fail
    later, deep inside the model's construction, or run in an untested precision)."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:  # not a dtype at all
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype={name or dtype!r} is not supported (supported: {', '.join(DTYPES)})")


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16, backend: str = "auto",
                    quantize=None) -> Gemma4ForCausalLM:
    """Loads a Gemma 4 text decoder from a Hugging Face checkpoint directory.

    ``dtype``: parameter and activation dtype, bfloat16 (like the released weights) or float32
    (for parity); others raise ValueError. ``backend``: "auto", "mila" (jax_mila kernels where they apply) or "reference".
    ``quantize``: weight format of the linears: None (dense) or "w4a8" (MXFP4 weights, FP8
    activations; see jax_mila.nn.Linear). With "w4a8" a dense checkpoint is quantized while
    loading, tensor by tensor; a checkpoint written by ``python -m jax_mila convert`` is read
    as stored. Such a converted checkpoint cannot be loaded with quantize=None (CheckpointError:
    its linears exist only in MXFP4; dequantizing them would silently give a different model
    than the dense original).
    """
    check_dtype(dtype)
    nn.check_quantize(quantize)
    path = os.fspath(path)
    try:
        stored = mxfp4_names.checkpoint_format(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json") from None
    if stored is not None and quantize != "w4a8":
        raise CheckpointError(f"{path}: the checkpoint holds MXFP4 weights ({mxfp4_names.CONFIG_KEY}="
                              f"{stored}); load it with quantize='w4a8' (got quantize={quantize!r})")
    cfg = Gemma4Config.from_pretrained(path)
    model = nnx.eval_shape(lambda: Gemma4ForCausalLM(cfg, dtype=dtype, backend=backend,
                                                     quantize=quantize, rngs=nnx.Rngs(0)))
    return load_weights(model, path)
