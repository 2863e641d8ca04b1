"""Reproduction modes against hand-computed cases of the authors' released code.

Each case uses a tiny vocabulary and explicit probabilities; the expected accept/reject decision
and residual are worked out in the comments (docs/reference_modes.md lists the differences).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from vvs_engine.acceptance.verify import LanternRule, check_lantern_reference
from vvs_engine.errors import VVSError

T = torch.tensor


def _nb(rows, V):
    return T([rows] * V)


# --- LANTERN --------------------------------------------------------------------------------------
P6 = T([[0.30, 0.05, 0.10, 0.15, 0.25, 0.15]])
NB6 = _nb([1, 2, 3, 4, 5], 6)  # x = 0's neighbours by distance: 1, 2, 3, 4, 5


def _reject(rule, p, x, qx, u, q=None):
    ok, moved = rule.accept(p, T([x]), T([qx]), T([u]), None)
    assert not ok.item()
    return rule.residual(p, q, T([x]), moved)


def test_dynamic_tree_rejection_removes_k_plus_1_neighbours():
    # k = 2, delta = 0.2: c_1 = 0.05, c_2 = 0.15 <= 0.2 -> m* = 2, p~(x) = 0.30 + 0.15 = 0.45.
    # u = 0.5, q(x) = 1 (deterministic draft): 0.5 < 0.45 fails -> reject.
    ref = LanternRule(NB6, 0.2, reference="llamagen", k=2)
    # released: zero x and its k + 1 = 3 nearest neighbours (1, 2, 3): left 0.25, 0.15 -> 0.625, 0.375
    res = _reject(ref, P6, 0, 1.0, 0.5)
    assert torch.allclose(res, T([[0, 0, 0, 0, 0.625, 0.375]]))
    # the Lumina-mGPT file does the same for dynamic trees
    assert torch.allclose(_reject(LanternRule(NB6, 0.2, reference="lumina-mgpt", k=2), P6, 0, 1.0, 0.5), res)
    # principled default: x and the m* = 2 credited neighbours go: 0.15, 0.25, 0.15 over 0.55
    res = _reject(LanternRule(NB6[:, :2], 0.2), P6, 0, 1.0, 0.5)
    assert torch.allclose(res, T([[0, 0, 0, 0.15, 0.25, 0.15]]) / 0.55)


def test_reference_removes_no_neighbour_when_no_prefix_fits():
    # delta = 0.01 < c_1 = 0.05 -> m* = 0, p~ = p(x) = 0.30; u = 0.5 rejects; only x is removed.
    res = _reject(LanternRule(NB6, 0.01, reference="llamagen", k=2), P6, 0, 1.0, 0.5)
    assert torch.allclose(res, T([[0, 0.05, 0.10, 0.15, 0.25, 0.15]]) / 0.70)


def test_empty_residual_is_uniform_over_the_vocabulary():
    # V = 4, p = (0.5, 0.2, 0.2, 0.1), x = 0, k = 2, delta = 0.5: c = 0.2, 0.4 -> m* = 2, p~ = 0.9.
    # u = 0.95 rejects; x and k + 1 = 3 neighbours removed -> nothing left -> uniform 1/4.
    p = T([[0.5, 0.2, 0.2, 0.1]])
    nb = _nb([1, 2, 3], 4)
    res = _reject(LanternRule(nb, 0.5, reference="llamagen", k=2), p, 0, 1.0, 0.95)
    assert torch.allclose(res, torch.full((1, 4), 0.25))
    # the principled residual keeps token 3 (x and the 2 credited neighbours removed)
    res = _reject(LanternRule(nb[:, :2], 0.5), p, 0, 1.0, 0.95)
    assert torch.allclose(res, T([[0, 0, 0, 1.0]]))


def test_static_tree_llamagen_zeroes_the_draft_lumina_zeroes_the_target():
    # q = drafter distribution at the parent (earlier siblings already removed, renormalised).
    q = T([[0.40, 0.10, 0.10, 0.05, 0.05, 0.30]])
    # k = 2, delta = 0.06: c_1 = 0.05 fits, c_2 = 0.15 does not -> m* = 1, p~ = 0.35.
    # q(x) = 0.40, u = 0.9: 0.36 < 0.35 fails -> reject. Neighbours removed: k + 1 = 3 -> 1, 2, 3.
    llama = _reject(LanternRule(NB6, 0.06, reference="llamagen", k=2), P6, 0, 0.40, 0.9, q)
    # LlamaGen: q' = (0.40, 0, 0, 0, 0.05, 0.30); p - q' = (-.10, .05, .10, .15, .20, -.15)
    # -> (0, .05, .10, .15, .20, 0) / 0.50: the neighbours keep their target mass
    assert torch.allclose(llama, T([[0, 0.1, 0.2, 0.3, 0.4, 0]]))
    lumina = _reject(LanternRule(NB6, 0.06, reference="lumina-mgpt", k=2), P6, 0, 0.40, 0.9, q)
    # Lumina-mGPT: p' = (0.30, 0, 0, 0, 0.25, 0.15); p' - q = (-.1, -.1, -.1, -.05, .20, -.15) -> token 4
    assert torch.allclose(lumina, T([[0, 0, 0, 0, 1.0, 0]]))
    # principled: p minus the credited neighbour 1 = (.30, 0, .10, .15, .25, .15); minus q ->
    # (0, 0, 0, .10, .20, 0) / 0.30
    ours = _reject(LanternRule(NB6[:, :2], 0.06), P6, 0, 0.40, 0.9, q)
    assert torch.allclose(ours, T([[0, 0, 0, 1 / 3, 2 / 3, 0]]))


def test_static_tree_empty_residual_is_uniform():
    # V = 4, p = (0.2, 0.3, 0.5, 0), x = 0, k = 1, delta = 0.35: c_1 = 0.3 -> m* = 1, p~ = 0.5.
    # q = (0.6, 0.1, 0.1, 0.2), q(x) = 0.6, u = 0.9: 0.54 < 0.5 fails -> reject; neighbours 1, 2.
    p, q = T([[0.2, 0.3, 0.5, 0.0]]), T([[0.6, 0.1, 0.1, 0.2]])
    nb = _nb([1, 2, 3], 4)
    # Lumina-mGPT: p' = (0.2, 0, 0, 0) <= q everywhere -> empty -> uniform
    lumina = _reject(LanternRule(nb, 0.35, reference="lumina-mgpt", k=1), p, 0, 0.6, 0.9, q)
    assert torch.allclose(lumina, torch.full((1, 4), 0.25))
    # LlamaGen: q' = (0.6, 0, 0, 0.2); p - q' -> (0, 0.3, 0.5, 0) / 0.8
    llama = _reject(LanternRule(nb, 0.35, reference="llamagen", k=1), p, 0, 0.6, 0.9, q)
    assert torch.allclose(llama, T([[0, 0.375, 0.625, 0]]))


def test_greedy_reference_credits_c_m_star_not_c_k():
    # softmax(logits) = (0.30, 0.04, 0.10, 0.20, 0.36); x = 0, neighbours 1, 2, 3 (k = 3).
    g = T([[0.30, 0.04, 0.10, 0.20, 0.36]])
    ctx = SimpleNamespace(logits=g.log(), parent=T([0]))
    nb = _nb([1, 2, 3, 4], 5)
    x = T([0])
    # delta = 0.1: c = 0.04, 0.14, 0.34 -> m* = 1, p~ = 0.34 < p(4) = 0.36: argmax is 4 -> reject.
    # (Crediting all k neighbours, p(x) + c_k = 0.64, would accept.)
    assert not LanternRule(nb, 0.1, reference="llamagen", k=3).greedy_accept(g, x, ctx).item()
    # delta = 0.2: m* = 2, p~ = 0.44 > 0.36 -> accept.
    assert LanternRule(nb, 0.2, reference="llamagen", k=3).greedy_accept(g, x, ctx).item()
    # LANTERN++ lambda = 2: c_m <= (2 - 1) * 0.30 -> m* = 2 (0.14), p~ = 0.44 -> accept
    assert LanternRule(nb, 2.0, ratio=True, reference="llamagen", k=3).greedy_accept(g, x, ctx).item()
    # greedy uses softmax of the logits, not the (one-hot) processed distribution handed in as r
    one_hot = T([[0.0, 0, 0, 0, 1.0]])
    assert LanternRule(nb, 0.2, reference="llamagen", k=3).greedy_accept(one_hot, x, ctx).item()


def test_lantern_reference_option_values():
    assert check_lantern_reference(None) == "off" and check_lantern_reference(False) == "off"
    assert check_lantern_reference("lumina-mgpt") == "lumina-mgpt"
    with pytest.raises(VVSError, match="llamagen"):
        check_lantern_reference(True)


# --- GSD: the released window at the lowest ranks --------------------------------------------------
def test_gsd_window_edge_released_code_falls_back_to_sjd():
    from vvs_engine.acceptance.gsd import GroupedRule

    # V = 6, p sorted descending: tokens 0..5 with p = .30 .25 .20 .12 .08 .05; G = 4 (G//2 = 2 ranks
    # below x, 1 above); prob threshold 1 and no distance filter, so every existing candidate counts.
    p = T([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05]])
    q = T([[0.02, 0.02, 0.02, 0.02, 0.02, 0.90]])
    ctx = SimpleNamespace(draft_q=q)
    x, qx = T([4]), T([0.02])
    # x = token 4 (rank 4): the 2 ranks below are 5 and 6; rank 6 does not exist.
    # shorten: C = {3, 4, 5}: sum p = .25, sum q = .94 -> accept iff u < .266
    short = GroupedRule(4, 1.0, math.inf)
    assert short.cluster(p, x).tolist() == [[3, 4, 5, -1]]
    assert short.accept(p, x, qx, T([0.26]), ctx)[0].item()
    assert not short.accept(p, x, qx, T([0.27]), ctx)[0].item()
    # released (ascending sort, slice [a-2 : a+2] with a = 1 -> start -1 -> empty -> SJD ratio):
    # C = {4}: p(x)/q(x) = .08/.02 = 4 -> always accepted
    sjd = GroupedRule(4, 1.0, math.inf, window_edge="sjd")
    assert sjd.cluster(p, x).tolist() == [[-1, 4, -1, -1]]
    assert sjd.accept(p, x, qx, T([0.99]), ctx)[0].item()
    # x = token 3 (rank 3): ranks 4 and 5 exist -> both settings take the full window {2, 3, 4, 5}
    x3 = T([3])
    assert sjd.cluster(p, x3).tolist() == short.cluster(p, x3).tolist() == [[2, 3, 4, 5]]
    with pytest.raises(VVSError, match="window-edge"):
        GroupedRule(4, 1.0, math.inf, window_edge="clip")


# --- CASCADE ----------------------------------------------------------------------------------------
def _tree(q=None, draft_logits=None):
    """root 0 (token 0) -> nodes 1, 2 (tokens 1, 2) at depth 1; node 1 -> node 3 (token 3). V = 4."""
    from vvs_engine.drafting.tree import DraftTree, tree_structure

    parents = T([-1, 0, 0, 1])
    # one tree seen unbatched, as a rule sees the flattened forest
    mask, depth, paths, leaf, children = (t[0] for t in tree_structure(parents[None], 2, 2))
    return DraftTree(T([0, 1, 2, 3]), parents, mask, depth, paths, leaf, children, q=q, draft_logits=draft_logits)


def _cctx(tree, p, logits=None, hidden=None, child=1, parent=0):
    from vvs_engine.acceptance.verify import VerifyContext

    return VerifyContext(tree, T([parent]), T([child]), T([True]), p, logits, hidden)


def test_cascade_llamagen_breadth_uses_masked_drafter_logits():
    from vvs_engine.acceptance.cascade import CascadeRule

    # Drafter predictions after nodes 1 and 2: logits z and 5z on the kept entries; entry 3 was
    # removed by the drafter's top-k (q = 0 there) and has a very different raw logit at node 2.
    q = torch.zeros(4, 4)
    q[1] = torch.softmax(T([1.0, 0.0, 0.0, -1e9]), 0)
    q[2] = torch.softmax(T([5.0, 0.0, 0.0, -1e9]), 0)
    lg = torch.zeros(4, 4)
    lg[1] = T([1.0, 0.0, 0.0, -7.0])
    lg[2] = T([5.0, 0.0, 0.0, 40.0])
    tree = _tree(q, lg)
    p = T([[0.1, 0.2, 0.3, 0.4]] * 4)
    # masked logits (1, 0, 0, 0) and (5, 0, 0, 0): cos = 1 > 0.9 -> S(node 1) = {node 2}, credit p(2) = 0.3
    llama = CascadeRule(source="drafter-logits", breadth_threshold=0.9, depth_threshold=2.0, gate="kl")
    A, moved = llama.credit(p[:1], T([1]), _cctx(tree, p))
    assert A.item() == pytest.approx(0.3) and moved.tolist() == [[False, False, True, False]]
    # softmax source: softmax(1,0,0) = (e, 1, 1)/(e+2), softmax(5,0,0) = (e^5, 1, 1)/(e^5+2):
    # cos = (e^6 + 2) / sqrt((e^2 + 2)(e^10 + 2)) = 405.4 / 454.8 = 0.891 < 0.9 -> no set, no credit
    want_cos = (math.e ** 6 + 2) / math.sqrt((math.e ** 2 + 2) * (math.e ** 10 + 2))
    assert want_cos == pytest.approx(0.891, abs=1e-3)
    soft = CascadeRule(source="drafter", breadth_threshold=0.9, depth_threshold=2.0, gate="kl")
    assert soft.credit(p[:1], T([1]), _cctx(tree, p))[0].item() == 0.0
    # ... and above 0.85 the softmax source finds it
    soft = CascadeRule(source="drafter", breadth_threshold=0.85, depth_threshold=2.0, gate="kl")
    assert soft.credit(p[:1], T([1]), _cctx(tree, p))[0].item() == pytest.approx(0.3)
    # unmasked logits (1, 0, 0, -7) vs (5, 0, 0, 40) would have cos = (5 - 280) / (7.07 * 40.3) < 0


def test_cascade_gate_on_the_sibling_updated_residual():
    from vvs_engine.acceptance.cascade import CascadeRule

    tree = _tree()
    logits = torch.zeros(4, 4)
    logits[0] = T([1.0, 0.0, 0.0, 0.0])
    logits[1] = T([0.9, math.sqrt(1 - 0.81), 0.0, 0.0])  # cos(parent, node 1) = 0.9 > 0.625
    confident = torch.full((4, 4), 0.25)
    confident[0] = T([0.97, 0.01, 0.01, 0.01])  # the unrelaxed target at the parent
    residual = torch.full((1, 4), 0.25)  # after earlier siblings were rejected: flat
    # KL(p || softmax(l/|l|)) with l/|l| = (1, 0, 0, 0), log-softmax = (1 - L, -L, -L, -L), L = log(e + 3):
    #   flat residual: log .25 - (1 - 4L)/4 = 0.107;  confident: sum p log p + L - 0.97 = 0.606.
    # kappa = 0.3: the residual passes, the unrelaxed parent distribution does not.
    ctx = _cctx(tree, confident, logits)
    x = T([1])
    by_parent = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="kl", kappa=0.3)
    assert by_parent.credit(residual, x, ctx)[0].item() == 0.0
    by_residual = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="kl", kappa=0.3,
                              gate_input="residual")
    assert by_residual.credit(residual, x, ctx)[0].item() == pytest.approx(0.9, abs=1e-6)
    # tested against the unrelaxed distribution itself, the residual gate agrees with the parent gate
    assert by_residual.credit(confident[:1], x, ctx)[0].item() == 0.0
    # nucleus on the residual: r = (.1, .6, .2, .1): the 0.8 nucleus is {1, 2}; x = token 1 is inside
    # it, while under the confident parent distribution (0.97 alone) it is not.
    r = T([[0.1, 0.6, 0.2, 0.1]])
    nuc = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="nucleus", gate_input="residual")
    assert nuc.credit(r, x, ctx)[0].item() == pytest.approx(0.9, abs=1e-6)
    nuc_parent = CascadeRule(breadth_threshold=2.0, depth_threshold=0.625, gate="nucleus")
    assert nuc_parent.credit(r, x, ctx)[0].item() == 0.0


def test_cascade_lumina_final_depth_compares_grandparent_and_parent():
    from vvs_engine.acceptance.cascade import CascadeRule

    tree = _tree()
    p = T([[0.25] * 4] * 4)
    hidden = torch.zeros(1, 4, 2)  # [rows, N, D]; node 0 (root) h = (0, 0): softmax (.5, .5)
    hidden[0, 1] = T([0.1, 0.0])  # softmax (.52498, .47502)
    hidden[0, 3] = T([-5.0, 5.0])  # node 3's own state plays no part
    # node 3 (depth 2): cos(softmax h_root, softmax h_1) = .5 / (.70711 * .70799) = 0.99875 > 0.9
    rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.9, gate="none", depth_source="hidden",
                       depth_mode="grandparent-parent")
    A, _ = rule.credit(p[:1], T([3]), _cctx(tree, p, hidden=hidden, child=3, parent=1))
    assert A.item() == pytest.approx(0.99875, abs=1e-5)
    # node 1 (depth 1) has no grandparent: no depth term, whatever the states
    rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.9, gate="none", depth_source="hidden",
                       depth_mode="grandparent-parent")
    assert rule.credit(p[:1], T([1]), _cctx(tree, p, hidden=hidden, child=1))[0].item() == 0.0
    # the parent-child mode compares h_1 and h_3: cos((.1, 0), (-5, 5)) = -0.707 -> nothing
    pc = CascadeRule(breadth_threshold=2.0, depth_threshold=0.9, gate="none", depth_source="hidden")
    assert pc.credit(p[:1], T([3]), _cctx(tree, p, hidden=hidden, child=3, parent=1))[0].item() == 0.0
    # h_1 = (2, 0): softmax (.8808, .1192); cos with (.5, .5) = .5 / (.70711 * .88883) = 0.7955 < 0.9
    hidden[0, 1] = T([2.0, 0.0])
    rule = CascadeRule(breadth_threshold=2.0, depth_threshold=0.9, gate="none", depth_source="hidden",
                       depth_mode="grandparent-parent")
    assert rule.credit(p[:1], T([3]), _cctx(tree, p, hidden=hidden, child=3, parent=1))[0].item() == 0.0


def test_cascade_variant_presets():
    from vvs_engine.acceptance.cascade import DEFAULTS, make_cascade_rule
    from vvs_engine.methods.cascade import CascadeOptions

    llama = make_cascade_rule(variant="llamagen")
    assert (llama.source, llama.gate, llama.gate_input, llama.depth_mode, llama.tau_b, llama.tau_d, llama.kappa) == \
        ("drafter-logits", "kl", "residual", "parent-child", 0.9, 0.625, 4.0)
    lum = make_cascade_rule(variant="lumina-final")
    assert (lum.source, lum.gate, lum.gate_input, lum.depth_mode, lum.depth_source, lum.tau_b, lum.tau_d,
            lum.nucleus) == ("drafter", "nucleus", "residual", "grandparent-parent", "hidden", 0.5, 0.9, 0.8)
    assert CascadeOptions().rule_kwargs() == DEFAULTS
    o = CascadeOptions(cascade_variant="lumina-final", cascade_breadth_threshold=0.7)
    kw = o.rule_kwargs()
    assert kw["breadth_threshold"] == 0.7 and kw["depth_mode"] == "grandparent-parent"  # explicit option wins
    with pytest.raises(VVSError, match="cascade-variant"):
        CascadeOptions(cascade_variant="anole").validate()
    with pytest.raises(VVSError, match="static tree"):
        CascadeOptions(cascade_variant="llamagen", tree="dynamic").validate()


# --- whole runs: a reference mode whose relaxation cannot fire is the exact method ------------------
@pytest.fixture(scope="module")
def eng():
    from spec_models import tiny_engine

    return tiny_engine(vocab=64, block=36, peak=8.0)


@pytest.mark.parametrize("family", ["llamagen", "lumina-mgpt"])
@pytest.mark.parametrize("method", ["lantern", "lantern++"])
def test_lantern_reference_with_nothing_to_credit_is_exact(eng, family, method):
    # delta = 0 (lambda = 1): only a neighbour with target probability exactly 0 fits a prefix. Greedy
    # (any tree) and sampled chains (no sibling is rejected, so no entry of the residual is zeroed
    # before the next test) then never credit anything and the released residual is the exact one.
    # With siblings the released code does act at delta = 0: a rejected sibling's zeroed entry makes
    # c_1 = 0 for a later sibling whose nearest neighbour it is, and k + 1 neighbours are removed.
    bound = dict(lantern_delta=0.0) if method == "lantern" else dict(lantern_lambda=1.0)
    for temperature, seed, tree in ((0.0, 0, {}), (1.0, 4, dict(tree="chain", tree_depth=3))):
        kw = dict(class_labels=[0, 3], temperature=temperature, cfg_scale=3.0, seed=seed, decode_images=False, **tree)
        exact = eng.generate(method="eagle", **({"tree": "static"} if method == "lantern++" and not tree else {}),
                             **kw).tokens
        ref = eng.generate(method=method, lantern_reference_residual=family, **bound, **kw).tokens
        assert torch.equal(exact, ref)


@pytest.mark.parametrize("variant", ["llamagen", "lumina-final"])
def test_cascade_variants_run_and_never_firing_is_exact(eng, variant):
    kw = dict(class_labels=[1, 4], temperature=1.0, cfg_scale=3.0, seed=9, decode_images=False)
    exact = eng.generate(method="eagle", tree="static", **kw)
    off = eng.generate(method="cascade", cascade_variant=variant, cascade_breadth_threshold=1.5,
                       cascade_depth_threshold=1.01, **kw)
    assert torch.equal(exact.tokens, off.tokens)
    on = eng.generate(method="cascade", cascade_variant=variant, cascade_gate="none", **kw)
    assert on.stats["tpf"] > exact.stats["tpf"]


def test_lantern_reference_under_vvs_post_verify_reject(eng):
    # VVS's rollback asks the rule for a residual without a credit mask; the reference mode must cope.
    kw = dict(class_labels=[2], temperature=1.0, cfg_scale=3.0, seed=6, decode_images=False)
    out = eng.generate(method="vvs", skip_interval=2, post_verify="reject", lantern_reference_residual="llamagen",
                       **kw)
    assert out.tokens.shape == (1, eng.tokens_per_image) and out.stats["post_verify_rollbacks"] > 0


def test_gsd_window_edge_option_reaches_the_rule(eng):
    from vvs_engine.methods.jacobi import GSDOptions

    assert GSDOptions(gsd_window_edge="sjd").validate().rule(eng).window_edge == "sjd"
    with pytest.raises(VVSError, match="window-edge"):
        GSDOptions(gsd_window_edge="wrap").validate()
    kw = dict(class_labels=[1], temperature=1.0, cfg_scale=3.0, seed=2, decode_images=False)
    out = eng.generate(method="eagle", accept="gsd", gsd_window_edge="sjd", gsd_dist_threshold=math.inf, **kw)
    assert out.tokens.shape == (1, eng.tokens_per_image)
    with pytest.raises(VVSError, match="--accept gsd"):
        eng.generate(method="eagle", gsd_window_edge="sjd", **kw)


@pytest.mark.parametrize("over, match", [
    ({"--method": "lantern", "--lantern-reference-residual": "yes"}, "lantern-reference-residual must be one of"),
    ({"--method": "cascade", "--cascade-variant": "anole"}, "cascade-variant must be one of"),
    ({"--method": "cascade", "--cascade-gate-input": "child"}, "cascade-gate-input must be one of"),
    ({"--method": "gsd", "--gsd-window-edge": "wrap"}, "gsd-window-edge must be"),
])
def test_cli_one_line_errors(ckpts, tmp_path, capsys, over, match):
    from test_cli import contract_argv, run_error

    run_error(capsys, contract_argv(ckpts, tmp_path / "out", **over), match=match)


