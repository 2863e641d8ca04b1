"""benchmarks/quality_speed.py and the harness it stands on (benchmarks/harness.py): interval and parity
arithmetic on synthetic data, a tiny run (two settings, a random engine) that exercises generation, caching,
metrics and the report, and the committed token caches found under the keys the tools compute."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import harness  # noqa: E402
import quality_speed as qs  # noqa: E402


def test_estimate_and_paired_difference_by_hand():
    idx = harness.bootstrap_indices(6, 400, seed=1)
    assert idx.shape == (400, 6) and idx.min() >= 0 and idx.max() <= 5
    ar_correct = np.array([1, 0, 1, 0, 1, 0], float)
    same = harness.estimate(lambda i: ar_correct[i].mean(), idx)
    m, boot = same
    assert m["value"] == 0.5 and m["ci"][0] <= 0.5 <= m["ci"][1]
    # the interval is the 2.5 / 97.5 percentiles of the per-draw means
    want = np.percentile([ar_correct[i].mean() for i in idx], [2.5, 97.5])
    assert np.allclose(m["ci"], want)
    # a setting that is AR plus one correct image: difference 1/6 on every draw that keeps ...
    better = np.array([1, 1, 1, 0, 1, 0], float)
    d, _ = harness.estimate(lambda i: better[i].mean(), idx, ar=(m["value"], boot))
    assert d["diff"] == pytest.approx(1 / 6)
    per_draw = np.array([better[i].mean() - ar_correct[i].mean() for i in idx])  # = share of index 1 in the draw
    assert np.allclose(d["diff_ci"], np.percentile(per_draw, [2.5, 97.5]))
    assert d["diff_ci"][0] >= 0  # paired: the setting is never worse on the same draw
    # identical to AR: zero difference with a zero-width interval
    z, _ = harness.estimate(lambda i: ar_correct[i].mean(), idx, ar=(m["value"], boot))
    assert z["diff"] == 0 and z["diff_ci"] == (0.0, 0.0)


def _row(name, method, acc_diff_ci, fd_diff_ci, tpf):
    return {"name": name, "method": method, "tpf": {"value": tpf, "ci": (tpf, tpf)},
            "class_accuracy": {"value": 0.5, "ci": (0.46, 0.54), "diff": 0.0, "diff_ci": acc_diff_ci},
            "fd_classifier": {"value": 10.0, "ci": (9.0, 11.0), "diff": 0.0, "diff_ci": fd_diff_ci}}


def test_parity_and_fastest_at_parity():
    ar = _row("AR", "ar", None, None, 1.0)
    for k in ("class_accuracy", "fd_classifier"):
        del ar[k]["diff"], ar[k]["diff_ci"]
    rows = [ar,
            _row("fast but worse", "x", (-0.10, -0.02), (-1.0, 1.0), 3.0),  # accuracy surely lower
            _row("slow at parity", "x", (-0.05, 0.04), (-1.0, 1.0), 1.5),
            _row("faster at parity", "x", (-0.04, 0.00), (0.0, 2.0), 2.0),  # both reach 0
            _row("fd too high", "x", (-0.03, 0.03), (0.1, 2.0), 2.5),  # FD surely higher
            _row("better", "x", (0.01, 0.05), (-2.0, -0.5), 1.2)]
    assert harness.parity_verdicts(rows) == "faster at parity"
    assert [r["parity"] for r in rows] == [True, False, True, True, False, True]
    md = qs.to_markdown({"command": "python benchmarks/quality_speed.py --x", "n_images": 6, "labels": "l",
                         "seed": 0, "sampling": {}, "checkpoints": "c", "torch": "t", "threads": 1, "device": "cpu",
                         "bootstrap": 10, "inception_bootstrap": 5}, rows, "faster at parity")
    lines = md.splitlines()
    assert lines[2] == "Command: `python benchmarks/quality_speed.py --x`"
    assert "**Fastest setting at parity: faster at parity**" in md
    every = lines[lines.index("## Every setting"):]
    table = [ln for ln in every if ln.startswith("| ") and not ln.startswith("| setting")]
    assert len(table) == len(rows) and all(ln.count("|") == 17 for ln in table)  # 13 columns + D, z, level
    assert "0.500 [0.460, 0.540]" in table[0] and table[1].endswith("| no | – | – | – |")  # no D: no level
    assert "-0.100, -0.020" in table[1]


def _fam_row(name, method, opts, tpf, acc_diff, acc_ci, fd_ci=(-1.0, 1.0)):
    r = _row(name, method, acc_ci, fd_ci, tpf)
    r["options"], r["class_accuracy"]["diff"] = opts, acc_diff
    return r


def test_family_fronts_within_two_points_and_the_vvs_verdict(tmp_path):
    ar = _row("AR", "ar", None, None, 1.0)
    for k in ("class_accuracy", "fd_classifier"):
        del ar[k]["diff"], ar[k]["diff_ci"]
    rows = [ar,
            _fam_row("LANTERN++", "lantern++", {}, 2.8, -0.006, (-0.05, 0.04)),
            _fam_row("LANTERN++ l=3", "lantern++", {"lantern_lambda": 3.0}, 3.2, -0.015, (-0.06, -0.001)),
            _fam_row("LANTERN++ l=9", "lantern++", {"lantern_lambda": 9.0}, 3.9, -0.05, (-0.09, -0.01)),
            _fam_row("VVS-U i=2 LANTERN++", "vvs", {"accept": "lantern++"}, 4.4, -0.03, (-0.07, -0.002)),
            _fam_row("VVS-U i=4 LANTERN++", "vvs", {"accept": "lantern++"}, 3.4, -0.01, (-0.05, 0.03)),
            _fam_row("VVS-U i=2 exact", "vvs", {"accept": "exact"}, 2.5, 0.0, (-0.04, 0.04), fd_ci=(0.2, 1.0)),
            _fam_row("SJD", "sjd", {}, 2.1, -0.02, (-0.07, 0.03))]
    ar["n_images"] = 32
    harness.parity_verdicts(rows)
    fronts = {f["family"]: f for f in qs.family_fronts(rows)}
    assert list(fronts) == ["LANTERN++", "VVS over LANTERN++", "VVS over exact", "SJD"]
    assert fronts["LANTERN++"]["parity"]["name"] == "LANTERN++"  # l=3's accuracy interval is wholly below 0
    assert fronts["LANTERN++"]["within"]["name"] == "LANTERN++ l=3"  # 1.5 points down: within 2
    assert fronts["VVS over LANTERN++"]["parity"]["name"] == "VVS-U i=4 LANTERN++"
    assert fronts["VVS over exact"]["parity"] is None and fronts["VVS over exact"]["within"] is None  # FD worse
    assert fronts["SJD"]["within"]["name"] == "SJD"  # exactly 2 points down counts as within
    answer = qs.vvs_answer(rows)
    assert [a["family"] for a in answer] == ["VVS over LANTERN++"]  # EAGLE-2, the exact base, is not in rows
    verdict = qs.vvs_verdict(answer)
    assert "VVS-U i=4 LANTERN++ at TPF 3.40" in verdict and "LANTERN++ at TPF 2.80" in verdict
    assert "VVS is faster at parity" in verdict
    # Jacobi windows on ZipAR's rows are PJD's front, plain ZipAR keeps its own
    assert qs.family_of("zipar", qs.SETTING_BY_NAME["ZipAR s=4 + SJD L=4"][2]) == "PJD"
    assert qs.family_of("zipar", qs.SETTING_BY_NAME["ZipAR s=4"][2]) == "ZipAR"
    assert qs.family_of("pjd", {}) == "PJD"
    # each VVS setting skips on its own rule and tree
    assert qs.vvs_base_setting({"accept": "lantern++"}) == "LANTERN++ dynamic tree"
    assert qs.vvs_base_setting({"accept": "lantern++", "tree": "static"}) == "LANTERN++ l=2"
    assert qs.vvs_base_setting({"accept": "exact"}) == "EAGLE-2" and qs.vvs_base_setting({}) == "LANTERN d=0.2"
    assert qs.vvs_base_setting(qs.SETTING_BY_NAME["VVS-U i=3 + CASCADE"][2]) == "CASCADE"
    assert qs.vvs_base_setting(qs.SETTING_BY_NAME["VVS-U i=3 + GSD"][2]) is None  # GSD's tree rule: no method
    # the equal-rule base (LANTERN++ on VVS's dynamic tree) is not among the rows: its cells say so
    (line,) = [ln for ln in qs.vvs_markdown(rows) if ln.startswith("| VVS-U i=4 LANTERN++ | LANTERN++ dynamic tree |")]
    assert line.split("|")[7].strip() == "–" and line.split("|")[6].strip().startswith("3.40")
    rows[5]["parity"] = False  # without its parity setting VVS over LANTERN++ is not faster
    assert "VVS is not faster at parity" in qs.vvs_verdict(qs.vvs_answer(rows))
    block = qs.readme_block({"n_images": 32, "labels": "l"}, rows, None)
    assert block.count("\n| ") == 1 + 4 and "VVS against its base rule" in block
    qs.plot(rows, str(tmp_path / "fronts.png"))
    assert (tmp_path / "fronts.png").stat().st_size > 0


def test_labels_are_placed_without_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    points = [(5.0, 5.0 + 0.01 * i, f"a long label {i}") for i in range(6)]  # all on one spot
    texts = qs.place_labels(ax, points)
    assert len(texts) >= 4
    boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)


def test_tiny_run_metrics_cache_and_report(tmp_path, monkeypatch):
    from spec_models import tiny_engine

    eng = tiny_engine(vocab=64, block=16, peak=4.0, dtype=__import__("torch").float32)
    settings = [qs.SETTING_BY_NAME["AR"], qs.SETTING_BY_NAME["EAGLE-2"]]
    labels = [0, 0, 1, 1, 2, 2]
    # VVS over exact: its skip fraction (a re-decode of SKIP_SAMPLE images per class) and the paired
    # difference to EAGLE-2, the same rule without skips
    vvs = qs.SETTING_BY_NAME["VVS-U i=2 exact"]
    vrows, _, _ = qs.evaluate(eng, settings + [vvs], labels, 0, {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                                "cfg_scale": 3.0}, inception=False, reps=30,
                              ckpt_key="tiny", show=False, ops=False)
    skip = vrows[2]["skip_fraction"]
    assert skip["images"] == 6 and 0.2 < skip["value"] < 0.5  # every other round skips once decoding is under way
    # what the rounds yield: a skip commits at least one drafted token; the base rule (re-decoded on the
    # same images) has no skips, and its verified rounds commit at least the target's own token
    base = vrows[1]["skip_fraction"]
    assert base["value"] == 0 and base["tokens_per_skip"] == 0 and base["accepted_per_verify"] >= 1
    assert skip["tokens_per_skip"] >= 1 and skip["accepted_per_verify"] >= 1
    assert "skip_fraction" not in vrows[0]  # AR: nothing to re-decode
    table = "\n".join(qs.vvs_markdown(vrows))
    assert f"| {skip['tokens_per_skip']:.2f} | {skip['accepted_per_verify']:.2f} ({base['accepted_per_verify']:.2f}) |" \
        in table, table
    assert set(vrows[2]["vs_base"]) == {"class_accuracy", "fd_classifier"}
    assert vrows[2]["vs_base"]["class_accuracy"]["diff"] == pytest.approx(
        vrows[2]["class_accuracy"]["value"] - vrows[1]["class_accuracy"]["value"])
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 3.0}
    kw = dict(inception=False, reps=30, cache_dir=str(tmp_path / "tok"), ckpt_key="tiny", show=False,
              work_dir=str(tmp_path / "work"))
    rows, fastest, missing = qs.evaluate(eng, settings, labels, 0, sampling, **kw)
    assert missing == []
    ar, eagle = rows
    assert ar["tpf"]["value"] == pytest.approx(1.0, abs=0.1) and eagle["tpf"]["value"] > ar["tpf"]["value"]
    for r in rows:
        for k in ("class_accuracy", "tpf"):
            assert r[k]["ci"][0] <= r[k]["value"] <= r[k]["ci"][1]
        # FD of a resample with repeated images is biased upwards: its interval need not hold the value
        assert 0 <= r["fd_classifier"]["ci"][0] <= r["fd_classifier"]["ci"][1]
        assert r["ops_per_token"] > 0
    assert "diff" in eagle["class_accuracy"] and "diff" not in ar["class_accuracy"]
    assert fastest in (None, "EAGLE-2") and (fastest == "EAGLE-2") == eagle["parity"]
    # cached tokens: a second run generates nothing and reproduces every figure
    monkeypatch.setattr(eng, "generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("regenerated")))
    rows2, _, _ = qs.evaluate(eng, settings, labels, 0, sampling, ops=False, **kw)
    assert rows2[1]["class_accuracy"] == eagle["class_accuracy"] and rows2[1]["tpf"] == eagle["tpf"]
    # a report over more settings than are cached lists the others as missing and generates nothing
    more = settings + [qs.SETTING_BY_NAME["SJD"]]
    rows3, _, missing3 = qs.evaluate(eng, more, labels, 0, sampling, ops=False, generate=[], **kw)
    assert [r["name"] for r in rows3] == ["AR", "EAGLE-2"] and missing3 == ["SJD"]
    # a changed option changes the digest: that setting's cache is not reused
    changed = [settings[0], ("EAGLE-2", "eagle", {"tree_topk": 4})]
    _, _, missing4 = qs.evaluate(eng, changed, labels, 0, sampling, ops=False, generate=[], **kw)
    assert missing4 == ["EAGLE-2"]
    qs.plot(rows, str(tmp_path / "p.png"), fastest)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_cli_rejects_unknown_settings(capsys):
    assert qs.main(["--settings", "AR,NOPE", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown setting(s) NOPE") and len(err.strip().splitlines()) == 1
    assert qs.main(["--no-report", "--report-only", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --no-report generates without a report") and len(err.strip().splitlines()) == 1


def test_interrupted_setting_resumes_from_its_last_batch(tmp_path):
    """A run stopped after the first batch keeps that batch (``.partial.npz``); the next run generates
    only the rest, and the result equals an uninterrupted run."""
    from spec_models import tiny_engine

    eng = tiny_engine(vocab=64, block=16, peak=4.0, dtype=__import__("torch").float32)
    labels, sampling = [0, 1, 2, 0, 1, 2], {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 3.0}
    key = harness.setting_key("tiny", "sjd", {}, sampling, labels, 0, 2)
    whole = harness.generate_setting(eng, "SJD", "sjd", {}, labels, 0, sampling, 2, str(tmp_path / "a.npz"), key,
                                show=False, ops=False)
    calls = []
    real = eng.generate

    def stop_after_one_batch(*args, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(kw["image_indices"])
        return real(*args, **kw)

    eng.generate = stop_after_one_batch
    cache = str(tmp_path / "b.npz")
    with pytest.raises(KeyboardInterrupt):
        harness.generate_setting(eng, "SJD", "sjd", {}, labels, 0, sampling, 2, cache, key, show=False, ops=False)
    assert os.path.exists(str(tmp_path / "b.partial.npz")) and not os.path.exists(cache)
    resumed = []
    eng.generate = lambda *args, **kw: resumed.append(kw["image_indices"]) or real(*args, **kw)
    again = harness.generate_setting(eng, "SJD", "sjd", {}, labels, 0, sampling, 2, cache, key, show=False, ops=False)
    assert resumed == [[2, 3], [4, 5]]  # batch [0, 1] came from the partial file
    assert (again["tokens"] == whole["tokens"]).all() and (again["forwards"] == whole["forwards"]).all()
    assert not os.path.exists(str(tmp_path / "b.partial.npz"))
    with np.load(cache) as z:
        assert z["tokens"].dtype == np.int16 and str(z["digest"]) == harness.digest_of(key)


COMMITTED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                         "quality_speed_tokens")


@pytest.mark.parametrize("name", ["AR", "ZipAR s=4"])
def test_committed_cache_is_what_generate_produces(name):
    """The committed evaluation tokens are exactly what ``Engine.generate`` gives for those labels,
    seeds, options and batch shape: the first batch (16 images) is regenerated and compared, for AR and
    for the cheapest sampled Jacobi setting (SJD's batch takes 30 s here, ZipAR's 8 s; ``quality_speed.py
    --verify N`` checks every setting, SJD included, outside CI). Exactly on the kind of
    machine that made the cache (recorded in it). On another CPU fp32 rounds differently (another BLAS
    path, another vector unit) and flips a few sampled near-ties, after which that image diverges: seen
    for one batch, AR 14 of 16 images identical, SJD 7 of 16 (its acceptance tests compare many
    probabilities). There AR must still match 12 of 16 images; the other settings are skipped."""
    import torch

    from vvs_engine import Engine

    path = os.path.join(COMMITTED, harness.slug(name) + ".npz")
    if not os.path.exists(path):
        pytest.skip(f"{path} is not committed yet")
    _, ckpt, sampling = harness.zoo_context()
    labels = [c for c in range(16) for _ in range(qs.CORE_IMAGES_PER_CLASS)]
    _, method, opts = qs.SETTING_BY_NAME[name]
    key = harness.setting_key(ckpt, method, opts, sampling, labels, 0, 16)
    gen = harness.load_cache(path, harness.digest_of(key))
    assert gen is not None, f"{path}: its digest does not match the current checkpoints/options (rerun the setting)"
    threads = torch.get_num_threads()
    try:
        eng = Engine.load(threads=int(gen["threads"]))  # the threads the cache was made with
        n, differ = harness.verify_cache(eng, gen, name, method, opts, labels, 0, sampling, 16, n_batches=1)
    finally:
        torch.set_num_threads(threads)
    made_on = str(gen["machine"]) if "machine" in gen else None
    if made_on == harness.machine_id("cpu"):
        assert n == 16 and differ == 0
    elif name == "AR":
        assert n == 16 and differ <= 4, (made_on, harness.machine_id("cpu"), differ)
    else:
        pytest.skip(f"{name}'s cache was made on {made_on or 'an unrecorded machine'}, this is "
                    f"{harness.machine_id('cpu')}: fp32 tokens are compared exactly only on the same machine")


def test_fast_reference_metrics_equal_the_library_ones():
    """ReferenceSet's FD (an n x n eigenproblem) and its precision/recall per draw (indexing distances
    computed once) give the values of the project's plain implementations."""
    from vvs_engine.evaluation.quality import frechet_distance_features, precision_recall

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(60, 24))
    fake = rng.normal(0.3, 1.2, size=(20, 24))
    rs = harness.ReferenceSet(ref, k=3)
    assert rs.fd(fake) == pytest.approx(frechet_distance_features(fake, ref), rel=1e-8)
    draws = harness.bootstrap_indices(20, 5, seed=2)
    full, per = rs.precision_recall_draws(fake, draws)
    want = precision_recall(ref, fake, 3)
    assert full == (want["precision"], want["recall"])
    for i, (p, r) in zip(draws, per):
        w = precision_recall(ref, fake[i], 3)
        assert (p, r) == (w["precision"], w["recall"])
        assert rs.fd(fake[i]) == pytest.approx(frechet_distance_features(fake[i], ref), rel=1e-8)


