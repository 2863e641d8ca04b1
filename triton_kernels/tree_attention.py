"""Tree attention: Q queries (draft-tree nodes, a pending skipped chain, a Jacobi window) whose K/V
already sit in cache slots ``[P, P + Q)`` attend to the committed prefix ``[0, P)`` without a mask and
to the local block under a ``Q x Q`` visibility mask.

Design (the SGLang Triton extend-attention pattern): the grid is ``(B * H, cdiv(Q, BLOCK_Q))`` and does
not depend on the prefix length ``P``, which the kernel reads from a device tensor, so one compiled
kernel (and one CUDA graph) serves every length. With ``Q <= 128`` every tree fits one query block, so
each prefix K/V tile is loaded once per (batch row, head) and shared by all tree queries. Stage 1
loops over the prefix with no mask read (only ``key_valid`` for padded condition slots); stage 2 walks
the local block and applies the mask. One online-softmax state (fp32) spans both stages.

Reference: ``vvs_engine.kernels.reference.tree_attention``.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(scores, v_tile, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores [BQ, BN] (masked = -inf) and its values [BN, BD] into the running
    (max, sum, accumulator). ``m_i`` starts at a finite -1e30 so fully masked tiles give exp2(-inf) = 0
    instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    prob = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(prob, 1)
    acc = acc * alpha[:, None] + tl.dot(prob.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION,
                                        out_dtype=tl.float32)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, prefix_len_ptr, local_ptr, key_valid_ptr,
    n_heads, n_queries, n_slots, qk_scale_log2,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_lq, stride_lk, stride_validb, stride_valids,
    HEAD_DIM: tl.constexpr, HAS_KEY_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // n_heads
    h = bh % n_heads
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
    prefix_len = tl.load(prefix_len_ptr)

    m_i = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    # Stage 1: the committed prefix, visible to every query (no mask read).
    for start in range(0, prefix_len, BLOCK_N):
        offs_s = start + offs_n
        key_ok = offs_s < prefix_len
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
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION, out_dtype=tl.float32) * qk_scale_log2
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v_tile, m_i, l_i, acc, DOT_PRECISION)

    # Stage 2: the local block in slots [P, P + Q), under the Q x Q visibility mask.
    for start in range(0, n_queries, BLOCK_N):
        offs_j = start + offs_n
        slot = prefix_len + offs_j
        key_ok = (offs_j < n_queries) & (slot < n_slots)
        visible = tl.load(local_ptr + offs_q[:, None] * stride_lq + offs_j[None, :] * stride_lk,
                          mask=q_ok[:, None] & key_ok[None, :], other=0) != 0
        k_t = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                      mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                         mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            k_t = k_t.to(tl.float32)
            v_tile = v_tile.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION, out_dtype=tl.float32) * qk_scale_log2
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v_tile, m_i, l_i, acc, DOT_PRECISION)

    # A query that sees nothing gets 0/0 = NaN, like SDPA with an all-False mask row.
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_q[:, None] * stride_oq + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                   local: torch.Tensor, key_valid: torch.Tensor | None = None, *,
                   block_n: int = 64, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D]; k, v [B, H, S, D] (any strides); prefix_len [1] int64; local [Q, Q] bool;
    key_valid [B or 1, S] bool or None -> [B, H, Q, D] in q's dtype (written into ``out`` if given)."""
    B, H, Q, D = q.shape
    S = k.shape[2]
    if out is None:
        out = torch.empty((B, H, Q, D), dtype=q.dtype, device=q.device)
    # uint8 views: one byte per mask entry, loaded as integers (bool pointers are awkward in Triton).
    local_u8 = local.to(torch.bool).view(torch.uint8)
    if key_valid is not None:
        valid_u8 = key_valid.to(torch.bool).view(torch.uint8)
        stride_validb = valid_u8.stride(0) if valid_u8.shape[0] > 1 else 0
        stride_valids = valid_u8.stride(1)
    else:
        valid_u8, stride_validb, stride_valids = local_u8, 0, 0  # never read
    # The Triton 3.9 interpreter computes bf16 tl.dot wrongly, so on the CPU the tiles are widened to
    # fp32 first; GPUs run the native half-precision dot with fp32 accumulation.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    # One query block holds a whole tree (Q <= 128), so the prefix is streamed once per (b, h).
    block_q = max(16, min(128, triton.next_power_of_2(Q)))
    block_d = max(16, triton.next_power_of_2(D))
    grid = (B * H, triton.cdiv(Q, block_q))
    _tree_attention_kernel[grid](
        q, k, v, out, prefix_len, local_u8, valid_u8,
        H, Q, S, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        local_u8.stride(0), local_u8.stride(1), stride_validb, stride_valids,
        HEAD_DIM=D, HAS_KEY_VALID=key_valid is not None,
        # fp32 inputs: full-precision dots (TF32 would miss the reference by ~1e-3).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=8 if block_q >= 128 else 4,
    )
    return out
