"""SJD and GSD: greedy SJD is greedy AR, sampled SJD is the target distribution, GSD with a group of
one is SJD, the vectorised GSD cluster matches a slow loop, bad options are one-line errors, and the
grouped rule runs inside the drafter-based methods."""
from __future__ import annotations

import math

import pytest
import torch

from spec_models import tiny_engine
from distribution_checks import _chi2, _chi2_crit
from vvs_engine.acceptance.verify import ExactRule, make_rule
from vvs_engine.errors import VVSError
from vvs_engine.acceptance.gsd import GroupedRule, _static_neighbors, rank_window_by_reductions, unit_codebook
from vvs_engine.methods import get_method, jacobi

LABELS = [0, 3, 4]


@pytest.fixture(scope="module")
def eng():
    return tiny_engine(vocab=64, block=36, peak=8.0)


@pytest.fixture(scope="module")
def greedy_ar(eng):
    return {cfg: eng.generate(class_labels=LABELS, temperature=0, cfg_scale=cfg, decode_images=False).tokens
            for cfg in (3.0, 1.0)}


# --- greedy SJD is greedy AR ------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [3.0, 1.0])
@pytest.mark.parametrize("window,init", [
    (1, "copy-left"),  # no drafts at all: plain AR through the Jacobi loop
    (2, "random"),
    (5, "argmax-left"),
    (16, "copy-left"),
    (16, "copy-above"),
    (36, "random"),  # as long as the image: positions past the last token are clamped
])
def test_greedy_sjd_equals_greedy_ar(eng, greedy_ar, cfg, window, init):
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=cfg, method="sjd", jacobi_window=window,
                       jacobi_init=init, decode_images=False)
    assert torch.equal(out.tokens, greedy_ar[cfg])
    st = out.stats
    assert st["target_forward_passes"] == st["jacobi_rounds"]
    if window == 1:
        assert st["target_forward_passes"] == len(LABELS) * (eng.tokens_per_image - 1)  # as AR counts
    else:
        assert st["tpf"] >= 1.0
    assert sum(st["accepted_drafts_histogram"]) == st["jacobi_rounds"]


def test_greedy_gsd_is_greedy_ar(eng, greedy_ar):
    """Greedy decoding accepts only the argmax, whatever the rule: GSD cannot change greedy output."""
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method="gsd", gsd_group=32,
                       gsd_dist_threshold=math.inf, decode_images=False)
    assert torch.equal(out.tokens, greedy_ar[3.0])


# --- sampled SJD reproduces the target distribution --------------------------------------------------
def _exact_joint3(eng, label, cfg):
    """Exact target probability of every sequence of the first three tokens (V = 4: 64 sequences)."""
    V = eng.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * 3)
    lg = eng.score(class_labels=[label] * len(seqs), tokens=seqs, cfg_scale=cfg)  # [64, 3, V]
    logp = torch.log_softmax(lg.double(), -1).gather(2, seqs[:, :, None])[:, :, 0].sum(1)
    return seqs, logp.exp()


def _pair_marginal(seqs, probs, a, b, V):
    pair = seqs[:, a] * V + seqs[:, b]
    marg = torch.zeros(V * V, dtype=probs.dtype).index_add_(0, pair, probs)
    return torch.cartesian_prod(torch.arange(V), torch.arange(V)), marg


