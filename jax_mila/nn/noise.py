"""One-ulp noise at the W4A8 activation quantizers: how far float32-level rounding differences
can move a quantized model.

Two runs of the same W4A8 model that differ only in float32 rounding (a kernel against the
reference, a sharded run against one device, an XLA-fused program against eager ops: summation
order, FMA contraction, another exp or tanh) reach the FP8 codes only through each quantizer's
bf16 input (nn.Linear rounds its activations to bf16 first; a bf16 model's are bf16 already).
There the difference is all or nothing per element: a value whose float32 form sat within that
noise of a bf16 rounding edge arrives one bf16 ulp off, every other value arrives bit-identical.
One in ~16 of the moved values then changes its e4m3 code by one step (bf16 keeps 7 mantissa
bits, e4m3 3), and that step moves everything after it, layer by layer.

``quantizer_noise(key, rate)`` makes exactly that perturbation on purpose, at a known rate:
while it is active (when a model is traced or run eagerly inside it), every element of every
W4A8 quantizer input moves by one bf16 ulp, up or down in magnitude at random, with
probability ``rate``; each quantizer call draws its own subset (``key`` folded with a per-call
counter). Comparing a model with itself under this noise measures its sensitivity to the kind
of difference a reordered float32 sum makes -- inside the layers, at every projection's input,
which perturbing the embedding does not reach: the bf16 rounding at the first quantizers
erases a float32-level change except where it crosses an edge, so o_proj's and down_proj's
inputs (after attention and the GeGLU) see none of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

# The probe's state while quantizer_noise is active: a context variable, since the probe wraps
# the tracing of a whole model rather than being passed to each projection.
_NOISE: contextvars.ContextVar = contextvars.ContextVar("jax_mila_quantizer_noise", default=None)
_BF16_MAX_FINITE_BITS = 0x7F7F  # the largest finite bf16 magnitude


@dataclasses.dataclass
class _Noise:
    key: jax.Array
    rate: float
    calls: int = 0  # quantizer calls so far (at trace time under jit): one subset per call


@contextlib.contextmanager
def quantizer_noise(key: jax.Array, rate: float):
    """Within this context, `perturb` moves a random ``rate`` fraction of its input's elements
    by one bf16 ulp (see the module docstring). Wrap the tracing (or eager run) of a model."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    token = _NOISE.set(_Noise(key, float(rate)))
    try:
        yield
    finally:
        _NOISE.reset(token)


def active() -> bool:
    return _NOISE.get() is not None


def one_ulp(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """bf16 ``x`` with each element, with probability ``rate``, one ulp larger or smaller in
    magnitude (signs at random), on the bit pattern: exact at powers of two and for zeros and
    subnormals, and never past the largest finite value."""
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"one_ulp takes bf16 (a quantizer's input), got {x.dtype}")
    pick, sign = jax.random.split(key)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
    step = jnp.where(jax.random.bernoulli(sign, 0.5, x.shape), 1, -1)
    step = jnp.where(jax.random.bernoulli(pick, rate, x.shape), step, 0)
    magnitude = jnp.clip((bits & 0x7FFF) + step, 0, _BF16_MAX_FINITE_BITS)
    return jax.lax.bitcast_convert_type((bits & 0x8000 | magnitude).astype(jnp.uint16),
                                        jnp.bfloat16)


def perturb(rows: jax.Array) -> jax.Array:
    """A W4A8 quantizer's bf16 input, perturbed inside `quantizer_noise` (else unchanged)."""
    noise = _NOISE.get()
    if noise is None:
        return rows
    key = jax.random.fold_in(noise.key, noise.calls)
    noise.calls += 1
    return one_ulp(rows, key, noise.rate)
