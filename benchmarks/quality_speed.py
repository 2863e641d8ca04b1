"""Quality versus speed of every decoding setting on the Zoo model, with intervals that can tell
settings apart; built incrementally, run after run.

Every setting generates the same labels (``--images-per-class`` per class; the core run uses 32 -> 512
images) with the same random streams: image i draws from (``--seed``, i) in every setting, whatever
the batch it is decoded in, so AR and a method are paired image by image. Per setting: class
accuracy, FD in the classifier's feature space, Inception FID, precision/recall (Inception features,
k = 3), TPF (tokens per target forward) and compute ops per token (one image, counted with
:class:`vvs_engine.measure.opcount.OpCounter`). Every quality figure and TPF gets a 95 %
percentile-bootstrap interval over images, and the difference to AR an interval from the same
resampled image indices (paired by seed).

Parity: a setting keeps AR quality when none of class accuracy, classifier FD and FID (when computed)
is detectably worse: each paired difference's 95 % interval reaches 0 or the better side. The table
names the fastest setting (highest TPF) at parity.

**Incremental.** Generated tokens are cached per setting in ``<out>_tokens/<setting>.npz`` (tokens as
int16, forwards per image, ops per token, images/s, and the digest of checkpoints + effective method
options + sampling + labels + seed + batch size). The cache is committed, so the table grows run by
run: a run generates only the settings it is asked for that have no valid cache, then rebuilds the
markdown, JSON and plot from **every** setting whose cache is complete, and lists the missing ones. A
cache whose digest no longer matches (a changed checkpoint or option) is recomputed, never reused. An
interrupted setting resumes from its last finished batch (``<setting>.partial.npz``, not committed).
Per-image features and bootstrap draws are cached beside (``<out>_work/``, git-ignored), so rebuilding
the report costs seconds once they exist.

The cache, the statistics, the levels of fidelity and the report helpers are the shared harness's
(``benchmarks/harness.py``, also ``pjd_zoo.py``'s); this file holds the settings, the families and the report.

    python benchmarks/quality_speed.py --images-per-class 32 --settings all       # the whole table
    python benchmarks/quality_speed.py --images-per-class 32 --settings core      # core settings first
    python benchmarks/quality_speed.py --images-per-class 32 --report-only         # rebuild from the cache
    python benchmarks/quality_speed.py --images-per-class 32 --verify 1            # regenerate a batch, compare
    python benchmarks/quality_speed.py --images-per-class 2 --settings AR,EAGLE-2 --no-inception --out /tmp/qs
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import (  # noqa: E402  (the shared harness: cache, statistics, levels, report helpers)
    GAP_FILE, NEAR_LOSSLESS_D, PARITY_METRICS, ROOT, ReferenceSet, WorkCache, at_parity, bootstrap_indices,
    cache_path, cached, digest_of, exact_by_construction, fmt_ci, fmt_diff, fmt_gap, fmt_z, gap_of, gap_sampling,
    generate_setting, labels_for, level_fronts, levels_markdown, machine_id, parity_verdicts, pick,
    place_levels, replace_block, setting_draws, setting_key, summarise, verify_cache, write_tables, zoo_context)

# (name, method, options): the issue's settings, AR first.
SETTINGS = [
    ("AR", "ar", {}),
    ("EAGLE-1", "eagle", {"tree": "static"}),
    ("EAGLE-2", "eagle", {}),
    ("LANTERN d=0.1", "lantern", {"lantern_delta": 0.1}),
    ("LANTERN d=0.2", "lantern", {"lantern_delta": 0.2}),
    ("LANTERN d=0.3", "lantern", {"lantern_delta": 0.3}),
    # λ = 2: the lantern++ default until the 512-image report moved it to 3 (2026-12-05); pinned, and
    # the rule every VVS-over-LANTERN++ setting below skips on (VVS keeps λ = 2)
    ("LANTERN++ l=2", "lantern++", {"lantern_lambda": 2.0}),
] + [
    (f"VVS-U i={i} {pv}", "vvs",
     {"skip_policy": "uniform", "skip_interval": i, "post_verify": pv, "lantern_delta": 0.2})
    for i in (2, 3, 4) for pv in ("fill", "reject")
] + [
    (f"VVS-D s={s} fill", "vvs", {"skip_policy": "dynamic", "skip_threshold": s, "lantern_delta": 0.2})
    for s in (0.65, 0.3)
] + [
    ("SJD", "sjd", {}),
    ("GSD G=3", "gsd", {"gsd_group": 3}),
    ("GSD G=8", "gsd", {"gsd_group": 8}),
    ("GSD G=14", "gsd", {"gsd_group": 14}),
    # (the defaults until the frontier showed faster settings at parity: now named by their options)
    ("SCD L=16", "scd", {"jacobi_window": 16}),  # maximal coupling (lossless)
    ("SJD-PAC W=3 D=3", "sjd-pac", {"pac_width": 3, "pac_depth": 3}),  # the exact variant (lossless)
    ("CASCADE", "cascade", {}),  # the engine preset (target-hidden breadth source)
    ("CASCADE drafter", "cascade", {"cascade_source": "drafter"}),
    ("CASCADE llamagen", "cascade", {"cascade_variant": "llamagen"}),
    ("CASCADE lumina-final", "cascade", {"cascade_variant": "lumina-final"}),
    # the variants all relax at the published thresholds and none is at parity, so stricter settings trace the
    # front: b=0.95 d=0.8 kept the loss (-7.4 points at TPF 3.24), hence the gate's nucleus and tighter thresholds
    # still (TPF on a 16-image probe: 2.79 and 2.94, the preset 3.67)
    ("CASCADE b=0.95 d=0.8", "cascade", {"cascade_breadth_threshold": 0.95, "cascade_depth_threshold": 0.8}),
    ("CASCADE nucleus 0.3", "cascade", {"cascade_nucleus": 0.3}),
    ("CASCADE b=0.99 d=0.9", "cascade", {"cascade_breadth_threshold": 0.99, "cascade_depth_threshold": 0.9}),
    # ZipAR (lossy): the window of benchmarks/studies/zipar_zoo/zipar_zoo.md's choice and the smallest (the default now)
    ("ZipAR s=4", "zipar", {"zipar_window": 4}),
    ("ZipAR s=2", "zipar", {"zipar_window": 2}),
    # compositions no published system has
    ("VVS-U i=2 + GSD", "vvs", {"skip_policy": "uniform", "skip_interval": 2, "accept": "gsd"}),
    ("VVS-U i=2 + CASCADE", "vvs", {"skip_policy": "uniform", "skip_interval": 2, "accept": "cascade",
                                    "tree": "static"}),
] + [  # the compositions' fronts: longer skip intervals
    (f"VVS-U i={i} + GSD", "vvs", {"skip_policy": "uniform", "skip_interval": i, "accept": "gsd"}) for i in (3, 4)
] + [
    (f"VVS-U i={i} + CASCADE", "vvs", {"skip_policy": "uniform", "skip_interval": i, "accept": "cascade",
                                       "tree": "static"}) for i in (3, 4)
] + [
    # The frontier (each family traced by >= 3 settings). VVS over every base rule at parity, so what
    # skipping costs by itself is measured at an equal rule: over exact (EAGLE-2) and over LANTERN++.
    (f"VVS-U i={i} exact", "vvs", {"skip_policy": "uniform", "skip_interval": i, "accept": "exact"})
    for i in (2, 3, 4)
] + [
    (f"VVS-U i={i} LANTERN++", "vvs", {"skip_policy": "uniform", "skip_interval": i, "accept": "lantern++"})
    for i in (2, 3, 4)
] + [
    (f"VVS-D s={s} LANTERN++", "vvs", {"skip_policy": "dynamic", "skip_threshold": s, "accept": "lantern++"})
    for s in (0.65, 0.5, 0.4, 0.3)
] + [
    # VVS on the lantern++ method's own static tree (the better tree on the Zoo): the candidates to beat
    # LANTERN++ itself at parity
    ("VVS-U i=2 LANTERN++ static tree", "vvs", {"skip_policy": "uniform", "skip_interval": 2,
                                                "accept": "lantern++", "tree": "static"}),
    ("VVS-D s=0.5 LANTERN++ static tree", "vvs", {"skip_policy": "dynamic", "skip_threshold": 0.5,
                                                  "accept": "lantern++", "tree": "static"}),
] + [
    ("LANTERN d=0.05", "lantern", {"lantern_delta": 0.05}),
    ("LANTERN++ l=1.5", "lantern++", {"lantern_lambda": 1.5}),
    ("LANTERN++ l=3", "lantern++", {"lantern_lambda": 3.0}),
    # VVS drafts its dynamic (EAGLE-2) tree over every rule, while the lantern++ method drafts a static
    # EAGLE-1 tree: LANTERN++ on VVS's tree is the equal-rule base of VVS over LANTERN++
    ("LANTERN++ dynamic tree", "lantern++", {"tree": "dynamic", "lantern_lambda": 2.0}),
    ("EAGLE-2 n=30 d=3", "eagle", {"tree_total": 30, "tree_depth": 3}),
    ("EAGLE-2 n=90 d=6", "eagle", {"tree_total": 90, "tree_depth": 6}),
    ("SJD L=8", "sjd", {"jacobi_window": 8}),
    ("SJD L=32", "sjd", {"jacobi_window": 32}),
    ("SJD random init", "sjd", {"jacobi_init": "random"}),
    ("SCD L=8", "scd", {"jacobi_window": 8}),
    ("SCD L=32", "scd", {"jacobi_window": 32}),
    ("GSD G=8 maximal", "gsd", {"gsd_group": 8, "coupling": "maximal"}),
    ("SJD-PAC W=2 D=3", "sjd-pac", {"pac_width": 2, "pac_depth": 3}),
    ("SJD-PAC W=4 D=3", "sjd-pac", {"pac_width": 4, "pac_depth": 3}),
    ("SJD-PAC W=3 D=4", "sjd-pac", {"pac_width": 3, "pac_depth": 4, "jacobi_window": 40}),
    ("ZipAR s=8", "zipar", {"zipar_window": 8}),
    # PJD (the row-parallel method's Jacobi rows; E1 exact per forward is the preset), the same settings
    # and cache keys as benchmarks/pjd_zoo.py, so either script's 512-image tokens serve both
    ("PJD-E1", "pjd", {"zipar_max_rows": 4}),
    ("PJD-E1 start 4", "pjd", {"zipar_max_rows": 4, "zipar_window": 4}),
    ("PJD-E1 start 3", "pjd", {"zipar_max_rows": 4, "zipar_window": 3}),
    ("PJD rule", "pjd", {"zipar_max_rows": 4, "zipar_commit": "drafts"}),
    # ZipAR's rows with SJD windows of 4 lanes: PJD with commit lag = start lag 4, copy-above drafts, no cap
    ("ZipAR s=4 + SJD L=4", "zipar", {"zipar_window": 4, "zipar_verify": "sjd", "zipar_jacobi_window": 4}),
    ("ZipAR s=2 + SJD L=4", "zipar", {"zipar_window": 2, "zipar_verify": "sjd", "zipar_jacobi_window": 4}),
]
SETTING_BY_NAME = {s[0]: s for s in SETTINGS}
# Controls of the instrument D (issue 52): AR sampling a known-wrong distribution, to show what D and the parity
# rule detect. They are no method's setting (no frontier, no family); each changes the sampling, which is part
# of its cache key.
CONTROL_SAMPLING = {"AR T=1.05": {"temperature": 1.05}, "AR T=1.1": {"temperature": 1.1},
                    "AR top-k 64": {"top_k": 64}}
CONTROLS = [(name, "ar", {}) for name in CONTROL_SAMPLING]
CONTROL_BY_NAME = {s[0]: s for s in CONTROLS}


def sampling_for(name: str, sampling: dict) -> dict:
    """The sampling a setting decodes with: the shared one, or a control's change to it."""
    return {**sampling, **CONTROL_SAMPLING.get(name, {})}

