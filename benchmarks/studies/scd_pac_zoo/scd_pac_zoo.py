"""Tokens per forward of the coupled Jacobi methods on the Zoo: SJD, SCD (maximal / Gumbel coupling),
SJD-PAC (exact and released), GSD and GSD + coupling, written to scd_pac_zoo.{md,json} beside it.

    OMP_NUM_THREADS=1 python benchmarks/studies/scd_pac_zoo/scd_pac_zoo.py            # 48 images (3 per class), batch 16
    OMP_NUM_THREADS=1 python benchmarks/studies/scd_pac_zoo/scd_pac_zoo.py --images 8 --only 0,1   # a quick look

Sampling at the engine defaults (temperature 1, CFG 4, no top-k), seed 0, one CPU thread, fp32. TPF =
image tokens per target forward per image (prefill excluded), the figure the papers report as step
compression; wall time is this shared machine's and only indicative. Every setting decodes the same
labels with the same seed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)

from vvs_engine import Engine  # noqa: E402

COMMAND = "OMP_NUM_THREADS=1 python benchmarks/studies/scd_pac_zoo/scd_pac_zoo.py"
RESULTS = HERE
DEFAULT_OUT = os.path.join(RESULTS, "scd_pac_zoo")
DOC = os.path.join(ROOT, "docs", "jacobi.md")
DOC_BEGIN, DOC_END = "<!-- scd-pac-zoo:begin -->", "<!-- scd-pac-zoo:end -->"

# (name, method, options); the first seven are the issue's settings at each method's defaults of the
# time this table was made (SCD L = 16, SJD-PAC W = D = 3: pinned, so a rerun reproduces it).
SETTINGS = [
    ("SJD", "sjd", {}),
    ("SCD maximal", "scd", {"coupling": "maximal", "jacobi_window": 16}),
    ("SCD gumbel", "scd", {"coupling": "gumbel", "jacobi_window": 16}),
    ("SJD-PAC", "sjd-pac", {"pac_width": 3}),
    ("SJD-PAC released", "sjd-pac", {"pac_variant": "released", "pac_width": 3}),
    ("GSD", "gsd", {}),
    ("GSD + maximal", "gsd", {"coupling": "maximal"}),
    # same node budget as SJD-PAC's default window, and SJD-PAC's other shapes
    ("GSD + gumbel", "gsd", {"coupling": "gumbel"}),
    ("SJD L=32", "sjd", {"jacobi_window": 32}),
    ("SCD maximal L=32", "scd", {"jacobi_window": 32}),
    ("SJD-PAC L=16", "sjd-pac", {"jacobi_window": 16, "pac_width": 3}),
    ("SJD-PAC W=4 D=2", "sjd-pac", {"pac_width": 4, "pac_depth": 2}),
    ("SJD-PAC random init", "sjd-pac", {"jacobi_init": "random", "pac_width": 3}),
]


def run(engine, labels, seed, batch_size, settings):
    from vvs_engine.methods import resolve_options

    rows = []
    for name, method, opts in settings:
        t0 = time.perf_counter()
        out = engine.generate(class_labels=labels, method=method, seed=seed, decode_images=False,
                              batch_size=batch_size, **opts)
        wall = time.perf_counter() - t0
        st = out.stats
        eff = resolve_options(method, opts)
        rows.append({"name": name, "method": method, "options": opts, "window": eff.get("jacobi_window"),
                     "tpf": st["tpf"], "mean_accepted_length": st["mean_accepted_length"],
                     "target_forward_passes": st["target_forward_passes"],
                     "batch_iterations": st["batch_iterations"],
                     "accepted_alternatives": st.get("accepted_alternatives"),
                     "accepted_drafts_carried": st["accepted_drafts_carried"],
                     "accepted_drafts_histogram": st["accepted_drafts_histogram"], "wall_s": wall})
        print(f"{name:22} TPF {st['tpf']:.3f}  forwards {st['target_forward_passes']}  {wall:.0f} s", flush=True)
    return rows


def table(rows, meta) -> str:
    sjd = {r["window"]: r["tpf"] for r in rows if r["method"] == "sjd"}
    base = next((r["tpf"] for r in rows if r["name"] == "SJD"), None)
    out = [f"<!-- written by `{meta['command']}`; do not edit -->", "",
           f"# Coupled Jacobi methods on the Zoo: tokens per forward", "",
           f"Command: `{meta['command']}`. {meta['n_images']} images (labels {meta['labels_text']}), seed "
           f"{meta['seed']}, batch {meta['batch_size']}, temperature 1, CFG 4 (engine defaults), "
           f"{meta['device']}, {meta['dtype']}, {meta['threads']} thread; torch {meta['torch']}, commit {meta['commit']}.",
           "", "TPF = image tokens per target forward per image (prefill excluded). \"× SJD\" divides by SJD at "
           "L = 16 (its default); \"× SJD same L\" by SJD at the setting's own window (L counts every "
           "query row of a forward: SJD-PAC's tree nodes included). Alternatives = accepted tree candidates "
           "other than candidate 0.", "",
           "| setting | method | options | L | TPF | × SJD | × SJD same L | forwards | accepted alternatives | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        opts = " ".join(f"{k.replace('_', '-')}={v}" for k, v in r["options"].items()) or "defaults"
        same = sjd.get(r["window"])
        alt = "" if r["accepted_alternatives"] is None else str(r["accepted_alternatives"])
        out.append(f"| {r['name']} | {r['method']} | {opts} | {r['window']} | {r['tpf']:.3f} | "
                   f"{r['tpf'] / base:.2f} | {'' if same is None else format(r['tpf'] / same, '.2f')} | "
                   f"{r['target_forward_passes']} | {alt} | {r['wall_s']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=48, help="images, labels cycling over the 16 classes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--only", default=None, help="comma-separated indices into SETTINGS")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output path without extension")
    a = ap.parse_args(argv)
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.set_num_threads(threads)
    eng = Engine.load(threads=threads)
    labels = [i % eng.config.num_classes for i in range(a.images)]
    settings = [SETTINGS[int(i)] for i in a.only.split(",")] if a.only else SETTINGS
    rows = run(eng, labels, a.seed, a.batch_size, settings)
    try:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    n_cls = eng.config.num_classes
    meta = {"command": COMMAND + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv)),
            "n_images": len(labels), "labels_text": f"0..{n_cls - 1} cycled" if len(labels) >= n_cls else str(labels),
            "seed": a.seed, "batch_size": a.batch_size, "device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", ""),
            "threads": threads, "torch": torch.__version__, "platform": platform.platform(), "commit": commit}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(table(rows, meta))
    print(f"wrote {a.out}.md and .json")
    if a.out == DEFAULT_OUT and not a.only:  # the full run also updates the table quoted in docs/jacobi.md
        write_doc_block(table(rows, meta))
        print(f"updated {DOC}")


def write_doc_block(text: str) -> None:
    with open(DOC, encoding="utf-8") as f:
        doc = f.read()
    start, end = doc.index(DOC_BEGIN) + len(DOC_BEGIN), doc.index(DOC_END)
    body = text.split("\n", 1)[1].replace("# Coupled Jacobi methods on the Zoo: tokens per forward\n\n", "")
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(doc[:start] + "\n" + body.strip() + "\n" + doc[end:])


if __name__ == "__main__":
    main()
