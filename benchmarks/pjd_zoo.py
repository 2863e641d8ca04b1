"""PJD (2-D Jacobi decoding over image rows) on the Zoo model against AR, SJD, SJD-PAC, ZipAR and ZipAR + SJD:
tokens per forward (TPF), class accuracy and classifier FD with 95 % paired bootstrap intervals, and
forwards per image against grid size from the step model of ``pjd.md`` §1.7, checked on our counts.

Every setting decodes the same labels with the same random streams (image i draws from (seed, i)), so
the differences to AR are paired image by image; statistics, parity and the token cache are the shared
harness's (``benchmarks/harness.py``: quality_speed's functions and cache key), and the settings the two
tables share are ``quality_speed``'s entries. A setting is read from
``quality_speed``'s committed token cache when it holds it for the same key (the same model, labels, seed,
sampling, batch and options: at 512 images AR, SJD, SJD-PAC, ZipAR and the PJD settings it shares);
every other setting is decoded and cached under ``<out>_tokens/`` (committed; interrupted runs resume
there), with the row statistics of its decode beside it (``<setting>.rows.json``; ``quality_speed``
keeps none, so settings read from its cache have no row statistics).

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/pjd_zoo.py --images-per-class 32 --out benchmarks/results/pjd_zoo_512
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/pjd_zoo.py --model zoo-gpt-32 --images-per-class 16
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/pjd_zoo.py --out benchmarks/results/pjd_zoo_rowdrafts \
        --settings "Row drafts L=32 start 4 lag 2,SCD L=32,Row drafts L=32 s=2,Row drafts L=16 s=2"
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/pjd_zoo.py --model zoo-gpt-32 --images-per-class 16 \
        --controls --controls-per-class 3     # the instrument's controls (AR at T 1.05, 1.1, top-k 64): D only
    python benchmarks/pjd_zoo.py --images-per-class 32 --out benchmarks/results/pjd_zoo_512 --report-only \
        --doc docs/jacobi.md                                               # tables from the cache

``--doc`` also writes the tables between that file's marker comments (``pjd-zoo`` for zoo-gpt,
``pjd-<model>`` for another member).

The PJD settings (but ``PJD-E1 no cap``) cap the rows served per forward at 4 (``--zipar-max-rows 4``: 32 query lanes per
image instead of 9 x 8 on a CPU); the table reports how often the cap made a row wait (``cap waits``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import quality_speed as qs  # noqa: E402  (its settings: one definition, one cache key)
from harness import (  # noqa: E402  (the shared harness: cache, statistics, levels, report helpers)
    QUALITY_CACHE, ROOT, ReferenceSet, WorkCache, bootstrap_indices, cache_path, checkpoint_digest, fmt_ci, fmt_diff,
    fmt_gap, fmt_z, gap_of, gap_sampling, generate_setting, has_block, labels_for, level_fronts, levels_markdown,
    load_setting, parity_verdicts, pick, place_levels, replace_block, setting_draws, setting_key, summarise,
    write_tables, zoo_context)

PJD_CAP = {"zipar_max_rows": 4}
DEFAULT_PER_CLASS = 8  # 128 images: PJD's 4 rows x 8 lanes per forward take ~1 min per 16 images on one CPU thread
# (name, method, options); settings quality_speed also runs are its entries (one definition, one cache key)
SETTINGS = [
    qs.SETTING_BY_NAME["AR"],
    qs.SETTING_BY_NAME["SJD"],
    ("SJD-PAC", *qs.SETTING_BY_NAME["SJD-PAC W=3 D=3"][1:]),  # W = D = 3: the default when this table was made
    qs.SETTING_BY_NAME["ZipAR s=4"],
    qs.SETTING_BY_NAME["ZipAR s=8"],
    qs.SETTING_BY_NAME["ZipAR s=4 + SJD L=4"],
    qs.SETTING_BY_NAME["PJD-E1"],
    qs.SETTING_BY_NAME["PJD rule"],
    qs.SETTING_BY_NAME["PJD-E1 start 4"],
    ("PJD rule + keep 0.5", "pjd", dict(PJD_CAP, zipar_commit="drafts", zipar_keep=0.5)),
    ("PJD-E1 no cap", "pjd", {}),  # every started row served: does the cap of 4 cost forwards on a wide grid?
    # the 32x32 frontier (issue 52): the smaller start lags with and without SJD windows in the rows, and every
    # drafter-free family's best 16x16 setting (the exact ones: SJD-PAC W=2 D=3, SCD L=32); the drafter families
    # (EAGLE, LANTERN, CASCADE, VVS) are not here: this script loads no drafter for another Zoo member
    qs.SETTING_BY_NAME["ZipAR s=2"],
    ("ZipAR s=3", "zipar", {"zipar_window": 3}),
    qs.SETTING_BY_NAME["ZipAR s=2 + SJD L=4"],
    ("ZipAR s=3 + SJD L=4", "zipar", {"zipar_window": 3, "zipar_verify": "sjd", "zipar_jacobi_window": 4}),
    qs.SETTING_BY_NAME["SJD-PAC W=2 D=3"],
    qs.SETTING_BY_NAME["SCD L=32"],
    qs.SETTING_BY_NAME["GSD G=14"],
    # row-parallel drafts verified exactly in raster order (pjd.md E3; docs/zipar.md "Row drafts"): rows as a
    # draft source for an SCD-coupled raster verifier of L lanes; start lag 4 and commit lag 2 (adaptive) or s = 2
    ("Row drafts L=32 start 4 lag 2", "row-drafts", {"jacobi_window": 32, "zipar_window": 4, "zipar_commit_lag": 2}),
    ("Row drafts L=32 s=2", "row-drafts", {"jacobi_window": 32, "zipar_window": 2, "zipar_commit_lag": 0}),
    ("Row drafts L=16 s=2", "row-drafts", {"jacobi_window": 16, "zipar_window": 2, "zipar_commit_lag": 0}),
]
# the order a run generates them: the settings cheapest first, then the extra PJD ones
ORDER = ["AR", "ZipAR s=4", "ZipAR s=8", "SJD-PAC", "ZipAR s=4 + SJD L=4", "PJD-E1", "PJD rule", "SJD",
         "PJD-E1 start 4", "PJD rule + keep 0.5", "PJD-E1 no cap", "ZipAR s=2", "ZipAR s=2 + SJD L=4",
         "SJD-PAC W=2 D=3", "ZipAR s=3", "ZipAR s=3 + SJD L=4", "SCD L=32", "GSD G=14"]
SETTING_BY_NAME = {s[0]: s for s in SETTINGS}
# settings quality_speed caches too: this table's name -> quality_speed's name
SHARED_CACHE = {"AR": "AR", "SJD": "SJD", "SJD-PAC": "SJD-PAC W=3 D=3"}
DOC_BEGIN = "<!-- {tag}:begin (written by benchmarks/pjd_zoo.py --doc; do not edit) -->"
DOC_END = "<!-- {tag}:end -->"
PAIRS = [("PJD rule", "PJD-E1"), ("PJD-E1 no cap", "PJD-E1"), ("PJD rule + keep 0.5", "PJD-E1"),
         ("PJD-E1 start 4", "ZipAR s=4 + SJD L=4"), ("ZipAR s=4 + SJD L=4", "ZipAR s=4"),
         ("Row drafts L=32 start 4 lag 2", "SCD L=32"), ("Row drafts L=32 s=2", "SCD L=32")]
CAP_BINDS = 1.0  # cap waits per image from which the rows-per-forward cap counts as binding
GRIDS = [(16, False), (24, False), (32, False), (48, True)]  # (side, rows end with an EOL: Lumina-mGPT)


# the instrument's controls (quality_speed's: AR at T 1.05, T 1.1 and top-k 64, a changed sampling each) decode
# fewer images than the settings (AR costs ~10 s of a thread per 32x32 image): D needs no pairing with AR
DEFAULT_CONTROLS_PER_CLASS = 4


def control_labels(eng, per_class):
    return labels_for(eng.config.num_classes, per_class)


def generate_controls(eng, names, per_class, seed, sampling, batch_size, ckpt, cache_dir, log=print):
    labels = control_labels(eng, per_class)
    for name, method, opts in [qs.CONTROL_BY_NAME[n] for n in names]:
        own = qs.sampling_for(name, sampling)
        key = setting_key(ckpt, method, opts, own, labels, seed, batch_size)
        if load_setting(key, [(cache_dir, name)])[0] is not None:
            log(f"[pjd_zoo] {name}: cached")
            continue
        log(f"[pjd_zoo] {name} ({len(labels)} images)")
        t0 = time.time()
        generate_setting(eng, name, method, opts, labels, seed, own, batch_size, cache_path(cache_dir, name), key,
                         True, False, ROW_STATS, "pjd_zoo")
        log(f"[pjd_zoo] {name}: {time.time() - t0:.0f} s")


def control_rows(eng, per_class, seed, sampling, batch_size, ckpt, cache_dir, cached_gaps=False) -> list:
    """The controls with a complete cache -> rows with D under the target's shared sampling (no parity metrics:
    they are fewer images than the settings, not paired with AR's)."""
    labels = control_labels(eng, per_class)
    rows = []
    for name, method, opts in qs.CONTROLS:
        own = qs.sampling_for(name, sampling)
        gen, _ = load_setting(setting_key(ckpt, method, opts, own, labels, seed, batch_size), [(cache_dir, name)])
        if gen is None:
            continue
        gap = gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt, cache_dir, batch_size,
                     compute=not cached_gaps)
        rows.append({"name": name, "method": method, "sampling": own, "n_images": len(labels),
                     "gen_seconds": float(gen.get("gen_seconds", -1.0)), **({"gap": gap} if gap else {})})
    return rows