# The core settings, in the order a run generates them (cheapest first, so a short run finishes some).
CORE = ["AR", "SJD", "GSD G=8", "VVS-U i=2 fill", "CASCADE", "VVS-U i=2 + GSD", "VVS-U i=2 + CASCADE",
        "VVS-D s=0.65 fill", "LANTERN++ l=2", "LANTERN d=0.2", "EAGLE-2", "ZipAR s=4", "SCD L=16", "SJD-PAC W=3 D=3"]
CORE_IMAGES_PER_CLASS = 32
# The frontier run (issue: every method's quality-speed front), cheapest first so each hour finishes
# settings; the VVS question (VVS over an equal base rule) before the rest of the spec-decoding fronts.
FRONTIER = ["ZipAR s=2", "ZipAR s=8", "SCD L=8", "SCD L=32", "SJD-PAC W=2 D=3", "SJD-PAC W=4 D=3",
            "SJD-PAC W=3 D=4", "VVS-D s=0.65 fill", "VVS-U i=2 LANTERN++", "VVS-U i=2 exact",
            "VVS-U i=3 LANTERN++", "VVS-U i=4 LANTERN++", "VVS-D s=0.5 LANTERN++", "VVS-D s=0.4 LANTERN++",
            "VVS-D s=0.65 LANTERN++", "VVS-D s=0.3 LANTERN++", "VVS-U i=3 exact", "LANTERN++ dynamic tree",
            "VVS-D s=0.5 LANTERN++ static tree", "VVS-U i=2 LANTERN++ static tree", "VVS-U i=4 exact",
            "LANTERN d=0.05", "LANTERN d=0.1", "LANTERN d=0.3", "LANTERN++ l=1.5", "LANTERN++ l=3", "EAGLE-1",
            "EAGLE-2 n=30 d=3", "EAGLE-2 n=90 d=6", "GSD G=3", "GSD G=14", "GSD G=8 maximal", "SJD L=8",
            "SJD L=32", "SJD random init", "CASCADE drafter", "CASCADE llamagen", "CASCADE lumina-final",
            "CASCADE b=0.95 d=0.8", "CASCADE nucleus 0.3", "CASCADE b=0.99 d=0.9",
            "VVS-U i=2 reject", "VVS-U i=3 fill", "VVS-U i=3 reject", "VVS-U i=4 fill", "VVS-U i=4 reject",
            "VVS-D s=0.3 fill", "PJD-E1", "PJD-E1 start 4", "PJD rule", "PJD-E1 start 3", "VVS-U i=3 + CASCADE",
            "VVS-U i=4 + CASCADE", "VVS-U i=3 + GSD", "VVS-U i=4 + GSD", "ZipAR s=4 + SJD L=4",
            "ZipAR s=2 + SJD L=4"]


