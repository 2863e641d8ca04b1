"""Batched SJD, GSD and AR: greedy equals plain AR at every batch size, sampled tokens do not depend on
the batch an image is decoded in, images that finish early stop while the batch runs on, and a Jacobi
iteration is one host-read-free function (captured as one CUDA graph on a GPU)."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spec_models import tiny_engine
from vvs_engine.acceptance.verify import ExactRule
from vvs_engine.methods import jacobi
from vvs_engine.methods.common import DecodeBatch
from vvs_engine.rng import CounterRNG
from vvs_engine.runtime import loop
from vvs_engine.runtime.masks import causal_local
from vvs_engine.runtime.target import TargetSession
from vvs_engine.sampling import SamplingParams

GPU = torch.cuda.is_available()
NO_GPU = "no CUDA device: Jacobi-iteration graph capture and its sync check need a GPU"
if not GPU:
    print(f"\n[test_jacobi_batch] GPU tests skipped: {NO_GPU}")
LABELS = [0, 3, 4]
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}


@pytest.fixture(scope="module")
def eng():
    return tiny_engine(vocab=64, block=36, peak=8.0)


@pytest.fixture(scope="module")
def greedy_ar(eng):
    return {cfg: eng.generate(class_labels=LABELS, temperature=0, cfg_scale=cfg, decode_images=False).tokens
            for cfg in (3.0, 1.0)}


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("method,opts", [
    ("sjd", {"jacobi_window": 16, "jacobi_init": "copy-left"}),
    ("sjd", {"jacobi_window": 5, "jacobi_init": "argmax-left"}),
    ("sjd", {"jacobi_window": 16, "jacobi_init": "copy-above"}),
    ("gsd", {"gsd_group": 32, "gsd_dist_threshold": math.inf, "jacobi_init": "random", "jacobi_window": 6}),
])
def test_greedy_batched_equals_greedy_ar(eng, greedy_ar, method, opts, batch_size):
    for cfg in (3.0, 1.0):
        out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=cfg, method=method, batch_size=batch_size,
                           decode_images=False, **opts)
        assert torch.equal(out.tokens, greedy_ar[cfg]), cfg
        assert out.stats["batch_size"] == batch_size


@pytest.mark.parametrize("method,opts", [
    ("ar", {}),
    ("sjd", {}),
    ("sjd", {"jacobi_init": "random", "jacobi_window": 6}),
    ("sjd", {"jacobi_init": "copy-above"}),
    ("sjd", {"jacobi_init": "argmax-left", "jacobi_window": 1}),
    ("gsd", {}),
    ("gsd", {"gsd_group": 8, "gsd_dist_threshold": math.inf, "jacobi_init": "random"}),
])
def test_sampled_tokens_do_not_depend_on_the_batch(eng, method, opts):
    """fp64: image i's tokens and forward count depend only on (seed, i, label) at batch sizes 1, 3, 8
    (8 images: batches of 3 are 3 + 3 + 2, the last one padded to 2)."""
    labels = [i % 5 for i in range(8)]
    runs = [eng.generate(class_labels=labels, temperature=1.0, top_k=20, cfg_scale=3.0, method=method, seed=11,
                         batch_size=b, decode_images=False, **opts) for b in (1, 3, 8)]
    for r in runs[1:]:
        assert torch.equal(r.tokens, runs[0].tokens)
        assert r.stats["target_forward_passes"] == runs[0].stats["target_forward_passes"]
        assert r.stats["tpf_per_image"] == runs[0].stats["tpf_per_image"]
    assert len({tuple(t.tolist()) for t in runs[0].tokens}) == len(labels)  # distinct images, not one stream
    # A different image index gives different draws: image 0 decoded at index 0 vs. as image 1.
    moved = eng.generate(class_labels=[labels[1], labels[0]], temperature=1.0, top_k=20, cfg_scale=3.0,
                         method=method, seed=11, batch_size=2, decode_images=False, **opts)
    assert not torch.equal(moved.tokens[1], runs[0].tokens[0])


def test_one_image_finishes_many_iterations_before_the_others(eng, greedy_ar):
    """Without CFG, label 0's greedy image is nearly constant: SJD accepts whole windows and finishes in
    a few iterations while the other images need about one per token. The finished image stops
    committing and counting; every image's tokens and forward count equal its batch-1 run."""
    kw = dict(class_labels=LABELS, temperature=0, cfg_scale=1.0, method="sjd", jacobi_window=16, decode_images=False)
    batched = eng.generate(batch_size=4, **kw)
    alone = [eng.generate(**dict(kw, class_labels=[lab]), batch_size=1) for lab in LABELS]
    assert torch.equal(batched.tokens, greedy_ar[1.0])
    passes = [a.stats["target_forward_passes"] for a in alone]
    assert max(passes) - min(passes) >= 20, passes
    assert batched.stats["target_forward_passes"] == sum(passes)
    # the batch runs until its slowest image is done, plus one round: the loop reads the rows' counts one
    # round late, so it learns of the last image's end after the next round has run
    assert batched.stats["batch_iterations"] == max(passes) + 1
    assert sum(batched.stats["accepted_drafts_histogram"]) == sum(passes)
    tpf = [eng.tokens_per_image / n for n in passes]
    assert batched.stats["tpf_per_image"] == {"min": min(tpf), "median": sorted(tpf)[1], "max": max(tpf)}


