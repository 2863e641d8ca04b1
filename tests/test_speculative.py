"""Speculative core: lossless modes are lossless, relaxed rules do what their formulas say, trees and
KV compaction match slow references."""
from __future__ import annotations


import pytest
import torch

from distribution_checks import _chi2, _chi2_crit
from spec_models import tiny_engine
from vvs_engine.acceptance.verify import ExactRule, LanternRule, neighbor_table
from vvs_engine.drafting.session import DraftSession, TreeSpec
from vvs_engine.kernels.reference import lantern_mass as lantern_mass_reference, tree_meta as tree_meta_reference
from vvs_engine.methods import speculative
from vvs_engine.sampling import SamplingParams, guided_logits, process_logits
from vvs_engine.runtime.target import TargetSession
from vvs_engine.drafting.tree import children_table

from spec_models import LABELS  # the labels of conftest's greedy_ar


@pytest.mark.parametrize("method,opts", [
    ("eagle", {}),
    ("eagle", {"tree": "static"}),
    ("eagle", {"tree": "chain", "tree_depth": 3}),
    ("eagle", {"tree_total": 7, "tree_depth": 2, "tree_topk": 3}),
    ("lantern", {"lantern_delta": 0.0}),
    ("vvs", {"skip_interval": 1}),  # a schedule that never fires
])
def test_greedy_speculative_equals_greedy_ar(eng, greedy_ar, method, opts):
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    assert torch.equal(out.tokens, greedy_ar)
    assert out.stats["target_forward_passes"] == out.stats["verified_steps"]
    assert out.stats["tpf"] >= 1.0


def test_greedy_without_cfg(eng):
    ar = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=1.0, decode_images=False).tokens
    sp = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=1.0, method="eagle", decode_images=False).tokens
    assert torch.equal(ar, sp)


def test_never_firing_vvs_equals_lantern_sampled(eng):
    """Same seed, sampling on: VVS whose schedule never fires is LANTERN token for token."""
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=7, decode_images=False)
    a = eng.generate(method="lantern", lantern_delta=0.2, **kw).tokens
    b = eng.generate(method="vvs", skip_interval=1, lantern_delta=0.2, **kw).tokens
    assert torch.equal(a, b)


def test_never_firing_vvs_over_lantern_pp_is_lantern_pp_on_the_dynamic_tree(eng):
    """VVS over LANTERN++ drafts VVS's dynamic tree: with a schedule that never fires it is LANTERN++ on
    that tree token for token at VVS's λ = 2 (the quality-speed report's equal-rule base), not the
    lantern++ method's default static tree, nor its default λ = 3 (the negative controls: those differ)."""
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=7, decode_images=False)
    vvs = eng.generate(method="vvs", skip_interval=1, accept="lantern++", **kw).tokens
    assert torch.equal(vvs, eng.generate(method="lantern++", tree="dynamic", lantern_lambda=2.0, **kw).tokens)
    assert not torch.equal(vvs, eng.generate(method="lantern++", tree="dynamic", **kw).tokens)
    assert not torch.equal(vvs, eng.generate(method="lantern++", lantern_lambda=2.0, **kw).tokens)


def test_lantern_delta_zero_equals_exact_sampled(eng):
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=3, decode_images=False)
    a = eng.generate(method="eagle", **kw).tokens
    b = eng.generate(method="lantern", lantern_delta=0.0, **kw).tokens
    assert torch.equal(a, b)


def test_seeded_reproducibility(eng):
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, decode_images=False, method="vvs")
    a = eng.generate(seed=11, **kw).tokens
    b = eng.generate(seed=11, **kw).tokens
    c = eng.generate(seed=12, **kw).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- the exact rule reproduces the target distribution ---------------------------------------------
