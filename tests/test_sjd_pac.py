"""SJD-PAC: the product-tree layout is the released one, greedy is greedy AR (both variants, every
family), the exact variant reproduces the target joint on the 4-token toy while the released sampler
fails it, marginals match AR on a longer image, tokens do not depend on the batch, and bad options
are one-line errors."""
from __future__ import annotations

import pytest
import torch

from spec_models import LABELS, tiny_engine
from distribution_checks import _chi2_crit, chi2_joint, exact_joint, toy_engine, toy_sample, two_sample_chi2
from vvs_engine.errors import VVSError
from vvs_engine.drafting.product_tree import ProductTree, tree_size
from vvs_engine.methods.sjd_pac import top_few



# --- layout ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_top_few_selects_what_topk_selects(k):
    """The alternatives' top-k as k max/arg-max rounds (one fused kernel compiled): the indices and
    values of topk for distinct values, in topk's order; rows with fewer than k finite values give
    -inf values past them (callers drop those); the lowest index wins a tie."""
    torch.manual_seed(k)
    x = torch.randn(3, 5, 37)
    x[0, 0, 5:] = float("-inf")  # 5 finite values
    x[1, 2, :] = float("-inf")
    x[1, 2, 7] = 0.5  # one finite value
    got_i, got_v = top_few(x, k)
    want = x.topk(k, dim=-1)
    assert torch.equal(got_v, want.values)
    finite = want.values > float("-inf")
    assert torch.equal(got_i[finite], want.indices[finite])
    assert k == 1 or not finite.all()  # the short rows ran out of finite values
    assert top_few(torch.zeros(1, 9), min(k, 4))[0].tolist() == [list(range(min(k, 4)))]
    if k > 1:  # fewer rounds: a prefix of the picks, as topk's
        assert torch.equal(top_few(x, k - 1)[0][finite[..., : k - 1]], got_i[..., : k - 1][finite[..., : k - 1]])


@pytest.mark.parametrize("L,W,D,M", [(64, 3, 3, 54), (64, 4, 3, 46), (16, 3, 3, 6), (16, 2, 2, 15), (8, 1, 3, 8)])
def test_product_tree_layout(L, W, D, M):
    """The released layout (M = D + L - (W^D - 1)/(W - 1): 54 main-chain nodes at 64/3/3, 46 at 64/4/3):
    every node's parent is one level up, every depth 1..D-1 below each node of the W-ary part has W
    distinct children of branches 0..W-1, only branch 0 continues past D - 1, and the rows are the
    W^(D-1) root-to-depth-(D-1) paths with row 0 the main chain."""
    t = ProductTree(L, W, D, "cpu")
    assert t.M == M and len(t.depth) == L and tree_size(W, D) == D + (L - M)
    assert torch.equal(t.depth[:M], torch.arange(M)) and (t.branch[:M] == 0).all()
    for n in range(1, L):
        par = int(t.parent[n])
        assert t.depth[par] == t.depth[n] - 1 and int(t.children[par, t.branch[n]]) == n
        assert (t.depth[n] < D) or n < M  # side nodes stay in the W-ary part
    for n in range(L):
        kids = [int(c) for c in t.children[n] if c >= 0]
        want = W if t.depth[n] < D - 1 else (1 if n < M - 1 else 0)
        assert len(kids) == want, (n, kids)
        assert [int(t.branch[c]) for c in kids] == list(range(len(kids)))
        for j in range(int(t.depth[n]), M):  # zero_path: branch-0 descendants, then the main chain
            z = int(t.zero_path[n, j])
            assert t.depth[z] == j and (z == j or t.branch[z] == 0 or j == t.depth[n])
    assert t.rows.shape == (W ** (D - 1), D) and torch.equal(t.rows[0], torch.arange(D))
    assert len({tuple(r.tolist()) for r in t.rows}) == W ** (D - 1)
    cells = t.branch * M + t.depth  # the candidate-table entry each node shows
    assert torch.equal(t.cell, cells)


