"""Counter-based randomness: determinism, batch invariance, uniformity and exact categorical sampling."""
import math

import torch

from vvs_engine.rng import CounterRNG, Streams, mix64, sample_inverse_cdf


def test_draws_depend_only_on_seed_image_step_stream():
    a = CounterRNG(7, torch.tensor([0, 1, 2, 3]))
    b = CounterRNG(7, torch.tensor([2, 9, 0]))  # other batch size, order and neighbours
    ua = a.uniform(torch.tensor([5, 5, 5, 5]), Streams.ACCEPT, (3, 4))
    ub = b.uniform(torch.tensor([5, 1, 5]), Streams.ACCEPT, (3, 4))
    assert torch.equal(ua[2], ub[0]) and torch.equal(ua[0], ub[2])
    assert not torch.equal(ua[0], ua[1])  # images differ
    assert not torch.equal(a.uniform(5, Streams.ACCEPT, 12)[0], a.uniform(6, Streams.ACCEPT, 12)[0])  # steps differ
    assert not torch.equal(a.uniform(5, Streams.ACCEPT, 12)[0], a.uniform(5, Streams.SAMPLE, 12)[0])  # streams differ
    assert not torch.equal(a.uniform(5, 0, 12), CounterRNG(8, torch.arange(4)).uniform(5, 0, 12))  # seeds differ
    assert torch.equal(a.uniform(5, 0, 12), CounterRNG(7, torch.arange(4)).uniform(5, 0, 12))  # reproducible


def test_large_and_negative_seeds_are_accepted():
    for seed in (0, -1, 2**63 - 1, 99999999999999999999):
        u = CounterRNG(seed, torch.arange(2)).uniform(0, 0, 8)
        assert u.shape == (2, 8) and bool(((u > 0) & (u <= 1)).all())


def test_mix64_is_a_bijection_on_a_sample():
    z = torch.arange(-50000, 50000, dtype=torch.long)
    assert torch.unique(mix64(z)).numel() == z.numel()


def test_uniforms_are_uniform_and_uncorrelated():
    rng = CounterRNG(3, torch.arange(64))
    u = rng.uniform(torch.arange(64), Streams.TREE, 1000).flatten().double()  # 64k draws
    assert bool(((u > 0) & (u <= 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45  # 19 dof: p ~ 1e-3
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 0.02


def test_inverse_cdf_sampling_matches_the_distribution():
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    rng = CounterRNG(11, torch.arange(4000))
    draws = rng.sample(p.expand(4000, 5).clone(), 0, Streams.SAMPLE)
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0  # zero-probability tokens are never drawn
    expected = p.double() * 4000
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 13.8  # 2 dof, p = 0.001
    wrong = torch.tensor([0.2, 0.0, 0.5, 0.3, 0.0]).double() * 4000  # negative control
    chi2_wrong = float(((counts[keep] - wrong[keep]) ** 2 / wrong[keep]).sum())
    assert chi2_wrong > 100


def test_inverse_cdf_edges():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert sample_inverse_cdf(p, torch.tensor([1e-7, 1.0])).tolist() == [2, 3]
    assert sample_inverse_cdf(p, torch.tensor([1.0, 1e-7])).tolist() == [2, 0]
    assert sample_inverse_cdf(p * 3, torch.tensor([0.5, 0.5])).tolist() == [2, 1]  # unnormalised rows
    assert math.isclose(float(CounterRNG(0, torch.arange(1)).uniform(0, 0, 1)), float(CounterRNG(0, torch.arange(1)).uniform(0, 0, 1)))


def test_uniforms_in_one_pass_equal_separate_draws():
    rng = CounterRNG(11, torch.tensor([0, 4, 9]))
    step = torch.tensor([3, 0, 57])
    draws = [(Streams.ACCEPT, (59,)), (Streams.SAMPLE, ()), (Streams.CHAIN, (2, 3))]
    together = rng.uniforms(step, draws)
    for (stream, shape), got in zip(draws, together):
        assert torch.equal(got, rng.uniform(step, stream, shape))
    assert not torch.equal(together[0][:, :1], together[1][:, None])  # streams stay distinct
