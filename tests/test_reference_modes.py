"""Reproduction modes against hand-computed cases of the authors' released code.

Each case uses a tiny vocabulary and explicit probabilities; the expected accept/reject decision
and residual are worked out in the comments (docs/reference_modes.md lists the differences).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from vvs_engine.acceptance import LanternRule, check_lantern_reference
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
    from vvs_engine.gsd_rule import GroupedRule

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