def _exact_joint(eng, label, n_tok, cfg):
    """Exact target probability of every sequence of the first n_tok tokens (by enumeration)."""
    V = eng.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * n_tok).reshape(-1, n_tok)
    lg = eng.score(class_labels=[label] * len(seqs), tokens=seqs, cfg_scale=cfg)  # [S, n_tok, V]
    logp = torch.log_softmax(lg.double(), -1).gather(2, seqs[:, :, None])[:, :, 0].sum(1)
    return seqs, logp.exp()


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_exact_sampling_matches_target_distribution(tree, monkeypatch):
    """Chi-square goodness of fit of the first two tokens (V=4: 16 cells) from speculative sampling
    (batches of 16) against the target's exact joint. Power: with 1200 samples the test rejects a sampler whose
    distribution is 0.1 away in total variation with probability > 0.99 (checked by the negative
    control below, which accepts every draft in the fused verification op the exact rule runs on)."""
    eng = tiny_engine(vocab=4, block=4, seed=1, peak=25.0, with_vq=False)
    seqs, probs = _exact_joint(eng, 1, 2, 2.0)
    opts = dict(tree=tree, tree_total=5, tree_depth=2, tree_topk=2)
    if tree == "static":
        opts = dict(tree="chain", tree_depth=2)
    n = 1200
    out = eng.generate(class_labels=[1] * n, temperature=1.0, cfg_scale=2.0, method="eagle", seed=5,
                       decode_images=False, batch_size=16, **opts)
    stat, dof = _chi2(out.tokens[:, :2], seqs, probs)
    assert stat < _chi2_crit(dof), (stat, dof)
    # The test has power: acceptance uniforms of 0 accept every draft (no verification) and are rejected.
    from vvs_engine import kernels

    fused = kernels.tree_verify
    monkeypatch.setattr(kernels, "tree_verify", lambda tokens, children, p, q, u_accept, *rest:
                        fused(tokens, children, p, q, torch.zeros_like(u_accept), *rest))
    bad = eng.generate(class_labels=[1] * n, temperature=1.0, cfg_scale=2.0, method="eagle", seed=5,
                       decode_images=False, batch_size=16, **opts)
    monkeypatch.undo()
    stat_bad, _ = _chi2(bad.tokens[:, :2], seqs, probs)
    assert stat_bad > _chi2_crit(dof)


# --- relaxed acceptance against hand-computed cases ----------------------------------------------
def test_lantern_mass_hand_computed():
    p = torch.tensor([[0.30, 0.05, 0.10, 0.15, 0.40]])
    nb = torch.tensor([[1, 2, 3, 4]] * 5)  # x=0's neighbours in order 1, 2, 3, 4
    x = torch.tensor([0])
    # c = 0.05, 0.15, 0.30, 0.70 ; delta 0.2 -> m*=2, relaxed = 0.30 + 0.15
    r, m = lantern_mass_reference(p, x, nb, 0.2, ratio=False)
    assert m.item() == 2 and r.item() == pytest.approx(0.45)
    # LANTERN++ lambda = 2: bound (2-1)*0.30 = 0.30 -> m* = 3, relaxed 0.60 (= 2 * p(x))
    r, m = lantern_mass_reference(p, x, nb, 2.0, ratio=True)
    assert m.item() == 3 and r.item() == pytest.approx(0.60)
    # nothing fits
    r, m = lantern_mass_reference(p, x, nb, 0.01, ratio=False)
    assert m.item() == 0 and r.item() == pytest.approx(0.30)


def test_relaxed_accept_and_residual():
    p = torch.tensor([[0.30, 0.05, 0.10, 0.15, 0.40]])
    nb = torch.tensor([[1, 2, 3, 4]] * 5)
    x = torch.tensor([0])
    rule = LanternRule(nb, 0.2)
    ok, moved = rule.accept(p, x, torch.ones(1), torch.tensor([0.44]), None)
    assert ok.item()
    ok, moved = rule.accept(p, x, torch.ones(1), torch.tensor([0.46]), None)
    assert not ok.item()
    # principled residual: x and the 2 credited neighbours (1, 2) removed, renormalised
    res = rule.residual(p, None, x, moved)
    assert torch.allclose(res, torch.tensor([[0, 0, 0, 0.15 / 0.55, 0.40 / 0.55]]))
    ref = LanternRule(nb, 0.2, reference="llamagen", k=3)
    _, moved_ref = ref.accept(p, x, torch.ones(1), torch.tensor([0.46]), None)
    res_ref = ref.residual(p, None, x, moved_ref)  # x and its k + 1 = 4 neighbours removed: uniform
    assert torch.allclose(res_ref, torch.full((1, 5), 0.2))


def test_neighbor_table():
    cb = torch.tensor([[0.0], [1.0], [3.0], [10.0]])
    nb = neighbor_table(cb, 2)
    assert nb.tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]


