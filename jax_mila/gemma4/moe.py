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

The experts run on the device end to end, with no host round trip and no shape that depends on
the routing: the T x k assignments are sorted by expert (a stable argsort), the expert group
sizes counted, the token rows gathered into that order, both expert projections run as grouped
matmuls over all experts at once (nn.GroupedLinear: one grouped_w4a8_matmul launch each under
W4A8, whose FP8 rows are quantized once per token and gathered, and whose GeGLU and FP8
requantization run as one quantize_geglu), and the rows are gathered back into token order and
summed over the k choices with their routing weights, in a fixed order (deterministic).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import nn
from jax_mila.gemma4.mlp import gelu_tanh
from jax_mila.nn import noise
from jax_mila.nn.linear import quantized_ops


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


def route(idx: jax.Array, num_experts: int):
    """Expert indices [N, k] -> (order [N k]: the assignments (t k + j) sorted by expert, stably;
    group_sizes int32 [E]; inverse [N k]: each assignment's position in that order)."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32),
                                                  unique_indices=True)
    return order, sizes, inverse


class Gemma4Experts(nnx.Module):
    """gate_up_proj [E, H -> 2I] and down_proj [E, I -> H] as nn.GroupedLinear (HF's
    experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I])."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, *, backend, dtype,
                 param_dtype, quantize, rngs: nnx.Rngs):
        self.intermediate, self.num_experts, self.dtype = intermediate, num_experts, dtype
        common = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, quantize=quantize,
                      rngs=rngs)
        self.gate_up_proj = nn.GroupedLinear(hidden, 2 * intermediate, num_experts, **common)
        self.down_proj = nn.GroupedLinear(intermediate, hidden, num_experts, **common)

    def takes_quantized_input(self) -> bool:
        """Whether __call__ may be given x already quantized (nn.QuantizedRows, e.g. from
        add_rms_norm_quantize) and compute what it computes from x: gate_up_proj W4A8 and no
        noise probe (which perturbs the projection's own quantizer input)."""
        return self.gate_up_proj.quantize == "w4a8" and not noise.active()

    def fuses_geglu(self) -> bool:
        """Whether the GeGLU and down_proj's quantizer run as one quantize_geglu: both
        projections W4A8 on one backend in a bfloat16 model (where the op's bf16 roundings are
        the model's; jax_mila/gemma4/mlp.py says why), and no noise probe."""
        up, down = self.gate_up_proj, self.down_proj
        return (up.quantize == down.quantize == "w4a8" and up.backend == down.backend
                and jnp.dtype(down.dtype) == jnp.dtype(jnp.bfloat16) and not noise.active())

    def __call__(self, x, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """x [N, H] (or its W4A8 quantization, nn.QuantizedRows, where takes_quantized_input());
        weights, idx [N, k] -> sum_k weights * expert_idx(x), [N, H] in the model dtype."""
        n, k = idx.shape
        order, sizes, inverse = route(idx, self.num_experts)
        token = order // k  # the token of each sorted row
        if isinstance(x, nn.QuantizedRows):
            gu = self.gate_up_proj.matmul_quantized(x.q[token], x.scale[token], sizes)
        elif self.gate_up_proj.quantize == "w4a8" and not noise.active():
            # Per-row quantization: quantizing each token once and gathering its FP8 row k times
            # gives the rows quantizing the gathered bf16 rows would.
            q, s = quantized_ops(self.gate_up_proj.backend).quantize_activations(
                x.astype(jnp.bfloat16))
            gu = self.gate_up_proj.matmul_quantized(q[token], s[token], sizes)
        else:
            gu = self.gate_up_proj(x[token], sizes)
        g, u = gu[:, : self.intermediate], gu[:, self.intermediate:]
        if self.fuses_geglu():
            hq, hs = quantized_ops(self.down_proj.backend).quantize_geglu(g, u)
            y = self.down_proj.matmul_quantized(hq, hs, sizes)
        else:
            y = self.down_proj(gelu_tanh(g) * u, sizes)
        # Back to token order (a gather, which XLA fuses into the sum), summed over the k
        # choices in float32 in a fixed order.
        y = y[inverse].reshape(n, k, -1).astype(jnp.float32)
        return jnp.sum(y * weights[..., None], axis=1).astype(self.dtype)
