"""Regenerates models/embedded/: a tiny Gemma 4 checkpoint with deterministic random weights.

It is a genuine Hugging Face checkpoint (transformers' Gemma4ForCausalLM.save_pretrained,
bf16 safetensors, ~2 MB) exercising sliding and full layers with a small window (16), K=V full
layers with one KV head, proportional RoPE and final-logit softcapping, plus a small BPE
tokenizer.json (trained on a fixed text) so text prompts work. Run from the repo root:

    python scripts/make_embedded_checkpoint.py [--out models/embedded]

Needs torch, transformers and tokenizers (test-only dependencies).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

S, F = "sliding_attention", "full_attention"
SEED = 20260402

CONFIG = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=[S, S, F, S, S, F], sliding_window=16, final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0, max_position_embeddings=4096, initializer_range=0.1,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)

# Fixed training text for the toy tokenizer (deterministic; no download).
CORPUS = """
Gemma 4 is a family of open models. The text decoder alternates sliding window attention layers
with global attention layers. Global layers use a head dimension of 512 and proportional rotary
embeddings; sliding layers use 256 and see only the last window of tokens. jax_mila runs the
prefill of long contexts on hand written CUDA kernels: flash attention for head dimensions 256
and 512, and a W4A8 matrix multiply with FP8 activations and MXFP4 weights. The quick brown fox
jumps over the lazy dog. Hello world! Once upon a time there was a small model that lived in a
repository and answered every prompt with random tokens, because its weights were random.
0 1 2 3 4 5 6 7 8 9 10 100 1000 , . ; : ? ! ( ) [ ] { } + - * / = < > " ' _ # @ & %
""".strip()


def perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Moves norm weights, router scales and layer_scalar away from 1 so tests notice a
    `1 + w` or a dropped layer_scalar."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.mul_(1 + 0.25 * torch.randn(p.shape, generator=generator))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.25 * torch.randn(b.shape, generator=generator))


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + bytes_,
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    from tokenizers.processors import TemplateProcessing
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "models", "embedded"))
    out = p.parse_args().out
    torch.manual_seed(SEED)
    cfg = Gemma4TextConfig(**CONFIG)
    model = Gemma4ForCausalLM(cfg).eval()
    perturb(model, torch.Generator().manual_seed(SEED + 1))
    model = model.to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    for extra in ("generation_config.json",):  # keep the directory to what the loader reads
        path = os.path.join(out, extra)
        if os.path.exists(path):
            os.remove(path)
    build_tokenizer(cfg.vocab_size).save(os.path.join(out, "tokenizer.json"))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out} ({size / 1e6:.2f} MB): {json.dumps(CONFIG)[:120]}...")


if __name__ == "__main__":
    main()
