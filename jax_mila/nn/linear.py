"""Linear: y = x @ kernel (+ bias, optional); dense (kernel [in, out], Flax layout) or W4A8.

Every projection of the model goes through this module, so the weight format is chosen here
and the model never changes with it:

- ``quantize=None``: a dense ``kernel`` nnx.Param [in_features, out_features] in param_dtype.
- ``quantize="w4a8"``: the weight is stored as MXFP4 (jax_mila.quant.mxfp4: 4.25 bits per
  value) in three uint8 :class:`MXFP4Param` variables ``packed`` [out, in/2], ``scales``
  [out, in/32] and ``channel_exp`` [out] -- [N=out, K=in], the orientation the format and the
  kernel use, i.e. the transpose of the dense kernel (and exactly a PyTorch/HF [out, in]
  weight), stored over in = padded_k(in_features) (a multiple of 128, zeros past
  in_features). The forward pass quantizes the activations per row to FP8 e4m3
  (quantize_activations) and runs w4a8_matmul (FP8 x MXFP4 on tensor cores, float32
  accumulation). Shapes the kernels cannot take (in_features % 32 or out_features % 8
  nonzero) stay dense, with one log line per shape on the "jax_mila" logger; the W4A8 ops
  themselves log (once per reason) when they run on the reference (no GPU, kernel not built,
  JAX_MILA_DISABLE, GPU below sm_89).

``use_bias=True`` adds an nnx.Param ``bias`` [out_features] (in param_dtype) to the float32
product before its one rounding to ``dtype``; without it the layer holds no ``bias`` attribute,
so bias-free models and checkpoints are as before. (Tensor parallelism splits bias-free layers
only.)

``MXFP4Param`` is its own nnx.Variable type (not nnx.Param), so optimizers and anything else
filtering on nnx.Param never see the integer codes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila import ffi, reference
from jax_mila.ffi._registry import log_fallback
from jax_mila.nn import noise
from jax_mila.nn.backend import check_backend
from jax_mila.quant.mxfp4 import GROUP, MXFP4Weight, padded_k, quantize_mxfp4

QUANTIZE_MODES = (None, "w4a8")
W4A8_K_MULTIPLE = ffi.w4a8.K_MULTIPLE  # 32: whole MXFP4 blocks
W4A8_N_MULTIPLE = ffi.w4a8.N_MULTIPLE  # 8
MXFP4_FIELDS = ("packed", "scales", "channel_exp")  # MXFP4Weight's fields, in order


class QuantizedRows(NamedTuple):
    """Activations already quantized per row for W4A8 projections: q float8_e4m3fn [..., K] and
    scale float32 [...], as quantize_activations (or add_rms_norm_quantize) returns them. Modules
    whose projections all read one activation take it in place of that activation when it was
    quantized outside them (jax_mila/gemma4/model.py); ``project`` feeds it to a projection."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The activation's shape [..., K]."""
        return tuple(self.q.shape)


def project(linear: "Linear", x):
    """``linear(x)``, or for QuantizedRows ``linear.matmul_quantized(q, scale)``: the same
    result where x's W4A8 quantization is the given one."""
    if isinstance(x, QuantizedRows):
        return linear.matmul_quantized(x.q, x.scale)
    return linear(x)


def project_many(linears, x) -> tuple:
    """``tuple(project(linear, x) for linear in linears)``: the projections of one activation.
    For QuantizedRows and W4A8 layers of one backend and output dtype, one
    ``w4a8_matmul_many``: in decode (at most 16 rows) the GEMV runs up to three weights in one
    launch."""
    linears = tuple(linears)
    if (isinstance(x, QuantizedRows) and len(linears) > 1 and shares_quantized_input(*linears)
            and len({lin.quantized_out_dtype() for lin in linears}) == 1):
        for lin in linears:
            lin.check_quantized_input(x.q, x.scale)
        q, scale = x
        ys = quantized_ops(linears[0].backend).w4a8_matmul_many(
            q.reshape(-1, q.shape[-1]), scale.reshape(-1), [lin.mxfp4 for lin in linears],
            out_dtype=linears[0].quantized_out_dtype())
        return tuple(lin.finish_quantized(y, q.shape[:-1]) for lin, y in zip(linears, ys))
    return tuple(project(lin, x) for lin in linears)


