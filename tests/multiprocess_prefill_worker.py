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

import numpy as np  # noqa: E402 - after jax.distributed, before any backend starts
from jax.sharding import Mesh  # noqa: E402

from jax_mila import gemma4  # noqa: E402
from jax_mila.parallel import chunked  # noqa: E402
from test_parallel_chunked import _ids, _model  # noqa: E402 - the same models

LENGTH, CHUNK, SEGMENTS = 21, 6, 2

model = _model("k_eq_v", seed)  # 12B-like: K=V global layers with one KV head, window 4
ids = _ids(seed, LENGTH, model.config.vocab_size)
want, want_cache = gemma4.prefill(model, ids, chunk_size=CHUNK)  # this process's device
reordered, _ = gemma4.prefill(model, ids, chunk_size=LENGTH)     # the same, summed otherwise
mesh = Mesh(np.array(jax.devices()), ("seq",))                    # every process's device
got, cache = gemma4.prefill(model, ids, chunk_size=CHUNK, mesh=mesh, seq_segments=SEGMENTS)

# The full layer's buffer: this process holds one device's block of it, positions from the
# layout; compare them with the same positions of the one-device cache.
full = [spec.is_sliding for spec in model.config.layers].index(False)
shard = cache.keys[full].addressable_shards[0]
positions = chunked.slot_positions(cache.max_len, processes, SEGMENTS)[shard.index[1]]
local = np.asarray(shard.data)
real = positions < LENGTH
expected = np.asarray(want_cache.keys[full])[:, positions[real]]
cache_err = float(np.max(np.abs(local[:, real] - expected)))
print(json.dumps(dict(
    process=process_id, devices=len(jax.devices()), local_devices=len(jax.local_devices()),
    got=np.asarray(got).tolist(), want=np.asarray(want).tolist(),
    reordered=np.asarray(reordered).tolist(),
    cache_err=cache_err, unwritten_zero=bool(np.all(local[:, ~real] == 0)),
    local_slots=int(local.shape[1]), capacity=int(cache.max_len))), flush=True)
