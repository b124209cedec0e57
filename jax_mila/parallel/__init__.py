"""Sharding and collective primitives for running a model over a mesh; nothing here imports a
model or what runs one (jax_mila.engine builds the steps).

- Layout (jax_mila.parallel.layout): the mesh axes and split a step's layers are given.
- Tensor parallelism over a `heads` axis (jax_mila.parallel.tensor): weight specs, the
  all-reduce of row-parallel outputs.
- Context parallelism over a `seq` axis for a whole sequence (jax_mila.parallel.context: ring
  attention, a halo exchange for sliding windows, in zig-zag order) and inside the chunked
  prefill (jax_mila.parallel.chunked: the position-sharded KV cache's layout and attention).
"""

from jax_mila.parallel.chunked import cache_in_position_order
from jax_mila.parallel.context import (halo_window_attention, ring_attention, zigzag_inverse,
                                       zigzag_order)
from jax_mila.parallel.layout import SINGLE_DEVICE, Layout
from jax_mila.parallel.tensor import param_specs

__all__ = ["Layout", "SINGLE_DEVICE", "cache_in_position_order", "halo_window_attention",
           "param_specs", "ring_attention", "zigzag_inverse", "zigzag_order"]