# --- trees ------------------------------------------------------------------------------------------
def _slow_tree_meta(parents, max_depth):
    N = len(parents)
    mask = torch.zeros(N, N, dtype=torch.bool)
    depth = [0] * N
    paths = torch.full((N, max_depth + 1), -1)
    for i in range(N):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            mask[i, j] = True
            j = parents[j]
        chain.reverse()
        depth[i] = len(chain) - 1
        paths[i, :len(chain)] = torch.tensor(chain)
    leaf = [all(parents[j] != i for j in range(N)) for i in range(N)]
    return mask, torch.tensor(depth), paths, torch.tensor(leaf)


def test_tree_meta_against_slow_reference():
    g = torch.Generator().manual_seed(0)
    for N in (1, 2, 7, 30, 59):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
        md = 12
        got = tree_meta_reference(torch.tensor(parents), md)
        want = _slow_tree_meta(parents, md)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        ch = children_table(torch.tensor(parents), N)
        for i in range(N):
            kids = [j for j in range(N) if parents[j] == i]
            assert ch[i, :len(kids)].tolist() == kids and (ch[i, len(kids):] == -1).all()


def _tree_of(tree, b):
    """Sequence b of a batched DraftTree with unbatched fields (tokens [N], mask [N, N], ...)."""
    from vvs_engine.drafting.tree import DraftTree

    pick = lambda t: None if t is None else t[b]
    return DraftTree(pick(tree.tokens), pick(tree.parents), pick(tree.mask), pick(tree.depth), pick(tree.paths),
                     pick(tree.is_leaf), pick(tree.children), pick(tree.q), pick(tree.draft_logp), None, tree.sampled)


def _session_and_drafts(eng, label=2):
    params = SamplingParams(temperature=1.0, cfg_scale=3.0)
    cond, _ = eng.condition_rows([label], None, True)
    s = TargetSession(eng.gpt, cond, 1, True, None, extra_slots=200)
    spec = TreeSpec("dynamic", total=12, depth=3, topk=3)
    ds = DraftSession(eng.drafter, s.rows, s.S, params, spec)
    H0 = s.prefill()
    root = torch.tensor([5])
    hd = ds.extend(H0, root[None], torch.zeros(1, dtype=torch.long))
    return s, ds, H0, hd, root, params


def test_dynamic_tree_against_slow_eagle2(eng):
    """Rebuild EAGLE-2's selection without any cache: every node's drafter output is recomputed by a
    causal run over the whole pair sequence of its path."""
    s, ds, H0, hd, root, params = _session_and_drafts(eng)
    P_d = torch.tensor([s.c])
    tree = _tree_of(ds.build(root, hd[:, -1], P_d), 0)
    d = eng.drafter

    def q_of(out):
        return process_logits(guided_logits(d.logits(out), ds.dparams), ds.dparams)[0, -1]

    def run_path(tokens):  # outputs of the last pair along [committed pair, path pairs...]
        feats, toks, out = H0, root.clone(), None
        for t in tokens:
            full = d(feats, toks[None].expand(2, -1), torch.arange(toks.shape[0]))
            out = full[:, -1:]
            feats = torch.cat([feats, out], 1)
            toks = torch.cat([toks, torch.tensor([t])])
        full = d(feats, toks[None].expand(2, -1), torch.arange(toks.shape[0]))
        return full[:, -1:]

    K, depth, total = 3, 3, 12
    cands = []  # (score, level, path tokens)
    lp, tk = torch.log(q_of(run_path([]))).topk(K)
    frontier = [(lp[i].item(), [tk[i].item()]) for i in range(K)]
    cands += [(sc, 1, pth) for sc, pth in frontier]
    for lvl in range(depth):
        children = []
        for sc, pth in frontier:
            clp, ctk = torch.log(q_of(run_path(pth))).topk(K)
            children += [(sc + clp[j].item(), pth + [ctk[j].item()]) for j in range(K)]
        cands += [(sc, lvl + 2, pth) for sc, pth in children]
        frontier = sorted(children, key=lambda t: -t[0])[:K]
    best = sorted(cands, key=lambda t: -(t[0] - 1e-6 * t[1]))[:total - 1]
    want = sorted(tuple(p) for _, _, p in best)
    got = sorted(tuple(tree.tokens[tree.paths[i, 1:tree.depth[i] + 1]].tolist()) for i in range(1, tree.n))
    assert got == want


