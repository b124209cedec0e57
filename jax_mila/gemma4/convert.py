"""``python -m jax_mila convert``: rewrites a Gemma 4 checkpoint's text decoder with MXFP4
(W4A8) linear weights, streaming one tensor at a time.

    convert(src, dst, quantize="w4a8")

- Reads ``model.safetensors`` or a sharded index from ``src``; writes only the tensors the text
  decoder uses (vision / audio towers, tied ``lm_head`` copies and unused KV-shared k/v
  tensors are not copied), under their original names.
- Which weights become MXFP4 is decided by the model itself: the converter builds the model
  abstractly with the same ``quantize`` and quantizes exactly the linears that hold an MXFP4
  weight (kernel-compatible shapes; the MoE router stays dense), so loading the result with
  ``quantize="w4a8"`` gives bit-identical weights to quantizing on load. Names: mxfp4_names.py.
- Writes ``dst/model.safetensors``, or shards of about ``shard_bytes`` (default 4 GiB) plus
  ``model.safetensors.index.json``; at most one shard's tensors are held in memory.
- Copies config.json (adding ``"jax_mila_quantization": {"format": "mxfp4", "version": 2}``)
  and the tokenizer / generation files that exist; files with MXFP4 tensors record the format
  version in their safetensors metadata too (mxfp4_names.METADATA_KEY).
- Atomic: everything is written to a staging folder beside ``dst`` (``.<dst name>.jax_mila_convert.<pid>``
  in its parent; inside ``dst`` when the parent is not writable), which becomes ``dst`` by one
  rename at the end; where ``dst`` already exists its files are moved in, the weights' entry
  file (model.safetensors or the index) last, so ``dst`` holds a loadable checkpoint only
  once every file is in place. A convert that fails cleans its staging folder; one that was
  killed leaves it, and the next convert to the same ``dst`` removes it (and shards of such a
  run left in ``dst``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import jax.numpy as jnp
from flax import nnx
from safetensors.flax import save_file

from jax_mila import nn
from jax_mila.gemma4 import loader, mxfp4_names
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.loader import CheckpointError
from jax_mila.gemma4.model import Gemma4ForCausalLM
from jax_mila.quant.mxfp4 import FORMAT_VERSION, quantize_mxfp4

SHARD_BYTES = 4 << 30
EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
               "chat_template.json", "processor_config.json")


def _plan(model, prefix: str):
    """[(HF tensor name, expected HF shape, quantize?)] for every weight the model loads."""
    entries = []
    for module_path, linear in loader.quantized_linears(model):
        name = loader.linear_weight_name(module_path, prefix)
        entries.append((name, loader.weight_shape(linear), True))
    for param_path, var in loader.dense_params(model):
        name, perm = loader._checkpoint_name(param_path, prefix)
        shape = tuple(var.get_value().shape)
        entries.append((name, shape if perm is None else tuple(shape[i] for i in perm), False))
    return sorted(entries)


def _new_file_mode() -> int:
    """The mode open() gives a new file: 0666 & ~umask (os.umask returns the mask only by
    replacing it, so it is put back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


STAGING_TAG = ".jax_mila_convert."  # staging folder: .<dst name>.jax_mila_convert.<pid>
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")
_OLD_PARTIAL_SHARD = re.compile(r"\.jax_mila_shard_\d{5}\.safetensors$")  # older converts, in dst


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_leftovers(folder: str, prefix: str) -> None:
    """Removes staging folders ``prefix<pid>`` in ``folder`` whose process is gone (or is this
    one: a convert of this process to the same place is not running, it failed)."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder):
            pid = entry[len(prefix):]
            if entry.startswith(prefix) and pid.isdigit() and (
                    int(pid) == os.getpid() or not _alive(int(pid))):
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _staging_dir(dst: str) -> str:
    """A new, empty staging folder for ``dst`` on its file system (see the module docstring),
    after removing what killed converts to ``dst`` left."""
    parent, name = os.path.split(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    prefix = f".{name}{STAGING_TAG}"
    _remove_leftovers(parent, prefix)
    if os.path.isdir(dst):
        _remove_leftovers(dst, STAGING_TAG)
        for entry in os.listdir(dst):
            if _OLD_PARTIAL_SHARD.match(entry):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(dst, entry))
    try:
        path = os.path.join(parent, f"{prefix}{os.getpid()}")
        os.mkdir(path)
    except PermissionError:
        if not os.path.isdir(dst):
            raise
        path = os.path.join(dst, f"{STAGING_TAG}{os.getpid()}")
        os.mkdir(path)
    return path


def _entry_files_in(dst: str) -> list[str]:
    return [f for f in (loader.SINGLE_FILE, loader.INDEX_FILE) if os.path.exists(os.path.join(dst, f))]


def _commit(staging: str, dst: str) -> None:
    """Makes the staging folder's files ``dst``'s: one rename when ``dst`` does not exist (or
    is empty), else one move per file, the weights' entry file last."""
    if os.path.dirname(staging) != os.path.abspath(dst):  # staging beside dst, not in it
        with contextlib.suppress(OSError):
            os.rename(staging, dst)  # fails when dst exists and is not empty
            return
    os.makedirs(dst, exist_ok=True)
    if _entry_files_in(dst):  # another convert to dst finished meanwhile
        raise CheckpointError(f"{dst} already holds {_entry_files_in(dst)[0]}; refusing to "
                              "overwrite it")
    names = sorted(os.listdir(staging), key=lambda n: (n in (loader.SINGLE_FILE, loader.INDEX_FILE), n))
    for entry in os.listdir(dst):  # shards of a convert killed while moving its files in
        if _SHARD_NAME.match(entry) and entry not in names:
            os.remove(os.path.join(dst, entry))
    for n in names:
        shutil.move(os.path.join(staging, n), os.path.join(dst, n))
    os.rmdir(staging)


class _ShardWriter:
    """Collects tensors and writes a shard whenever ~shard_bytes are pending."""

    def __init__(self, dst: str, shard_bytes: int):
        self.dst, self.shard_bytes = dst, shard_bytes
        self.mode = _new_file_mode()
        self.pending, self.pending_bytes, self.shards = {}, 0, []  # shards: [(tmp file, names)]
        self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        tmp = os.path.join(self.dst, f".jax_mila_shard_{len(self.shards):05d}.safetensors")
        metadata = {"format": "pt"}
        if any(mxfp4_names.is_mxfp4_tensor(name) for name in self.pending):
            metadata[mxfp4_names.METADATA_KEY] = str(FORMAT_VERSION)
        save_file(self.pending, tmp, metadata=metadata)
        # safetensors writes through a private temporary file (mode 0600); give the shard the
        # mode of the config and tokenizer files written beside it.
        os.chmod(tmp, self.mode)
        self.shards.append((tmp, sorted(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Renames the shards to their final names (and writes the index if several); returns
        the shards' file names."""
        self.flush()
        if len(self.shards) == 1:
            os.replace(self.shards[0][0], os.path.join(self.dst, loader.SINGLE_FILE))
            return [loader.SINGLE_FILE]
        n, weight_map, files = len(self.shards), {}, []
        for i, (tmp, names) in enumerate(self.shards):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.dst, file))
            weight_map.update({name: file for name in names})
            files.append(file)
        with open(os.path.join(self.dst, loader.INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return files


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, quantize="w4a8",
            shard_bytes: int = SHARD_BYTES, progress: bool = True) -> dict:
    """Writes the text decoder of checkpoint ``src`` to ``dst`` with ``quantize``'s weight
    format (None: dense, as stored). Returns a summary dict (tensor counts and bytes).
    Raises CheckpointError (a ValueError) for bad paths or checkpoints."""
    nn.check_quantize(quantize)
    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise CheckpointError(f"{src}: not a checkpoint directory (no config.json)")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"--out {dst}: not a directory (--out is the directory to write the "
                              "checkpoint to; it is created if missing)")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise CheckpointError(f"--out {dst} is the source checkpoint; choose another directory")
    for existing in (loader.SINGLE_FILE, loader.INDEX_FILE):
        if os.path.exists(os.path.join(dst, existing)):
            raise CheckpointError(f"{dst} already holds {existing}; refusing to overwrite it")
    try:
        stored = mxfp4_names.checkpoint_format(src)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if stored is not None:
        raise CheckpointError(f"{src} is already converted ({mxfp4_names.CONFIG_KEY}={stored})")
    cfg = Gemma4Config.from_pretrained(src)
    files = loader._tensor_files(src)
    prefix = loader.find_prefix(src, files)
    model = nnx.eval_shape(lambda: Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16, quantize=quantize,
                                                     rngs=nnx.Rngs(0)))
    plan = _plan(model, prefix)
    del model

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if quantize == "w4a8":
        config[mxfp4_names.CONFIG_KEY] = dict(mxfp4_names.FORMAT)

    staging = _staging_dir(dst)
    summary = {"tensors": 0, "quantized": 0, "dense_bytes_of_quantized": 0, "mxfp4_bytes": 0}
    bar = _progress(len(plan), progress)
    try:
        writer = _ShardWriter(staging, shard_bytes)
        with contextlib.ExitStack() as stack:
            reader = loader._Reader(src, files, stack)
            for name, shape, quantized in plan:
                bar.set_postfix_str(name[len(prefix):] if name.startswith(prefix) else name, refresh=False)
                if quantized:
                    dense = reader.read(name, shape)
                    summary["dense_bytes_of_quantized"] += dense.nbytes
                    try:  # the same call as the loader's quantize-on-load: identical bits
                        w = quantize_mxfp4(dense, name=name)
                    except ValueError as e:  # NaN / inf
                        raise CheckpointError(f"{src}: {e}") from None
                    del dense
                    for field, tname in mxfp4_names.tensor_names(name).items():
                        t = getattr(w, field)
                        writer.add(tname, t)
                        summary["mxfp4_bytes"] += t.nbytes
                    summary["quantized"] += 1
                else:
                    tensor = reader.read(name, shape)
                    loader.check_finite(src, name, tensor)  # the loader would refuse it
                    writer.add(name, tensor)
                summary["tensors"] += 1
                bar.update(1)
        out_files = writer.finish()
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for extra in EXTRA_FILES:
            if os.path.isfile(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), os.path.join(staging, extra))
        _commit(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()
    summary["files"] = [os.path.join(dst, f) for f in out_files]
    summary["bytes_written"] = int(sum(os.path.getsize(f) for f in summary["files"]))
    return summary


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tensor", desc="convert", disable=not enabled)
