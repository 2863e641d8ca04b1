"""Memory of one AR decode per model, quantization and batch: weights + KV cache + activations, and
whether it fits a 12 / 16 / 24 / 80 GB card. Written to benchmarks/results/memory.md (+ .json).

    python benchmarks/memory_table.py

* Weights: the engine's target (and, for LlamaGen and Janus-Pro, the VQ-16 decoder, which the engine
  keeps in fp32) from the published configs below. LlamaGen-XL is counted exactly from this project's
  ``GPT`` built on the meta device; the Hugging Face families from their published shapes (decoder
  layers, heads, FFN, vocabularies) as this engine loads them: Janus-Pro's generation path only (no
  SigLIP tower, no text head), Lumina-mGPT's and Emu3's full text head kept in the model dtype
  (``models/quantize.py``: it is read by row selection, which torchao's tensors do not run).
  Their VQ decoders (Chameleon's VQGAN, Emu3's MoVQ) are not counted.
* Quantized bytes per linear weight: int8 and fp8 measured here by quantizing one 4096x4096 layer with
  torchao (data + per-row scale and zero point); int4 from torchao's tile-packed layout (4 bits a
  weight + a bf16 scale and zero point per group of 128), which only a CUDA build creates. Embeddings
  and norms stay bf16.
* KV cache and activations: ``engine.decode_bytes`` for the AR method in bf16 (the estimate the engine
  checks a batch against before decoding: static KV cache of prompt + image + slack, logits, scores);
  "rows" are images, and CFG doubles them. A speculative method's tree or window adds query rows.
* Fits: weights + KV + activations + 1 GiB (CUDA context and allocator slack) <= the card's GiB.
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vvs_engine.engine import ModelShape, decode_bytes  # noqa: E402
from vvs_engine.methods.registry import get_method_options  # noqa: E402

GIB = 2 ** 30
CARDS = (12, 16, 24, 80)
ROWS = (1, 4, 16)
MODES = ("none (bf16)", "int8", "fp8", "int4")
RESERVE = 1 * GIB
PROMPT = 128  # the engine's default --max-prompt-tokens for the Hugging Face families

# Published configs (Hugging Face config.json of each checkpoint; LlamaGen's GPT-XL preset).
# decoder: (layers, dim, heads, kv heads, FFN); extra_linear: (out, in) of the other linear layers the
# engine calls; kept_linear: linear layers kept in the model dtype; embed: embedding parameters.
FAMILIES = {
    "Janus-Pro-7B": dict(  # deepseek-ai/Janus-Pro-7B: DeepSeek-LLM-7B language model, 384 px, 24x24 codes
        decoder=(30, 4096, 32, 32, 11008), tokens=576, vocab=16384,
        extra_linear=[(4096, 8), (4096, 4096), (4096, 4096), (16384, 4096)],  # aligner fc1, hidden; gen head
        kept_linear=[], embed=102400 * 4096 + 16384 * 8, vq16=True),
    "Lumina-mGPT-7B-768": dict(  # Alpha-VLLM/Lumina-mGPT-7B-768: Chameleon-7B, 48x48 codes + 48 row ends
        decoder=(32, 4096, 32, 32, 11008), tokens=48 * 49, vocab=8193,
        extra_linear=[], kept_linear=[(65536, 4096)], embed=65536 * 4096, vq16=False),
    "Emu3-Gen-8B (720 px)": dict(  # BAAI/Emu3-Gen: 90x90 codes + 90 row ends, GQA with 8 KV heads
        decoder=(32, 4096, 32, 8, 14336), tokens=90 * 91, vocab=32769,
        extra_linear=[], kept_linear=[(184622, 4096)], embed=184622 * 4096, vq16=False),
}


def measured_linear_bytes() -> dict:
    """Bytes per weight of a quantized 4096x4096 linear layer (torchao, bf16 model), by mode."""
    from vvs_engine.models.quantize import quantize_module, tensor_bytes

    out = {"none (bf16)": 2.0}
    for mode in ("int8", "fp8"):
        layer = nn.Sequential(nn.Linear(4096, 4096, bias=False)).to(torch.bfloat16)
        quantize_module(layer, mode)
        out[mode] = tensor_bytes(layer[0].weight) / 4096 ** 2
    out["int4"] = 0.5 + 2 * 2 / 128  # tile-packed int4 + bf16 scale and zero point per group of 128 (CUDA only)
    return out


def llamagen_xl():
    """LlamaGen GPT-XL c2i at 384 px (24x24 codes): the project's GPT on the meta device."""
    from vvs_engine.models.gpt import GPT, gpt_config
    from vvs_engine.models.vq import VQ_PRESETS, VQConfig, VQModel

    cfg = gpt_config("GPT-XL", vocab_size=16384, num_classes=1000, block_size=576)
    with torch.device("meta"):
        gpt = GPT(cfg)
        vq = VQModel(VQConfig(**VQ_PRESETS["VQ-16"]))
    linear = sum(m.weight.numel() for m in gpt.modules() if isinstance(m, nn.Linear))
    other = sum(p.numel() for p in gpt.parameters()) - linear
    vq_params = sum(p.numel() for p in vq.parameters())
    shape = ModelShape.of(cfg)
    return dict(linear=linear, kept=0, other=other, vq_params=vq_params, shape=shape)


