"""One expansion step of the dynamic (EAGLE-2) draft tree in one launch.

Between two drafter forwards the tree build used a dozen small kernels per level (cumulative scores,
top-K, four gathers, the CFG row copy, the ancestor-column concatenation, the attention mask's clone
and scatter). Here program b (one sequence) does all of it: it forms the K*C cumulative scores in
registers, selects the K best by K rounds of max + lowest index (largest first, ties to the lower
index), and for each chosen child writes, in each of the sequence's CFG rows, its token, its
parent's drafter output, its ancestor columns (the parent's + its own) and its attention row over the
drafter cache as an additive mask (0 at the committed prefix and its scratch ancestors at
``prefix_len + column``, -inf elsewhere). With the
target's embedding table it writes the drafter's whole input row instead of the parent's output alone:
[embedding of the child's token | parent's output], what the drafter's fc GEMM reads.

Reference: ``vvs_engine.kernels.reference.tree_level``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_level_kernel(score_ptr, clp_ptr, ctok_ptr, feats_ptr, anc_ptr, plen_ptr, emb_ptr,
                       cum_ptr, best_ptr, tok_ptr, score_next_ptr, feats_next_ptr, anc_next_ptr, vis_ptr,
                       B, C, D, W, S, REP,
                       K: tl.constexpr, BLOCK_KC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_S: tl.constexpr, EMBED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    KC = K * C
    kc = tl.arange(0, BLOCK_KC)
    in_kc = kc < KC
    parent_score = tl.load(score_ptr + b * K + kc // C, mask=in_kc, other=0.0)
    child_lp = tl.load(clp_ptr + b * KC + kc, mask=in_kc, other=float("-inf"))
    cum = parent_score + child_lp
    tl.store(cum_ptr + b * KC + kc, cum, mask=in_kc)
    alive = in_kc
    dd = tl.arange(0, BLOCK_D)
    ww = tl.arange(0, BLOCK_W)
    ss = tl.arange(0, BLOCK_S)
    WK = W + K
    OUT_D = 2 * D if EMBED else D  # a feats_next row: [embedding | parent output] or the parent output
    OFF = D if EMBED else 0
    for j in tl.static_range(K):
        m = tl.max(tl.where(alive, cum, float("-inf")), axis=0)
        sel = tl.min(tl.where(alive & (cum == m), kc, BLOCK_KC), axis=0).to(tl.int64)
        alive = alive & (kc != sel)
        tl.store(best_ptr + b * K + j, sel)
        tl.store(score_next_ptr + b * K + j, m)
        tok = tl.load(ctok_ptr + b * KC + sel)
        parent = sel // C
        for r in range(REP):
            row = b + r * B
            tl.store(tok_ptr + row * K + j, tok)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + dd
                f = tl.load(feats_ptr + (row * K + parent) * D + d, mask=d < D)
                tl.store(feats_next_ptr + (row * K + j) * OUT_D + OFF + d, f, mask=d < D)
                if EMBED:
                    e = tl.load(emb_ptr + tok * D + d, mask=d < D)
                    tl.store(feats_next_ptr + (row * K + j) * OUT_D + d, e.to(feats_next_ptr.dtype.element_ty), mask=d < D)
            a = tl.load(anc_ptr + (row * K + parent) * W + ww, mask=ww < W, other=0) != 0
            a = tl.where(ww < W, a, (ww - W) == j)
            tl.store(anc_next_ptr + (row * K + j) * WK + ww, a.to(tl.uint8), mask=ww < WK)
            plen = tl.load(plen_ptr + row)
            for s0 in range(0, S, BLOCK_S):
                slot = s0 + ss
                col = slot - plen
                seen = tl.load(anc_ptr + (row * K + parent) * W + col, mask=(col >= 0) & (col < W), other=0) != 0
                seen = seen | (col == W + j)
                vis = (col < 0) | seen
                tl.store(vis_ptr + (row * K + j) * S + slot, tl.where(vis, 0.0, float("-inf")).to(vis_ptr.dtype.element_ty),
                         mask=slot < S)


def tree_level(score: torch.Tensor, child_logp: torch.Tensor, child_tokens: torch.Tensor, feats: torch.Tensor,
               anc: torch.Tensor, prefix_len: torch.Tensor, n_slots: int, embedding: torch.Tensor | None = None,
               *, out=None):
    """See ``reference.tree_level``: score [B, K], child_logp / child_tokens [B, K, C], feats [R, K, D],
    anc [R, K, W] bool, prefix_len [R], embedding [V, D] or None -> (cum, best, tokens, score_next,
    feats_next ([R, K, 2D] with an embedding), anc_next, mask_next). ``out``: the seven output tensors to
    write (else new ones)."""
    B, K, C = child_logp.shape
    R, _, D = feats.shape
    W = anc.shape[2]
    dtype = torch.promote_types(score.dtype, child_logp.dtype)
    dev = score.device
    if out is None:
        out = (torch.empty((B, K * C), dtype=dtype, device=dev), torch.empty((B, K), dtype=torch.long, device=dev),
               torch.empty((R, K), dtype=torch.long, device=dev), torch.empty((B, K), dtype=dtype, device=dev),
               torch.empty((R, K, 2 * D if embedding is not None else D), dtype=feats.dtype, device=dev),
               torch.empty((R, K, W + K), dtype=torch.bool, device=dev),
               torch.empty((R, K, n_slots), dtype=feats.dtype, device=dev))
    cum, best, tokens, score_next, feats_next, anc_next, mask_next = out
    _tree_level_kernel[(B,)](
        score.to(dtype).contiguous(), child_logp.to(dtype).contiguous(), child_tokens.contiguous(),
        feats.contiguous(), anc.contiguous().view(torch.uint8), prefix_len.to(torch.long).contiguous(),
        embedding.contiguous() if embedding is not None else feats,  # never read without EMBED
        cum, best, tokens, score_next, feats_next, anc_next.view(torch.uint8), mask_next,
        B, C, D, W, n_slots, R // B,
        K=K, BLOCK_KC=triton.next_power_of_2(K * C), BLOCK_D=min(1024, triton.next_power_of_2(D)),
        BLOCK_W=triton.next_power_of_2(W + K), BLOCK_S=min(1024, triton.next_power_of_2(n_slots)),
        EMBED=embedding is not None)
    return out
