"""Loads the CUDA extension lazily, registers its FFI targets once, and decides per op
whether a call goes to the kernel or to the pure-JAX reference.

Kill switch: ``JAX_MILA_DISABLE=all`` or a comma-separated list of op names (for example
``JAX_MILA_DISABLE=flash_attention,w4a8_matmul``) sends those ops to the reference path.
It is read when a function is traced, so already-compiled functions keep their choice.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Callable

import jax

from jax_mila import _env
from jax_mila._vma import vary_like

log = logging.getLogger("jax_mila")

DISABLE_ENV = "JAX_MILA_DISABLE"

# Public op name -> the FFI targets (names in the extension's registrations()) it needs.
OPS: dict[str, tuple[str, ...]] = {
    "quantize_activations": ("jax_mila_quantize_activations",),
    "quantize_geglu": ("jax_mila_quantize_geglu",),
    # With a branch (residual add, returns h) and without.
    "add_rms_norm_quantize": ("jax_mila_add_rms_norm_quantize", "jax_mila_rms_norm_quantize"),
    "rms_norm_rope": ("jax_mila_rms_norm_rope",),
    "flash_attention": ("jax_mila_flash_attention_d256", "jax_mila_flash_attention_d512",
                        # the last three: Hopper only
                        "jax_mila_flash_attention_d512_sm90",
                        "jax_mila_flash_attention_d512_sm90_rotary_keys",
                        "jax_mila_flash_attention_d256_sm90"),
    # The second: the GEMV of several weights in one launch (w4a8_matmul_many).
    "w4a8_matmul": ("jax_mila_w4a8_matmul", "jax_mila_w4a8_gemv"),
    "grouped_w4a8_matmul": ("jax_mila_grouped_w4a8_matmul",),
    "decode_attention": ("jax_mila_decode_attention",),
}


@dataclasses.dataclass(frozen=True)
class OpStatus:
    """Whether an op's CUDA kernel can be used in this process, and if not, why."""

    op: str
    kernel: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.op}: {'kernel' if self.kernel else 'reference only'} ({self.reason})"


@functools.cache
def _load_extension():
    """Returns (module, None) or (None, reason)."""
    try:
        module = importlib.import_module("jax_mila._jax_mila_cuda")
    except ImportError as e:
        return None, (
            "the CUDA extension is not built (installed without nvcc?); "
            f"see BUILD.md. Import error: {e}"
        )
    return module, None


@functools.cache
def _registered_targets() -> frozenset[str]:
    """Registers every target of the extension for platform CUDA, exactly once per process."""
    module, _ = _load_extension()
    if module is None:
        return frozenset()
    targets = module.registrations()
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return frozenset(targets)


def build_info() -> dict[str, str]:
    module, reason = _load_extension()
    return dict(module.build_info()) if module is not None else {"error": reason}


def disabled_ops() -> frozenset[str]:
    return _env.names(DISABLE_ENV, OPS, everything="all")


def status(op: str, target: str | None = None) -> OpStatus:
    """Whether `op` (or one of its targets, e.g. one head dim of flash_attention) can run on
    its CUDA kernel. Without `target`, an op counts as available when any target is."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {sorted(OPS)}")
    if target is not None and target not in OPS[op]:
        raise ValueError(f"{target!r} is not a target of {op} (targets: {OPS[op]})")
    if op in disabled_ops():
        return OpStatus(op, False, f"disabled by {DISABLE_ENV}")
    module, reason = _load_extension()
    if module is None:
        return OpStatus(op, False, reason)
    wanted = OPS[op] if target is None else (target,)
    built = [t for t in wanted if t in _registered_targets()]
    if not built:
        return OpStatus(op, False, f"this build has no kernel for it (kernel families built: "
                                   f"{module.build_info()['kernels']}; missing {list(wanted)})")
    return OpStatus(op, True, f"CUDA kernel{'s' if len(built) > 1 else ''} {built}, "
                              f"archs {module.build_info()['cuda_archs']}")


def available() -> dict[str, OpStatus]:
    """Per op: whether its CUDA kernel is available in this process, and why not."""
    return {op: status(op) for op in OPS}


# (op, reason) pairs already reported: each fallback is logged once per process, at trace
# time, not once per layer or per call.
_logged_fallbacks: set[tuple[str, str]] = set()


def log_fallback(op: str, reason: str, *, instead: str = "the pure-JAX reference") -> bool:
    """Says once per (op, reason) on the "jax_mila" logger that `op` does not run on its CUDA
    kernel here and why. WARNING in a process with CUDA devices (the kernels were expected),
    INFO otherwise (a CPU process always runs the reference). Returns whether it logged."""
    if (op, reason) in _logged_fallbacks:
        return False
    _logged_fallbacks.add((op, reason))
    level = logging.WARNING if cuda_capabilities() else logging.INFO
    log.log(level, "jax_mila.%s falls back to %s: %s", op, instead, reason)
    return True


def logged_fallbacks() -> list[tuple[str, str]]:
    """The (op, reason) fallbacks reported so far in this process."""
    return sorted(_logged_fallbacks)


def reset_fallback_log() -> None:
    """Forgets which fallbacks were reported (tests)."""
    _logged_fallbacks.clear()


NO_CUDA_DEVICE = "no CUDA device in this process (JAX runs on {platform})"


def _vary_like_inputs(kernel_fn: Callable) -> Callable:
    """ffi_call results carry no varying mesh axes, while the reference's results vary like
    its inputs; inside shard_map, lax.platform_dependent needs both branches to agree, so
    the kernel's results are marked varying over every axis its inputs vary over."""

    def call(*args):
        return jax.tree.map(lambda o: vary_like(o, args), kernel_fn(*args))

    return call


@functools.cache
def cuda_capabilities() -> tuple[tuple[int, int], ...]:
    """Compute capabilities (major, minor) of this process's CUDA devices."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return ()
    caps = []
    for d in devices:
        major, minor = str(getattr(d, "compute_capability", "0.0")).split(".")
        caps.append((int(major), int(minor)))
    return tuple(caps)


def dispatch(op: str, kernel_fn: Callable, reference_fn: Callable, *args,
             target: str | None = None,
             device_ok: Callable[[tuple[int, int]], bool] | None = None,
             device_requirement: str = ""):
    """Calls `kernel_fn(*args)` when lowering for CUDA and the kernel is usable,
    `reference_fn(*args)` otherwise (CPU, kernel not built, or disabled). `device_ok(cc)`
    says whether a GPU of compute capability `cc` can run the kernel (e.g. enough shared
    memory); when some device of the process cannot, the call uses the reference
    (`device_requirement` is the reason). Every fallback (no CUDA device, kernel not built or
    disabled, device too small) is logged once per (op, reason) when the call is traced."""
    caps = cuda_capabilities()
    if not caps:
        log_fallback(op, NO_CUDA_DEVICE.format(platform=jax.default_backend()))
        return reference_fn(*args)
    st = status(op, target)
    if not st.kernel:
        log_fallback(op, st.reason)
        return reference_fn(*args)
    if device_ok is not None and not all(device_ok(cc) for cc in caps):
        log_fallback(op, f"{device_requirement}; this process has GPUs of compute capability "
                         f"{sorted(set(caps))}")
        return reference_fn(*args)
    return jax.lax.platform_dependent(*args, cuda=_vary_like_inputs(kernel_fn),
                                      default=reference_fn)
