"""CASCADE: thresholds that never fire are the exact method token for token; the relaxed acceptance
probability, the similarity sets, the gates and the training weights match hand computations and slow
loops; bad options are one-line errors."""
from __future__ import annotations

import math

import pytest
import torch

from spec_models import tiny_engine
from vvs_engine.acceptance.verify import VerifyContext, make_rule
from vvs_engine.acceptance.cascade import (CascadeRule, acceptance_probability, kl_to_normalised_logits, nucleus_floor,
                                     set_token_mask, similarity_sets)
from vvs_engine.training.cascade import cascade_loss_weights, redundancy_weights
from vvs_engine.errors import VVSError
from vvs_engine.drafting.tree import DraftTree, tree_structure

LABELS = [0, 3, 4]
OFF = dict(cascade_breadth_threshold=1.5, cascade_depth_threshold=1.01)  # cosines never exceed these


@pytest.fixture(scope="module")
def eng():
    return tiny_engine(vocab=64, block=36, peak=8.0)


# --- never-firing thresholds are the underlying exact method ----------------------------------------
_EXACT = {}


def _exact(eng, **kw):
    """The exact method's output, computed once per setting (several tests compare against it)."""
    key = repr(sorted(kw.items()))
    if key not in _EXACT:
        _EXACT[key] = eng.generate(method="eagle", decode_images=False, **kw)
    return _EXACT[key]


@pytest.mark.parametrize("temperature,seed,labels", [(0.0, 0, [3]), (1.0, 7, LABELS), (1.0, 8, [1, 2])])
@pytest.mark.parametrize("source", ["drafter", "target-hidden"])
def test_off_thresholds_equal_eagle1_static(eng, temperature, seed, labels, source):
    kw = dict(class_labels=labels, temperature=temperature, cfg_scale=3.0, seed=seed)
    exact = _exact(eng, tree="static", **kw)
    casc = eng.generate(method="cascade", cascade_source=source, decode_images=False, **OFF, **kw)
    assert torch.equal(exact.tokens, casc.tokens)
    assert exact.stats["target_forward_passes"] == casc.stats["target_forward_passes"]


@pytest.mark.parametrize("opts", [
    dict(tree="dynamic", cascade_source="target-logits"),  # dynamic trees with a target source
    dict(skip_policy="uniform", skip_interval=2),  # under VVS skipping (static tree)
    dict(skip_policy="uniform", skip_interval=2, post_verify="reject"),
    dict(tree="dynamic", cascade_source="target-hidden", cascade_depth_source="hidden", cascade_gate="nucleus"),
])
def test_off_thresholds_equal_exact_with_other_trees_and_skipping(eng, opts):
    kw = dict(class_labels=[0, 4], temperature=1.0, cfg_scale=3.0, seed=5)
    base = {k: v for k, v in opts.items() if not k.startswith("cascade_")}
    base.setdefault("tree", "static")
    exact = _exact(eng, **base, **kw)
    casc = eng.generate(method="cascade", decode_images=False, **opts, **OFF, **kw)
    assert torch.equal(exact.tokens, casc.tokens)


def test_relaxation_fires_and_raises_tpf(eng):
    # 8 images: on 3 the target-side sources' gain is within the noise of the random streams
    kw = dict(class_labels=[0, 3, 4, 1, 2, 0, 3, 4], temperature=1.0, cfg_scale=3.0, seed=7)
    exact = _exact(eng, tree="static", **kw).stats["tpf"]
    for source in ("drafter", "target-logits", "target-hidden"):
        st = eng.generate(method="cascade", cascade_source=source, cascade_gate="none", decode_images=False,
                          **kw).stats
        assert st["tpf"] > exact and st["mean_accepted_length"] > 1.0


# --- hand-computed relaxed acceptance ---------------------------------------------------------------
def _hand_tree():
    """root 0 (token 0) -> nodes 1, 2 (tokens 1, 2) at depth 1; node 1 -> node 3 (token 3). V = 4."""
    parents = torch.tensor([-1, 0, 0, 1])
    mask, depth, paths, leaf, children = (t[0] for t in tree_structure(parents[None], 2, 2))  # one tree
    q = torch.zeros(4, 4)
    q[1] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # drafter predictions after nodes 1 and 2 ...
    q[2] = torch.tensor([0.0, 0.0, 0.1, 0.9])  # ... nearly the same: cos = 0.994
    return DraftTree(torch.tensor([0, 1, 2, 3]), parents, mask, depth, paths, leaf, children, q=q)