def hf_family(spec, vq_params):
    layers, dim, heads, kv, ffn = spec["decoder"]
    hd = dim // heads
    per_layer = dim * heads * hd + 2 * dim * kv * hd + heads * hd * dim + 3 * dim * ffn
    linear = layers * per_layer + sum(o * i for o, i in spec["extra_linear"])
    kept = sum(o * i for o, i in spec["kept_linear"])
    norms = layers * 2 * dim + dim
    shape = ModelShape(spec["tokens"], spec["vocab"], None, PROMPT, layers, heads, kv, hd, dim)
    return dict(linear=linear, kept=kept, other=spec["embed"] + norms, vq_params=vq_params if spec["vq16"] else 0,
                shape=shape)


def table():
    per_weight = measured_linear_bytes()
    xl = llamagen_xl()
    models = {"LlamaGen-XL (c2i, 384 px)": xl}
    for name, spec in FAMILIES.items():
        models[name] = hf_family(spec, xl["vq_params"])
    ar = get_method_options("ar", {})
    rows = []
    for name, m in models.items():
        for mode in MODES:
            weights = m["linear"] * per_weight[mode] + (m["kept"] + m["other"]) * 2 + m["vq_params"] * 4
            for n in ROWS:
                total_decode = decode_bytes(m["shape"], ar, n, True, torch.bfloat16)
                s = m["shape"]
                slots = s.cls_token_num + s.tokens_per_image + 8  # decode_bytes' AR slots
                kv = 2 * s.n_layer * 2 * n * slots * s.n_kv_head * s.head_dim * 2
                total = weights + total_decode
                rows.append({"model": name, "quantize": mode, "images": n, "cfg_rows": 2 * n,
                             "params_linear": m["linear"], "params_other": m["kept"] + m["other"],
                             "weights_gib": weights / GIB, "kv_gib": kv / GIB,
                             "activations_gib": (total_decode - kv) / GIB, "total_gib": total / GIB,
                             "fits": {c: total + RESERVE <= c * GIB for c in CARDS}})
    return rows, per_weight


def write(rows, per_weight, out: str) -> None:
    with open(out + ".json", "w") as f:
        json.dump({"rows": rows, "bytes_per_linear_weight": per_weight}, f, indent=1)
    lines = ["# Memory of an AR decode with CFG: weights + KV cache + activations", "",
             f"Written by `python benchmarks/memory_table.py` on {datetime.date.today().isoformat()} "
             f"(torch {torch.__version__}). How each column is counted: the script's docstring; in short, "
             "the engine's own weights per quantization (embeddings, norms and the Chameleon/Emu3 text "
             "head in bf16; the VQ-16 decoder in fp32 for LlamaGen and Janus-Pro, the other families' VQ "
             "decoders not counted), `engine.decode_bytes` for the KV cache and activations (bf16, AR), "
             "and a fit when the total + 1 GiB stays within the card.", "",
             "Bytes per linear weight: " + ", ".join(f"{k} {v:.4f}" for k, v in per_weight.items()) +
             " (int8 and fp8 measured with torchao on the CPU; int4 from its CUDA tile-packed layout).", "",
             "| model | weights | images (rows with CFG) | weights GiB | KV GiB | activations GiB | total GiB | "
             + " | ".join(f"fits {c} GB" for c in CARDS) + " |",
             "|---|---|---|---:|---:|---:|---:|" + "|".join(":-:" for _ in CARDS) + "|"]
    for r in rows:
        fits = " | ".join("yes" if r["fits"][c] else "no" for c in CARDS)
        lines.append(f"| {r['model']} | {r['quantize']} | {r['images']} ({r['cfg_rows']}) | {r['weights_gib']:.2f} | "
                     f"{r['kv_gib']:.2f} | {r['activations_gib']:.2f} | {r['total_gib']:.2f} | {fits} |")
    lines.append("")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines))


def main():
    rows, per_weight = table()
    out = os.path.join(ROOT, "benchmarks", "results", "memory")
    write(rows, per_weight, out)
    print(open(out + ".md").read())


if __name__ == "__main__":
    main()