def available_settings() -> list:
    """SETTINGS restricted to methods this engine has (a new method's rows appear once it is registered)."""
    from vvs_engine.methods import method_names

    have = set(method_names())
    return [s for s in SETTINGS if s[1] in have]


# --- per-family fronts and the VVS question --------------------------------------------------------
# VVS is a family per base rule: skipping is judged against the same rule without skips.
# accept= -> the base setting: the same rule on the same (dynamic) tree without skips. Not "LANTERN++ l=2",
# whose method drafts a static tree: on the Zoo that alone is TPF 2.65 against 2.25 on VVS's tree (16
# images), which the table would otherwise count as skipping's cost.
VVS_BASE = {"exact": "EAGLE-2", "lantern++": "LANTERN++ dynamic tree", None: "LANTERN d=0.2",
            # VVS + CASCADE skips on the cascade method's own static tree and preset: the same rule without skips
            "cascade": "CASCADE"}


def vvs_base_setting(opts: dict):
    """The setting a VVS setting skips on: its rule on its own tree (VVS over LANTERN++ with ``tree
    static`` skips on the lantern++ method's own static tree)."""
    if opts.get("accept") == "lantern++" and opts.get("tree") == "static":
        return "LANTERN++ l=2"
    return VVS_BASE.get(opts.get("accept"))
FAMILY_OF_METHOD = {"ar": "AR", "eagle": "EAGLE", "lantern": "LANTERN", "lantern++": "LANTERN++", "sjd": "SJD",
                    "gsd": "GSD", "scd": "SCD", "sjd-pac": "SJD-PAC", "cascade": "CASCADE", "zipar": "ZipAR",
                    "pjd": "PJD"}
WITHIN_POINTS = 0.02  # the fronts' second column: class accuracy at most 2 points below AR's


def family_of(method: str, opts: dict) -> str:
    """The front a setting belongs to: its method, VVS split by the rule it verifies with."""
    if method == "zipar" and opts.get("zipar_verify") == "sjd":
        return "PJD"  # Jacobi windows on ZipAR's rows are PJD's decoding (whatever the lags): one front
    if method != "vvs":
        return FAMILY_OF_METHOD.get(method, method)
    accept = opts.get("accept")
    if accept in ("gsd", "cascade"):
        return "VVS + " + accept.upper()  # compositions: their own fronts (no published base)
    return {"exact": "VVS over exact", "lantern++": "VVS over LANTERN++"}.get(accept, "VVS over LANTERN")


def within_points(row: dict, points: float = WITHIN_POINTS) -> bool:
    """A small-loss verdict: at parity, or class accuracy's point estimate at most ``points`` below AR's
    with the distance metrics (classifier FD, FID) not detectably worse (their paired intervals reach 0)."""
    if row["method"] == "ar" or row.get("parity"):
        return True  # at parity is within any loss (its point estimate may sit just below 2 points)
    acc = row.get("class_accuracy")
    if acc is None or "diff" not in acc or acc["diff"] < -points:
        return False
    return at_parity({k: v for k, v in row.items() if k != "class_accuracy"})


def family_fronts(rows: list) -> list:
    """One entry per family (in table order): its settings, and the highest-TPF setting at parity and
    within ``WITHIN_POINTS`` (None where no setting qualifies)."""
    fronts = {}
    for r in rows:
        if "error" in r or r["method"] == "ar":
            continue
        f = fronts.setdefault(family_of(r["method"], r.get("options", {})),
                              {"settings": [], "parity": None, "within": None})
        f["settings"].append(r["name"])
        for verdict, ok in (("parity", r["parity"]), ("within", within_points(r))):
            if ok and (f[verdict] is None or r["tpf"]["value"] > f[verdict]["tpf"]["value"]):
                f[verdict] = r
    return [dict(family=name, **f) for name, f in fronts.items()]


def vvs_answer(rows: list) -> list:
    """VVS against its base rule: per VVS family over a base, its best setting at parity (and within
    2 points) next to the base family's, and every VVS setting's paired difference to the base setting
    it skips on (what skipping alone costs at an equal rule: ``vs_base`` from :func:`evaluate`)."""
    by_family = {f["family"]: f for f in family_fronts(rows)}
    out = []
    for accept, base_name in VVS_BASE.items():
        fam = family_of("vvs", {"accept": accept})
        if fam not in by_family:
            continue
        _, base_method, base_opts = SETTING_BY_NAME[base_name]  # the base setting may not be decoded yet,
        base_fam = by_family.get(family_of(base_method, base_opts))  # its family must be
        if base_fam is None:
            continue
        settings = [r for r in rows if "error" not in r and r["method"] == "vvs" and
                    family_of("vvs", r.get("options", {})) == fam]
        out.append({"family": fam, "base_setting": base_name, "base_family": base_fam, "vvs": by_family[fam],
                    "settings": settings})
    return out


# --- defaults against the evidence -------------------------------------------------------------------
# A method's default options should be its family's fastest setting at AR parity on the Zoo. The method
# whose defaults stand for each family; a default kept otherwise on purpose has its reason here (printed
# in the report). tests/test_quality_speed.py checks today's defaults against the committed report.
DEFAULT_OF_FAMILY = {**{family: method for method, family in FAMILY_OF_METHOD.items() if method != "ar"},
                     family_of("vvs", {}): "vvs"}
KEPT_DEFAULTS = {
    "EAGLE": "EAGLE-2's dynamic tree, kept so that `--method eagle` is the published EAGLE-2; on the Zoo the "
             "static 57-node tree (EAGLE-1, `--tree static`) commits more per forward, as it does under LANTERN++",
    "VVS over LANTERN": "the published setting (VVS-U, every 2nd round skipped, over LANTERN δ = 0.2), kept so "
                        "that `--method vvs` is the paper's method",
    "LANTERN": "δ = 0.2, the VVS paper's scripts and Stage I base rule, kept so that `--method lantern` is that "
               "published relaxation (and VVS's base); on the Zoo only δ = 0.05 is at parity, slower than "
               "EAGLE-1 and LANTERN++ at parity",
    "CASCADE": "the published thresholds and gate (breadth 0.9, depth 0.625, the authors' final nucleus gate "
               "at 0.8), kept so that `--method cascade` is the relaxation the paper measured; on the Zoo they "
               "cost class accuracy; at parity are the authors' Lumina-mGPT preset (`--cascade-variant lumina-final`, "
               "the fastest) and the engine preset gated with `--cascade-nucleus 0.3`",
    "PJD": "PJD's published lags (start 8, commit 2, 8 lanes, random drafts) with the exact commit rule E1; "
           "the table's PJD rows cap the rows per forward at 4 to bound the CPU cost",
}


