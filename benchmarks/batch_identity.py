"""How often an image's tokens change with the decode batch size, per method and dtype, on the Zoo model.

    OMP_NUM_THREADS=1 python benchmarks/batch_identity.py      # writes benchmarks/results/batch_identity_zoo_cpu.{md,json}
    OMP_NUM_THREADS=1 python benchmarks/batch_identity.py --methods ar,vvs --dtypes fp64 --images 4   # a subset

Each setting generates the same images (labels 0..n-1, seed 0, temperature 1, CFG 4; image i keyed by
its index i) once at every batch size of ``--batch-sizes`` and counts the images whose tokens equal
their batch-1 decode. An image's random numbers depend only on (seed, its index), so every difference
comes from floating-point: a matrix product over a batch of 16 rows may sum in another order than
over 1 row, and a sampled (or accepted) token near a tie then flips, and every later token follows
from it. In fp64 such ties are far below the rounding, so the count there says whether the decode is
exact. One thread (the count also depends on the thread count and the CPU's kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine import Engine  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def identity_rates(engine, method: str, n_images: int, batch_sizes, seed: int = 0) -> dict:
    """-> {batch size: images identical to batch 1}, plus the wall time of each decode."""
    labels = [i % engine.config.num_classes for i in range(n_images)]
    tokens, seconds = {}, {}
    for b in [1] + [b for b in batch_sizes if b != 1]:
        t0 = time.perf_counter()
        out = engine.generate(class_labels=labels, method=method, seed=seed, batch_size=b, decode_images=False)
        seconds[b] = time.perf_counter() - t0
        tokens[b] = out.tokens
    same = {b: int((tokens[b] == tokens[1]).all(1).sum()) for b in tokens if b != 1}
    return {"identical": same, "seconds": seconds}


def table(result: dict) -> str:
    sizes = result["batch_sizes"]
    head = "| method | dtype | " + " | ".join(f"identical at batch {b}" for b in sizes) + " |"
    rows = [head, "|---|---|" + "---:|" * len(sizes)]
    for r in result["rows"]:
        n = result["images"]
        cells = [f"{r['identical'][str(b)]}/{n} ({100 * r['identical'][str(b)] / n:.0f}%)" for b in sizes]
        rows.append(f"| {r['method']} | {r['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ar,eagle,lantern,vvs,sjd,gsd")
    ap.add_argument("--dtypes", default="fp32,bf16,fp64")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--batch-sizes", default="16", help="compared with batch 1 (default 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS, "batch_identity_zoo_cpu"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    command = "python benchmarks/batch_identity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "images": a.images, "batch_sizes": sizes, "threads": a.threads,
              "torch": torch.__version__, "platform": platform.platform(), "rows": []}
    for dtype in a.dtypes.split(","):
        engine = Engine.load(dtype=DTYPES[dtype], threads=a.threads)
        for method in a.methods.split(","):
            r = identity_rates(engine, method, a.images, sizes)
            result["rows"].append({"method": method, "dtype": dtype,
                                   "identical": {str(b): v for b, v in r["identical"].items()},
                                   "seconds": {str(b): v for b, v in r["seconds"].items()}})
            print(f"{method:8s} {dtype}: " + ", ".join(f"batch {b}: {v}/{a.images} identical to batch 1"
                                                     for b, v in r["identical"].items()), flush=True)
            with open(a.out + ".json", "w") as f:  # kept as it grows: a long run may be cut short
                json.dump(result, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(f"# Tokens against the batch size (Zoo model, CPU)\n\nWritten by `{result['command']}` "
                f"({a.threads} thread, torch {result['torch']}). Images whose tokens equal their batch-1 "
                f"decode; {a.images} images (labels 0..{a.images - 1} mod 16, seed 0, temperature 1, CFG 4). "
                f"See the docstring of `benchmarks/batch_identity.py` for why they differ.\n\n")
        f.write(table(result) + "\n")
    print(f"wrote {a.out}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
