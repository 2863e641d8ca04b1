"""Triton fused draft sampling against the torch reference (same explicit noise)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vvs_engine.kernels import reference as R

import oracles as O


def run(triton_kernels, logits, cfg, temp, top_k, top_p, k, noise):
    B = logits.shape[0] // 2 if cfg != 1.0 else logits.shape[0]
    out = (torch.full((B, k), O.POISON_I, dtype=torch.int64, device=logits.device),
           torch.full((B, k), O.POISON_F, dtype=torch.float32, device=logits.device))
    tokens, logp = triton_kernels.draft_topk(logits, cfg, temp, top_k, top_p, k, noise, out=out)
    want_t, want_l = R.draft_topk(logits, cfg, temp, top_k, top_p, k, noise)
    assert torch.equal(tokens, want_t), (tokens, want_t)
    assert not logp.isnan().any()
    torch.testing.assert_close(logp, want_l, rtol=1e-5, atol=1e-5)
    return tokens, logp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg,temp,top_k,top_p,noisy", [
    (1.0, 1.0, 0, 1.0, False),  # plain greedy top-k
    (4.0, 1.0, 0, 1.0, True),  # CFG + exponential race
    (1.0, 0.7, 20, 1.0, True),  # top-k truncation
    (2.5, 1.3, 0, 0.8, True),  # top-p truncation
    (3.0, 0.9, 40, 0.6, False),  # both
    (1.0, 1.0, 1, 1.0, True),  # top-k 1: every other token has p = 0, logp = -inf
])
def test_draft_topk_matches_reference(triton_kernels, device, dtype, cfg, temp, top_k, top_p, noisy):
    gen = torch.Generator().manual_seed(top_k + int(10 * cfg))
    B, V, k = 3, 97, 6
    logits = (3 * torch.randn(2 * B if cfg != 1.0 else B, V, generator=gen)).to(dtype).to(device)
    noise = torch.empty(B, V).exponential_(generator=gen).to(device) if noisy else None
    run(triton_kernels, logits, cfg, temp, top_k, top_p, k, noise)


def test_draft_topk_ties_go_to_lower_index(triton_kernels, device):
    logits = torch.zeros(2, 33, device=device)
    logits[0, [30, 4, 17]] = 2.0
    tokens, _ = run(triton_kernels, logits, 1.0, 1.0, 0, 1.0, 5, None)
    assert tokens[0].tolist() == [4, 17, 30, 0, 1]


def test_draft_topk_philox_noise_is_valid_and_advances(triton_kernels, device):
    B, V, k = 2, 64, 4
    logits = torch.randn(B, V, device=device)
    seed_offset = torch.tensor([1234, 0], device=device)
    t1, l1 = triton_kernels.draft_topk(logits, 1.0, 1.0, 10, 1.0, k, seed_offset=seed_offset)
    assert seed_offset.tolist() == [1234, B * V]
    t2, l2 = triton_kernels.draft_topk(logits, 1.0, 1.0, 10, 1.0, k, seed_offset=seed_offset)
    assert seed_offset.tolist() == [1234, 2 * B * V]
    p = R.draft_probs(logits, 1.0, 1.0, 10, 1.0)
    for t, l in ((t1, l1), (t2, l2)):
        assert all(len(set(row)) == k for row in t.tolist())  # without replacement
        assert bool((p.gather(1, t) > 0).all())  # only tokens inside the top-k
        torch.testing.assert_close(l, p.gather(1, t).log())
    assert not torch.equal(t1, t2)  # fresh noise on the second call (probability ~1)


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 3), V=st.integers(8, 150), cfg=st.sampled_from([1.0, 2.0]), temp=st.floats(0.5, 1.5),
       top_k=st.integers(0, 40), top_p=st.sampled_from([1.0, 0.95, 0.7]), k=st.integers(1, 5),
       noisy=st.booleans(), seed=st.integers(0, 2**31))
def test_draft_topk_fuzz(triton_kernels, B, V, cfg, temp, top_k, top_p, k, noisy, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(2 * B if cfg != 1.0 else B, V, generator=gen)).to(device)
    noise = torch.empty(B, V).exponential_(generator=gen).to(device) if noisy else None
    run(triton_kernels, logits, cfg, temp, top_k, top_p, k, noise)