ROW_STATS = ("committing_rows", "testing_rows", "accepted_drafts", "most_rows_per_forward", "cap_waits", "zipar_rows")


def places(name, cache_dir):
    """Where a setting's tokens may be: this table's cache, then quality_speed's (under its own name)."""
    return [(cache_dir, name), (QUALITY_CACHE, SHARED_CACHE.get(name, name))]


def generate(eng, settings, labels, seed, sampling, batch_size, ckpt, cache_dir, log=print):
    for name, method, opts in settings:
        key = setting_key(ckpt, method, opts, sampling, labels, seed, batch_size)
        if load_setting(key, places(name, cache_dir))[0] is not None:
            log(f"[pjd_zoo] {name}: cached")  # here or in quality_speed's cache: never decoded twice
            continue
        log(f"[pjd_zoo] {name}")
        t0 = time.time()
        generate_setting(eng, name, method, opts, labels, seed, sampling, batch_size,
                         cache_path(cache_dir, name), key, True, False, ROW_STATS, "pjd_zoo")
        log(f"[pjd_zoo] {name}: {time.time() - t0:.0f} s")


def step_model(start_lag, rows, codes, per_row):
    """pjd.md §1.7: row r starts about s / v forwards after row r - 1 and the last row needs W / v more:
    (s (H - 1) + W) / v forwards (v: codes a row commits per forward it commits in)."""
    return (start_lag * (rows - 1) + codes) / per_row