def test_kv_after_compaction_equals_fresh_forward(eng):
    """Verify a tree, move an accepted path into place, and compare the cache with a fresh causal
    forward over the committed tokens."""
    s, ds, H0, hd, root, params = _session_and_drafts(eng)
    P = torch.tensor([s.c])
    tree = _tree_of(ds.build(root, hd[:, -1], P), 0)
    H = s.forward(tree.tokens[None], P + tree.depth, P, tree.mask)
    leaf = int(tree.is_leaf.nonzero()[-1])
    path = tree.paths[leaf]
    L = int(tree.depth[leaf]) + 1
    s.kv.move(P + path.clamp(min=0), P + torch.arange(path.shape[0]))
    committed = tree.tokens[path[:L]]
    fresh = TargetSession(eng.gpt, s.cond_rows, 1, True, None, extra_slots=200)
    fresh.prefill()
    fresh.forward(committed[None], P + torch.arange(L), P, torch.ones(L, L, dtype=torch.bool).tril())
    n = s.c + L
    assert torch.allclose(s.kv.k[:, :, :, :n], fresh.kv.k[:, :, :, :n], atol=1e-10)
    assert torch.allclose(s.kv.v[:, :, :, :n], fresh.kv.v[:, :, :, :n], atol=1e-10)
    # and the features of the path equal the fresh ones
    Hf = fresh.forward(committed[None], P + torch.arange(L), P, torch.ones(L, L, dtype=torch.bool).tril())
    assert torch.allclose(H[:, path[:L]], Hf, atol=1e-10)


def decode_rounds(eng, labels, params, seed=0, **opts):
    """Run the speculative decoder on one batch on the one loop (every row kept to the end) and return
    it (caches and state) with the loop's result."""
    from vvs_engine.methods import get_method
    from vvs_engine.methods.common import DecodeBatch
    from vvs_engine.rng import CounterRNG
    from vvs_engine.runtime import loop

    _, o = get_method("eagle", eng, opts)
    with torch.inference_mode():
        cond, km = eng.condition_rows(labels, None, params.use_cfg)
        batch = DecodeBatch(cond, km, CounterRNG(seed, torch.arange(len(labels))), len(labels))
        rounds = speculative.SpeculativeRounds(eng, batch, params, o, speculative.make_rule_for(eng, o))
        result = loop.run(lambda b: rounds, lambda images, pad: batch, len(labels), len(labels), rounds.T,
                          retire=False)
    return rounds, result


@pytest.mark.parametrize("opts", [
    dict(accept="exact"),
    dict(accept="lantern", skip_policy="uniform", skip_interval=2),
    dict(accept="lantern", skip_policy="dynamic", skip_threshold=-1.0),
    dict(accept="lantern", skip_policy="uniform", skip_interval=2, post_verify="reject"),
    dict(accept="lantern++", tree="static", skip_policy="uniform", skip_interval=2),
])
def test_cache_equals_fresh_forward_after_any_rounds(eng, opts, monkeypatch):
    """After any mix of skip and verify rounds, for every sequence of a batch, the target KV of every
    committed (verified) token equals a fresh causal forward over its committed tokens, and so do the
    cached features."""
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # every sequence's rows stay in the caches to the end
    labels = [1, 3, 0]
    params = SamplingParams(temperature=1.0, cfg_scale=3.0)
    rounds, result = decode_rounds(eng, labels, params, seed=4, **opts)
    s, st = rounds.target, rounds.state
    B = len(labels)
    for b in range(B):
        P_t = min(int(st.target_len[b]), s.c + s.T)  # positions past the image are clamped (and discarded)
        toks = st.out[b, : P_t - s.c]  # tokens whose KV is committed
        assert torch.equal(toks, result.tokens[b, : toks.shape[0]])
        with torch.inference_mode():
            cond, _ = eng.condition_rows([labels[b]], None, True)
            fresh = TargetSession(eng.gpt, cond, 1, True, None, extra_slots=8)
            fresh.prefill()
            L = toks.shape[0]
            c = torch.tensor([s.c])
            Hf = fresh.forward(toks[None], c + torch.arange(L), c, torch.ones(L, L, dtype=torch.bool).tril())
        rows = [b, b + B]
        assert torch.allclose(s.kv.k[:, rows, :, :P_t], fresh.kv.k[:, :, :, :P_t], atol=1e-9)
        assert torch.allclose(s.kv.v[:, rows, :, :P_t], fresh.kv.v[:, :, :, :P_t], atol=1e-9)
        assert torch.allclose(st.feats[rows, s.c:P_t], Hf, atol=1e-9)
    if opts.get("skip_policy") == "uniform" and opts.get("post_verify") != "reject":
        assert result.stats["skip_steps"] > 0 and result.stats["tokens_committed_unverified"] > 0
    if opts.get("post_verify") == "reject":
        assert result.stats["post_verify_rollbacks"] > 0


