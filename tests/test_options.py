"""One source for method options: the dataclass fields generate the CLI flags and the README table."""
import os

import pytest

from vvs_engine.cli import build_parser, method_options
from vvs_engine.methods.options import BEGIN, END, method_flags, options_table, replace_block

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_block(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip()


def test_readme_option_table_is_current():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert readme_block(text) == options_table(), \
        "README option table is stale: run `python -m vvs_engine.methods.options README.md`"


def test_replace_block_rewrites_only_the_table():
    text = f"intro\n{BEGIN}\n| old |\n{END}\noutro\n"
    new = replace_block(text, "| new |")
    assert new == f"intro\n{BEGIN}\n| new |\n{END}\noutro\n"
    assert readme_block(new) != readme_block(text)


def test_cli_flags_are_the_documented_fields():
    names = {fl.name for fl in method_flags()}
    assert set(method_options(build_parser().parse_args(["generate"]))) == names
    assert {"lantern_k", "skip_policy", "jacobi_window", "gsd_group", "cascade_nucleus"} <= names
    assert not {"static_tree", "rule_options", "feature_reuse"} & names  # API-only fields get no flag
    parsed = build_parser().parse_args(["generate", "--cascade-kappa", "2.5", "--tree-total", "9"])
    assert method_options(parsed)["cascade_kappa"] == 2.5 and method_options(parsed)["tree_total"] == 9
    with pytest.raises(Exception):
        build_parser().parse_args(["generate", "--static-tree", "x"])


def test_subclass_default_keeps_the_base_help():
    skip = next(fl for fl in method_flags() if fl.name == "skip_policy")
    assert skip.defaults["vvs"] == "uniform" and skip.defaults["eagle"] == "never"
    assert skip.help.startswith("VVS")
