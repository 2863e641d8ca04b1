"""Per-row KV move (Triton, under the interpreter on the CPU) against the torch reference: overlapping
source and destination slots, odd head dims, poisoned (untouched) slots, and the op's schema."""
import pytest
import torch

from vvs_engine.kernels import ops
from vvs_engine.kernels import reference as R


def _cache(L, B, H, S, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, B, H, S, D, generator=g, dtype=torch.float64).to(dtype).to(device)
    v = torch.randn(L, B, H, S, D, generator=g, dtype=torch.float64).to(dtype).to(device)
    return k, v


def _moves(B, S, n, seed, overlap):
    """src, dst [B, n] per row; with ``overlap`` each row moves an accepted tree path back to the slots
    right after its prefix (dst[j] = P + j <= src[j] = P + node_j, node ids increasing along the path),
    so a destination slot can be another entry's source."""
    g = torch.Generator().manual_seed(seed)
    src, dst = [], []
    for _ in range(B):
        if overlap:
            P = int(torch.randint(0, S - 3 * n, (1,), generator=g))
            nodes = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values
            nodes[0] = 0
            src.append(P + nodes)
            dst.append(P + torch.arange(n))
        else:
            perm = torch.randperm(S, generator=g)
            src.append(perm[:n])
            dst.append(perm[n:2 * n])
    return torch.stack(src), torch.stack(dst)


@pytest.mark.parametrize("L,B,H,S,D,n,overlap,dtype", [
    (2, 3, 4, 64, 32, 6, True, torch.float32), (1, 2, 3, 50, 33, 5, True, torch.float64),
    (3, 1, 2, 40, 8, 7, False, torch.float32), (1, 4, 1, 130, 160, 16, True, torch.bfloat16)])
def test_kv_move_rows_matches_reference(triton_kernels, device, L, B, H, S, D, n, overlap, dtype):
    k, v = _cache(L, B, H, S, D, dtype, device, seed=n)
    src, dst = (t.to(device) for t in _moves(B, S, n, seed=D, overlap=overlap))
    want_k, want_v = k.clone(), v.clone()
    R.kv_move_rows(want_k, want_v, src, dst)
    triton_kernels.kv_move_rows(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # copies: bit-exact, other slots untouched


def test_reference_moves_what_the_slots_held_before():
    """The oracle itself: entry j of row b takes what slot src[b, j] held before the call, even when
    that slot is another entry's destination; every other slot is unchanged."""
    k, v = _cache(2, 2, 3, 30, 4, torch.float32, "cpu", seed=1)
    src, dst = torch.tensor([[3, 5, 9], [0, 2, 4]]), torch.tensor([[3, 4, 5], [1, 2, 3]])
    before_k, before_v = k.clone(), v.clone()
    R.kv_move_rows(k, v, src, dst)
    for b in range(2):
        for j in range(3):
            assert torch.equal(k[:, b, :, dst[b, j]], before_k[:, b, :, src[b, j]])
            assert torch.equal(v[:, b, :, dst[b, j]], before_v[:, b, :, src[b, j]])
        untouched = [s for s in range(30) if s not in dst[b].tolist()]
        assert torch.equal(k[:, b, :, untouched], before_k[:, b, :, untouched])


def test_kv_compact_per_row_goes_through_the_op():
    k, v = _cache(1, 2, 2, 20, 4, torch.float32, "cpu", seed=2)
    src, dst = _moves(2, 20, 4, seed=3, overlap=True)
    want_k, want_v = k.clone(), v.clone()
    R.kv_compact(want_k, want_v, src, dst)
    ops.kv_move_rows(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    torch.library.opcheck(ops.kv_move_rows, (k, v, src, dst), test_utils=("test_schema", "test_faketensor"))
