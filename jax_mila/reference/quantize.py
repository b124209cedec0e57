"""Reference activation quantizer: bf16 rows -> float8_e4m3fn with one float32 scale per row.

Definition (the CUDA kernel computes exactly this, in the same float32 operations):
    amax  = max |x[r, :]|
    scale = amax * f32(1 / 448)              (1.0 for rows with amax < 2**-112)
    q     = e4m3_round_nearest_even(clip(x * (448 / amax), -448, 448))   (0 for those rows)
so that q * scale ~= x. The scale is a multiplication by the float32 constant 1/448, not a
division, because XLA rewrites division by a constant that way and the kernel must agree bit
for bit. Rows below 2**-112 count as zero rows because 448 / amax would
overflow float32; their values dequantize to exact zeros, never NaN or inf. Inputs are
expected to be finite.

quantize_geglu(gate, up) is quantize_activations of a Gemma MLP's down-projection input,
    h = bf16(bf16(gelu_tanh(gate)) * up),
    gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   in float32 (HF's
                                                                      gelu_pytorch_tanh)
which is what a bf16 model's gelu_tanh(g) * u computes (jax_mila/gemma4/mlp.py): the product
of two bf16 values is exact in float32, so multiplying there and rounding once is the bf16
multiply. The two bf16 roundings are lax.reduce_precision, not convert pairs: under jit on a
GPU, XLA (xla_allow_excess_precision, on by default) deletes f32 -> bf16 -> f32 convert chains
(SimplifyFPConversions), which would quietly skip both roundings. Implementations differ in
their float32 tanh (XLA's rational approximation, the kernel's exp2 form), which moves rare
elements of h by a bf16 step: jax_mila.reference.bounds.geglu_quantization_problem states what
is admissible and checks it element by element.

add_rms_norm_quantize(x, branch, branch_weight=, norm_weight=, eps=) is a Gemma 4 decoder layer's
norms around its W4A8 projections (jax_mila/gemma4/model.py), rms_norm being
jax_mila.nn.norm.rms_norm (float32, the weight itself as the multiplier, one rounding to bf16):
    h = x + rms_norm(branch, branch_weight)         the bf16 add, rounded once
                                                    (h + post_attention_layernorm(a))
    (q, scale) = quantize_activations(rms_norm(h, norm_weight))
                                                    (pre_feedforward_layernorm -> gate/up)
returning (h, q, scale); without a branch, (q, scale) of rms_norm(x, norm_weight)
(input_layernorm -> q/k/v). Unlike quantize_geglu's, this reference IS the layers' expression:
the same jnp operations as rms_norm, the bf16 add and nn.Linear's quantizer input (bf16 rows),
so that a model taking the op computes what it computed without it, bit for bit, under jit too. That matters
because XLA does not keep every bf16 rounding of that expression under jit: on the CPU (jax
0.10) it computes the second norm from h in float32, before its rounding (the bf16 add becomes
a float32 add whose bf16 result only the returned h gets), in the model as in this function.
Evaluated op by op (eagerly) every rounding is kept, and that is the op's definition, which the
kernel computes (PyTorch's bf16 model rounds h too): h rounded to bf16 before the second norm.
A kernel also sums the squares in its own order and takes its own rsqrt, which moves rare
elements by a bf16 step: jax_mila.reference.bounds.add_rms_norm_quantization_problem states what
is admissible under the definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mila.reference.norm import rms_norm

E4M3_MAX = 448.0
INV_E4M3_MAX = 1.0 / 448.0  # rounded to float32 where used
QUANT_MIN_AMAX = 2.0**-112


def quantize_activations(x, *, amax=None):
    """x: [..., K] -> (q float8_e4m3fn [..., K], scale float32 [...]).

    ``amax`` [...] overrides the rows' own max |x|: a slice of a row (tensor parallelism) then
    quantizes exactly as the whole row would (jax_mila/nn/linear.py)."""
    x32 = x.astype(jnp.float32)
    if amax is None:
        amax = jnp.max(jnp.abs(x32), axis=-1)
    zero_row = amax < QUANT_MIN_AMAX
    safe_amax = jnp.where(zero_row, jnp.float32(1.0), amax)
    inv_scale = jnp.where(zero_row, jnp.float32(0.0), jnp.float32(E4M3_MAX) / safe_amax)
    scale = jnp.where(zero_row, jnp.float32(1.0), safe_amax * jnp.float32(INV_E4M3_MAX))
    q = jnp.clip(x32 * inv_scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def _round_to_bf16(x):
    """float32 x rounded to the nearest bf16 value (ties to even), kept in float32."""
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def _geglu_f32(gate, up):
    a = _round_to_bf16(jax.nn.gelu(gate.astype(jnp.float32), approximate=True))
    return _round_to_bf16(a * up.astype(jnp.float32))


def geglu(gate, up):
    """h = bf16(bf16(gelu_tanh(gate)) * up), gelu_tanh in float32; gate and up bf16 [..., K].

    jax.nn.gelu(approximate=True) is that formula in jnp ops, the same function the model's
    unfused gelu_tanh calls."""
    return _geglu_f32(gate, up).astype(jnp.bfloat16)


def quantize_geglu(gate, up):
    """gate, up: bf16 [..., K] -> quantize_activations(geglu(gate, up)).

    h stays float32 (holding bf16 values) into the quantizer: a bf16 -> f32 convert there would
    be one XLA may fold away under jit (see above)."""
    return quantize_activations(_geglu_f32(gate, up))


def add_rms_norm_quantize(x, branch=None, *, branch_weight=None, norm_weight, eps):
    """x, branch: bf16 [..., K]; branch_weight, norm_weight: [K] (any float dtype: rms_norm uses
    them in float32); eps: a Python float.

    With ``branch``: h = x + rms_norm(branch, branch_weight, eps) (bf16) and (q, scale) =
    quantize_activations(rms_norm(h, norm_weight, eps)); returns (h, q, scale). Without:
    (q, scale) of rms_norm(x, norm_weight, eps)."""
    h = x if branch is None else x + rms_norm(branch, branch_weight, eps)
    y = rms_norm(h, norm_weight, eps)
    # What nn.Linear's W4A8 path does with its input: bf16 (already), rows, the quantizer.
    q, scale = quantize_activations(y.astype(jnp.bfloat16).reshape(-1, y.shape[-1]))
    q, scale = q.reshape(y.shape), scale.reshape(y.shape[:-1])
    return (q, scale) if branch is None else (h, q, scale)


def dequantize_activations(q, scale, dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
