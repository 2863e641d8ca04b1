"""The one decode loop (``runtime.loop``): continuous batching changes no token.

An image's tokens must not depend on when it was admitted or on its batch-mates: the same images are
decoded alone (one row), in static batches, and with fewer rows than images so that most of them are
admitted mid-run into rows freed by finished images; every method on the loop, greedy and sampled,
fp64 (where a batch shape cannot change rounding). Also: padding rows, the late-read bookkeeping of
admitted rows, session row admission with caption key masks, and the GPU's sync-free steady state.
"""
from __future__ import annotations

import pytest
import torch

from spec_models import tiny_engine
from vvs_engine.methods import get_method
from vvs_engine.runtime.loop import LateRead, batch_bucket
from vvs_engine.runtime.target import TargetSession
from vvs_engine.sampling import SamplingParams

GPU = torch.cuda.is_available()
NO_GPU = "no CUDA device: CUDA-graph replay of the loop's rounds needs a GPU (benchmarks/gpu_suite.sh)"
if not GPU:
    print(f"\n[test_loop] GPU tests skipped: {NO_GPU}")

TREE = dict(tree_total=8, tree_depth=3, tree_topk=3)
LOOP_METHODS = [("ar", {}), ("sjd", {"jacobi_window": 6}), ("gsd", {"gsd_group": 4, "jacobi_window": 6}),
                ("scd", {"jacobi_window": 6}), ("sjd-pac", {"jacobi_window": 12, "pac_width": 2, "pac_depth": 3}),
                ("eagle", TREE), ("lantern", TREE), ("lantern++", {}), ("cascade", {}),
                ("vvs", dict(TREE, skip_policy="uniform", skip_interval=2)),
                ("vvs", dict(TREE, skip_policy="dynamic", skip_threshold=0.0, post_verify="reject")),
                ("zipar", {"zipar_window": 2}), ("zipar", {"zipar_window": 2, "zipar_verify": "sjd"}),
                ("pjd", {"zipar_window": 3, "zipar_commit_lag": 1, "zipar_jacobi_window": 3, "zipar_commit": "drafts",
                         "zipar_keep": 0.5}),
                ("quant-draft", {"draft_length": 3}),
                ("row-drafts", {"jacobi_window": 3, "zipar_window": 1, "zipar_commit_lag": 0, "zipar_jacobi_window": 2})]
IDS = [f"vvs-{o['skip_policy']}" if m == "vvs" else f"zipar-{o.get('zipar_verify', 'none')}" if m == "zipar" else m
       for m, o in LOOP_METHODS]
LABELS = [0, 3, 4, 1, 2, 0, 3]  # 7 images: with 2 or 3 rows, most are admitted into a running batch


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=20, cfg_scale=3.0), dict(temperature=0.0)],
                         ids=["sampled", "greedy"])
@pytest.mark.parametrize("method,opts", LOOP_METHODS, ids=IDS)
def test_tokens_do_not_depend_on_admission_or_batch_mates(eng, method, opts, sampling):
    kw = dict(class_labels=LABELS, method=method, seed=7, decode_images=False, **opts, **sampling)
    static = eng.generate(batch_size=4, static_batches=True, **kw)
    continuous = eng.generate(batch_size=3, **kw)
    assert continuous.stats["admissions"] >= 2  # images joined a running batch, at several rounds
    assert torch.equal(continuous.tokens, static.tokens)
    # (each image decoded alone, greedy and sampled, is test_images_with_other_settings_share_a_batch's)
    # the same work per image, whichever way it was batched
    assert continuous.stats["per_image"] == static.stats["per_image"]
    assert continuous.stats["target_forward_passes"] == static.stats["target_forward_passes"]
    if method == "vvs":  # skips decided per sequence: some happened, and the same ones either way
        assert continuous.stats["skip_steps"] == static.stats["skip_steps"] > 0


