"""Batched CPU throughput before and after a change, side by side in one run (VVS-U and GSD on the Zoo).

Variants, interleaved repeat by repeat so machine load hits them alike:

* ``before``: the package as of ``--before REF`` (exported with ``git archive`` to a temporary folder),
* ``after, no retire``: this checkout with ``VVS_RETIRE_FINISHED=0`` (finished rows stay to the end),
* ``after``: this checkout as it ships.

Each measurement is a fresh process (1 thread, fp32): load the Zoo model, one untimed warm-up image,
then ``--images`` images at batch size B (B = 1: the first ``--images-b1`` of them) -> images/s and the
tokens. Medians over ``--repeats``; tokens of every variant are compared with ``before``.

    OMP_NUM_THREADS=1 python benchmarks/studies/batch_before_after/batch_before_after.py --before c8a5495
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SETTINGS = {"vvs-u": ("vvs", {"skip_interval": 2}), "gsd": ("gsd", {})}


def worker(setting: str, batch_size: int, n_images: int, out: str) -> None:
    """One measurement in this process (run by the parent with the variant's PYTHONPATH / env)."""
    import torch

    torch.set_num_threads(1)
    from vvs_engine import Engine

    method, opts = SETTINGS[setting]
    eng = Engine.load(device="cpu")
    labels = [(7 * i) % eng.config.num_classes for i in range(n_images)]
    kw = dict(method=method, temperature=1.0, cfg_scale=4.0, decode_images=False, **opts)
    eng.generate(class_labels=labels[:1], seed=10_000, batch_size=1, **kw)  # warm-up
    t0 = time.perf_counter()
    res = eng.generate(class_labels=labels, seed=0, batch_size=batch_size, **kw)
    wall = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump({"wall_s": wall, "images_per_s": n_images / wall, "tpf": res.stats["tpf"],
                   "tokens": res.tokens.tolist(), "package": os.path.dirname(__import__("vvs_engine").__file__)}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="c8a5495", help="git ref of the 'before' package")
    ap.add_argument("--settings", default="vvs-u,gsd")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--images", type=int, default=16, help="images per measurement at B > 1")
    ap.add_argument("--images-b1", type=int, default=8, help="images per measurement at B = 1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--worker", nargs=4, metavar=("SETTING", "B", "N", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]), a.worker[3])
        return 0
    from tqdm import tqdm

    base = tempfile.mkdtemp(prefix="vvs_before_")
    subprocess.run(f"git -C {ROOT} archive {a.before} vvs_engine | tar -x -C {base}", shell=True, check=True)
    env0 = {**os.environ, "OMP_NUM_THREADS": "1"}
    variants = {"before": {**env0, "PYTHONPATH": base},
                "after, no retire": {**env0, "VVS_RETIRE_FINISHED": "0"},
                "after": {**env0, "VVS_RETIRE_FINISHED": "1"}}
    settings = [s for s in a.settings.split(",") if s]
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    jobs = [(r, s, b, v) for r in range(a.repeats) for s in settings for b in sizes for v in variants
            if not (b == 1 and v == "after, no retire")]  # nothing retires at B = 1
    command = "OMP_NUM_THREADS=1 python benchmarks/studies/batch_before_after/batch_before_after.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    runs = []
    for r, s, b, v in tqdm(jobs, desc="before/after"):
        out = os.path.join(base, f"run_{r}_{s}_{b}_{len(runs)}.json")
        n = a.images_b1 if b == 1 else a.images
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", s, str(b), str(n), out],
                       env=variants[v], check=True, cwd=base if v == "before" else ROOT)
        with open(out) as f:
            runs.append({"repeat": r, "setting": s, "batch_size": b, "variant": v, **json.load(f)})
        write(runs, variants, settings, sizes, a, command)
    return 0


def write(runs, variants, settings, sizes, a, command) -> None:
    os.makedirs(a.out, exist_ok=True)
    lines = [f"<!-- written by `{command}`; do not edit -->",
             "# Batched CPU throughput before / after (Zoo model, fp32, 1 thread)", "",
             f"`before` = the package at `{a.before}`; `after, no retire` = this checkout with "
             "`VVS_RETIRE_FINISHED=0`; `after` = this checkout. Interleaved repeats in one run; medians "
             f"of images/s over {a.repeats} repeats ({a.images} images at B > 1, the first {a.images_b1} at "
             "B = 1; shared machine, so wall-clock figures are noisy). `same tokens`: every repeat's "
             "tokens equal `before`'s.", "",
             "| setting | variant | " + " | ".join(f"images/s B={b}" for b in sizes) +
             f" | B={sizes[-1]} / B={sizes[0]} | TPF B={sizes[-1]} | same tokens | repeats |",
             "|---|---|" + "---:|" * (len(sizes) + 3) + "---:|"]
    summary = {}
    for s in settings:
        for v in variants:
            med = {}
            for b in sizes:
                rs = [r for r in runs if r["setting"] == s and r["variant"] == (v if b > 1 else
                      ("before" if v == "before" else "after")) and r["batch_size"] == b]
                med[b] = statistics.median(r["images_per_s"] for r in rs) if rs else float("nan")
            mine = [r for r in runs if r["setting"] == s and r["variant"] == v]
            ref = {(r["repeat"], r["batch_size"]): r["tokens"] for r in runs if r["setting"] == s
                   and r["variant"] == "before"}
            same = all(r["tokens"] == ref[(r["repeat"], r["batch_size"])] for r in mine
                       if (r["repeat"], r["batch_size"]) in ref)
            big = [r["tpf"] for r in mine if r["batch_size"] == sizes[-1]]
            ratio = med[sizes[-1]] / med[sizes[0]]
            summary[f"{s} / {v}"] = {"images_per_s": med, "ratio": ratio}
            lines.append(f"| {s} | {v} | " + " | ".join(f"{med[b]:.3f}" for b in sizes) +
                         f" | {ratio:.2f}x | {statistics.median(big) if big else float('nan'):.2f} | "
                         f"{'yes' if same else 'no'} | {len({r['repeat'] for r in mine})} |")
    lines += ["", "B = 1 runs retire nothing: `after, no retire` reuses the `after` B = 1 runs."]
    with open(os.path.join(a.out, "batch_before_after.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    slim = [{k: v for k, v in r.items() if k != "tokens"} for r in runs]
    with open(os.path.join(a.out, "batch_before_after.json"), "w") as f:
        json.dump({"command": command, "runs": slim, "summary": summary}, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
