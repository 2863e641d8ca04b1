"""Tree attention: Q queries (draft-tree nodes, a pending skipped chain, a Jacobi window, or one AR
query) whose K/V already sit in cache slots ``[P, P + Q)`` attend to the committed prefix ``[0, P)``
without a mask and to the local block under a ``Q x Q`` visibility mask. The prefix length and the
mask are either shared by every row or given per row (a batch of sequences, each at its own length
with its own tree).

Design (the SGLang Triton extend-attention pattern plus flash-decoding's split over the keys): the
grid is ``(B * H, cdiv(Q, BLOCK_Q), n_splits)`` and does not depend on the prefix length ``P``, which
the kernel reads from a device tensor, so one compiled kernel (and one CUDA graph) serves every length.
Split ``s`` streams its share of the prefix with no mask read (only ``key_valid`` for padded condition
slots); the last split also walks the local block under the mask. One online-softmax state (fp32) per
split; with several splits a small reduction kernel merges the partial (max, sum, accumulator) triples.
``n_splits`` is picked on the host from static shapes (batch x heads x query blocks against the SM
count, and the cache length), so the launch stays static. ``BLOCK_Q = 1`` (AR decode) replaces the
tensor-core dot by a broadcast multiply-reduce: a 16-row query tile would be 15/16 padding.

Reference: ``vvs_engine.kernels.reference.tree_attention``.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# Fewest prefix keys worth a split of their own: below this the partial write-back and the reduction
# cost more than the extra parallelism gains.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# SM count assumed off the GPU (the interpreter), so CPU tests pick the same splits an H200 would.
DEFAULT_SMS = 132


def launch_config(n_queries: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps) by query count and head dim. A heuristic table (not yet measured
    on a GPU): a whole tree (Q <= 128) in one query block so each prefix tile is loaded once per
    (row, head); narrower key tiles at head dim 128 to bound registers (acc is BLOCK_Q x D fp32)."""
    if n_queries == 1:
        return 1, (128 if head_dim <= 64 else 64), 4
    block_q = max(16, min(128, triton.next_power_of_2(n_queries)))
    block_n = 64 if head_dim <= 64 or block_q <= 32 else 32
    return block_q, block_n, (8 if block_q >= 128 else 4)


def pick_splits(programs: int, n_slots: int, device: torch.device) -> int:
    """Key splits so that ``programs * splits`` fills about two waves of SMs, each split keeping at least
    ``MIN_KEYS_PER_SPLIT`` of the ``n_slots`` cache slots."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    want = triton.cdiv(2 * sms, max(1, programs))
    return max(1, min(want, n_slots // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


@triton.jit
def _scores(q, k_t, qk_scale_log2, ONE_QUERY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Base-2 scaled scores [BQ, BN] of q [BQ, BD] against k_t [BD, BN]."""
    if ONE_QUERY:
        s = tl.sum(q.to(tl.float32)[:, :, None] * k_t.to(tl.float32)[None, :, :], 1)
    else:
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    return s * qk_scale_log2


