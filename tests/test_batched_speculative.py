"""Batched speculative decoding: an image's tokens do not depend on the batch it is decoded in,
lossless modes stay lossless at any batch size, finished sequences stop committing while the batch
runs on, and nothing but the round functions dispatches compute between rounds."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spec_models import tiny_engine
from vvs_engine.methods import speculative
from vvs_engine.methods.common import DecodeBatch
from vvs_engine.rng import CounterRNG
from vvs_engine.sampling import SamplingParams

GPU = torch.cuda.is_available()
NO_GPU = "no CUDA device: whole-round CUDA-graph capture (replay == eager, no host sync) needs a GPU"
if not GPU:
    print(f"\n[test_batched_speculative] GPU tests skipped: {NO_GPU}")

LABELS = [0, 3, 4, 1, 2]

# Every drafter method with options that exercise its own machinery (trees, rules, skips, rollbacks).
METHODS = [
    ("eagle", {}),
    ("eagle", {"tree": "static"}),
    ("lantern", {}),
    ("lantern++", {}),
    ("vvs", {"skip_interval": 2}),
    ("vvs", {"skip_interval": 2, "post_verify": "reject", "select": "confidence", "feature_reuse": "repeat"}),
    ("cascade", {}),
]


@pytest.fixture(scope="module")
def greedy_ar(eng):  # this file's own labels (conftest's fixture has spec_models.LABELS)
    return eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, decode_images=False).tokens


@pytest.mark.parametrize("method,opts", [
    ("eagle", {}),
    ("eagle", {"tree": "static"}),
    ("lantern", {"lantern_delta": 0.0}),
    ("vvs", {"skip_interval": 1}),  # a schedule that never fires
], ids=str)
def test_greedy_batch4_equals_batch1_equals_ar(eng, greedy_ar, method, opts):
    kw = dict(class_labels=LABELS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    one = eng.generate(batch_size=1, **kw)
    four = eng.generate(batch_size=4, **kw)  # a batch of 4 and a batch of 1
    assert torch.equal(one.tokens, greedy_ar)
    assert torch.equal(four.tokens, greedy_ar)
    assert four.stats["batch_size"] == 4 and one.stats["batch_size"] == 1
    assert four.stats["target_forward_passes"] == one.stats["target_forward_passes"]


# The options tests/test_loop.py does not decode: there every method's default tree, LANTERN(++), CASCADE
# and both VVS schedules are decoded in static batches, with admission, and each image alone.
@pytest.mark.parametrize("method,opts", [m for m in METHODS if m[1].get("tree") == "static" or "select" in m[1]],
                         ids=str)
def test_sampled_tokens_identical_at_batch_sizes_1_3_8(eng, method, opts):
    """fp64 on the CPU: every image's sampled tokens are the same whether it is decoded alone, in
    batches of 3 (with bucket padding) or all 8 together; VVS's per-sequence schedule included."""
    labels = [0, 3, 4, 1, 2, 0, 3, 1]
    kw = dict(class_labels=labels, temperature=1.0, cfg_scale=3.0, method=method, seed=4, decode_images=False,
              **opts)
    runs = {bs: eng.generate(batch_size=bs, **kw) for bs in (1, 3, 8)}
    assert torch.equal(runs[1].tokens, runs[3].tokens)
    assert torch.equal(runs[1].tokens, runs[8].tokens)
    if method == "vvs":
        assert runs[8].stats["skip_steps"] > 0
    if opts.get("post_verify") == "reject":
        assert runs[8].stats["post_verify_rollbacks"] > 0
    # Per-image counts do not depend on the batch either.
    assert runs[1].stats["tpf_per_image"] == runs[8].stats["tpf_per_image"]


def test_image_indices_select_the_random_stream(eng):
    """An image's draws are keyed by its global index: image 5 of a run equals image 0 of a run that
    starts at index 5 (dataset sharding), and different indices give different tokens."""
    kw = dict(temperature=1.0, cfg_scale=3.0, method="lantern", seed=9, decode_images=False)
    full = eng.generate(class_labels=[1] * 6, **kw).tokens
    shard = eng.generate(class_labels=[1, 1], image_indices=[5, 2], **kw).tokens
    assert torch.equal(shard[0], full[5]) and torch.equal(shard[1], full[2])
    assert not torch.equal(full[0], full[1])


