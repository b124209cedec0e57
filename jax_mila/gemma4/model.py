"""Gemma4ForCausalLM: the Gemma 4 text decoder in Flax NNX, numerically following HF
transformers' Gemma4ForCausalLM / Gemma4UnifiedForCausalLM.

Attribute names mirror HF's module names (``layers.3.self_attn.q_proj`` ...), which is what
the loader relies on to map checkpoint tensors onto parameters.

Decoder layer, in HF's order:
    h = h + post_attention_layernorm(attn(input_layernorm(h)))
    f = mlp(pre_feedforward_layernorm(h))
    MoE: f = post_feedforward_layernorm_1(f)
             + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))
    h = h + post_feedforward_layernorm(f)
    PLE: h = h + post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(h)) * ple_i))
    h = h * layer_scalar      # trap: scales the WHOLE residual stream; trained, not 1
Output: final norm, tied head (embed_tokens), then 30 * tanh(logits / 30) softcapping.

Where the projections after a norm are W4A8, the norm and their quantizer run as one op
(add_rms_norm_quantize; Gemma4DecoderLayer.fuses_input_norm / fuses_pre_feedforward_norm):
input_layernorm -> q/k/v, and h + post_attention_layernorm(a) -> pre_feedforward_layernorm ->
gate/up, so the normed activations are never written out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mila import nn
from jax_mila.gemma4 import cache as kv
from jax_mila.gemma4.attention import Gemma4Attention
from jax_mila.gemma4.cache import KVCache
from jax_mila.gemma4.config import Gemma4Config, LayerSpec
from jax_mila.gemma4.mlp import Gemma4MLP, gelu_tanh
from jax_mila.gemma4.moe import Gemma4Experts, Gemma4Router
from jax_mila.gemma4.rope import rope_tables
from jax_mila.nn.linear import quantized_ops
from jax_mila.parallel.layout import CHUNK, SINGLE_DEVICE, ZIGZAG, Layout

MODES = ("full", "prefill", "decode", "chunk")


def check_input_ids(input_ids, vocab_size: int, *, name: str = "input_ids",
                    rank: int = 2) -> jax.Array:
    """``input_ids`` [B, S] (``rank=2``; ``rank=1``: a token vector [B], e.g. decode's) as
    int32, once they are known to be integer token ids in [0, vocab_size), with B >= 1 and
    S >= 1. ``name`` is the argument the errors name.

    Nothing downstream would fail on bad ids: a cast truncates float ids, and the embedding
    gather wraps -1 to the last row and gives non-finite logits past the table. Only concrete
    ids are range-checked: traced ones (inside jit) have no values at trace time, and checking
    them on the device would cost a sync in every jitted step; their dtype is still checked.
    Concrete ids on a device are copied to the host for the check ([B, S] int32, small)."""
    layout = "[B, S]" if rank == 2 else "[B]"
    ids = input_ids if isinstance(input_ids, jax.Array) else np.asarray(input_ids)
    if ids.ndim != rank or (rank == 2 and ids.shape[1] < 1):
        raise ValueError(f"{name} must be int32 {layout}" + (" with S >= 1" if rank == 2 else "")
                         + f", got shape {list(ids.shape)}")
    if ids.shape[0] < 1:
        raise ValueError(f"{name}: an empty batch is not supported (B >= 1), got shape "
                         f"{list(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype} "
                         "(supported: integer dtypes, cast to int32)")
    if not isinstance(ids, jax.core.Tracer) and getattr(ids, "is_fully_addressable", True):
        host = np.asarray(ids)
        bad = np.unique(host[(host < 0) | (host >= vocab_size)]).tolist()
        if bad:
            shown = f"{bad[:10]}" + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            raise ValueError(f"{name}: {shown} outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(ids, jnp.int32)


def _scale(x: jax.Array, factor: float) -> jax.Array:
    """x * a Python float, as PyTorch computes it: in float32, rounded once to x.dtype (the
    factor itself is not rounded to bf16 first)."""
    return (x.astype(jnp.float32) * jnp.float32(factor)).astype(x.dtype)


class Gemma4DecoderLayer(nnx.Module):
    def __init__(self, cfg: Gemma4Config, spec: LayerSpec, *, backend, dtype, param_dtype,
                 quantize, rngs: nnx.Rngs):
        self.spec = spec
        common = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, quantize=quantize, rngs=rngs)
        norm = lambda: nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Gemma4Attention(cfg, spec, **common)
        self.mlp = Gemma4MLP(cfg.hidden_size, spec.intermediate_size, **common)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nnx.Param(jnp.ones((1,), param_dtype))
        self.has_ple = cfg.has_ple
        if self.has_ple:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, p, **common)
            self.per_layer_projection = nn.Linear(p, cfg.hidden_size, **common)
            self.post_per_layer_input_norm = norm()
        self.has_moe = cfg.enable_moe_block
        if self.has_moe:
            self.router = Gemma4Router(cfg.hidden_size, cfg.num_experts, cfg.top_k_experts,
                                       eps=cfg.rms_norm_eps, **common)
            self.experts = Gemma4Experts(cfg.hidden_size, cfg.num_experts,
                                         cfg.moe_intermediate_size, **common)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()

    def fuses_input_norm(self, dtype, layout: Layout = SINGLE_DEVICE) -> bool:
        """Whether input_layernorm(h) and the quantizer of the attention's q/k/v projections run
        as one op (add_rms_norm_quantize without a branch) for a residual stream of ``dtype``
        in a step of ``layout``.

        Only where that op computes what the layers compute (its CPU path, the reference, is
        their expression, so CPU results are unchanged bit for bit):
        - h is bfloat16 (a bf16 model): the op takes bf16 rows and rounds the norm to bf16, as
          rms_norm does for a bf16 h; a float32 model's norm stays float32 up to the
          projections' own bf16 cast, which the op does not do;
        - the attention takes quantized input: q_proj (and k_proj, v_proj where the layer has
          them) all W4A8 on one backend, no tensor parallelism;
        - input_layernorm has a weight (a decoder norm always has)."""
        return (jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
                and self.input_layernorm.with_scale
                and self.self_attn.takes_quantized_input(layout))

    def fuses_pre_feedforward_norm(self, dtype, branch_dtype,
                                   layout: Layout = SINGLE_DEVICE) -> bool:
        """Whether h + post_attention_layernorm(a), pre_feedforward_layernorm and the quantizer
        of the MLP's gate/up projections run as one op (add_rms_norm_quantize with the
        attention output as its branch), for h of ``dtype`` and a of ``branch_dtype``.

        As fuses_input_norm: h and a bfloat16 (the op's bf16 add and roundings are the model's),
        gate_proj and up_proj W4A8 on one backend without tensor parallelism, both norms with a
        weight and one eps (the op has one). MoE layers fuse it too: h, which the router and
        the experts read, is one of the op's results; their own norms stay as they are."""
        bf16 = jnp.dtype(jnp.bfloat16)
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        return (jnp.dtype(dtype) == bf16 and jnp.dtype(branch_dtype) == bf16
                and post.with_scale and pre.with_scale and post.eps == pre.eps
                and self.mlp.takes_quantized_input(layout))

    def moe(self, h, routing_out: list | None = None):
        """The routed experts' output for the residual stream h [..., H]. Where the experts
        take quantized rows, pre_feedforward_layernorm_2 and their quantizer run as one op
        (add_rms_norm_quantize without a branch; as fuses_input_norm, for a bf16 h).
        ``routing_out``: a list that receives the expert indices [N, k] (the fidelity check)."""
        flat = h.reshape(-1, h.shape[-1])
        weights, idx = self.router(flat)
        if routing_out is not None:
            routing_out.append(idx)
        norm = self.pre_feedforward_layernorm_2
        if (jnp.dtype(h.dtype) == jnp.dtype(jnp.bfloat16) and norm.with_scale
                and self.experts.takes_quantized_input()):
            ops = quantized_ops(self.experts.gate_up_proj.backend)
            x = nn.QuantizedRows(*ops.add_rms_norm_quantize(flat, norm_weight=norm.weight[...],
                                                            eps=norm.eps))
        else:
            x = norm(flat)
        return self.experts(x, weights, idx).reshape(h.shape)

    def __call__(self, h, ple_i, cos, sin, *, layout: Layout = SINGLE_DEVICE,
                 routing_out: list | None = None, **attn_kwargs):
        """h [B, T, H] -> (h, the attention's K/V view, its new cache entry); ``layout``: the
        step's split over the mesh, passed on to the attention and the MLP; ``attn_kwargs``:
        Gemma4Attention's."""
        if self.fuses_input_norm(h.dtype, layout):
            ops, norm = quantized_ops(self.self_attn.q_proj.backend), self.input_layernorm
            x = nn.QuantizedRows(*ops.add_rms_norm_quantize(h, norm_weight=norm.weight[...],
                                                            eps=norm.eps))
        else:
            x = self.input_layernorm(h)
        a, kv_view, entry = self.self_attn(x, cos, sin, layout=layout, **attn_kwargs)
        if self.fuses_pre_feedforward_norm(h.dtype, a.dtype, layout):
            post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
            h, q, s = quantized_ops(self.mlp.gate_proj.backend).add_rms_norm_quantize(
                h, a, branch_weight=post.weight[...], norm_weight=pre.weight[...], eps=pre.eps)
            f = self.mlp(nn.QuantizedRows(q, s), layout)
        else:
            h = h + self.post_attention_layernorm(a)
            f = self.mlp(self.pre_feedforward_layernorm(h), layout)
        if self.has_moe:
            f = self.post_feedforward_layernorm_1(f) + self.post_feedforward_layernorm_2(
                self.moe(h, routing_out))
        h = h + self.post_feedforward_layernorm(f)
        if self.has_ple:
            g = gelu_tanh(self.per_layer_input_gate(h)) * ple_i
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar[...].astype(h.dtype), kv_view, entry