def default_verdicts(rows: list) -> list:
    """Per family of :data:`DEFAULT_OF_FAMILY`: the setting equal to the method's default options (today's
    code; None if not measured), the fastest at parity, and a verdict: ``follows`` (the default is the
    fastest at parity), ``no parity`` (no setting of the family is at parity: nothing to follow), ``kept``
    (a reason in :data:`KEPT_DEFAULTS`) or ``differs`` (a faster setting at parity than the default)."""
    from vvs_engine.methods import resolve_options

    fronts = {f["family"]: f for f in family_fronts(rows)}
    out = []
    for family, method in DEFAULT_OF_FAMILY.items():
        if family not in fronts:
            continue
        default = resolve_options(method, {})
        members = [r for r in rows if "error" not in r and r["method"] != "ar"
                   and family_of(r["method"], r.get("options", {})) == family]
        default_row = next((r for r in members if r["method"] == method
                            and resolve_options(method, r.get("options", {})) == default), None)
        fastest = fronts[family]["parity"]
        if fastest is None:
            verdict = "no parity"
        elif default_row is not None and default_row["name"] == fastest["name"]:
            verdict = "follows"
        elif family in KEPT_DEFAULTS:
            verdict = "kept"
        else:
            verdict = "differs"
        out.append({"family": family, "method": method, "default": default_row, "fastest": fastest,
                    "verdict": verdict, "reason": KEPT_DEFAULTS.get(family, "")})
    return out


def defaults_markdown(rows: list) -> list:
    verdicts = default_verdicts(rows)
    if not verdicts:
        return []
    text = {"follows": "follows the evidence", "no parity": "no setting at parity yet, the default stays",
            "kept": "kept on purpose", "differs": "**differs: a faster setting is at parity**"}
    lines = ["## Defaults against the evidence", "",
             "Each method's default options (`--method NAME` with no other option) against its family's fastest "
             "setting at parity in this table.", "",
             "| family | method | default is | its TPF | at parity | fastest at parity | TPF | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        d, f = v["default"], v["fastest"]
        verdict = text[v["verdict"]] + (f" ({v['reason']})" if v["reason"] else "")
        lines.append(f"| {v['family']} | `{v['method']}` | {d['name'] if d else 'not measured'} | "
                     f"{fmt_ci(d['tpf'], 2) if d else '–'} | {('yes' if d['parity'] else 'no') if d else '–'} | "
                     f"{f['name'] if f else 'none'} | {fmt_ci(f['tpf'], 2) if f else '–'} | {verdict} |")
    return lines + [""]


# --- what VVS's rounds yield -------------------------------------------------------------------------
SKIP_SAMPLE = 2  # images per class whose skip fraction is measured (a re-run of those images)


def skip_fraction(eng, name, method, opts, labels, seed, sampling) -> dict:
    """What the rounds yield, on the first ``SKIP_SAMPLE`` images of every class re-decoded with their own
    image indices (VVS's skip decision is per sequence, so they skip exactly as in the cached run; the
    token cache keeps no round counts): ``value`` = skipped rounds / all rounds; ``accepted_per_verify`` =
    tokens committed per verified round (the engine's mean accepted length); ``tokens_per_skip`` = the
    other tokens / skipped rounds. Also run for the base rules (no skips), so the report can show where a
    VVS setting's TPF goes: skips add tokens without a forward, while a tree drafted from stale target
    features may be accepted less in the verify rounds."""
    chosen = [i for c in sorted(set(labels)) for i in [j for j, lab in enumerate(labels) if lab == c][:SKIP_SAMPLE]]
    print(f"[quality_speed] {name}: rounds of {len(chosen)} images", flush=True)
    out = eng.generate(class_labels=[labels[i] for i in chosen], method=method, seed=seed, image_indices=chosen,
                       batch_size=len(chosen), decode_images=False, **sampling, **opts)
    skips, verified = int(out.stats.get("skip_steps", 0)), int(out.stats.get("verified_steps", 0))
    accepted = float(out.stats["mean_accepted_length"])
    tokens = len(chosen) * eng.tokens_per_image
    return {"value": skips / max(skips + verified, 1), "images": len(chosen), "accepted_per_verify": accepted,
            "tokens_per_skip": (tokens - accepted * verified) / skips if skips else 0.0}


# --- report -----------------------------------------------------------------------------------------
def to_markdown(meta: dict, rows: list, fastest, missing=(), controls=()) -> str:
    lines = ["# Quality versus speed on the Zoo model", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['n_images']} images per setting ({meta['labels']}), image i seeded with {meta['seed']} + i "
             f"(paired with AR by seed), sampling {meta['sampling']}, checkpoints {meta['checkpoints']}, "
             f"torch {meta['torch']}, {meta['threads']} threads, device {meta['device']}. Intervals: 95 % "
             f"percentile bootstrap over images ({meta['bootstrap']} draws; {meta['inception_bootstrap']} for the "
             f"Inception metrics); Δ = setting − AR on the same draws. Parity: no Δ interval (class accuracy, "
             f"classifier FD, FID) lies wholly on the worse side. FD intervals come from resamples that "
             f"repeat images and sit above the full-set value; the shift largely cancels in Δ. "
             f"Ops/token: aten compute ops of one image (views excluded) per token. Images/s: CPU wall clock of "
             f"the run that generated the setting, at its batch size and threads, under whatever else the "
             f"machine was running then (settings are generated in different runs, so these are not "
             f"comparable between settings: TPF and ops/token are the speed measures here).", "",
             f"**Fastest setting at parity: {fastest or 'none'}**", ""]
    if missing:
        lines += [f"Not yet in the table ({len(missing)}): {', '.join(missing)}.", ""]
    if meta.get("gap_run"):
        lines += [f"D (the sampling gap) and the levels: `{meta['gap_run']}` (the other columns are the last full "
                  f"run's, read from this report's JSON after checking each setting's cache digest).", ""]
    lines += levels_markdown(rows, controls)
    lines += fronts_markdown(rows) + vvs_markdown(rows) + defaults_markdown(rows)
    lines += ["## Every setting", "",
              "| setting | TPF | ops/token | images/s | class acc | Δ acc vs AR | FD (classifier) | Δ FD | FID | Δ FID "
              "| precision | recall | parity | D (nats/token) | z | level |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} |||||||||||| ")
            continue
        ops = f"{r['ops_per_token']:.0f}" if r.get("ops_per_token") not in (None, -1.0) else "–"
        ips = f"{r['images_per_second']:.3f}" if r.get("images_per_second") else "–"
        lines.append(f"| {r['name']} | {fmt_ci(r['tpf'], 2)} | {ops} | {ips} | {fmt_ci(r['class_accuracy'], 3)} | "
                     f"{fmt_diff(r['class_accuracy'], 3)} | {fmt_ci(r['fd_classifier'], 2)} | "
                     f"{fmt_diff(r['fd_classifier'], 2)} | "
                     f"{fmt_ci(r.get('fid_inception'), 1)} | {fmt_diff(r.get('fid_inception'), 1)} | "
                     f"{fmt_ci(r.get('precision'), 2)} | {fmt_ci(r.get('recall'), 2)} | "
                     f"{'yes' if r['parity'] else 'no'} | {fmt_gap(r)} | {fmt_z(r)} | {r.get('level') or '–'} |")
    return "\n".join(lines) + "\n"


