"""Gemma4Config: the text-decoder configuration read from a checkpoint's config.json.

Accepts every layout the released checkpoints and transformers use:
- nested (``model_type`` gemma4 / gemma4_unified, decoder fields under ``text_config``) or
  flat (``model_type`` gemma4_text / gemma4_unified_text);
- full-attention geometry either as the flat ``global_head_dim`` / ``num_global_key_value_heads``
  keys of the original Hub configs, or as ``per_layer_config`` (transformers >= 5.15).
Anything this implementation does not reproduce exactly is refused with a ValueError naming
the field and why, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from typing import Any

log = logging.getLogger("jax_mila")

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
NESTED_MODEL_TYPES = ("gemma4", "gemma4_unified")
FLAT_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
ROPE_TYPES = ("default", "proportional")
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")

DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _fail(field: str, why: str):
    raise ValueError(f"Gemma4Config: unsupported {field}: {why}")


def _token_ids(value, field: str) -> tuple[int, ...]:
    """A config's token id or list of ids (None: none) as a tuple of ints."""
    ids = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        _fail(field, f"{value!r} (expected a token id or a list of token ids)")
    return tuple(ids)


def _merged(*groups: tuple[int, ...]) -> tuple[int, ...]:
    """The ids of ``groups`` in order, each once."""
    return tuple(dict.fromkeys(t for g in groups for t in g))


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type: ``inv_freq[j] = 1 / theta^(2j / head_dim)`` for the first
    ``rotated`` angles, zero for the rest (proportional RoPE), divided by ``factor``."""

    theta: float
    head_dim: int
    rotated: int  # number of non-zero angles (head_dim // 2 for the default RoPE)
    factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Geometry and role of one decoder layer, derived from the config."""

    index: int
    layer_type: str
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool            # full layers with attention_k_eq_v: no v_proj, V = raw k_proj output
    kv_source: int | None   # KV-shared layers: the layer whose (normed, RoPE'd) K/V they reuse
    intermediate_size: int  # dense MLP width (doubled on KV-shared layers with use_double_wide_mlp)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def is_kv_shared(self) -> bool:
        return self.kv_source is not None


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """The fields of a Gemma 4 text decoder that change its computation."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, RopeSpec]
    per_layer: dict[int, dict[str, int]]  # overrides of head_dim / num_key_value_heads by layer
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    max_position_embeddings: int = 131_072
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    # The ids that end generation (engine.generate's stop_tokens): config.json's eos_token_id,
    # top level and text_config (instruction-tuned checkpoints: 1 and 106, <turn|>), and
    # generation_config.json's where from_pretrained finds one.
    eos_token_id: tuple[int, ...] = (1,)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Gemma4Config":
        """Reads ``config.json`` from a checkpoint directory (or the file itself); the
        eos ids of a generation_config.json beside it are added to ``eos_token_id``."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            cfg = cls.from_dict(json.load(f))
        generation = os.path.join(os.path.dirname(path), "generation_config.json")
        if os.path.isfile(generation):
            with open(generation) as f:
                extra = _token_ids(json.load(f).get("eos_token_id"), "generation_config.json")
            cfg = dataclasses.replace(cfg, eos_token_id=_merged(cfg.eos_token_id, extra))
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Gemma4Config":
        """Builds the config from a parsed config.json (nested or flat)."""
        model_type = raw.get("model_type")
        if model_type in NESTED_MODEL_TYPES:
            if not isinstance(raw.get("text_config"), dict):
                _fail("text_config", f"model_type {model_type!r} needs a 'text_config' object")
            text = dict(raw["text_config"])
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
            if raw.get("eos_token_id") is not None:  # IT checkpoints: [1, 106] at the top level
                text["eos_token_id"] = list(_merged(
                    _token_ids(raw["eos_token_id"], "eos_token_id"),
                    _token_ids(text.get("eos_token_id"), "text_config.eos_token_id")))
            text_type = text.get("model_type", model_type + "_text")
            if text_type not in FLAT_MODEL_TYPES:
                _fail("text_config.model_type", f"{text_type!r} (supported: {FLAT_MODEL_TYPES})")
        elif model_type in FLAT_MODEL_TYPES:
            text, text_type = dict(raw), model_type
        else:
            _fail("model_type", f"{model_type!r} (supported: {NESTED_MODEL_TYPES + FLAT_MODEL_TYPES})")
        return cls._from_text_dict(text, text_type)

    @classmethod
    def _from_text_dict(cls, t: dict[str, Any], model_type: str) -> "Gemma4Config":
        unified = model_type == "gemma4_unified_text"
        g = t.get
        num_layers = int(g("num_hidden_layers", 30))
        layer_types = g("layer_types")
        if layer_types is None:  # HF default: every 6th layer is full
            layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            _fail("layer_types", f"{len(layer_types)} entries for num_hidden_layers={num_layers}")
        for i, lt in enumerate(layer_types):
            if lt not in LAYER_TYPES:
                _fail("layer_types", f"layer {i} is {lt!r} (supported: {LAYER_TYPES})")
        if layer_types[-1] != FULL:  # transformers forces this too (with a warning)
            log.warning("Gemma4Config: last layer must be full attention; forcing it, as HF does")
            layer_types[-1] = FULL

        activation = g("hidden_activation", "gelu_pytorch_tanh")
        if activation not in SUPPORTED_ACTIVATIONS:
            _fail("hidden_activation", f"{activation!r} (supported: {SUPPORTED_ACTIVATIONS})")
        if g("attention_bias", False):
            _fail("attention_bias", "true; Gemma 4 projections have no biases")
        if g("use_bidirectional_attention") not in (None, "vision"):
            _fail("use_bidirectional_attention",
                  f"{g('use_bidirectional_attention')!r}; only causal text attention is implemented "
                  "('vision' is fine: it only affects image tokens)")
        if g("attention_logit_softcapping") is not None:
            _fail("attention_logit_softcapping", "Gemma 4 has no attention-logit softcap")

        head_dim = int(g("head_dim", 256))
        per_layer = cls._per_layer_overrides(t, layer_types, head_dim)
        rope = cls._rope_specs(g("rope_parameters"), layer_types, per_layer, head_dim)

        moe = bool(g("enable_moe_block", False)) and not unified
        moe_inter = g("moe_intermediate_size") or g("expert_intermediate_size") or 0
        if moe and not (g("num_experts") and g("top_k_experts") and moe_inter):
            _fail("enable_moe_block", "true needs num_experts, top_k_experts and moe_intermediate_size")
        ple = 0 if unified else int(g("hidden_size_per_layer_input", 256) or 0)
        eos = _token_ids(g("eos_token_id", 1), "eos_token_id")

        cfg = cls(
            model_type=model_type,
            vocab_size=int(g("vocab_size", 262_144)),
            hidden_size=int(g("hidden_size", 2304)),
            intermediate_size=int(g("intermediate_size", 9216)),
            num_hidden_layers=num_layers,
            num_attention_heads=int(g("num_attention_heads", 8)),
            num_key_value_heads=int(g("num_key_value_heads", 4)),
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            sliding_window=int(g("sliding_window", 1024 if unified else 512)),
            rope=rope,
            per_layer=per_layer,
            rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
            final_logit_softcapping=g("final_logit_softcapping"),
            tie_word_embeddings=bool(g("tie_word_embeddings", True)),
            attention_k_eq_v=bool(g("attention_k_eq_v", False)),
            num_kv_shared_layers=int(g("num_kv_shared_layers", 0) or 0),
            use_double_wide_mlp=bool(g("use_double_wide_mlp", False)),
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=int(g("vocab_size_per_layer_input", 262_144) or 0) if ple else 0,
            enable_moe_block=moe,
            num_experts=int(g("num_experts") or 0) if moe else 0,
            top_k_experts=int(g("top_k_experts") or 0) if moe else 0,
            moe_intermediate_size=int(moe_inter) if moe else 0,
            max_position_embeddings=int(g("max_position_embeddings", 262_144 if unified else 131_072)),
            pad_token_id=g("pad_token_id", 0),
            bos_token_id=g("bos_token_id", 2),
            eos_token_id=eos,
        )
        cfg.validate()
        return cfg

    @staticmethod
    def _per_layer_overrides(t, layer_types, head_dim) -> dict[int, dict[str, int]]:
        """Per-layer head_dim / num_key_value_heads, from either config format (as HF derives it)."""
        n = len(layer_types)
        if t.get("per_layer_config") is not None:
            out = {}
            for key, entry in t["per_layer_config"].items():
                try:
                    idx = int(key)
                except (TypeError, ValueError):
                    _fail("per_layer_config", f"key {key!r} is not a layer index")
                if not 0 <= idx < n:
                    _fail("per_layer_config", f"layer {idx} is out of range for {n} layers")
                extra = set(entry) - set(PER_LAYER_KEYS)
                if extra:
                    _fail("per_layer_config", f"layer {idx} overrides {sorted(extra)}; only "
                                              f"{PER_LAYER_KEYS} are supported")
                out[idx] = {k: int(v) for k, v in entry.items() if v is not None}
            return out
        # Flat (original Hub) form. HF: full layers get head_dim = global_head_dim (default 512);
        # their KV heads become num_global_key_value_heads only when attention_k_eq_v is set.
        override = {"head_dim": int(t.get("global_head_dim") or 512)}
        if t.get("attention_k_eq_v", False) and t.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = int(t["num_global_key_value_heads"])
        return {i: dict(override) for i, lt in enumerate(layer_types) if lt == FULL}

    @staticmethod
    def _rope_specs(params, layer_types, per_layer, head_dim) -> dict[str, RopeSpec]:
        params = params if params is not None else DEFAULT_ROPE
        out = {}
        for lt in sorted(set(layer_types)):
            dims = {per_layer.get(i, {}).get("head_dim", head_dim)
                    for i, t in enumerate(layer_types) if t == lt}
            if len(dims) != 1:  # HF computes one inv_freq per layer type
                _fail("per_layer_config", f"{lt} layers have different head dims {sorted(dims)}")
            hd = dims.pop()
            p = params.get(lt) if isinstance(params, dict) else None
            if not isinstance(p, dict):
                _fail("rope_parameters", f"no entry for {lt!r}")
            rope_type = p.get("rope_type", "default")
            if rope_type not in ROPE_TYPES:
                _fail(f"rope_parameters.{lt}.rope_type", f"{rope_type!r} (supported: {ROPE_TYPES})")
            if rope_type == "default":
                if p.get("factor", 1.0) not in (None, 1.0):
                    _fail(f"rope_parameters.{lt}.factor", "the default RoPE has no scaling factor")
                rotated, factor = hd // 2, 1.0
            else:  # proportional: int(fraction * head_dim // 2) angles, the rest pass through
                rotated = int(float(p.get("partial_rotary_factor", 1.0)) * hd // 2)
                factor = float(p.get("factor", 1.0) or 1.0)
            out[lt] = RopeSpec(theta=float(p["rope_theta"]), head_dim=hd, rotated=rotated,
                               factor=factor)
        return out

    def validate(self) -> None:
        """Checks the cross-field constraints; raises ValueError naming the field."""
        if self.num_kv_shared_layers >= self.num_hidden_layers or self.num_kv_shared_layers < 0:
            _fail("num_kv_shared_layers", f"{self.num_kv_shared_layers} with "
                  f"{self.num_hidden_layers} layers: some layers must produce K/V")
        for spec in self.layers:
            if self.num_attention_heads % spec.num_kv_heads:
                _fail("num_key_value_heads", f"layer {spec.index}: {self.num_attention_heads} query "
                      f"heads are not a multiple of {spec.num_kv_heads} KV heads")
            if spec.head_dim % 2:
                _fail("head_dim", f"layer {spec.index}: {spec.head_dim} is odd (RoPE halves it)")
        if self.enable_moe_block and not 0 < self.top_k_experts <= self.num_experts:
            _fail("top_k_experts", f"{self.top_k_experts} with {self.num_experts} experts")
        if self.sliding_window < 1:
            _fail("sliding_window", f"{self.sliding_window}")

    # ---- derived ------------------------------------------------------------------------

    def __hash__(self):  # dict-valued fields: hash the (deterministic) repr instead
        return hash(repr(self))

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @functools.cached_property
    def kv_sources(self) -> dict[str, int]:
        """Layer type -> the last non-shared layer of that type (whose K/V shared layers reuse).

        Trap: this is NOT a modulo mapping; each shared layer reuses the K/V of the last
        producing layer of its own type (E2B: sliding 13, full 14)."""
        first = self.first_kv_shared_layer
        out = {}
        for lt in set(self.layer_types):
            producers = [i for i in range(first) if self.layer_types[i] == lt]
            if not producers:
                _fail("num_kv_shared_layers", f"no unshared {lt} layer produces the K/V that "
                      f"shared {lt} layers would reuse")
            out[lt] = producers[-1]
        return out

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        sources = self.kv_sources if self.num_kv_shared_layers else {}
        out = []
        for i, lt in enumerate(self.layer_types):
            o = self.per_layer.get(i, {})
            shared = i >= self.first_kv_shared_layer
            out.append(LayerSpec(
                index=i, layer_type=lt,
                head_dim=o.get("head_dim", self.head_dim),
                num_kv_heads=o.get("num_key_value_heads", self.num_key_value_heads),
                k_eq_v=self.attention_k_eq_v and lt == FULL,
                kv_source=sources[lt] if shared else None,
                intermediate_size=self.intermediate_size * (2 if shared and self.use_double_wide_mlp else 1),
            ))
        return tuple(out)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @property
    def has_ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0