# --- greedy SJD-PAC is greedy AR ------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [
    {},
    {"jacobi_init": "random"},
    {"pac_variant": "released"},
    {"pac_variant": "released", "jacobi_init": "random"},
    {"pac_width": 2, "pac_depth": 4, "jacobi_window": 20},
    {"pac_width": 1, "jacobi_window": 5},
    {"jacobi_window": 36, "jacobi_init": "copy-above"},  # the whole image
    {"pac_width": 4, "pac_depth": 2, "jacobi_init": "argmax-left"},
])
def test_greedy_sjd_pac_equals_greedy_ar(eng, greedy_ar, opts):
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method="sjd-pac", decode_images=False,
                       **opts)
    assert torch.equal(out.tokens, greedy_ar)
    assert sum(out.stats["accepted_drafts_histogram"]) == out.stats["jacobi_rounds"]


# --- exactness -------------------------------------------------------------------------------------------
def test_sjd_pac_toy_joint_is_exact_and_the_released_sampler_is_not():
    """Chi-square of the full 4-token joint (256 cells) against the exact target joint, W = D = 3 on
    L = 14 nodes (a main chain of 4 = the image): the exact variant passes with both initialisations
    (copy-left: one-hot candidates, no initial alternatives; random: W distinct uniform candidates
    declared uniform), n = 3000 each; the released sampler (longest path, all-siblings residual on stale
    tree columns, alternatives from the residual) fails, n = 8000 (alpha = 1e-3). At n = 20 000 (68 dof,
    critical value 110): exact 60 (random init) and 87 (copy-left), released 585. The alternatives are used (accepted alternatives counted)."""
    eng = toy_engine()
    joint = exact_joint(eng)
    V = 4
    for init in ("random", "copy-left"):
        out = toy_sample(eng, 3000, "sjd-pac", jacobi_window=14, pac_width=3, jacobi_init=init)
        assert out.stats["accepted_alternatives"] > 500 and out.stats["accepted_drafts_carried"] > 500
        stat, dof = chi2_joint(out.tokens, joint, V)
        assert stat < _chi2_crit(dof), (init, stat, dof)
    bad = toy_sample(eng, 8000, "sjd-pac", jacobi_window=14, pac_width=3, jacobi_init="random",
                     pac_variant="released")
    stat, dof = chi2_joint(bad.tokens, joint, V)
    assert stat > _chi2_crit(dof), (stat, dof)


def test_sjd_pac_marginals_match_ar_at_several_positions():
    """V = 8, 16 tokens per image, W = D = 3 on 16 nodes: two-sample chi-square of the token marginals at
    positions 3, 8 and 15 between AR and the exact variant (1000 images each, alpha = 1e-3, 7 dof)."""
    eng = tiny_engine(vocab=8, block=16, seed=3, peak=6.0, with_vq=False)
    kw = dict(class_labels=[2] * 1000, temperature=1.0, cfg_scale=2.0, decode_images=False, batch_size=1000)
    ar = eng.generate(method="ar", seed=11, **kw).tokens
    out = eng.generate(method="sjd-pac", jacobi_window=16, pac_width=3, seed=12, **kw)
    assert out.stats["tpf"] > 1.5 and out.stats["accepted_alternatives"] > 0
    for pos in (3, 8, 15):
        stat, dof = two_sample_chi2(ar[:, pos], out.tokens[:, pos], 8)
        assert stat < _chi2_crit(dof), (pos, stat, dof)