def _best(r):
    if r is None:
        return "none", "–", "–"
    return r["name"], fmt_ci(r["tpf"], 2), fmt_diff(r["class_accuracy"], 3)


def fronts_markdown(rows: list) -> list:
    lines = ["## Per-family fronts", "",
             f"Each family's highest-TPF setting at parity, and at \"within {WITHIN_POINTS * 100:.0f} points\" "
             f"(at parity, or class accuracy's point estimate at most {WITHIN_POINTS * 100:.0f} points below AR's with "
             f"classifier FD and FID not detectably worse) for users who accept a small loss. VVS is one family per base rule.", "",
             ] + fronts_table(rows, counts=True)
    return lines + [""]


def fronts_table(rows: list, counts: bool) -> list:
    """The fronts as markdown table lines (with the number of settings per family when ``counts``)."""
    lines = ["| family |" + (" settings |" if counts else "") + " fastest at parity | TPF | Δ acc vs AR | "
             "fastest within 2 points | TPF | Δ acc vs AR |", "|---" * (7 + counts) + "|"]
    for f in family_fronts(rows):
        n = f" {len(f['settings'])} |" if counts else ""
        lines.append(f"| {f['family']} |{n} " + " | ".join(_best(f["parity"]) + _best(f["within"])) + " |")
    return lines


def vvs_verdict(answer: list) -> str:
    """One plain sentence per VVS family: does skipping reach parity at a TPF above its base rule's best?"""
    parts = []
    for a in answer:
        v, b = a["vvs"]["parity"], a["base_family"]["parity"] if a["base_family"] else None
        vt = f"{v['name']} at TPF {v['tpf']['value']:.2f}" if v else "no setting at parity"
        bt = f"{b['name']} at TPF {b['tpf']['value']:.2f}" if b else "no setting at parity"
        faster = v is not None and (b is None or v["tpf"]["value"] > b["tpf"]["value"])
        parts.append(f"{a['family']}: {vt} against its base rule's best, {bt}: "
                     f"{'VVS is faster at parity' if faster else 'VVS is not faster at parity'}.")
    return " ".join(parts)


def vvs_markdown(rows: list) -> list:
    answer = vvs_answer(rows)
    if not answer:
        return []
    lines = ["## VVS against its base rule", "", vvs_verdict(answer), "",
             "Skipping alone at an equal rule: each VVS setting against the same rule without skips (the base "
             "setting), paired image by image (Δ = VVS − base, 95 % bootstrap intervals). Skip fraction: skipped "
             f"rounds / all rounds on {SKIP_SAMPLE} images per class re-decoded; on those images also the tokens "
             "committed per verified round (VVS / its base rule: a tree drafted after a skip, from stale target "
             "features, can be accepted less) and per skipped round.", "",
             "| VVS setting | base setting | skip fraction | tokens / skip | tokens / verify (base) | TPF | base TPF "
             "| Δ acc vs base | Δ FD vs base | parity (vs AR) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_name = {r["name"]: r for r in rows if "error" not in r}
    missing = {"tpf": None}
    for a in answer:
        for r in a["settings"]:
            base_name = vvs_base_setting(r.get("options", {}))
            base = by_name.get(base_name, missing)  # "–" until the base setting is decoded
            vs = r.get("vs_base", {})
            skip = f"{r['skip_fraction']['value']:.2f}" if r.get("skip_fraction") else "–"
            rounds, base_rounds = r.get("skip_fraction", {}), base.get("skip_fraction", {})
            per_skip = f"{rounds['tokens_per_skip']:.2f}" if rounds.get("tokens_per_skip") else "–"
            per_verify = (f"{rounds['accepted_per_verify']:.2f} ({base_rounds['accepted_per_verify']:.2f})"
                          if "accepted_per_verify" in rounds and "accepted_per_verify" in base_rounds else "–")
            lines.append(f"| {r['name']} | {base_name} | {skip} | {per_skip} | {per_verify} | "
                         f"{fmt_ci(r['tpf'], 2)} | {fmt_ci(base['tpf'], 2)} | "
                         f"{fmt_diff(vs.get('class_accuracy'), 3)} | "
                         f"{fmt_diff(vs.get('fd_classifier'), 2)} | {'yes' if r['parity'] else 'no'} |")
    return lines + [""]


README_BEGIN = "<!-- quality-speed:begin"
README_END = "<!-- quality-speed:end -->"


def readme_block(meta: dict, rows: list, fastest, missing=()) -> str:
    """The README's quote of the table: TPF, class accuracy and classifier FD with their differences to AR
    (95 % intervals) and the parity verdict, for every complete setting."""
    command = (meta["gap_run"].rsplit(" (", 1)[0] if meta.get("gap_run") else
               f"python benchmarks/quality_speed.py --images-per-class {meta['n_images'] // 16} --report-only "
               f"--readme README.md --readme docs/benchmarks.md")
    lines = [f"{README_BEGIN} (generated by `{command}`; do not edit) -->",
             f"{meta['n_images']} images per setting ({meta['labels']}), paired with AR by seed; 95 % bootstrap "
             f"intervals; parity = no Δ interval wholly on the worse side; within 2 points = at parity, or class "
             f"accuracy at most 2 points below AR's with FD and FID not detectably worse. Fastest at parity: "
             f"**{fastest or 'none'}**. Every setting (FID, precision/recall, ops per token, VVS's skip fractions): "
             f"`benchmarks/results/quality_speed.md`." + (f" Not yet run at this size: {', '.join(missing)}."
                                                          if missing else ""), "",
             ] + fronts_table(rows, counts=False)
    verdict = vvs_verdict(vvs_answer(rows))
    if verdict:
        lines += ["", "**VVS against its base rule** (best at parity, same rule without skips): " + verdict]
    claims = exact_claims_sentence(rows)
    if claims:
        lines += ["", claims]
    lines += ["", levels_sentence(rows) + " `vvs-engine generate --preset exact|near-lossless|fastest` (and "
              "`Engine.generate(preset=...)`) decodes with a level's fastest setting for the target's grid: these "
              "rows on zoo-gpt (16x16), the 32x32 report's on zoo-gpt-32 (`vvs_engine/presets.py`, checked against "
              "both reports by `tests/test_presets.py`)."]
    lines.append(README_END)
    return "\n".join(lines)


def exact_claims_sentence(rows: list) -> str:
    """Every setting exact by construction with its D: the evidence behind each "lossless" claim."""
    from vvs_engine.evaluation.divergence import reads_exact

    exact = [r for r in rows if "error" not in r and exact_by_construction(r["method"], r.get("options", {}))]
    measured = [r for r in exact if r.get("gap")]
    if not measured:
        return ""
    off = [r["name"] for r in measured if not reads_exact(r["gap"])]
    text = (f"**Exact by construction, checked by D** ({len(measured)} of {len(exact)} settings measured; 95 % "
            f"intervals): " + ", ".join(f"{r['name']} {fmt_gap(r)}" for r in measured) + ". ")
    if off:
        text += (f"Outside its interval of 0: {', '.join(off)} (one in twenty exact settings is expected to miss; "
                 f"a miss is not counted as exact).")
    else:
        text += "Every one reads 0 within its interval."
    return text


def levels_sentence(rows: list) -> str:
    """One sentence: each level's fastest setting with its TPF and D."""
    parts = []
    for level, front in level_fronts(rows).items():
        parts.append(f"{level}: {front[0]['name']} (TPF {front[0]['tpf']['value']:.2f}, D {fmt_gap(front[0])})" if front
                     else f"{level}: none")
    return (f"**Fastest per level of fidelity** (D = sampling gap in nats/token; exact = exact by construction and D "
            f"reads 0; near-lossless = |D| <= {NEAR_LOSSLESS_D} and at parity): " + "; ".join(parts) + ".")


def place_labels(ax, points: list, fontsize: int = 7) -> list:
    """Annotate ``points`` [(x, y, text)] so no two labels overlap each other or leave the axes: each
    label takes the first free spot among offsets around its point at growing distances (measured
    with the figure's renderer), with a leader line when it moved away."""
    renderer = ax.figure.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    taken, texts = [], []
    offsets = [(dx * r, dy * r) for r in (6, 16, 28, 42, 58) for dx, dy in
               ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1.5), (0, -1.5))]
    for x, y, text in points:
        for k, (dx, dy) in enumerate(offsets):
            t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                            ha="left" if dx >= 0 else "right", va="bottom" if dy >= 0 else "top",
                            arrowprops=dict(arrowstyle="-", lw=0.5, color="grey") if k >= 8 else None)
            bb = t.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1
            if inside and not any(bb.overlaps(o) for o in taken):
                taken.append(bb)
                texts.append(t)
                break
            t.remove()
    return texts


