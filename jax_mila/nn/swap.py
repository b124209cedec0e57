"""swap_linears: an existing flax.nnx model's linears become W4A8 ``jax_mila.nn.Linear`` layers.

    report = jax_mila.nn.swap_linears(model)    # in place; the model runs under nnx.jit as before

Walks the module tree (attributes, nnx.List / nnx.Dict, lists and dicts held as nnx.data) and
replaces each ``nnx.Linear`` whose shape the W4A8 kernels take (jax_mila.nn.linear
``w4a8_unsupported_reason``) with a ``jax_mila.nn.Linear(quantize="w4a8")`` holding its weight as
MXFP4 and its bias (the same nnx.Param). ``nnx.LinearGeneral`` is swapped where it is a plain
matrix product: no batch axes, contracting the last axes of its input; multi-axis inputs or
outputs are flattened around the product (``ReshapedLinear``). The replacement computes in the
layer's ``preferred_element_type``, else its ``dtype``, else its kernel's dtype (a ``dtype=None``
layer promotes its inputs too; the replacement rounds to that dtype).

Left as they are, each with its reason in the returned ``SwapReport`` and in one log line on the
"jax_mila" logger: shapes the kernels cannot take, subclasses (nnx.LoRALinear and the like:
their forward pass is not a plain product), layers with a custom ``dot_general`` /
``dot_general_cls`` / ``promote_dtype``, LinearGeneral with batch axes or other contracted
axes, weights that are not concrete finite floating-point arrays (e.g. a model built by
nnx.eval_shape), and layers held in a tuple (which cannot be assigned into). ``strict=True``
raises ValueError naming every such layer and its reason, before changing anything.

A layer reachable at several places (the same module object) is replaced by one new module at
all of them; layers sharing one kernel variable share one set of MXFP4 variables.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import graph

from jax_mila.nn.backend import check_backend
from jax_mila.nn.linear import MXFP4_FIELDS, Linear, check_quantize, w4a8_unsupported_reason
from jax_mila.quant.mxfp4 import quantize_mxfp4

log = logging.getLogger("jax_mila")

_DEFAULT_PROMOTE = {
    cls: inspect.signature(cls.__init__).parameters["promote_dtype"].default
    for cls in (nnx.Linear, nnx.LinearGeneral)
}


class ReshapedLinear(nnx.Module):
    """A LinearGeneral that is a plain matrix product, as a W4A8 ``linear``: the input's last
    ``len(in_shape)`` axes are flattened into the product's K, its N unflattened into
    ``out_shape``."""

    def __init__(self, linear: Linear, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        self.linear = linear
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.in_shape)
        if tuple(x.shape[x.ndim - n_in:]) != self.in_shape:
            raise ValueError(f"ReshapedLinear: input of shape {list(x.shape)} does not end in "
                             f"the layer's input features {list(self.in_shape)}")
        lead = x.shape[:x.ndim - n_in]
        y = self.linear(x.reshape(*lead, math.prod(self.in_shape)))
        return y.reshape(*lead, *self.out_shape)


@dataclasses.dataclass(frozen=True)
class SwapEntry:
    """One nnx.Linear / nnx.LinearGeneral of the model: where it is reachable (several paths for
    a shared layer), its product's [K -> N], and whether it was swapped or why not."""

    paths: tuple[str, ...]
    kind: str
    in_features: int | None
    out_features: int | None
    swapped: bool
    reason: str | None = None

    @property
    def path(self) -> str:
        return self.paths[0]

    def __str__(self) -> str:
        shape = (f" {self.in_features} -> {self.out_features}"
                 if self.in_features is not None else "")
        where = " = ".join(self.paths)
        return f"{where} ({self.kind}{shape}): " + ("W4A8" if self.swapped else
                                                    f"kept ({self.reason})")


@dataclasses.dataclass(frozen=True)
class SwapReport:
    """What swap_linears did, one entry per layer in the order the walk met them."""

    entries: tuple[SwapEntry, ...]

    @property
    def swapped(self) -> tuple[SwapEntry, ...]:
        return tuple(e for e in self.entries if e.swapped)

    @property
    def kept(self) -> tuple[SwapEntry, ...]:
        return tuple(e for e in self.entries if not e.swapped)

    def summary(self) -> str:
        kept = "; ".join(f"{' = '.join(e.paths)}: {e.reason}" for e in self.kept)
        return (f"swap_linears: {len(self.swapped)} of {len(self.entries)} linears now W4A8"
                + (f"; kept: {kept}" if kept else ""))

    def __str__(self) -> str:
        return "\n".join([self.summary()] + [f"  {e}" for e in self.entries])


