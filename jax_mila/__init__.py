"""jax_mila: long-context Gemma 4 prefill in JAX on hand-written CUDA kernels.

Subpackages: ``jax_mila.ffi`` (the custom calls), ``jax_mila.reference`` (pure-JAX oracles),
``jax_mila.quant`` (weight formats), ``jax_mila.nn`` (Flax NNX modules), ``jax_mila.gemma4``
(the model, loader, prefill and generate). ``jax_mila.dot_product_attention`` is
``jax.nn.dot_product_attention`` on the FlashAttention kernels where they apply
(jax_mila/attention_api.py).
"""

__version__ = "0.1.0"

# The subpackages load on first use (``jax_mila.ffi.available()`` after ``import jax_mila``):
# importing them imports jax (~1.5 s), which ``python -m jax_mila --help`` and the CLI's
# argument errors do without. The CUDA extension stays lazier still: jax_mila.ffi loads it
# only when an op or ``available()`` first needs it.
_SUBPACKAGES = ("ffi", "gemma4", "nn", "quant", "reference")


def __getattr__(name: str):
    if name == "dot_product_attention":
        from jax_mila.attention_api import dot_product_attention

        globals()[name] = dot_product_attention
        return dot_product_attention
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"jax_mila.{name}")  # also binds it as an attribute
    raise AttributeError(f"module 'jax_mila' has no attribute {name!r}")


def selftest(verbose: bool = True):
    """Runs each op once on the default device against its reference; see jax_mila.selftest."""
    from jax_mila._selftest import run

    return run(verbose=verbose)