# --- engine contract -------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [{}, {"jacobi_init": "random", "jacobi_window": 16}, {"pac_variant": "released"}])
def test_sjd_pac_tokens_do_not_depend_on_the_batch(eng, opts):
    kw = dict(class_labels=LABELS * 2, temperature=1.0, cfg_scale=3.0, method="sjd-pac", seed=9,
              decode_images=False, **opts)
    a = eng.generate(batch_size=1, **kw)
    b = eng.generate(batch_size=6, **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert a.stats["target_forward_passes"] == b.stats["target_forward_passes"]
    assert a.stats["accepted_alternatives"] == b.stats["accepted_alternatives"]


@pytest.mark.parametrize("opts,match", [
    ({"pac_width": 0}, "pac-width"), ({"pac_depth": 2.5}, "pac-depth"), ({"pac_variant": "paper"}, "pac-variant"),
    ({"pac_width": 3, "pac_depth": 3, "jacobi_window": 12}, "at least"), ({"pac_width": 65}, "pac-width"),
    ({"coupling": "gumbel"}, "unknown option"),
])
def test_bad_sjd_pac_options_are_one_line_errors(eng, opts, match):
    with pytest.raises(VVSError, match=match) as e:
        eng.generate(class_labels=LABELS, method="sjd-pac", decode_images=False, **opts)
    assert "\n" not in str(e.value)


def test_cli_flags_reach_sjd_pac():
    from vvs_engine.cli import build_parser, method_options
    from vvs_engine.methods import get_method_options

    args = build_parser().parse_args(["generate", "--method", "sjd-pac", "--pac-width", "4", "--pac-depth", "2",
                                      "--pac-variant", "released"])
    o = get_method_options("sjd-pac", method_options(args))
    assert (o.pac_width, o.pac_depth, o.pac_variant, o.jacobi_window) == (4, 2, "released", 32)


# --- every family ----------------------------------------------------------------------------------------
def _family_engine(kind, path):
    from vvs_engine.engine import Engine
    from vvs_engine.models import hf_tiny

    if kind == "janus":
        hf_tiny.make_janus_folder(path)
        eng = Engine.load(model_dir=path, max_prompt_tokens=24)
    elif kind == "lumina":
        hf_tiny.make_chameleon_folder(path)
        eng = Engine.load(model_dir=path, max_prompt_tokens=32, image_size=64)
    else:
        hf_tiny.make_emu3_folder(path)
        eng = Engine.load(model_dir=path, max_prompt_tokens=24, image_size=32)
    eng.gpt.to(torch.float64)
    eng.dtype = torch.float64
    return eng


@pytest.mark.parametrize("kind", ["janus", "lumina", "emu3"])
def test_every_family_greedy_equals_ar_and_samples_within_layout(kind, tmp_path):
    """Janus-Pro, Lumina-mGPT and Emu3 (tiny random folders): greedy SCD and SJD-PAC are greedy AR;
    sampled, they keep the family's layout (forced end-of-line tokens) and a batch-of-one image is the
    same image."""
    from vvs_engine.models.hf_tiny import PROMPTS

    eng = _family_engine(kind, str(tmp_path))
    ar = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens
    c = eng.config
    layout = getattr(c, "grid_w", None) is not None and eng.tokens_per_image == c.grid_h * (c.grid_w + 1)
    for method, opts in (("scd", {}), ("scd", {"coupling": "gumbel"}), ("sjd-pac", {}),
                         ("sjd-pac", {"pac_variant": "released"})):
        out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
        assert torch.equal(out.tokens, ar), (method, opts)
        kw = dict(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, method=method, seed=3, decode_images=False, **opts)
        s = eng.generate(**kw)
        assert s.tokens.shape == ar.shape and int(s.tokens.max()) < c.vocab_size
        if layout:
            rows = s.tokens.view(len(PROMPTS), c.grid_h, c.grid_w + 1)
            assert (rows[:, :, -1] == c.n_codes).all() and (rows[:, :, :-1] < c.n_codes).all()
        one = eng.generate(**dict(kw, prompts=PROMPTS[1:], image_indices=[1], batch_size=1))
        assert torch.equal(one.tokens[0], s.tokens[1])


# --- bench and generate-dataset ----------------------------------------------------------------------
def test_generate_dataset_and_bench_run_both_methods(tmp_path):
    """generate-dataset writes the same tokens as Engine.generate for SCD and SJD-PAC (its shards merge
    the method's stats), and the bench measures both (tiny checkpoints / the quick random model)."""
    import numpy as np

    from dataset_utils import read_all, write_tiny_checkpoints
    from vvs_engine import Engine, dataset
    from vvs_engine.evaluation import bench

    (tmp_path / "tiny").mkdir()
    tiny = write_tiny_checkpoints(str(tmp_path / "tiny"))
    for method, opts in (("scd", {"coupling": "gumbel"}), ("sjd-pac", {"jacobi_window": 16})):
        out = tmp_path / method
        stats = dataset.generate(str(out), class_labels=[3, 1, 4], method=method, seed=7, shard_size=2, batch_size=2,
                                 model=tiny, threads=1, progress=False, decode_images=False, **opts)
        assert stats["method"] == method and stats["tpf"] >= 1.0
        want = Engine.load(**tiny).generate(class_labels=[3, 1, 4], method=method, seed=7, batch_size=2,
                                            decode_images=False, **opts).tokens
        assert np.array_equal(read_all(out)["tokens"], want.numpy())
    assert bench.main(["--quick", "--repeats", "1", "--settings", "scd;sjd-pac:jacobi_window=16", "--out",
                       str(tmp_path / "bench"), "--no-plot", "--threads", "1"]) == 0