def _ctx(tree, p, logits=None, hidden=None, child=1):
    return VerifyContext(tree, torch.tensor([0]), torch.tensor([child]), torch.tensor([True]), p, logits, hidden)


def _acceptance_rate(rule, r, x, qx, ctx, n=20000):
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n  # a fine grid stands in for U(0, 1)
    ok, _ = rule.accept(r.expand(n, -1), x.expand(n), qx.expand(n), u, _expand_ctx(ctx, n))
    return ok.float().mean().item()


def _expand_ctx(ctx, n):
    return VerifyContext(ctx.tree, ctx.parent.expand(n), ctx.child.expand(n), ctx.valid.expand(n), ctx.p,
                         ctx.logits, ctx.hidden)


def test_breadth_credit_hand_computed():
    tree = _hand_tree()
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4)
    ctx = _ctx(tree, p)
    rule = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=2.0, gate="kl")
    x, r = torch.tensor([1]), p[:1]
    A, moved = rule.credit(r, x, ctx)
    assert A.item() == pytest.approx(0.3)  # S(1) = {node 2}: p(token 2) is credited
    assert moved.tolist() == [[False, False, True, False]]
    # u q < p + u A with p 0.2, q 0.8, A 0.3  <=>  u < 0.4
    ok, _ = rule.accept(r, x, torch.tensor([0.8]), torch.tensor([0.399]), ctx)
    assert ok.item()
    ok, _ = rule.accept(r, x, torch.tensor([0.8]), torch.tensor([0.401]), ctx)
    assert not ok.item()
    assert _acceptance_rate(rule, r, x, torch.tensor([0.8]), ctx) == pytest.approx(0.4, abs=1e-3)
    assert acceptance_probability(0.2, 0.8, 0.3) == pytest.approx(0.4)
    # a threshold above the similarity: no set, the exact rule's min(1, p/q) = 0.25
    strict = CascadeRule(source="drafter", breadth_threshold=0.999, depth_threshold=2.0)
    assert _acceptance_rate(strict, r, x, torch.tensor([0.8]), ctx) == pytest.approx(0.25, abs=1e-3)
    # the nucleus gate also gates breadth: p = .1 .2 .3 .4 -> token 1 is inside the 0.8 nucleus
    # (0.4 + 0.3 + 0.2 reaches it) but not inside the 0.5 one (0.4 + 0.3)
    inside = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=2.0, gate="nucleus", nucleus=0.8)
    assert inside.credit(r, x, ctx)[0].item() == pytest.approx(0.3)
    outside = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=2.0, gate="nucleus", nucleus=0.5)
    assert outside.credit(r, x, ctx)[0].item() == 0.0
    # the deepest level has no drafter prediction (zero q row): node 3 is in no set
    S = similarity_sets(tree.q, tree.depth, tree.q.sum(-1) > 0, 0.9)
    assert S.tolist() == [[False] * 4, [False, False, True, False], [False, True, False, False], [False] * 4]


def test_depth_credit_hand_computed():
    tree = _hand_tree()
    p = torch.full((4, 4), 0.25)
    p[0] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.zeros(4, 4)
    logits[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    logits[1] = torch.tensor([0.7, math.sqrt(1 - 0.49), 0.0, 0.0])  # cos(parent, x) = 0.7
    logits[2] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # cos = 0: no credit
    ctx = _ctx(tree, p, logits)
    x, r = torch.tensor([1]), p[:1]
    rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="none")
    A, _ = rule.credit(r, x, ctx)
    assert A.item() == pytest.approx(0.7, abs=1e-6)
    # q = 1 (deterministic draft): P = p / (1 - 0.7) = 2/3
    assert _acceptance_rate(rule, r, x, torch.ones(1), ctx) == pytest.approx(2 / 3, abs=1e-3)
    A2, _ = rule.credit(r, torch.tensor([2]), _ctx(tree, p, logits, child=2))
    assert A2.item() == 0.0
    # both terms: A = 0.7 + 0.3 >= q -> always accepted, even at u -> 1
    both = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=0.625, gate="none")
    assert _acceptance_rate(both, r, x, torch.ones(1), ctx) == 1.0
    # tau_d above the cosine: nothing
    off = CascadeRule(breadth_threshold=2.0, depth_threshold=0.75, gate="none")
    assert off.credit(r, x, ctx)[0].item() == 0.0