def test_vvs_dynamic_per_sequence_choice(eng):
    """VVS-D: each sequence decides for itself (similar paths, more than 5 tokens, unfinished, no chain
    pending from a skip); the status tells the loop how many want to skip."""
    params = SamplingParams(temperature=1.0, cfg_scale=3.0)
    T = eng.tokens_per_image
    with torch.inference_mode():
        rounds, _, _ = _rounds(eng, [0, 3, 4], params, skip_policy="dynamic", skip_threshold=-1.0)
        st = rounds.state

        def wants(n_out, chain=(0, 0, 0)):
            st.n_out.copy_(torch.tensor(n_out))
            st.chain_len.copy_(torch.tensor(chain))
            rounds._update_status(st)
            return rounds.wants_skip(st).tolist(), st.status.tolist()[-1]

        assert wants([10, 10, 1]) == ([True, True, False], 2)  # sequence 2 has too few tokens
        assert wants([T, 10, 10]) == ([False, True, True], 2)  # a finished sequence does not skip
        assert wants([10, 10, 10], chain=(0, 2, 0)) == ([True, False, True], 2)  # never two skips in a row
        rounds.opts.skip_threshold = 1.0  # paths never agree perfectly in a random tree
        assert wants([10, 10, 10]) == ([False, False, False], 0)


@pytest.mark.parametrize("interval", [1, 2, 4])
def test_vvs_uniform_per_sequence_schedule_on_device_and_host_agree(eng, interval):
    """VVS-U: a sequence wants to skip on its own rounds r >= 5 with r % interval == 1, never right
    after a skip (a chain pending); the host's copy of the rule (which picks the round kind) agrees
    with the device's (which decides who takes part) round by round."""
    params = SamplingParams(temperature=1.0, cfg_scale=3.0)
    with torch.inference_mode():
        rounds, _, _ = _rounds(eng, [0, 3, 4], params, skip_policy="uniform", skip_interval=interval)
        st = rounds.state
        st.n_out.fill_(20)
        for r in range(16):
            for chain in (0, 1):
                st.round.fill_(r)
                st.chain_len.fill_(chain)
                rounds.own_rounds, rounds.own_skipped = [r] * 3, [bool(chain)] * 3
                device = rounds.wants_skip(st).tolist()
                expected = chain == 0 and r >= 5 and interval > 1 and r % interval == 1
                assert device == [expected] * 3, (r, chain)
                assert [rounds._uniform_wants(i) for i in range(3)] == device


def _decode(rounds, batch, retire=False):
    """Decode ``rounds`` (a prefilled decoder of ``batch``) on the one loop, no admission."""
    from vvs_engine.runtime import loop

    return loop.run(lambda b: rounds, lambda images, pad: batch, batch.size, batch.size, rounds.T, retire=retire)


def _rounds(eng, labels, params, seed=0, **opts):
    from vvs_engine.methods import get_method

    _, o = get_method("eagle", eng, opts)
    cond, km = eng.condition_rows(labels, None, params.use_cfg)
    batch = DecodeBatch(cond, km, CounterRNG(seed, torch.arange(len(labels), device=eng.device)), len(labels))
    return speculative.SpeculativeRounds(eng, batch, params, o, speculative.make_rule_for(eng, o)), o, batch


