"""Session-wide test setup."""

import jax

# Several CPU devices so that sharding tests (tests/test_parallel_*.py) run in CI without GPUs.
# Must happen before any backend is initialized; other tests use the default device only.
jax.config.update("jax_num_cpu_devices", 4)