def test_gates_hand_computed():
    tree = _hand_tree()
    logits = torch.zeros(4, 4)
    logits[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    logits[1] = torch.tensor([0.9, math.sqrt(1 - 0.81), 0.0, 0.0])  # cos 0.9
    uncertain = torch.full((4, 4), 0.25)
    confident = uncertain.clone()
    confident[0] = torch.tensor([0.97, 0.01, 0.01, 0.01])
    x = torch.tensor([1])
    # KL(p || softmax(l/|l|)) against a direct evaluation
    lhat = logits[0] / logits[0].norm()
    for p in (uncertain, confident):
        want = (p[0] * (p[0].log() - torch.log_softmax(lhat, -1))).sum()
        assert kl_to_normalised_logits(p[:1], logits[:1]).item() == pytest.approx(want.item(), abs=1e-6)
    kl_u = kl_to_normalised_logits(uncertain[:1], logits[:1]).item()
    kl_c = kl_to_normalised_logits(confident[:1], logits[:1]).item()
    kappa = (kl_u + kl_c) / 2  # the uncertain parent passes, the confident one does not
    for gate, k in (("kl", kappa), ("entropy", math.log(4) - 1.0)):
        rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate=gate, kappa=k)
        assert rule.credit(uncertain[:1], x, _ctx(tree, uncertain, logits))[0].item() == pytest.approx(0.9, abs=1e-6)
        rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate=gate, kappa=k)
        assert rule.credit(confident[:1], x, _ctx(tree, confident, logits))[0].item() == 0.0
    # nucleus: p = .5 .3 .15 .05 -> the 80% nucleus is tokens {0, 1}; x = token 1 is inside, 2 is not
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    assert nucleus_floor(p[:1], 0.8).item() == pytest.approx(0.3)
    logits[2] = logits[1]
    rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="nucleus", nucleus=0.8)
    assert rule.credit(p[:1], x, _ctx(tree, p, logits))[0].item() == pytest.approx(0.9, abs=1e-6)
    rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="nucleus", nucleus=0.8)
    assert rule.credit(p[:1], torch.tensor([2]), _ctx(tree, p, logits, child=2))[0].item() == 0.0


def test_greedy_breadth_and_unrelaxed_residual():
    from vvs_engine.acceptance.verify import _greedy_ok

    tree = _hand_tree()
    onehot = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 4)  # the target's argmax is token 2
    ctx = _ctx(tree, onehot)
    rule = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=2.0, gate="kl")
    x = torch.tensor([1])
    _, moved = rule.accept(onehot[:1], x, torch.ones(1), torch.tensor([0.5]), ctx)
    assert _greedy_ok(rule, onehot[:1], x, moved).item()  # token 2 is interchangeable with x
    strict = CascadeRule(source="drafter", breadth_threshold=0.999, depth_threshold=2.0, gate="kl")
    _, moved = strict.accept(onehot[:1], x, torch.ones(1), torch.tensor([0.5]), ctx)
    assert not _greedy_ok(strict, onehot[:1], x, moved).item()
    # under the nucleus gate (the default) x must itself be in the target's nucleus: a one-hot target's
    # nucleus is its argmax alone, so greedy is the exact rule
    nucleus = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=2.0, gate="nucleus")
    _, moved = nucleus.accept(onehot[:1], x, torch.ones(1), torch.tensor([0.5]), ctx)
    assert not _greedy_ok(nucleus, onehot[:1], x, moved).item()
    # rejection keeps the credited tokens' mass: norm((r - q)+) exactly as EAGLE
    r = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.0, 0.5, 0.0, 0.5]])
    moved = torch.tensor([[False, False, True, False]])
    want = torch.tensor([[0.1, 0.0, 0.3, 0.0]]) / 0.4
    assert torch.allclose(rule.residual(r, q, x, moved), want)


