"""Quantized weights on the Zoo (CPU): weight bytes, decode time int8 vs fp32 in one run, and quality.

Quality is paired: every row decodes the same labels with the same seeds (image i draws the same random
numbers in every row), at temperature 1, CFG 4, no top-k/top-p. Besides class accuracy and FD (the Zoo
classifier's feature space), the sharpest measure is

    D = E_x[ NLL_p(x_t | x_<t) - H(p(. | x_<t)) ]  (per token, averaged over the tokens of each image)

with p the full-precision target's CFG-combined distribution (``Engine.score``) and x the row's samples:
for samples of p itself E[D] = 0 exactly (the fp32 rows are the controls: their D is sampling noise), and a
row whose distribution departs from p has D != 0 (> 0 where it places tokens where p puts less mass than
p's own samples do, < 0 where it is sharper than p). The row "target + drafter int8" quantizes both (EAGLE-2 is lossless w.r.t. its target, so
its D measures the quantized target's distribution too); acceptance and TPF show what the quantized
drafter and target change for a drafter method (EAGLE-2) and a Jacobi method (SJD).

    nice -n 19 python benchmarks/quantize_zoo.py --per-class 32      # 512 images (16 classes)
    python benchmarks/quantize_zoo.py --per-class 2 --time-images 8  # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vvs_engine import Engine  # noqa: E402
from vvs_engine.models.quantize import linear_weight_bytes, weight_bytes  # noqa: E402

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=4.0)


def byte_rows():
    """Weight bytes of the Zoo target and drafter per dtype and quantization."""
    rows = []
    for name, dtype, q in (("fp32", "fp32", "none"), ("bf16", "bf16", "none"), ("int8 (bf16 compute)", "bf16", "int8"),
                           ("fp8 (bf16 compute)", "bf16", "fp8"), ("int8 (fp32 compute)", "fp32", "int8")):
        eng = Engine.load(dtype=dtype, quantize=q)
        lin, other = linear_weight_bytes(eng.gpt)
        rows.append({"name": name, "target_bytes": weight_bytes(eng.gpt), "target_linear_bytes": lin,
                     "target_other_bytes": other, "drafter_bytes": weight_bytes(eng.drafter)})
    base = rows[1]
    for r in rows:
        r["target_vs_bf16"] = r["target_bytes"] / base["target_bytes"]
        r["drafter_vs_bf16"] = r["drafter_bytes"] / base["drafter_bytes"]
    return rows


def time_ar(engines: dict, n: int, batch: int, repeats: int) -> dict:
    """Seconds of an AR decode of n images per engine, the engines alternated, the median of ``repeats``."""
    labels = [i % 16 for i in range(n)]
    times = {k: [] for k in engines}
    for name, eng in engines.items():  # warm-up (first-call allocations)
        eng.generate(class_labels=labels[:2], seed=99, decode_images=False, batch_size=batch, **SAMPLING)
    for _ in range(repeats):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            eng.generate(class_labels=labels, seed=0, decode_images=False, batch_size=batch, **SAMPLING)
            times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def d_measure(full: Engine, labels, tokens, chunk: int = 32) -> list:
    """Per image: mean over its tokens of NLL - entropy under the full-precision target (CFG 4)."""
    out = []
    for i in range(0, len(labels), chunk):
        logits = full.score(class_labels=labels[i:i + chunk], tokens=tokens[i:i + chunk],
                            cfg_scale=SAMPLING["cfg_scale"]).double()
        logp = torch.log_softmax(logits, -1)
        nll = -logp.gather(-1, tokens[i:i + chunk, :, None].long().to(logp.device))[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        out += (nll - ent).mean(1).tolist()
    return out


def mean_se(xs):
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def quality_rows(full: Engine, quant: Engine, per_class: int, batch: int, seed: int) -> list:
    from vvs_engine.evaluation.quality import class_accuracy, fd_classifier

    labels = [c for c in range(16) for _ in range(per_class)]
    d_full = {}  # method -> the fp32 row's per-image D, to pair the quantized row with
    rows = []
    for name, eng, method in (("AR fp32", full, "ar"), ("AR, target int8", quant, "ar"),
                              ("EAGLE-2 fp32", full, "eagle"), ("EAGLE-2, target + drafter int8", quant, "eagle"),
                              ("SJD fp32", full, "sjd"), ("SJD, target int8", quant, "sjd")):
        t0 = time.perf_counter()
        out = eng.generate(class_labels=labels, method=method, seed=seed, batch_size=batch, **SAMPLING)
        wall = time.perf_counter() - t0
        d = d_measure(full, labels, out.tokens)
        dm, dse = mean_se(d)
        row = {"name": name, "method": method, "quantize": eng.quantization, "images": len(labels),
               "tpf": out.stats["tpf"], "mean_accepted_length": out.stats.get("mean_accepted_length"),
               "class_accuracy": class_accuracy(out.images, labels), "fd_classifier": fd_classifier(out.images),
               "D": dm, "D_se": dse, "wall_s": wall}
        if eng is full:
            d_full[method] = d
        else:  # paired image by image with the fp32 row of the same method (same labels, same seeds)
            diff = [a - b for a, b in zip(d, d_full[method])]
            row["D_minus_fp32"], row["D_minus_fp32_se"] = mean_se(diff)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write_md(path: str, res: dict) -> None:
    lines = [f"# Quantized weights on the Zoo (CPU, {res['threads']} thread)", "",
             f"Written by `{res['command']}` on {res['date']} ({res['machine']}; torch {res['torch']}, "
             f"torchao {res['torchao']}).", "", "## Weight bytes", "",
             "| weights | target bytes | of which linear | target vs bf16 | drafter bytes | drafter vs bf16 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in res["bytes"]:
        lines.append(f"| {r['name']} | {r['target_bytes']:,} | {r['target_linear_bytes']:,} | "
                     f"{r['target_vs_bf16']:.3f} | {r['drafter_bytes']:,} | {r['drafter_vs_bf16']:.3f} |")
    t = res["timing"]
    lines += ["", "## Decode time (AR, one run, engines alternated, median of "
              f"{t['repeats']})", "",
              f"{t['images']} images, batch {t['batch']} (CFG: {2 * t['batch']} rows): fp32 {t['fp32_s']:.2f} s, "
              f"int8 weights (fp32 compute) {t['int8_s']:.2f} s: **int8 / fp32 = {t['ratio']:.2f}**" +
              (f" (timed by `{t['command']}`; load average {t['load_average']}: the ratio is noisy)" if "command" in t
               else "") + ". The Zoo is "
              "small enough that a CPU round is bound by launches and attention, not by reading weights; the "
              "decode where fewer weight bytes pay, a large model on a GPU, is not measured here.", "",
              "## Quality, paired with AR (same labels and seeds)", "",
              "| row | images | TPF | mean accepted | class acc. | FD (classifier) | D (± s.e.) | D − fp32 row, paired |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["quality"]:
        mal = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else "–"
        paired = (f"{r['D_minus_fp32']:+.4f} ± {r['D_minus_fp32_se']:.4f}" if "D_minus_fp32" in r else "–")
        lines.append(f"| {r['name']} | {r['images']} | {r['tpf']:.2f} | {mal} | {r['class_accuracy']:.3f} | "
                     f"{r['fd_classifier']:.2f} | {r['D']:+.4f} ± {r['D_se']:.4f} | {paired} |")
    lines += ["", "D = E[NLL − entropy] per token of the row's samples under the full-precision target (CFG 4): "
              "0 in expectation for the target's own samples (the fp32 rows: AR, and EAGLE-2 and SJD, which are "
              "lossless; their values are sampling noise); != 0 where the sampled distribution departs from the "
              "target's (> 0: more spread than the target; < 0: sharper). The last column pairs each quantized row with the fp32 row of its method image by image. The quantized rows' int8 is of fp32 weights "
              "(the CPU computes in fp32).", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-class", type=int, default=32, help="images per class for quality (16 classes)")
    ap.add_argument("--time-images", type=int, default=32, help="images of each timed AR decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quantize_zoo"))
    ap.add_argument("--timing-json", default=None,
                    help="take the timing from this JSON (the timing line an earlier run printed) instead of timing")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.out + ".json") as f:
            write_md(args.out + ".md", json.load(f))
        return
    torch.set_num_threads(1)
    import torchao

    full, quant = Engine.load(threads=1), Engine.load(threads=1, quantize="int8")
    res = {"command": "python benchmarks/quantize_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "torchao": torchao.__version__, "threads": torch.get_num_threads()}
    res["bytes"] = byte_rows()
    print(json.dumps(res["bytes"]), flush=True)
    if args.timing_json:
        with open(args.timing_json) as f:
            res["timing"] = dict(json.load(f), source=args.timing_json)
    else:
        t = time_ar({"fp32": full, "int8": quant}, args.time_images, args.batch, args.repeats)
        res["timing"] = {"images": args.time_images, "batch": args.batch, "repeats": args.repeats,
                         "fp32_s": t["fp32"], "int8_s": t["int8"], "ratio": t["int8"] / t["fp32"]}
    print(json.dumps(res["timing"]), flush=True)
    res["quality"] = quality_rows(full, quant, args.per_class, args.batch, args.seed)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_md(args.out + ".md", res)
    print(f"wrote {args.out}.md / .json")


if __name__ == "__main__":
    main()
