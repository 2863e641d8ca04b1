"""SCD (coupled Jacobi re-drafting): greedy is greedy AR, the sampled joint is the target's exactly (the
4-token toy of docs/jacobi.md, with the released Lumina/Janus bug as a negative control that must fail),
marginals match AR at several positions of a longer image, tokens do not depend on the batch, GSD
composes with both couplings, and bad options are one-line errors."""
from __future__ import annotations

import pytest
import torch

from spec_models import LABELS, tiny_engine
from distribution_checks import _chi2_crit, chi2_joint, exact_joint, toy_engine, toy_sample, two_sample_chi2
from vvs_engine.errors import VVSError


# --- greedy SCD is greedy AR ------------------------------------------------------------------------
@pytest.mark.parametrize("method,opts", [
    ("scd", {}),
    ("scd", {"coupling": "gumbel"}),
    ("scd", {"jacobi_window": 36, "jacobi_init": "random"}),  # the whole image
    ("scd", {"jacobi_window": 1}),
    ("gsd", {"coupling": "maximal", "gsd_group": 8}),
    ("gsd", {"coupling": "gumbel", "gsd_group": 8}),
])
def test_greedy_scd_equals_greedy_ar(eng, greedy_ar, method, opts):
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    assert torch.equal(out.tokens, greedy_ar)
    assert sum(out.stats["accepted_drafts_histogram"]) == out.stats["jacobi_rounds"]


# --- exactness: the toy joint -------------------------------------------------------------------------
def test_scd_toy_joint_is_exact_and_the_released_bug_is_not():
    """Chi-square of the full 4-token joint (256 cells, n = 4000, window 4 = the image, so stale drafts
    are carried and kept) against the exact target joint. Maximal and Gumbel coupling pass (alpha =
    1e-3; 47 and 46 on 52 dof here, critical value 89); the Lumina-mGPT / Janus-Pro code's choice of
    declaring the *old* draft distribution for a kept draft fails (213 here). At n = 20 000 (68 dof, critical value 110): maximal 50, gumbel 81, the bug 825."""
    eng = toy_engine()
    joint = exact_joint(eng)
    n, V = 4000, 4
    for coupling in ("maximal", "gumbel"):
        out = toy_sample(eng, n, "scd", coupling=coupling, jacobi_window=4)
        assert out.stats["accepted_drafts_carried"] > 1000  # the coupled drafts are what is tested
        stat, dof = chi2_joint(out.tokens, joint, V)
        assert stat < _chi2_crit(dof), (coupling, stat, dof)
    bad = toy_sample(eng, n, "scd", coupling="maximal", jacobi_window=4, coupling_declares_old_q=True)
    stat, dof = chi2_joint(bad.tokens, joint, V)
    assert stat > _chi2_crit(dof), (stat, dof)


def test_scd_marginals_match_ar_at_several_positions():
    """V = 8, 16 tokens per image: two-sample chi-square of the token marginals at positions 3, 8 and 15
    between AR and SCD (both couplings), 1000 images each (alpha = 1e-3 per test, 7 dof). Weaker than the
    toy joint (one position at a time) but on a longer image, where drafts are carried over many
    iterations."""
    eng = tiny_engine(vocab=8, block=16, seed=3, peak=6.0, with_vq=False)
    kw = dict(class_labels=[2] * 1000, temperature=1.0, cfg_scale=2.0, decode_images=False, batch_size=1000)
    ar = eng.generate(method="ar", seed=11, **kw).tokens
    for coupling in ("maximal", "gumbel"):
        out = eng.generate(method="scd", coupling=coupling, seed=12, **kw)
        assert out.stats["tpf"] > 1.5
        for pos in (3, 8, 15):
            stat, dof = two_sample_chi2(ar[:, pos], out.tokens[:, pos], 8)
            assert stat < _chi2_crit(dof), (coupling, pos, stat, dof)


# --- engine contract ----------------------------------------------------------------------------------
@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
def test_scd_tokens_do_not_depend_on_the_batch(eng, coupling):
    kw = dict(class_labels=LABELS * 2, temperature=1.0, cfg_scale=3.0, method="scd", coupling=coupling, seed=9,
              decode_images=False)
    a = eng.generate(batch_size=1, **kw)
    b = eng.generate(batch_size=6, **kw)
    assert torch.equal(a.tokens, b.tokens)


def test_coupling_raises_tpf_and_gsd_group_of_one_with_coupling_is_scd(eng):
    # one window for every method (SCD's default is 32, SJD's and GSD's 16): the equivalences hold at equal L
    kw = dict(class_labels=LABELS * 2, temperature=1.0, cfg_scale=3.0, seed=3, decode_images=False, jacobi_window=16)
    sjd = eng.generate(method="sjd", **kw)
    scd = eng.generate(method="scd", **kw)
    assert scd.stats["tpf"] > 1.2 * sjd.stats["tpf"]
    assert scd.stats["accepted_drafts_carried"] > sjd.stats["accepted_drafts_carried"]
    none = eng.generate(method="scd", coupling="none", **kw)
    assert torch.equal(none.tokens, sjd.tokens)  # coupling none is SJD itself
    for coupling in ("maximal", "gumbel"):
        a = eng.generate(method="scd", coupling=coupling, **kw)
        b = eng.generate(method="gsd", coupling=coupling, gsd_group=1, **kw)
        assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("opts", [{"coupling": "mc"}, {"coupling": 1}, {"coupling_declares_old_q": "yes"}])
def test_bad_scd_options_are_one_line_errors(eng, opts):
    with pytest.raises(VVSError) as e:
        eng.generate(class_labels=LABELS, method="scd", decode_images=False, **opts)
    assert "\n" not in str(e.value)


def test_cli_has_the_coupling_flag():
    from vvs_engine.cli import build_parser, method_options
    from vvs_engine.methods import get_method_options

    args = build_parser().parse_args(["generate", "--method", "gsd", "--coupling", "gumbel"])
    assert method_options(args)["coupling"] == "gumbel"
    assert get_method_options("gsd", method_options(args)).coupling == "gumbel"
    assert get_method_options("scd", {}).coupling == "maximal"
    assert get_method_options("gsd", {}).coupling == "none"
