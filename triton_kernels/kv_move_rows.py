"""Per-row KV move in one launch: in every layer, row and head of the cache, slots ``dst[r]`` take what
slots ``src[r]`` held (the accepted path of a verified tree moved after the committed prefix; a Jacobi
window moved from its scratch slots to each row's own).

Torch needs two kernels for it (a gather of the source slots, then a scatter), because a source slot
of one entry can be the destination of another. Here one program per (layer, row, head) loads all of
its row's source slots, waits at a barrier until every thread of the program has loaded, then stores:
the same result with one launch, and K and V move in the same program.

Reference: ``vvs_engine.kernels.reference.kv_move_rows``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_move_rows_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, n_rows, n_heads, n_moves, head_dim,
                         stride_kl, stride_kr, stride_kh, stride_ks, stride_vl, stride_vr, stride_vh, stride_vs,
                         stride_src, stride_dst, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    h = pid % n_heads
    r = (pid // n_heads) % n_rows
    layer = pid // (n_heads * n_rows)
    j = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    moving = j < n_moves
    src = tl.load(src_ptr + r * stride_src + j, mask=moving, other=0)
    dst = tl.load(dst_ptr + r * stride_dst + j, mask=moving, other=0)
    k_base = k_ptr + layer * stride_kl + r * stride_kr + h * stride_kh
    v_base = v_ptr + layer * stride_vl + r * stride_vr + h * stride_vh
    for d0 in range(0, head_dim, BLOCK_D):
        cols = d0 + d
        ok = moving[:, None] & (cols[None, :] < head_dim)
        k_tile = tl.load(k_base + src[:, None] * stride_ks + cols[None, :], mask=ok)
        v_tile = tl.load(v_base + src[:, None] * stride_vs + cols[None, :], mask=ok)
        tl.debug_barrier()  # every source slot of this chunk is read before any destination is written
        tl.store(k_base + dst[:, None] * stride_ks + cols[None, :], k_tile, mask=ok)
        tl.store(v_base + dst[:, None] * stride_vs + cols[None, :], v_tile, mask=ok)


def kv_move_rows(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place on K and V [L, R, H, S, D] (last dim contiguous): for every layer and head, row r's slots
    ``dst[r]`` take the values its slots ``src[r]`` held before the call. src, dst [R, n] int64."""
    L, R, H, S, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kv_move_rows needs K and V with a contiguous head dimension")
    n = src.shape[1]
    src, dst = src.to(torch.long).contiguous(), dst.to(torch.long).contiguous()
    _kv_move_rows_kernel[(L * R * H,)](
        k, v, src, dst, R, H, n, D, *k.stride()[:4], *v.stride()[:4], src.stride(0), dst.stride(0),
        BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_D=min(128, max(16, triton.next_power_of_2(D))))
