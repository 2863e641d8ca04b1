"""Triton counter-based uniforms against the torch reference and CounterRNG (the same bits)."""
import pytest
import torch

from vvs_engine.kernels import reference as R
from vvs_engine.rng import CounterRNG, Streams


@pytest.mark.parametrize("B,streams,n_lanes", [(1, 1, 1), (3, 2, 59), (2, 3, 1500), (5, 1, 17)])
def test_counter_uniform_matches_reference_and_rng(triton_kernels, device, B, streams, n_lanes):
    rng = CounterRNG(12345, torch.arange(B, device=device) * 7 + 1)
    step = torch.randint(-3, 10 ** 6, (B,), generator=torch.Generator().manual_seed(B)).to(device)
    offsets = rng.stream_offsets([Streams.ACCEPT, Streams.SAMPLE, Streams.CHAIN][:streams])
    out = torch.full((B, streams, n_lanes), float("nan"), device=device)  # poison: every entry is written
    got = triton_kernels.counter_uniform(rng.key, step, offsets, n_lanes, out=out)
    want = R.counter_uniform(rng.key, step, offsets, n_lanes)
    assert torch.equal(got, want)  # integer hashing: bit-exact, not approximately equal
    for s, stream in enumerate([Streams.ACCEPT, Streams.SAMPLE, Streams.CHAIN][:streams]):
        assert torch.equal(want[:, s], rng.uniform(step, stream, (n_lanes,)))
    assert bool(((got > 0) & (got <= 1)).all())


def test_counter_uniform_one_step_for_every_image(triton_kernels, device):
    rng = CounterRNG(-9, torch.tensor([4, 0, 2], device=device))
    offsets = rng.stream_offsets([Streams.SKIP])
    step = torch.tensor([11], device=device)
    got = triton_kernels.counter_uniform(rng.key, step, offsets, 8)
    assert torch.equal(got, R.counter_uniform(rng.key, step.expand(3), offsets, 8))
