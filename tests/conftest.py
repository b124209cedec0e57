"""Session-wide test setup."""

import importlib.util
import os
import shutil
import sys
import tempfile

import jax
import pytest

# Several CPU devices so that sharding tests (tests/test_parallel_*.py) run in CI without GPUs.
# Must happen before any backend is initialized; other tests use the default device only.
jax.config.update("jax_num_cpu_devices", 4)


def _cuda_plugin_installed() -> bool:
    for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
        if importlib.util.find_spec(name) is not None:
            return True
    return False


# Without a GPU most of the suite's time is XLA:CPU compiling small programs, most of it in
# LLVM's optimizations of code that then runs for microseconds: the suite compiles at LLVM's
# optimization level 0, with the expensive passes off. What that changes: no floating-point
# contraction into FMAs, so the last bit of a result can differ from a default build's. The
# tests hold each path to a bound or to another path compiled the same way; with no program
# contracting, a bit-for-bit comparison of two programs checks their order of arithmetic alone.
# Set before any backend starts (XLA reads its flags once), inherited by the suite's
# subprocesses; a GPU installation keeps XLA's defaults; a flag XLA_FLAGS already names keeps
# its value.
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                     "--xla_llvm_disable_expensive_passes=true")
if not _cuda_plugin_installed():
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_flags] + [f for f in CPU_COMPILE_FLAGS if f.split("=")[0] not in _flags]).strip()


# One persistent XLA compilation cache for the session, shared by the worker processes (they
# inherit the variable from the controller, which loads this file first): the modules build
# the same small models and compile the same steps again after _fresh_jax_caches, and workers
# repeat what the other compiled. Off where a GPU is installed (compiles there depend on the
# device and the tests measure nothing of it) or when JAX_COMPILATION_CACHE_DIR is set.
_CACHE_ENV = "JAX_MILA_TEST_XLA_CACHE"
if (not _cuda_plugin_installed() and "JAX_COMPILATION_CACHE_DIR" not in os.environ
        and os.environ.get(_CACHE_ENV) != "off"):
    if _CACHE_ENV not in os.environ:
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jax_mila_tests_xla_")
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    cache = os.environ.get(_CACHE_ENV)
    if cache and cache != "off" and not hasattr(session.config, "workerinput"):
        shutil.rmtree(cache, ignore_errors=True)  # the controller, after every worker ended


def pytest_runtest_logreport(report):
    """JAX_MILA_TEST_INSTAFAIL=1 (scripts/gpu_round.sh sets it): each failure's traceback is
    written the moment the test fails, not only in pytest's summary at the end, which a run cut
    short by a time limit never prints."""
    if report.failed and os.environ.get("JAX_MILA_TEST_INSTAFAIL") == "1":
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; absent without it (-o addopts=-ra)
def pytest_xdist_auto_num_workers(config):
    """Workers of ``-n auto`` (pyproject.toml's addopts): one per core up to 4 on a machine
    without a GPU, where XLA:CPU compiles most of the suite's time away on one thread each;
    none (the tests in this process) where jax's CUDA plugin is installed, since each process
    would claim most of the GPU's memory for its allocator."""
    if _cuda_plugin_installed():
        return 0
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Each test module starts with JAX's compilation caches empty. The whole CPU suite (2026-12-01,
    jax 0.10, 4 CPU devices) segfaulted twice inside XLA's compiler at the same sharded chunk step
    of tests/test_parallel_chunked.py, which passes alone and after either of the test files
    added that day; the root cause is not found. Clearing the caches between modules also
    keeps one module's compiled programs from outliving it."""
    yield
    jax.clear_caches()