# Per-image settings in one batch: greedy, sampled, top-k, top-p, another guidance and none (cfg 1).
MIXED = dict(temperature=[1.0, 0.0, 0.8, 1.0, 1.2, 0.0, 1.0], top_k=[20, 0, 10, 0, 0, 5, 0],
             top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 1.0, 0.9], cfg_scale=[3.0, 3.0, 1.5, 3.0, 1.0, 2.0, 3.0],
             seed=[7, 8, 9, 10, 11, 12, 7])


@pytest.mark.parametrize("method,opts", LOOP_METHODS, ids=IDS)
def test_images_with_other_settings_share_a_batch(eng, method, opts):
    """Images with different seeds and sampling settings (greedy next to sampled, top-k, top-p, other
    guidance scales) decoded together, most admitted mid-run, equal each image decoded alone with its own
    settings (fp64)."""
    kw = dict(method=method, decode_images=False, **opts)
    mixed = eng.generate(class_labels=LABELS, batch_size=3, **MIXED, **kw)
    assert mixed.stats["admissions"] >= 2 and "per_image" in mixed.stats["sampling"]
    for i in (0, 1, 2, 3, 4, 5):
        alone = eng.generate(class_labels=[LABELS[i]], image_indices=[i], batch_size=1,
                             **{name: values[i] for name, values in MIXED.items()}, **kw)
        assert torch.equal(mixed.tokens[i], alone.tokens[0]), f"image {i} ({ {k: v[i] for k, v in MIXED.items()} })"
        assert mixed.stats["per_image"]["target_forward_passes"][i] == \
            alone.stats["per_image"]["target_forward_passes"][0]


def test_per_image_settings_are_checked(eng):
    from vvs_engine.errors import VVSError

    with pytest.raises(VVSError, match="temperature has 2 values for 3 images"):
        eng.generate(class_labels=[0, 1, 2], temperature=[1.0, 0.5], decode_images=False)
    with pytest.raises(VVSError, match="top-p must be in"):
        eng.generate(class_labels=[0, 1], top_p=[0.5, 1.5], decode_images=False)
    with pytest.raises(VVSError, match="seed must be an integer"):
        eng.generate(class_labels=[0, 1], seed=[0, "x"], decode_images=False)


def test_continuous_batching_keeps_rows_busy(eng):
    """SJD images finish at different iterations: with continuous batching fewer rounds are run and a
    larger share of row-rounds does real work than with static batches; forwards per image are equal."""
    kw = dict(class_labels=[i % 5 for i in range(12)], method="sjd", seed=1, temperature=1.0, cfg_scale=3.0,
              decode_images=False)
    static = eng.generate(batch_size=4, static_batches=True, **kw)
    continuous = eng.generate(batch_size=4, **kw)
    assert continuous.stats["batch_rounds"] < static.stats["batch_rounds"]
    assert continuous.stats["row_utilisation"] > static.stats["row_utilisation"]
    assert continuous.stats["target_forward_passes"] == static.stats["target_forward_passes"]
    assert 0 < static.stats["row_utilisation"] <= 1 and continuous.stats["row_utilisation"] <= 1


def test_padding_rows_are_dropped(eng):
    """3 images in a static batch of 4 rows (the pad repeats image 0): tokens and counts as 3 alone."""
    kw = dict(class_labels=[1, 2, 4], method="sjd", seed=2, decode_images=False)
    assert batch_bucket(3) == 4
    padded = eng.generate(batch_size=4, static_batches=True, **kw)
    single = eng.generate(batch_size=1, **kw)
    assert padded.tokens.shape == (3, eng.tokens_per_image)
    assert torch.equal(padded.tokens, single.tokens)
    assert padded.stats["per_image"] == single.stats["per_image"]


def test_greedy_ar_is_the_argmax_of_teacher_forced_logits(eng):
    """The loop's AR decoder, with admission, against the model scored independently (Engine.score):
    every greedy token is the argmax of the guided logits of its prefix."""
    labels = [0, 1, 2, 3, 4]
    out = eng.generate(class_labels=labels, temperature=0.0, cfg_scale=3.0, batch_size=2, decode_images=False)
    logits = eng.score(class_labels=labels, tokens=out.tokens, cfg_scale=3.0)
    assert torch.equal(logits.argmax(-1), out.tokens)


