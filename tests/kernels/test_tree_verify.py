"""Fused tree verification (Triton, one program per tree) against its torch reference, and the exact
rule's output distribution through the kernel (chi-square, with a biased negative control)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vvs_engine.acceptance.verify import neighbor_table
from vvs_engine.kernels import reference as R
from vvs_engine.drafting.tree import children_table

import oracles as O


def tree_case(B, N, V, C, max_depth, seed, sampled, device):
    """B random trees (children tables with at most C children per node), target distributions that
    favour each node's first children (so walks go deep), drafts, uniforms."""
    gen = torch.Generator().manual_seed(seed)
    children, tokens = [], []
    for _ in range(B):
        parents = O.random_tree(N, max_depth, gen)
        children.append(children_table(parents, C))
        tokens.append(torch.randint(0, V, (N,), generator=gen))
    children, tokens = torch.stack(children), torch.stack(tokens)
    logits = 2 * torch.randn(B, N, V, generator=gen)
    first = children[:, :, 0]
    has = first >= 0
    boost_tok = tokens.gather(1, first.clamp(min=0))  # [B, N] token of each node's first child
    logits.scatter_add_(2, boost_tok[:, :, None], 4.0 * has[:, :, None].float())
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(B, N, V, generator=gen), -1) if sampled else None
    u_accept = 1.0 - torch.rand(B, N, generator=gen)
    u_sample = 1.0 - torch.rand(B, generator=gen)
    to = lambda t: None if t is None else t.to(device)
    return [to(t) for t in (tokens, children, p, q, u_accept, u_sample)]


def check(triton_kernels, case, neighbors, delta, ratio, ref_residual, greedy, max_depth):
    tokens, children, p, q, u_accept, u_sample = case
    B = tokens.shape[0]
    dev = p.device
    out = (torch.full((B, max_depth + 1), O.POISON_I, dtype=torch.int64, device=dev),
           *(torch.full((B,), O.POISON_I, dtype=torch.int64, device=dev) for _ in range(3)))
    got = triton_kernels.tree_verify(tokens, children, p, q, u_accept, u_sample, neighbors, delta, ratio,
                                     ref_residual, greedy, max_depth, out=out)
    want = R.tree_verify(tokens, children, p, q, u_accept, u_sample, neighbors, delta, ratio, ref_residual, greedy,
                         max_depth)
    for name, g, w in zip(("path", "n_accepted", "last", "next_token"), got, want):
        assert torch.equal(g.cpu(), w.cpu()), (name, g, w)
    return want


RULES = {  # (relaxed, delta, ratio, reference_residual)
    "exact": (False, 0.0, False, False),
    "lantern": (True, 0.2, False, False),
    "lantern++": (True, 2.0, True, False),
    "lantern-ref-residual": (True, 0.2, False, True),
}


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("rule", list(RULES))
def test_tree_verify_matches_reference(triton_kernels, device, rule, sampled, greedy):
    relaxed, delta, ratio, ref_residual = RULES[rule]
    B, N, V, C, D = 4, 11, 37, 4, 4  # odd vocabulary, several children per node
    case = tree_case(B, N, V, C, D, seed=7 + sampled + 2 * greedy, sampled=sampled, device=device)
    neighbors = neighbor_table(torch.randn(V, 3, generator=torch.Generator().manual_seed(1)), 5).to(device)
    want = check(triton_kernels, case, neighbors if relaxed else None, delta, ratio, ref_residual, greedy, D)
    assert (want[1] > 0).any()  # some tree accepted something: the walk is exercised


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 5), N=st.integers(1, 14), V=st.integers(2, 70), C=st.integers(1, 5),
       D=st.integers(1, 5), rule=st.sampled_from(list(RULES)), sampled=st.booleans(), greedy=st.booleans(),
       seed=st.integers(0, 2**31))
