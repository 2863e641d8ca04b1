"""The fused dynamic-tree level (Triton, under the interpreter on the CPU) against the torch reference
and against the unfused per-level code it replaces; the custom op's fake has the real shapes and
strides."""
import pytest
import torch

from vvs_engine.kernels import ops
from vvs_engine.kernels import reference as R


def _inputs(B, K, C, D, W, S, cfg, device, dtype=torch.float32, seed=0, neg_inf=False):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * B if cfg else B
    score = torch.randn(B, K, generator=g, dtype=torch.float64).to(dtype)
    clp = -torch.rand(B, K, C, generator=g, dtype=torch.float64).to(dtype) * 5
    if neg_inf:  # children outside top-p: log-prob -inf (never chosen while finite ones are left)
        clp[:, :, C // 2:] = float("-inf")
    ctok = torch.randint(0, 1000, (B, K, C), generator=g)
    feats = torch.randn(rows, K, D, generator=g, dtype=torch.float64).to(dtype)
    anc = torch.rand(rows, K, W, generator=g) < 0.5
    plen = torch.randint(0, S - W - K + 1, (rows,), generator=g)
    if cfg:
        plen[B:] = plen[:B]  # the unconditional rows of a sequence share its length
    return [t.to(device) for t in (score, clp, ctok, feats, anc, plen)]


def _poisoned(B, K, C, D, W, S, rows, dtype, device):
    nan = float("nan")
    return (torch.full((B, K * C), nan, dtype=dtype, device=device), torch.full((B, K), -7, dtype=torch.long, device=device),
            torch.full((rows, K), -7, dtype=torch.long, device=device), torch.full((B, K), nan, dtype=dtype, device=device),
            torch.full((rows, K, D), nan, dtype=dtype, device=device), torch.ones(rows, K, W + K, dtype=torch.bool, device=device),
            torch.full((rows, K, S), nan, dtype=dtype, device=device))


@pytest.mark.parametrize("B,K,C,D,W,S,cfg", [(1, 10, 10, 256, 10, 300, True), (3, 4, 5, 33, 8, 61, True),
                                             (2, 3, 7, 1030, 9, 1500, False), (1, 1, 1, 1, 1, 3, True)])
def test_tree_level_matches_reference(triton_kernels, device, B, K, C, D, W, S, cfg):
    args = _inputs(B, K, C, D, W, S, cfg, device)
    rows = args[3].shape[0]
    out = _poisoned(B, K, C, D, W, S, rows, torch.float32, device)
    got = triton_kernels.tree_level(*args, S, out=out)
    want = R.tree_level(*args, S)
    names = ("cum", "best", "tokens", "score_next", "feats_next", "anc_next", "mask_next")
    for name, g_, w in zip(names, got, want):
        assert g_.shape == w.shape and g_.dtype == w.dtype, name
        assert torch.equal(g_, w), name  # the same float adds and copies: bit-exact


def test_tree_level_neg_inf_children_and_fp64(triton_kernels, device):
    """Children with log-prob -inf (outside the drafter's top-p) and float64 (the tests' tiny models):
    the finite children are chosen first, in the reference's order."""
    args = _inputs(2, 4, 6, 16, 4, 40, True, device, dtype=torch.float64, neg_inf=True, seed=3)
    got = triton_kernels.tree_level(*args, 40)
    want = R.tree_level(*args, 40)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)


def test_ties_go_to_the_lower_index(triton_kernels, device):
    """Equal cumulative scores: the kernel takes the lower candidate index (torch.topk leaves the
    order of ties unspecified); every other output follows from the chosen candidates."""
    score, clp, ctok, feats, anc, plen = _inputs(1, 3, 4, 8, 3, 20, True, device)
    clp[:] = -1.0
    score[:] = 0.5
    cum, best, tokens, score_next, feats_next, anc_next, mask_next = triton_kernels.tree_level(
        score, clp, ctok, feats, anc, plen, 20)
    assert best.tolist() == [[0, 1, 2]]
    assert torch.equal(tokens, ctok.flatten(1).gather(1, best).repeat(2, 1))
    assert torch.equal(feats_next, feats[:, [0, 0, 0]])  # all three children of frontier node 0


