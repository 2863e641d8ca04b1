"""Triton LANTERN neighbour mass and GSD group mass against the torch references."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vvs_engine.kernels import reference as R

import oracles as O


def lantern_case(M, V, k, seed, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(M, V, generator=gen), -1).to(dtype).to(device)
    tokens = torch.randint(0, V, (M,), generator=gen).to(device)
    neighbors = torch.randint(-1, V, (V, k), generator=gen).to(device)
    return p, tokens, neighbors


def check_lantern(triton_kernels, p, tokens, neighbors, delta, ratio):
    M = p.shape[0]
    out = (torch.full((M,), O.POISON_F, device=p.device), torch.full((M,), O.POISON_I, dtype=torch.int64, device=p.device))
    relaxed, m_star = triton_kernels.lantern_mass(p, tokens, neighbors, delta, ratio, out=out)
    want_relaxed, want_m = R.lantern_mass(p, tokens, neighbors, delta, ratio)
    assert torch.equal(m_star, want_m)
    torch.testing.assert_close(relaxed, want_relaxed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,delta", [(False, 0.0), (False, 0.1), (False, 0.6), (True, 1.0), (True, 3.0)])
def test_lantern_mass_matches_reference(triton_kernels, device, dtype, ratio, delta):
    check_lantern(triton_kernels, *lantern_case(11, 97, 7, int(delta * 10) + ratio, dtype, device), delta, ratio)


@settings(max_examples=15, deadline=None)
@given(M=st.integers(1, 12), V=st.integers(2, 120), k=st.integers(1, 20), delta=st.floats(0, 0.5),
       lam=st.floats(1, 5), ratio=st.booleans(), seed=st.integers(0, 2**31))
def test_lantern_mass_fuzz(triton_kernels, M, V, k, delta, lam, ratio, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_lantern(triton_kernels, *lantern_case(M, V, k, seed, torch.float32, device), lam if ratio else delta, ratio)


@settings(max_examples=15, deadline=None)
@given(M=st.integers(1, 12), V=st.integers(1, 120), G=st.integers(1, 17), seed=st.integers(0, 2**31))
def test_group_mass_fuzz(triton_kernels, M, V, G, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(M, V, generator=gen).to(device)
    q = torch.rand(M, V, generator=gen).half().to(device)
    members = torch.randint(-1, V, (M, G), generator=gen).to(device)
    out = (torch.full((M,), O.POISON_F, device=device), torch.full((M,), O.POISON_F, device=device))
    got = triton_kernels.group_mass(p, q, members, out=out)
    want = R.group_mass(p, q, members)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
