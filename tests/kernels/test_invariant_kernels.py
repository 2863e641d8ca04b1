"""Batch-invariant Triton kernels (``triton_kernels/invariant_matmul.py``, ``invariant_attention.py``):
a row's result has the same bits whatever the other rows of the call (the matmul's M, the attention's
batch and cache length), and is close to the torch reference (the CPU path). Run in the Triton
interpreter on the CPU (small odd shapes, outputs poisoned with NaN so an unwritten entry shows); on a
GPU they run compiled."""
import pytest
import torch

from vvs_engine.kernels import reference as R


def randn(*shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,N,bias", [(37, 50, True), (100, 70, False)], ids=["37x50-bias", "100x70"])
def test_matmul_rows_do_not_depend_on_M(triton_kernels, device, dtype, tol, K, N, bias):
    """Row 0 of M = 1 against M = 2..17 (and every row against the 17-row call, at any start): equal
    bit for bit; all of it close to the reference; a transposed (strided) x gives the same bits."""
    x = randn(20, K, seed=1, dtype=dtype, device=device)
    w = randn(N, K, seed=2, dtype=dtype, device=device) * 0.1
    b = randn(N, seed=3, dtype=dtype, device=device) if bias else None
    full = triton_kernels.invariant_linear(x[:17], w, b, out=poisoned((17, N), dtype, device))
    assert full.dtype == dtype and not full.isnan().any()
    torch.testing.assert_close(full.float(), R.invariant_linear(x[:17].cpu(), w.cpu(), None if b is None else b.cpu())
                               .float().to(device), rtol=tol, atol=tol)
    for M in range(1, 18):
        part = triton_kernels.invariant_linear(x[:M], w, b, out=poisoned((M, N), dtype, device))
        assert torch.equal(part, full[:M]), M
    for start in (1, 3):
        assert torch.equal(triton_kernels.invariant_linear(x[start:start + 5], w, b), full[start:start + 5])
    strided = x[:17].t().contiguous().t()  # the same values, column-major
    assert strided.stride() != x[:17].stride()
    assert torch.equal(triton_kernels.invariant_linear(strided, w, b), full)


def attention_inputs(B, H, Q, S, D, dtype, device, seed):
    q, k, v = (randn(B, H, n, D, seed=seed + i, dtype=dtype, device=device) for i, n in enumerate((Q, S, S)))
    g = torch.Generator().manual_seed(seed + 3)
    local = (torch.rand(B, Q, Q, generator=g) < 0.5) | torch.eye(Q, dtype=torch.bool)  # each sees itself
    prefix = torch.randint(0, S - Q + 1, (B,), generator=g)
    valid = torch.rand(B, S, generator=g) < 0.9
    return q, k, v, prefix.to(device), local.to(device), valid.to(device)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Q,D,with_valid", [(1, 16, False), (7, 24, True)], ids=["Q1-D16", "Q7-D24-key_valid"])
def test_attention_rows_do_not_depend_on_the_batch_or_cache_length(triton_kernels, device, dtype, tol, Q, D,
                                                                    with_valid, monkeypatch):
    """Row 0 (its own prefix length past two key splits, its own tree mask) alone and in batches of
    2..5 rows, and in a longer cache: the same bits; close to the reference; the output laid out as
    tree_attention's ([B, Q, H, D] memory seen as [B, H, Q, D]), every entry written. The split size
    is cut to 64 slots here (a quarter of the default) to keep the interpreter's time down."""
    import triton_kernels.invariant_attention as kernel

    SPLIT_KEYS = 64
    monkeypatch.setattr(kernel, "SPLIT_KEYS", SPLIT_KEYS)
    H, S = 2, 2 * SPLIT_KEYS + 77
    q, k, v, prefix, local, valid = attention_inputs(5, H, Q, S, D, dtype, device, seed=10)
    prefix[0] = 2 * SPLIT_KEYS + 41  # three prefix splits, the last cut at P
    valid = valid if with_valid else None

    def run(rows, k=k, v=v, valid=valid):
        out = poisoned((rows, Q, H, D), dtype, device).transpose(1, 2)
        got = triton_kernels.invariant_attention(q[:rows], k[:rows], v[:rows], prefix[:rows], local[:rows],
                                                 None if valid is None else valid[:rows], out=out)
        assert not got.isnan().any()
        return got

    alone = run(1)
    assert alone.stride() == torch.empty(1, Q, H, D).transpose(1, 2).stride()
    want = R.tree_attention(*(t.cpu() for t in (q, k, v, prefix, local)), None if valid is None else valid.cpu())
    for rows in range(2, 6):
        together = run(rows)
        assert torch.equal(together[:1], alone), rows
        torch.testing.assert_close(together.float().cpu(), want[:rows].float(), rtol=tol, atol=tol)
    # a longer cache (more, empty splits past the prefix): the same bits
    pad = lambda t: torch.cat([t, torch.randn_like(t[:, :, :SPLIT_KEYS + 5])], 2)
    longer_valid = None if valid is None else torch.cat([valid, valid[:, :SPLIT_KEYS + 5]], 1)
    assert torch.equal(run(1, pad(k), pad(v), longer_valid), alone)


def test_negative_control_tree_attentions_split_follows_the_batch(triton_kernels, device):
    """The plain tree_attention kernel sizes its key splits by the batch (``pick_splits``): the same row
    with the split count a batch of 1 gets and the one a batch of 64 gets differs in its bits (what
    the invariant kernel removes), though both are close to the reference."""
    from triton_kernels.tree_attention import pick_splits

    B, H, Q, S, D = 1, 2, 3, 1100, 16
    q, k, v, prefix, local, _ = attention_inputs(B, H, Q, S, D, torch.float32, device, seed=20)
    prefix[0] = S - Q
    few, many = pick_splits(64 * H, S, torch.device("cpu")), pick_splits(1 * H, S, torch.device("cpu"))
    assert few < many
    a = triton_kernels.tree_attention(q, k, v, prefix, local, num_splits=few)
    b = triton_kernels.tree_attention(q, k, v, prefix, local, num_splits=many)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.equal(a, b)
    c = triton_kernels.invariant_attention(q, k, v, prefix, local)
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["invariant_linear", "invariant_attention"])
def test_custom_ops_fakes_agree_with_the_triton_kernels(triton_kernels, device, monkeypatch, op):
    """``torch.ops.vvs.<op>`` run by the Triton kernel: schema, and the fake's shape, dtype and strides
    against the real output (what torch.compile and CUDA-graph capture rely on)."""
    from vvs_engine.kernels import backends

    monkeypatch.setenv(backends.ENV, "triton")
    assert backends.choose(op, device) == "triton"
    if op == "invariant_linear":
        args = (randn(5, 19, seed=1, device=device), randn(23, 19, seed=2, device=device), randn(23, seed=3, device=device))
    else:
        q, k, v, prefix, local, valid = attention_inputs(2, 2, 3, 40, 16, torch.float32, device, seed=4)
        args = (q, k, v, prefix, local, valid)
    torch.library.opcheck(getattr(torch.ops.vvs, op).default, args, test_utils=("test_schema", "test_faketensor"))