@pytest.mark.parametrize("method", ["sjd", "gsd"])
def test_retiring_finished_rows_changes_no_token(eng, monkeypatch, method):
    """fp64, sampled: dropping finished rows mid-batch (8 -> 4 -> 2 -> 1 rows) gives the same tokens and
    forward counts as keeping every row to the end, and the batch really shrinks."""
    sizes = []
    from vvs_engine.runtime.core import DecodeCore

    original = DecodeCore.move

    def logged(self, source, keep, target):  # the tail: live rows move into a smaller kept decoder
        sizes.append(len(keep))
        return original(self, source, keep, target)

    monkeypatch.setattr(DecodeCore, "move", logged)
    kw = dict(class_labels=[i % 5 for i in range(7)], temperature=1.0, top_k=20, cfg_scale=3.0, method=method,
              seed=5, batch_size=8, decode_images=False)
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")
    kept = eng.generate(**kw)
    assert sizes == []
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "1")
    retired = eng.generate(**kw)
    assert sizes and sizes[0] <= 4 and sizes == sorted(sizes, reverse=True), sizes
    assert torch.equal(retired.tokens, kept.tokens)
    assert retired.stats["tpf_per_image"] == kept.stats["tpf_per_image"]
    assert retired.stats["accepted_drafts_histogram"] == kept.stats["accepted_drafts_histogram"]
    # a shrink reads the kept rows' status afresh (not one round late): the run may end a round sooner
    assert kept.stats["batch_iterations"] - 1 <= retired.stats["batch_iterations"] <= kept.stats["batch_iterations"]