def test_admitted_rows_take_the_newcomers_caches_and_caption_masks():
    """A session's row table (``runtime.rows``): rows of a running session take a newcomer session's KV
    cache, condition rows and caption key mask (both CFG halves); the other rows keep theirs."""
    from vvs_engine.runtime.rows import RowTable

    from vvs_engine.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    g = GPT(GPTConfig(dim=32, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, model_type="t2i",
                      cls_token_num=6, caption_dim=12)).double().eval()
    unc = g.cls_embedding.uncond_embedding.double()

    def session(emb, mask):
        cond = torch.cat([emb, unc[None].expand_as(emb)])
        s = TargetSession(g, cond, emb.shape[0], True, torch.cat([mask, mask]))
        s.prefill()
        return s

    emb = torch.randn(3, 6, 12, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    running = session(emb, mask)
    new_emb, new_mask = torch.randn(1, 6, 12, dtype=torch.float64), torch.ones(1, 6, dtype=torch.bool)
    new_mask[0, 3:] = False
    newcomer = session(new_emb, new_mask)
    before = running.kv.k.clone()
    tables = []
    for s, n in ((running, 3), (newcomer, 1)):
        tables.append(RowTable(n, True, "cpu"))
        s.declare_rows(tables[-1])
    with torch.inference_mode():
        tables[0].copy_rows([1], tables[1], [0])
    for row, source in ((1, 0), (4, 1)):  # image 1's conditional and unconditional rows
        assert torch.equal(running.kv.k[:, row], newcomer.kv.k[:, source])
        assert torch.equal(running.key_valid[row], newcomer.key_valid[source])
        assert torch.equal(running.cond_rows[row], newcomer.cond_rows[source])
    for row in (0, 2, 3, 5):
        assert torch.equal(running.kv.k[:, row], before[:, row])
    assert not running.key_valid[1, 3:6].any() and running.key_valid[0, :6].all()


def test_late_read_is_one_push_behind():
    status = torch.zeros(3, dtype=torch.long)
    late = LateRead(status)
    late.push()
    assert late.read() is None
    status.fill_(5)
    late.push()
    assert late.read() == [0, 0, 0] and late.read_index == 0
    late.push()
    assert late.read() == [5, 5, 5]


def test_every_registered_method_is_a_decoder_of_the_loop(eng):
    """Every registered method builds a decoder with the whole protocol, and this file's identity test
    covers every one of them."""
    from vvs_engine.methods import method_names
    from vvs_engine.methods.common import DecodeBatch
    from vvs_engine.rng import CounterRNG

    protocol = ("round_functions", "round_buffers", "status", "next_kind", "declare_rows", "summarize")
    params = SamplingParams(1.0, 0, 1.0, 3.0)
    cond, km = eng.condition_rows([1], None, True)
    for name in method_names():
        make, opts = get_method(name, eng, {})
        with torch.inference_mode():
            decoder = make(eng, DecodeBatch(cond, km, CounterRNG(0, torch.zeros(1, dtype=torch.long)), 1), params, opts)
        assert all(callable(getattr(decoder, attr, None)) for attr in protocol), name
        assert "tokens" in decoder.RESULTS or "out" in decoder.RESULTS, name
    assert set(method_names()) == {m for m, _ in LOOP_METHODS}


# --- GPU only ---------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not GPU, reason=NO_GPU)


@gpu
@pytest.mark.parametrize("method", ["ar", "sjd", "sjd-pac"])
def test_gpu_graphs_equal_eager_with_admission(method):
    e = tiny_engine(vocab=64, block=36, peak=8.0).to("cuda", torch.float32)
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=1, method=method, batch_size=3,
              decode_images=False)
    eager = e.generate(cuda_graphs=False, **kw)
    graphed = e.generate(cuda_graphs=True, **kw)
    assert graphed.stats["cuda_graphs"] and not eager.stats["cuda_graphs"]
    assert torch.equal(eager.tokens, graphed.tokens)


@gpu
@pytest.mark.parametrize("opts", [{}, dict(zipar_commit="drafts", zipar_keep=0.5, zipar_max_rows=3)],
                         ids=["E1", "rule"])
