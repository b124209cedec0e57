"""Tiny random Gemma 4 checkpoints built with Hugging Face transformers (test-only helper).

Each config covers some of the features a port can get wrong; together they cover all of
them: PLE, KV sharing, double-wide MLP, MoE, K=V full layers with one KV head, the
gemma4_unified classes, both config formats (flat global_head_dim vs per_layer_config),
nested text_config with the ``model.language_model.`` prefix, and sequences longer than the
sliding window. Norm weights, router scales and ``layer_scalar`` are perturbed away from 1.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

S, F = "sliding_attention", "full_attention"

CONFIGS = {
    # E2B-like: 4:1 pattern, PLE, KV sharing (sources 3 sliding, 4 full) and double-wide MLP.
    "e2b_like": dict(
        cls="gemma4", vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        layer_types=[S, S, S, S, F, S, S, F], num_kv_shared_layers=3, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, sliding_window=4,
        final_logit_softcapping=30.0),
    # 26B-like: MoE (shared dense MLP + routed experts) with K=V full layers.
    "moe_26b_like": dict(
        cls="gemma4", vocab_size=101, hidden_size=32, intermediate_size=20, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=2, attention_k_eq_v=True, layer_types=[S, S, F, F],
        enable_moe_block=True, num_experts=6, top_k_experts=2, moe_intermediate_size=16,
        hidden_size_per_layer_input=0, sliding_window=5, final_logit_softcapping=30.0),
    # 31B-like: K=V full layers with a single KV head, 5:1 pattern; config.json rewritten to the
    # original Hub form (flat global_head_dim / num_global_key_value_heads). Untied output
    # head (no released model unties it, but the config allows it): lm_head.weight is loaded.
    "dense_31b_like_flat": dict(tie_word_embeddings=False,
        cls="gemma4", flat_config=True, vocab_size=89, hidden_size=48, intermediate_size=40,
        num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=[S, S, S, S, S, F, F], hidden_size_per_layer_input=0, sliding_window=5,
        final_logit_softcapping=30.0),
    # 12B-like: the gemma4_unified classes, K=V with one KV head, wrapped in a nested
    # gemma4_unified config with model.language_model.* names and a vision tensor to skip.
    "unified_12b_like_nested": dict(
        cls="gemma4_unified", nested=True, vocab_size=83, hidden_size=32, intermediate_size=36,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=[S, S, F, S, S, F], sliding_window=4, final_logit_softcapping=30.0),
    # transformers' own tiny test config (PLE + MoE + KV sharing together, no softcap),
    # with the window shrunk so the sequence is longer than it.
    "hf_tester": dict(
        cls="gemma4", vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, intermediate_size=37,
        layer_types=[S, F, S, F], num_kv_shared_layers=2, vocab_size_per_layer_input=99,
        hidden_size_per_layer_input=16, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=16, sliding_window=3),
}


# W4A8 test models (tests/test_gemma4_quantized.py; not in the parity sweep): every size a
# multiple of 128 where the W4A8 kernel needs it (hidden, intermediate, q heads * head_dim), so
# the attention and MLP linears are quantized; PLE's 16 -> 128 projection and the MoE router
# stay dense. Covers PLE, KV sharing, double-wide MLP, MoE and K=V full layers.
QUANTIZABLE_CONFIGS = {
    "w4a8_all_features": dict(
        cls="gemma4", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F, S, F],
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=64, sliding_window=8, final_logit_softcapping=30.0),
}


# The attention kernels' head dims (256 sliding, 512 global, as 12B/31B) at toy width, so
# backend="mila" runs the flash-attention kernels on a GPU (every CONFIGS head dim falls back).
# qk_norm_scale shrinks the q/k norm weights: with unit-RMS q and k at head_dim 512 and scale 1,
# random scores have std ~sqrt(512) = 23, a softmax so peaked that bf16 rounding of one score
# flips it (HF itself then sits up to ~4 away from float32); 0.2 gives trained-model-like
# score magnitudes, so the suite's bf16 tolerances apply unchanged.
KERNEL_SHAPE_CONFIGS = {
    "kernel_dims_12b_like": dict(
        cls="gemma4_unified", vocab_size=97, hidden_size=64, intermediate_size=96,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
        global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=[S, S, F, S, F], sliding_window=5, final_logit_softcapping=30.0,
        qk_norm_scale=0.2),
}


def _spec(name: str) -> dict:
    for table in (CONFIGS, QUANTIZABLE_CONFIGS, KERNEL_SHAPE_CONFIGS):
        if name in table:
            return table[name]
    raise KeyError(name)


def _classes(kind: str):
    if kind == "gemma4":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
        return Gemma4TextConfig, Gemma4ForCausalLM
    from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig
    return Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM


def build(name: str, *, seed: int = 0, dtype=torch.float32):
    """A random HF model (eval, eager attention) for CONFIGS[name]."""
    spec = dict(_spec(name))
    config_cls, model_cls = _classes(spec.pop("cls"))
    spec.pop("flat_config", None), spec.pop("nested", None)
    qk_norm_scale = spec.pop("qk_norm_scale", None)
    cfg = config_cls(initializer_range=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=1, **spec)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("scale"):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
        if qk_norm_scale is not None:
            for pname, p in model.named_parameters():
                if pname.endswith(("q_norm.weight", "k_norm.weight")):
                    p.mul_(qk_norm_scale)
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):
                b.copy_(1 + 0.3 * torch.randn(b.shape, generator=g))
    model.generation_config.eos_token_id = None  # greedy runs must produce every token
    return model.to(dtype)


def save(model, name: str, directory: str) -> str:
    """save_pretrained, then rewrite into the variant's on-disk form. Returns the directory."""
    model.save_pretrained(directory)
    spec = _spec(name)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if spec.get("flat_config"):
        per_layer = cfg.pop("per_layer_config")
        full = next(iter(per_layer.values()))
        cfg["global_head_dim"] = full["head_dim"]
        cfg["num_global_key_value_heads"] = full.get("num_key_value_heads")
    if spec.get("nested"):
        top = "gemma4_unified" if cfg["model_type"].startswith("gemma4_unified") else "gemma4"
        cfg = {"model_type": top, "architectures": ["ForConditionalGeneration"], "text_config": cfg,
               "vision_config": {"hidden_size": 8}, "tie_word_embeddings": True}
        weights_path = os.path.join(directory, "model.safetensors")
        tensors = load_file(weights_path)
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        tensors["model.embed_vision.embedding_projection.weight"] = torch.zeros(4, 8)
        save_file(tensors, weights_path, metadata={"format": "pt"})
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return directory


def random_ids(vocab: int, batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)