def run_layers(layers, h, tables, entries, *, offset, mode, max_len, valid, first_chunk=False,
               ple=None, kv_sources=frozenset(), return_layers=False,
               layout: Layout = SINGLE_DEVICE, routing_out: list | None = None):
    """Decoder layers ``layers`` (consecutive, with their cache ``entries``: None where a layer
    has none) on the hidden state h, as Gemma4ForCausalLM.hidden_states runs them; the engine's
    layer pieces run slices of the stack through it too (PieceRunner), so that both compute
    the same. ``tables``: rope_tables per layer type; ``ple``: [B, T, len(layers), D]
    per-layer inputs or None; ``kv_sources``: indices (into ``layers``) of the layers whose K/V
    view the KV-shared layers of their type read; ``layout``: the step's split over the mesh.
    Returns (h, new entries, each layer's output or None)."""
    shared, new_entries, outputs = {}, [], [] if return_layers else None
    for i, (layer, entry) in enumerate(zip(layers, entries)):
        spec = layer.spec
        h, kv_view, new_entry = layer(
            h, ple[:, :, i] if ple is not None else None, *tables[spec.layer_type],
            offset=offset, mode=mode, entry=entry, max_len=max_len, valid=valid,
            first_chunk=first_chunk, layout=layout, routing_out=routing_out,
            shared=shared.get(spec.layer_type) if spec.is_kv_shared else None)
        if i in kv_sources:
            shared[spec.layer_type] = kv_view
        if return_layers:
            outputs.append(h)
        new_entries.append(new_entry)
    return h, new_entries, outputs


