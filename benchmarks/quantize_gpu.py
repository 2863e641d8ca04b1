"""Decode time of quantized weights vs bf16 on a GPU: a random target of a LlamaGen preset's shape
(GPT-XL by default, 384 px = 576 tokens), AR with CFG, each quantization in the same process.

    python benchmarks/quantize_gpu.py                          # GPU: bf16, int8, fp8, int4 on GPT-XL
    python benchmarks/quantize_gpu.py --device cpu --dtype fp32 --gpt-model GPT-B --image-size 64 \
        --modes none,int8,fp8 --out /tmp/q                     # a CPU dry run (int4 is CUDA-only)

Reports per mode: the weight bytes, the seconds of the whole decode after one untimed warm-up decode
(compiled rounds and CUDA graphs on CUDA by the engine's defaults), ms per decode round and image
tokens per second. A mode the device cannot run (fp8 below compute capability 8.9, int4 off CUDA) is
recorded with the engine's one-line reason. With ``--quant-draft MODES`` (default int8,int4) the unquantized
target also decodes with ``quant-draft`` (k = ``--draft-length``) and each copy: ms per round (k copy forwards +
one target forward over k + 1 queries) and tokens per second. The target is random, so its copy's acceptance
(TPF) is not a real model's; the round time is what this measures. Written to ``--out`` .json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vvs_engine.engine import Engine  # noqa: E402
from vvs_engine.errors import VVSError  # noqa: E402
from vvs_engine.models.gpt import GPT, gpt_config  # noqa: E402
from vvs_engine.models.quantize import weight_bytes  # noqa: E402


def random_engine(preset: str, tokens: int, device: str, dtype: torch.dtype) -> Engine:
    torch.manual_seed(0)
    gpt = GPT(gpt_config(preset, vocab_size=16384, num_classes=1000, block_size=tokens)).to(dtype)
    eng = Engine(gpt)
    return eng


def quant_draft_row(eng: Engine, copy_mode: str, k: int, kw: dict, tokens: int) -> dict:
    """quant-draft with a ``copy_mode`` copy of the (unquantized) target: ms per round and tokens per second."""
    name = f"quant-draft {copy_mode} copy, k={k}"
    qkw = dict(kw, method="quant-draft", draft_length=k, draft_quantize=copy_mode)
    try:
        eng.generate(**qkw)  # warm-up: builds the copy, compiles and captures
    except VVSError as e:
        return {"mode": name, "refused": str(e)}
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = eng.generate(**qkw)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rounds = out.stats["target_forward_passes"] / len(kw["class_labels"])  # per image (rounds run batched)
    return {"mode": name, "images": len(kw["class_labels"]), "weight_bytes": weight_bytes(eng.gpt), "wall_s": wall,
            "ms_per_round": 1000 * wall / rounds, "tokens_per_s": len(kw["class_labels"]) * tokens / wall,
            "tpf": out.stats["tpf"], "compiled": out.stats.get("compiled")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpt-model", default="GPT-XL")
    ap.add_argument("--image-size", type=int, default=384, help="pixels / 16 per side = tokens per side")
    ap.add_argument("--images", default="1,4", help="comma list of images per decode (CFG doubles the rows)")
    ap.add_argument("--modes", default="none,int8,fp8,int4")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quant-draft", default="int8,int4",
                    help="copies to run quant-draft with on the unquantized target ('' for none)")
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu", "quantize_gpu"))
    args = ap.parse_args(argv)
    from vvs_engine.engine import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    tokens = (args.image_size // 16) ** 2
    rows = []
    for mode in args.modes.split(","):
        eng = random_engine(args.gpt_model, tokens, args.device, dtype)
        try:
            eng.quantize_weights(mode, args.device, dtype).to(args.device, dtype)
        except VVSError as e:
            rows.append({"mode": mode, "refused": str(e)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        for n in [int(x) for x in args.images.split(",")]:
            kw = dict(class_labels=list(range(n)), seed=0, decode_images=False, batch_size=n)
            eng.generate(**kw)  # warm-up: compiles and captures
            if eng.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = eng.generate(**kw)
            if eng.device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            rows.append({"mode": mode, "images": n, "weight_bytes": weight_bytes(eng.gpt), "wall_s": wall,
                         "ms_per_round": 1000 * wall / tokens,  # AR: one round per token
                         "tokens_per_s": n * tokens / wall, "compiled": out.stats.get("compiled")})
            print(json.dumps(rows[-1]), flush=True)
            for copy_mode in [m for m in args.quant_draft.split(",") if m] if mode == "none" else []:
                rows.append(quant_draft_row(eng, copy_mode, args.draft_length, kw, tokens))
                print(json.dumps(rows[-1]), flush=True)
        del eng
    base = {r["images"]: r["wall_s"] for r in rows if r.get("mode") == "none" and "wall_s" in r}
    for r in rows:
        if "wall_s" in r and r["images"] in base:
            r["vs_unquantized"] = r["wall_s"] / base[r["images"]]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "CPU"
    cmd = "python benchmarks/quantize_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Quantized decode time ({args.gpt_model} shape, {tokens} tokens, {args.dtype}, {device})", "",
             f"Written by `{cmd}` on {datetime.date.today().isoformat()} (torch {torch.__version__}).", "",
             "| mode | images | weight bytes | decode s | ms per round | image tokens/s | time vs none |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    # quant-draft rows: the target's bytes (the copy is extra); TPF is a random target's copy's, not a real model's
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['mode']} | – | – | – | – | – | refused: {r['refused']} |")
        else:
            vs = f"{r['vs_unquantized']:.2f}" if "vs_unquantized" in r else "–"
            tpf = f" (TPF {r['tpf']:.2f})" if "tpf" in r else ""
            lines.append(f"| {r['mode']}{tpf} | {r['images']} | {r['weight_bytes']:,} | {r['wall_s']:.2f} | "
                         f"{r['ms_per_round']:.2f} | {r['tokens_per_s']:.0f} | {vs} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": cmd, "device": device, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