def shares_quantized_input(*linears: "Linear") -> bool:
    """Whether these projections of one activation may take it quantized once, outside them
    (QuantizedRows), and compute what they compute from the activation itself: every one W4A8
    (its input is quantized at all), all on one backend (by the same ops: quantized_ops), and no
    noise.quantizer_noise (the probe perturbs each projection's own quantizer input, in _w4a8;
    the fused norm + quantizer's reference is the unfused expression, so only the noise moves).
    Row-parallel projections (``row_parallel_axis``) quantize their rows themselves, so callers
    that split projections over a mesh keep them out.
    """
    return (all(lin.quantize == "w4a8" for lin in linears)
            and len({lin.backend for lin in linears}) == 1
            and not noise.active())


class MXFP4Param(nnx.Variable):
    """One uint8 array of an MXFP4 weight (packed codes, block exponents or channel exponents).

    Deliberately not an nnx.Param: the values are integer codes, not trainable parameters."""


def quantized_ops(backend: str):
    """The module whose quantizer and W4A8 matmul a layer of `backend` calls: the references
    for "reference", else jax_mila.ffi (kernels on GPU, references elsewhere)."""
    return reference if backend == "reference" else ffi


def check_quantize(quantize) -> None:
    """Raises ValueError for a quantization mode this build does not implement."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r} is not supported (supported: {QUANTIZE_MODES}; "
                         "'w4a8' = MXFP4 weights x FP8 activations)")


def w4a8_unsupported_reason(in_features: int, out_features: int) -> str | None:
    """Why the W4A8 kernels cannot take a [in_features -> out_features] projection, or None."""
    if in_features % W4A8_K_MULTIPLE:
        return f"in_features={in_features} is not a multiple of {W4A8_K_MULTIPLE}"
    if out_features % W4A8_N_MULTIPLE:
        return f"out_features={out_features} is not a multiple of {W4A8_N_MULTIPLE}"
    return None


def _log_fallback(in_features: int, out_features: int, reason: str, what: str = "Linear") -> None:
    # Once per shape (the reason names it), on a GPU as a warning (log_fallback).
    log_fallback(ffi.w4a8.OP, f"{what} {in_features} -> {out_features} stays dense ({reason}; "
                              f"the W4A8 kernel needs in % {W4A8_K_MULTIPLE} == 0 and out % "
                              f"{W4A8_N_MULTIPLE} == 0)", instead="a dense weight")


def w4a8_quantize_mode(quantize, in_features: int, out_features: int, what: str = "Linear"):
    """``quantize`` as a layer of this shape can hold it: "w4a8" falls back to None (dense,
    logged once per shape) where the W4A8 kernels cannot take the shape."""
    check_quantize(quantize)
    if quantize == "w4a8":
        reason = w4a8_unsupported_reason(in_features, out_features)
        if reason is not None:
            _log_fallback(in_features, out_features, reason, what)
            return None
    return quantize


def get_mxfp4(module: nnx.Module) -> MXFP4Weight:
    """The MXFP4 weight a module holds in its MXFP4Param variables."""
    return MXFP4Weight(*(getattr(module, f)[...] for f in MXFP4_FIELDS))


def set_mxfp4(module: nnx.Module, w: MXFP4Weight, shape: tuple[int, ...], what: str) -> None:
    """Stores ``w`` (stored shape ``shape``) in the module's MXFP4Param variables."""
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"MXFP4 weight of shape {list(w.shape)} does not fit {what} (expected "
                         f"{list(shape)})")
    w.validate("w", rank=len(shape))
    for field in MXFP4_FIELDS:
        value = getattr(w, field)
        if hasattr(module, field):
            getattr(module, field).set_value(value)
        else:
            setattr(module, field, MXFP4Param(value))