def plot(rows: list, path: str, fastest=None) -> None:
    """TPF against Δ class accuracy and Δ classifier FD to AR (paired 95 % intervals), one colour per
    family, each family's front joined; labels on every family's fastest setting at parity (or its
    fastest, marked "(loss)", where none is), placed so they do not overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r["method"] != "ar"]
    ar = next(r for r in rows if "error" not in r and r["method"] == "ar")
    fronts = family_fronts(rows)
    colour = {f["family"]: plt.get_cmap("tab20")(i % 20) for i, f in enumerate(fronts)}
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5))
    for ax, key, sign, label in ((axes[0], "class_accuracy", +1, "Δ class accuracy vs AR (higher is better)"),
                                 (axes[1], "fd_classifier", -1, "Δ FD in classifier features vs AR (lower is better)")):
        ax.axhline(0.0, color="grey", lw=0.8)
        for f in fronts:
            mine = sorted((r for r in ok if r["name"] in f["settings"]), key=lambda r: r["tpf"]["value"])
            for r in mine:
                m, t = r[key], r["tpf"]
                # an FD difference's interval need not hold the full-set value (resamples repeat images)
                ax.errorbar(t["value"], m["diff"], yerr=[[max(0.0, m["diff"] - m["diff_ci"][0])],
                                                         [max(0.0, m["diff_ci"][1] - m["diff"])]],
                            fmt="o" if r["parity"] else "x", ms=5, capsize=2, color=colour[f["family"]], lw=0.8)
            # the front: settings no other of the family beats on both TPF and this metric
            front = [r for r in mine if not any(o["tpf"]["value"] > r["tpf"]["value"] and
                                                sign * o[key]["diff"] >= sign * r[key]["diff"] for o in mine)]
            ax.plot([r["tpf"]["value"] for r in front], [r[key]["diff"] for r in front], "-",
                    color=colour[f["family"]], lw=1.0, label=f"{f['family']} ({len(mine)})")
        labels = []
        for f in fronts:
            r = f["parity"] or max((r for r in ok if r["name"] in f["settings"]), key=lambda r: r["tpf"]["value"])
            text = r["name"] + (" *" if r["name"] == fastest else "") + ("" if r["parity"] else " (loss)")
            labels.append((r["tpf"]["value"], r[key]["diff"], text))
        ax.set_xlabel("TPF (tokens per target forward)", fontsize=10)
        ax.set_ylabel(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left" if sign > 0 else "upper left", ncol=2, title="family (settings)",
                  title_fontsize=7)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        place_labels(ax, sorted(labels, key=lambda p: -p[0]))
    fig.suptitle(f"Quality vs TPF on the Zoo, {ar['n_images']} images per setting, paired with AR (95 % bootstrap "
                 f"intervals; o = at AR parity, x = detectably worse; lines: each family's front; * = fastest at "
                 f"parity)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the run ----------------------------------------------------------------------------------------
def evaluate(eng, settings, labels, seed, sampling, inception=True, reps=1000, inception_reps=100, batch_size=16,
             cache_dir=None, ckpt_key="", ops=True, show=True, generate=None, work_dir=None) -> tuple:
    """Generate what is asked and report what is complete -> (rows, fastest setting at parity, missing).

    ``settings``: every setting the table lists (AR first). ``generate``: the names to generate when
    their cache is missing or stale (default: all of ``settings``); the others are reported only if
    their cache is complete and current, and listed as missing otherwise."""
    from vvs_engine.evaluation.quality import reference_features
    from vvs_engine.errors import VVSError

    want = set(s[0] for s in settings) if generate is None else set(generate)
    work = WorkCache(work_dir)
    idx = bootstrap_indices(len(labels), reps, seed)
    ref = {"cls": ReferenceSet(reference_features("classifier"))}
    if inception:
        ref["inc"] = ReferenceSet(reference_features("inception"))
    rows, ar, missing, all_draws = [], None, [], {}
    # the settings VVS settings skip on: their rounds are re-decoded too, for the VVS table's yield columns
    skip_bases = {vvs_base_setting(opts) for _, method, opts in settings if method == "vvs"}
    for name, method, opts in settings:
        key = setting_key(ckpt_key, method, opts, sampling, labels, seed, batch_size, str(eng.device))
        cache = cache_path(cache_dir, name) if cache_dir else None
        if name not in want:
            gen = cached(cache_dir, name, key) if cache_dir else None
            if gen is None:
                missing.append(name)
                continue
        else:
            if show:
                print(f"[quality_speed] {name}", flush=True)
            try:
                gen = generate_setting(eng, name, method, opts, labels, seed, sampling, batch_size, cache, key, show,
                                       ops)
            except VVSError as e:
                rows.append({"name": name, "method": method, "options": opts, "error": str(e)})
                continue
        token_digest, _, draws = setting_draws(eng, work, name, gen, labels, ref, idx, seed, inception, inception_reps)
        if method == "ar":
            ar = draws
        all_draws[name] = draws
        metrics = {k: summarise(v, b, ar.get(k) if (ar is not None and method != "ar") else None)
                   for k, (v, b) in draws.items()}
        row = {"name": name, "method": method, "options": opts, "n_images": len(labels),
               "ops_per_token": float(gen.get("ops_per_token", -1.0)),
               "images_per_second": float(gen["images_per_second"]) if "images_per_second" in gen else None,
               "gen_seconds": float(gen["gen_seconds"]) if "gen_seconds" in gen else None,
               "generated_with": {k: (gen[k] if not isinstance(gen.get(k), np.ndarray) else gen[k].item())
                                  for k in ("threads", "batch_size", "device", "machine", "revision", "date", "torch")
                                  if k in gen},
               "digest": digest_of(key)}
        row.update(metrics)
        row["gap"] = gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt_key, cache_dir, batch_size)
        if method == "vvs" or name in skip_bases:
            skips = work.get("rounds", [token_digest, method, opts, sampling, seed, SKIP_SAMPLE],
                             lambda: skip_fraction(eng, name, method, opts, labels, seed, sampling))
            row["skip_fraction"] = {k: float(v) for k, v in skips.items()}
        rows.append(row)
    for row in rows:  # VVS against the same rule without skips, paired image by image
        base = vvs_base_setting(row.get("options", {}))
        if row.get("method") == "vvs" and "error" not in row and base in all_draws:
            row["vs_base"] = {k: summarise(*all_draws[row["name"]][k], all_draws[base][k])
                              for k in PARITY_METRICS if k in all_draws[base]}
    ok = [r for r in rows if "error" not in r]
    if ok and ok[0]["method"] != "ar":
        raise VVSError("AR's tokens are not cached: the table needs AR (run it first)")
    fastest = parity_verdicts(ok)
    return rows, fastest, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images-per-class", type=int, default=CORE_IMAGES_PER_CLASS,
                    help=f"images per class (default {CORE_IMAGES_PER_CLASS}: 512 on the Zoo, class accuracy "
                         f"near 0.5 to +-4.3 points)")
    ap.add_argument("--settings", default="core",
                    help="what to generate: core (the default), frontier (core, then every front setting, cheapest "
                         "first), all, controls (AR at T 1.05, T 1.1 and top-k 64: the instrument's controls), or a "
                         "comma list of setting names (AR is "
                         "always included). The report lists every setting with a complete cache either way. "
                         "Known: " + ", ".join(SETTING_BY_NAME))
    ap.add_argument("--report-only", action="store_true", help="generate nothing; rebuild the report from the cache")
    ap.add_argument("--no-report", action="store_true",
                    help="generate the settings into the cache and stop (the report recomputes every cached "
                         "setting's image features: about 3 min of a core each; run --report-only when done)")
    ap.add_argument("--verify", type=int, default=0, metavar="N",
                    help="regenerate the first N batches of every cached setting and compare tokens; no report")
    ap.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                    help="start no new setting after S seconds (0 = no limit); the report is written anyway")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quality_speed"),
                    help="output prefix: .md, .json, _tokens/ (committed), _work/ (ignored); "
                         "default benchmarks/results/quality_speed")
    ap.add_argument("--readme", action="append", default=None,
                    help="also write the fronts' summary into this file between its quality-speed markers "
                         "(repeatable: README.md and docs/benchmarks.md)")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "quality_speed.png"), help="Pareto plot path")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--batch-size", type=int, default=16, help="images decoded together (default 16; part of the "
                                                              "cache digest)")
    ap.add_argument("--seed", type=int, default=0, help="image i draws from (seed, i); also seeds the bootstrap (default 0)")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap draws (default 1000)")
    ap.add_argument("--inception-bootstrap", type=int, default=100, help="draws for FID/precision/recall "
                                                                         "(each needs a 2048-d matrix root; default 100)")
    ap.add_argument("--no-inception", action="store_true", help="skip FID and precision/recall")
    ap.add_argument("--gap-report", action="store_true",
                    help="rebuild the report from its last full run's JSON (each row checked against its cache) "
                         "with the sampling gap D, the three levels of fidelity and the controls added")
    ap.add_argument("--cached-gaps", action="store_true",
                    help="with --gap-report: use the D values already in sampling_gap.json and compute no new ones "
                         "(a setting without D is placed at parity at most)")
    ap.add_argument("--gap-only", action="store_true",
                    help="compute the sampling gap D of every cached setting into <out>_tokens/sampling_gap.json "
                         "and stop (no generation, no report)")
    ap.add_argument("--no-ops", action="store_true", help="skip the ops-per-token count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ckpt-dir", default=None, help="load zoo-{gpt,vq,drafter} from this folder")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    from vvs_engine import Engine
    from vvs_engine.errors import VVSError

    t_start = time.time()
    try:
        torch.set_num_threads(a.threads)
        if a.images_per_class < 1 or a.batch_size < 1 or a.bootstrap < 1 or a.inception_bootstrap < 1:
            raise VVSError("--images-per-class, --batch-size and the bootstrap counts must be >= 1")
        if a.no_report and (a.report_only or a.verify):
            raise VVSError("--no-report generates without a report: it does not combine with --report-only "
                           "or --verify")
        known = available_settings()
        known_names = [s[0] for s in known]
        if a.settings == "core":
            generate = [n for n in CORE if n in known_names]
        elif a.settings == "frontier":
            generate = [n for n in CORE + FRONTIER if n in known_names]
        elif a.settings == "all":
            generate = known_names
        elif a.settings == "controls":
            generate = list(CONTROL_BY_NAME)
        else:
            generate = pick(a.settings, {**SETTING_BY_NAME, **CONTROL_BY_NAME})
            unavailable = [n for n in generate if n not in known_names and n not in CONTROL_BY_NAME]
            if unavailable:
                raise VVSError(f"setting(s) {', '.join(unavailable)} need a method this engine does not have")
        generate = ["AR"] + [n for n in generate if n != "AR"]
        if a.report_only or a.verify:
            generate = []
        out_dir = os.path.dirname(os.path.abspath(a.out))
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise VVSError(f"cannot write to {out_dir}")
        paths, ckpt, sampling = zoo_context(a.ckpt_dir)
        eng = Engine.load(gpt_ckpt=paths["zoo-gpt"], vq_ckpt=paths["zoo-vq"], drafter=paths["zoo-drafter"],
                          device=a.device, threads=a.threads)
        ncls = eng.config.num_classes
        labels = labels_for(ncls, a.images_per_class)
        cache_dir = a.out + "_tokens"
        if a.verify:
            return verify_all(eng, known, labels, a, sampling, ckpt, cache_dir)
        if a.gap_only:
            return gaps_of_cache(eng, known + CONTROLS, labels, a, sampling, ckpt, cache_dir)
        if a.gap_report:
            meta, rows, fastest, missing, controls = gap_report(eng, labels, a, sampling, ckpt, cache_dir)
            return write_report(a, meta, rows, fastest, missing, controls)
        # Generate in order, honouring the time budget between settings; then report everything cached.
        settings = [s for s in known if s[0] == "AR"] + [s for s in known if s[0] != "AR"]
        order = [SETTING_BY_NAME.get(n) or CONTROL_BY_NAME[n] for n in generate]
        for name, method, opts in order:
            if a.time_budget and time.time() - t_start > a.time_budget:
                print(f"[quality_speed] time budget of {a.time_budget:.0f} s spent: {name} and later settings "
                      f"are left for the next run", flush=True)
                break
            key = setting_key(ckpt, method, opts, sampling_for(name, sampling), labels, a.seed, a.batch_size,
                              a.device)
            print(f"[quality_speed] {name}", flush=True)
            generate_setting(eng, name, method, opts, labels, a.seed, sampling_for(name, sampling), a.batch_size,
                             cache_path(cache_dir, name), key, True, not a.no_ops)
        if a.no_report:
            print(f"[quality_speed] generated into {cache_dir}; report not rebuilt (--no-report)", flush=True)
            return 0
        rows, fastest, missing = evaluate(eng, settings, labels, a.seed, sampling, not a.no_inception, a.bootstrap,
                                          a.inception_bootstrap, a.batch_size, cache_dir, ckpt, not a.no_ops,
                                          generate=[], work_dir=a.out + "_work")
    except VVSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[quality_speed] interrupted: finished settings and batches are cached; run the same command "
              "again to resume", file=sys.stderr)
        return 130
    whole = f"python benchmarks/quality_speed.py --images-per-class {a.images_per_class} --settings all"
    if a.device != "cpu":
        whole += f" --device {a.device}"
    meta = {"command": whole, "n_images": len(labels), "labels": f"{a.images_per_class} per class x {ncls} classes",
            "seed": a.seed, "sampling": sampling, "checkpoints": ckpt, "torch": torch.__version__,
            "threads": a.threads, "device": a.device, "bootstrap": a.bootstrap,
            "inception_bootstrap": a.inception_bootstrap, "complete": [r["name"] for r in rows], "missing": missing,
            "this_run": "python benchmarks/quality_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "this_run_wall_s": time.time() - t_start}
    return write_report(a, meta, rows, fastest, missing)


def write_report(a, meta, rows, fastest, missing, controls=()) -> int:
    """The report's JSON, markdown, plot and README blocks."""
    from vvs_engine.errors import VVSError

    levels = place_levels(rows)
    md = to_markdown(meta, rows, fastest, missing, controls)
    write_tables(a.out, md, {"meta": meta, "rows": rows, "fastest_at_parity": fastest, "fastest_per_level": levels,
                             "controls": list(controls)})
    print(md)
    if a.plot and any(r["method"] == "ar" for r in rows):
        plot(rows, a.plot, fastest)
    for path in a.readme or ():
        try:
            replace_block(path, README_BEGIN, README_END, readme_block(meta, rows, fastest, missing))
        except (VVSError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


def control_rows(eng, labels, seed, sampling, batch_size, ckpt, cache_dir, reps, work_dir, device="cpu",
                 compute_gaps=True) -> list:
    """The controls with a complete cache -> rows with D, class accuracy and classifier FD paired with AR (the
    same bootstrap draws as the report's; no Inception features)."""
    from vvs_engine.evaluation.quality import reference_features

    idx = bootstrap_indices(len(labels), reps, seed)
    ref = {"cls": ReferenceSet(reference_features("classifier"))}
    work = WorkCache(work_dir)
    rows, ar = [], None
    for name, method, opts in [SETTING_BY_NAME["AR"]] + CONTROLS:
        key = setting_key(ckpt, method, opts, sampling_for(name, sampling), labels, seed, batch_size, device)
        gen = cached(cache_dir, name, key)
        if gen is None:
            if name == "AR":
                return []
            continue
        _, _, draws = setting_draws(eng, work, name, gen, labels, ref, idx, seed)
        if name == "AR":
            ar = draws
            continue
        row = {"name": name, "method": method, "options": opts, "sampling": sampling_for(name, sampling),
               "n_images": len(labels), "digest": digest_of(key),
               **{k: summarise(v, b, ar[k]) for k, (v, b) in draws.items()}}
        row["parity"] = at_parity(row)
        gap = gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt, cache_dir, batch_size,
                     compute=compute_gaps)
        if gap is not None:
            row["gap"] = gap
        rows.append(row)
    return rows


