"""Batch-invariant tree attention: ``tree_attention``'s contract (Q queries over the committed prefix
``[0, P)`` without a mask plus their local block ``[P, P + Q)`` under a ``Q x Q`` mask), with each
query's reduction order fixed by its own prefix length alone.

Why: ``tree_attention.py`` picks its number of key splits from the batch (``pick_splits``: programs
against the SM count) and sizes each split from it, so a query's partial sums, and the rounding of its
output, change with the batch size. Here the split is a fixed number of key slots (``SPLIT_KEYS``):
split ``s`` always covers slots ``[s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS)`` of the prefix (cut at
``P``), one more program takes the local block, and the merge adds the partial (max, sum, accumulator)
states one split after another in index order (a loop, not a tree reduction whose shape would follow
the split count). Splits past the prefix contribute exact zeros, so the result does not depend on the
cache length either. The tile sizes follow the query count and head dim (``launch_config``), which a
round gives every row alike. The "Defeating Nondeterminism in LLM Inference" recipe for attention:
a fixed split size, not a fixed split count.

Reference (and the CPU path): ``vvs_engine.kernels.reference.tree_attention``.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .tree_attention import _online_softmax_step, _scores, launch_config
from . import _unshadow

_unshadow("tree_attention")  # the package attribute stays tree_attention's launcher

# Key slots per split: a multiple of every BLOCK_N of launch_config, and tree_attention's smallest
# worthwhile split.
SPLIT_KEYS = 256


@triton.jit
def _invariant_attention_kernel(
    q_ptr, k_ptr, v_ptr, part_acc_ptr, part_ml_ptr, prefix_len_ptr, local_ptr, key_valid_ptr,
    n_heads, n_queries, n_slots, n_parts, qk_scale_log2,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_pb, stride_lb, stride_lq, stride_lk, stride_validb, stride_valids,
    HEAD_DIM: tl.constexpr, HAS_KEY_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b * H + h, query block, part): part < n_parts - 1 is the prefix split of that index,
    the last part the local block. Each writes its fp32 (acc, max, sum) for the merge."""
    ONE_QUERY: tl.constexpr = BLOCK_Q == 1
    bh = tl.program_id(0)
    b = bh // n_heads
    h = bh % n_heads
    part = tl.program_id(2)
    offs_q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = offs_q < n_queries
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_q[:, None] * stride_qq + offs_d[None, :] * stride_qd,
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    prefix_len = tl.minimum(tl.load(prefix_len_ptr + b * stride_pb), n_slots)  # P > S: all S slots, as the reference
    is_local = part == n_parts - 1
    # A prefix split: its fixed slot range cut at P (empty past it); the local part: no prefix keys.
    lo = tl.where(is_local, 0, part * SPLIT_KEYS)
    hi = tl.where(is_local, 0, tl.minimum(lo + SPLIT_KEYS, prefix_len))

    m_i = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_s = start + offs_n
        key_ok = offs_s < hi
        if HAS_KEY_VALID:
            valid = tl.load(key_valid_ptr + b * stride_validb + offs_s * stride_valids, mask=key_ok, other=0)
            key_ok = key_ok & (valid != 0)
        k_t = tl.load(k_base + offs_s[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                      mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + offs_s[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                         mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            k_t = k_t.to(tl.float32)
            v_tile = v_tile.to(tl.float32)
        scores = tl.where(key_ok[None, :], _scores(q, k_t, qk_scale_log2, ONE_QUERY, DOT_PRECISION), float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v_tile, m_i, l_i, acc, ONE_QUERY, DOT_PRECISION)

    local_end = tl.where(is_local, n_queries, 0)
    for start in range(0, local_end, BLOCK_N):
        offs_j = start + offs_n
        slot = prefix_len + offs_j
        key_ok = (offs_j < n_queries) & (slot < n_slots)
        visible = tl.load(local_ptr + b * stride_lb + offs_q[:, None] * stride_lq + offs_j[None, :] * stride_lk,
                          mask=q_ok[:, None] & key_ok[None, :], other=0) != 0
        k_t = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                      mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                         mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            k_t = k_t.to(tl.float32)
            v_tile = v_tile.to(tl.float32)
        scores = tl.where(visible, _scores(q, k_t, qk_scale_log2, ONE_QUERY, DOT_PRECISION), float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v_tile, m_i, l_i, acc, ONE_QUERY, DOT_PRECISION)

    row = (bh * n_parts + part) * n_queries + offs_q
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + row * 2, m_i, mask=q_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=q_ok)


@triton.jit
def _merge_in_order_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, n_heads, n_queries, n_parts,
    stride_ob, stride_oh, stride_oq, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (b, h, query): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, summed
    over the parts in index order (the order does not follow the number of parts)."""
    pid = tl.program_id(0)
    bh = pid // n_queries
    qi = pid % n_queries
    b = bh // n_heads
    h = bh % n_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    first = (bh * n_parts) * n_queries + qi
    m_max = tl.load(part_ml_ptr + first * 2)
    for s in range(1, n_parts):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (first + s * n_queries) * 2))  # exact: order-free
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    l_sum = 0.0
    for s in range(0, n_parts):
        row = first + s * n_queries
        w = tl.exp2(tl.load(part_ml_ptr + row * 2) - m_max)
        l_sum = l_sum + w * tl.load(part_ml_ptr + row * 2 + 1)
        acc = acc + w * tl.load(part_acc_ptr + row * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    out = acc / l_sum  # nothing visible: 0/0 = NaN, like SDPA with an all-False mask row
    tl.store(out_ptr + b * stride_ob + h * stride_oh + qi * stride_oq + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                        local: torch.Tensor, key_valid: torch.Tensor | None = None, *,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``tree_attention``'s arguments and result (q [B, H, Q, D]; k, v [B, H, S, D]; prefix_len [1] or
    [B]; local [Q, Q] or [B, Q, Q]; key_valid [B or 1, S] or None -> [B, H, Q, D] in q's dtype, laid out
    as [B, Q, H, D]), with a fixed key split size and an in-order merge: a query's bits depend on its
    row's inputs alone, not on B or S."""
    B, H, Q, D = q.shape
    S = k.shape[2]
    if out is None:
        out = torch.empty((B, Q, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    local_u8 = local.to(torch.bool).view(torch.uint8)
    if key_valid is not None:
        valid_u8 = key_valid.to(torch.bool).view(torch.uint8)
        stride_validb = valid_u8.stride(0) if valid_u8.shape[0] > 1 else 0
        stride_valids = valid_u8.stride(1)
    else:
        valid_u8, stride_validb, stride_valids = local_u8, 0, 0  # never read
    upcast = q.dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") == "1"
    block_q, block_n, num_warps = launch_config(Q, D)
    block_d = max(16, triton.next_power_of_2(D))
    q_blocks = triton.cdiv(Q, block_q)
    n_parts = triton.cdiv(S, SPLIT_KEYS) + 1  # the prefix splits of the whole cache, then the local block
    part_acc = torch.empty((B * H * n_parts * Q, D), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((B * H * n_parts * Q, 2), dtype=torch.float32, device=q.device)
    _invariant_attention_kernel[(B * H, q_blocks, n_parts)](
        q, k, v, part_acc, part_ml, prefix_len, local_u8, valid_u8,
        H, Q, S, n_parts, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(),
        prefix_len.stride(0) if prefix_len.numel() > 1 else 0, local_u8.stride(0) if local_u8.dim() == 3 else 0,
        local_u8.stride(-2), local_u8.stride(-1), stride_validb, stride_valids,
        HEAD_DIM=D, HAS_KEY_VALID=key_valid is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", DOT_UPCAST=upcast,
        SPLIT_KEYS=SPLIT_KEYS, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )
    _merge_in_order_kernel[(B * H * Q,)](
        part_acc, part_ml, out, H, Q, n_parts, *out.stride(),
        HEAD_DIM=D, BLOCK_D=block_d, num_warps=4 if D >= 128 else 2,
    )
    return out
