"""Sampling: CFG combination, temperature / top-k / top-p against hand-computed cases, greedy and
seeded reproducibility, the categorical draw, and generation in fp32 / bf16 / fp16."""
import math

import pytest
import torch

from vvs_engine import Engine, VVSError
from vvs_engine.models.gpt import GPT, GPTConfig
from vvs_engine.sampling import SamplingParams, cfg_combine, guided_logits, make_generator, process_logits, sample


def P(**kw):
    return SamplingParams(**kw).validate()


# --- CFG -------------------------------------------------------------------------------------------
def test_cfg_combination_by_hand():
    cond = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    uncond = torch.tensor([[0.5, 2.5, 1.0], [1.0, 0.0, 0.0]])
    rows = torch.cat([cond, uncond])  # the engine's layout: conditional rows first
    got = cfg_combine(rows, 4.0)
    want = torch.tensor([[0.5 + 4 * 0.5, 2.5 + 4 * -0.5, 1.0 + 4 * 2.0], [1.0 - 4.0, 0.0, 4.0]])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cfg_combine(rows, 1.0), cond)  # scale 1 = the conditional logits
    torch.testing.assert_close(cfg_combine(rows, 0.0), uncond)
    # guided_logits applies CFG only when it is on; with scale 1 there are no unconditional rows.
    torch.testing.assert_close(guided_logits(cond, P(cfg_scale=1.0)), cond)
    torch.testing.assert_close(guided_logits(rows, P(cfg_scale=4.0)), want)


# --- logits processing -----------------------------------------------------------------------------
def test_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    for t in (0.5, 1.0, 2.0):
        want = torch.tensor([math.exp(2 / t), math.exp(1 / t), 1.0])
        torch.testing.assert_close(process_logits(logits, P(temperature=t))[0], want / want.sum())


def test_top_k_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    p = process_logits(logits, P(top_k=2))[0]
    e3, e2 = math.exp(3), math.exp(2)
    torch.testing.assert_close(p, torch.tensor([0.0, e3 / (e3 + e2), e2 / (e3 + e2), 0.0]))
    torch.testing.assert_close(process_logits(logits, P(top_k=1))[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # k >= vocabulary and k = 0 are both "off".
    full = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(process_logits(logits, P(top_k=4))[0], full)
    torch.testing.assert_close(process_logits(logits, P(top_k=0))[0], full)


def test_top_p_by_hand():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()[None]
    # Keep the smallest prefix of the sorted tokens whose mass reaches top_p (always >= 1 token).
    cases = {
        0.4: [0.0, 1.0, 0.0, 0.0],  # 0.5 already exceeds 0.4
        0.7: [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8],  # 0.5 < 0.7 <= 0.8
        0.9: [0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95],
        1.0: probs.tolist(),
    }
    for top_p, want in cases.items():
        torch.testing.assert_close(process_logits(logits, P(top_p=top_p))[0], torch.tensor(want), msg=str(top_p))


def test_top_k_then_top_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-k 3 renormalises to (4, 3, 2)/9; top-p 0.6 then keeps 4/9 + 3/9 (4/9 < 0.6 <= 7/9).
    p = process_logits(probs.log()[None], P(top_k=3, top_p=0.6))[0]
    torch.testing.assert_close(p, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 5.0, -1.0], [3.0, 2.0, 2.9]])
    p = process_logits(logits, P(temperature=0))
    torch.testing.assert_close(p, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    g = make_generator(0, "cpu")
    assert sample(p, g).tolist() == [1, 0]


def test_sample_is_a_categorical_draw():
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3]).expand(20000, 4).contiguous()
    draws = sample(probs, make_generator(123, "cpu"))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)
    assert freq[2] == 0  # a zero-probability token is never drawn


def test_invalid_sampling_values():
    bad = [dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
           dict(top_k=-1), dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.01), dict(top_p=float("nan")),
           dict(cfg_scale=float("nan")), dict(cfg_scale=-1.0)]
    for kw in bad:
        with pytest.raises(VVSError):
            SamplingParams(**kw).validate()


# --- end to end through the engine -----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=64, num_classes=10, block_size=16)
    return Engine(GPT(cfg))


def test_greedy_determinism(engine):
    a = engine.generate(class_labels=[1, 2, 1], temperature=0, seed=0).tokens
    b = engine.generate(class_labels=[1, 2, 1], temperature=0, seed=99).tokens
    assert torch.equal(a, b)  # greedy ignores the seed
    assert torch.equal(a[0], a[2])


def test_seeded_sampling(engine):
    kw = dict(class_labels=[1, 2, 3, 4], temperature=1.0, top_k=32, top_p=0.95)
    a = engine.generate(seed=7, **kw).tokens
    b = engine.generate(seed=7, **kw).tokens
    c = engine.generate(seed=8, **kw).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Sampling is per row: the same label twice in one batch gives two different images.
    d = engine.generate(class_labels=[5, 5], seed=7, temperature=1.0).tokens
    assert not torch.equal(d[0], d[1])


def test_cfg_changes_the_output(engine):
    with_cfg = engine.generate(class_labels=[3], temperature=0, cfg_scale=4.0).tokens
    without = engine.generate(class_labels=[3], temperature=0, cfg_scale=1.0).tokens
    assert not torch.equal(with_cfg, without)
    assert engine.generate(class_labels=[3], temperature=0, cfg_scale=1.0).stats["target_forward_passes"] > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_dtypes_run(engine, dtype):
    eng = Engine(GPT(engine.config))
    eng.gpt.load_state_dict(engine.gpt.state_dict())
    eng.to("cpu", dtype)
    out = eng.generate(class_labels=[0, 9], temperature=1.0, top_k=16, seed=3)
    assert out.tokens.shape == (2, 16) and out.tokens.dtype == torch.int64
    assert 0 <= int(out.tokens.min()) and int(out.tokens.max()) < 64
    assert out.stats["dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    logits = eng.score(class_labels=[0, 9], tokens=out.tokens, cfg_scale=4.0)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    if dtype != "fp32":  # low precision stays close to fp32 on the same weights
        ref = engine.score(class_labels=[0, 9], tokens=out.tokens, cfg_scale=4.0)
        assert (logits.softmax(-1) - ref.softmax(-1)).abs().sum(-1).max() < 0.1