def gap_report(eng, labels, a, sampling, ckpt, cache_dir) -> tuple:
    """--gap-report: the last full run's rows (``<out>.json``, each checked against its cache's digest) with D,
    the levels and the controls added -> (meta, rows, fastest, missing, controls)."""
    from vvs_engine.errors import VVSError

    with open(a.out + ".json") as f:
        old = json.load(f)
    rows = old["rows"]
    for r in rows:
        if "error" in r:
            continue
        name, method, opts = SETTING_BY_NAME[r["name"]]
        key = setting_key(ckpt, method, opts, sampling, labels, a.seed, a.batch_size, a.device)
        if digest_of(key) != r.get("digest"):
            raise VVSError(f"{a.out}.json's row {name} is not from its current cache key: run the full report")
        gen = cached(cache_dir, name, key)
        if gen is None:
            raise VVSError(f"{name}'s tokens are not in {cache_dir}")
        r["gap"] = gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt, cache_dir, a.batch_size,
                          compute=not a.cached_gaps)
        if r["gap"] is None:
            del r["gap"]
    fastest = parity_verdicts([r for r in rows if "error" not in r])
    place_levels(rows)
    controls = control_rows(eng, labels, a.seed, sampling, a.batch_size, ckpt, cache_dir, a.bootstrap,
                            a.out + "_work", a.device, not a.cached_gaps)
    meta = dict(old["meta"])
    meta["gap_run"] = (f"python benchmarks/quality_speed.py --images-per-class {a.images_per_class} --gap-report"
                       + (" --cached-gaps" if a.cached_gaps else "")
                       + "".join(f" --readme {os.path.relpath(os.path.abspath(p), ROOT)}" for p in a.readme or ())
                       + f" ({datetime.date.today().isoformat()})")
    return meta, rows, fastest, old["meta"].get("missing", []), controls