@triton.jit
def _online_softmax_step(scores, v_tile, m_i, l_i, acc, ONE_QUERY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores [BQ, BN] (masked = -inf) and its values [BN, BD] into the running
    (max, sum, accumulator). ``m_i`` starts at a finite -1e30 so fully masked tiles give exp2(-inf) = 0
    instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    prob = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(prob, 1)
    if ONE_QUERY:
        pv = tl.sum(prob[:, :, None] * v_tile.to(tl.float32)[None, :, :], 1)
    else:
        pv = tl.dot(prob.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, prefix_len_ptr, local_ptr, key_valid_ptr,
    n_heads, n_queries, n_slots, n_splits, qk_scale_log2,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_pb, stride_lb, stride_lq, stride_lk, stride_validb, stride_valids,
    HEAD_DIM: tl.constexpr, HAS_KEY_VALID: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    ONE_QUERY: tl.constexpr = BLOCK_Q == 1
    bh = tl.program_id(0)
    b = bh // n_heads
    h = bh % n_heads
    split = tl.program_id(2)
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
    prefix_len = tl.minimum(tl.load(prefix_len_ptr + b * stride_pb), n_slots)  # P > S: the reference sees all S slots
    # This split's share of the prefix, in whole key tiles (the last splits may get nothing).
    per_split = tl.cdiv(tl.cdiv(prefix_len, n_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, prefix_len)

    m_i = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    # Stage 1: the committed prefix, visible to every query (no mask read).
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
        scores = _scores(q, k_t, qk_scale_log2, ONE_QUERY, DOT_PRECISION)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v_tile, m_i, l_i, acc, ONE_QUERY, DOT_PRECISION)

    # Stage 2 (last split only): the local block in slots [P, P + Q), under the Q x Q visibility mask.
    local_end = tl.where(split == n_splits - 1, n_queries, 0)
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
        scores = _scores(q, k_t, qk_scale_log2, ONE_QUERY, DOT_PRECISION)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v_tile, m_i, l_i, acc, ONE_QUERY, DOT_PRECISION)

    if SPLIT:
        # Partial state of (bh, split, query): acc [D] fp32 and (m, l); the reduction kernel merges them.
        row = (bh * n_splits + split) * n_queries + offs_q
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=q_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=q_ok)
    else:
        # A query that sees nothing gets 0/0 = NaN, like SDPA with an all-False mask row.
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_q[:, None] * stride_oq + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, n_heads, n_queries, n_splits,
    stride_ob, stride_oh, stride_oq, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (b, h, query): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    pid = tl.program_id(0)
    bh = pid // n_queries
    qi = pid % n_queries
    b = bh // n_heads
    h = bh % n_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    row = (bh * n_splits + offs_s) * n_queries + qi
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=-1.0e30)
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # nothing visible: 0/0 = NaN, as unsplit
    tl.store(out_ptr + b * stride_ob + h * stride_oh + qi * stride_oq + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                   local: torch.Tensor, key_valid: torch.Tensor | None = None, *,
                   block_n: int | None = None, num_splits: int | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D]; k, v [B, H, S, D] (any strides); prefix_len [1] or [B] int64 (one length per
    row); local [Q, Q] or [B, Q, Q] bool (one local block per row: batched trees); key_valid [B or 1, S] bool or None -> [B, H, Q, D] in q's dtype (written into ``out`` if given).
    ``block_n`` / ``num_splits`` override ``launch_config`` / ``pick_splits`` (tests use them)."""
    B, H, Q, D = q.shape
    S = k.shape[2]
    if out is None:  # [B, Q, H, D] memory seen as [B, H, Q, D]: the output projection reads it without a copy
        out = torch.empty((B, Q, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
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
    block_q, table_block_n, num_warps = launch_config(Q, D)
    block_n = block_n or table_block_n
    block_d = max(16, triton.next_power_of_2(D))
    q_blocks = triton.cdiv(Q, block_q)
    splits = num_splits or pick_splits(B * H * q_blocks, S, q.device)
    if splits > 1:
        part_acc = torch.empty((B * H * splits * Q, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((B * H * splits * Q, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # never touched
    _tree_attention_kernel[(B * H, q_blocks, splits)](
        q, k, v, out, part_acc, part_ml, prefix_len, local_u8, valid_u8,
        H, Q, S, splits, (1.0 / math.sqrt(D)) * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        prefix_len.stride(0) if prefix_len.numel() > 1 else 0, local_u8.stride(0) if local_u8.dim() == 3 else 0,
        local_u8.stride(-2), local_u8.stride(-1), stride_validb, stride_valids,
        HEAD_DIM=D, HAS_KEY_VALID=key_valid is not None,
        # fp32 inputs: full-precision dots (TF32 would miss the reference by ~1e-3).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast, SPLIT=splits > 1,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )
    if splits > 1:
        _merge_splits_kernel[(B * H * Q,)](
            part_acc, part_ml, out, H, Q, splits, *out.stride(),
            HEAD_DIM=D, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4 if D >= 128 else 2,
        )
    return out