def test_vvs_stats_and_tpf_counts_skipped_tokens(eng):
    out = eng.generate(class_labels=[0, 1], temperature=1.0, cfg_scale=3.0, method="vvs", skip_interval=2,
                       seed=0, decode_images=False)
    st = out.stats
    assert st["target_forward_passes"] == st["verified_steps"]
    assert st["tpf"] == pytest.approx(st["tokens_generated"] / st["verified_steps"])
    assert st["skip_steps"] >= 1 and sum(st["staleness_histogram"].values()) == st["skip_steps"]


@pytest.mark.parametrize("bad", [
    dict(skip_interval=0), dict(skip_threshold=1.5), dict(select="best"), dict(post_verify="maybe"),
    dict(tree="forest"), dict(tree_total=1), dict(lantern_delta=-0.1), dict(lantern_lambda=0.5),
    dict(accept="nope"), dict(bogus_option=1),
])
def test_bad_options_are_clear_errors(eng, bad):
    from vvs_engine.errors import VVSError

    with pytest.raises(VVSError) as e:
        eng.generate(class_labels=[0], method="vvs", decode_images=False, **bad)
    assert "\n" not in str(e.value)
    # and the engine still works
    eng.generate(class_labels=[0], method="vvs", decode_images=False, temperature=0)


def test_schedules():
    from types import SimpleNamespace

    from vvs_engine.methods.schedule import path_similarity
    from vvs_engine.drafting.tree import tree_structure

    cb = torch.nn.functional.normalize(torch.randn(10, 4, dtype=torch.float64), dim=-1).float()

    def tree_of(parents, tokens):  # B trees of one shape
        B = len(tokens)
        mask, depth, paths, leaf, children = tree_structure(torch.tensor([parents] * B), 2, 3)
        return SimpleNamespace(tokens=torch.tensor(tokens), paths=paths, is_leaf=leaf)

    # leaves 3, 4, 5 in node order; kept (every other): 3 and 5. Tree 0: both (1, 3); tree 1: (1, 3), (1, 5)
    trees = tree_of([-1, 0, 0, 1, 2, 1], [[0, 1, 2, 3, 3, 3], [0, 1, 2, 3, 3, 5]])
    sim = path_similarity(trees, cb)
    w0, w1 = 1 / 1.9, 0.9 / 1.9
    assert sim[0].item() == pytest.approx(1.0, abs=1e-6)
    assert sim[1].item() == pytest.approx(w0 + w1 * float(cb[3] @ cb[5]), abs=1e-6)
    # kept leaves 3 (depth 2) and 2 (depth 1, token 1 like 3's first): the missing depth counts as 0
    uneq = tree_of([-1, 0, 0, 1, 1], [[0, 1, 1, 3, 4]])
    assert path_similarity(uneq, cb).item() == pytest.approx(w0, abs=1e-6)


# --- the shipped Zoo model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo_engine():
    from vvs_engine import Engine

    return Engine.load()


def test_zoo_greedy_speculative_equals_ar(zoo_engine):
    """On the trained model (fp32), greedy EAGLE and greedy VVS-never equal greedy AR token for token."""
    kw = dict(class_labels=[0, 7], temperature=0, cfg_scale=4.0, decode_images=False)
    ar = zoo_engine.generate(**kw).tokens
    for method, opts in (("eagle", {}), ("eagle", {"tree": "static"})):
        sp = zoo_engine.generate(method=method, **opts, **kw)
        assert torch.equal(sp.tokens, ar), method
        assert sp.stats["tpf"] > 1.2  # the trained drafter is accepted