@dataclasses.dataclass
class _Layer:
    module: nnx.Module
    sites: list  # (parent, graph node impl, key, path)


def _path_str(path) -> str:
    return ".".join(str(p) for p in path) or "<model>"


def _find_layers(model) -> list[_Layer]:
    """Every nnx.Linear / nnx.LinearGeneral (subclasses too) reachable from `model`, with each
    (parent, key) that holds it; containers reachable twice are walked once."""
    layers: dict[int, _Layer] = {}
    seen: set[int] = set()

    def visit(node, path):
        if id(node) in seen:
            return
        seen.add(id(node))
        impl = graph.get_node_impl(node)
        if impl is None:
            return
        if isinstance(impl, graph.GraphNodeImpl):
            children = list(impl.node_dict(node).items())
        else:
            children = list(impl.flatten(node)[0])
        for key, child in children:
            if isinstance(child, (nnx.Linear, nnx.LinearGeneral)):
                entry = layers.setdefault(id(child), _Layer(child, []))
                entry.sites.append((node, impl, key, path + (key,)))
            elif not isinstance(child, nnx.Variable):
                visit(child, path + (key,))

    visit(model, ())
    return list(layers.values())


def _weight(variable):
    """The concrete floating-point array a kernel or bias variable holds, or a reason."""
    value = variable.get_value()
    if isinstance(value, jax.core.Tracer) or not isinstance(value, (jax.Array, np.ndarray)):
        return None, (f"its weights are not concrete arrays ({type(value).__name__}; "
                      "e.g. a model made by nnx.eval_shape, or swap_linears called under a trace)")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return None, f"its kernel has dtype {np.dtype(value.dtype).name} (floating point needed)"
    return value, None


def _plain_product(layer) -> tuple[tuple[int, ...], tuple[int, ...], str | None]:
    """(input feature shape, output feature shape, why the layer is not a plain product of its
    input's last axes with a [K, N] matrix or None)."""
    cls = type(layer)
    base = nnx.Linear if isinstance(layer, nnx.Linear) else nnx.LinearGeneral
    if cls is nnx.Linear:
        ins, outs = (layer.in_features,), (layer.out_features,)
    elif cls is nnx.LinearGeneral:
        ins, outs = tuple(layer.in_features), tuple(layer.out_features)
    else:
        return (), (), (f"{cls.__name__} subclasses nnx.{base.__name__} (its forward pass may "
                        "be more than the product)")
    if layer.dot_general not in (None, jax.lax.dot_general):
        return ins, outs, "a custom dot_general"
    if getattr(layer, "dot_general_cls", None) is not None:
        return ins, outs, "a custom dot_general_cls"
    if layer.promote_dtype is not _DEFAULT_PROMOTE[base]:
        return ins, outs, "a custom promote_dtype"
    if cls is nnx.LinearGeneral:
        if layer.batch_axis:
            return ins, outs, f"batch axes {dict(layer.batch_axis)}"
        if tuple(layer.axis) != tuple(range(-len(ins), 0)):
            return ins, outs, (f"axis={tuple(layer.axis)} (a plain product contracts the last "
                               f"axes, counted from the end: {tuple(range(-len(ins), 0))})")
    return ins, outs, None


@dataclasses.dataclass
class _Plan:
    layer: _Layer
    entry: SwapEntry
    kernel_var: object = None
    kernel: object = None
    ins: tuple = ()
    outs: tuple = ()


