"""The fused end of the dynamic-tree build (selection + tree structure; Triton under the interpreter on
the CPU) against the torch reference, and the reference against the code it replaced in
DraftSession._dynamic; the custom op's fake has the real shapes and strides."""
from types import SimpleNamespace

import pytest
import torch

from vvs_engine.drafting.session import DraftSession, TreeSpec
from vvs_engine.drafting.tree import tree_structure
from vvs_engine.kernels import ops
from vvs_engine.kernels import reference as R

NAMES = ("tokens", "parents", "mask", "depth", "paths", "is_leaf", "children", "logp")


def _tables(B, K, depth):
    """The engine's constant tables (penalty, frontier offsets, parent columns) for this tree shape."""
    stub = SimpleNamespace(spec=TreeSpec(topk=K, depth=depth), device=torch.device("cpu"), batch=B, rows=B)
    return DraftSession._dynamic_tables(stub)


def _levels(B, K, depth, seed=0, dtype=torch.float32):
    """Per-level pieces as the build makes them: the root's K children (log-probs best first), then per
    expansion the K frontier nodes' K children each; the next frontier is the K best children."""
    g = torch.Generator().manual_seed(seed)
    t = _tables(B, K, depth)
    lp = (-torch.rand(B, K, generator=g, dtype=torch.float64) * 3).sort(1, descending=True).values.to(dtype)
    root = torch.randint(0, 1000, (B,), generator=g)
    cand_score, cand_tok, cand_lp, frontiers = [lp], [root[:, None], torch.randint(0, 1000, (B, K), generator=g)], \
        [t["zero_logp"].to(dtype), lp], [t["frontier0"]]
    f_score = lp
    for d in range(depth):
        clp = (-torch.rand(B, K, K, generator=g, dtype=torch.float64) * 5).sort(2, descending=True).values.to(dtype)
        cum = (f_score[:, :, None] + clp).flatten(1)
        cand_score.append(cum)
        cand_tok.append(torch.randint(0, 1000, (B, K * K), generator=g))
        cand_lp.append(clp.flatten(1))
        if d < depth - 1:
            best = R.stable_topk(cum, K)
            frontiers.append(best)
            f_score = cum.gather(1, best)
    return t, cand_score, cand_tok, cand_lp, frontiers


def _inputs(B, K, depth, seed=0, dtype=torch.float32):
    """The op's arguments (without the three ints)."""
    t, cand_score, cand_tok, cand_lp, frontiers = _levels(B, K, depth, seed, dtype)
    return [torch.cat(cand_score, 1), t["penalty"], torch.cat(frontiers, 1), t["frontier_offset"], t["parent_col"],
            torch.cat(cand_tok, 1), torch.cat(cand_lp, 1)]


def _poisoned(B, N, max_depth, max_children, logp_dtype):
    full = lambda shape, v, dtype=torch.long: torch.full(shape, v, dtype=dtype)
    return (full((B, N), -7), full((B, N), -7), full((B, N, N), True, torch.bool), full((B, N), -7),
            full((B, N, max_depth + 1), -7), full((B, N), True, torch.bool), full((B, N, max_children), -7),
            full((B, N), float("nan"), logp_dtype))


def _check_kernel(triton_kernels, args, n_nodes, max_depth, max_children):
    B, C = args[0].shape
    N = min(n_nodes - 1, C) + 1
    out = _poisoned(B, N, max_depth, max_children, args[6].dtype)
    got = triton_kernels.tree_select(*args, n_nodes, max_depth, max_children, out=out)
    want = R.tree_select(*args, n_nodes, max_depth, max_children)
    for name, g_, w in zip(NAMES, got, want):
        assert g_.shape == w.shape and g_.dtype == w.dtype, name
        assert torch.equal(g_, w), name  # the same selection and index arithmetic: bit-exact
    return got


@pytest.mark.parametrize("B,K,depth,total", [(1, 10, 4, 59), (3, 10, 4, 59), (3, 3, 2, 8), (2, 4, 3, 30),
                                             (1, 2, 1, 3), (2, 2, 1, 10), (1, 5, 2, 56), (2, 6, 3, 90)])
def test_tree_select_matches_reference(triton_kernels, B, K, depth, total):
    """Default EAGLE-2 shape (K 10, depth 4, 59 nodes; C = 410 candidates), B = 1 and 3, small and odd
    trees, more nodes asked than candidates (all taken), every candidate taken exactly, and 90 nodes
    (the structure in 64-node blocks: children counted across column blocks)."""
    _check_kernel(triton_kernels, _inputs(B, K, depth, seed=B + K + depth), total, depth + 1, K)


def test_ties_at_the_selection_boundary(triton_kernels):
    """Equal scores straddling the cut: the lower candidate id is taken (torch.topk leaves the choice
    among ties unspecified), as stable_topk does."""
    B, K, depth, total = 2, 4, 2, 12
    args = _inputs(B, K, depth, seed=4)
    score = args[0]
    # Level 1 (ids 0-3) distinct and best; all 16 level-2 candidates (ids 4-19) tie, the cut (11 nodes
    # below the root) falls among them; level 3 below. The penalty is per level, so ranked values tie too.
    score[:, :K] = torch.linspace(-0.1, -0.4, K)
    score[:, K:K + K * K] = -1.0
    score[:, K + K * K:] = -3.0
    got = _check_kernel(triton_kernels, args, total, depth + 1, K)
    node_cand = torch.cat([torch.arange(K), K + torch.arange(total - 1 - K)])  # the lowest tied ids
    assert torch.equal(got[0][:, 1:], args[5][:, 1:].gather(1, node_cand.expand(B, -1)))


