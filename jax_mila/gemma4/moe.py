"""The mixture-of-experts branch of the 26B-A4B (``enable_moe_block``).

HF names (the Orbax names are swapped; only these matter for safetensors): the router reads
the post-attention residual r (not the normed MLP input):
    z = rmsnorm(r) * router.scale * H**-0.5;  probs = softmax(float32(z @ proj))
    top-k, renormalised over the k, times router.per_expert_scale[idx]
Experts: gate_up_proj holds gate rows first, then up rows; y_e = down(gelu(gate) * up).
The whole router runs in float32 (the softmax is float32 in transformers >= 5.24 and Google's
reference; the norm, scale and projection are float32 here too): in bf16 a near-tie in the
top-k flips an expert choice and moves that token's output by O(1), so routing from the most
accurate scores keeps bf16 closest to the float32 model.

Experts run as grouped matmuls (jax.lax.ragged_dot over assignments sorted by expert), so only
the selected experts' work is expressed; they are not nn.Linear modules (the 3-D expert
tensors are their own weight format).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import nn
from jax_mila.gemma4.mlp import gelu_tanh


class Gemma4Router(nnx.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, *, eps, backend, dtype,
                 param_dtype, quantize, rngs: nnx.Rngs):
        self.hidden, self.top_k, self.eps, self.dtype = hidden, top_k, eps, dtype
        # Always dense, also under quantize="w4a8": it is tiny (E x H) and FP8/MXFP4 rounding
        # of the routing scores would flip near-tied expert choices (see above).
        del quantize
        self.proj = nn.Linear(hidden, num_experts, backend=backend, dtype=jnp.float32,
                              param_dtype=param_dtype, quantize=None, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((hidden,), param_dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((num_experts,), param_dtype))

    def __call__(self, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        """r [N, H] -> (weights [N, k] float32, expert indices [N, k] int32)."""
        z = nn.rms_norm(r.astype(jnp.float32), None, self.eps)
        z = z * self.scale[...].astype(jnp.float32) * jnp.float32(self.hidden**-0.5)
        probs = jax.nn.softmax(self.proj(z), axis=-1)
        weights, idx = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * self.per_expert_scale[...].astype(jnp.float32)[idx], idx


class Gemma4Experts(nnx.Module):
    """gate_up_proj [E, H, 2I] and down_proj [E, I, H] (Flax layout: HF's, transposed)."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, *, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.intermediate, self.dtype = intermediate, dtype
        init = jax.nn.initializers.normal(stddev=hidden**-0.5)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, 2 * intermediate), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, intermediate, hidden), param_dtype))

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """x [N, H]; weights, idx [N, k] -> sum_k weights * expert_idx(x), [N, H] in x.dtype."""
        n, k = idx.shape
        num_experts = self.gate_up_proj.shape[0]
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        xs = x[token].astype(self.dtype)
        gu = jax.lax.ragged_dot(xs, self.gate_up_proj[...].astype(self.dtype), sizes,
                                preferred_element_type=jnp.float32).astype(self.dtype)
        h = gelu_tanh(gu[:, : self.intermediate]) * gu[:, self.intermediate:]
        y = jax.lax.ragged_dot(h, self.down_proj[...].astype(self.dtype), sizes,
                               preferred_element_type=jnp.float32).astype(self.dtype)
        y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)