def swap_linears(model: nnx.Module, *, quantize: str = "w4a8", backend: str = "auto",
                 strict: bool = False) -> SwapReport:
    """Replaces, in place, each nnx.Linear / plain-product nnx.LinearGeneral of `model` that the
    W4A8 kernels take by a ``jax_mila.nn.Linear(quantize=quantize, backend=backend)`` with the
    same weights (MXFP4) and bias; returns the SwapReport (also logged as one line). With
    ``strict=True`` any layer that cannot be swapped raises ValueError (layer path and reason)
    and the model is left unchanged."""
    check_quantize(quantize)
    if quantize != "w4a8":
        raise ValueError(f"swap_linears: quantize={quantize!r} is not supported (supported: "
                         "'w4a8' = MXFP4 weights x FP8 activations)")
    check_backend(backend)
    if isinstance(model, (nnx.Linear, nnx.LinearGeneral)):
        raise ValueError("swap_linears: the model is itself a linear layer; pass the module "
                         "that holds it")
    if not isinstance(model, nnx.Module):
        raise ValueError(f"swap_linears: model must be a flax.nnx Module, got "
                         f"{type(model).__name__}")

    plans = []
    for layer in _find_layers(model):
        module = layer.module
        paths = tuple(_path_str(site[3]) for site in layer.sites)
        ins, outs, reason = _plain_product(module)
        k = math.prod(ins) if ins else None
        n = math.prod(outs) if outs else None
        kernel = None
        if reason is None:
            reason = w4a8_unsupported_reason(k, n)
        if reason is None:
            kernel, reason = _weight(module.kernel)
        if reason is None and any(site[1].set_key is None for site in layer.sites):
            reason = "it is held in a tuple (immutable; hold it in a list or nnx.List)"
        entry = SwapEntry(paths, type(module).__name__, k, n, reason is None, reason)
        plans.append(_Plan(layer, entry, module.kernel, kernel, ins, outs))

    # Quantize before changing anything, so that strict mode (and a NaN weight) leaves the
    # model as it was.
    mxfp4 = {}
    for plan in plans:
        if not plan.entry.swapped:
            continue
        k, n = plan.entry.in_features, plan.entry.out_features
        key = (id(plan.kernel_var), k, n)
        if key not in mxfp4:
            try:
                mxfp4[key] = quantize_mxfp4(jnp.asarray(plan.kernel).reshape(k, n).T,
                                            name=plan.entry.path)
            except ValueError as e:
                mxfp4[key] = e
        if isinstance(mxfp4[key], ValueError):
            plan.entry = dataclasses.replace(plan.entry, swapped=False,
                                             reason=f"its kernel cannot be quantized: "
                                                    f"{mxfp4[key]}")

    report = SwapReport(tuple(p.entry for p in plans))
    if strict and report.kept:
        raise ValueError("swap_linears(strict=True): cannot swap "
                         + "; ".join(f"{e.path} ({e.kind}): {e.reason}" for e in report.kept))

    shared_vars: dict[tuple, Linear] = {}
    for plan in plans:
        if not plan.entry.swapped:
            continue
        new = _replacement(plan, backend, mxfp4, shared_vars)
        for parent, impl, key, _ in plan.layer.sites:
            impl.set_key(parent, key, new)
    log.info("%s", report.summary())
    return report


def _replacement(plan: _Plan, backend: str, mxfp4: dict, shared_vars: dict):
    """The jax_mila module that computes what plan's layer computes, W4A8."""
    module = plan.layer.module
    k, n = plan.entry.in_features, plan.entry.out_features
    kernel_dtype = plan.kernel.dtype
    dtype = module.preferred_element_type or module.dtype or kernel_dtype
    bias = module.bias
    single = len(plan.ins) == 1 and len(plan.outs) == 1
    linear = nnx.eval_shape(lambda: Linear(k, n, backend=backend, dtype=dtype,
                                           param_dtype=kernel_dtype, quantize="w4a8",
                                           use_bias=bias is not None, rngs=nnx.Rngs(0)))
    key = (id(plan.kernel_var), k, n)
    if key in shared_vars:  # a kernel variable shared with a layer already swapped
        for field in MXFP4_FIELDS:
            setattr(linear, field, getattr(shared_vars[key], field))
    else:
        linear.set_mxfp4(mxfp4[key])
        shared_vars[key] = linear
    if bias is not None:
        if single:
            linear.bias = bias  # the same variable: ties and optimizer state stay
        else:
            linear.bias = nnx.Param(jnp.asarray(bias.get_value()).reshape(n))
    return linear if single else ReshapedLinear(linear, plan.ins, plan.outs)