def report(eng, settings, labels, seed, sampling, batch_size, ckpt, cache_dir, reps, work_dir, cached_gaps=False):
    from vvs_engine.evaluation.quality import reference_features
    from vvs_engine.methods import resolve_options

    T = eng.tokens_per_image
    H = W = int(round(T ** 0.5))
    idx = bootstrap_indices(len(labels), reps, seed)
    ref = {"cls": ReferenceSet(reference_features("classifier"))}
    work = WorkCache(work_dir)
    rows, ar, missing, all_draws = [], None, [], {}
    for name, method, opts in settings:
        key = setting_key(ckpt, method, opts, sampling, labels, seed, batch_size)
        gen, row_stats = load_setting(key, places(name, cache_dir))
        if gen is None:
            missing.append(name)
            continue
        _, _, draws = setting_draws(eng, work, name, gen, labels, ref, idx, seed)
        all_draws[name] = draws
        if method == "ar":
            ar = draws
        metrics = {k: summarise(v, b, ar.get(k) if (ar is not None and method != "ar") else None)
                   for k, (v, b) in draws.items()}
        row = {"name": name, "method": method, "options": resolve_options(method, opts), "n_images": len(labels),
               "forwards": float(gen["forwards"].mean()), "gen_seconds": float(gen.get("gen_seconds", -1.0)),
               **metrics}
        # the sampling gap D, kept in this table's tokens folder (quality_speed's for the settings read from there)
        gap = gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt, cache_dir, batch_size,
                     compute=not cached_gaps)
        if gap is not None:
            row["gap"] = gap
        if method in ("zipar", "pjd"):
            eff = row["options"]
            row["start_lag"] = eff["zipar_window"]
            plain = method == "zipar" and eff.get("zipar_verify") != "sjd"
            if not row_stats and plain:
                # plain ZipAR commits exactly one code per row per forward: its v needs no recording
                row["codes_per_row_forward"] = 1.0
                row["model_forwards"] = step_model(row["start_lag"], H, W, 1.0)
            elif not row_stats:
                row["row_stats_missing"] = True
            if row_stats:
                # v: codes per (row, forward) in which the row could commit (token 0: the prefill's)
                testing = sum(b["testing_rows"] for b in row_stats)
                row["codes_per_row_forward"] = len(labels) * (T - 1) / testing
                row["rows_per_forward"] = testing / float(gen["forwards"].sum())
                row["most_rows_per_forward"] = max(b["most_rows_per_forward"] for b in row_stats)
                row["cap_waits"] = sum(b["cap_waits"] for b in row_stats) / len(labels)
                row["model_forwards"] = step_model(row["start_lag"], H, W, row["codes_per_row_forward"])
        rows.append(row)
    if rows and rows[0]["method"] != "ar":
        raise SystemExit("error: AR's tokens are not cached: run AR first")
    parity_verdicts(rows)
    place_levels(rows)
    pairs = []  # paired differences between two settings on the same bootstrap draws
    for a, b in PAIRS:
        if a in all_draws and b in all_draws:
            pairs.append({"a": a, "b": b, **{k: summarise(all_draws[a][k][0], all_draws[a][k][1], all_draws[b][k])
                                             for k in ("class_accuracy", "fd_classifier", "tpf")}})
    return rows, missing, (H, W), pairs


