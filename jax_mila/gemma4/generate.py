"""Jitted forward, prefill and greedy generation over a KVCache.

``prefill`` runs the whole prompt once (positions 0..S-1) and returns the last position's
logits and the cache; ``generate`` continues greedily one token per step from that cache. The
decode steps use the same positions, window and masks as a full re-run, so the tokens equal
those of re-running the full sequence at every step (the parity suite checks this).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_mila.gemma4.cache import KVCache
from jax_mila.gemma4.model import Gemma4ForCausalLM


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, state, input_ids):
    return nnx.merge(graphdef, state)(input_ids)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _prefill(graphdef, state, input_ids, max_len):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden_states(input_ids, mode="prefill", max_len=max_len)
    return model.logits(h[:, -1]), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnames=("cache",))
def _decode(graphdef, state, cache, token, steps):
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        cache, tok = carry
        h, cache = model.hidden_states(tok[:, None], mode="decode", cache=cache)
        nxt = jnp.argmax(model.logits(h[:, 0]), axis=-1).astype(jnp.int32)
        return (cache, nxt), nxt

    (cache, _), tokens = jax.lax.scan(step, (cache, token), None, length=steps)
    return tokens.T, cache


def _ids(input_ids) -> jax.Array:
    ids = jnp.asarray(input_ids, jnp.int32)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must be int32 [B, S] with S >= 1, got shape {list(ids.shape)}")
    return ids


def forward(model: Gemma4ForCausalLM, input_ids) -> jax.Array:
    """Jitted ``model(input_ids)``: logits [B, S, vocab]; compiles once per input shape."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, _ids(input_ids))


def prefill(model: Gemma4ForCausalLM, input_ids, *, max_cache_len: int | None = None):
    """Runs the prompt [B, S] once; returns (logits of the last position [B, vocab], KVCache).

    ``max_cache_len`` (default S) is the number of positions the cache can hold in total,
    prompt included; sliding layers keep only a ring of ``sliding_window`` positions."""
    ids = _ids(input_ids)
    max_len = ids.shape[1] if max_cache_len is None else int(max_cache_len)
    if max_len < ids.shape[1]:
        raise ValueError(f"max_cache_len={max_len} is shorter than the prompt ({ids.shape[1]})")
    graphdef, state = nnx.split(model)
    return _prefill(graphdef, state, ids, max_len)


def decode(model: Gemma4ForCausalLM, token, cache: KVCache, steps: int):
    """Feeds ``token`` [B] (the token at position cache.length) and then its own greedy
    choices for ``steps`` steps. Returns (the ``steps`` new tokens [B, steps], cache).
    The cache passed in is donated (do not reuse it)."""
    needed = int(cache.length) + steps
    if needed > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {steps} decode steps from "
                         f"length {int(cache.length)} need {needed} (pass a larger max_cache_len)")
    graphdef, state = nnx.split(model)
    return _decode(graphdef, state, cache, jnp.asarray(token, jnp.int32), steps)


def generate(model: Gemma4ForCausalLM, input_ids, max_new_tokens: int, *,
             cache: KVCache | None = None, logits: jax.Array | None = None) -> jax.Array:
    """Greedy continuation of ``input_ids`` [B, S]: returns the new token ids [B, max_new_tokens].

    Without ``cache``, runs ``prefill`` first (sized for S + max_new_tokens). To continue an
    existing prefill, pass its ``logits`` and ``cache`` (its capacity must cover the new
    tokens; it is donated). There is no early stop at EOS: exactly max_new_tokens come back.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = _ids(input_ids)
    if (cache is None) != (logits is None):
        raise ValueError("pass both the cache and the last logits of a prefill, or neither")
    if cache is None:
        logits, cache = prefill(model, ids, max_cache_len=ids.shape[1] + max_new_tokens)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if max_new_tokens == 1:
        return first[:, None]
    rest, _ = decode(model, first, cache, max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest], axis=1)
