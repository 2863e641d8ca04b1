"""Triton tree attention against the torch reference (interpreter on the CPU, compiled on a GPU)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vvs_engine.kernels import reference as R

import oracles as O

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def make_case(B, H, Q, S, D, P, dtype, device, seed, key_valid=False, strided_q=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, H, D, generator=gen).transpose(1, 2) if strided_q else torch.randn(B, H, Q, D, generator=gen)
    k = torch.randn(B, H, S, D, generator=gen)
    v = torch.randn(B, H, S, D, generator=gen)
    local = (torch.rand(Q, Q, generator=gen) < 0.4) | torch.eye(Q, dtype=torch.bool)
    valid = (torch.rand(B, S, generator=gen) < 0.8) if key_valid else None
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), torch.tensor([P], **to),
            local.to(**to), None if valid is None else valid.to(**to))


def check(triton_kernels, case, dtype, block_n=16):
    q, k, v, P, local, valid = case
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)  # poison: every element must be written
    got = triton_kernels.tree_attention(q, k, v, P, local, valid, block_n=block_n, out=out)
    want = R.tree_attention(q.float(), k.float(), v.float(), P, local, valid)
    rtol, atol = TOL[dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,Q,S,D,P", [
    (2, 3, 5, 37, 16, 20),  # odd sizes
    (1, 2, 7, 40, 24, 33),  # non-power-of-2 head dim, local block ends at S
    (2, 1, 17, 50, 16, 0),  # no prefix: local block only; Q spans two key tiles
    (1, 1, 3, 70, 32, 61),  # prefix spans several key tiles with a ragged last one
])
def test_tree_attention_matches_reference(triton_kernels, device, dtype, B, H, Q, S, D, P):
    check(triton_kernels, make_case(B, H, Q, S, D, P, dtype, device, seed=Q * S), dtype)


@pytest.mark.parametrize("rows", [1, 2])
def test_tree_attention_key_valid_and_strided_q(triton_kernels, device, rows):
    q, k, v, P, local, valid = make_case(2, 2, 6, 30, 16, 18, torch.float32, device, seed=3, key_valid=True, strided_q=True)
    check(triton_kernels, (q, k, v, P, local, valid[:rows]), torch.float32)


def test_tree_attention_on_cache_layer_views(triton_kernels, device):
    # The engine passes k_cache[l] / v_cache[l] slices of [L, B, H, S, D] and a transposed q.
    L, B, H, S, D, Q = 3, 2, 2, 24, 16, 4
    gen = torch.Generator().manual_seed(7)
    cache_k = torch.randn(L, B, H, S, D, generator=gen).to(device)
    cache_v = torch.randn(L, B, H, S, D, generator=gen).to(device)
    q = torch.randn(B, Q, H, D, generator=gen).to(device).transpose(1, 2)
    local = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()
    P = torch.tensor([15], device=device)
    check(triton_kernels, (q, cache_k[1], cache_v[1], P, local, None), torch.float32)


def test_tree_attention_equals_causal_attention_along_each_branch(triton_kernels, device):
    # vLLM's oracle: a tree node's output equals causal attention over its root -> node branch.
    gen = torch.Generator().manual_seed(11)
    parents = O.random_tree(9, 4, gen)
    mask, depth, paths, _ = R.tree_meta(parents, 4)
    B, H, D, P = 1, 2, 16, 6
    N = parents.shape[0]
    S = P + N
    q = torch.randn(B, H, N, D, generator=gen)
    k = torch.randn(B, H, S, D, generator=gen)
    v = torch.randn(B, H, S, D, generator=gen)
    got = triton_kernels.tree_attention(q.to(device), k.to(device), v.to(device), torch.tensor([P], device=device),
                                        mask.to(device), block_n=16).cpu()
    for node in range(N):
        branch = [int(j) for j in paths[node] if j >= 0]
        slots = list(range(P)) + [P + j for j in branch]
        ks, vs = k[:, :, slots], v[:, :, slots]
        chain = torch.nn.functional.scaled_dot_product_attention(q[:, :, node:node + 1], ks, vs)
        torch.testing.assert_close(got[:, :, node:node + 1], chain, rtol=2e-5, atol=2e-5)


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Q=st.integers(1, 20), D=st.sampled_from([8, 16, 20, 32]),
       P=st.integers(0, 45), extra=st.integers(0, 9), key_valid=st.booleans(), seed=st.integers(0, 2**31))
def test_tree_attention_fuzz(triton_kernels, B, H, Q, D, P, extra, key_valid, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case(B, H, Q, P + Q + extra, D, P, torch.float32, device, seed, key_valid=key_valid)
    if key_valid and P > 0:
        case[5][:, 0] = True  # keep at least one prefix key per row so no query sees nothing
    check(triton_kernels, case, torch.float32)


def test_tree_attention_more_queries_than_one_block(triton_kernels, device):
    # Q > 128 spreads the queries over several programs per (b, h); each streams the prefix itself.
    check(triton_kernels, make_case(1, 1, 133, 160, 16, 20, torch.float32, device, seed=5), torch.float32, block_n=64)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Q,P,splits", [
    (1, 4096, None),  # AR decode: the one-query kernel, split over the prefix as an H200 would
    (1, 37, 3),  # one query, splits with an empty share
    (60, 4096, None),  # a tree of 60 nodes over a long prefix (split-KV + merge)
    (70, 700, 3),  # 70 queries (block of 128), ragged splits
    (60, 0, 4),  # no prefix: every split but the last is empty
])
def test_tree_attention_split_kv_and_one_query(triton_kernels, device, D, Q, P, splits):
    case = make_case(1, 1, Q, P + Q + 5, D, P, torch.float32, device, seed=D + Q + P)
    check(triton_kernels, case, torch.float32, block_n=None)
    if splits is not None:
        q, k, v, prefix_len, local, valid = case
        out = torch.full(q.shape, float("nan"), device=device)
        got = triton_kernels.tree_attention(q, k, v, prefix_len, local, valid, num_splits=splits, out=out)
        torch.testing.assert_close(got, R.tree_attention(q, k, v, prefix_len, local, valid), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_attention_split_kv_half_precision_with_key_valid(triton_kernels, device, dtype):
    q, k, v, P, local, valid = make_case(2, 2, 1, 700, 64, 690, dtype, device, seed=9, key_valid=True)
    valid[:, 0] = True
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    got = triton_kernels.tree_attention(q, k, v, P, local, valid, num_splits=3, out=out)
    want = R.tree_attention(q.float(), k.float(), v.float(), P, local, valid)
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_tree_attention_split_choice():
    from vvs_engine.triton_kernels.tree_attention import launch_config, pick_splits

    cpu = torch.device("cpu")
    # LlamaGen-XL AR decode with CFG: 2 x 20 programs on 132 SMs -> split the 4096-slot prefix.
    assert pick_splits(40, 4104, cpu) == 7
    assert pick_splits(40, 200, cpu) == 1  # too short to be worth a split
    assert pick_splits(400, 4104, cpu) == 1  # enough programs already
    assert launch_config(1, 64)[0] == 1 and launch_config(60, 128)[0] == 64 and launch_config(70, 64)[0] == 128


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shared_mask", [False, True])
def test_tree_attention_per_row_lengths_and_trees(triton_kernels, device, splits, shared_mask):
    # A batch of sequences (CFG rows included), each at its own committed length with its own tree.
    B, H, Q, D, S = 3, 2, 7, 16, 50
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(B, H, Q, D, generator=gen).to(device)
    k = torch.randn(B, H, S, D, generator=gen).to(device)
    v = torch.randn(B, H, S, D, generator=gen).to(device)
    P = torch.tensor([0, 21, 43], device=device)  # the last one's block runs to the end of the cache
    local = ((torch.rand(B, Q, Q, generator=gen) < 0.4) | torch.eye(Q, dtype=torch.bool)).to(device)
    if shared_mask:
        local = local[:1].expand(B, Q, Q)
    out = torch.full(q.shape, float("nan"), device=device)
    got = triton_kernels.tree_attention(q, k, v, P, local, None, block_n=16, num_splits=splits, out=out)
    assert not got.isnan().any()
    torch.testing.assert_close(got, R.tree_attention(q, k, v, P, local, None), rtol=2e-5, atol=2e-5)
    for b in range(B):  # row b alone, with a shared length and mask, is the same computation
        alone = R.tree_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], P[b:b + 1], local[b], None)
        torch.testing.assert_close(got[b:b + 1], alone, rtol=2e-5, atol=2e-5)