def gaps_of_cache(eng, settings, labels, a, sampling, ckpt, cache_dir) -> int:
    """--gap-only: D of every setting with a complete cache into ``sampling_gap.json``, nothing else."""
    done = 0
    if os.path.exists(a.out + ".json"):  # the report's candidates first (at parity, fastest first): a partial run helps
        with open(a.out + ".json") as f:
            rank = {r["name"]: (not r.get("parity", False), -r["tpf"]["value"]) for r in json.load(f)["rows"]
                    if "tpf" in r}
        settings = sorted(settings, key=lambda s: (s[0] != "AR", s[0] not in CONTROL_BY_NAME,
                                                   rank.get(s[0], (False, 0.0))))
    for name, method, opts in settings:
        key = setting_key(ckpt, method, opts, sampling_for(name, sampling), labels, a.seed, a.batch_size, a.device)
        gen = cached(cache_dir, name, key)
        if gen is None:
            continue
        gap_of(eng, name, gen["tokens"], labels, gap_sampling(sampling), ckpt, cache_dir, a.batch_size)
        done += 1
    print(f"[quality_speed] D of {done} settings in {os.path.join(cache_dir, GAP_FILE)}", flush=True)
    return 0


def verify_all(eng, settings, labels, a, sampling, ckpt, cache_dir) -> int:
    """--verify N: every cached setting's first N batches regenerated and compared; exit 1 on a mismatch."""
    bad = 0
    for name, method, opts in settings:
        key = setting_key(ckpt, method, opts, sampling, labels, a.seed, a.batch_size, a.device)
        gen = cached(cache_dir, name, key)
        if gen is None:
            continue
        n, differ = verify_cache(eng, gen, name, method, opts, labels, a.seed, sampling, a.batch_size, a.verify)
        made_on, here = str(gen.get("machine", "an unrecorded machine")), machine_id(eng.device)
        same = made_on == here
        bad += differ if same else 0
        print(f"[quality_speed] verify {name}: {n - differ}/{n} images identical to the cache"
              + ("" if same else f" (made on {made_on}, this is {here}: fp32 rounding differs between machines, "
                                 f"so a few images may too)"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