def test_gpu_pjd_rounds_graphed_and_compiled_equal_eager(opts):
    """PJD's round (every option) captured as a CUDA graph, and compiled then captured, with admission:
    the eager tokens (fp64 for the compiled run, so no sampled token can flip on rounding)."""
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=1, method="pjd", batch_size=3,
              decode_images=False, zipar_window=2, zipar_commit_lag=1, zipar_jacobi_window=3, **opts)
    e = tiny_engine(vocab=64, block=36, peak=8.0).to("cuda", torch.float32)
    eager = e.generate(cuda_graphs=False, **kw)
    graphed = e.generate(cuda_graphs=True, **kw)
    assert graphed.stats["cuda_graphs"] and graphed.stats["admissions"] >= 2
    assert torch.equal(eager.tokens, graphed.tokens)
    e64 = tiny_engine(vocab=64, block=36, peak=8.0).to("cuda", torch.float64)
    eager64 = e64.generate(cuda_graphs=False, **kw)
    compiled = e64.generate(cuda_graphs=True, compile=True, **kw)
    assert compiled.stats["compiled"] == {"zipar": True}
    assert torch.equal(eager64.tokens, compiled.tokens)


@gpu
def test_gpu_ar_steady_state_never_syncs():
    """Replays and the late status read between admissions run under sync-debug 'error'."""
    from vvs_engine.methods.common import DecodeBatch
    from vvs_engine.rng import CounterRNG
    from vvs_engine.runtime.runner import RoundGraphs

    e = tiny_engine(vocab=64, block=36, peak=8.0).to("cuda", torch.float32)
    params = SamplingParams(1.0, 0, 1.0, 4.0)
    with torch.inference_mode():
        cond, km = e.condition_rows([1, 2], None, True)
        run, opts = get_method("ar", e, {})
        dec = run(e, DecodeBatch(cond, km, CounterRNG(0, torch.arange(2, device="cuda")), 2), params, opts)
        graphs = RoundGraphs(dec.round_functions(), dec.round_buffers(), use_graphs=True)
        graphs("ar_step")  # capture (capture itself synchronises)
        late = LateRead(dec.status())
        late.push()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                late.read()
                graphs("ar_step")
                late.push()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert int(dec.state.count.min()) > 10


def test_negative_control_admission_without_the_newcomers_cache_changes_tokens(eng, monkeypatch):
    """If admission left the previous image's KV cache in the rows (only the rest of the state copied),
    admitted images would decode from the wrong condition: the identity check above would see it."""
    kw = dict(class_labels=LABELS, method="sjd", seed=7, temperature=1.0, cfg_scale=3.0, decode_images=False)
    good = eng.generate(batch_size=2, **kw)

    def declare_without_cache(self, table):
        table.add("key_valid", self.key_valid, model_rows=True)
        table.add("cond_rows", self.cond_rows, model_rows=True)

    monkeypatch.setattr(TargetSession, "declare_rows", declare_without_cache)
    eng.clear_cores()  # the kept decoders' row tables were declared with the cache
    bad = eng.generate(batch_size=2, **kw)
    eng.clear_cores()
    assert torch.equal(bad.tokens[:2], good.tokens[:2])  # the first rows were never admitted into
    assert not torch.equal(bad.tokens[2:], good.tokens[2:])


