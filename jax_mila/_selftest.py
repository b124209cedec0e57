"""jax_mila.selftest(): runs each op once on the default device against its reference.

Per op it reports OK (kernel matches the reference), MISMATCH (with the error), or
REFERENCE ONLY / NOT AVAILABLE (with why). Inputs are fresh random values each run.

``gpu_install_hint()`` tells a machine with an NVIDIA GPU that jax does not use (a CPU-only
jax, above all) what to run; the selftest and the CLI print it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
from typing import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi, reference
from jax_mila.reference import bounds


@dataclasses.dataclass
class SelftestResult:
    op: str
    outcome: str  # "OK", "MISMATCH", "REFERENCE ONLY", "NOT AVAILABLE", "ERROR"
    detail: str

    def __str__(self) -> str:
        return f"{self.op:22s} {self.outcome:15s} {self.detail}"


# Signs of an NVIDIA driver on this machine, whether or not jax can use it.
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidia0")
# The CUDA major version of the kernels when the extension does not say (BUILD.md: tested 13.0).
DEFAULT_CUDA_MAJOR = 13
FIRST_JAX_WITH_CUDA13 = (0, 7, 2)  # the first jax with a "cuda13" extra


def nvidia_gpu_evidence() -> str | None:
    """What shows an NVIDIA GPU on this machine (a driver file, or nvidia-smi on PATH), or None."""
    for path in NVIDIA_DRIVER_FILES:
        if os.path.exists(path):
            return path
    smi = shutil.which("nvidia-smi")
    return f"{smi} on PATH" if smi else None


def _jax_gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend, or it failed to start
        return []


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_major() -> int:
    """The CUDA major version the kernels were built with (the extension's build_info), else
    DEFAULT_CUDA_MAJOR."""
    from jax_mila.ffi import _registry

    version = _registry.build_info().get("cuda_version", "")
    major = version.split(".")[0]
    return int(major) if major.isdigit() else DEFAULT_CUDA_MAJOR


def gpu_install_hint() -> str | None:
    """None, unless this machine has an NVIDIA GPU (nvidia_gpu_evidence) and jax sees no GPU;
    then why, and the command that fixes it."""
    evidence = nvidia_gpu_evidence()
    if evidence is None or _jax_gpus():
        return None
    head = (f"an NVIDIA GPU is present ({evidence}) but jax {jax.__version__} sees none, so "
            "every op runs its CPU reference")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
        return f"{head}: JAX_PLATFORMS={platforms!r} excludes it. Fix: unset JAX_PLATFORMS"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"{head}: CUDA_VISIBLE_DEVICES={visible!r} hides every GPU. Fix: unset CUDA_VISIBLE_DEVICES"
    major = _cuda_major()
    jax_version = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
    # The same jax version keeps the FFI the extension was compiled against.
    if major == 13 and jax_version < FIRST_JAX_WITH_CUDA13:
        fix = (f'python3 -m pip install -U "jax[cuda13]", then rebuild jax_mila against it '
               "(python3 -m pip install --no-build-isolation --no-deps .)")
    else:
        fix = f'python3 -m pip install "jax[cuda{major}]=={jax.__version__}"'
    plugins = {d: v for d in ("jax-cuda13-plugin", "jax-cuda12-plugin") if (v := _version(d))}
    if not plugins:
        return (f"{head}: no jax CUDA plugin is installed (a CPU-only jax). Fix: {fix} "
                f"(CUDA {major}, as the kernels are built; or pip install '.[cuda]' from the "
                "source tree)")
    installed = ", ".join(f"{d} {v}" for d, v in plugins.items())
    jaxlib = _version("jaxlib")
    if any(v != jaxlib for v in plugins.values()):
        return f"{head}: {installed} does not match jaxlib {jaxlib}. Fix: {fix}"
    return (f"{head}: {installed} is installed but its backend did not start (jax's warning "
            f"above says why; most often a driver older than CUDA {major}: nvidia-smi shows "
            f"the CUDA version the driver supports). Fix: update the NVIDIA driver, or {fix}")


def _fresh_key():
    return jax.random.key(int.from_bytes(os.urandom(4), "little"))


def _check_quantize() -> str | None:
    x = jax.random.normal(_fresh_key(), (97, 2816), jnp.float32) * 3
    x = x.at[5].set(0).astype(jnp.bfloat16)  # one all-zero row
    q, s = jax.jit(ffi.quantize_activations)(x)
    q_ref, s_ref = reference.quantize_activations(x)
    step = np.abs(np.asarray(q, np.float32) - np.asarray(q_ref, np.float32))
    ulp = np.maximum(np.abs(np.asarray(q_ref, np.float32)) * 2.0**-3, 2.0**-9)
    if not np.array_equal(np.asarray(s), np.asarray(s_ref)):
        return f"scales differ (max {np.max(np.abs(np.asarray(s) - np.asarray(s_ref))):.3g})"
    if np.any(step > ulp):
        return f"values differ by more than one e4m3 step at {int(np.sum(step > ulp))} elements"
    return None


def _check_quantize_geglu() -> str | None:
    k1, k2 = jax.random.split(_fresh_key())
    gate = (jax.random.normal(k1, (97, 2816), jnp.float32) * 2).at[5].set(0).astype(jnp.bfloat16)
    up = jax.random.normal(k2, (97, 2816), jnp.float32).astype(jnp.bfloat16)
    q, s = jax.jit(ffi.quantize_geglu)(gate, up)
    # Against the interval oracle (every code and scale admissible), not against the reference:
    # the kernel's tanh and XLA's differ within the oracle's bound.
    return bounds.geglu_quantization_problem(gate, up, q, s)


def _check_add_rms_norm_quantize() -> str | None:
    k1, k2, k3 = jax.random.split(_fresh_key(), 3)
    x = (jax.random.normal(k1, (97, 2816), jnp.float32) * 3).astype(jnp.bfloat16)
    branch = jax.random.normal(k2, (97, 2816), jnp.float32).at[5].set(0).astype(jnp.bfloat16)
    wb, wn = jax.random.uniform(k3, (2, 2816), jnp.float32, -1.0, 3.0)
    kw = dict(branch_weight=wb.astype(jnp.bfloat16), norm_weight=wn, eps=1e-6)
    got = jax.jit(lambda x, b: ffi.add_rms_norm_quantize(x, b, **kw))(x, branch)
    # Against the interval oracle, like quantize_geglu: the kernel's sums of squares run in
    # another order than XLA's.
    problem = bounds.add_rms_norm_quantization_problem(x, branch, got, **kw)
    if problem is None:
        got = jax.jit(lambda x: ffi.add_rms_norm_quantize(x, norm_weight=wn, eps=1e-6))(x)
        problem = bounds.add_rms_norm_quantization_problem(x, None, got, **kw)
    return problem


def _check_rms_norm_rope() -> str | None:
    for shape in ((97, 16, 256), (2, 33, 3, 512)):
        k1, k2, k3 = jax.random.split(_fresh_key(), 3)
        x = (jax.random.normal(k1, shape, jnp.float32) * 3).astype(jnp.bfloat16)
        x = x.reshape(-1, shape[-1]).at[5].set(0).reshape(shape)  # one all-zero row
        w = 1 + 0.5 * jax.random.normal(k2, (shape[-1],), jnp.float32)
        cos, sin = jax.random.uniform(k3, (2,) + shape[-3:-2] + shape[-1:], jnp.float32, -1, 1)
        cos, sin = cos.astype(jnp.bfloat16), sin.astype(jnp.bfloat16)
        got = jax.jit(lambda *a: ffi.rms_norm_rope(*a, eps=1e-6))(x, w, cos, sin)
        # Against the interval oracle: the kernel's sums of squares run in another order.
        problem = bounds.norm_rope_problem(x, w, cos, sin, got, eps=1e-6)
        if problem is not None:
            return f"{list(shape)}: {problem}"
    return None


def _attention_case(d: int, target: str) -> Callable[[], str | None]:
    """D=``d`` through ffi.flash_attention with its routing pinned to ``target`` (a Hopper
    kernel or the portable one: jax_mila/ffi/attention.py)."""
    from jax_mila.ffi import attention

    portable = f"jax_mila_flash_attention_d{d}"
    # The portable kernel: the Hopper target unmapped (attention._SM90_TARGETS).
    pin = {d: None} if target == portable else {}
    # The rotary-keys instance: scores from k's rotated columns and v's others.
    rotary = target == attention.D512_SM90_ROTARY_KEYS_TARGET
    r = attention.D512_SM90_ROTARY_PAIRS if rotary else None

    def check() -> str | None:
        k1, k2, k3 = jax.random.split(_fresh_key(), 3)
        q = jax.random.normal(k1, (1, 97, 4, d), jnp.bfloat16)
        k = jax.random.normal(k2, (1, 130, 2, d), jnp.bfloat16)
        v = jax.random.normal(k3, (1, 130, 2, d), jnp.bfloat16)
        kw = dict(scale=d**-0.5, causal=True, window=64, q_offset=33, kv_offset=0,
                  rotary_keys_only=r)
        # The route is chosen when the call is traced.
        with mock.patch.dict(attention._SM90_TARGETS, pin):
            routed = attention._route(q, k, v, r)[0]
            if routed != target:
                return f"ffi.flash_attention routes this call to {routed}, not {target}"
            o = jax.jit(lambda q, k, v: ffi.flash_attention(q, k, v, **kw))(q, k, v)
        o_ref = reference.flash_attention(q, k, v, **kw)
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32))))
        return None if err <= 2e-2 else f"max abs error {err:.3g} > 2e-2 ({target})"

    return check


def _attention_targets() -> list[tuple[int, str]]:
    """(head dim, target) of the attention kernels this process can run: the portable ones,
    and the Hopper ones when every GPU is compute capability 9.0."""
    from jax_mila.ffi import _registry, attention

    caps = _registry.cuda_capabilities()
    hopper = bool(caps) and all(cc == (9, 0) for cc in caps)
    return [(d, t) for d in (256, 512)
            for t in (f"jax_mila_flash_attention_d{d}",)
            + ((attention._SM90_TARGETS[d],) if hopper else ())
            + ((attention.D512_SM90_ROTARY_KEYS_TARGET,) if hopper and d == 512 else ())]


def _check_w4a8() -> str | None:
    """97 rows (the GEMM "auto" runs there) and 3 rows (the decode GEMV)."""
    from jax_mila import quant
    from jax_mila.ffi import w4a8 as w4a8_module

    k1, k2 = jax.random.split(_fresh_key())
    w = quant.quantize_mxfp4(jax.random.normal(k2, (136, 256), jnp.float32))
    for rows in (97, 3):
        x = jax.random.normal(jax.random.fold_in(k1, rows), (rows, 256),
                              jnp.float32).astype(jnp.bfloat16)
        xq, xs = reference.quantize_activations(x)
        y = jax.jit(lambda a, b, c: ffi.w4a8_matmul(a, b, c, out_dtype=jnp.float32))(xq, xs, w)
        y_ref = reference.w4a8_matmul(xq, xs, w, out_dtype=jnp.float32)
        err = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
        # The Hopper (wgmma) kernels accumulate FP8 at reduced precision (jax_mila/ffi/w4a8.py).
        kernel = w4a8_module.auto_kernel(rows)
        tol = 1e-5 if kernel in ("mma_sync", "gemv") else 4e-4
        if err > tol:
            return f"{kernel} ({rows} rows): relative Frobenius error {err:.3g} > {tol:g}"
    return None


def _check_decode_attention() -> str | None:
    """A global-layer call (D=512, FP8 cache, rotary_keys_only=64, rows of different lengths)
    and a sliding-layer ring read past its wrap (D=256, bf16, window 8)."""
    cases = ((512, (2, 2, 16, 1, 97), (97, 5), dict(rotary_keys_only=64), jnp.float8_e4m3fn),
             (256, (3, 2, 4, 2, 9), (9, 40, 1), dict(window=8, ring=True), jnp.bfloat16))
    for d, (b, t, hq, hkv, s), lens, kw, dtype in cases:
        k1, k2, k3 = jax.random.split(_fresh_key(), 3)
        q = jax.random.normal(k1, (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(k2, (b, s, hkv, d), jnp.float32).astype(dtype)
        v = jax.random.normal(k3, (b, s, hkv, d), jnp.float32).astype(dtype)
        kv_len = jnp.asarray(lens, jnp.int32)
        o = jax.jit(lambda *a: ffi.decode_attention(*a, **kw))(q, k, v, kv_len)
        o_ref = reference.decode_attention(q, k, v, kv_len, **kw)
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32))))
        if not err <= 2.0**-6:
            return f"D={d} {kw}: max abs error {err:.3g} > 2^-6"
    return None


def _checks() -> dict[str, list[tuple[str | None, Callable[[], str | None]]]]:
    """op -> [(target or None, check)]; an op with several targets is checked per target."""
    return {
        "quantize_activations": [(None, _check_quantize)],
        "quantize_geglu": [(None, _check_quantize_geglu)],
        "add_rms_norm_quantize": [(None, _check_add_rms_norm_quantize)],
        "rms_norm_rope": [(None, _check_rms_norm_rope)],
        "flash_attention": [(t, _attention_case(d, t)) for d, t in _attention_targets()],
        "w4a8_matmul": [(None, _check_w4a8)],
        "decode_attention": [(None, _check_decode_attention)],
    }


def run(verbose: bool = True) -> list[SelftestResult]:
    platform = jax.default_backend()
    hint = gpu_install_hint() if platform != "gpu" else None
    results = []
    checks = _checks()
    for op in ffi.OPS:
        if platform != "gpu":
            why = ("though an NVIDIA GPU is present (see above)" if hint
                   else "kernels run on CUDA GPUs")
            results.append(SelftestResult(op, "REFERENCE ONLY",
                                          f"default device is {platform}; {why}"))
            continue
        for target, check in checks.get(op, []):
            name = op if target is None else f"{op}[{target.removeprefix(f'jax_mila_{op}_')}]"
            st = ffi.status(op, target)
            if not st.kernel:
                results.append(SelftestResult(name, "NOT AVAILABLE", st.reason))
                continue
            try:
                problem = check()
            except Exception as e:  # report, never crash the selftest
                results.append(SelftestResult(name, "ERROR", f"{type(e).__name__}: {e}"))
                continue
            results.append(SelftestResult(name, "OK" if problem is None else "MISMATCH",
                                          problem or st.reason))
        if op not in checks:
            results.append(SelftestResult(op, "NOT AVAILABLE", "no selftest case"))
    if verbose:
        if hint:
            print(f"jax_mila selftest: {hint}")
        print(f"jax_mila selftest on {jax.devices()[0]}:")
        for r in results:
            print("  " + str(r))
    return results