def test_early_finisher_in_a_batch_keeps_its_tokens(eng, monkeypatch):
    """Image 0 finishes (every draft accepted) many rounds before image 1 (none accepted) of the same
    batch: it stops committing and counting target forwards, and its tokens equal a solo decode."""
    real_verify = speculative.verify_tree

    def forced(tree, p, rule, u_accept, u_sample, greedy, **kw):  # chain trees: node j's child is j + 1
        child = tree.tokens[:, 1:, None]
        p = p.clone()
        p[0, :-1] = torch.zeros_like(p[0, :-1]).scatter_(1, child[0], 1.0)  # the target agrees
        if p.shape[0] > 1:
            refuse = p[1, :-1].scatter(1, child[1], 0.0)  # the target never agrees
            p[1, :-1] = refuse / refuse.sum(-1, keepdim=True)
        return real_verify(tree, p, rule, u_accept, u_sample, greedy, **kw)

    monkeypatch.setattr(speculative, "verify_tree", forced)
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # the finished row stays in the batch to the end
    kw = dict(temperature=1.0, cfg_scale=3.0, seed=3, method="eagle", tree="chain", tree_depth=4,
              decode_images=False)
    T = eng.tokens_per_image
    params = SamplingParams(temperature=1.0, cfg_scale=3.0)
    with torch.inference_mode():
        rounds, o, batch = _rounds(eng, [1, 1], params, seed=3, tree="chain", tree_depth=4, accept="exact")
        result = _decode(rounds, batch)
    passes = result.counters["passes"].tolist()
    assert passes == [-(-(T - 1) // 5), T - 1], passes
    assert int(rounds.state.n_out[0]) < T + 5  # stopped committing long before the batch ended
    assert result.stats["batch_rounds"] >= T - 1
    solo = eng.generate(class_labels=[1], batch_size=1, **kw).tokens[0]
    assert torch.equal(result.tokens[0], solo)


# VVS-D's sequences wait for the round kind they want, so they finish closer together: seed 3 has three
# early finishers (the batch shrinks from 8 rows to 4)
@pytest.mark.parametrize("method,opts", METHODS + [("vvs", {"skip_policy": "dynamic", "skip_threshold": 0.0,
                                                            "seed": 3})], ids=str)
def test_retiring_finished_sequences_changes_no_token(eng, monkeypatch, method, opts):
    """fp64, sampled: dropping finished sequences mid-batch (8 -> 4 -> 2 -> 1) gives the same tokens,
    forward counts and statistics as keeping every row to the end (VVS-D's batch decisions included:
    finished sequences never vote), and the batch really shrinks."""
    sizes = []
    from vvs_engine.runtime.core import DecodeCore

    original = DecodeCore.move

    def logged(self, source, keep, target):  # the tail: live rows move into a smaller kept decoder
        sizes.append(len(keep))
        return original(self, source, keep, target)

    monkeypatch.setattr(DecodeCore, "move", logged)
    kw = dict(class_labels=[i % 5 for i in range(7)], temperature=1.0, top_k=20, cfg_scale=3.0, method=method,
              seed=4, batch_size=8, decode_images=False)
    kw.update(opts)
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")
    kept = eng.generate(**kw)
    assert sizes == []
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "1")
    retired = eng.generate(**kw)
    assert sizes and sizes[0] <= 4 and sizes == sorted(sizes, reverse=True), sizes
    assert torch.equal(retired.tokens, kept.tokens)
    for key in ("tpf_per_image", "target_forward_passes", "skip_steps", "acceptance_rate_by_depth",
                "post_verify_rollbacks"):
        assert retired.stats.get(key) == kept.stats.get(key), key
    # a shrink reads the kept rows' status afresh (not one round late), so the run may end a round sooner
    assert kept.stats["batch_rounds"] - 1 <= retired.stats["batch_rounds"] <= kept.stats["batch_rounds"]


@pytest.mark.parametrize("method,opts", [("eagle", {}), ("vvs", {"skip_interval": 2})], ids=str)
def test_progress_counts_each_token_once_across_retirements(eng, monkeypatch, method, opts):
    """The tokens a decode reports to the progress bar add up to exactly the images' tokens, with rows
    retired mid-batch (the one-round-late status still shows a retirement's rows: none is counted twice)."""
    import vvs_engine.engine as engine_mod

    reports, retirements = [], []
    from vvs_engine.runtime.core import DecodeCore

    original_tokens, original_retire = engine_mod._progress_bar.tokens, DecodeCore.move

    def record(self, k):
        reports.append(int(k))
        return original_tokens(self, k)

    def logged(self, source, keep, target):
        retirements.append(len(keep))
        return original_retire(self, source, keep, target)

    monkeypatch.setattr(engine_mod._progress_bar, "tokens", record)
    monkeypatch.setattr(DecodeCore, "move", logged)
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "1")
    eng.generate(class_labels=[i % 5 for i in range(7)], temperature=1.0, top_k=20, cfg_scale=3.0, method=method,
                 seed=4, batch_size=8, decode_images=False, progress=True, **opts)
    assert retirements, "the batch never retired rows: the test would not exercise the late flags"
    assert all(k >= 0 for k in reports)
    assert sum(reports) == 7 * eng.tokens_per_image, (sum(reports), reports)


# Ops that read device memory on the host, or copy host data to the device: either one breaks CUDA-graph
# capture of a round (and a value baked in at capture would never change between replays). A lifted
# tensor of one element or more (torch.tensor([...]) inside a round) is a host-to-device copy on CUDA;
# a 0-dim one is a Python scalar written by indexing (x[:, 0] = True), a kernel argument, which is fine.
HOST_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "unique", "masked_select"}