# --- S(x) and the token sets against slow loops -----------------------------------------------------
def test_similarity_sets_against_slow_loop():
    g = torch.Generator().manual_seed(0)
    N, F_ = 40, 6
    base = torch.randn(5, F_, generator=g)  # clustered vectors so that sets are not all empty
    vec = base[torch.randint(0, 5, (N,), generator=g)] + 0.3 * torch.randn(N, F_, generator=g)
    depth = torch.randint(0, 4, (N,), generator=g)
    has = torch.rand(N, generator=g) > 0.2
    tokens = torch.randint(0, 9, (N,), generator=g)
    for tau in (-0.5, 0.5, 0.9, 0.99):
        S = similarity_sets(vec, depth, has, tau)
        for i in range(N):
            for j in range(N):
                c = torch.dot(vec[i], vec[j]) / (vec[i].norm() * vec[j].norm())
                want = i != j and bool(has[i]) and bool(has[j]) and depth[i] == depth[j] and c.item() > tau
                if abs(c.item() - tau) > 1e-5:  # leave float ties at the threshold alone
                    assert bool(S[i, j]) == want, (i, j, tau)
        assert S.any() or tau > 0.9
        rows = torch.arange(N)
        x = tokens[rows]
        mask = set_token_mask(S[rows], tokens, x, 9)
        for i in range(N):
            want = {int(tokens[j]) for j in range(N) if S[i, j]} - {int(tokens[i])}
            assert set(mask[i].nonzero()[:, 0].tolist()) == want


def test_redundancy_weights_against_slow_loop():
    g = torch.Generator().manual_seed(1)
    B, T, F_ = 3, 23, 5
    v = torch.randn(B, T, F_, generator=g)
    v[:, 10] = v[:, 3] + 0.01  # a guaranteed later match for position 3
    w = redundancy_weights(v, 0.625, 2.0)
    for b in range(B):
        for t in range(T):
            marked = any(torch.nn.functional.cosine_similarity(v[b, t], v[b, u], dim=0).item() > 0.625
                         for u in range(t + 1, T))
            assert w[b, t].item() == (2.0 if marked else 1.0)
    assert (w[:, 3] == 2.0).all()
    assert (w[:, T - 1] == 1.0).all()  # nothing comes after the last position
    # the train_drafter hook picks logits or hidden states
    feats, logits = torch.randn(B, T, 4, generator=g), v
    assert torch.equal(cascade_loss_weights("logits")(feats, logits), w)
    assert torch.equal(cascade_loss_weights("hidden", 0.5, 3.0)(feats, logits), redundancy_weights(feats, 0.5, 3.0))


def test_weighted_drafter_training_runs():
    from vvs_engine.training.drafter import train_cascade_drafter

    eng = tiny_engine(vocab=16, block=9, dtype=torch.float32, with_vq=False, dim=32, n_layer=1)
    tok = torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(0))
    d = train_cascade_drafter(eng.gpt, tok, torch.arange(8) % 5, steps=3, batch_size=4, log=None, progress=False)
    assert d.fc.weight.isfinite().all()


# --- options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(cascade_breadth_threshold="high"), dict(cascade_breadth_threshold=float("nan")),
    dict(cascade_depth_threshold=-2.0), dict(cascade_gate="maybe"), dict(cascade_source="oracle"),
    dict(cascade_kappa=-1.0), dict(cascade_kappa=float("inf")), dict(cascade_nucleus=0.0),
    dict(cascade_depth_source="attention"),
    dict(tree="dynamic", cascade_source="drafter"),  # the drafter source needs a static tree
    dict(cascade_bogus=1),
])
def test_bad_options_are_one_line_errors(eng, bad):
    with pytest.raises(VVSError) as e:
        eng.generate(class_labels=[0], method="cascade", decode_images=False, **bad)
    assert "\n" not in str(e.value)


def test_bad_rule_options_and_runtime_errors(eng):
    with pytest.raises(VVSError) as e:
        make_rule("cascade", eng, bogus=1)
    assert "\n" not in str(e.value)
    with pytest.raises(VVSError) as e:
        make_rule("cascade", eng, gate="x")
    assert "\n" not in str(e.value)
    # eagle's dynamic tree with the cascade rule and the drafter source: a clear error at verification
    with pytest.raises(VVSError) as e:
        eng.generate(class_labels=[0], method="eagle", accept="cascade", rule_options={"source": "drafter"},
                     decode_images=False)
    assert "\n" not in str(e.value) and "static" in str(e.value)
    from vvs_engine.training.cascade import check_weighting

    for args in (("attention", 0.6, 2.0), ("logits", 1.5, 2.0), ("logits", 0.6, 0.0)):
        with pytest.raises(VVSError) as e:
            check_weighting(*args)
        assert "\n" not in str(e.value)