# --- the iteration function -----------------------------------------------------------------------------
class OpLog(TorchDispatchMode):
    """Names of the aten ops dispatched, with markers where iterations start and end."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _batch(e, labels, params, seed=0):
    cond, km = e.condition_rows(labels, None, params.use_cfg)
    return DecodeBatch(cond, km, CounterRNG(seed, torch.arange(len(labels), device=e.device)), len(labels))


@pytest.mark.parametrize("method", ["sjd", "gsd"])
def test_iteration_reads_nothing_from_the_host_and_the_loop_only_reads_the_counter(eng, monkeypatch, method):
    """Inside an iteration no op reads the host; between iterations the loop dispatches nothing but its
    one-round-late read of the rows' committed counts (a copy to the host, ``tolist``). Retiring
    finished rows is off here: it dispatches its gathers between two iterations, at most log2(B) times
    per batch; so is collecting finished rows (one read per finished set)."""
    params = SamplingParams(1.0, 0, 1.0, 3.0)
    opts = jacobi.GSDOptions(gsd_group=4) if method == "gsd" else jacobi.SJDOptions()
    rule = opts.rule(eng) if method == "gsd" else ExactRule()
    log = OpLog()
    original = jacobi.JacobiDecoder.jacobi_iteration

    def marked(self, st):
        log.log.append("<iteration>")
        original(self, st)
        log.log.append("</iteration>")

    monkeypatch.setattr(jacobi.JacobiDecoder, "jacobi_iteration", marked)
    with torch.inference_mode(), log:
        batch = _batch(eng, [1, 2, 3], params)
        res = loop.run(lambda b: jacobi.JacobiDecoder.start(eng, b, params, opts, rule), lambda images, pad: batch,
                       3, 3, eng.tokens_per_image, retire=False)
    assert res.tokens.shape == (3, eng.tokens_per_image)
    text = " ".join(log.log)
    inside = text.split("<iteration>")[1:]
    assert len(inside) >= 3
    for chunk in inside:
        body, between = chunk.split("</iteration>")
        assert not HOST_READS & set(body.split()), body
    between = [chunk.split("</iteration>")[1].split() for chunk in inside[:-1]]
    read = {"copy_", "resolve_conj", "resolve_neg", "item", "_local_scalar_dense"}  # the late copy and tolist
    # where images finished, their rows are collected (gathers and one copy to the host): at most once
    # per image
    other = [ops for ops in between if not (ops and set(ops) <= read)]
    assert len(other) <= 3 and all(set(ops) >= read - {"item", "_local_scalar_dense"} for ops in other), other


def test_window_kv_lands_in_each_rows_own_slots(eng):
    """After a decode, each row's cache slots of its committed tokens equal a fresh forward of that
    image alone (the scratch window K/V were copied to the right per-row slots)."""
    params = SamplingParams(1.0, 0, 1.0, 3.0)
    labels = [1, 2, 4]
    with torch.inference_mode():
        batch = _batch(eng, labels, params, seed=2)
        dec = jacobi.JacobiDecoder(eng, batch, params, jacobi.SJDOptions(jacobi_window=6), ExactRule())
        st = dec.prefill()
        for _ in range(7):
            dec.jacobi_iteration(st)
        n = st.n_committed.tolist()
        # the 8th iteration first places the 7th window's K/V (its forward computes the last committed
        # token's own); the scratch slots then hold the 8th window's
        dec.jacobi_iteration(st)
        assert min(n) > 7 and len(set(n)) > 1  # rows at different prefix lengths
        c = dec.c
        for b, lab in enumerate(labels):
            cond, _ = eng.condition_rows([lab], None, True)
            m = n[b] - 1  # K/V in place: every token committed by the 7th iteration but its last
            ref = TargetSession(eng.gpt, cond, 1, True, None)
            ref.prefill()
            ref.forward(st.tokens[b : b + 1, :m], c + torch.arange(m), torch.tensor([c]), causal_local(m, "cpu"))
            rows = [b, b + len(labels)]
            for got, want in ((dec.session.kv.k, ref.kv.k), (dec.session.kv.v, ref.kv.v)):
                torch.testing.assert_close(got[:, rows, :, : c + m], want[:, :, :, : c + m])


# --- GPU: the iteration as one CUDA graph ---------------------------------------------------------------
gpu = pytest.mark.skipif(not GPU, reason=NO_GPU)


@gpu
@pytest.mark.parametrize("method", ["sjd", "gsd"])
def test_gpu_graph_replay_equals_eager(method):
    e = tiny_engine(vocab=64, block=36, peak=8.0).to("cuda", torch.float32)
    kw = dict(class_labels=[0, 1, 2, 3, 4], temperature=1.0, cfg_scale=3.0, seed=1, method=method, batch_size=8,
              decode_images=False)
    eager = e.generate(cuda_graphs=False, **kw)
    graphed = e.generate(cuda_graphs=True, **kw)
    assert graphed.stats["cuda_graphs"] and not eager.stats["cuda_graphs"]
    assert torch.equal(eager.tokens, graphed.tokens)
    assert eager.stats["target_forward_passes"] == graphed.stats["target_forward_passes"]


@gpu
@pytest.mark.parametrize("options", ["SJDOptions", "GSDOptions"])
def test_gpu_jacobi_steady_state_never_syncs(options):
    """After capture, replays and the one-round-late status read run under sync-debug 'error'."""
    from vvs_engine.runtime.loop import LateRead
    from vvs_engine.runtime.runner import RoundGraphs

    e = tiny_engine(vocab=64, block=36, peak=8.0).to("cuda", torch.float32)
    params = SamplingParams(1.0, 0, 1.0, 3.0)
    with torch.inference_mode():
        opts = getattr(jacobi, options)()
        rule = opts.rule(e) if isinstance(opts, jacobi.GSDOptions) else ExactRule()
        dec = jacobi.JacobiDecoder.start(e, _batch(e, [1, 2, 3, 4], params), params, opts, rule)
        graphs = RoundGraphs(dec.round_functions(), dec.round_buffers(), use_graphs=True)
        graphs("jacobi")  # capture
        committed = LateRead(dec.status())
        committed.push()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(6):
                committed.read()
                graphs("jacobi")
                committed.push()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert int(dec.state.n_committed.min()) > 6
