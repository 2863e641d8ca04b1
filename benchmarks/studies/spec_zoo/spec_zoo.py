"""One-run comparison of every decoding method on the Zoo model (CPU or GPU).

Same labels, same seed, same sampling settings for every row; each row reports TPF (tokens per target
forward, prefill excluded), mean accepted length, wall-clock ratio to plain AR measured in this run
(batch 1 per image, like the speculative methods), and the Zoo quality metrics (class accuracy, FD in
the classifier space, FID with the bundled InceptionV3). Writes markdown + JSON under
benchmarks/results/ and the quality-vs-TPF plot docs/vvs_pareto.png.

    python benchmarks/studies/spec_zoo/spec_zoo.py                      # full table (slow on CPU)
    python benchmarks/studies/spec_zoo/spec_zoo.py --quick --no-inception
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from vvs_engine import Engine  # noqa: E402

# (row name, method, options). VVS rows come in fill and reject variants.
CORE_ROWS = [
    ("AR", "ar", {}),
    ("EAGLE-2", "eagle", {}),
    ("LANTERN d=0.1", "lantern", {"lantern_delta": 0.1}),
    ("LANTERN d=0.2", "lantern", {"lantern_delta": 0.2}),
    ("LANTERN d=0.3", "lantern", {"lantern_delta": 0.3}),
    ("LANTERN++", "lantern++", {"lantern_lambda": 2.0}),  # the default when the table was made (pinned)
]
VVS_ROWS = [
    (f"VVS-U i={i} {pv}", "vvs", {"skip_policy": "uniform", "skip_interval": i, "post_verify": pv, "lantern_delta": 0.2})
    for i in (2, 4) for pv in ("fill", "reject")
] + [
    (f"VVS-D s={s} {pv}", "vvs", {"skip_policy": "dynamic", "skip_threshold": s, "post_verify": pv, "lantern_delta": 0.2})
    for s in (0.65, 0.7) for pv in ("fill", "reject")
] + [("VVS-D s=0.3 fill", "vvs", {"skip_policy": "dynamic", "skip_threshold": 0.3, "lantern_delta": 0.2})]


def extra_rows():
    """Training-free Jacobi methods and CASCADE next to the paper baselines (EAGLE-1 static tree)."""
    return [
        ("SJD", "sjd", {}),
        ("GSD G=3", "gsd", {"gsd_group": 3}),
        ("GSD G=8", "gsd", {"gsd_group": 8}),
        ("GSD G=14", "gsd", {"gsd_group": 14}),
        ("GSD G=50", "gsd", {"gsd_group": 50}),
        ("EAGLE-1 (static, exact)", "eagle", {"tree": "static"}),
        ("CASCADE (drafter)", "cascade", {"cascade_source": "drafter"}),
        ("CASCADE (target-logits)", "cascade", {"cascade_source": "target-logits"}),
        ("CASCADE (target-hidden)", "cascade", {"cascade_source": "target-hidden"}),
    ]


def run_row(eng, name, method, opts, labels, seed, sampling, inception, tokens_dir=None):
    from vvs_engine.errors import VVSError

    try:
        t0 = time.perf_counter()
        if method == "ar":  # batch 1 per image, like the speculative methods (a fair latency ratio)
            outs = [eng.generate(class_labels=[lab], method="ar", seed=seed + i, **sampling)
                    for i, lab in enumerate(labels)]
            out = outs[0]
            out.tokens = torch.cat([o.tokens for o in outs])
            out.images = [im for o in outs for im in o.images]
            out.stats = dict(outs[0].stats, target_forward_passes=sum(o.stats["target_forward_passes"] for o in outs))
            out.stats["tpf"] = len(labels) * eng.tokens_per_image / out.stats["target_forward_passes"]
        else:
            out = eng.generate(class_labels=labels, method=method, seed=seed, **sampling, **opts)
        wall = time.perf_counter() - t0
    except VVSError as e:
        return {"name": name, "method": method, "options": opts, "error": str(e)}
    st = out.stats
    row = {"name": name, "method": method, "options": opts, "tpf": st["tpf"],
           "mean_accepted_length": st.get("mean_accepted_length"),
           "target_forward_passes": st["target_forward_passes"], "wall_s": wall,
           "wall_s_per_image": wall / len(labels), "skip_steps": st.get("skip_steps"),
           "acceptance_rate_by_depth": st.get("acceptance_rate_by_depth"),
           "time_split_s": st.get("time_split_s")}
    if tokens_dir:  # keep the tokens so quality can be (re)computed without regenerating
        import numpy as np

        os.makedirs(tokens_dir, exist_ok=True)
        row["tokens_file"] = os.path.join(tokens_dir, _slug(name) + ".npz")
        np.savez_compressed(row["tokens_file"], tokens=out.tokens.numpy().astype("int16"), labels=np.array(labels))
    try:
        evaluate_row(row, out.images, labels, inception)
    except Exception as e:  # e.g. the classifier is not there yet: --merge --reeval fills it in later
        row["eval_error"] = str(e).splitlines()[0]
    return row


def evaluate_row(row, images, labels, inception):
    from vvs_engine.evaluation.quality import evaluate_images

    m = evaluate_images(images, labels, inception=inception, progress=None)
    row.update({k: m[k] for k in ("class_accuracy", "fd_classifier", "fid_inception", "precision", "recall") if k in m})
    row.pop("eval_error", None)


def _slug(name):
    return "".join(c if c.isalnum() else "_" for c in name)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-class", type=int, default=4, help="images per class (all classes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 images per class, core rows only")
    ap.add_argument("--essential", action="store_true", help="one row per method family (a shorter CPU run)")
    ap.add_argument("--only", default=None, help="comma list of row names to run (AR always runs)")
    ap.add_argument("--no-inception", action="store_true")
    ap.add_argument("--rows", default="core,vvs,extra", help="comma list of core,vvs,extra")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--shard", default="1/1", help="i/n: run every n-th row starting at i (AR always runs,"
                    " so each shard has its own same-run AR baseline); merge the shards with --merge")
    ap.add_argument("--merge", nargs="+", default=None, help="merge shard JSON files into one table")
    ap.add_argument("--reeval", action="store_true", help="with --merge: recompute quality from saved tokens")
    ap.add_argument("--table", default=None, metavar="JSON", help="only rewrite the markdown table (--out + .md) "
                    "and the plot (--plot) from a results JSON; runs nothing")
    ap.add_argument("--readme", default=None, metavar="README", help="with --table: also rewrite the README's "
                    "summary table (between its spec-zoo markers)")
    ap.add_argument("--ckpt-dir", default=None, help="load zoo-{gpt,vq,drafter} from this folder")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spec_zoo"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "vvs_pareto.png"))
    a = ap.parse_args(argv)
    if a.table:
        write_table(a.table, a.out, a.readme)
        with open(a.table) as fh:
            plot(json.load(fh)["rows"], a.plot)
        return 0
    if a.merge:
        return merge(a.merge, a.out, a.plot, a.reeval, not a.no_inception)
    if a.ckpt_dir:
        j = lambda n: os.path.join(a.ckpt_dir, n + ".safetensors")
        eng = Engine.load(gpt_ckpt=j("zoo-gpt"), vq_ckpt=j("zoo-vq"), drafter=j("zoo-drafter"),
                          device=a.device, dtype=a.dtype)
    else:
        eng = Engine.load(device=a.device, dtype=a.dtype)
    from vvs_engine import zoo

    defaults = zoo.sampling_defaults() if hasattr(zoo, "sampling_defaults") else {}
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 4.0}
    sampling.update({k: v for k, v in defaults.items() if k in sampling})
    if a.temperature is not None:
        sampling["temperature"] = a.temperature
    ncls = eng.config.num_classes
    per = 2 if a.quick else a.per_class
    labels = [c for c in range(ncls) for _ in range(per)]
    groups = {"core": CORE_ROWS, "vvs": VVS_ROWS, "extra": extra_rows()}
    rows_spec = []
    for g in a.rows.split(","):
        rows_spec += groups[g]
    if a.quick:
        rows_spec = CORE_ROWS[:2] + [r for r in VVS_ROWS if r[0] == "VVS-U i=2 fill"] + CORE_ROWS[3:4]
    if a.essential:
        keep = {"AR", "EAGLE-2", "LANTERN d=0.1", "LANTERN d=0.2", "LANTERN d=0.3", "LANTERN++",
                "VVS-U i=2 fill", "VVS-U i=2 reject", "VVS-U i=4 fill", "VVS-D s=0.65 fill", "VVS-D s=0.3 fill",
                "SJD", "GSD G=14", "EAGLE-1 (static, exact)", "CASCADE (drafter)", "CASCADE (target-hidden)"}
        rows_spec = [r for r in rows_spec if r[0] in keep]
    if a.only:
        names = set(a.only.split(","))
        rows_spec = [r for r in rows_spec if r[0] in names or r[1] == "ar"]
    i, n = (int(x) for x in a.shard.split("/"))
    rows_spec = [r for k, r in enumerate(rows_spec) if r[1] == "ar" or k % n == i - 1]
    results = []
    for name, method, opts in rows_spec:
        print(f"[spec_zoo] {name} ...", flush=True)
        r = run_row(eng, name, method, opts, labels, a.seed, sampling, not a.no_inception, a.out + "_tokens")
        results.append(r)
        print(f"[spec_zoo] {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in r.items() if isinstance(v, float)), flush=True)
    ar = next((r for r in results if r["method"] == "ar" and "error" not in r), None)
    for r in results:
        if ar and "wall_s" in r:
            r["speedup_vs_ar"] = ar["wall_s"] / r["wall_s"]
    meta = {"device": str(eng.device), "dtype": a.dtype, "host": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "n_images": len(labels),
            "labels": f"{per} per class x {ncls} classes", "seed": a.seed, "sampling": sampling,
            "tokens_per_image": eng.tokens_per_image, "vq_decode_in_wall": True,
            "command": "python benchmarks/studies/spec_zoo/spec_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": results}, f, indent=2)
    md = to_markdown(meta, results)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    print(md)
    if a.plot and not a.quick:
        plot(results, a.plot)


def merge(files, out, plot_path, reeval=False, inception=True):
    """Shards -> one table; each row keeps the speed-up against its own shard's AR run. With
    ``reeval`` the quality metrics are recomputed from each row's saved tokens."""
    meta, rows, seen = None, [], set()
    for f in files:
        with open(f) as fh:
            d = json.load(fh)
        meta = meta or d["meta"]
        for r in d["rows"]:
            if r["name"] in seen:
                continue
            seen.add(r["name"])
            rows.append(r)
    if reeval:
        import numpy as np

        eng = Engine.load()
        for r in rows:
            if "tokens_file" in r:
                with np.load(r["tokens_file"]) as z:
                    toks, labels = torch.as_tensor(z["tokens"].astype("int64")), [int(x) for x in z["labels"]]
                evaluate_row(r, eng.decode_images(toks), labels, inception)
    meta["command"] = meta["command"] + f"  (merged from {len(files)} shards run side by side)"
    meta.setdefault("merges", []).append("python benchmarks/studies/spec_zoo/spec_zoo.py --merge " + " ".join(files)
                                         + (" --reeval" if reeval else "") + ("" if inception else " --no-inception"))
    with open(out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    md = to_markdown(meta, rows)
    with open(out + ".md", "w") as fh:
        fh.write(md)
    print(md)
    if plot_path:
        plot(rows, plot_path)


README_ORDER = ["AR", "EAGLE-2", "EAGLE-1 (static, exact)", "LANTERN d=0.1", "LANTERN d=0.2", "LANTERN d=0.3",
                "LANTERN++", "VVS-U i=2 fill", "VVS-U i=4 fill", "VVS-U i=2 reject", "VVS-D s=0.65 fill",
                "VVS-D s=0.3 fill", "SJD", "GSD G=3", "GSD G=8", "GSD G=14", "GSD G=50", "CASCADE (drafter)",
                "CASCADE (target-hidden)"]


def readme_summary(rows) -> str:
    """The README's short table: one row per run, in method-family order."""
    rank = {n: i for i, n in enumerate(README_ORDER)}
    lines = ["| method | TPF | mean accepted | class acc | FD (classifier) | FID |", "|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if "error" not in r), key=lambda r: rank.get(r["name"], len(rank))):
        lines.append(f"| {r['name']} | {_fmt(r['tpf'], 2)} | {_fmt(r.get('mean_accepted_length'), 2)} | "
                     f"{_fmt(r.get('class_accuracy'), 2)} | {_fmt(r.get('fd_classifier'), 1)} | "
                     f"{_fmt(r.get('fid_inception'), 0)} |")
    return "\n".join(lines)


def write_table(json_path, out, readme=None):
    """Rewrite ``out``.md (and the README's summary) from a results JSON: no table is edited by hand."""
    with open(json_path) as fh:
        d = json.load(fh)
    command = f"python benchmarks/studies/spec_zoo/spec_zoo.py --table {json_path} --out {os.path.relpath(out, ROOT)}"
    md = to_markdown(d["meta"], d["rows"], table_command=command)
    with open(out + ".md", "w") as fh:
        fh.write(md)
    print(md)
    if readme:
        begin = (f"<!-- spec-zoo:begin (generated by `{command} --readme {os.path.relpath(readme, ROOT)}`; "
                 f"do not edit) -->")
        with open(readme, encoding="utf-8") as fh:
            text = fh.read()
        i, j = text.index("<!-- spec-zoo:begin"), text.index("<!-- spec-zoo:end -->")
        with open(readme, "w", encoding="utf-8") as fh:
            fh.write(text[:i] + begin + "\n" + readme_summary(d["rows"]) + "\n" + text[j:])


def _fmt(v, nd=3):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def to_markdown(meta, rows, table_command=None):
    lines = [f"# Speculative methods on the Zoo model ({meta['device']}, {meta['dtype']})", "",
             f"{meta['n_images']} images ({meta['labels']}), seed {meta['seed']}, sampling {meta['sampling']}, "
             f"{meta['tokens_per_image']} tokens/image; torch {meta['torch']}, {meta['threads']} threads. "
             f"Wall-clock includes VQ decoding; speed-up = AR wall / row wall, same run. On a shared CPU the "
             f"ratio is only meaningful under steady load (the committed run's load changed while it ran); "
             f"clean CPU latencies: e2e_zoo_cpu.md. On a CPU, TPF and quality are the figures.", "",
             f"Command: `{meta['command']}`", ""]
    if meta.get("merges"):
        lines += ["Merged by: " + "; ".join(f"`{c}`" for c in meta["merges"]), ""]
    if table_command:
        lines += [f"Table written by `{table_command}`.", ""]
    lines += [
        "| method | TPF | mean accepted | speed-up vs AR | class acc | FD (classifier) | FID | skip steps |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} |||||||")
            continue
        lines.append(f"| {r['name']} | {_fmt(r['tpf'], 2)} | {_fmt(r.get('mean_accepted_length'), 2)} | "
                     f"{_fmt(r.get('speedup_vs_ar'), 2)} | {_fmt(r.get('class_accuracy'), 3)} | "
                     f"{_fmt(r.get('fd_classifier'), 2)} | {_fmt(r.get('fid_inception'), 1)} | {_fmt(r.get('skip_steps'))} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    """Quality against TPF, one numbered marker per row; the numbers are keyed in a legend beside the
    axes (names written next to 19 close points overlapped into an unreadable block)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "error" not in r and r.get("tpf") is not None]
    markers = {"AR": "s", "EAGLE-2": "^", "EAGLE-1": "v", "LANTERN": "o", "LANTERN++": "D", "VVS-U": "*",
               "VVS-D": "P", "SJD": "X", "GSD": "h", "CASCADE": "p"}
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.2))
    for ax, key, label in ((axes[0], "fd_classifier", "FD in the Zoo classifier's features (lower is better)"),
                           (axes[1], "class_accuracy", "class accuracy (higher is better)")):
        for i, r in enumerate(shown, 1):
            if key not in r:
                continue
            ax.scatter(r["tpf"], r[key], marker=markers.get(r["name"].split()[0], "x"), s=90, color=colours(i - 1),
                       label=f"{i}  {r['name']}" if ax is axes[0] else None, edgecolors="black", linewidths=0.4)
            ax.annotate(str(i), (r["tpf"], r[key]), fontsize=10, xytext=(5, 4), textcoords="offset points")
        ax.set_xlabel("TPF: tokens per target forward (higher is faster on a GPU)", fontsize=11)
        ax.set_ylabel(label, fontsize=11)
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
    fig.legend(loc="center right", fontsize=10, frameon=False, title="setting", title_fontsize=11)
    fig.suptitle("Quality against tokens per target forward, Zoo model (one run: same seed and labels)", fontsize=13)
    fig.tight_layout(rect=(0, 0, 0.78, 0.95))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