def test_neg_inf_and_extreme_scores(triton_kernels):
    """Children outside the drafter's top-p (log-prob -inf, so cumulative -inf -> -1e30 after the
    penalty), candidates at exactly -1e30 (tied with them), +inf and NaN scores (nan_to_num: the
    dtype's max and 0), in float32 and float64."""
    for dtype in (torch.float32, torch.float64):
        B, K, depth = 2, 4, 3
        args = _inputs(B, K, depth, seed=7, dtype=dtype)
        score = args[0]
        score[0, K + 3::3] = float("-inf")
        score[1, K:] = float("-inf")  # every expansion's children: the cut falls among -1e30 ties
        score[0, K + 1] = -1e30
        score[0, 2] = float("inf")
        score[0, K + 20] = float("nan")
        for total in (8, 30, 60):
            _check_kernel(triton_kernels, args, total, depth + 1, K)


def test_fp64_log_probs(triton_kernels):
    """The tests' tiny fp64 models draft in fp64: scores and log-probs float64 (the penalty stays
    float32 and promotes)."""
    args = _inputs(3, 5, 3, seed=11, dtype=torch.float64)
    got = _check_kernel(triton_kernels, args, 40, 4, 5)
    assert got[7].dtype == torch.float64


def test_scores_unrelated_to_the_tree(triton_kernels):
    """Random scores break the build's invariant (a child ranks below its parent), so a taken node's
    parent can be left out: both implementations still agree element for element (parents found by
    the same searchsorted count, the structure from the same parent links)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        args = _inputs(2, 3, 3, seed=seed)
        args[0] = torch.randn(args[0].shape, generator=g)
        _check_kernel(triton_kernels, args, 12, 4, 3)


def test_op_with_the_triton_backend_equals_the_reference(triton_kernels, monkeypatch):
    """Through the custom op with Triton forced: contiguous outputs equal to the reference."""
    monkeypatch.setenv("VVS_KERNELS", "triton")
    args = _inputs(2, 4, 3, seed=2)
    got = ops.tree_select(*args, 25, 4, 4)
    monkeypatch.delenv("VVS_KERNELS")
    for g_, w in zip(got, R.tree_select(*args, 25, 4, 4)):
        assert g_.is_contiguous() and torch.equal(g_, w)


def _old_tail(t, cand_score, cand_tok, cand_lp, frontiers, total, depth, K):
    """The code after the level loop of DraftSession._dynamic before the op (kept as the oracle)."""
    B = cand_score[0].shape[0]
    no_parent = torch.full((B, 1), -1, dtype=torch.long)
    score = torch.nan_to_num(torch.cat(cand_score, 1) - t["penalty"], neginf=-1e30)
    sel = score.topk(min(total - 1, score.shape[1]), dim=1).indices.sort(dim=1).values
    frontier_ids = torch.cat(frontiers, 1) + t["frontier_offset"]
    par_gid = frontier_ids.gather(1, t["parent_col"][sel])
    sel_nodes = torch.cat([no_parent, sel], 1)
    parents = torch.cat([no_parent, torch.searchsorted(sel_nodes, par_gid)], 1)
    node_cand = sel_nodes + 1
    tokens = torch.cat(cand_tok, 1).gather(1, node_cand)
    logp = torch.cat(cand_lp, 1).gather(1, node_cand)
    mask, dep, paths, leaf, children = tree_structure(parents, depth + 1, K)
    return tokens, parents, mask, dep, paths, leaf, children, logp


@pytest.mark.parametrize("B,K,depth,total,dtype", [(2, 10, 4, 59, torch.float64), (3, 4, 3, 20, torch.float64),
                                                   (1, 3, 2, 13, torch.float32)])
def test_reference_equals_the_replaced_code(B, K, depth, total, dtype):
    """Random scores without ties at the cut: the reference reproduces the old tail exactly."""
    for seed in range(3):
        t, cand_score, cand_tok, cand_lp, frontiers = _levels(B, K, depth, seed=seed, dtype=dtype)
        args = [torch.cat(cand_score, 1), t["penalty"], torch.cat(frontiers, 1), t["frontier_offset"],
                t["parent_col"], torch.cat(cand_tok, 1), torch.cat(cand_lp, 1)]
        ranked = torch.nan_to_num(args[0] - args[1], neginf=-1e30)
        n_sel = min(total - 1, ranked.shape[1])
        top = ranked.sort(1, descending=True).values
        if n_sel < ranked.shape[1]:
            assert (top[:, n_sel - 1] > top[:, n_sel]).all()  # no tie at the cut
        want = _old_tail(t, cand_score, cand_tok, cand_lp, frontiers, total, depth, K)
        got = R.tree_select(*args, total, depth + 1, K)
        for name, g_, w in zip(NAMES, got, want):
            assert g_.dtype == w.dtype and torch.equal(g_, w), name


def test_fake_matches_real_shapes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for B, K, depth, total in ((2, 4, 3, 25), (1, 2, 1, 10)):
        args = _inputs(B, K, depth)
        real = ops.tree_select(*args, total, depth + 1, K)
        with FakeTensorMode() as mode:
            fake = ops.tree_select(*[mode.from_tensor(a) for a in args], total, depth + 1, K)
        for name, f, r in zip(NAMES, fake, real):
            assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride(), name
            assert r.is_contiguous(), name


def test_opcheck():
    args = _inputs(2, 3, 2, seed=1)
    torch.library.opcheck(ops.tree_select, (*args, 10, 3, 3), test_utils=("test_schema", "test_faketensor"))