class _HostOpsInRounds(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.in_round = False
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.in_round and (name in HOST_OPS or (name == "lift_fresh" and args[0].dim() > 0)):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def watched_rounds(mode):
    """SpeculativeRounds whose round functions mark ``mode`` (``in_round`` while one runs, ``started``
    from the first round on), so a dispatch mode can tell round work from the host loop's."""

    class Watched(speculative.SpeculativeRounds):
        def _watch(self, fn):
            mode.started = mode.in_round = True
            mode.rounds = getattr(mode, "rounds", 0) + 1
            try:
                fn()
            finally:
                mode.in_round = False

        def verify_round(self):
            self._watch(super().verify_round)

        def verify_after_skip(self):
            self._watch(super().verify_after_skip)

        def skip_round(self):
            self._watch(super().skip_round)

    return Watched


@pytest.mark.parametrize("method,opts", METHODS + [("vvs", {"skip_policy": "dynamic", "skip_threshold": 0.0})], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_rounds_never_touch_the_host(eng, method, opts, temperature):
    """Inside every round function (verify, skip, verify after a skip) no op reads the device from the
    host or copies host data in, so each round can be captured whole as a CUDA graph."""
    from vvs_engine.methods import get_method

    mode = _HostOpsInRounds()
    with mode:  # the sanity check below proves the mode sees such ops
        mode.in_round = True
        torch.ones(2).sum().item()
        torch.ones(2, dtype=torch.bool)[0] = False  # a scalar write: not counted
        torch.tensor([1, 2])  # host data: counted
        mode.in_round = False
    assert mode.seen == ["aten._local_scalar_dense.default", "aten.lift_fresh.default"]
    mode.seen.clear()

    Watched = watched_rounds(mode)
    _, o = get_method(method, eng, opts)
    params = SamplingParams(temperature=temperature, cfg_scale=3.0)
    with torch.inference_mode():
        cond, km = eng.condition_rows([0, 3], None, True)
        batch = DecodeBatch(cond, km, CounterRNG(0, torch.arange(2)), 2)
        rounds = Watched(eng, batch, params, o, speculative.make_rule_for(eng, o))
        with mode:
            result = _decode(rounds, batch)
    assert result.stats["verified_steps"] > 0
    assert mode.seen == [], sorted(set(mode.seen))


class _OpsBetweenRounds(TorchDispatchMode):
    """Counts compute ops (an output that shares no storage with an input) outside round functions,
    with the number of rounds started before each."""

    def __init__(self):
        super().__init__()
        self.in_round = False
        self.started = False
        self.rounds = 0
        self.outside = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.started and not self.in_round:
            ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)}
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() not in ins for t in outs):
                self.outside.append((self.rounds, str(func)))
        return out


@pytest.mark.parametrize("opts", [dict(accept="lantern"), dict(accept="lantern", skip_policy="uniform"),
                                  dict(accept="lantern", skip_policy="dynamic", skip_threshold=0.0)], ids=str)
def test_no_compute_op_between_round_calls(eng, opts, monkeypatch):
    """Steady state on the loop: from the first round to the last, every compute op runs inside a round
    function; the loop only copies the status it reads late. (Retiring finished sequences, at most
    log2(B) gathers per run between two rounds, is off here; collecting a finished image's results,
    once per image, is allowed.)"""
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")
    params = SamplingParams(temperature=1.0, cfg_scale=3.0)
    mode = _OpsBetweenRounds()

    Watched = watched_rounds(mode)
    from vvs_engine.methods import get_method

    _, o = get_method("eagle", eng, opts)
    with torch.inference_mode():
        cond, km = eng.condition_rows([0, 3], None, True)
        batch = DecodeBatch(cond, km, CounterRNG(0, torch.arange(2)), 2)
        rounds = Watched(eng, batch, params, o, speculative.make_rule_for(eng, o))
        from vvs_engine.runtime.core import DecodeCore

        real_collect = DecodeCore.collect

        def collect(slot, rows, tokens_per_image):  # once per finished image: its results to the host
            mode.in_round = True
            try:
                return real_collect(slot, rows, tokens_per_image)
            finally:
                mode.in_round = False

        monkeypatch.setattr(DecodeCore, "collect", staticmethod(collect))
        with mode:
            result = _decode(rounds, batch)
    between = [op for started, op in mode.outside if started < mode.rounds]  # after the last: the results
    assert between == [], between[:10]
    assert result.stats["verified_steps"] > 0


