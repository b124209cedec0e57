"""jax_mila: long-context Gemma 4 prefill in JAX on hand-written CUDA kernels.

Subpackages: ``jax_mila.ffi`` (the custom calls), ``jax_mila.reference`` (pure-JAX oracles),
``jax_mila.quant`` (weight formats), ``jax_mila.nn`` (Flax NNX modules), ``jax_mila.gemma4``
(the model, loader, prefill and generate).
"""

__version__ = "0.1.0"


def selftest(verbose: bool = True):
    """Runs each op once on the default device against its reference; see jax_mila.selftest."""
    from jax_mila._selftest import run

    return run(verbose=verbose)
