"""The end-to-end benchmark's quick mode runs on the CPU and writes its report; replay helpers."""
from __future__ import annotations

import json
import os

import pytest

from vvs_engine.evaluation import bench

SMALL = "ar;eagle:tree_total=8,tree_depth=2,tree_topk=3;vvs:skip_interval=2,tree_total=8,tree_depth=2,tree_topk=3"


def test_quick_measure_then_replay_writes_reports(tmp_path):
    trace = tmp_path / "trace.json"
    assert bench.main(["--quick", "--repeats", "1", "--settings", SMALL, "--out", str(tmp_path),
                       "--record", str(trace), "--threads", "1"]) == 0
    rep = json.loads((tmp_path / "e2e_measure_cpu_quick.json").read_text())
    rows = rep["blocks"][0]["rows"]
    assert [r["method"] for r in rows] == ["ar", "eagle", "vvs"]
    assert rows[0]["speedup_vs_ar"] == pytest.approx(1.0)
    for r in rows:
        assert r["latency_s"] > 0 and r["tpf"] >= 1.0 and r["mean_accepted_length"] >= 1.0
    assert rows[2]["skip_steps"] > 0
    meta = rep["meta"]
    assert meta["vq_decode_included"] is False and meta["dtype"] == "float32" and "hardware" in meta
    md = (tmp_path / "e2e_measure_cpu_quick.md").read_text()
    assert "speed-up vs AR" in md and "| vvs(" in md
    assert trace.exists()

    # Replay with a high recorded acceptance: the forced lengths must show up in the replayed stats.
    t = json.loads(trace.read_text())
    for r in t["blocks"][0]["rows"]:
        if r["method"] != "ar":
            r["acceptance_rate_by_depth"] = {"1": 1.0, "2": 1.0}
    trace.write_text(json.dumps(t))
    assert bench.main(["--quick", "--repeats", "1", "--replay", str(trace), "--out", str(tmp_path), "--no-plot",
                       "--threads", "1"]) == 0
    rep = json.loads((tmp_path / "e2e_replay_cpu_quick.json").read_text())
    eagle = next(r for r in rep["blocks"][0]["rows"] if r["method"] == "eagle")
    assert eagle["mean_accepted_length"] > 2.5  # two drafts accepted + the bonus token, every round
    assert rep["meta"]["mode"] == "replay"


def test_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    row = dict(setting="ar", method="ar", latency_s=0.1, tpf=1.0, mean_accepted_length=1.0, speedup_vs_ar=1.0,
               speedup_over_tpf=1.0, cuda_graphs=False)
    files = bench.write_report({"meta": {"mode": "measure"}, "blocks": [
        {"model": "m", "tokens_per_image": 4, "rows": [row]}]}, str(tmp_path), "t")
    assert [os.path.basename(f) for f in files] == ["e2e_t.json", "e2e_t.md", "e2e_t.png"]
    assert os.path.getsize(files[2]) > 1000


def test_accepted_histogram_and_sequence():
    hist = bench.accepted_histogram({"1": 0.75, "2": 0.5, "3": 0.25})
    assert hist == pytest.approx([0.25, 0.25, 0.25, 0.25])
    seq = bench.length_sequence(hist, n=8, seed=0)
    assert sorted(seq) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert seq == bench.length_sequence(hist, n=8, seed=0)  # deterministic


def test_parse_setting():
    s = bench.parse_setting("vvs:skip-interval=3,lantern_delta=0.1,select=confidence")
    assert s.method == "vvs" and s.opts == {"skip_interval": 3, "lantern_delta": 0.1, "select": "confidence"}
    with pytest.raises(ValueError):
        bench.parse_setting("vvs:skip_interval")


def test_replay_setting_turns_dynamic_skips_into_uniform():
    class E:
        vq = None

        class config:
            vocab_size = 256

    row = {"method": "vvs", "opts": {"skip_policy": "dynamic", "lantern_delta": 0.3, "lantern_k": 16},
           "verified_steps": 40, "skip_steps": 20, "acceptance_rate_by_depth": {"1": 0.5}}
    s = bench.replay_setting(row, E)
    assert s.opts["skip_policy"] == "uniform" and s.opts["skip_interval"] == 3
    assert s.opts["accept"] == "trace_replay"
    ro = s.opts["rule_options"]
    assert ro["inner"] == "lantern" and ro["delta"] == 0.3 and ro["k"] == 16 and set(ro["lengths"]) == {0, 1}


def test_batch_table_quick(tmp_path):
    """--batch-sizes: one row per setting and batch size, images/s and TPF side by side; the command
    is written into the table."""
    settings = "ar;vvs:skip_interval=2,tree_total=8,tree_depth=2,tree_topk=3"
    assert bench.main(["--quick", "--settings", settings, "--batch-sizes", "1,2", "--images", "2", "--out",
                       str(tmp_path), "--threads", "1"]) == 0
    rep = json.loads((tmp_path / "batch_quick_cpu.json").read_text())
    rows = rep["rows"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [("ar", 1), ("ar", 2), ("vvs", 1), ("vvs", 2)]
    for r in rows:
        assert r["images_per_s"] > 0 and r["tpf"] >= 1.0 and r["images"] == 2
    vvs1, vvs2 = rows[2], rows[3]
    assert vvs1["tpf"] == pytest.approx(vvs2["tpf"])  # VVS-U: the same tokens and rounds per image
    # ops per committed token: a batched AR step is the same ops for twice the tokens
    ar1, ar2 = rows[0]["ops_per_token"], rows[1]["ops_per_token"]
    assert 0 < ar2 < 0.75 * ar1
    assert vvs1["ops_per_token"] > 0 and vvs2["ops_per_token"] < vvs1["ops_per_token"]
    md = (tmp_path / "batch_quick_cpu.md").read_text()
    assert "--batch-sizes 1,2" in md and "images/s" in md and "compute ops per committed token" in md
