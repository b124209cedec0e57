"""Multi-device prefill through JAX sharding: tensor parallelism over a `heads` mesh axis
(jax_mila.parallel.tensor), context parallelism over a `seq` axis for the whole-sequence
forward (ring attention, halo exchange for sliding windows; jax_mila.parallel.context) and
inside the chunked prefill (a position-sharded KV cache; jax_mila.parallel.chunked)."""

from jax_mila.parallel.chunked import cache_in_position_order
from jax_mila.parallel.context import (halo_window_attention, ring_attention, zigzag_inverse,
                                       zigzag_order)
from jax_mila.parallel.context import context_parallel
from jax_mila.parallel.sharded import forward
from jax_mila.parallel.tensor import forward as tensor_parallel_forward
from jax_mila.parallel.tensor import param_specs, tensor_parallel

__all__ = ["cache_in_position_order", "context_parallel", "forward", "halo_window_attention", "param_specs",
           "ring_attention", "tensor_parallel", "tensor_parallel_forward", "zigzag_inverse",
           "zigzag_order"]