def test_tree_level_equals_the_unfused_level_code():
    """The op reproduces the per-level code of DraftSession._dynamic it replaced (topk, gathers, CFG
    row copies, eye concatenation, visibility clone + scatter)."""
    B, K, D, S = 2, 5, 12, 64
    rows = 2 * B
    score, clp, ctok, feats, _, plen = _inputs(B, K, K, D, K, S, True, "cpu", seed=5)
    eye = torch.eye(K, dtype=torch.bool).expand(rows, K, K)
    anc = torch.cat([torch.rand(rows, K, K, generator=torch.Generator().manual_seed(1)) < 0.5, eye], 2)  # level 1
    width = 3 * K
    rows_of = lambda x: torch.cat([x, x])
    # the code before the op
    cum = (score[:, :, None] + clp).flatten(1)
    best = cum.topk(K, dim=1).indices
    par_rows = rows_of(best // K)
    f_tok, f_score = ctok.flatten(1).gather(1, best), cum.gather(1, best)
    f_feat = feats.gather(1, par_rows[:, :, None].expand(rows, K, D))
    a = torch.cat([anc.gather(1, par_rows[:, :, None].expand(rows, K, 2 * K)), eye], 2)
    scratch = plen[:, None] + torch.arange(4 * K)
    vis = (torch.arange(S)[None, :] < plen[:, None])[:, None, :].expand(rows, K, S).clone()
    vis.scatter_(2, scratch[:, None, :width].expand(rows, K, width), a)
    got = R.tree_level(score, clp, ctok, feats, anc, plen, S)
    mask = torch.where(vis, 0.0, float("-inf"))  # the additive form SDPA makes of the boolean mask
    for g_, w in zip(got, (cum, best, rows_of(f_tok), f_score, f_feat, a, mask)):
        assert torch.equal(g_, w)


def test_fake_matches_real_shapes_and_strides():
    args = _inputs(2, 4, 5, 16, 8, 50, True, "cpu")
    real = R.tree_level(*args, 50)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(t) for t in args]
        fake = ops.tree_level(*fake_args, 50)
    for f, r in zip(fake, real):
        assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()
        assert r.is_contiguous()


def test_opcheck():
    args = _inputs(2, 3, 4, 8, 4, 30, True, "cpu")
    torch.library.opcheck(ops.tree_level, (*args, 30), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_level_writes_the_drafter_input_with_an_embedding(triton_kernels, device, dtype):
    """With the target's embedding table, feats_next is the drafter's whole fc input [R, K, 2D]:
    [embedding of each new node's token (cast to the features' dtype) | its parent's output]."""
    B, K, C, D, W, S = 2, 3, 4, 6, 5, 40
    args = _inputs(B, K, C, D, W, S, True, device, dtype=dtype, seed=7)
    table = torch.randn(1000, D, generator=torch.Generator().manual_seed(2)).to(device)  # fp32 table
    rows = args[3].shape[0]
    out = list(_poisoned(B, K, C, D, W, S, rows, dtype, device))
    out[4] = torch.full((rows, K, 2 * D), float("nan"), dtype=dtype, device=device)
    got = triton_kernels.tree_level(*args, S, table, out=tuple(out))
    want = R.tree_level(*args, S, table)
    plain = R.tree_level(*args, S)
    assert torch.equal(want[4], torch.cat([table[want[2]].to(dtype), plain[4]], 2))
    for g_, w in zip(got, want):
        assert g_.shape == w.shape and g_.dtype == w.dtype and torch.equal(g_, w)


def test_drafter_fc_input_equals_embedding_and_features():
    """The drafter fed the op's [embedding | feature] rows computes what it computes from the
    features and tokens (the session's compiled path vs its eager one)."""
    from vvs_engine.drafting.drafter import Drafter, DrafterConfig
    from vvs_engine.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(dim=32, n_layer=1, n_head=4, vocab_size=50, num_classes=3, block_size=16)).eval()
    dr = Drafter(DrafterConfig(dim=32, n_head=4)).attach(gpt).eval()
    feats, tokens, pos = torch.randn(2, 3, 32), torch.randint(0, 50, (2, 3)), torch.arange(3)
    fc_in = torch.cat([gpt.token_embedding_table()[tokens], feats], -1)
    assert torch.equal(dr(feats, tokens, pos), dr(None, None, pos, fc_input=fc_in))
