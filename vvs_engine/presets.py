"""``--preset exact | near-lossless | fastest``: per Zoo grid, the fastest setting of each level of fidelity
in the committed quality reports (docs/quality_speed.md "Three levels of fidelity").

* ``exact``: exact by construction, and the sampling gap D's 95 % interval holds 0;
* ``near-lossless``: |D| <= 0.025 nats/token (a tenth of AR at temperature 1.1) and at perceptual parity;
* ``fastest``: the fastest setting at perceptual parity (not detectably worse than AR on the report's metrics).

A level's fastest setting may come from a stricter level. The table below is the reports' evidence, written
by ``python -m vvs_engine.presets --write`` from the reports' JSON (``--check``: exit 1 and the differences
when a rebuilt report moved a frontier); ``tests/test_presets.py`` checks every entry against its report's
row (method, options, TPF, level).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

from .errors import VVSError

PRESET_NAMES = ("exact", "near-lossless", "fastest")
LEVEL_OF_PRESET = {"exact": "exact", "near-lossless": "near-lossless", "fastest": "parity"}


class Preset(NamedTuple):
    setting: str  # the report row's name
    method: str
    options: dict  # the method options the setting names (the method's defaults fill the rest)
    tpf: float  # the report's tokens per forward
    gap: float  # the report's D (nats/token)


# tokens per image -> (grid name, the report the evidence comes from)
GRIDS: Dict[int, Tuple[str, str]] = {
    256: ("16x16 (zoo-gpt)", "benchmarks/results/quality_speed.json"),
    1024: ("32x32 (zoo-gpt-32)", "benchmarks/results/pjd_zoo-gpt-32.json"),
}

# presets:begin (written by `python -m vvs_engine.presets --write` from the reports in GRIDS; do not edit)
PRESETS: Dict[int, Dict[str, Preset]] = {
    256: {
        "exact": Preset("SJD-PAC W=2 D=3", "sjd-pac", {"pac_width": 2, "pac_depth": 3}, 3.80, 0.007),
        "near-lossless": Preset("SJD-PAC W=2 D=3", "sjd-pac", {"pac_width": 2, "pac_depth": 3}, 3.80, 0.007),
        "fastest": Preset("ZipAR s=2 + SJD L=4", "zipar",
                          {"zipar_window": 2, "zipar_verify": "sjd", "zipar_jacobi_window": 4}, 5.98, 0.068),
    },
    1024: {
        "exact": Preset("SJD-PAC W=2 D=3", "sjd-pac",
                        {"jacobi_window": 32, "jacobi_init": "copy-left", "pac_width": 2, "pac_depth": 3,
                         "pac_variant": "exact"}, 4.45, -0.001),
        "near-lossless": Preset("ZipAR s=3", "zipar", {"zipar_window": 3}, 8.26, 0.014),
        "fastest": Preset("ZipAR s=2 + SJD L=4", "zipar",
                          {"zipar_window": 2, "zipar_verify": "sjd", "zipar_jacobi_window": 4, "zipar_commit_lag": 0,
                           "zipar_commit": "sjd", "zipar_init": "copy-above", "zipar_keep": 0.0, "zipar_max_rows": 0},
                           11.43, 0.038),
    },
}
# presets:end


def resolve_preset(name: str, tokens_per_image: int) -> Tuple[str, dict]:
    """A preset's (method, options) on a target with ``tokens_per_image`` tokens; a one-line error for an
    unknown preset or a grid without evidence."""
    if name not in PRESET_NAMES:
        raise VVSError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    if tokens_per_image not in PRESETS:
        side = round(tokens_per_image ** 0.5)
        raise VVSError(f"no preset for a {side}x{side}-token target: presets exist for the Zoo grids "
                       f"({', '.join(g for g, _ in GRIDS.values())}); choose --method and its options")
    p = PRESETS[tokens_per_image][name]
    return p.method, dict(p.options)


def presets_help() -> str:
    """One line per preset for ``--help``: each grid's setting, TPF and D."""
    parts = []
    for name in PRESET_NAMES:
        per_grid = "; ".join(f"{GRIDS[t][0]}: {p.setting} (TPF {p.tpf:.2f}, D {p.gap:+.3f})"
                             for t, table in PRESETS.items() for p in [table[name]])
        parts.append(f"{name} = {per_grid}")
    return ("the fastest committed setting of a level of fidelity for the target's grid (exact: exact by "
            "construction and D reads 0; near-lossless: |D| <= 0.025 nats/token and at parity; fastest: at "
            "perceptual parity); sets --method and its options: " + " | ".join(parts))


