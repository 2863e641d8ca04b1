"""The sampling gap D (vvs_engine.evaluation.divergence): its summary arithmetic, that it reads 0 on an exact
method's committed Zoo tokens and is detected on the negative controls (AR at temperature 1.1 over-dispersed,
LANTERN mode-seeking), its levels of fidelity, and ``vvs-engine eval --target``."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

from vvs_engine.evaluation.divergence import format_gap, reads_exact, summarise_gap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import harness  # noqa: E402
import quality_speed as qs  # noqa: E402

CACHE = os.path.join(REPO, "benchmarks", "results", "quality_speed_tokens")
LABELS = [c for c in range(16) for _ in range(32)]  # the report's 512 images, class-major
SUBSET = list(range(0, 512, 16))  # 32 images, 2 of every class


def test_summary_is_the_mean_with_a_normal_interval_over_images():
    d = np.array([0.1, -0.1, 0.3, -0.3, 0.0, 0.2, -0.2, 0.0])
    s = summarise_gap(d)
    se = d.std(ddof=1) / math.sqrt(len(d))
    assert s["value"] == pytest.approx(0.0, abs=1e-12) and s["half_width"] == pytest.approx(1.96 * se)
    assert reads_exact(s) and s["n"] == 8
    shifted = summarise_gap(d + 0.5)
    assert not reads_exact(shifted) and shifted["z"] == pytest.approx(0.5 / se)
    assert format_gap(shifted) == f"+0.500 ± {1.96 * se:.3f}"
    assert not math.isfinite(summarise_gap([0.1, math.inf])["value"])


def _tokens(name):
    z = np.load(os.path.join(CACHE, harness.slug(name) + ".npz"))
    return z["tokens"].astype(np.int64)[SUBSET]


@pytest.fixture(scope="module")
def zoo_engine():
    from vvs_engine import Engine

    return Engine.load(model="zoo-gpt", threads=1)


def test_exact_method_reads_zero_and_the_controls_do_not(zoo_engine):
    """32 committed images per setting (2 per class) of the 512-image report: SJD-PAC (exact by construction)
    holds 0 in its interval; AR sampled at temperature 1.1 (over-dispersed) reads far above it; LANTERN's relaxed
    acceptance (mode-seeking at delta 0.2) reads below it."""
    from vvs_engine.evaluation.divergence import sampling_gap_per_image

    labels = [LABELS[i] for i in SUBSET]
    gap = {name: summarise_gap(sampling_gap_per_image(zoo_engine, _tokens(name), labels, batch_size=32))
           for name in ("SJD-PAC W=2 D=3", "AR T=1.1", "LANTERN d=0.2")}
    assert reads_exact(gap["SJD-PAC W=2 D=3"]), gap["SJD-PAC W=2 D=3"]
    assert gap["AR T=1.1"]["ci"][0] > 0.1, gap["AR T=1.1"]  # +0.25 at 512 images
    assert gap["LANTERN d=0.2"]["ci"][1] < 0, gap["LANTERN d=0.2"]


def _row(name, method, opts, gap, parity=True, tpf=2.0):
    return {"name": name, "method": method, "options": opts, "parity": parity, "tpf": {"value": tpf, "ci": (tpf, tpf)},
            "gap": summarise_gap(np.full(64, gap) + np.linspace(-0.05, 0.05, 64))}


def test_levels_need_construction_and_evidence():
    rows = [_row("AR", "ar", {}, 0.0, tpf=1.0),
            _row("exact", "sjd-pac", {"pac_width": 2}, 0.002, tpf=3.0),
            _row("exact by construction, D off", "sjd", {}, 0.05, tpf=2.5),  # a broken exact method: not exact
            _row("released PAC", "sjd-pac", {"pac_variant": "released"}, 0.0, tpf=3.5),  # relaxed sampler
            _row("relaxed, tiny D", "zipar", {"zipar_window": 8}, 0.02, tpf=4.0),
            _row("relaxed, tiny D, worse", "zipar", {}, 0.01, parity=False, tpf=6.0),
            _row("relaxed", "zipar", {}, 0.07, tpf=5.0)]
    fastest = harness.place_levels(rows)
    assert [r["level"] for r in rows] == ["exact", "exact", "parity", "near-lossless", "near-lossless", None, "parity"]
    assert fastest == {"exact": "exact", "near-lossless": "relaxed, tiny D", "parity": "relaxed"}
    md = "\n".join(harness.levels_markdown(rows))
    assert "| exact | 1 | exact | " in md and "| near-lossless | 1 | relaxed, tiny D |" in md
    # the README's evidence for every exact claim names the exact-by-construction setting that misses
    claims = qs.exact_claims_sentence(rows)
    assert "(3 of 3 settings measured" in claims and "Outside its interval of 0: exact by construction, D off" in claims


def test_eval_reports_the_gap_given_the_target(tmp_path, capsys):
    from vvs_engine.cli import main

    z = np.load(os.path.join(CACHE, "AR_T_1_1.npz"))
    pick = [0, 100, 200, 300, 400, 500, 64, 164]
    np.savez(tmp_path / "tokens.npz", tokens=z["tokens"].astype(np.int64)[pick],
             labels=np.asarray([LABELS[i] for i in pick], np.int64))
    # the run's recorded sampling is the one D is measured under: here the target's own (T 1), not the control's
    (tmp_path / "stats.json").write_text(json.dumps({"sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                                  "cfg_scale": 4.0}}))
    assert main(["eval", "--images", str(tmp_path), "--no-inception", "--target", "zoo-gpt", "--threads", "1"]) == 0
    gap = json.load(open(tmp_path / "metrics.json"))["sampling_gap"]
    assert gap["n"] == 8 and gap["target"] == "zoo-gpt" and gap["sampling"]["temperature"] == 1.0
    assert gap["ci"][0] > 0  # over-dispersed even on 8 images
    capsys.readouterr()
    # the wrong grid is a one-line error, before any image metric
    assert main(["eval", "--images", str(tmp_path), "--no-inception", "--target", "zoo-gpt-32"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tokens are 256 per image but --target zoo-gpt-32 has 1024")
