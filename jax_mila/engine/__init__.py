"""The engine: everything that runs a model, apart from the model.

    logits = jax_mila.engine.forward(model, input_ids)              # also over a mesh
    last_logits, cache = jax_mila.engine.prefill(model, input_ids)  # chunked, one device or a mesh
    new_ids = jax_mila.engine.generate(model, input_ids, 16)        # greedy decode
(jax_mila.gemma4 re-exports these four.)

Modules, in the order a prefill meets them:
- plan: how many tokens a chunk holds and the widths of a prompt's chunks;
- jitted: the single-device jitted steps (forward, one-shot prefill, chunk step, output head,
  decode) and how they take the model apart (model_args);
- pieces: a chunk's step in pieces of consecutive layers (one device);
- sharded: the steps over a mesh (tensor and context parallelism), built with the
  jax_mila.parallel primitives;
- run: the entry points and the prefill loop.

Package edges. The engine imports jax_mila.parallel (sharding and collective primitives) and
jax_mila.ffi, never a model package: it runs the model it is handed through the methods that
model provides, so jax_mila.gemma4 can re-export the entry points without an import cycle
(tests/test_import_cycles.py checks both). What the engine calls on a model:
- ``hidden_states(ids, mode=..., cache=..., valid=..., first_chunk=..., layout=...)`` and
  ``logits(h)``: the computation; ``layout`` (jax_mila.parallel.Layout) tells the layers how the
  step splits its work over the mesh, so no layer reads global state to learn it;
- ``check_input_ids(ids)``, ``empty_cache(batch, max_len, full_dtype=, seq_layout=)``;
- ``runs_in_pieces()``, ``piece_modules(start, stop)``, ``piece_runner()`` and ``layers``: the
  layer pieces;
- ``config`` (the geometry the chunk plan and the tensor-parallel specs read), ``dtype`` and
  ``backend`` (the compile options: no XLA autotuning on the kernel backend).
"""

from jax_mila.engine.run import decode, forward, generate, prefill

__all__ = ["decode", "forward", "generate", "prefill"]
