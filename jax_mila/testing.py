"""Helpers for jax_mila's test suites (absltest cases run with pytest).

Kept in the package so GPU suites, benchmarks and users' own tests share one definition of
"poisoned output", "CUDA present" and the error measures.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def cuda_devices() -> tuple:
    try:
        return tuple(jax.devices("cuda"))
    except RuntimeError:
        return ()


def has_cuda() -> bool:
    return bool(cuda_devices())


def skip_unless_kernel(testcase, op: str, target: str | None = None) -> None:
    """Skips `testcase` (in setUp) unless a CUDA device is present and `op`'s kernel is built."""
    from jax_mila import ffi

    if not has_cuda():
        testcase.skipTest("no CUDA device")
    st = ffi.status(op, target)
    if not st.kernel:
        testcase.skipTest(f"{op} kernel not available: {st.reason}")


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the first CUDA device."""
    from jax_mila.ffi._registry import cuda_capabilities

    return cuda_capabilities()[0]


def poison_like(struct: jax.ShapeDtypeStruct):
    """An array of `struct`'s shape filled with NaN (floating types) or 0x5A bytes."""
    dtype = np.dtype(struct.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.full(struct.shape, jnp.nan, dtype)
    return jnp.full(struct.shape, 0x5A, dtype)


def call_with_poisoned_outputs(fn, *args):
    """Runs `fn(*args)` under jit with every output buffer pre-filled with poison.

    The poisoned arrays are donated and XLA aliases each donated buffer to the output of the
    same shape and dtype, so an element the kernel forgets to write keeps its poison (NaN for
    floating outputs). Asserts that the output really reuses the poisoned memory; returns the
    outputs.
    """
    out_structs = jax.eval_shape(fn, *args)
    leaves, treedef = jax.tree.flatten(out_structs)
    poisons = [poison_like(s) for s in leaves]
    ptrs = [p.unsafe_buffer_pointer() for p in poisons]

    def run(poisons, *args):
        del poisons  # donated only so XLA can place the outputs in their memory
        return fn(*args)

    # keep_unused: `poisons` is unused in the body, and jit would otherwise drop it before
    # XLA sees it, so nothing would be donated (the reuse check below then always fails).
    out = jax.jit(run, donate_argnums=0, keep_unused=True)(poisons, *args)
    out_leaves = jax.tree.leaves(out)
    for i, (o, p) in enumerate(zip(out_leaves, ptrs)):
        if o.unsafe_buffer_pointer() != p:
            raise AssertionError(f"output {i} did not reuse its poisoned buffer; "
                                 "the poison check would prove nothing")
    return jax.tree.unflatten(treedef, out_leaves)


def attention_target_call(target: str, q, k, v, q_offset, kv_offset, *, scale, causal, window):
    """(o, lse) of one flash-attention FFI target called directly, past the routing of
    jax_mila.ffi.flash_attention: so that tests can hold two kernels against each other
    (``window`` 0: none)."""
    b, t, hq, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
           jax.ShapeDtypeStruct((b, hq, t), jnp.float32))
    return jax.ffi.ffi_call(target, out)(q, k, v, jnp.int32(q_offset), jnp.int32(kv_offset),
                                         scale=np.float32(scale), causal=bool(causal),
                                         window=np.int64(window))


def e4m3_steps(q, q_ref) -> np.ndarray:
    """|q - q_ref| of two float8_e4m3fn arrays in units of q_ref's local e4m3 spacing (2^-3 of
    the value, 2^-9 among the subnormals)."""
    a = np.asarray(q, np.float32)
    b = np.asarray(q_ref, np.float32)
    return np.abs(a - b) / np.maximum(np.abs(b) * 2.0**-3, 2.0**-9)


def quantization_mismatch(q, scale, q_ref, scale_ref, *, code_fraction: float = 0.0,
                          row_fraction: float = 0.0) -> str | None:
    """Why two row quantizations (q [..., K] float8_e4m3fn, scale [...] float32) of nearly the
    same rows disagree more than allowed, or None.

    Rows whose inputs differ in a few elements by one bf16 step (quantize_geglu's kernel and
    reference: their tanh differs) quantize to codes that differ by one e4m3 step in rare
    places, and, where the row's largest element moved, to a scale one bf16 step away. Allowed:
    every code within one e4m3 step; at most ceil(row_fraction * rows) rows with a different
    scale, each within 2^-7 relative (one bf16 step of the row's amax); on the rows with equal
    scales, at most ceil(code_fraction * their codes) codes different. Both fractions 0 (the
    default) ask for bit equality."""
    s = np.asarray(scale, np.float32).reshape(-1)
    s_ref = np.asarray(scale_ref, np.float32).reshape(-1)
    qf = np.asarray(q, np.float32).reshape(s.size, -1)
    qf_ref = np.asarray(q_ref, np.float32).reshape(s.size, -1)
    if not np.all(np.isfinite(qf)) or not np.all(np.isfinite(s)):
        return "NaN/inf in the result"
    steps = e4m3_steps(qf, qf_ref)
    if steps.max() > 1.0:
        r, c = np.unravel_index(int(np.argmax(steps)), steps.shape)
        return (f"code [{r}, {c}] is {qf[r, c]} against {qf_ref[r, c]} "
                f"({steps[r, c]:.1f} e4m3 steps)")
    off = s != s_ref
    if off.sum() > np.ceil(row_fraction * s.size):
        return f"{int(off.sum())} of {s.size} rows have another scale (first: row {np.argmax(off)})"
    rel = np.abs(s[off] / s_ref[off] - 1.0) if off.any() else np.zeros(0)
    if rel.size and rel.max() > 2.0**-7:
        return f"a scale is {rel.max():.2e} relative from the reference (more than one bf16 step)"
    differ = int(np.sum(qf[~off] != qf_ref[~off]))
    allowed = int(np.ceil(code_fraction * qf[~off].size))
    if differ > allowed:
        return (f"{differ} of {qf[~off].size} codes differ by one e4m3 step "
                f"(at most {allowed} allowed)")
    return None


def max_abs_err(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def rel_fro_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