def test_sampled_sjd_matches_target_distribution():
    """Chi-square goodness of fit on a V=4 model, window 2, random init, 1200 images decoded in batches
    of 64, for the pairs
    (token 0, token 1) and (token 1, token 2) against the exact marginals (16 cells each). Token 1 is
    always decided in the first round (fresh draft, q one-hot); token 2 is where carried Jacobi drafts
    (q = last round's p) are tested, so both kinds of q are covered.

    Power: the chi-square divergence is at least 4 TV^2, so a sampler at total variation >= 0.12 from
    the target has non-centrality >= 1200 * 0.0576 = 69, and a non-central chi-square(15, 69) exceeds
    the alpha = 1e-3 critical value (37.7) with probability > 0.99 (before merging sparse cells). Two
    negative controls must fail: accepting every draft (no verification), and the subtle bug of
    testing carried drafts as if their q were one-hot, on 4000 images: its statistic grows with n (53 at
    1200 images, 128 at 4000, against a critical value of about 30; it was 24 at 1200 with another
    random stream, so 1200 alone is not a safe margin)."""
    eng = tiny_engine(vocab=4, block=4, seed=1, peak=25.0, with_vq=False)
    V = 4
    seqs, probs = _exact_joint3(eng, 1, 2.0)
    n = 1200
    kw = dict(class_labels=[1] * n, temperature=1.0, cfg_scale=2.0, method="sjd", seed=5, jacobi_window=2,
              jacobi_init="random", decode_images=False, batch_size=64)
    out = eng.generate(**kw)
    assert out.stats["accepted_drafts_carried"] > 100 and out.stats["accepted_drafts_fresh"] > 100
    for a, b in ((0, 1), (1, 2)):
        cells, marg = _pair_marginal(seqs, probs, a, b, V)
        stat, dof = _chi2(out.tokens[:, [a, b]], cells, marg)
        assert stat < _chi2_crit(dof), ((a, b), stat, dof)
    original = ExactRule.accept
    try:
        ExactRule.accept = lambda self, r, x, qx, u, ctx: (torch.ones_like(x, dtype=torch.bool), None)
        bad = eng.generate(**dict(kw, class_labels=[1] * 400))  # fails by far; fewer samples suffice
        bad_tokens = torch.cat([bad.tokens] * 3)  # compare at the same n (counts scaled by 3)
    finally:
        ExactRule.accept = original
    cells, marg = _pair_marginal(seqs, probs, 1, 2, V)
    stat_bad, dof = _chi2(bad_tokens[:, [1, 2]], cells, marg)
    assert stat_bad > _chi2_crit(dof), (stat_bad, dof)
    # A subtle bug is caught too: testing carried drafts as if q were one-hot (u < p(x), not p/q).
    try:
        ExactRule.accept = lambda self, r, x, qx, u, ctx: (u < r.gather(1, x[:, None])[:, 0], None)
        bad = eng.generate(**dict(kw, class_labels=[1] * 4000))
    finally:
        ExactRule.accept = original
    stat_bad, dof = _chi2(bad.tokens[:, [1, 2]], cells, marg)
    assert stat_bad > _chi2_crit(dof), (stat_bad, dof)


# --- GSD ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"gsd_dist_threshold": math.inf}, {"gsd_static_clusters": True},
                                   {"jacobi_init": "random", "jacobi_window": 6}])
