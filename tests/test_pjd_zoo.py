"""benchmarks/pjd_zoo.py: the step model and the grid extrapolation on synthetic rows (no decoding)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import pjd_zoo  # noqa: E402


def _row(name, method, forwards, tpf, **extra):
    metric = {"value": 0.5, "ci": (0.45, 0.55), "diff": 0.0, "diff_ci": (-0.05, 0.05)}
    return {"name": name, "method": method, "forwards": forwards, "tpf": {"value": tpf, "ci": (tpf, tpf)},
            "class_accuracy": metric, "fd_classifier": metric, "parity": True, **extra}


def _zipar_forwards(side, start_lag):
    """Plain ZipAR's exact count: row r starts s forwards after row r - 1 and takes W forwards; the
    prefill gives the first code, so (H - 1) s + W - 1 forwards."""
    return (side - 1) * start_lag + side - 1


@pytest.mark.parametrize("side,start_lag", [(16, 4), (16, 8), (32, 4), (48, 3)])
def test_step_model_is_plain_zipar_plus_one_forward(side, start_lag):
    # v = 1: the model counts the prefill's code as a forward, nothing else differs
    assert pjd_zoo.step_model(start_lag, side, side, 1.0) == _zipar_forwards(side, start_lag) + 1
    # a faster row (v = 2) halves every term
    assert pjd_zoo.step_model(start_lag, side, side, 2.0) == pytest.approx((_zipar_forwards(side, start_lag) + 1) / 2)


def test_grid_rows_extrapolate_only_what_was_measured():
    rows = [_row("AR", "ar", 255.0, 1.0),
            _row("SJD", "sjd", 120.0, 255 / 120),
            _row("ZipAR s=4", "zipar", 75.0, 255 / 75, start_lag=4, codes_per_row_forward=1.0,
                 model_forwards=pjd_zoo.step_model(4, 16, 16, 1.0)),
            _row("PJD-E1", "pjd", 100.0, 2.55, start_lag=8, codes_per_row_forward=1.5, cap_waits=5.0,
                 model_forwards=pjd_zoo.step_model(8, 16, 16, 1.5)),
            _row("PJD rule", "pjd", 104.0, 2.45, start_lag=8, row_stats_missing=True)]
    grid = dict(pjd_zoo.grid_rows(rows, 16))
    sides = [s for s, _ in pjd_zoo.GRIDS]
    at = {name: dict(zip(sides, cells)) for name, cells in grid.items()}
    # the measured grid keeps the measured count for every setting
    assert [at[r["name"]][16][0] for r in rows] == [r["forwards"] for r in rows]
    # AR needs T - 1 forwards anywhere; SJD keeps its tokens per forward
    assert at["AR"][32] == (1023, 1024 / 1023)
    assert at["SJD"][32][1] == pytest.approx(rows[1]["tpf"]["value"])
    # row-parallel settings follow the step model with their v, line ends (48 + EOL) need no forward
    assert at["PJD-E1"][32][0] == pytest.approx(pjd_zoo.step_model(8, 32, 32, 1.5))
    assert at["PJD-E1"][48][0] == pytest.approx(pjd_zoo.step_model(8, 48, 48, 1.5))
    assert at["PJD-E1"][48][1] == pytest.approx(48 * 49 / pjd_zoo.step_model(8, 48, 48, 1.5))
    # without a measured v a row-parallel setting is not extrapolated (its TPF grows with the grid)
    assert at["PJD rule"][16] is not None and at["PJD rule"][24] is None and at["PJD rule"][48] is None
    meta = {"grid": (16, 16), "command": "python benchmarks/pjd_zoo.py", "n_images": 4, "per_class": 1, "seed": 0,
            "sampling": {}, "batch_size": 4, "bootstrap": 10}
    md = pjd_zoo.to_markdown(meta, rows, missing=["SJD-PAC"])
    assert "Row statistics not recorded for PJD rule:" in md
    assert "| PJD rule | 104 (2.46) | – | – | – |" in md
    assert "Not generated yet (no complete cache): SJD-PAC." in md
    # a binding cap is named beside the model's ratio; no uncapped Jacobi setting: no such sentence
    assert "Where the cap on rows per forward binds (PJD-E1 (5.0 waits per image))" in md
    assert "no binding cap" not in md
    rows[3]["cap_waits"] = 0.0
    md = pjd_zoo.to_markdown(meta, rows, missing=[])
    ratio = pjd_zoo.step_model(8, 16, 16, 1.5) / 100.0
    assert f"With Jacobi windows and no binding cap the model gives {ratio:.2f} of our counts" in md
    assert "Where the cap" not in md


def test_doc_blocks_are_per_model(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    blocks = "".join(f"{pjd_zoo.DOC_BEGIN.format(tag=t)}\nold\n{pjd_zoo.DOC_END.format(tag=t)}\n"
                     for t in ("pjd-zoo", "pjd-zoo-gpt-32"))
    doc.write_text("intro\n" + blocks + "outro\n")
    md = "# title\n\nCommand: `x`\n\n## Section\n\nbody\n"
    pjd_zoo.write_doc(str(doc), md, pjd_zoo.doc_tag("zoo-gpt-32"))
    text = doc.read_text()
    # the 32x32 block holds the tables (sections one level down), the 16x16 block is untouched
    assert "pjd-zoo-gpt-32:begin (written by benchmarks/pjd_zoo.py --doc; do not edit) -->\nCommand: `x`\n\n" \
           "#### Section\n\nbody\n<!-- pjd-zoo-gpt-32:end -->" in text
    assert text.count("\nold\n") == 1 and text.startswith("intro\n") and text.endswith("outro\n")
    # a doc without the model's block is refused before anything is decoded: one line, exit 2
    doc.write_text("no markers\n")
    assert pjd_zoo.main(["--model", "zoo-gpt-32", "--report-only", "--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --doc {doc} has no <!-- pjd-zoo-gpt-32:begin") and len(err.splitlines()) == 1


def test_controls_table_lists_each_controls_gap_and_the_per_class_count(capsys):
    rows = [_row("AR", "ar", 255.0, 1.0)]
    meta = {"grid": (16, 16), "command": "python benchmarks/pjd_zoo.py", "n_images": 16, "per_class": 1, "seed": 0,
            "sampling": {}, "batch_size": 4, "bootstrap": 10, "controls_per_class": 3}
    gap = {"value": 0.25, "ci": (0.23, 0.27), "half_width": 0.02, "z": 25.0, "n": 48}
    controls = [{"name": "AR T=1.1", "n_images": 48, "gen_seconds": 480.0, "gap": gap},
                {"name": "AR top-k 64", "n_images": 48, "gen_seconds": 470.0}]  # D not computed yet
    md = pjd_zoo.to_markdown(meta, rows, missing=[], controls=controls)
    assert "### Controls: AR sampling a known-wrong distribution" in md
    assert "(48 images, 3 per class" in md
    assert "| AR T=1.1 | 48 | +0.250 ± 0.020 | +25.0 | 480 |" in md
    assert "| AR top-k 64 | 48 | – | – | 470 |" in md
    assert "### Controls" not in pjd_zoo.to_markdown(meta, rows, missing=[])
    # an unknown control is a one-line error before anything loads
    assert pjd_zoo.main(["--controls", "AR T=9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown setting(s) AR T=9") and len(err.splitlines()) == 1