class Linear(nnx.Module):
    """Linear layer, bias-free unless ``use_bias=True``.

    Dense: ``kernel`` is [in_features, out_features] in ``param_dtype``; the product accumulates
    in float32 and is rounded once to ``dtype`` (like a bf16 PyTorch ``nn.Linear``), so bf16
    models round exactly once per projection.

    W4A8 (``quantize="w4a8"``, where the shape allows; ``self.quantize`` then reads "w4a8",
    else None): activations are cast to bf16 (the quantizer's input), quantized per row to
    FP8 and multiplied with the MXFP4 weight in float32, rounded once to ``dtype`` (bf16 or
    float32 straight from the kernel; other dtypes via float32).
    """

    def __init__(self, in_features: int, out_features: int, *, backend: str = "auto",
                 dtype=jnp.float32, param_dtype=jnp.float32, quantize=None,
                 use_bias: bool = False, rngs: nnx.Rngs | None = None):
        check_backend(backend)
        quantize = w4a8_quantize_mode(quantize, in_features, out_features)
        self.in_features, self.out_features = in_features, out_features
        self.backend, self.dtype, self.quantize = backend, dtype, quantize
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        init = jax.nn.initializers.normal(stddev=in_features**-0.5)
        if quantize is None:
            self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        else:
            # A random weight quantized like a checkpoint's; check_finite=False keeps this
            # traceable (nnx.eval_shape builds models abstractly before loading).
            w = quantize_mxfp4(init(rngs.params(), (out_features, in_features), jnp.float32),
                               check_finite=False)
            self.set_mxfp4(w)
        if use_bias:
            self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype))

    @property
    def use_bias(self) -> bool:
        return "bias" in vars(self)

    # ---- the MXFP4 weight -----------------------------------------------------------------

    @property
    def mxfp4(self) -> MXFP4Weight:
        """The quantized weight [out_features, padded_k(in_features)] (W4A8 layers only)."""
        if self.quantize != "w4a8":
            raise AttributeError(f"Linear {self.in_features} -> {self.out_features} is dense")
        return get_mxfp4(self)

    def set_mxfp4(self, w: MXFP4Weight) -> None:
        """Replaces the quantized weight (stored shape [out_features, padded_k(in_features)])."""
        set_mxfp4(self, w, (self.out_features, padded_k(self.in_features)),
                  f"Linear {self.in_features} -> {self.out_features}")

    @classmethod
    def quantize_from(cls, kernel, *, backend: str = "auto", dtype=jnp.float32,
                      param_dtype=jnp.float32, bias=None) -> "Linear":
        """A ``quantize="w4a8"`` Linear holding the MXFP4 quantization of a dense Flax kernel
        [in_features, out_features] (concrete; NaN/inf raise), and ``bias`` [out_features]
        (in param_dtype) if given. Shapes the kernel cannot take give a dense Linear holding
        ``kernel`` (with the fallback log line)."""
        in_features, out_features = kernel.shape
        if bias is not None and tuple(jnp.shape(bias)) != (out_features,):
            raise ValueError(f"Linear.quantize_from: bias of shape {list(jnp.shape(bias))} does "
                             f"not fit kernel {list(kernel.shape)} (expected [{out_features}])")
        layer = nnx.eval_shape(lambda: cls(in_features, out_features, backend=backend,
                                           dtype=dtype, param_dtype=param_dtype,
                                           quantize="w4a8", use_bias=bias is not None,
                                           rngs=nnx.Rngs(0)))
        if layer.quantize == "w4a8":
            layer.set_mxfp4(quantize_mxfp4(jnp.asarray(kernel).T, name="kernel"))
        else:
            layer.kernel.set_value(jnp.asarray(kernel, param_dtype))
        if bias is not None:
            layer.bias.set_value(jnp.asarray(bias, param_dtype))
        return layer

    # ---- forward --------------------------------------------------------------------------

    def __call__(self, x: jax.Array, *, row_parallel_axis: str | None = None) -> jax.Array:
        """x [..., in_features] -> [..., out_features]. ``row_parallel_axis``: the mesh axis
        this layer's input features (and weight rows) are split over inside jax.shard_map
        (row parallelism under tensor parallelism, jax_mila.parallel.tensor); x then holds this
        device's slice of each row and the result is its partial sum. W4A8 quantizes the slice
        by the whole row's amax (one pmax over the axis)."""
        if self.use_bias and row_parallel_axis is not None:
            raise ValueError(f"Linear {self.in_features} -> {self.out_features}: a bias on a "
                             "row-parallel layer is not supported (each device's partial sum "
                             "would add it)")
        if self.quantize == "w4a8":
            return self._w4a8(x, row_parallel_axis)
        x = x.astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)
        y = jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=jnp.float32)
        if self.use_bias:
            y = self._add_bias(y)
        return y.astype(self.dtype)

    def _w4a8(self, x: jax.Array, row_parallel_axis: str | None) -> jax.Array:
        ops = quantized_ops(self.backend)
        lead = x.shape[:-1]
        # The quantizer takes bf16 rows (rank >= 2); a float32 model's activations are rounded
        # to bf16 first, which costs far less than the FP8 rounding that follows.
        # Sizes from the arrays, not the attributes: under tensor parallelism (shard_map) this
        # layer holds a slice of its weight (jax_mila/parallel/tensor.py).
        # noise.perturb: the identity, except inside noise.quantizer_noise (a sensitivity probe).
        rows = noise.perturb(x.astype(jnp.bfloat16).reshape(-1, x.shape[-1]))
        if row_parallel_axis is not None and x.shape[-1] != self.in_features:
            # Row-parallel under tensor parallelism: this device holds a slice of each row. Scale
            # it by the whole row's amax (one pmax), so the FP8 codes and the partial sums are
            # those of one device; the quantizer is then XLA's (fused), not the kernel.
            amax = jax.lax.pmax(jnp.max(jnp.abs(rows.astype(jnp.float32)), axis=-1),
                                row_parallel_axis)
            q, s = reference.quantize_activations(rows, amax=amax)
        else:
            q, s = ops.quantize_activations(rows)
        y = self.matmul_quantized(q, s)
        return y.reshape(*lead, y.shape[-1])

    def matmul_quantized(self, q: jax.Array, scale: jax.Array) -> jax.Array:
        """The W4A8 product of activations already quantized per row: q float8_e4m3fn
        [..., in_features] and scale float32 [...] as quantize_activations (or quantize_geglu)
        returns them -> [..., out_features] in ``self.dtype``. The rest of the W4A8 forward pass
        after its quantizer; for callers that quantize a fused expression themselves
        (jax_mila/gemma4/mlp.py)."""
        if self.quantize != "w4a8":
            raise ValueError(f"Linear {self.in_features} -> {self.out_features}: "
                             "matmul_quantized needs a quantize='w4a8' layer; this one is dense "
                             "(call it on its unquantized input instead)")
        self.check_quantized_input(q, scale)
        y = quantized_ops(self.backend).w4a8_matmul(q.reshape(-1, q.shape[-1]), scale.reshape(-1),
                                                    self.mxfp4, out_dtype=self.quantized_out_dtype())
        return self.finish_quantized(y, q.shape[:-1])

    def check_quantized_input(self, q: jax.Array, scale: jax.Array) -> None:
        """Raises ValueError unless q [..., K] and scale [...] fit this W4A8 layer's weight."""
        # q holds in_features columns, or (row-parallel, inside shard_map) this device's slice
        # of them, which fits the slice of the stored weight the device holds.
        kp = self.mxfp4.shape[-1]
        if not kp - GROUP < q.shape[-1] <= kp or tuple(scale.shape) != tuple(q.shape[:-1]):
            raise ValueError(f"Linear {self.in_features} -> {self.out_features}: matmul_quantized "
                             f"got q{list(q.shape)} and scale{list(scale.shape)}; expected q "
                             f"[..., {self.in_features}] and scale of q's leading shape")

    def quantized_out_dtype(self):
        """The dtype the W4A8 matmul returns for this layer: bf16 for a bf16 layer without a
        bias, else float32 (the bias is added in float32)."""
        return (self.dtype if jnp.dtype(self.dtype) == jnp.dtype(jnp.bfloat16)
                and not self.use_bias else jnp.float32)

    def finish_quantized(self, y: jax.Array, lead: tuple[int, ...]) -> jax.Array:
        """The W4A8 matmul's rows y [M, N] -> [*lead, N] in ``self.dtype``, the bias added."""
        if self.use_bias:
            y = self._add_bias(y)
        return y.reshape(*lead, y.shape[-1]).astype(self.dtype)

    def _add_bias(self, y: jax.Array) -> jax.Array:
        """The float32 product plus the bias, in float32."""
        return y + self.bias[...].astype(jnp.float32)