def test_defaults_follow_the_committed_evidence():
    """Each method's default options (today's code) are its family's fastest setting at AR parity in the
    committed 512-image report, or a documented exception; a faster setting at parity than the default
    is caught (negative control: SCD's L = 8 row made the fastest)."""
    import copy
    import json

    with open(os.path.join(os.path.dirname(COMMITTED), "quality_speed.json")) as f:
        rows = json.load(f)["rows"]
    verdicts = {v["family"]: v for v in qs.default_verdicts(rows)}
    assert {"EAGLE", "GSD", "SCD", "SJD-PAC", "ZipAR"} <= set(verdicts)
    assert [f for f, v in verdicts.items() if v["verdict"] == "differs"] == []
    assert all(v["reason"] for v in verdicts.values() if v["verdict"] == "kept")
    for family in ("SCD", "SJD-PAC", "ZipAR"):  # measured and at parity: the default is the fastest
        assert verdicts[family]["verdict"] == "follows", (family, verdicts[family]["default"])
    control = copy.deepcopy(rows)
    fast = next(r for r in control if r["name"] == "SCD L=8")
    fast["tpf"]["value"] = 99.0
    assert {v["family"]: v["verdict"] for v in qs.default_verdicts(control)}["SCD"] == "differs"


@pytest.mark.parametrize("folder,least", [("quality_speed_tokens", 10), ("pjd_zoo-gpt-32_tokens", 10),
                                          ("pjd_zoo_rowdrafts_tokens", 5), ("pjd_zoo-gpt-32_rowdrafts_tokens", 3)])
