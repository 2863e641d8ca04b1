"""``--preset exact | near-lossless | fastest``: per Zoo grid, the fastest setting of each level of fidelity
in the committed quality reports (docs/quality_speed.md "Three levels of fidelity").

* ``exact``: exact by construction, and the sampling gap D's 95 % interval holds 0;
* ``near-lossless``: |D| <= 0.025 nats/token (a tenth of AR at temperature 1.1) and at perceptual parity;
* ``fastest``: the fastest setting at perceptual parity (not detectably worse than AR on the report's metrics).

A level's fastest setting may come from a stricter level. The table below is the reports' evidence copied:
``tests/test_presets.py`` checks every entry against its report's row (method, options, TPF, level), so a
rebuilt report that moves a frontier fails the test until this table follows it.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Tuple

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

PRESETS: Dict[int, Dict[str, Preset]] = {
    256: {
        "exact": Preset("SJD-PAC W=2 D=3", "sjd-pac", {"pac_width": 2, "pac_depth": 3}, 3.80, 0.007),
        "near-lossless": Preset("SJD-PAC W=2 D=3", "sjd-pac", {"pac_width": 2, "pac_depth": 3}, 3.80, 0.007),
        "fastest": Preset("ZipAR s=2 + SJD L=4", "zipar",
                          {"zipar_window": 2, "zipar_verify": "sjd", "zipar_jacobi_window": 4}, 5.98, 0.068),
    },
    1024: {
        "exact": Preset("SJD-PAC", "sjd-pac", {"pac_width": 3, "pac_depth": 3}, 4.10, 0.002),
        "near-lossless": Preset("ZipAR s=3", "zipar", {"zipar_window": 3}, 8.26, 0.014),
        "fastest": Preset("ZipAR s=2", "zipar", {"zipar_window": 2}, 11.01, 0.046),
    },
}


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
