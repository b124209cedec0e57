"""Helpers of the test suites: the CUDA device probes, a direct call of one flash-attention FFI
target, and loading a script of scripts/ or benchmarks/ by its path.

The error bounds and the poisoned-output runner live in the package
(jax_mila.reference.bounds: the op docstrings cite them, and the selftest and
scripts/sanitize_kernels.py use them); they are re-exported here so that a suite imports one
module, ``import testing`` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila.reference.bounds import (  # noqa: F401  (re-exported for the suites)
    GEGLU_TANH_ERROR,
    NORM_RSQRT_ULPS,
    add_rms_norm_h_interval,
    add_rms_norm_quantization_problem,
    call_with_poisoned_outputs,
    e4m3_steps,
    geglu_gelu_interval,
    geglu_h_interval,
    geglu_quantization_problem,
    max_abs_err,
    norm_rope_interval,
    norm_rope_problem,
    poison_like,
    rel_fro_err,
    rms_norm_interval,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def load_script(path: str):
    """The module of a program under the repository (e.g. "benchmarks/gemm.py"), loaded from
    its file: the scripts are run by path and are not packages, and they import nothing but
    installed modules, so loading one needs no change to sys.path."""
    full = os.path.join(REPO, path)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# XLA flags that put every fusion and custom call of a jitted program into CUDA graphs
# (command buffers), from one op on.
CUDA_GRAPH_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1")


def assert_child_ok_in_cuda_graphs(test, script: str, extra_xla_flags: str = "") -> None:
    """Runs ``script`` (Python source that prints "CHILD OK" at its end) in a fresh process
    whose XLA captures the custom calls into CUDA graphs (XLA reads its flags once per
    process), and fails ``test`` with the child's stderr unless it printed that."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), CUDA_GRAPH_XLA_FLAGS,
                                            extra_xla_flags) if f)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    test.assertIn("CHILD OK", res.stdout, res.stderr[-3000:])
