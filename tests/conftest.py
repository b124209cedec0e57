"""Session-wide test setup."""

import jax
import pytest

# Several CPU devices so that sharding tests (tests/test_parallel_*.py) run in CI without GPUs.
# Must happen before any backend is initialized; other tests use the default device only.
jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Each test module starts with JAX's compilation caches empty. The whole CPU suite (2026-12-01,
    jax 0.10, 4 CPU devices) segfaulted twice inside XLA's compiler at the same sharded chunk step
    of tests/test_parallel_chunked.py, which passes alone and after either of the test files
    added that day; the root cause is not found. Clearing the caches between modules also
    keeps one module's compiled programs from outliving it."""
    yield
    jax.clear_caches()
