"""What a new user hits with bad input (issue 35): every case ends in one `error:` line and a non-zero
exit (no traceback), before any model loads or any memory is spent, or in the documented behaviour."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from dataset_utils import write_tiny_checkpoints
from vvs_engine import Engine, VVSError, dataset
from vvs_engine.cli import main
from vvs_engine.zoo import default_paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the input must be refused before."""
    import vvs_engine.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(engine_mod.Engine, "load", classmethod(no_load))
    monkeypatch.setattr(dataset, "load_engine", no_load)


def one_line_error(capsys, argv, code=1) -> str:
    got = main(argv)
    err = capsys.readouterr().err.strip()
    assert got == code and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


# --- 1. nothing can exhaust the machine ---------------------------------------------------------------
def test_huge_label_ranges_refused_without_expanding_them(tmp_path, capsys, no_model_loads):
    """0-999999999999 would be a list of 10^12 ints (a MemoryError or a machine-wide OOM): it is
    counted, not expanded. The address-space cap makes an expanding implementation fail loudly."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    for command in ("generate", "generate-dataset"):
        err = one_line_error(capsys, [command, "--class-labels", "0-999999999999", "--out", str(tmp_path / "o"),
                                      "--threads", "1", "--quiet"])
        assert f"a job holds at most {dataset.MAX_IMAGES} images" in err and "0-999999999999" in err
    with pytest.raises(VVSError, match="at most"):
        dataset.parse_label_ranges(",".join(["0-999999"] * 11))  # 11 million in all, each range small
    assert len(dataset.parse_label_ranges("0-999999")) == 10 ** 6
    assert (soft, hard) == resource.getrlimit(resource.RLIMIT_AS)


def test_huge_per_class_refused_before_planning(tmp_path, capsys, no_model_loads):
    out = tmp_path / "d"
    t = time.perf_counter()
    err = one_line_error(capsys, ["generate-dataset", "--class-labels", "0-1", "--per-class", "1000000000000",
                                  "--out", str(out), "--quiet"])
    assert time.perf_counter() - t < 30
    assert "2 conditions x --per-class 1000000000000 = 2000000000000 images" in err
    assert f"at most {dataset.MAX_IMAGES} images" in err
    assert not out.exists()  # refused before the folder (or its manifest) was made
    with pytest.raises(VVSError, match="per-class"):  # the Python API refuses it the same way
        dataset.generate(str(out), class_labels=[0, 1], per_condition=10 ** 12, progress=False)


# --- 7. consistent errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "generate-dataset"])
@pytest.mark.parametrize("flag,value,message", [
    ("--top-p", "2", "error: --top-p must be in (0, 1]"),
    ("--top-k", "-1", "error: --top-k must be an integer >= 0"),
    ("--temperature", "-1", "error: --temperature must be a finite number"),
    ("--cfg-scale", "-1", "error: --cfg-scale must be a finite number"),
    ("--seed", str(2 ** 64), "error: --seed must fit in 64 bits"),
])
def test_option_names_are_flags_in_every_message(tmp_path, capsys, no_model_loads, command, flag, value, message):
    err = one_line_error(capsys, [command, "--class-labels", "0-3", "--out", str(tmp_path / "o"), "--quiet", flag,
                                  value])
    assert err.startswith(message), err


def test_dataset_flags_named_as_flags(tmp_path, capsys, no_model_loads):
    base = ["generate-dataset", "--class-labels", "0-3", "--out", str(tmp_path / "d"), "--quiet"]
    err = one_line_error(capsys, base + ["--per-class", "0"])
    assert err == "error: --per-class must be an integer >= 1, got 0"
    err = one_line_error(capsys, base + ["--max-retries", "-1"])
    assert err == "error: --max-retries must be an integer >= 0, got -1"


@pytest.mark.parametrize("shard,suggested", [(8, "e.g. --shard-size 16"), (20, "e.g. --shard-size 16 or 32"),
                                              (40, "e.g. --shard-size 32 or 48")])
def test_shard_size_suggestion_names_each_size_once(tmp_path, capsys, no_model_loads, shard, suggested):
    err = one_line_error(capsys, ["generate-dataset", "--class-labels", "0-3", "--out", str(tmp_path / "d"),
                                  "--quiet", "--shard-size", str(shard)])
    assert err.startswith(f"error: --shard-size {shard} must be a multiple of the --batch-size 16"), err
    assert err.endswith(suggested), err


@pytest.mark.parametrize("command", ["generate", "generate-dataset"])
def test_empty_out_refused(tmp_path, monkeypatch, capsys, no_model_loads, command):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, [command, "--class-labels", "1", "--out", "", "--quiet"])
    assert err.startswith("error: --out is empty"), err
    assert os.listdir(tmp_path) == []


def test_class_label_ranges_read_alike_by_both_commands(tmp_path, monkeypatch, capsys):
    """generate takes generate-dataset's syntax ("0-3", "0,3,7-9") and refuses the same spellings."""
    from vvs_engine.cli import parse_class_labels

    for text in ("0-3", "0,3,7-9", "5", " 2 - 4 ,1"):
        assert parse_class_labels(text) == dataset.parse_label_ranges(text)
    for bad in ("3-1", "a", "1-", ""):
        with pytest.raises(VVSError) as via_generate:
            parse_class_labels(bad)
        with pytest.raises(VVSError) as via_dataset:
            dataset.parse_label_ranges(bad)
        assert str(via_generate.value) == str(via_dataset.value)
    seen = {}

    def fake_generate(self, **kw):
        seen["labels"] = kw["class_labels"]
        raise VVSError("stop here")

    monkeypatch.setattr(Engine, "generate", fake_generate)
    one_line_error(capsys, ["generate", "--class-labels", "0-3", "--out", str(tmp_path / "o"), "--quiet",
                            "--threads", "1"])
    assert seen["labels"] == [0, 1, 2, 3]
