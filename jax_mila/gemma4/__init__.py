"""Gemma 4 text decoder (all released sizes) in Flax NNX, logit-exact against transformers.

    model = jax_mila.gemma4.from_pretrained(path, dtype=jnp.bfloat16, backend="auto")
    logits = model(input_ids)                                   # [B, S, vocab]
    last_logits, cache = jax_mila.gemma4.prefill(model, input_ids)
    new_ids = jax_mila.gemma4.generate(model, input_ids, 16)    # greedy

The package holds the model (config, layers, KV cache layout, loader, conversion); forward,
prefill, decode and generate are jax_mila.engine's, re-exported here. The engine imports no
model: it runs this one through its methods (jax_mila/engine/__init__.py lists them).
"""

from jax_mila.engine import decode, forward, generate, prefill
from jax_mila.gemma4.cache import KVCache
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.gemma4.loader import from_pretrained, load_weights
from jax_mila.gemma4.model import Gemma4ForCausalLM
from jax_mila.gemma4.paths import embedded_checkpoint, model_card, models_dir

__all__ = ["Gemma4Config", "Gemma4ForCausalLM", "KVCache", "decode", "embedded_checkpoint",
           "forward", "from_pretrained", "generate", "load_weights", "model_card", "models_dir",
           "prefill"]