def test_tree_verify_fuzz(triton_kernels, B, N, V, C, D, rule, sampled, greedy, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    relaxed, delta, ratio, ref_residual = RULES[rule]
    case = tree_case(B, N, V, C, D, seed, sampled, device)
    k = max(1, min(V - 1, 6))
    neighbors = neighbor_table(torch.randn(V, 3, generator=torch.Generator().manual_seed(seed)), k).to(device) \
        if relaxed and V > 1 else None
    check(triton_kernels, case, neighbors, delta, ratio, ref_residual, greedy, D)


def _first_token(tokens, path, n_accepted, next_token):
    """The first token a verify round commits: the accepted depth-1 draft, else the resampled one."""
    first_node = path[:, 1].clamp(min=0)
    return torch.where(n_accepted > 0, tokens.gather(1, first_node[:, None])[:, 0], next_token)


def _chi2_rejects(samples, probs, alpha_z=3.090232):
    """Pearson chi-square of samples against probs (cells with expectation < 5 merged); True when the
    fit is rejected at alpha = 1e-3 (Wilson-Hilferty quantile)."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    exp = probs.double() * samples.shape[0]
    keep = exp >= 5
    stat = (((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    if exp[~keep].sum() > 0:
        stat = stat + (counts[~keep].sum() - exp[~keep].sum()) ** 2 / exp[~keep].sum()
        dof += 1
    crit = dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3
    return float(stat) > crit


def test_exact_rule_through_kernel_samples_the_target(triton_kernels, device):
    """Root with 2 children drafted from q without replacement (as sampled trees do), one grandchild
    each; the first committed token must follow p(root) exactly. Dividing by a q the drafts were not
    drawn from (uniform) is biased and must be caught.

    The interpreter runs one program per sample slowly, so on the CPU the chi-square statistics are
    taken over the torch reference's 4000 samples and the kernel is checked to give exactly the
    reference's outputs on the first 96 of them (both rules); on a GPU the kernel draws all 4000."""
    V, n = 6, 4000
    n_kernel = n if device.type == "cuda" else 96
    gen = torch.Generator().manual_seed(0)
    p_root = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    q_root = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.20, 0.60])  # far from p: many rejections
    parents = torch.tensor([-1, 0, 0, 1, 2])
    N = parents.shape[0]
    children = children_table(parents, 2)[None].expand(n, N, 2).contiguous()
    tokens = torch.zeros(n, N, dtype=torch.int64)
    tokens[:, 1:3] = torch.multinomial(q_root.expand(n, V), 2, replacement=False, generator=gen)
    tokens[:, 3:] = torch.randint(0, V, (n, 2), generator=gen)
    p = torch.softmax(torch.randn(N, V, generator=gen), -1)
    p[0] = p_root
    q = torch.softmax(torch.randn(N, V, generator=gen), -1)
    q[0] = q_root
    p, q = p[None].expand(n, N, V).contiguous(), q[None].expand(n, N, V).contiguous()
    u_accept = 1.0 - torch.rand(n, N, generator=gen)
    u_sample = 1.0 - torch.rand(n, generator=gen)
    for draft_q, biased in ((q, False), (torch.ones_like(q), True)):  # the second: the wrong draft distribution
        args = [tokens, children, p, draft_q, u_accept, u_sample]
        want = R.tree_verify(*args, None, 0.0, False, False, False, 2)
        got = triton_kernels.tree_verify(*[t[:n_kernel].to(device) for t in args], None, 0.0, False, False, False, 2)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w[:n_kernel]), biased
        outputs = got if n_kernel == n else want
        assert _chi2_rejects(_first_token(tokens, *[o.cpu() for o in (outputs[0], outputs[1], outputs[3])]),
                             p_root) == biased


def test_tree_verify_reads_strided_uniforms(triton_kernels, device):
    """The uniforms arrive as slices of one [B, 2, N] counter-RNG draw (the op takes any layout): the
    kernel reads them through their strides, with the results of contiguous copies."""
    tokens, children, p, q, u_accept, u_sample = tree_case(3, 9, 40, 3, 4, seed=5, sampled=False, device=device)
    u = torch.stack([u_accept, torch.cat([u_sample[:, None], torch.rand_like(u_accept[:, 1:])], 1)], 1)
    ua, us = u[:, 0], u[:, 1, 0]
    assert not ua.is_contiguous() and not us.is_contiguous()
    got = triton_kernels.tree_verify(tokens, children, p, q, ua, us, None, 0.0, False, False, False, 4)
    want = R.tree_verify(tokens, children, p, q, u_accept, u_sample, None, 0.0, False, False, False, 4)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