def grid_rows(rows, measured_side):
    """Forwards per image at each grid of GRIDS: AR, SJD and SJD-PAC at their measured TPF (a model: their
    acceptance per token need not hold elsewhere), the row-parallel settings by the step model with
    their measured codes per row per forward."""
    out = []
    for r in rows:
        cells = []
        for side, eol in GRIDS:
            tokens = side * (side + eol)
            if side == measured_side and not eol:
                f = r["forwards"]
            elif "codes_per_row_forward" in r:  # the forced line ends need no forward (placed by the schedule)
                f = step_model(r["start_lag"], side, side, r["codes_per_row_forward"])
            elif r.get("row_stats_missing"):  # a row-parallel setting's TPF does not carry to other grids
                cells.append(None)
                continue
            else:
                # TPF counts the prefill's code (tokens / forwards): the same TPF on another grid
                f = tokens - 1.0 if r["method"] == "ar" else tokens / r["tpf"]["value"]
            cells.append((f, tokens / f))
        out.append((r["name"], cells))
    return out


def _span(ratios) -> str:
    """'0.82–0.86', or one figure when both ends print the same."""
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    return low if low == high else f"{low}–{high}"


def to_markdown(meta, rows, missing, pairs=(), controls=()) -> str:
    H, W = meta["grid"]
    lines = [f"# PJD on the Zoo model ({H}x{W} tokens)", "", f"Command: `{meta['command']}`", "",
             f"{meta['n_images']} images per setting ({meta['per_class']} per class), image i seeded with "
             f"({meta['seed']}, i) in every setting (paired with AR), sampling {meta['sampling']}, batch "
             f"{meta['batch_size']}, CPU fp32, 1 thread. Intervals: 95 % percentile bootstrap over images "
             f"({meta['bootstrap']} draws, shared by every setting); Δ = setting − AR on the same draws. Parity: no Δ "
             "interval (class accuracy, classifier FD) lies wholly on the worse side. Forwards: target forwards "
             "per image, prefill excluded. PJD: start lag 8, commit lag 2, 8 lanes per row, random new drafts, "
             "at most 4 rows per forward (no cap in `PJD-E1 no cap`); E1 = every row commits by the SJD rule "
             "(exact per forward), PJD rule = rows below the top one commit accepted drafts only (the release).", "",
             "| setting | forwards / image | TPF | class acc | Δ acc vs AR | FD (classifier) | Δ FD | parity | "
             "D (nats/token) | z | level | rows / forward | codes / row-forward | cap waits / image |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rpf = f"{r['rows_per_forward']:.2f} (max {r['most_rows_per_forward']})" if "rows_per_forward" in r else "–"
        cpr = f"{r['codes_per_row_forward']:.2f}" if "codes_per_row_forward" in r else "–"
        waits = f"{r['cap_waits']:.2f}" if "cap_waits" in r and r["method"] == "pjd" else "–"
        lines.append(f"| {r['name']} | {r['forwards']:.1f} | {fmt_ci(r['tpf'], 2)} | "
                     f"{fmt_ci(r['class_accuracy'], 3)} | "
                     f"{fmt_diff(r['class_accuracy'], 3)} | {fmt_ci(r['fd_classifier'], 2)} | "
                     f"{fmt_diff(r['fd_classifier'], 2)} | {'yes' if r['parity'] else 'no'} | {fmt_gap(r)} | "
                     f"{fmt_z(r)} | "
                     f"{r.get('level') or '–'} | {rpf} | {cpr} | {waits} |")
    if missing:
        lines += ["", f"Not generated yet (no complete cache): {', '.join(missing)}."]
    unrecorded = [r["name"] for r in rows if r.get("row_stats_missing")]
    if unrecorded:
        lines += ["", f"Row statistics not recorded for {', '.join(unrecorded)}: their tokens were read from "
                      "`quality_speed`'s cache, which keeps tokens and forwards only, so they have no measured v "
                      "(no step-model row, no extrapolation to other grids)."]
    lines += [""] + levels_markdown(rows)[:-1]
    if controls:
        lines += ["", "### Controls: AR sampling a known-wrong distribution", "",
                  f"AR's tokens at a changed sampling ({controls[0]['n_images']} images, {meta['controls_per_class']} "
                  "per class, image i seeded with (seed, i)), D measured against the target's own (the shared "
                  "sampling): what the instrument detects at this grid. No parity metrics (fewer images than the "
                  "settings, not paired with AR's).", "",
                  "| control | images | D (nats/token) | z | decode s (1 thread) |", "|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['n_images']} | {fmt_gap(r)} | {fmt_z(r)} | {r['gen_seconds']:.0f} |"
                  for r in controls]
    if pairs:
        lines += ["", "## Paired differences between settings", "",
                  "Δ = first − second on the same images and bootstrap draws (95 % intervals): does the released "
                  "rule's \"confirm twice\" buy quality over E1 at equal lags; what do PJD's lags and a row's "
                  "Jacobi window cost or buy against ZipAR + SJD and plain ZipAR at the same start lag?", "",
                  "| first | second | Δ class acc | Δ FD (classifier) | Δ TPF |", "|---|---|---|---|---|"]
        for pr in pairs:
            lines.append(f"| {pr['a']} | {pr['b']} | {fmt_diff(pr['class_accuracy'], 3)} | "
                         f"{fmt_diff(pr['fd_classifier'], 2)} | {fmt_diff(pr['tpf'], 2)} |")
    lines += ["", "## The step model (pjd.md §1.7) against our counts", "",
              "A row starts about s / v forwards after the row above (s: start lag, v: codes a row commits per "
              "forward in which the window rule lets it commit, measured) and the last row needs W / v more: "
              "forwards ≈ (s (H − 1) + W) / v. Plain ZipAR has v = 1 and needs (H − 1) s + W − 1 exactly.", "",
              "| setting | start lag s | v (measured) | forwards measured | model | model / measured |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if "model_forwards" in r:
            lines.append(f"| {r['name']} | {r['start_lag']} | {r['codes_per_row_forward']:.3f} | {r['forwards']:.1f} | "
                         f"{r['model_forwards']:.1f} | {r['model_forwards'] / r['forwards']:.3f} |")
    # a row held back by the rows-per-forward cap is slower than the model for that reason alone
    jacobi = [r for r in rows if r.get("codes_per_row_forward", 1.0) > 1.0 and "model_forwards" in r]
    free = [r["model_forwards"] / r["forwards"] for r in jacobi if r.get("cap_waits", 0.0) < CAP_BINDS]
    capped = [r for r in jacobi if r.get("cap_waits", 0.0) >= CAP_BINDS]
    if free:
        lines += ["", f"With Jacobi windows and no binding cap the model gives {_span(free)} of our counts (our "
                      "reading: it spends one average v on every row's start delay, while a lower row is held to the "
                      "pace of the row above by the commit lag, so the wavefront is longer than modelled; the "
                      "extrapolations below share that bias)."]
    if capped:
        names = ", ".join(f"{r['name']} ({r['cap_waits']:.1f} waits per image)" for r in capped)
        lines += ["", f"Where the cap on rows per forward binds ({names}) the model, which has no cap, gives "
                      f"{_span([r['model_forwards'] / r['forwards'] for r in capped])} of our counts: its "
                      "extrapolations to other grids are what the same lags would do without the cap."]
    head = " | ".join(f"{s}x{s}{' + EOL' if e else ''}" for s, e in GRIDS)
    lines += ["", "## Forwards per image (TPF) against grid size", "",
              f"Measured at {H}x{W}; elsewhere a model: row-parallel settings by the step model with the v measured "
              "here (the forced line ends need no forward), AR as T − 1, SJD and SJD-PAC at the TPF measured here "
              "(their acceptance per token held fixed). 48x48 + EOL is Lumina-mGPT 768's layout. The model has no row "
              "cap: on wider grids more rows are in flight (about W / s), which the PJD settings' cap of 4 rows "
              "would limit.", "",
              f"| setting | {head} |", "|---|" + "---|" * len(GRIDS)]
    for name, cells in grid_rows(rows, H):
        lines.append(f"| {name} | " + " | ".join("–" if c is None else f"{c[0]:.0f} ({c[1]:.2f})" for c in cells)
                     + " |")
    return "\n".join(lines) + "\n"


def doc_tag(model: str) -> str:
    """The marker name of a model's tables in a doc: each Zoo member has its own block."""
    return "pjd-zoo" if model == "zoo-gpt" else f"pjd-{model}"


def write_doc(path, md, tag="pjd-zoo") -> None:
    """The tables (with their command, without the title) between the marker comments ``tag`` of ``path``."""
    body = md.split("\n", 2)[2].strip().replace("\n## ", "\n#### ")  # the doc's own section levels
    begin, end = DOC_BEGIN.format(tag=tag), DOC_END.format(tag=tag)
    replace_block(path, begin, end, begin + "\n" + body + "\n" + end)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images-per-class", type=int, default=DEFAULT_PER_CLASS,
                    help=f"images per class (default {DEFAULT_PER_CLASS}: {16 * DEFAULT_PER_CLASS} images)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--settings", default=None, help="comma list of setting names to generate (AR always runs "
                                                     "first); default all. Known: " + ", ".join(SETTING_BY_NAME))
    ap.add_argument("--report-only", action="store_true", help="generate nothing; tables from the cache")
    ap.add_argument("--controls", nargs="?", const="all", default=None,
                    help="also decode the instrument's controls (all, or a comma list of " + ", ".join(qs.CONTROL_BY_NAME)
                         + ") at --controls-per-class images per class")
    ap.add_argument("--controls-per-class", type=int, default=DEFAULT_CONTROLS_PER_CLASS,
                    help=f"images per class of the controls (default {DEFAULT_CONTROLS_PER_CLASS}); the report shows "
                         "the controls cached at this count")
    ap.add_argument("--cached-gaps", action="store_true", help="the tables with the D values already in "
                                                               "sampling_gap.json only (no new ones: a setting "
                                                               "without D is placed at parity at most)")
    ap.add_argument("--gap-only", action="store_true", help="generate nothing, write no tables: the sampling gap D "
                                                            "of every cached setting into <out>_tokens/sampling_gap.json")
    ap.add_argument("--model", default="zoo-gpt", help="the Zoo target by name: zoo-gpt (16x16, default) or another "
                                                       "Zoo member with the same tokenizer (zoo-gpt-32 once it ships)")
    ap.add_argument("--out", default=None, help="output prefix: .md, .json, _tokens/ (default "
                                                "benchmarks/results/pjd_zoo, or pjd_<model> for another model)")
    ap.add_argument("--doc", default=None, help="also write the tables between this file's markers "
                                                "(pjd-zoo for zoo-gpt, pjd-<model> for another member)")
    a = ap.parse_args(argv)
    from vvs_engine.errors import VVSError

    try:
        if min(a.images_per_class, a.batch_size, a.bootstrap, a.controls_per_class) < 1:
            raise VVSError("--images-per-class, --controls-per-class, --batch-size and --bootstrap must be >= 1")
        names = pick(a.settings, SETTING_BY_NAME) if a.settings else list(ORDER)
        controls = (list(qs.CONTROL_BY_NAME) if a.controls == "all" else pick(a.controls, qs.CONTROL_BY_NAME)
                    if a.controls else [])
        tag = doc_tag(a.model)
        if a.doc and not has_block(a.doc, DOC_BEGIN.format(tag=tag), DOC_END.format(tag=tag)):
            # checked before any decoding: a run of hours must not fail at its last line
            raise VVSError(f"--doc {a.doc} has no {DOC_BEGIN.format(tag=tag)} ... {DOC_END.format(tag=tag)} block")
    except VVSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from vvs_engine import Engine
    from vvs_engine.zoo import model_path

    default_out = os.path.join(ROOT, "benchmarks", "results", "pjd_zoo" if a.model == "zoo-gpt" else f"pjd_{a.model}")
    out_given = a.out is not None and os.path.abspath(a.out) != default_out
    a.out = a.out or default_out
    paths, ckpt, sampling = zoo_context()
    if a.model != "zoo-gpt":  # another target, the same tokenizer and classifier; no method here needs a drafter
        try:
            paths = {"zoo-gpt": model_path(a.model), "zoo-vq": paths["zoo-vq"], "zoo-classifier": paths["zoo-classifier"]}
        except VVSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        ckpt = checkpoint_digest(paths)
    eng = Engine.load(gpt_ckpt=paths["zoo-gpt"], vq_ckpt=paths["zoo-vq"], drafter=paths.get("zoo-drafter"), threads=1)
    labels = labels_for(eng.config.num_classes, a.images_per_class)
    cache_dir = a.out + "_tokens"
    os.makedirs(cache_dir, exist_ok=True)
    if a.gap_only:  # the settings asked for (default all) in that order, each with a complete cache
        for name in ["AR"] + [n for n in names if n != "AR"]:
            _, method, opts = SETTING_BY_NAME[name]
            key = setting_key(ckpt, method, opts, sampling, labels, a.seed, a.batch_size)
            gen, _ = load_setting(key, places(name, cache_dir))
            if gen is not None:
                gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt, cache_dir, a.batch_size)
        control_rows(eng, a.controls_per_class, a.seed, sampling, a.batch_size, ckpt, cache_dir)
        return 0
    if not a.report_only:
        order = ["AR"] + [n for n in names if n != "AR"]
        if not (a.controls and not a.settings):  # --controls alone decodes the controls only
            generate(eng, [SETTING_BY_NAME[n] for n in order], labels, a.seed, sampling, a.batch_size, ckpt,
                     cache_dir)
        if a.controls:
            generate_controls(eng, controls, a.controls_per_class, a.seed, sampling, a.batch_size, ckpt, cache_dir)
    rows, missing, grid, pairs = report(eng, SETTINGS, labels, a.seed, sampling, a.batch_size, ckpt, cache_dir,
                                        a.bootstrap, a.out + "_work", a.cached_gaps)
    controls = control_rows(eng, a.controls_per_class, a.seed, sampling, a.batch_size, ckpt, cache_dir,
                            a.cached_gaps)
    command = "OMP_NUM_THREADS=1 nice -n 19 python benchmarks/pjd_zoo.py" + (
        f" --model {a.model}" if a.model != "zoo-gpt" else "") + (
        f" --images-per-class {a.images_per_class}" if a.images_per_class != DEFAULT_PER_CLASS else "") + (
        f" --settings \"{a.settings}\"" if a.settings and not a.report_only else "") + (
        (" --controls" if a.controls == "all" else f" --controls \"{a.controls}\"") if a.controls and not a.report_only
        else "") + (
        f" --controls-per-class {a.controls_per_class}" if a.controls_per_class != DEFAULT_CONTROLS_PER_CLASS
        else "") + (
        " --report-only" if a.report_only else "") + (" --cached-gaps" if a.cached_gaps else "") + (
        f" --out {os.path.relpath(a.out, ROOT)}" if out_given else "") + (
        f" --doc {os.path.relpath(os.path.abspath(a.doc), ROOT)}" if a.doc else "")
    meta = {"command": command, "n_images": len(labels), "per_class": a.images_per_class, "seed": a.seed,
            "sampling": sampling, "batch_size": a.batch_size, "bootstrap": a.bootstrap, "grid": grid,
            "torch": torch.__version__, "controls_per_class": a.controls_per_class}
    md = to_markdown(meta, rows, missing, pairs, controls)
    levels = {level: (front[0]["name"] if front else None) for level, front in level_fronts(rows).items()}
    write_tables(a.out, md, {"meta": meta, "rows": rows, "missing": missing, "pairs": pairs,
                             "fastest_per_level": levels, "controls": controls})
    if a.doc:
        try:
            write_doc(a.doc, md, doc_tag(a.model))
        except VVSError as e:  # the block went missing during the run: the tables are written, say so
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