@pytest.mark.parametrize("method,static", [("sjd", False), ("sjd", True), ("eagle", False), ("scd", True)])
def test_benchmark_simulator_replays_the_loop(eng, method, static):
    """benchmarks/continuous_batching.py replays the loop's schedule on per-image forwards (its 512-image
    table rests on it): rounds and row-rounds equal the loop's, tail shrinking included."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from continuous_batching import simulate

    opts = dict(TREE) if method == "eagle" else {"jacobi_window": 6}
    out = eng.generate(class_labels=[i % 5 for i in range(11)], method=method, seed=2, batch_size=4,
                       static_batches=static, decode_images=False, **opts)
    sim = simulate(out.stats["per_image"]["target_forward_passes"], 4, static)
    assert (sim["rounds"], sim["row_rounds"]) == (out.stats["batch_rounds"], out.stats["row_rounds"])


class Arrivals:
    """A server's image source for ``loop.serve``, played by the test: images arrive in waves (one before
    round 3, as a front end thread would submit them; the last only once the loop has gone idle and
    blocks in ``wait``), and one image is abandoned mid-decode (its client gone)."""

    def __init__(self, waves, drop, tokens_per_image):
        self.waves, self.drop, self.T = [list(w) for w in waves], drop, tokens_per_image
        self.waiting, self.done, self.committed, self.idle_waits = [], {}, {}, 0
        self.waiting += self.waves.pop(0)

    def on_round(self, index):
        if index == 3 and len(self.waves) > 1:
            self.waiting += self.waves.pop(0)

    def pending(self):
        return len(self.waiting)

    def take(self, k):
        out, self.waiting = self.waiting[:k], self.waiting[k:]
        return out

    def wait(self):
        if self.waiting:
            return True
        if self.waves:  # nothing in flight: the loop blocks here until the next request arrives
            self.idle_waits += 1
            self.waiting += self.waves.pop(0)
            return True
        return False  # the server closes

    def dropped(self, images):
        return [i for i in images if i == self.drop and self.committed.get(i, 0) >= 3]

    def progress(self, image, committed):
        assert committed > self.committed.get(image, 0) and committed <= self.T
        self.committed[image] = committed

    def finished(self, image, result):
        assert image not in self.done
        self.done[image] = result["tokens"]


@pytest.mark.parametrize("method,opts", [("ar", {}), ("sjd", {"jacobi_window": 6})])
def test_serve_admits_arrivals_frees_dropped_rows_and_keeps_its_shape(eng, method, opts):
    """``loop.serve`` (a server's engine thread): images that arrive while the batch runs and after it went
    idle, each with its own seed and settings, equal the same images of one ``generate`` call (fp64); an
    abandoned image's row is freed and reused; the rows never change (no tail shrink: one shape)."""
    from vvs_engine.engine import ImageSpec
    from vvs_engine.runtime import loop
    from vvs_engine.sampling import SamplingScope

    settings = [SamplingParams(1.0, 20, 1.0, 3.0), SamplingParams(0.0, 0, 1.0, 3.0), SamplingParams(0.8, 0, 0.9, 1.5),
                SamplingParams(1.0, 0, 1.0, 3.0), SamplingParams(1.2, 5, 1.0, 2.0), SamplingParams(1.0, 0, 1.0, 1.0)]
    specs = [ImageSpec(label, None, seed, index, sampling) for label, seed, index, sampling in
             zip([0, 3, 4, 1, 2, 0], [7, 8, 7, 9, 7, 8], [0, 0, 1, 0, 2, 1], settings)]
    scope = SamplingScope.server()
    make_decoder, _ = eng.decoder_for(method, opts, scope)
    source = Arrivals([[0, 1], [2, 3, 4], [5]], drop=3, tokens_per_image=eng.tokens_per_image)
    rows = 3
    with torch.inference_mode():
        stats = loop.serve(make_decoder, lambda images, pad: eng.image_batch([specs[i] for i in images], pad, scope),
                           source, rows, eng.tokens_per_image, on_round=source.on_round)
    assert sorted(source.done) == [0, 1, 2, 4, 5]  # the abandoned image never finishes
    assert source.idle_waits == 1 and stats["admissions"] >= 3
    assert stats["row_rounds"] == rows * stats["batch_rounds"]  # every round on all rows: one shape
    offline = eng.generate(class_labels=[s.label for s in specs], seed=[s.seed for s in specs],
                           image_indices=[s.index for s in specs], temperature=[s.sampling.temperature for s in specs],
                           top_k=[s.sampling.top_k for s in specs], top_p=[s.sampling.top_p for s in specs],
                           cfg_scale=[s.sampling.cfg_scale for s in specs], method=method, batch_size=2,
                           decode_images=False, **opts)
    for i, tokens in source.done.items():
        assert torch.equal(tokens, offline.tokens[i]), i
        assert source.committed[i] == eng.tokens_per_image
