"""One process of tests/test_parallel_multiprocess.py: joins jax.distributed (CPU devices, gloo
collectives), runs a context-parallel prefill over every process's device and the same prefill
on its own device, and prints one JSON line for the parent test to judge.

    python3 tests/multiprocess_prefill_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID SEED
"""

import json
import sys

import jax

coordinator, processes, process_id, seed = sys.argv[1], *map(int, sys.argv[2:5])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)

import jax.numpy as jnp  # noqa: E402 - after jax.distributed, before any backend starts
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jax_mila import gemma4  # noqa: E402
from jax_mila.gemma4.config import Gemma4Config  # noqa: E402
from jax_mila.parallel import chunked  # noqa: E402

S, F = "sliding_attention", "full_attention"
# 12B-like: K=V global layers with one KV head, sliding layers with a window of 4.
CONFIG = dict(model_type="gemma4_text", final_logit_softcapping=30.0, vocab_size=256,
              hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F],
              sliding_window=4, hidden_size_per_layer_input=0)
LENGTH, CHUNK, SEGMENTS = 21, 6, 2

model = gemma4.Gemma4ForCausalLM(Gemma4Config.from_dict(CONFIG), dtype=jnp.float32,
                                 backend="reference", rngs=nnx.Rngs(seed))
ids = jax.random.randint(jax.random.key(seed), (2, LENGTH), 3, 256, jnp.int32)
want, want_cache = gemma4.prefill(model, ids, chunk_size=CHUNK)  # this process's device
reordered, _ = gemma4.prefill(model, ids, chunk_size=LENGTH)     # the same, summed otherwise
mesh = Mesh(np.array(jax.devices()), ("seq",))                    # every process's device
got, cache = gemma4.prefill(model, ids, chunk_size=CHUNK, mesh=mesh, seq_segments=SEGMENTS)

# The full layer's buffer: this process holds one device's block of it, positions from the
# layout; compare them with the same positions of the one-device cache.
full = CONFIG["layer_types"].index(F)
shard = cache.keys[full].addressable_shards[0]
positions = chunked.slot_positions(cache.max_len, processes, SEGMENTS)[shard.index[1]]
local = np.asarray(shard.data)
real = positions < LENGTH
expected = np.asarray(want_cache.keys[full])[:, positions[real]]
cache_err = float(np.max(np.abs(local[:, real] - expected)))
print(json.dumps(dict(
    process=process_id, devices=len(jax.devices()), local_devices=len(jax.local_devices()),
    logits_err=float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),
    own_reordering=float(np.max(np.abs(np.asarray(reordered) - np.asarray(want)))),
    scale=max(1.0, float(np.max(np.abs(np.asarray(want))))),
    cache_err=cache_err, unwritten_zero=bool(np.all(local[:, ~real] == 0)),
    local_slots=int(local.shape[1]), capacity=int(cache.max_len))), flush=True)
