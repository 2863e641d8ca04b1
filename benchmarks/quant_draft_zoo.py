"""quant-draft on the Zoo (CPU): acceptance and TPF of an int8 copy of the target as its drafter.

    nice -n 19 python benchmarks/quant_draft_zoo.py --per-class 2 --lengths 2,4,6

Every setting decodes the same labels (``--per-class`` images of each of the 16 classes) with the same
seeds, at the sampling of ``benchmarks/results/quality_speed.md`` (temperature 1, CFG 4, no top-k/p),
one thread. TPF = image tokens / target forwards (prefill excluded); mean accepted length = tokens
committed per round; draft forwards per token = k / mean accepted length.

The modelled GPU time is a weight-read model only: a decode step of a model this size at batch 1 is
bound by reading its weights, so per committed token AR reads W (bf16 target) and quant-draft reads
(W + k W8) / TPF, with W8 the int8 copy's bytes (bf16 compute): modelled speed-up = TPF W / (W + k W8).
It leaves out the KV cache, the launches (k + 1 forwards per round instead of 1: at the Zoo's size on a
real GPU these dominate; ``benchmarks/round_cost.py`` models them for the other methods and was not
extended to this one) and the draft forwards' running one after another. EAGLE-2's and SJD-PAC's TPF are
quoted from quality_speed.md (512 images), not rerun.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine import Engine  # noqa: E402
from vvs_engine.models.quantize import quantize_module, weight_bytes  # noqa: E402

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=4.0)
# TPF at 512 images, benchmarks/results/quality_speed.md ("Defaults against the evidence"), 95 % bootstrap
QUOTED = [("EAGLE-2 (`eagle`, default)", 1.85, "[1.82, 1.89]"),
          ("SJD-PAC W=2 D=3 (`sjd-pac`, default)", 3.80, "[3.70, 3.90]")]


def weight_model() -> dict:
    """Weight bytes of the Zoo target in bf16 and of its int8 copy (bf16 compute)."""
    eng = Engine.load(dtype="bf16")
    q = copy.deepcopy(eng.gpt)
    quantize_module(q, "int8")
    return {"target_bf16_bytes": weight_bytes(eng.gpt), "copy_int8_bytes": weight_bytes(q)}


def run(per_class: int, lengths, batch: int, seed: int) -> list:
    eng = Engine.load(threads=1)
    labels = [c for c in range(16) for _ in range(per_class)]
    rows = []
    for k in lengths:
        t0 = time.perf_counter()
        out = eng.generate(class_labels=labels, method="quant-draft", draft_length=k, seed=seed, batch_size=batch,
                           decode_images=False, **SAMPLING)
        s, passes = out.stats, out.stats["target_forward_passes"]
        hist = s["accepted_drafts_histogram"]
        rows.append({"draft_length": k, "images": len(labels), "tpf": out.tokens.numel() / passes,
                     "mean_accepted_length": s["mean_accepted_length"], "target_forwards": passes,
                     "accepted_drafts_histogram": hist, "all_accepted_fraction": hist[-1] / sum(hist),
                     "seconds": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_md(path: str, res: dict) -> None:
    W, W8 = res["bytes"]["target_bf16_bytes"], res["bytes"]["copy_int8_bytes"]
    lines = [f"# quant-draft on the Zoo (int8 copy of the target drafts, fp32 target verifies)", "",
             f"Written by `{res['command']}` on {res['date']} ({res['machine']}, torch {res['torch']}, torchao "
             f"{res['torchao']}, {res['threads']} thread). Sampling {SAMPLING}; images seeded {res['seed']} + i.", "",
             "| setting | images | TPF | mean accepted length | rounds accepting all k | draft fwd / token | "
             "modelled GPU speed-up (weight reads only) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        k, tpf = r["draft_length"], r["tpf"]
        lines.append(f"| quant-draft int8, k={k} | {r['images']} | {tpf:.2f} | {r['mean_accepted_length']:.2f} | "
                     f"{r['all_accepted_fraction']:.2f} | {k / r['mean_accepted_length']:.2f} | "
                     f"{tpf * W / (W + k * W8):.2f} |")
    for name, tpf, ci in QUOTED:
        lines.append(f"| {name}: quoted from quality_speed.md | 512 | {tpf:.2f} {ci} | | | | |")
    lines += ["", f"Weight bytes: target bf16 {W / 1e6:.1f} MB, int8 copy {W8 / 1e6:.1f} MB ({W8 / W:.3f}x). "
              "Modelled speed-up over AR = TPF x W / (W + k x W8): weight reads per committed token only (no "
              "KV cache, no launches, drafts run one after another); see the script's docstring.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-class", type=int, default=2, help="images per class (16 classes)")
    ap.add_argument("--lengths", default="4", help="draft lengths k, comma-separated")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quant_draft_zoo"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import torchao

    res = {"command": "python benchmarks/quant_draft_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "torchao": torchao.__version__, "threads": 1, "seed": args.seed}
    res["bytes"] = weight_model()
    res["rows"] = run(args.per_class, [int(k) for k in args.lengths.split(",")], args.batch, args.seed)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_md(args.out + ".md", res)
    print(f"wrote {args.out}.md / .json")


if __name__ == "__main__":
    main()
