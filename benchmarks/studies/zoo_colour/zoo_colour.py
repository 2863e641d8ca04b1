"""The Zoo tokenizer's colour fidelity: held-out crops against their VQ reconstructions, per class.

    OMP_NUM_THREADS=1 python benchmarks/studies/zoo_colour/zoo_colour.py      # writes benchmarks/studies/zoo_colour/zoo_colour.md

For each class: 100 held-out crops (seed 0, the split docs/zoo.md's PSNR uses), encoded and decoded by
``zoo-vq``. Reported: the mean RGB of the crops and of their reconstructions, and, over the pixels that
are clearly blue in the crop (B > R + 30 and B > G), the share whose reconstruction is no longer blue
(B <= R) and the mean RGB they decode to. Blue is rare in the training crops (only a few photos have
sky or blue objects), so the codebook has few blue codes.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine.engine import load_vq  # noqa: E402
from vvs_engine.models.vq import to_uint8  # noqa: E402
from vvs_engine.zoo import class_names, model_path  # noqa: E402
from vvs_engine.zoo.data import make_crops, to_tensor  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(HERE, "zoo_colour.md"))
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    vq = load_vq(model_path("zoo-vq"))
    crops, labels = make_crops(a.per_class, seed=0, split="heldout")
    with torch.no_grad():
        recon = torch.cat([to_uint8(vq.decode(vq.encode(to_tensor(crops[i:i + 64]))))
                           for i in range(0, len(crops), 64)]).numpy()
    names = class_names()
    rows = ["| class | crops: mean RGB | reconstructions: mean RGB | blue pixels (share of the crops' pixels) | "
            "blue pixels no longer blue | what they decode to (mean RGB) |", "|---|---|---|---:|---:|---|"]
    total_blue = total_lost = 0
    for c in range(len(names)):
        x, y = crops[labels == c].astype(np.int32), recon[labels == c].astype(np.int32)
        blue = (x[..., 2] > x[..., 0] + 30) & (x[..., 2] > x[..., 1])
        lost = blue & (y[..., 2] <= y[..., 0])
        total_blue += int(blue.sum())
        total_lost += int(lost.sum())
        share = f"{100 * blue.mean():.2f}%"
        gone = f"{100 * lost.sum() / blue.sum():.0f}%" if blue.sum() >= 100 else "–"
        to = "(" + ", ".join(f"{v:.0f}" for v in y[blue].mean(0)) + ")" if blue.sum() >= 100 else "–"
        rows.append(f"| {c} {names[c]} | ({', '.join(f'{v:.0f}' for v in x.reshape(-1, 3).mean(0))}) | "
                    f"({', '.join(f'{v:.0f}' for v in y.reshape(-1, 3).mean(0))}) | {share} | {gone} | {to} |")
    with open(a.out, "w") as f:
        f.write("# Zoo tokenizer: colours of held-out crops after encoding and decoding\n\n"
                f"Written by `python benchmarks/studies/zoo_colour/zoo_colour.py` ({a.per_class} held-out crops per class, seed 0; "
                "blue pixel: B > R + 30 and B > G in the crop; no longer blue: B <= R in the reconstruction). "
                f"Over all classes {100 * total_lost / max(1, total_blue):.0f}% of the blue pixels decode to a "
                "colour that is not blue.\n\n" + "\n".join(rows) + "\n")
    print(open(a.out).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
