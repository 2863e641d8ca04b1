"""The op counter (views and allocations are free, compute and in-place ops count, host reads are
tallied) and the op-count benchmark on a tiny model."""
from __future__ import annotations

import json
import os
import sys

import torch

from spec_models import tiny_engine
from vvs_engine.measure.opcount import OpCounter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_views_and_allocations_are_not_compute():
    x = torch.randn(4, 6)
    with OpCounter() as ops:
        x.view(24), x.t(), x[1:], x.reshape(6, 4), x.to(torch.float32), x.contiguous(), torch.empty(3)
    assert ops.compute == 0 and ops.syncs == 0


def test_compute_and_in_place_ops_count():
    x = torch.randn(4, 6)
    with OpCounter() as ops:
        y = x * 2
        x.add_(1)
        y.index_copy_(0, torch.tensor([0]), x[:1])
        x.reshape(6, 4).sum(0)  # a view feeding a reduction: one op
    assert ops.by_name["aten.mul"] == 1 and ops.by_name["aten.add_"] == 1
    assert ops.by_name["aten.index_copy_"] == 1 and ops.by_name["aten.sum"] == 1
    assert ops.syncs == 0


def test_host_reads_are_tallied():
    x = torch.randn(5)
    with OpCounter() as ops:
        float(x.sum())
        x.nonzero()
    assert ops.syncs == 2


def test_op_count_benchmark_on_a_tiny_model(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import op_count

    eng = tiny_engine(vocab=64, block=16, peak=8.0)
    results = op_count.main(["--quick", "--out", str(tmp_path)], engine=eng)
    ar, lantern = results[1]["AR"], results[1]["LANTERN d=0.2"]
    T = eng.tokens_per_image
    assert ar["rounds"] == T - 1 and ar["tokens"] == T  # the first token comes from the prefill
    assert ar["ops_per_round"] > 20  # a transformer step is many ops
    assert lantern["tpf"] > 1.0 and lantern["rounds"] < T - 1
    assert lantern["ops_per_round"] > ar["ops_per_round"]  # a verify round drafts, verifies and redrafts
    # each kernel as one custom op: the fused verification replaces the torch walk's hundreds of ops
    assert lantern["kernel_ops_per_round"] < lantern["ops_per_round"] - 100
    md = (tmp_path / "op_count.md").read_text()
    assert md.startswith("<!-- written by: python benchmarks/op_count.py")
    assert "| AR | " in md and "| LANTERN d=0.2 | " in md
    data = json.loads((tmp_path / "op_count.json").read_text())
    fused = {v["rule"]: v for v in data["verify_call"]}
    assert fused["exact"]["fused_ops"] == 1 < fused["exact"]["torch_walk_ops"]
