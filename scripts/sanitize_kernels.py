"""Small, odd-sized calls of every CUDA kernel, for compute-sanitizer (not a test suite).

pytest under compute-sanitizer crashed the sanitizer itself on the H200 (rc 139, in several
tools), and a kernel-name filter makes initcheck blame our kernels for inputs written by XLA
kernels it did not instrument. This script keeps the process minimal: inputs are built on the
host and copied to the device (initialized memory), each kernel runs under jit with its outputs
poisoned, and the oracle runs on the CPU device, so the only GPU kernels are ours and XLA's
poison fills. Every case checks its result, so a run is also a correctness check.

    compute-sanitizer --tool initcheck python3 scripts/sanitize_kernels.py --ops quantize
    compute-sanitizer --tool racecheck --kernel-name kns=mila python3 scripts/sanitize_kernels.py

The two-GPU groups (prefill_cp2, collectives_cp2) run as two processes with one GPU each
(compute-sanitizer segfaulted at start whenever a process saw both H200s), joined by
jax.distributed; every process runs the same checks on the global mesh:

    CUDA_VISIBLE_DEVICES=$i compute-sanitizer ... python3 scripts/sanitize_kernels.py \
        --ops prefill_cp2 --coordinator localhost:12355 --num-processes 2 --process-id $i

Exit status 0 when every case matched its oracle.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jax_mila import ffi, quant, reference
from jax_mila.reference import bounds

RNG = np.random.default_rng()


def _on_cpu(fn, *args, **kwargs):
    # Looked up per call: with --num-processes, no backend may start before jax.distributed.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*jax.device_put(args, cpu), **kwargs)


def _capability():
    """(major, minor) of the first CUDA device, or None without one."""
    try:
        device = jax.devices("cuda")[0]
    except RuntimeError:
        return None
    return tuple(int(v) for v in str(device.compute_capability).split("."))


def _bf16(shape, scale=1.0):
    return jnp.asarray((RNG.standard_normal(shape) * scale).astype(np.float32)).astype(jnp.bfloat16)


def check_quantize():
    for shape in ((1, 16), (97, 2816), (3, 5, 48)):
        x = _bf16(shape, 3.0).reshape(-1, shape[-1]).at[0].set(0).reshape(shape)
        q, s = bounds.call_with_poisoned_outputs(ffi.quantize_activations, x)
        q_ref, s_ref = _on_cpu(reference.quantize_activations, x)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
        d = np.abs(np.asarray(q, np.float32) - np.asarray(q_ref, np.float32))
        assert np.all(d <= np.maximum(np.abs(np.asarray(q_ref, np.float32)) / 8, 2**-9)), shape
        yield f"quantize {shape}"
    # The fused GEGLU quantizer: the same shapes, each of its block / register-cache buckets
    # (K = 21504: 512 threads x 6 chunks; 32768: 512 x 8) and an uncached row, held against
    # the interval oracle (jax_mila.reference.bounds.geglu_quantization_problem).
    for shape in ((1, 16), (97, 2816), (3, 5, 48), (7, 15360), (7, 21504), (3, 32768),
                  (5, 40000)):
        gate = _bf16(shape, 2.0).reshape(-1, shape[-1]).at[-1].set(0).reshape(shape)
        up = _bf16(shape)
        got = bounds.call_with_poisoned_outputs(ffi.quantize_geglu, gate, up)
        problem = bounds.geglu_quantization_problem(gate, up, *got)
        assert problem is None, (shape, problem)
        yield f"quantize_geglu {shape}"
    # The fused norms, with and without a branch: each launch configuration (one warp or a pair
    # per row, 1 to 16 chunks a lane up to K = 8192, the uncached kernel beyond), more rows than
    # the grid (the groups stride over rows; the pairs' shared exchange reused per row), zero rows;
    # held against jax_mila.reference.bounds.add_rms_norm_quantization_problem. Only the kernel: the
    # reference under jit is the unfused layers' expression as XLA computes it, which may keep h
    # in float32 for the second norm (jax_mila/reference/quantize.py) where the oracle wants it
    # rounded.
    st = ffi.status("add_rms_norm_quantize")
    if not (_capability() and st.kernel):
        yield f"add_rms_norm_quantize: skipped, no kernel here ({st.reason})"
        return
    for shape in ((1, 16), (3, 5, 48), (9, 512), (9, 1024), (97, 2816), (9, 2048), (9, 2064),
                  (33, 3840), (9, 3856), (9, 4112), (9, 5376), (9, 6160), (3, 8192), (3, 9008),
                  (3000, 128), (3000, 3840), (2000, 4096)):
        k = shape[-1]
        rows = int(np.prod(shape[:-1]))
        x = _bf16(shape, 3.0).reshape(-1, k).at[0].set(0).reshape(shape)
        # Branch rows of RMS 1e-4 .. 30 (where eps matters, up to dominating x); a zero row.
        rms = np.exp(RNG.uniform(np.log(1e-4), np.log(30.0), (rows, 1))).astype(np.float32)
        branch = (_bf16((rows, k)).astype(jnp.float32) * rms).astype(jnp.bfloat16)
        branch = branch.at[-1].set(0).reshape(shape)
        wb = jnp.asarray(RNG.uniform(-1, 3, k).astype(np.float32)).astype(jnp.bfloat16)
        wn = jnp.asarray(RNG.uniform(-1, 3, k).astype(np.float32))
        kw = dict(branch_weight=wb, norm_weight=wn, eps=1e-6)
        got = bounds.call_with_poisoned_outputs(
            lambda x, b, wb, wn: ffi.add_rms_norm_quantize(x, b, branch_weight=wb, norm_weight=wn,
                                                           eps=1e-6), x, branch, wb, wn)
        problem = bounds.add_rms_norm_quantization_problem(x, branch, got, **kw)
        assert problem is None, (shape, problem)
        got = bounds.call_with_poisoned_outputs(
            lambda x, wn: ffi.add_rms_norm_quantize(x, norm_weight=wn, eps=1e-6), x, wn)
        problem = bounds.add_rms_norm_quantization_problem(x, None, got, **kw)
        assert problem is None, (shape, "no branch", problem)
        yield f"add_rms_norm_quantize {shape}"


def check_norm_rope():
    """The fused q/k norm + RoPE: both head dims, T = 1 and odd, H = 1 and odd, leading batch
    dims, partial last blocks (16 rows a block at D = 256, 8 at D = 512), a zero row and rows of
    magnitude 1e4, held against jax_mila.reference.bounds.norm_rope_problem (numpy, on the host)."""
    st = ffi.status("rms_norm_rope")
    if not (_capability() and st.kernel):
        yield f"rms_norm_rope: skipped, no kernel here ({st.reason})"
        return
    for shape in ((1, 1, 256), (1, 1, 512), (97, 1, 256), (97, 8, 512), (97, 16, 256),
                  (37, 3, 512), (2, 33, 3, 256), (2, 3, 5, 2, 512), (1000, 16, 256),
                  (1, 1000, 1, 512)):
        t, d = shape[-3], shape[-1]
        rows = int(np.prod(shape[:-1]))
        x = _bf16((rows, d), 3.0).at[0].set(0).at[-1].multiply(1e4).reshape(shape)
        w = jnp.asarray(RNG.uniform(-1, 3, d).astype(np.float32))
        cos = jnp.asarray(RNG.uniform(-1, 1, (t, d)).astype(np.float32)).astype(jnp.bfloat16)
        sin = jnp.asarray(RNG.uniform(-1, 1, (t, d)).astype(np.float32)).astype(jnp.bfloat16)
        got = bounds.call_with_poisoned_outputs(
            lambda x, w, c, s: ffi.rms_norm_rope(x, w, c, s, eps=1e-6), x, w, cos, sin)
        problem = bounds.norm_rope_problem(x, w, cos, sin, got, eps=1e-6)
        assert problem is None, (shape, problem)
        yield f"rms_norm_rope {shape}"


# (B, T, S, Hq, Hkv, causal, window, q_offset, kv_offset): odd sizes, GQA, a window, masked rows.
ATTENTION_CASES = (
    (1, 1, 1, 2, 1, True, None, 0, 0),
    (2, 97, 97, 4, 2, True, 5, 0, 0),
    (1, 33, 50, 2, 2, True, None, 0, 10),     # rows before their first key: fully masked
    (1, 97, 130, 16, 1, False, None, 0, 0),
    (1, 70, 200, 16, 1, True, None, 130, 0),  # queries at the end of a longer key range
    # 192 work items of the persistent D=256 kernel: a second, reversed round on 132 SMs.
    (4, 300, 300, 16, 16, True, None, 0, 0),
    # Segmented keys (D=512 only; kv_offset = segment starts): out of order, a future segment,
    # segments of 100 slots (tiles reach into the next segment), a window across segments.
    (1, 97, 256, 16, 1, True, None, 480, (500, 0, 1000, 64)),
    (2, 40, 300, 4, 1, True, 64, 350, (0, 100, 300)),
)


def check_attention(d, rotary_keys_only=None):
    for b, t, s, hq, hkv, causal, window, qo, ko in ATTENTION_CASES:
        if isinstance(ko, tuple) and d != 512:
            continue
        q, k, v = _bf16((b, t, hq, d)), _bf16((b, s, hkv, d)), _bf16((b, s, hkv, d))
        kw = dict(causal=causal, window=window, return_lse=True, rotary_keys_only=rotary_keys_only)
        fn = lambda q, k, v, a, c: ffi.flash_attention(q, k, v, q_offset=a, kv_offset=c, **kw)  # noqa: E731
        o, lse = bounds.call_with_poisoned_outputs(fn, q, k, v, jnp.int32(qo),
                                                   jnp.asarray(ko, jnp.int32))
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        ro, rl = _on_cpu(lambda q, k, v: reference.flash_attention(
            f32(q), f32(k), f32(v), q_offset=qo, kv_offset=ko, **kw), q, k, v)
        err = bounds.max_abs_err(o, ro)
        assert err < 0.05, (d, b, t, s, err)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(rl)))
        yield (f"attention d{d} B{b} T{t} S{s} {hq}/{hkv} window={window} offsets={qo},{ko}"
               f" rotary_keys_only={rotary_keys_only}")


def check_w4a8():
    hopper = (_capability() or (0, 0)) >= (9, 0)
    kernels = (["mma_sync", "wgmma_ws", "wgmma_ws_e4m3"] if hopper else []) + ["auto"]
    # (1100, 4104, 384) has more output tiles than an H100/H200 has SMs: persistent CTAs of
    # wgmma_ws run a second tile, whose row scales are staged while the first tile's epilogue
    # may still be reading (the cross-tile hazard racecheck must see); K = 384 ends on the
    # one-tile promotion chain. bf16 output is wgmma_ws's staged epilogue, float32 its direct one.
    # (300, 264, 1664) and (1100, 3848, 2048) run wgmma_ws's stream-K on 132 SMs (partials
    # written, flagged, read by the owner). K = 704 and 2112 are stored padded (the last K tile
    # read past K as zeros). wgmma_ws_e4m3 expands the weights into the scratch first (the GEMM's
    # TMA reads what another kernel wrote); from M = 4096 "auto" runs it.
    shapes = ((1, 256, 128), (97, 384, 256), (300, 136, 704), (1100, 4104, 384),
              (300, 264, 1664), (1100, 3848, 2112), (4100, 264, 384))
    yield from _check_w4a8_shapes(
        shapes, kernels, lambda kern, m: ffi.w4a8.auto_kernel(m) if kern == "auto" else kern)


def check_w4a8_gemv():
    """The decode GEMV ("gemv", and "auto" for 1-16 rows): 1, 3, 9 and 16 rows (one and two n8
    activation tiles), a partial weight tile (N = 24, 4104), K stored padded (2112, 704), and
    split-K: partials written to the scratch, counted, added by the last CTA of a tile (N = 512,
    K = 3840: 30 splits on 132 SMs; K = 6144 with 9 rows: 48 groups in at least 3 splits).
    On Hopper the splits of a tile are a thread-block cluster (partials added through
    distributed shared memory) unless more than 8 are needed: K = 24576 with 16 rows (192 groups,
    at least 9 splits) takes the counters there too. w4a8_matmul_many: three weights in one
    launch (tiles of three weights in one list, each weight's last tile partial)."""
    shapes = ((1, 256, 128), (3, 24, 2112), (16, 4104, 384), (9, 264, 6144), (1, 512, 3840),
              (16, 136, 704), (16, 136, 24576))
    yield from _check_w4a8_shapes(shapes, ("gemv", "auto"), lambda kern, m: "gemv")
    for m, ns, k in ((1, (4104, 520, 136), 2112), (16, (264, 24), 3840)):
        x = _bf16((m, k))
        xq, xs = ffi.quantize_activations(x)
        ws = [jax.device_put(_on_cpu(quant.quantize_mxfp4, jnp.asarray(
            (RNG.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))), jax.devices()[0])
            for n in ns]
        for out_dtype in (jnp.float32, jnp.bfloat16):
            name = f"w4a8_matmul_many {m}x{ns}x{k} {jnp.dtype(out_dtype).name}"
            print(f"...  {name}", flush=True)
            got = bounds.call_with_poisoned_outputs(
                lambda a, b, dt=out_dtype: ffi.w4a8_matmul_many(a, b, ws, out_dtype=dt), xq, xs)
            for y, w in zip(got, ws):
                want = _on_cpu(lambda a, b, c: reference.w4a8_matmul(a, b, c,
                                                                     out_dtype=jnp.float32),
                               xq, xs, w)
                _check_w4a8_error(y, want, "gemv", out_dtype, (m, w.shape[0], k, "many"))
            yield name


def _check_w4a8_shapes(shapes, kernels, resolve):
    """Each (m, n, k) of ``shapes`` through each of ``kernels``, float32 and bf16 out, poisoned
    outputs, against the reference on the CPU; ``resolve(kernel, m)`` names the kernel that runs
    (its error bound)."""
    for m, n, k in shapes:
        x = _bf16((m, k))
        w = jnp.asarray((RNG.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
        xq, xs = ffi.quantize_activations(x)
        # Quantized on the CPU: the NaN check's scalar read-back is then not an XLA GPU buffer
        # (initcheck flagged that 4-byte device-to-host copy, outside our kernels).
        wq = jax.device_put(_on_cpu(quant.quantize_mxfp4, w), jax.devices()[0])
        want = _on_cpu(lambda a, b, c: reference.w4a8_matmul(a, b, c, out_dtype=jnp.float32),
                       xq, xs, wq)
        for kern in kernels:
            for out_dtype in (jnp.float32, jnp.bfloat16):
                name = f"w4a8 {kern} {m}x{n}x{k} {jnp.dtype(out_dtype).name}"
                print(f"...  {name}", flush=True)  # where a sanitizer crash happened
                got = bounds.call_with_poisoned_outputs(
                    lambda a, b, c, kern=kern, dt=out_dtype: ffi.w4a8_matmul(
                        a, b, c, out_dtype=dt, kernel=kern), xq, xs, wq)
                _check_w4a8_error(got, want, resolve(kern, m), out_dtype, (m, n, k, kern))
                yield name


def _check_w4a8_error(got, want, resolved, out_dtype, what):
    # wgmma: FP8 accumulation, ~1e-4 (jax_mila/ffi/w4a8.py); bf16 output adds its rounding.
    err = bounds.rel_fro_err(got.astype(jnp.float32), want)
    bound = (4e-4 if resolved.startswith("wgmma") else 1e-4) + (
        4e-3 if out_dtype == jnp.bfloat16 else 0.0)
    assert err < bound, (what, jnp.dtype(out_dtype).name, err)


def check_grouped_w4a8():
    """The grouped (mixture-of-experts) GEMM: empty experts, groups that are no tile multiple,
    one expert with every row, rows past the groups (zero-filled), K stored padded, a persistent
    grid walking more tiles than SMs, and the 26B's shapes."""
    hopper = (_capability() or (0, 0)) >= (9, 0)
    kernels = (["mma_sync", "wgmma_ws"] if hopper else []) + ["auto"]
    cases = (((97,), 136, 256, None), ((5, 0, 300, 1, 0, 64), 264, 704, None),
             ((0, 0, 513), 128, 384, 600), ((40,) * 24, 1408, 2816, None),
             ((200, 0, 60) * 6, 2816, 704, None))
    for sizes, n, k, m in cases:
        m = sum(sizes) if m is None else m
        x = _bf16((m, k))
        w = jnp.asarray((RNG.standard_normal((len(sizes), n, k)) / np.sqrt(k)).astype(np.float32))
        xq, xs = ffi.quantize_activations(x)
        wq = jax.device_put(_on_cpu(quant.quantize_mxfp4, w), jax.devices()[0])
        gs = jnp.asarray(sizes, jnp.int32)
        want = _on_cpu(lambda a, b, c, g: reference.grouped_w4a8_matmul(
            a, b, c, g, out_dtype=jnp.float32), xq, xs, wq, gs)
        for kern in kernels:
            for out_dtype in (jnp.float32, jnp.bfloat16):
                name = f"grouped w4a8 {kern} E={len(sizes)} M={m} {n}x{k} " \
                       f"{jnp.dtype(out_dtype).name}"
                print(f"...  {name}", flush=True)
                got = bounds.call_with_poisoned_outputs(
                    lambda a, b, c, g, kern=kern, dt=out_dtype: ffi.grouped_w4a8_matmul(
                        a, b, c, g, out_dtype=dt, kernel=kern), xq, xs, wq, gs)
                resolved = ffi.w4a8.auto_kernel(m, grouped=True) if kern == "auto" else kern
                _check_w4a8_error(got, want, resolved, out_dtype, (sizes, n, k, kern))
                yield name


def _mma_sync(d):
    """check_attention(d) through the portable mma.sync kernel on Hopper too: the Hopper target
    unmapped while the checks run (the route is chosen at trace time)."""
    from jax_mila.ffi import attention

    with mock.patch.dict(attention._SM90_TARGETS, {d: None}):
        yield from check_attention(d)


# The model of the prefill groups: both attention geometries (D=256 sliding with a window of
# 128, D=512 global with K=V and 2:1 GQA), chunks of 256 over a 1000-token prompt.
PREFILL_RUN = dict(chunk_size=256, max_cache_len=1024)


def _prefill_model(seed, backend):
    """The 4-layer model with W4A8 linears: it runs every kernel family (quantizer, fused norms,
    GEMM, both attention geometries); dense linears would add only XLA's GEMMs and, under the
    sanitizer, minutes of compiling (tests/test_parallel_chunked.py runs them on two GPUs)."""
    from flax import nnx

    from jax_mila import gemma4
    from jax_mila.gemma4.config import Gemma4Config

    sliding, full = "sliding_attention", "full_attention"
    cfg = Gemma4Config.from_dict(dict(
        model_type="gemma4_text", final_logit_softcapping=30.0, vocab_size=512, hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=[sliding, full, sliding, full], sliding_window=128,
        hidden_size_per_layer_input=0))
    return gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.bfloat16, backend=backend, quantize="w4a8",
                                    rngs=nnx.Rngs(seed))


def _prefill_prompt():
    return jnp.asarray(RNG.integers(3, 512, (2, 1000)).astype(np.int32))  # the model's vocab


def _two_gpu_mesh(group):
    """A `seq` mesh of two GPUs (under jax.distributed, jax.devices() lists every process's)."""
    from jax.sharding import Mesh

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        raise RuntimeError(f"{group} needs 2 GPUs, found {len(gpus)}")
    return Mesh(np.array(gpus[:2]), ("seq",))


def _relative(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_prefill_one_gpu():
    """The prefill_cp2 model and prompt on one GPU without a mesh or jax.distributed, against
    the same weights through the reference ops: whether a whole-model program alone crashes
    the sanitizer (prefill_cp2 did, eighth round; so did pytest, on one GPU)."""
    from jax_mila import gemma4

    seed = int(RNG.integers(1 << 30))
    ids = _prefill_prompt()
    got, _ = gemma4.prefill(_prefill_model(seed, "auto"), ids, **PREFILL_RUN)
    want, _ = gemma4.prefill(_prefill_model(seed, "reference"), ids, **PREFILL_RUN)
    rel = _relative(got, want)
    assert rel < 0.05, (seed, rel)  # bf16 noise is ~1e-2; a broken kernel is O(1)
    yield f"prefill on 1 GPU: logits {rel:.1e} from the reference ops"


def check_prefill_two_gpus():
    """Context-parallel chunked prefill over 2 GPUs (every kernel inside shard_map, the NCCL
    collectives between them) against the same prefill on one GPU."""
    from jax.experimental import multihost_utils

    from jax_mila import gemma4

    mesh = _two_gpu_mesh("prefill_cp2")
    # Several processes must build the same model and prompt: process 0's draws for all.
    shared = lambda x: np.asarray(multihost_utils.broadcast_one_to_all(x))  # noqa: E731
    ids = jnp.asarray(shared(_prefill_prompt()))
    seed = int(shared(np.int32(RNG.integers(1 << 30))))
    model = _prefill_model(seed, "auto")
    one, _ = gemma4.prefill(model, ids, **PREFILL_RUN)
    # A line per stage: the sanitizer has crashed inside this check (eighth round) with
    # nothing printed, while collectives_cp2 ran clean; this says which prefill it was in.
    yield "prefill on 1 GPU (the oracle)"
    got, _ = gemma4.prefill(model, ids, mesh=mesh, seq_segments=4, **PREFILL_RUN)
    rel = _relative(got, one)
    assert rel < 0.05, (seed, rel)  # bf16 noise is ~1e-2; a wrong merge is O(1)
    yield f"prefill over 2 GPUs (seq axis): logits {rel:.1e} from 1 GPU"


def check_collectives_two_gpus():
    """One all-gather and one psum over 2 GPUs and none of our kernels: whether the sanitizer
    itself survives NCCL here (it segfaulted in every prefill_cp2 run, seventh and eighth
    rounds)."""
    from jax.sharding import PartitionSpec as P

    mesh = _two_gpu_mesh("collectives_cp2")

    def body(x):
        return jax.lax.psum(jax.lax.all_gather(x, "seq", tiled=True), "seq")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("seq"), out_specs=P()))
    x = jax.make_array_from_callback((8, 128), jax.NamedSharding(mesh, P("seq")),
                                     lambda idx: np.ones((8, 128), np.float32)[idx])
    got = np.asarray(jax.device_get(step(x).addressable_shards[0].data))
    assert np.all(got == 2.0), got
    yield "all-gather + psum over 2 GPUs"


# (D, B, T, Hq, Hkv, S, kv_len, window, ring, cache dtype, rotary_keys_only): both head dims, 16
# and 32 rows a CTA, bf16 and FP8 caches, a ring read past its wrap, rows shorter than T.
DECODE_CASES = (
    (512, 2, 1, 16, 1, 97, (97, 5), None, False, jnp.bfloat16, None),
    (512, 2, 2, 8, 1, 33, (33, 1), None, False, jnp.float8_e4m3fn, 64),
    (512, 1, 16, 4, 2, 40, (40,), None, False, jnp.bfloat16, 64),
    (256, 3, 2, 4, 2, 9, (9, 40, 1), 8, True, jnp.bfloat16, None),
    (256, 2, 16, 16, 8, 20, (20, 70), 5, True, jnp.float8_e4m3fn, None),
    (256, 2, 3, 2, 1, 50, (50, 17), 7, False, jnp.float8_e4m3fn, None),
)


def check_decode_attention():
    """The split and combine kernels through the op, and the target with more pieces than
    tiles (empty pieces), every output poisoned first."""
    dec = importlib.import_module("jax_mila.ffi.decode_attention")  # the module, not the op
    for d, b, t, hq, hkv, s, lens, window, ring, dtype, rotary in DECODE_CASES:
        q = _bf16((b, t, hq, d))
        k = jnp.asarray(RNG.standard_normal((b, s, hkv, d)).astype(np.float32)).astype(dtype)
        v = jnp.asarray(RNG.standard_normal((b, s, hkv, d)).astype(np.float32)).astype(dtype)
        kv_len = jnp.asarray(np.array(lens, np.int32))
        kw = dict(window=window, ring=ring, rotary_keys_only=rotary)
        o = bounds.call_with_poisoned_outputs(
            lambda q, k, v, n: ffi.decode_attention(q, k, v, n, **kw), q, k, v, kv_len)
        ro = _on_cpu(lambda q, k, v, n: reference.decode_attention(q, k, v, n, **kw),
                     q, k, v, kv_len)
        err = bounds.max_abs_err(o, ro)
        assert err < 0.05, (d, b, t, s, lens, err)
        yield f"decode_attention d{d} B{b} T{t} {hq}/{hkv} S{s} kv_len={lens} {kw} {dtype.__name__}"
        rows = t * (hq // hkv)
        pieces = 7
        out = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
               jax.ShapeDtypeStruct((b, hkv, pieces, rows, d), jnp.float32),
               jax.ShapeDtypeStruct((b, hkv, pieces, rows, 2), jnp.float32))
        target = lambda q, k, v, n: jax.ffi.ffi_call(dec.TARGET, out)(  # noqa: E731
            q, k, v, n, scale=np.float32(d**-0.5), window=np.int64(window or 0), ring=ring,
            rotary=np.int64(d // 2 if rotary is None else rotary), pieces=np.int64(pieces))
        o7 = bounds.call_with_poisoned_outputs(target, q, k, v, kv_len)[0]
        err = bounds.max_abs_err(o7, ro)
        assert err < 0.05, (d, b, t, s, lens, pieces, err)
        yield f"decode_attention d{d} ... {pieces} pieces"


# On Hopper "d256" / "d512" run the sm90 kernels (the route there); "d256_mma" / "d512_mma"
# the portable mma.sync kernels.
OPS = {"quantize": check_quantize, "norm_rope": check_norm_rope,
       "d256": lambda: check_attention(256),
       "d512": lambda: check_attention(512),
       "d512_rotary": lambda: check_attention(512, rotary_keys_only=64),  # Hopper: *_rotary_keys
       "d256_mma": lambda: _mma_sync(256),
       "d512_mma": lambda: _mma_sync(512),
       "w4a8": lambda: itertools.chain(check_w4a8(), check_w4a8_gemv()),
       "w4a8_gemv": check_w4a8_gemv, "moe": check_grouped_w4a8,
       "decode_attention": check_decode_attention, "prefill_1gpu": check_prefill_one_gpu,
       "prefill_cp2": check_prefill_two_gpus,
       "collectives_cp2": check_collectives_two_gpus}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {list(OPS)}")
    parser.add_argument("--coordinator", help="host:port of jax.distributed (several processes)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args()
    if args.num_processes > 1:
        if not args.coordinator:
            parser.error("--num-processes > 1 needs --coordinator host:port")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    failed = 0
    for op in args.ops.split(","):
        if op not in OPS:
            parser.error(f"--ops: unknown op {op!r}; known: {list(OPS)}")
        try:
            for name in OPS[op]():
                print(f"ok   {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on with the next op
            failed += 1
            print(f"FAIL {op}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
