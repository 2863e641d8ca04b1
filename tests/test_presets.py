"""--preset exact | near-lossless | fastest: each preset is its committed report's row (the fastest setting of its
level of fidelity on that grid), resolves to that method and options in the CLI and the Python API, and refuses
what it cannot honour in one line."""
from __future__ import annotations

import json
import os

import pytest

from vvs_engine.methods import resolve_options
from vvs_engine.presets import GRIDS, LEVEL_OF_PRESET, PRESET_NAMES, PRESETS, resolve_preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report(tokens_per_image):
    with open(os.path.join(REPO, GRIDS[tokens_per_image][1])) as f:
        return json.load(f)


@pytest.mark.parametrize("tokens_per_image", sorted(PRESETS))
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_is_its_report_row(tokens_per_image, name):
    report = _report(tokens_per_image)
    preset = PRESETS[tokens_per_image][name]
    level = LEVEL_OF_PRESET[name]
    # the fastest setting of the level (or a stricter one) in the committed report
    assert report["fastest_per_level"][level] == preset.setting
    row = next(r for r in report["rows"] if r["name"] == preset.setting)
    assert row["method"] == preset.method
    assert resolve_options(preset.method, preset.options) == resolve_options(row["method"], row["options"])
    assert row["tpf"]["value"] == pytest.approx(preset.tpf, abs=0.005)
    assert row["gap"]["value"] == pytest.approx(preset.gap, abs=0.0005)
    assert row["level"] in ("exact", "near-lossless", "parity")[: ("exact", "near-lossless", "parity").index(level) + 1]


def test_unknown_preset_and_grid_are_one_line_errors():
    from vvs_engine.errors import VVSError

    with pytest.raises(VVSError, match="unknown preset 'lossless'"):
        resolve_preset("lossless", 256)
    with pytest.raises(VVSError, match="no preset for a 24x24-token target"):
        resolve_preset("exact", 576)


def test_cli_preset_refuses_a_method_or_its_options(tmp_path, capsys):
    from vvs_engine.cli import main

    for extra, named in ((["--method", "sjd"], "--method"), (["--zipar-window", "3"], "--zipar-window")):
        rc = main(["generate", "--class-labels", "0", "--preset", "fastest", "--out", str(tmp_path / "x")] + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc != 0 and len(err) == 1 and err[0].startswith("error: --preset sets the method") and named in err[0]
    assert not (tmp_path / "x").exists()


def test_preset_decodes_as_its_method_and_options(tmp_path, capsys):
    """The API and the CLI: --preset fastest on zoo-gpt gives the tokens of the method and options it names."""
    import numpy as np

    from vvs_engine import Engine
    from vvs_engine.cli import main

    eng = Engine.load(model="zoo-gpt", threads=1)
    method, opts = resolve_preset("fastest", eng.tokens_per_image)
    by_preset = eng.generate(class_labels=[3], preset="fastest", seed=5, decode_images=False)
    explicit = eng.generate(class_labels=[3], method=method, seed=5, decode_images=False, **opts)
    assert by_preset.stats["method"] == method
    assert (by_preset.tokens == explicit.tokens).all()
    with pytest.raises(Exception, match="give preset or method"):
        eng.generate(class_labels=[3], preset="fastest", method="sjd")
    assert main(["generate", "--class-labels", "3", "--preset", "fastest", "--seed", "5", "--no-images",
                 "--out", str(tmp_path), "--threads", "1", "--quiet"]) == 0
    assert (np.load(tmp_path / "tokens.npz")["tokens"] == explicit.tokens.numpy()).all()


def test_the_table_is_written_from_the_reports(tmp_path):
    """``python -m vvs_engine.presets --write`` rewrites the table from the reports' JSON: on the committed
    reports it reproduces this module's block byte for byte (so --check passes); a report whose frontier moved
    (negative control: the 16x16 parity row's TPF changed) is one difference, and the rewritten block carries it."""
    import shutil

    from vvs_engine import presets

    want = presets.presets_from_reports()
    assert presets.differences(want) == []
    text = open(presets.__file__, encoding="utf-8").read()
    block = text[text.index(presets.BEGIN): text.index(presets.END) + len(presets.END)]
    assert presets.table_source(presets.merged(want)) == block
    for _, report in GRIDS.values():
        os.makedirs(tmp_path / os.path.dirname(report), exist_ok=True)
        shutil.copy(os.path.join(REPO, report), tmp_path / report)
    report = tmp_path / GRIDS[256][1]
    data = json.loads(report.read_text())
    row = next(r for r in data["rows"] if r["name"] == data["fastest_per_level"]["parity"])
    row["tpf"]["value"] += 0.5
    report.write_text(json.dumps(data))
    moved = presets.presets_from_reports(str(tmp_path))
    diff = presets.differences(moved)
    assert len(diff) == 1 and diff[0].startswith("16x16 (zoo-gpt) fastest")
    assert f"{PRESETS[256]['fastest'].tpf + 0.5:.2f}" in presets.table_source(presets.merged(moved))