@dataclasses.dataclass(frozen=True)
class PieceRunner:
    """Runs one piece of a prefill chunk: consecutive decoder layers given only their modules
    (Gemma4ForCausalLM.piece_modules), each layer exactly as hidden_states(mode="chunk") runs
    it, on one device. The engine jits one call per piece with just that piece's weights as
    arguments (jax_mila.engine.pieces); this object is a static argument there, hashable and
    compared by value (the RoPE specs per layer type and the model's dtype)."""

    rope: tuple  # (layer type, RopeSpec) pairs
    dtype: Any

    def __call__(self, modules, x, entries, *, lengths, valid, max_len, first_chunk):
        """``modules`` (embedding or None, layers): x is the chunk's token ids where the piece
        has the embedding, else the hidden state before its first layer; ``lengths``: the
        cache's (KVCache.length). Returns (the hidden state after its last layer, its layers'
        new cache entries)."""
        embed, layers = modules
        h = embed(x) if embed is not None else x
        offset = kv.chunk_start(lengths)
        positions = offset + jnp.arange(h.shape[1], dtype=jnp.int32)
        tables = {layer_type: rope_tables(spec, positions, self.dtype)
                  for layer_type, spec in self.rope}
        h, new_entries, _ = run_layers(layers, h, tables, entries, offset=offset, mode="chunk",
                                       max_len=max_len, valid=valid, first_chunk=first_chunk)
        return h, tuple(new_entries)


