"""ZipAR on the Zoo model: forwards per image and quality (class accuracy, classifier FD) for windows
2, 4, 8 (and 6), plain and with SJD-verified row windows, against AR, with 95 % bootstrap intervals.

Every setting decodes the same labels (``--per-class`` images per class) with the same random
streams (image i draws from (seed, i)), so the differences to AR are paired image by image; the
statistics are ``benchmarks/harness.py``'s (percentile bootstrap over images, one draw shared by
every setting; Δ = setting − AR on the same draws). Generated tokens are cached per setting beside
the table (``<out>_tokens/``), so an interrupted run resumes.

    OMP_NUM_THREADS=1 python benchmarks/studies/zipar_zoo/zipar_zoo.py --per-class 16 --doc docs/zipar.md
    python benchmarks/studies/zipar_zoo/zipar_zoo.py --from-json benchmarks/studies/zipar_zoo/zipar_zoo.json --doc docs/zipar.md   # tables only

``--doc`` also writes the table between the ``zipar-zoo`` marker comments of that file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import harness as qs  # noqa: E402  (the shared harness: bootstrap, metrics, token cache)

SETTINGS = [("AR", "ar", {})] + [
    (f"ZipAR s={s}", "zipar", {"zipar_window": s}) for s in (2, 4, 6, 8)
] + [
    (f"ZipAR s={s} + SJD L=4", "zipar", {"zipar_window": s, "zipar_verify": "sjd", "zipar_jacobi_window": 4})
    for s in (2, 4, 8)
]
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 4.0}
DOC_BEGIN = "<!-- zipar-zoo:begin (written by benchmarks/studies/zipar_zoo/zipar_zoo.py --doc; do not edit) -->"
DOC_END = "<!-- zipar-zoo:end -->"


def _cached_wall(cache, key):
    try:
        with open(cache + ".wall.json") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved["wall_s"] if saved.get("key") == key and os.path.exists(cache) else None


def run(eng, settings, labels, seed, batch_size, cache_dir, reps, log=print):
    from vvs_engine.evaluation.quality import reference_features

    ref = {"cls": reference_features("classifier")}
    idx = qs.bootstrap_indices(len(labels), reps, seed)
    digest = qs.checkpoint_digest(eng.info_paths)
    rows, ar = [], None
    for name, method, opts in settings:
        key = json.dumps([digest, method, opts, SAMPLING, labels, seed, batch_size, "counter-rng"], sort_keys=True)
        cache = os.path.join(cache_dir, qs.slug(name) + ".npz")
        wall = _cached_wall(cache, key)
        t0 = time.perf_counter()
        gen = qs.generate_setting(eng, name, method, opts, labels, seed, SAMPLING, batch_size, cache, key, show=False)
        if wall is None:  # generated now, not loaded: keep its time beside the tokens
            wall = time.perf_counter() - t0
            with open(cache + ".wall.json", "w") as f:
                json.dump({"key": key, "wall_s": wall}, f)
        feats = qs.image_features(eng, gen["tokens"], labels, inception=False)
        metrics, draws = qs.setting_metrics(feats, gen["forwards"], eng.tokens_per_image, ref, idx, ar=ar)
        forwards, boot = gen["forwards"], gen["forwards"][idx].mean(1)
        row = {"name": name, "method": method, "options": opts, "wall_s": wall,
               "forwards": {"value": float(forwards.mean()), "ci": qs.interval(boot)}, **metrics}
        if ar is None:
            ar, ar_forwards = draws, float(forwards.mean())
        row["forwards_vs_ar"] = row["forwards"]["value"] / ar_forwards
        rows.append(row)
        log(f"{name:24s} forwards {row['forwards']['value']:6.1f}  acc {metrics['class_accuracy']['value']:.3f}  "
            f"FD {metrics['fd_classifier']['value']:.2f}  ({wall:.0f} s)")
    qs.parity_verdicts(rows)
    return rows


def to_markdown(meta, rows) -> str:
    ar_wall = rows[0]["wall_s"]
    lines = ["# ZipAR on the Zoo model", "", f"Command: `{meta['command']}`", "",
             f"{meta['n_images']} images per setting ({meta['labels']}), image i seeded with ({meta['seed']}, i) in "
             f"every setting (paired with AR), sampling {meta['sampling']}, batch {meta['batch_size']}, CPU fp32, "
             f"{meta['threads']} thread, torch {meta['torch']}. Intervals: 95 % percentile bootstrap over images "
             f"({meta['bootstrap']} draws, shared by every setting); Δ = setting − AR on the same draws. Parity: no "
             "Δ interval (class accuracy, classifier FD) lies wholly on the worse side. Forwards: target forwards "
             "per image, prefill excluded (AR: T − 1 = 255; plain ZipAR: (H − 1)·s + W − 1 exactly). Wall: "
             "this run's generation time relative to AR's (one process, a shared 2-core machine: indicative only; "
             "speed belongs to GPU runs).", "",
             "| setting | forwards / image | × AR | TPF | class acc | Δ acc vs AR | FD (classifier) | Δ FD | parity "
             "| wall vs AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {qs.fmt_ci(r['forwards'], 1)} | {r['forwards_vs_ar']:.3f} | {qs.fmt_ci(r['tpf'], 2)} | "
                     f"{qs.fmt_ci(r['class_accuracy'], 3)} | {qs.fmt_diff(r['class_accuracy'], 3)} | "
                     f"{qs.fmt_ci(r['fd_classifier'], 2)} | {qs.fmt_diff(r['fd_classifier'], 2)} | "
                     f"{'yes' if r['parity'] else 'no'} | {r['wall_s'] / ar_wall:.2f} |")
    return "\n".join(lines) + "\n"


def write_doc(path, meta, rows) -> None:
    """The table (with its command) between the marker comments of ``path``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    table = to_markdown(meta, rows).split("\n", 2)[2].strip()  # without the title line
    start, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + "\n" + table + "\n" + text[end:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-class", type=int, default=16, help="images per class (default 16: 256 images)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settings", default=None, help="comma list of setting names (AR always runs first)")
    ap.add_argument("--out", default=os.path.join(HERE, "zipar_zoo"),
                    help="output prefix: .md, .json, _tokens/ (default zipar_zoo beside this script)")
    ap.add_argument("--doc", default=None, help="also write the table between this file's zipar-zoo markers")
    ap.add_argument("--from-json", default=None, help="render the tables of an earlier run's JSON (no generation)")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        md = to_markdown(saved["meta"], saved["rows"])
        with open(os.path.splitext(a.from_json)[0] + ".md", "w") as f:
            f.write(md)
        if a.doc:
            write_doc(a.doc, saved["meta"], saved["rows"])
        print(md)
        return 0
    torch.set_num_threads(a.threads)
    from vvs_engine import Engine
    from vvs_engine.zoo import model_path

    settings = SETTINGS
    if a.settings:
        wanted = {s.strip() for s in a.settings.split(",")}
        settings = [SETTINGS[0]] + [s for s in SETTINGS[1:] if s[0] in wanted]
    paths = {n: model_path(n) for n in ("zoo-gpt", "zoo-vq", "zoo-classifier")}
    eng = Engine.load(gpt_ckpt=paths["zoo-gpt"], vq_ckpt=paths["zoo-vq"])
    eng.info_paths = paths
    labels = [c for c in range(eng.config.num_classes) for _ in range(a.per_class)]
    t0 = time.time()
    rows = run(eng, settings, labels, a.seed, a.batch_size, a.out + "_tokens", a.bootstrap)
    meta = {"command": "OMP_NUM_THREADS=1 python benchmarks/studies/zipar_zoo/zipar_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "n_images": len(labels), "labels": f"{a.per_class} per class x {eng.config.num_classes} classes",
            "seed": a.seed, "sampling": SAMPLING, "batch_size": a.batch_size, "threads": a.threads,
            "torch": torch.__version__, "bootstrap": a.bootstrap, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = to_markdown(meta, rows)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    if a.doc:
        write_doc(a.doc, meta, rows)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