def test_gsd_group_of_one_is_sjd(eng, extra):
    kw = dict(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=7, decode_images=False)
    sjd_opts = {k: v for k, v in extra.items() if k.startswith("jacobi")}
    a = eng.generate(method="sjd", **sjd_opts, **kw)
    b = eng.generate(method="gsd", gsd_group=1, **extra, **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert a.stats["target_forward_passes"] == b.stats["target_forward_passes"]


def test_gsd_accepts_more_than_sjd(eng):
    kw = dict(class_labels=LABELS * 2, temperature=1.0, cfg_scale=3.0, seed=3, decode_images=False)
    sjd = eng.generate(method="sjd", **kw).stats
    gsd = eng.generate(method="gsd", gsd_group=16, gsd_dist_threshold=math.inf, **kw).stats
    assert gsd["mean_accepted_length"] > sjd["mean_accepted_length"]
    assert gsd["target_forward_passes"] < sjd["target_forward_passes"]


def _slow_cluster(p, x, G, prob_thr, dist_thr, cb):
    """Per position: sort the vocabulary by p (descending, ties by token id), take G//2 less likely
    tokens, x and G-1-G//2 more likely ones, then filter."""
    out = []
    for m in range(p.shape[0]):
        pm = p[m].tolist()
        order = sorted(range(len(pm)), key=lambda j: -pm[j])
        r = order.index(int(x[m]))
        members = set()
        for rr in range(r - (G - 1 - G // 2), r + G // 2 + 1):
            if not 0 <= rr < len(order):
                continue
            j = order[rr]
            d2 = float(((cb[j] - cb[x[m]]) ** 2).sum()) if cb is not None else 0.0
            if j == int(x[m]) or (abs(pm[j] - pm[int(x[m])]) < prob_thr and d2 < dist_thr):
                members.add(j)
        out.append(members)
    return out


@pytest.mark.parametrize("G", [1, 2, 5, 14, 64])
@pytest.mark.parametrize("prob_thr,dist_thr", [(0.15, 1.0), (1.0, math.inf), (0.02, 2.0), (0.0, 0.5)])
def test_vectorised_cluster_matches_slow_loop(eng, G, prob_thr, dist_thr):
    g = torch.Generator().manual_seed(G)
    M, V = 24, eng.config.vocab_size
    p = torch.softmax(torch.randn(M, V, generator=g) * 2, -1)
    p[:8, 40:] = 0.0  # ties (top-k filtered tokens): stable order by token id
    p[:8] /= p[:8].sum(-1, keepdim=True)
    x = torch.randint(0, V, (M,), generator=g)
    x[0], x[1] = int(p[0].argmax()), int(p[1].argmin())  # edges of the ranking
    cb = unit_codebook(eng, V) if dist_thr != math.inf else None
    rule = GroupedRule(G, prob_thr, dist_thr, cb)
    got = rule.cluster(p, x)
    want = _slow_cluster(p, x, G, prob_thr, dist_thr, cb)
    for m in range(M):
        row = [int(t) for t in got[m] if t >= 0]
        assert len(row) == len(set(row)) and set(row) == want[m], m


@pytest.mark.parametrize("G", [1, 3, 8, 14])
def test_rank_window_without_a_sort_picks_the_sorts_tokens(G):
    """The compiled rank window (reductions, no argsort) gives the argsort's tokens at every existing
    rank, ties ordered by id, for drafts anywhere in the order (the ends included), on rows with many
    equal values (zeros of a top-k filter, coarsely quantised masses). Negative control: ordering ties
    the other way changes the picks."""
    torch.manual_seed(G)
    V = 23
    p = torch.rand(12, V)
    p[:4] = (p[:4] * 4).floor() / 4  # a few distinct values, many ties
    p[4:8] = torch.where(torch.rand(4, V) < 0.6, 0.0, p[4:8])  # zeros
    p = p / p.sum(1, keepdim=True)
    rule = GroupedRule(group=G, prob_threshold=math.inf, dist_threshold=math.inf)
    xs = torch.cat([torch.arange(V), torch.randint(0, V, (12 * 3 - V,))])[: 12 * 3].view(3, 12)
    xs[0, :2] = p.argmax(1)[:2]  # the most likely token: nothing above it
    xs[1, :2] = p.argmin(1)[:2]
    edges = 0
    for x in xs:
        want_cand, want_inside = rule._rank_window(p, x)
        got_cand, got_inside = rank_window_by_reductions(p, x, G)
        assert torch.equal(got_inside, want_inside)
        assert torch.equal(got_cand[got_inside], want_cand[want_inside])
        edges += int((~want_inside).sum())
    assert edges > 0 or G == 1  # windows cut by the ends of the order were compared
    # the ties' order matters: reverse the ids and the picks differ somewhere
    flipped = p.flip(1)
    x = xs[2]
    if G > 1:
        got = rank_window_by_reductions(flipped, V - 1 - x, G)[0]
        assert not torch.equal(V - 1 - got, rule._rank_window(p, x)[0])


def test_static_clusters_match_slow_loop(eng):
    V = eng.config.vocab_size
    cb = unit_codebook(eng, V)
    G, d = 6, 1.0
    rule = GroupedRule(G, 0.15, d, cb, _static_neighbors(cb, G - 1))
    x = torch.arange(V)
    got = rule.cluster(torch.full((V, V), 1.0 / V), x)
    for t in range(V):
        dist = ((cb - cb[t]) ** 2).sum(-1)
        dist[t] = math.inf
        near = dist.argsort()[: G - 1].tolist()
        want = {t} | {j for j in near if dist[j] < d}
        assert {int(j) for j in got[t] if j >= 0} == want


def test_grouped_ratio_hand_computed():
    # ranks under p: 3 (0.4), 0 (0.3), 2 (0.2), 1 (0.1); x = 0 (rank 1); G = 3 -> {3, 0, 2}
    p = torch.tensor([[0.3, 0.1, 0.2, 0.4]])
    q = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    x = torch.tensor([0])
    rule = GroupedRule(3, 1.0, math.inf)
    assert sorted(int(t) for t in rule.cluster(p, x)[0] if t >= 0) == [0, 2, 3]
    ctx = jacobi.JacobiContext(draft_q=q)
    # sum_C p = 0.9, sum_C q = 1.0 -> accept iff u < 0.9 (SJD: u < 0.3 / 0.5 = 0.6)
    ok, moved = rule.accept(p, x, q[:, 0], torch.tensor([0.89]), ctx)
    assert ok.item() and moved is None
    ok, _ = rule.accept(p, x, q[:, 0], torch.tensor([0.91]), ctx)
    assert not ok.item()
    # probability filter: |p(j) - 0.3| < 0.15 keeps 3 (0.4) and 2 (0.2) but not 1
    rule = GroupedRule(4, 0.15, math.inf)
    assert sorted(int(t) for t in rule.cluster(p, x)[0] if t >= 0) == [0, 2, 3]


def test_one_hot_drafts_grouped_accepts_superset_of_exact():
    """With a deterministic draft (q one-hot) the grouped mass contains p(x): GSD accepts whenever
    the exact rule does."""
    g = torch.Generator().manual_seed(0)
    M, V = 200, 32
    p = torch.softmax(torch.randn(M, V, generator=g), -1)
    x = torch.randint(0, V, (M,), generator=g)
    u = torch.rand(M, generator=g)
    ones = torch.ones(M)
    exact, _ = ExactRule().accept(p, x, ones, u, None)
    grouped, _ = GroupedRule(8, 0.15, math.inf).accept(p, x, ones, u, None)
    assert bool((grouped | ~exact).all()) and int(grouped.sum()) > int(exact.sum())


# --- options: one-line errors, the engine keeps working ---------------------------------------------
@pytest.mark.parametrize("method,opts", [
    ("sjd", {"jacobi_window": 0}),
    ("sjd", {"jacobi_window": -3}),
    ("sjd", {"jacobi_window": 2.5}),
    ("sjd", {"jacobi_window": True}),
    ("sjd", {"jacobi_window": 10**6}),
    ("sjd", {"jacobi_init": "vertical"}),
    ("sjd", {"gsd_group": 4}),  # GSD options are not SJD options
    ("gsd", {"gsd_group": 0}),
    ("gsd", {"gsd_group": 65}),  # larger than the vocabulary
    ("gsd", {"gsd_group": "14"}),
    ("gsd", {"gsd_prob_threshold": -0.1}),
    ("gsd", {"gsd_prob_threshold": float("nan")}),
    ("gsd", {"gsd_prob_threshold": 1.5}),
    ("gsd", {"gsd_dist_threshold": -1.0}),
    ("gsd", {"gsd_dist_threshold": float("nan")}),
    ("gsd", {"gsd_static_clusters": "yes"}),
    ("eagle", {"accept": "gsd", "rule_options": {"gsd_group": 0}}),
    ("eagle", {"accept": "gsd", "rule_options": {"group": 3}}),
])
def test_bad_options_are_one_line_errors(eng, greedy_ar, method, opts):
    with pytest.raises(VVSError) as e:
        eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    assert "\n" not in str(e.value) and str(e.value)
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method="sjd", decode_images=False)
    assert torch.equal(out.tokens, greedy_ar[3.0])


def test_gsd_without_tokenizer():
    e = tiny_engine(vocab=16, block=9, with_vq=False)
    with pytest.raises(VVSError, match="tokenizer"):
        e.generate(class_labels=[1], method="gsd", decode_images=False)
    e.generate(class_labels=[1], method="gsd", gsd_dist_threshold=math.inf, decode_images=False)  # no codebook needed


def test_cli_option_names_reach_the_methods(eng):
    from vvs_engine.cli import build_parser, method_options

    names = set(method_options(build_parser().parse_args(["generate"])))
    given = {"jacobi_window": 8, "jacobi_init": "random", "gsd_group": 5, "gsd_prob_threshold": 0.2,
             "gsd_dist_threshold": 1.5}
    assert set(given) <= names
    _, o = get_method("gsd", eng, given)
    assert (o.jacobi_window, o.jacobi_init, o.gsd_group, o.gsd_prob_threshold, o.gsd_dist_threshold) == \
        (8, "random", 5, 0.2, 1.5)
    _, o = get_method("sjd", eng, {"jacobi_window": 8, "jacobi_init": "argmax-left"})
    assert o.jacobi_window == 8


# --- the grouped rule inside the drafter-based methods ----------------------------------------------
@pytest.mark.parametrize("tree", ["dynamic", "static"])  # deterministic drafts / drafts sampled from q
def test_accept_gsd_group_of_one_is_exact_in_eagle(eng, tree):
    kw = dict(class_labels=LABELS[:2], temperature=1.0, cfg_scale=3.0, seed=4, decode_images=False, tree=tree)
    a = eng.generate(method="eagle", **kw)
    b = eng.generate(method="eagle", accept="gsd", rule_options={"gsd_group": 1}, **kw)
    assert torch.equal(a.tokens, b.tokens)


def test_tree_draft_distribution_drops_rejected_siblings():
    """Sampled trees: the q the grouped rule sums over is the parent's draft distribution without the
    siblings already rejected this round, renormalised (what verify_tree divides by)."""
    from types import SimpleNamespace

    from vvs_engine.acceptance.gsd import _draft_distribution

    V = 10
    q0 = torch.softmax(torch.arange(V, dtype=torch.float32), 0)
    tree = SimpleNamespace(sampled=True, q=torch.stack([q0, q0, q0, q0]), tokens=torch.tensor([0, 5, 7, 9]),
                           children=torch.tensor([[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]))
    ctx = SimpleNamespace(tree=tree, parent=torch.tensor([0]), child=torch.tensor([3]))
    x = torch.tensor([9])
    want = q0.clone()
    want[[5, 7]] = 0
    want /= want.sum()
    got = _draft_distribution(None, x, want[9:10], ctx)
    assert torch.allclose(got[0], want)


@pytest.mark.parametrize("method,opts", [
    ("eagle", {}),
    ("eagle", {"tree": "static"}),  # sampled drafts: the rule uses the tree's q over the cluster
    ("vvs", {}),
    ("vvs", {"post_verify": "reject"}),
])
def test_accept_gsd_runs_in_drafter_methods(eng, method, opts):
    out = eng.generate(class_labels=LABELS[:1], temperature=1.0, cfg_scale=3.0, seed=2, method=method, accept="gsd",
                       rule_options={"gsd_group": 8}, decode_images=False, **opts)
    assert out.tokens.shape == (1, eng.tokens_per_image)
    assert out.stats["tpf"] >= 1.0
    assert make_rule("gsd", eng).name == "gsd"


def test_benchmark_rows(eng):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "studies", "spec_zoo",
                        "jacobi_zoo.py")
    spec = importlib.util.spec_from_file_location("jacobi_zoo", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run_jacobi_rows(eng, [0], 0, settings=[("sjd", {}), ("gsd", {"gsd_group": 4})], include_ar=True,
                                 temperature=1.0, cfg_scale=3.0)
    assert [r["method"] for r in rows] == ["ar", "sjd", "gsd"]
    for r in rows:
        assert r["tpf"] >= 1.0 and r["mean_accepted_length"] >= 1.0 and r["wall_s"] > 0 and "wall_ratio_vs_ar" in r


def test_one_pass_draw_and_masked_gather_are_the_same_numbers():
    """The Jacobi rounds' fusable forms (docs/launches.md) are the same arithmetic as the plain ones:
    the inverse-CDF draw with the total read as the cdf's maximum, p(x) as a masked sum."""
    from vvs_engine.rng import sample_inverse_cdf, sample_inverse_cdf_one_pass
    from vvs_engine.sampling import value_at

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        p = torch.rand(6, 5, 97, generator=g, dtype=dtype) ** 4
        p[0, 0] = 0.0  # an all-zero row
        p[1, :, 40:] = 0.0  # zero tails (top-k / forced tokens)
        p[2] = torch.softmax(torch.randn(5, 97, generator=g, dtype=dtype) * 30, -1)  # underflow to 0
        u = torch.rand(6, 5, generator=g)
        u[3, 0] = 1.0
        assert torch.equal(sample_inverse_cdf_one_pass(p, u), sample_inverse_cdf(p, u))
        x = torch.randint(0, 97, (6, 5), generator=g)
        assert torch.equal(value_at(p, x), p.gather(-1, x[..., None])[..., 0])