class Gemma4ForCausalLM(nnx.Module):
    """The text decoder with its (tied) output head.

    ``model(input_ids)`` with int32 [B, S] returns softcapped logits [B, S, vocab] in ``dtype``.
    Prefill and cached decoding go through jax_mila.gemma4.prefill / generate (jax_mila.engine),
    which run the model through hidden_states, logits and the methods under "what the engine
    calls" below.
    """

    def __init__(self, cfg: Gemma4Config, *, dtype=jnp.bfloat16, param_dtype=None,
                 backend: str = "auto", quantize=None, rngs: nnx.Rngs | None = None):
        nn.check_backend(backend)
        nn.check_quantize(quantize)
        param_dtype = dtype if param_dtype is None else param_dtype
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config, self.dtype, self.backend = cfg, dtype, backend
        common = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, quantize=quantize, rngs=rngs)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, scale=cfg.embed_scale,
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.has_ple:
            n, p = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embed(cfg.vocab_size_per_layer_input, n * p,
                                                   scale=p**0.5, dtype=dtype,
                                                   param_dtype=param_dtype, rngs=rngs)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, n * p, **common)
            self.per_layer_projection_norm = nn.RMSNorm(p, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List([Gemma4DecoderLayer(cfg, spec, **common) for spec in cfg.layers])
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, **common)

    # ---- pieces -------------------------------------------------------------------------

    def per_layer_inputs(self, input_ids, h):
        """PLE [B, T, L, P]: (rmsnorm(h @ W * H^-0.5) + E_ple[ids] * sqrt(P)) * 2^-0.5.

        The packed table is layer-major (column = layer * P + d)."""
        cfg = self.config
        shape = input_ids.shape + (cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        tok = self.embed_tokens_per_layer(input_ids).reshape(shape)
        ctx = _scale(self.per_layer_model_projection(h), cfg.hidden_size**-0.5)
        ctx = self.per_layer_projection_norm(ctx.reshape(shape))
        return _scale(ctx + tok, 2.0**-0.5)

    def logits(self, h):
        """Final norm, output head and softcap of hidden states [.., H]."""
        h = self.norm(h)
        logits = self.embed_tokens.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            c = jnp.asarray(cap, logits.dtype)
            logits = jnp.tanh(logits / c) * c
        return logits

    def hidden_states(self, input_ids, *, mode: str = "full", cache: KVCache | None = None,
                      max_len: int = 0, valid=None, first_chunk: bool = False,
                      return_layers: bool = False, return_routing: bool = False,
                      layout: Layout = SINGLE_DEVICE):
        """Runs the decoder stack. Returns (hidden [B, T, H] before the final norm, new cache).

        mode "full": no cache. "prefill": positions from 0, returns a new KVCache with capacity
        ``max_len``. "decode": one token per row, row b's at position ``cache.length[b]``.
        "chunk": a prefill chunk at positions p + arange(T), p = max(cache.length)
        (cache.chunk_start), whose first ``valid`` (traced; a scalar, or [B] for rows of
        different lengths) tokens are real; the returned cache's lengths grow by ``valid``.
        ``first_chunk`` (static, mode "chunk"): the caller promises cache.length == 0, so the
        sliding layers attend over the chunk's own keys (cache.chunk_update's ``first``).

        ``layout`` (jax_mila.parallel.Layout): how the step that traces this call splits its
        work over the mesh (inside jax.shard_map); the default is one device. With seq_split
        "zigzag" input_ids are this device's tokens of a zig-zag sharded sequence (mode "full"
        only), with "chunk" its slice of a prefill chunk (mode "chunk" only).

        ``return_layers=True`` appends a third result: every decoder layer's output [B, T, H]
        stacked to [L, B, T, H] (HF's output_hidden_states without the embedding), so the
        fidelity check can show how errors compound layer by layer. ``return_routing=True``
        appends the expert indices of every mixture-of-experts layer, [L_moe, B T, k] int32
        (the fidelity check compares the paths' expert choices)."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} (supported: {MODES})")
        cfg = self.config
        input_ids = jnp.asarray(input_ids, jnp.int32)
        t = input_ids.shape[1]
        cached = mode in ("decode", "chunk")
        if mode == "decode":  # each row at its own position
            offset = cache.length
        elif mode == "chunk":
            offset = kv.chunk_start(cache.length)
        else:
            offset = jnp.int32(0)
        max_len = cache.max_len if cached else max_len
        valid = t if valid is None else valid
        if layout.seq_split == ZIGZAG and mode != "full":
            raise ValueError(f"context parallelism runs mode 'full' only, got {mode!r}")
        if layout.seq_split == CHUNK and mode != "chunk":
            raise ValueError(f"chunked context parallelism runs mode 'chunk' only, got {mode!r}")
        if mode == "decode":
            positions = offset[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        else:
            positions = layout.positions(offset, t)
        h = self.embed_tokens(input_ids)
        ple = self.per_layer_inputs(input_ids, h) if cfg.has_ple else None
        tables = {lt: rope_tables(spec, positions, self.dtype) for lt, spec in cfg.rope.items()}
        sources = set(cfg.kv_sources.values()) if cfg.num_kv_shared_layers else set()
        entries = [(cache.keys[i], cache.values[i]) if cached and not layer.spec.is_kv_shared
                   else None for i, layer in enumerate(self.layers)]
        routing = [] if return_routing else None
        h, new_entries, layer_outputs = run_layers(
            self.layers, h, tables, entries, offset=offset, mode=mode, max_len=max_len,
            valid=valid, first_chunk=first_chunk, ple=ple, kv_sources=sources,
            return_layers=return_layers, layout=layout, routing_out=routing)
        keys = [e[0] if e is not None else None for e in new_entries]
        values = [e[1] if e is not None else None for e in new_entries]
        if mode == "prefill":
            length = jnp.full((input_ids.shape[0],), t, jnp.int32)
        elif cached:  # a row whose prompt ended in an earlier chunk has valid 0 here
            length = cache.length + valid
        new_cache = None if mode == "full" else KVCache(
            keys=tuple(keys), values=tuple(values), length=length, max_len=max_len,
            seq_layout=cache.seq_layout if cached else ())
        extra = (jnp.stack(layer_outputs),) if return_layers else ()
        if return_routing:
            extra += (jnp.stack(routing) if routing else jnp.zeros((0, 0, 0), jnp.int32),)
        if extra:
            return (h, new_cache) + extra
        return h, new_cache

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Softcapped logits [B, S, vocab] (dtype of the model) for int32 ids [B, S]
        (``check_input_ids``: integer ids; concrete ones in [0, vocab_size))."""
        h, _ = self.hidden_states(check_input_ids(input_ids, self.config.vocab_size))
        return self.logits(h)

    # ---- what the engine calls --------------------------------------------------------------

    def check_input_ids(self, input_ids, *, name: str = "input_ids", rank: int = 2) -> jax.Array:
        """``input_ids`` as int32 [B, S] (``rank=1``: a token vector [B]), checked against this
        model's vocabulary (the module's check_input_ids)."""
        return check_input_ids(input_ids, self.config.vocab_size, name=name, rank=rank)

    def empty_cache(self, batch: int, max_len: int, *, full_dtype=None,
                    seq_layout=()) -> KVCache:
        """A zero KVCache of capacity ``max_len`` for this model, at length 0 (cache.empty)."""
        return kv.empty(self.config, batch, max_len, self.dtype, full_dtype=full_dtype,
                        seq_layout=seq_layout)

    def runs_in_pieces(self) -> bool:
        """Whether a prefill chunk may run in pieces of consecutive layers, each its own step
        (PieceRunner): only where a layer reads nothing but its own cache entry and the hidden
        state before it, so not with per-layer embeddings or KV-shared layers."""
        cfg = self.config
        return not (cfg.has_ple or cfg.num_kv_shared_layers) and len(self.layers) > 0

    def piece_modules(self, start: int, stop: int) -> tuple:
        """The modules a piece of layers [start, stop) runs with: (the embedding for the first
        piece, else None; the layers)."""
        return (self.embed_tokens if start == 0 else None, tuple(self.layers[start:stop]))

    def piece_runner(self) -> PieceRunner:
        """The static function that runs a piece's modules (PieceRunner)."""
        return PieceRunner(rope=tuple(sorted(self.config.rope.items())), dtype=self.dtype)
