"""The round-cost model's arithmetic (benchmarks/round_cost.py) on cases computed by hand."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import round_cost as rc  # noqa: E402

# 1000 bytes/s and 1000 FLOP/s: a group's milliseconds are max(bytes, FLOPs) / 1000 * 1000.
SLOW = rc.Hardware(gap_us=2.0, hbm_tb_s=1e-9, peak_tflop_s=1e-9, rows=2)
TOY = rc.Shape("toy", layers=2, dim=4, heads=1, kv_heads=1, ffn=8, head_rows=10, tokens=4, cond=2, source="test",
               draft_dim=4, draft_ffn=8)


def test_ar_step_by_hand():
    # layer params: q/k/v 4x12 + o 4x4 + gate/up/down 3x4x8 = 160; prefix P = 2 + 4/2 = 4; rows R = 2
    assert TOY.layer_params() == 160
    g = rc.round_groups(TOY, rc.round_work("ar_step"), SLOW)
    # GEMMs: weights (2 x 160 + 10 x 4) x 2 B = 720, activations 2 x 1 x 2 x (24 + 8 + 24 + 8) x 2 = 512;
    # FLOPs 2 x 2 x 1 x (320 + 40) = 1440
    assert g["target GEMMs"] == (1232, 1440)
    # attention: KV read 2 x 2 x 2 x 4 x 4 x 2 = 256 + write 2 x 2 x 2 x 1 x 4 x 2 = 64; FLOPs 4 x 2 x 1 x 4 x 4 x 2 = 256
    assert g["target attention"] == (320, 256)
    assert g["target logits"] == (160, 0)  # 2 rows x 10 logits x 4 B, written and read
    r = rc.round_ms(TOY, rc.round_work("ar_step"), launches=10, hw=SLOW)
    assert r["launch_ms"] == pytest.approx(0.02)  # 10 launches x 2 us
    assert r["work_ms"] == pytest.approx(1440 + 320 + 160)  # max(bytes, FLOPs) per group
    assert r["ms"] == pytest.approx(1920.02)


def test_skip_round_has_no_target_work():
    g = rc.round_groups(TOY, rc.round_work("skip"), SLOW)
    assert set(g) == {"drafter GEMMs", "drafter attention", "drafter head"}
    w = rc.round_work("skip")
    assert w.draft_forwards == (5, 10, 10, 10, 10) and w.draft_head_rows == 41  # extend + 4 levels of 10
    # drafter params: fc 2x4x4 + 4 bias, q/k/v/o 4x4x4, MLP 3x4x8 = 32 + 4 + 64 + 96 = 196
    assert TOY.draft_params() == 196
    assert g["drafter GEMMs"] == (5 * 196 * 2 + 2 * 45 * 12 * 4 * 2, 2 * 2 * 45 * 196)


def test_speedup_from_rounds():
    # 8 tokens at TPF 2: 4 forwards; half of them follow a skip: 2 skip + 2 verify-after-skip + 2 verify
    n = rc.rounds_per_image(8, 2.0, 0.5, ("verify", "skip", "verify_after_skip"))
    assert n == {"skip": 2.0, "verify_after_skip": 2.0, "verify": 2.0}
    assert rc.rounds_per_image(8, 2.0, 0.0, ("jacobi_iteration",)) == {"jacobi_iteration": 4.0}


def test_fit_recovers_slope_and_fixed_part():
    slope, fixed, resid = rc.fit([2, 4, 6], [79, 129, 179])
    assert (slope, fixed, resid) == pytest.approx((25.0, 29.0, 0.0))


def test_committed_table_is_labelled_a_model_and_consistent():
    path = os.path.join(ROOT, "benchmarks", "results", "round_cost.json")
    with open(path) as f:
        res = json.load(f)
    assert res["label"].startswith("MODEL")
    md = open(path[:-4] + "md").read()
    assert md.startswith("<!-- written by: python benchmarks/round_cost.py") and "a MODEL" in md
    hw = rc.Hardware(**res["hardware"])
    xl = res["model"]["LlamaGen-XL"]
    ar = xl["rows"]["AR"]["kinds"]["ar_step"]
    # the fitted count at 36 layers plus the launches the multi-kernel ops add at XL (the AR step's
    # tree attention splits its keys: one merge kernel per layer)
    assert ar["launches"] == pytest.approx(ar["slope"] * 36 + ar["fixed"] + ar.get("multi_launch_extra", 0.0))
    assert ar.get("multi_launch_extra", 0.0) in (0.0, 36.0)
    for row, r in xl["rows"].items():
        # speed-up = tokens x AR step / time per image = TPF x AR step / time per forward
        assert r["speedup"] == pytest.approx(r["tpf"] * xl["ar_step_ms"] / r["ms_per_forward"])
    assert ar["launch_ms"] == pytest.approx(ar["launches"] * hw.gap_us * 1e-3)


def test_multi_kernel_ops_at_real_shapes():
    """At the Zoo every engine op is one launch; at LlamaGen-XL's cache tree attention splits its keys
    (a merge kernel more) and draft_topk over 16384 head rows runs its four chunked kernels."""
    zoo, xl, seven_b = rc.shapes()
    assert rc.extra_launches(zoo, "EAGLE-2", "verify") == {"vvs.tree_attention": 0, "vvs.draft_topk": 0}
    assert rc.extra_launches(xl, "EAGLE-2", "verify") == {"vvs.tree_attention": 1, "vvs.draft_topk": 3}
    assert rc.extra_launches(xl, "AR", "ar_step")["vvs.tree_attention"] == 1
    assert rc.extra_launches(seven_b, "VVS-U i=2", "skip") == {"vvs.tree_attention": 0, "vvs.draft_topk": 3}
    # the model adds them per call: counts that name their ops grow by calls x extra at XL, not at the Zoo
    counts = {row: {kind: {"2": {"total": 30, "vvs.tree_attention": 2, "vvs.draft_topk": 5},
                           "6": {"total": 70, "vvs.tree_attention": 6, "vvs.draft_topk": 5}} for kind in kinds}
              for row, _, _, kinds in rc.METHODS}
    acc = {row: dict(tpf=2.0, skip_per_forward=0.0, source="test") for row, *_ in rc.METHODS}
    out = rc.model(counts, rc.Hardware(), acc, qk_norm_extra=0)
    zoo_v = out["Zoo"]["rows"]["EAGLE-2"]["kinds"]["verify"]
    xl_v = out["LlamaGen-XL"]["rows"]["EAGLE-2"]["kinds"]["verify"]
    assert zoo_v["launches"] == 70 and zoo_v["multi_launch_extra"] == 0
    assert xl_v["launches"] == 10 * 36 + 10 + 36 * 1 + 5 * 3  # slope 10, fixed 10, + merge kernels + chunks


def test_benchmarks_find_every_cached_setting_they_name():
    """round_cost.py and continuous_batching.py read settings of the committed quality cache by file name;
    a renamed setting must not silently drop their rows (SCD and SJD-PAC once did)."""
    import continuous_batching
    import round_cost

    cache = os.path.join(ROOT, "benchmarks", "results", "quality_speed_tokens")
    names = [n + ".npz" for n in continuous_batching.CACHE_ROWS] + list(round_cost.QS_CACHE.values())
    assert [n for n in names if not os.path.exists(os.path.join(cache, n))] == []
    assert [r["setting"] for r in continuous_batching.from_cache([16])] == list(continuous_batching.CACHE_ROWS.values())


def test_row_parallel_model_carries_the_measured_rows(tmp_path):
    """ZipAR / PJD at 24x24 and 48x48: plain ZipAR's forwards are the exact (H - 1) s + W - 1 (v = 1, bias from its
    measured 32x32 count); a capped PJD never has more rows in flight than its cap; Jacobi lanes multiply queries."""
    report = {"rows": [
        {"name": "ZipAR s=4", "method": "zipar", "options": {"zipar_window": 4, "zipar_verify": "none"},
         "codes_per_row_forward": 1.0, "start_lag": 4, "forwards": 155.0, "level": "parity", "gap": {"value": 0.04}},
        {"name": "PJD-E1", "method": "pjd", "options": {"zipar_window": 8, "zipar_jacobi_window": 8, "zipar_max_rows": 4},
         "codes_per_row_forward": 1.6, "start_lag": 8, "forwards": 213.8},
        {"name": "AR", "method": "ar", "options": {}, "forwards": 1023.0}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    tables = {name: {"ar_step_ms": 1.0, "rows": {"SJD": {"kinds": {"jacobi_iteration": {"launches": 100}}}}}
              for name in rc.ROW_PARALLEL_SHAPES}
    rows = rc.row_parallel_model(tables, rc.Hardware(), str(path))
    assert len(rows) == 4  # two settings x two shapes; AR has no rows
    zipar = {r["shape"]: r for r in rows if r["setting"] == "ZipAR s=4"}
    bias = 155.0 / (4 * 31 + 32)
    assert zipar["LlamaGen-XL"]["forwards"] == pytest.approx((4 * 23 + 24) * bias)
    assert zipar["7B (Lumina-mGPT)"]["tokens"] == 48 * 49 and zipar["7B (Lumina-mGPT)"]["grid"] == "48x48 + EOL"
    assert zipar["LlamaGen-XL"]["queries_per_forward"] == pytest.approx(zipar["LlamaGen-XL"]["rows_in_flight"])
    for r in (r for r in rows if r["setting"] == "PJD-E1"):
        assert r["rows_in_flight"] <= 4 and r["queries_per_forward"] == pytest.approx(8 * r["rows_in_flight"])
        assert r["speedup"] == pytest.approx(r["ar_image_ms"] / r["image_ms"])


def test_quantized_weights_read_fewer_bytes_by_hand():
    # TOY: 2 x 160 layer params + a 10 x 4 head, input width 4: int8 reads 1 + 5/4 bytes a weight (a 5-byte
    # scale per output row), int4 0.5 + 4/128 (a bf16 scale and zero point per group of 128); activations as bf16
    acts = 512
    for dtype, per in (("bf16", 2.0), ("int8", 2.25), ("fp8", 2.0), ("int4", 0.53125)):
        g = rc.round_groups(TOY, rc.round_work("ar_step"), SLOW, weights=dtype)
        assert g["target GEMMs"] == (pytest.approx(360 * per + acts), 1440)  # FLOPs do not change
        assert g["target attention"] == (320, 256)
    # the drafter's weights follow draft_weights, the target's stay as given
    g8 = rc.round_groups(TOY, rc.round_work("verify"), SLOW, weights="bf16", draft_weights="int8")
    g2 = rc.round_groups(TOY, rc.round_work("verify"), SLOW)
    assert g8["target GEMMs"] == g2["target GEMMs"] and g8["drafter GEMMs"][0] > g2["drafter GEMMs"][0] - 1e-9
    with pytest.raises(KeyError):
        rc.weight_bytes_per_param("int3", 4)


def test_quantized_head_kept_full_where_the_engine_keeps_it():
    # Lumina-mGPT's head stays bf16 under --quantize (models/quantize.KEEP_FULL): only its layers shrink
    hw = rc.Hardware()
    seven_b = next(s for s in rc.shapes() if s.name.startswith("7B"))
    assert not seven_b.head_quantized
    bf16 = rc.round_groups(seven_b, rc.round_work("ar_step"), hw)["target GEMMs"][0]
    int8 = rc.round_groups(seven_b, rc.round_work("ar_step"), hw, weights="int8")["target GEMMs"][0]
    head = seven_b.head_rows * seven_b.dim * 2
    layers = seven_b.layers * seven_b.layer_params()
    assert int8 - head == pytest.approx((bf16 - head) - layers * (2 - (1 + 5 / seven_b.dim)))


def test_committed_quantized_section_is_a_model_of_fewer_bytes():
    with open(os.path.join(ROOT, "benchmarks", "results", "round_cost.json")) as f:
        res = json.load(f)
    rows = {(r["setting"], r["weights"]): r for r in res["quantized"]}
    for shape in ("LlamaGen-XL", "7B (Lumina-mGPT)"):
        ar = [rows[("AR", w)]["shapes"][shape]["round_ms"] for w in ("bf16", "int8", "int4")]
        assert ar[0] > ar[1] > ar[2]  # fewer weight bytes, a shorter memory-bound AR step
        assert rows[("AR", "bf16")]["shapes"][shape]["speedup"] == pytest.approx(1.0)
    assert "## Quantized weights" in open(os.path.join(ROOT, "benchmarks", "results", "round_cost.md")).read()
