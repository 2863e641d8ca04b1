"""quant-draft: a weight-only quantized copy of the target drafts, the full-precision target verifies with
the exact speculative rule. Lossless whatever the drafts: greedy equals AR, the sampled joint is the
target's (chi-square, with a drafter far from the target and with the real int8 copy), and a rule that
accepts every draft is detected. Tokens do not depend on admission. Refusals are one-line errors."""
from __future__ import annotations

import copy

import pytest
import torch

from distribution_checks import _chi2_crit, chi2_joint, exact_joint, toy_engine, toy_sample
from spec_models import tiny_engine
from vvs_engine.acceptance.verify import ExactRule
from vvs_engine.errors import VVSError
from vvs_engine.methods import quant_draft
from vvs_engine.models.quantize import is_quantized, quantize_module

pytest.importorskip("torchao")


@pytest.fixture
def far_drafter(monkeypatch):
    """The copy perturbed before it is quantized (noise on its output head): drafts often rejected, so
    the residual path is exercised. The method must stay exact: the rule, not the drafter, decides."""
    def build(engine, mode):
        torch.manual_seed(123)
        model = copy.deepcopy(engine.gpt).to(dtype=quant_draft.draft_dtype(engine.dtype))
        with torch.no_grad():
            model.output.weight.add_(torch.randn_like(model.output.weight) * model.output.weight.std() * 2)
        quantize_module(model, mode)
        return model.eval()
    monkeypatch.setattr(quant_draft, "quantized_copy", build)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("far", [False, True], ids=["int8-copy", "far-drafter"])
def test_greedy_equals_ar(dtype, far, request):
    if far:
        request.getfixturevalue("far_drafter")
    eng = tiny_engine(dtype=dtype, peak=8.0)
    kw = dict(class_labels=[0, 3, 4, 1], decode_images=False, temperature=0.0, cfg_scale=3.0, seed=1)
    ar = eng.generate(method="ar", **kw)
    for k in (1, 4):
        out = eng.generate(method="quant-draft", draft_length=k, **kw)
        assert torch.equal(out.tokens, ar.tokens), k
        hist = out.stats["accepted_drafts_histogram"]
        assert len(hist) == k + 1 and sum(hist) == out.stats["target_forward_passes"]
        if far:  # the far drafter is rejected in some rounds and accepted in others
            assert hist[0] > 0 and sum(hist[1:]) > 0, hist


def test_greedy_equals_ar_with_an_fp8_copy():
    """fp8 runs on the CPU too (torchao upcasts before the matmul): the same tokens as AR."""
    eng = tiny_engine(dtype=torch.float32, peak=8.0)
    kw = dict(class_labels=[0, 3], decode_images=False, temperature=0.0, cfg_scale=3.0, seed=1)
    out = eng.generate(method="quant-draft", draft_quantize="fp8", **kw)
    assert torch.equal(out.tokens, eng.generate(method="ar", **kw).tokens)
    assert is_quantized(quant_draft.quantized_copy(eng, "fp8"))


def test_the_copy_is_quantized_and_built_once():
    eng = tiny_engine(dtype=torch.float32, peak=8.0)
    a = quant_draft.quantized_copy(eng, "int8")
    assert is_quantized(a) and not is_quantized(eng.gpt)
    assert quant_draft.quantized_copy(eng, "int8") is a
    out = eng.generate(class_labels=[1], method="quant-draft", decode_images=False, temperature=0.0)
    assert out.stats["mean_accepted_length"] > 1.5  # the int8 copy of a model agrees with it mostly


def test_sampled_joint_is_the_targets_and_accepting_every_draft_is_not(far_drafter):
    """Chi-square of the full 4-token joint (V = 4: 256 cells) against the exact target joint, alpha
    1e-3, k = 3 (every round drafts across the image), with a drafter far from the target so that
    acceptance, rejection with the residual, and the bonus token all occur. Negative control: the rule
    replaced by 'accept every draft' gives the drafter's joint, and the test detects it."""
    eng = toy_engine()
    joint, V, n = exact_joint(eng), 4, 3000
    out = toy_sample(eng, n, "quant-draft", draft_length=3)
    hist = out.stats["accepted_drafts_histogram"]
    assert hist[0] > 1000 and hist[3] > 100, hist  # rejections and full acceptances both common
    stat, dof = chi2_joint(out.tokens, joint, V)
    assert stat < _chi2_crit(dof), (stat, dof)
    original = ExactRule.accept
    try:
        ExactRule.accept = lambda self, r, x, qx, u, ctx: (torch.ones_like(x, dtype=torch.bool), None)
        bad = toy_sample(eng, n, "quant-draft", draft_length=3)
    finally:
        ExactRule.accept = original
    stat_bad, dof = chi2_joint(bad.tokens, joint, V)
    assert stat_bad > _chi2_crit(dof), (stat_bad, dof)


def test_sampled_joint_with_the_int8_copy():
    eng = toy_engine()
    joint, V = exact_joint(eng), 4
    out = toy_sample(eng, 3000, "quant-draft", draft_length=2)
    stat, dof = chi2_joint(out.tokens, joint, V)
    assert stat < _chi2_crit(dof), (stat, dof)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=20, cfg_scale=3.0), dict(temperature=0.0)],
                         ids=["sampled", "greedy"])
def test_tokens_do_not_depend_on_admission(far_drafter, sampling):
    eng = tiny_engine(dtype=torch.float64, peak=8.0)
    labels = [0, 3, 4, 1, 2]
    kw = dict(class_labels=labels, method="quant-draft", seed=7, decode_images=False, draft_length=3, **sampling)
    static = eng.generate(batch_size=4, static_batches=True, **kw)
    continuous = eng.generate(batch_size=2, **kw)
    assert continuous.stats["admissions"] >= 2
    assert torch.equal(continuous.tokens, static.tokens)
    assert continuous.stats["per_image"] == static.stats["per_image"]
    alone = eng.generate(**dict(kw, class_labels=[labels[3]], image_indices=[3], batch_size=1))
    assert torch.equal(alone.tokens[0], static.tokens[3])


@pytest.mark.parametrize("opts,message", [({"draft_length": 0}, "draft-length"),
                                          ({"draft_quantize": "int4"}, "draft-quantize int4 needs a CUDA GPU"),
                                          ({"draft_quantize": "int3"}, "draft-quantize")])
def test_bad_options_are_one_line_errors(opts, message):
    eng = tiny_engine(dtype=torch.float32)
    with pytest.raises(VVSError, match=message) as err:
        eng.generate(class_labels=[1], method="quant-draft", decode_images=False, **opts)
    assert "\n" not in str(err.value)


def test_a_quantized_engine_is_refused():
    eng = tiny_engine(dtype=torch.float32).quantize_weights("int8")
    with pytest.raises(VVSError, match="already quantized"):
        eng.generate(class_labels=[1], method="quant-draft", decode_images=False)
