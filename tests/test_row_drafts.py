"""Row drafts verified exactly in raster order (``--method row-drafts``, pjd.md E3): greedy is greedy AR
whatever the rows propose (every option, and on Janus-Pro's layout); sampled, the tokens are raster AR
samples by the sampling-gap test (D = mean of NLL - entropy under the raster target reads 0), where the
same decoder committing its row drafts untested (what ZipAR commits) reads far from 0; marginals at
row-drafted positions match AR; bad options and a family with end-of-line tokens are one-line errors.
Identity under admission mid-run is ``tests/test_loop.py``'s (the method is in its list)."""
from __future__ import annotations

import pytest
import torch

from spec_models import LABELS, tiny_engine
from distribution_checks import _chi2_crit, two_sample_chi2
from vvs_engine.engine import Engine
from vvs_engine.errors import VVSError
from vvs_engine.models.hf_tiny import PROMPTS, make_emu3_folder, make_janus_folder

# rows overlap on the 6 x 6 test grid: start lag 1 or 2, commit lag 1, small verifier windows
OVERLAP = [
    dict(jacobi_window=2, zipar_window=1, zipar_commit_lag=0),
    dict(jacobi_window=4, zipar_window=1, zipar_commit_lag=0, zipar_jacobi_window=3),
    dict(jacobi_window=3, zipar_window=2, zipar_commit_lag=1, zipar_jacobi_window=3, coupling="none",
         row_after_reject="keep", row_redraw=1),
    dict(jacobi_window=2, zipar_window=2, zipar_commit_lag=1, row_redraw=2),
]


@pytest.mark.parametrize("opts", [{}] + OVERLAP)
def test_greedy_row_drafts_equal_greedy_ar(eng, greedy_ar, opts):
    out = eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, method="row-drafts", decode_images=False,
                       **opts)
    assert torch.equal(out.tokens, greedy_ar)
    if opts:  # the rows drafted, and some of their drafts were committed
        assert out.stats["row_draft_tokens"] > 0 and out.stats["most_rows_per_forward"] >= 2
        assert out.stats["accepted_row_drafts"] > 0


def raster_gap_z(eng, tokens, labels, cfg):
    """The sampling gap over every token, in standard deviations: log p(x_t) - E_p log p under the raster
    target p (teacher-forced ``Engine.score``) has mean 0 given the tokens before it when x_t ~ p, so the
    sum is a martingale (approximately normal) -> (z, D in nats per token)."""
    logp = torch.log_softmax(eng.score(class_labels=labels, tokens=tokens, cfg_scale=cfg).double(), -1)
    p = logp.exp()
    lx = logp.gather(2, tokens[:, :, None])[..., 0]
    mean = (p * logp).sum(-1)
    var = (p * logp ** 2).sum(-1) - mean ** 2
    return float((lx - mean).sum() / var.sum().sqrt()), float((mean - lx).mean())


@pytest.fixture(scope="module")
def four_by_four():
    eng = tiny_engine(vocab=16, block=16, seed=2, peak=6.0, with_vq=False)
    labels = [i % 5 for i in range(600)]
    kw = dict(class_labels=labels, temperature=1.0, cfg_scale=2.0, decode_images=False, batch_size=300)
    return eng, labels, kw, eng.generate(method="ar", seed=11, **kw).tokens


@pytest.mark.parametrize("opts", [OVERLAP[0], OVERLAP[2]], ids=["plain-rows", "row-windows-keep"])
def test_sampled_row_drafts_are_raster_ar_samples(four_by_four, opts):
    """4 x 4 grid, V = 16, 600 images: |z| < 3.29 (two-sided 1e-3; 0.35 and 0.7 at 1000 images) while
    thousands of row-drafted tokens were committed; two-sample chi-square of the marginals at row-drafted
    positions against AR (alpha 1e-3)."""
    eng, labels, kw, ar = four_by_four
    out = eng.generate(method="row-drafts", seed=12, **kw, **opts)
    assert out.stats["accepted_row_drafts"] > 1500, out.stats["accepted_row_drafts"]
    z, _ = raster_gap_z(eng, out.tokens, labels, 2.0)
    assert abs(z) < 3.29, z
    for pos in (5, 9, 10, 13, 14):
        stat, dof = two_sample_chi2(ar[:, pos], out.tokens[:, pos], 16)
        assert stat < _chi2_crit(dof), (pos, stat, dof)


def test_row_drafts_committed_untested_fail_the_gap_test(four_by_four):
    """Negative control: the same decoder with the verifier passing row-drafted tokens untested (they are
    samples of a partial-context target, as ZipAR commits them) reads z = -17 here, D = +0.12 nats per token
    (tokens less likely under the raster target than its own samples: over-dispersed, as ZipAR reads on
    the Zoo)."""
    eng, labels, kw, _ = four_by_four
    out = eng.generate(method="row-drafts", seed=12, row_drafts_untested=True, **kw, **OVERLAP[0])
    z, gap = raster_gap_z(eng, out.tokens, labels, 2.0)
    assert z < -3.29 and gap > 0.05, (z, gap)


def fp64(e):
    e.gpt.to(torch.float64)
    e.dtype = torch.float64
    return e


def test_janus_greedy_equals_ar_and_end_of_line_families_are_refused(tmp_path):
    path = str(tmp_path / "janus")
    make_janus_folder(path)
    janus = fp64(Engine.load(model_dir=path, max_prompt_tokens=24))
    kw = dict(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False)
    out = janus.generate(method="row-drafts", jacobi_window=2, zipar_window=1, zipar_commit_lag=0, **kw)
    assert torch.equal(out.tokens, janus.generate(**kw).tokens)
    assert out.stats["row_draft_tokens"] > 0
    path = str(tmp_path / "emu3")
    make_emu3_folder(path)
    emu3 = Engine.load(model_dir=path, max_prompt_tokens=24, image_size=32)
    with pytest.raises(VVSError, match="end-of-line"):
        emu3.generate(method="row-drafts", **kw)


@pytest.mark.parametrize("opts,match", [
    ({"jacobi_window": 1}, "jacobi-window"), ({"zipar_window": 0}, "zipar-window"),
    ({"zipar_jacobi_window": 65}, "zipar-jacobi-window"), ({"zipar_window": 2, "zipar_commit_lag": 3}, "zipar-commit-lag"),
    ({"coupling": "gumbel"}, "coupling"), ({"row_after_reject": "drop"}, "row-after-reject"),
    ({"row_redraw": -1}, "row-redraw"), ({"pac_width": 2}, "unknown option"),
])
def test_bad_row_drafts_options_are_one_line_errors(eng, opts, match):
    with pytest.raises(VVSError, match=match):
        eng.generate(class_labels=LABELS, method="row-drafts", decode_images=False, **opts)