# --- the table from the reports: python -m vvs_engine.presets --check | --write ---------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "# presets:begin", "# presets:end"


def presets_from_reports(root: str = ROOT) -> Dict[int, Dict[str, Preset]]:
    """Every grid's presets as its report names them: the fastest setting of each level (``fastest_per_level``)
    with the report row's method, options, TPF (2 decimals) and D (3 decimals)."""
    table = {}
    for tokens, (_, report) in GRIDS.items():
        path = os.path.join(root, report)
        if not os.path.isfile(path):
            raise VVSError(f"no report at {path}: the presets are written from the repository's committed reports")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        rows = {row["name"]: row for row in data["rows"]}
        table[tokens] = {}
        for name in PRESET_NAMES:
            row = rows[data["fastest_per_level"][LEVEL_OF_PRESET[name]]]
            table[tokens][name] = Preset(row["name"], row["method"], dict(row["options"]),
                                         round(row["tpf"]["value"], 2), round(row["gap"]["value"], 3))
    return table


def same(table: Optional[Preset], report: Optional[Preset]) -> bool:
    """A table entry follows its report row: the same setting, method, TPF and D, and options the row's
    (a report may list every option, defaults included; the table names a subset with the same values)."""
    if table is None or report is None:
        return table is report
    return (table._replace(options={}) == report._replace(options={})
            and all(k in report.options and report.options[k] == v for k, v in table.options.items()))


def differences(want: Dict[int, Dict[str, Preset]], have: Dict[int, Dict[str, Preset]] = None) -> List[str]:
    """One line per preset whose table entry differs from the reports' (``have``: this module's table)."""
    have = PRESETS if have is None else have
    out = []
    for tokens in sorted(set(want) | set(have)):
        for name in PRESET_NAMES:
            w, h = want.get(tokens, {}).get(name), have.get(tokens, {}).get(name)
            if not same(h, w):
                out.append(f"{GRIDS.get(tokens, (str(tokens),))[0]} {name}: table {h}, report {w}")
    return out


def merged(want: Dict[int, Dict[str, Preset]], have: Dict[int, Dict[str, Preset]] = None) -> Dict[int, Dict[str, Preset]]:
    """The reports' table, keeping the entries that already follow their rows as they are written."""
    have = PRESETS if have is None else have
    return {tokens: {name: (have[tokens][name] if same(have.get(tokens, {}).get(name), p) else p)
                     for name, p in presets.items()} for tokens, presets in want.items()}


def table_source(table: Dict[int, Dict[str, Preset]]) -> str:
    """The PRESETS block of this file for ``table``."""
    lines = [f"{BEGIN} (written by `python -m vvs_engine.presets --write` from the reports in GRIDS; do not edit)",
             "PRESETS: Dict[int, Dict[str, Preset]] = {"]
    for tokens, presets in table.items():
        lines.append(f"    {tokens}: {{")
        for name, p in presets.items():
            head = f"        {json.dumps(name)}: Preset({json.dumps(p.setting)}, {json.dumps(p.method)},"
            tail = f"{_literal(p.options)}, {p.tpf:.2f}, {p.gap:.3f}),"
            one = f"{head} {tail}"
            lines += [one] if len(one) <= 120 else [head] + _wrapped(tail, " " * (head.index("Preset(") + 7))
        lines.append("    },")
    return "\n".join(lines + ["}", END])


def _wrapped(text: str, indent: str, width: int = 120) -> List[str]:
    """``text`` (an options literal and its figures) broken after commas into lines of at most ``width``."""
    lines, line = [], indent
    for piece in text.split(", "):
        if line.strip() and len(line) + len(piece) + 2 > width:
            lines.append(line + ",")
            line = indent + " " + piece
        else:
            line = line + (", " if line.strip() else "") + piece
    return lines + [line]


def _literal(options: dict) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v) if isinstance(v, str) else repr(v)}"
                           for k, v in options.items()) + "}"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["--check"], ["--write"]):
        print("usage: python -m vvs_engine.presets --check | --write", file=sys.stderr)
        return 2
    try:
        want = presets_from_reports()
    except VVSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    diff = differences(want)
    if argv == ["--check"]:
        print("\n".join(diff) if diff else "the presets equal the reports' rows")
        return 1 if diff else 0
    path = os.path.abspath(__file__)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + table_source(merged(want)) + text[end:])
    print(f"wrote {len(diff)} changed preset(s) to {path}" + "".join(f"\n  {d}" for d in diff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
