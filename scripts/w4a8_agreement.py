"""Agreement of W4A8 (MXFP4 weights x FP8 activations) with the dense model on CPU.

    python scripts/w4a8_agreement.py embedded          # the shipped embedded checkpoint
    python scripts/w4a8_agreement.py 12b-stack         # 2 random layers of the 12B's shapes

Prints top-1 agreement and mean / max KL(dense float32 || other) of the final logits over a
64-token prompt, for the w4a8 model (float32 and bfloat16 activations) and, as a yardstick,
the dense bfloat16 model; "w4 only" is the float32 model with the dequantized MXFP4 weights
(the weight format's share). "12b-stack": models/12b's text config with 2 layers (one sliding,
one full: head_dim 256 / 512, K=V full layer), vocab 4096, random weights (linears
N(0, 1/in), embeddings N(0, 1/hidden) so the embedding adds ~unit RMS to the residual like
each layer does), written as a bf16 checkpoint and loaded twice. With random *tied*
embeddings every position would predict its own input token at the softcap (entropy 0: no
measurement at all), so the 12b-stack logits come from a fixed dense random head
N(0, 0.05^2) [hidden, vocab] on the final-normed hidden states, softcapped at 30, the same
for all models (dense, like the 12B's tied head): what is compared is what the decoder layers
compute.

ATTENTION_NOTE: Gemma 4 attends with scale 1.0 after q_norm / k_norm; with norm weights of 1
(random init) the scores of unit-RMS q and k have std sqrt(head_dim) = 16 / 22.6, so every
softmax is a hard argmax and any perturbation (bf16 or w4a8 alike) flips which key a query
reads. Trained norm weights do not do that; the random stack sets q_norm and k_norm weights to
head_dim**-0.25 (scores with the usual 1/sqrt(head_dim) spread).
Results: docs/design/w4a8.md, "Accuracy".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from jax_mila import gemma4, nn
from jax_mila.gemma4 import loader
from jax_mila.gemma4.config import Gemma4Config
from jax_mila.quant import dequantize_mxfp4

SEQ = 64


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref, other):
    p, q = log_softmax(ref), log_softmax(other)
    kl = (np.exp(p) * (p - q)).sum(-1)
    return float((p.argmax(-1) == q.argmax(-1)).mean()), float(kl.mean()), float(kl.max())


def write_random_12b_stack(path: str, seed: int = 0) -> None:
    with open(gemma4.model_card("12b")) as f:
        raw = json.load(f)
    text = raw["text_config"]
    text.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                vocab_size=4096)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    cfg = Gemma4Config.from_dict(raw)
    model = gemma4.Gemma4ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    tensors = {}
    for param_path, var in loader.dense_params(model):
        name, perm = loader._checkpoint_name(param_path, "model.language_model.")
        value = var.get_value()
        if name.endswith("embed_tokens.weight"):
            value = value * cfg.hidden_size**-0.5
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # see ATTENTION_NOTE
            value = value * value.shape[0]**-0.25
        if perm is not None:
            value = jnp.transpose(value, perm)  # Flax -> HF layout (perm is its own inverse)
        tensors[name] = value.astype(jnp.bfloat16)
    del model
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def random_head_logits(head):
    """Logits from a fixed dense head on the final-normed hidden states, softcapped at 30."""
    def fn(model, ids):
        h, _ = model.hidden_states(ids)
        x = model.norm(h).astype(jnp.float32)
        return 30.0 * jnp.tanh((x @ head) / 30.0)
    return fn


def dequantized_weights_model(path: str):
    """float32 dense model whose quantizable linears hold their dequantized MXFP4 weights:
    the weight format's share of the error, without FP8 activations."""
    dense = gemma4.from_pretrained(path, dtype=jnp.float32)
    quantized = dict(loader.quantized_linears(
        gemma4.from_pretrained(path, dtype=jnp.float32, quantize="w4a8")))
    for module_path, node in nnx.iter_graph(dense):
        if module_path in quantized and isinstance(node, nn.Linear):
            node.kernel.set_value(dequantize_mxfp4(quantized[module_path].mxfp4, jnp.float32).T)
    return dense


def measure(path: str, label: str, logits_fn=None) -> None:
    cfg = Gemma4Config.from_pretrained(path)
    logits_fn = logits_fn or (lambda model, ids: model(ids))
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, (1, SEQ)).astype(np.int32)
    ids[0, 0] = 2
    t = time.time()
    ref = np.asarray(logits_fn(gemma4.from_pretrained(path, dtype=jnp.float32), ids))
    p = log_softmax(ref)
    print(f"{label}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
          f"{cfg.vocab_size}, {SEQ} tokens; dense float32 entropy {-(np.exp(p) * p).sum(-1).mean():.2f} nats")
    for name, dtype, quantize in (("dense bf16", jnp.bfloat16, None),
                                  ("w4a8 f32  ", jnp.float32, "w4a8"),
                                  ("w4a8 bf16 ", jnp.bfloat16, "w4a8"),
                                  ("w4 only   ", jnp.float32, "w4-only")):
        if quantize == "w4-only":
            model = dequantized_weights_model(path)
        else:
            model = gemma4.from_pretrained(path, dtype=dtype, quantize=quantize)
        out = np.asarray(logits_fn(model, ids).astype(jnp.float32))
        del model
        top1, kl, kl_max = compare(ref, out)
        print(f"  {name} vs dense f32: top-1 {top1:.3f}  KL mean {kl:.4f}  max {kl_max:.4f} nats")
    print(f"  ({time.time() - t:.0f} s)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default="embedded", choices=("embedded", "12b-stack"),
                   help="the shipped embedded checkpoint (default), or 2 random layers of the "
                        "12B's shapes")
    args = p.parse_args(argv)
    if args.target == "embedded":
        measure(str(gemma4.embedded_checkpoint()), "embedded checkpoint")
    else:
        with tempfile.TemporaryDirectory() as d:
            write_random_12b_stack(d)
            head = 0.05 * jax.random.normal(jax.random.key(7), (3840, 4096), jnp.float32)
            measure(d, "random 12B-shaped 2-layer stack", random_head_logits(head))


if __name__ == "__main__":
    main()