# GPU-only extras: VVS-D (decided per sequence on the device), GSD's rule on a dynamic tree, greedy.
GPU_METHODS = METHODS + [
    ("vvs", {"skip_policy": "dynamic", "skip_threshold": -1.0}),
    ("vvs", {"skip_policy": "dynamic", "skip_threshold": -1.0, "post_verify": "reject"}),
    ("eagle", {"accept": "gsd"}),
    ("lantern", {"temperature": 0.0}),
]


@pytest.mark.skipif(not GPU, reason=NO_GPU)
def test_gpu_round_graphs_replay_equals_eager():
    e = tiny_engine(vocab=64, block=36, peak=8.0)
    e.to("cuda", torch.float32)
    for method, opts in GPU_METHODS:
        kw = dict(class_labels=[0, 3, 4], temperature=1.0, cfg_scale=3.0, seed=5, method=method, decode_images=False,
                  batch_size=4)
        kw.update(opts)
        eager = e.generate(cuda_graphs=False, **kw)
        graphed = e.generate(cuda_graphs=True, **kw)
        assert graphed.stats["cuda_graphs"] and not eager.stats["cuda_graphs"]
        assert torch.equal(eager.tokens, graphed.tokens), (method, opts)


# Option sets whose verify / skip rounds differ: relaxed acceptance with a skip schedule, exact
# acceptance, and post-verification rollback (reject) with confidence selection and repeated features.
# Also: CASCADE's torch walk, GSD's rule, VVS-D (path agreement in the status), a sampled static tree, greedy.
ROUND_OPTIONS = [dict(accept="lantern", skip_policy="uniform"), dict(accept="exact", skip_policy="uniform"),
                 dict(skip_policy="uniform", post_verify="reject", select="confidence", feature_reuse="repeat"),
                 dict(accept="cascade"), dict(accept="gsd"), dict(skip_policy="dynamic", skip_threshold=-1.0),
                 dict(tree="static"), dict(accept="lantern", skip_policy="uniform", temperature=0.0)]


def _replay_every_round_kind(e, use_graphs, sync_check, temperature=1.0, **opts):
    """Capture (or run) each round kind once, then replay every kind with the one-round-late counter read
    between replays, as the decode loop does; with ``sync_check`` the steady state runs under
    sync-debug "error". Returns the graphs and the output tokens so far."""
    from vvs_engine.runtime.runner import RoundGraphs

    params = SamplingParams(temperature=temperature, cfg_scale=3.0)
    with torch.inference_mode():
        rounds, o, batch = _rounds(e, [0, 3], params, **opts)
        graphs = RoundGraphs({"verify": rounds.verify_round, "verify_after_skip": rounds.verify_after_skip,
                              "skip": rounds.skip_round}, rounds.state.buffers(), use_graphs=use_graphs)
        for kind in ("verify", "skip", "verify_after_skip"):  # capture each kind
            graphs(kind)
        from vvs_engine.runtime.loop import LateRead

        counters = LateRead(rounds.state.status)
        counters.push()
        if sync_check:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for kind in ("verify", "skip", "verify_after_skip", "verify"):
                counters.read()
                graphs(kind)
                counters.push()
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode(0)
        n_out = rounds.state.n_out.clone()
    return graphs, n_out


@pytest.mark.parametrize("opts", ROUND_OPTIONS, ids=str)
def test_round_kinds_replay_in_any_order_on_the_cpu(eng, opts):
    """The sequence the GPU sync test replays, run eagerly on the CPU (so the GPU test's setup is
    exercised in CI): every round kind runs, and each round commits tokens."""
    graphs, n_out = _replay_every_round_kind(eng, use_graphs=False, sync_check=False, **opts)
    assert all(graphs.replays[k] >= 2 for k in graphs.replays)
    assert bool((n_out > 3).all()), n_out


@pytest.mark.skipif(not GPU, reason=NO_GPU)
@pytest.mark.parametrize("opts", ROUND_OPTIONS, ids=str)
def test_gpu_steady_state_rounds_never_sync(opts):
    """After capture, replaying every round kind and reading the late counters never syncs."""
    e = tiny_engine(vocab=64, block=36, peak=8.0)
    e.to("cuda", torch.float32)
    graphs, n_out = _replay_every_round_kind(e, use_graphs=True, sync_check=True, **opts)
    assert all(graphs.replays[k] >= 2 for k in graphs.replays)
    assert bool((n_out > 3).all()), n_out