def test_every_committed_cache_loads_under_the_key_the_tools_compute(folder, least):
    """Hours of decoding sit in the committed caches: every one is found by the harness under the key its tool
    computes today from the setting's name (quality_speed's settings and controls, pjd_zoo's), the run's
    labels, seed, batch and checkpoints, with the pjd table's row statistics beside it. A changed cache key,
    digest, slug or effective default orphans them and fails here (negative control: another batch size)."""
    import glob
    import json

    import pjd_zoo

    settings = {harness.slug(s[0]): s for s in qs.SETTINGS + qs.CONTROLS}
    if folder.startswith("pjd_zoo"):
        settings.update({harness.slug(s[0]): s for s in pjd_zoo.SETTINGS})
    paths = sorted(p for p in glob.glob(os.path.join(os.path.dirname(COMMITTED), folder, "*.npz"))
                   if not p.endswith(".partial.npz"))
    assert len(paths) >= least
    for path in paths:
        name, method, opts = settings[os.path.basename(path)[: -len(".npz")]]
        with np.load(path) as z:
            run = json.loads(str(z["key"]))  # the run's labels, seed, batch, checkpoints: the report's own
        key = harness.setting_key(run["checkpoints"], method, opts, qs.sampling_for(name, run["sampling"])
                                  if folder == "quality_speed_tokens" else run["sampling"], run["labels"], run["seed"],
                                  run["batch_size"])
        gen, rows = harness.load_setting(key, [(os.path.dirname(path), name)])
        assert gen is not None, f"{path}: not found under today's key of {name!r} (its cache would be decoded again)"
        assert gen["tokens"].dtype == np.int64 and len(gen["forwards"]) == len(run["labels"])
        assert rows is not None or not folder.startswith("pjd_zoo"), path  # pjd_zoo keeps them for every setting
    changed = harness.setting_key(run["checkpoints"], method, opts, run["sampling"], run["labels"], run["seed"],
                                  run["batch_size"] // 2)
    assert harness.load_setting(changed, [(os.path.dirname(path), name)]) == (None, None)


def test_harness_report_helpers(tmp_path, capsys):
    """A GPU tool's table names the command from the repository root and its date, with its JSON beside it;
    a generated doc block is replaced between its markers only, and a missing block is a one-line error."""
    import json

    from vvs_engine.errors import VVSError

    script = os.path.join(harness.ROOT, "benchmarks", "round_replay.py")
    res = {"rows": [1], **harness.provenance(script, ["--shape", "tiny"])}
    assert res["command"] == "python benchmarks/round_replay.py --shape tiny" and res["device"] == "cpu"
    md = harness.write_report(str(tmp_path / "t.md"), res, "Title", ["a", "b"], [[1, "x"], [2, "y"]], ["note"])
    assert md.splitlines() == ["## Title", "", f"`{res['command']}`  |  {res['date']}", "", "| a | b |", "|---|---|",
                               "| 1 | x |", "| 2 | y |", "", "note"]
    assert (tmp_path / "t.md").read_text() == md and json.loads((tmp_path / "t.json").read_text()) == res
    doc = tmp_path / "doc.md"
    doc.write_text("head\n<!-- b -->\nold\n<!-- e -->\nmiddle\n<!-- b -->\nsecond\n<!-- e -->\ntail\n")
    assert harness.has_block(str(doc), "<!-- b -->", "<!-- e -->")
    harness.replace_block(str(doc), "<!-- b -->", "<!-- e -->", "<!-- b -->\nnew\n<!-- e -->")
    assert doc.read_text() == "head\n<!-- b -->\nnew\n<!-- e -->\nmiddle\n<!-- b -->\nsecond\n<!-- e -->\ntail\n"
    assert not harness.has_block(str(tmp_path / "none.md"), "<!-- b -->", "<!-- e -->")
    doc.write_text("<!-- e -->\n<!-- b -->\n")  # the end marker must follow the begin marker
    with pytest.raises(VVSError, match=r"has no <!-- b --> \.\.\. <!-- e --> block$"):
        harness.replace_block(str(doc), "<!-- b -->", "<!-- e -->", "x")
    assert doc.read_text() == "<!-- e -->\n<!-- b -->\n"
