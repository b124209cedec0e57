"""Multi-device prefill through JAX sharding: context parallelism (ring attention over a `seq`
mesh axis, halo exchange for sliding windows)."""

from jax_mila.parallel.context import (halo_window_attention, ring_attention, zigzag_inverse,
                                       zigzag_order)

__all__ = ["halo_window_attention", "ring_attention", "zigzag_inverse", "zigzag_order"]
