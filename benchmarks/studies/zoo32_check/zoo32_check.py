"""Sanity check of the Zoo's 32x32-token member against the 16x16 one, and its training figures.

    OMP_NUM_THREADS=1 python benchmarks/studies/zoo32_check/zoo32_check.py      # writes benchmarks/studies/zoo32_check/zoo32.md

Both targets sample the same labels (``--per-class`` images of each of the 16 classes, class-major)
with plain AR at the engine's default sampling (cfg 4.0, temperature 1.0, no top-k/top-p, seed 0).
Class accuracy is the shipped classifier's, on the images resized to its 64-px input
(``vvs_engine.evaluation.quality.classifier_input``: zoo-gpt-32's 128-px images are averaged down,
zoo-gpt's are used as they are). Intervals are Wilson 95 % intervals of a proportion; at 32 images
they are wide, so this is a sanity check, not a quality measurement. The drafter columns run EAGLE
(``--method eagle``, defaults) with each target's own drafter on ``--drafter-images`` of those labels
(evenly spaced; EAGLE is slow on a CPU) and report tokens per target forward. The training figures
come from ``train_report-32.json`` next to the checkpoints.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine import Engine, zoo  # noqa: E402
from vvs_engine.evaluation.quality import classifier_input, load_classifier  # noqa: E402


def wilson(k: int, n: int, z: float = 1.96) -> tuple:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-class", type=int, default=2)
    ap.add_argument("--drafter-images", type=int, default=4, help="images for the EAGLE columns (0: none)")
    ap.add_argument("--out", default=os.path.join(HERE, "zoo32.md"))
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    net = load_classifier()
    labels = [c for c in range(net.num_classes) for _ in range(a.per_class)]
    drafter_labels = [labels[i] for i in np.linspace(0, len(labels) - 1, a.drafter_images).round().astype(int)]
    rows = []
    for name in zoo.TARGETS:
        eng = Engine.load(model=name, threads=torch.get_num_threads())
        t0 = time.perf_counter()
        out = eng.generate(class_labels=labels, method="ar", seed=0, batch_size=16)
        seconds = time.perf_counter() - t0
        x = classifier_input(out.images)
        with torch.no_grad():
            correct = (net(x).argmax(-1).numpy() == np.asarray(labels))
        row = dict(name=name, tokens=eng.tokens_per_image, size=out.images[0].size[0], n=len(labels),
                   correct=int(correct.sum()), ar_seconds=seconds)
        if a.drafter_images:
            t0 = time.perf_counter()
            spec = eng.generate(class_labels=drafter_labels, method="eagle", seed=0, batch_size=16,
                                decode_images=False)
            row.update(eagle_tpf=spec.stats["tpf"], eagle_seconds=time.perf_counter() - t0)
        rows.append(row)
        print(json.dumps(row), flush=True)

    report_path = os.path.join(os.path.dirname(zoo.model_path("zoo-gpt-32")), "train_report-32.json")
    with open(report_path) as f:
        rep = json.load(f)
    sizes = {n: os.path.getsize(zoo.model_path(n)) for n in ("zoo-gpt-32", "zoo-drafter-32")}
    hp = rep["hyperparameters"]
    cmd = "OMP_NUM_THREADS=1 python benchmarks/studies/zoo32_check/zoo32_check.py" + (f" --per-class {a.per_class}"
                                                                   if a.per_class != 2 else "") + \
        (f" --drafter-images {a.drafter_images}" if a.drafter_images != 4 else "")
    lines = [
        "# The Zoo's 32x32-token member: training figures and an AR sanity check", "",
        f"Written by `{cmd}` from `train_report-32.json` and "
        f"{len(labels)} images per target ({a.per_class} per class, plain AR, cfg 4.0, temperature 1.0, seed 0; "
        "class accuracy by `zoo-classifier` on the images resized to its 64-px input; Wilson 95 % intervals).", "",
        "| figure | zoo-gpt-32 |", "|---|---|",
        f"| target held-out loss (teacher-forced CE, true labels, {rep['data']['n_heldout']} held-out 128-px crops) "
        f"| {rep['gpt_heldout_loss']:.3f} nats/token (train subset of {hp['train_loss_sequences']}: "
        f"{rep['gpt_train_loss']:.3f}; uniform {math.log(1024):.3f}) |",
        f"| zoo-vq held-out PSNR at 128 px | {rep['vq_heldout_psnr']:.2f} dB |",
        f"| target parameters | {rep['gpt_params']:,} |",
        f"| files (bf16): zoo-gpt-32 + zoo-drafter-32 | {sizes['zoo-gpt-32'] / 2**20:.1f} + "
        f"{sizes['zoo-drafter-32'] / 2**20:.1f} MiB |",
        f"| schedule | target {hp['gpt_steps']} steps x {hp['gpt_batch']} sequences of 1024 tokens; drafter "
        f"{hp['drafter_steps']} steps x {hp['drafter_batch']}; {rep['data']['n_target_train']} training "
        f"sequences; target peak lr {hp['gpt_lr']:g}"
        + (f", started from zoo-gpt (sha256 {rep['init_from']['sha256_16']}...) with positions x"
           f"{rep['init_from']['rope_grid_scale']:g}" if rep.get("init_from") else ", from random weights") + " |",
        f"| wall time, 1 niced thread on the shared 2-core machine | encoding "
        f"{rep.get('encode_seconds', float('nan')) / 60:.0f} min, target {rep['gpt_seconds'] / 60:.0f} min, "
        f"held-out/train loss {rep.get('loss_eval_seconds', float('nan')) / 60:.0f} min, drafter "
        f"{rep.get('drafter_seconds', float('nan')) / 60:.0f} min |", "",
        "| target | tokens/image | image px | images | AR class accuracy (95 % interval) | AR wall s |"
        + (f" EAGLE TPF, own drafter ({a.drafter_images} images) | EAGLE wall s |" if a.drafter_images else ""),
        "|---|---:|---:|---:|---|---:|" + ("---:|---:|" if a.drafter_images else ""),
    ]
    for r in rows:
        lo, hi = wilson(r["correct"], r["n"])
        line = (f"| {r['name']} | {r['tokens']} | {r['size']} | {r['n']} | {100 * r['correct'] / r['n']:.1f} % "
                f"({r['correct']}/{r['n']}; {100 * lo:.0f}-{100 * hi:.0f} %) | {r['ar_seconds']:.0f} |")
        if a.drafter_images:
            line += f" {r['eagle_tpf']:.2f} | {r['eagle_seconds']:.0f} |"
        lines.append(line)
    lines += ["", "zoo-gpt's full quality bar (256 images, 50.8 %) is in docs/zoo.md; chance is 6.25 %."]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
