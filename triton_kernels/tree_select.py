"""The end of a dynamic (EAGLE-2) draft tree build in one launch: selection and tree structure.

After its levels the build picks the best ``n_nodes - 1`` of its C candidates (C = K + depth * K * K,
410 at K = 10, depth 4) and forms their tree. Inlined in a compiled round that was ~11 kernels and aten
fallbacks (the penalised scores, ``topk``, ``sort``, the parent lookup by ``searchsorted``, the token and
log-prob gathers, the structure's scatters and reductions). Here program b (one sequence) does it all in
three stages that hand over through global memory (``tl.debug_barrier`` between them):

1. selection by rank: ``rank_i = #{j: s_j > s_i} + #{j < i: s_j == s_i}`` over the penalised, sanitised
   scores, counted in [BLOCK_I, BLOCK_J] tiles (never a [C, C] one); candidate i is taken iff
   ``rank_i < n_sel`` (the n_sel largest, ties to the lower id: ``reference.stable_topk``), and the
   exclusive prefix count of taken candidates before i (scratch) numbers the nodes in increasing id;
2. for every taken candidate: its node's token, draft log-prob and parent (the parent's global id from
   the frontier table, its node from the prefix count, as ``searchsorted`` finds it);
3. per block of nodes, from the parents: the ancestor mask (parent links followed ``max_depth`` times),
   depths (ancestors - 1), root -> node paths, leaf flags and the children table in increasing id
   (sibling rank from a running count), all as ``drafting.tree.tree_structure`` defines them.

Reference: ``vvs_engine.kernels.reference.tree_select``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _nan_to_num(x, POS_FILL: tl.constexpr, NEG_FILL: tl.constexpr):
    # torch.nan_to_num(x, neginf=NEG_FILL): NaN -> 0, +inf -> the dtype's largest finite value. The fill
    # values are made in x's dtype (tl.full): a float literal would be a float32 constant.
    x = tl.where(x != x, tl.zeros_like(x), x)
    x = tl.where(x == float("inf"), tl.full(x.shape, POS_FILL, x.dtype), x)
    return tl.where(x == float("-inf"), tl.full(x.shape, NEG_FILL, x.dtype), x)


@triton.jit
def _parent_hop(par_row_ptr, node, N):
    # One step up the tree; the root (parent -1) and the sentinel N step to N (tree_structure's
    # ``parents % (N + 1)`` padded with N).
    p = tl.load(par_row_ptr + node, mask=node < N, other=-1)
    return tl.where(p >= 0, p, N)


@triton.jit
def _tree_select_kernel(score_ptr, penalty_ptr, frontier_ptr, foff_ptr, pcol_ptr, ctok_ptr, clp_ptr,
                        tok_ptr, par_ptr, mask_ptr, depth_ptr, paths_ptr, leaf_ptr, child_ptr, lp_ptr,
                        before_ptr, taken_ptr,
                        C, F, N, n_sel,
                        MAX_DEPTH: tl.constexpr, MAX_CHILDREN: tl.constexpr, POS_FILL: tl.constexpr,
                        NEG_FILL: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_CH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    ii = tl.arange(0, BLOCK_I)
    jj = tl.arange(0, BLOCK_J)

    # --- 1. ranks, selection, node numbering ----------------------------------------------------------
    n_taken = tl.full((), 0, tl.int32)  # taken candidates in the chunks before this one
    for i0 in range(0, C, BLOCK_I):
        i = i0 + ii
        in_i = i < C
        s_i = tl.load(score_ptr + b * C + i, mask=in_i, other=0.0) - tl.load(penalty_ptr + i, mask=in_i, other=0.0)
        s_i = _nan_to_num(s_i, POS_FILL, NEG_FILL)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, C, BLOCK_J):
            j = j0 + jj
            in_j = j < C
            s_j = tl.load(score_ptr + b * C + j, mask=in_j, other=0.0) - tl.load(penalty_ptr + j, mask=in_j, other=0.0)
            s_j = _nan_to_num(s_j, POS_FILL, NEG_FILL)
            ahead = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum((ahead & in_j[None, :]).to(tl.int32), axis=1)
        taken = (in_i & (rank < n_sel)).to(tl.int32)
        before = n_taken + tl.cumsum(taken, axis=0) - taken  # exclusive prefix count
        tl.store(before_ptr + b * C + i, before, mask=in_i)
        tl.store(taken_ptr + b * C + i, taken.to(tl.int8), mask=in_i)
        n_taken += tl.sum(taken, axis=0)
    tl.debug_barrier()  # stage 2 reads the prefix counts of other threads' candidates

    # --- 2. tokens, log-probs and parents of the nodes ------------------------------------------------
    tl.store(tok_ptr + b * N, tl.load(ctok_ptr + b * (C + 1)))  # node 0: the root
    tl.store(lp_ptr + b * N, tl.load(clp_ptr + b * (C + 1)))
    tl.store(par_ptr + b * N, tl.full((), -1, tl.int64))
    for i0 in range(0, C, BLOCK_I):
        i = i0 + ii
        in_i = i < C
        taken = tl.load(taken_ptr + b * C + i, mask=in_i, other=0) != 0
        node = tl.load(before_ptr + b * C + i, mask=taken, other=0).to(tl.int64) + 1
        col = tl.load(pcol_ptr + i, mask=taken, other=0)
        gid = tl.load(frontier_ptr + b * F + col, mask=taken, other=-1) + tl.load(foff_ptr + col, mask=taken, other=0)
        # searchsorted(sorted [-1, selected ids...], gid) = (gid >= 0) + #{selected ids < gid}
        n_below = tl.load(before_ptr + b * C + tl.minimum(gid, C - 1), mask=taken & (gid >= 0), other=0)
        n_below = tl.where(gid < C, n_below, n_taken)
        parent = tl.where(gid >= 0, n_below.to(tl.int64) + 1, 0)
        tl.store(par_ptr + b * N + node, parent, mask=taken)
        tl.store(tok_ptr + b * N + node, tl.load(ctok_ptr + b * (C + 1) + 1 + i, mask=taken), mask=taken)
        tl.store(lp_ptr + b * N + node, tl.load(clp_ptr + b * (C + 1) + 1 + i, mask=taken), mask=taken)
    tl.debug_barrier()  # stage 3 reads every node's parent

    # --- 3. tree structure ----------------------------------------------------------------------------
    par_row = par_ptr + b * N
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    pp = tl.arange(0, BLOCK_P)
    cc = tl.arange(0, BLOCK_CH)
    for r0 in range(0, N, BLOCK_R):
        r = (r0 + rr).to(tl.int64)
        in_r = r < N
        n_anc = tl.zeros([BLOCK_R], dtype=tl.int64)
        n_kids = tl.zeros([BLOCK_R], dtype=tl.int32)
        kids = tl.full([BLOCK_R, BLOCK_CH], -1, tl.int64)
        for k0 in range(0, N, BLOCK_K):
            k = (k0 + kk).to(tl.int64)
            in_k = k < N
            # ancestor mask: k is r or one of the nodes r's parent links reach
            hop = r
            anc = hop[:, None] == k[None, :]
            for _ in tl.static_range(MAX_DEPTH):
                hop = _parent_hop(par_row, hop, N)
                anc = anc | (hop[:, None] == k[None, :])
            anc = anc & in_k[None, :]
            tl.store(mask_ptr + (b * N + r[:, None]) * N + k[None, :], anc.to(tl.uint8), mask=in_r[:, None] & in_k[None, :])
            n_anc += tl.sum(anc.to(tl.int64), axis=1)
            # children of r among these k, ranked by a running count (increasing id)
            par_k = tl.load(par_row + k, mask=in_k, other=-1)
            is_child = (par_k[None, :] == r[:, None]) & in_k[None, :]
            order = n_kids[:, None] + tl.cumsum(is_child.to(tl.int32), axis=1) - 1
            for c in tl.static_range(MAX_CHILDREN):
                kid = tl.max(tl.where(is_child & (order == c), k[None, :], -1), axis=1)
                kids = tl.where((cc[None, :] == c) & (kid[:, None] >= 0), kid[:, None], kids)
            n_kids += tl.sum(is_child.to(tl.int32), axis=1)
        depth = n_anc - 1
        tl.store(depth_ptr + b * N + r, depth, mask=in_r)
        tl.store(leaf_ptr + b * N + r, (n_kids == 0).to(tl.uint8), mask=in_r)
        tl.store(child_ptr + (b * N + r[:, None]) * MAX_CHILDREN + cc[None, :], kids,
                 mask=in_r[:, None] & (cc[None, :] < MAX_CHILDREN))
        # path column c holds the ancestor depth - c steps up (-1 past the node's depth)
        hop = r
        path = tl.where(pp[None, :] == depth[:, None], hop[:, None], -1)
        for t in tl.static_range(1, MAX_DEPTH + 1):
            hop = _parent_hop(par_row, hop, N)
            path = tl.where(pp[None, :] == (depth - t)[:, None], hop[:, None], path)
        tl.store(paths_ptr + (b * N + r[:, None]) * (MAX_DEPTH + 1) + pp[None, :], path,
                 mask=in_r[:, None] & (pp[None, :] < MAX_DEPTH + 1))


def tree_select(score: torch.Tensor, penalty: torch.Tensor, frontier: torch.Tensor, frontier_offset: torch.Tensor,
                parent_col: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, n_nodes: int, max_depth: int,
                max_children: int, *, out=None):
    """See ``reference.tree_select``: score [B, C], penalty [C], frontier [B, F], frontier_offset [F],
    parent_col [C], tokens / logp [B, 1 + C] -> (tokens, parents, mask, depth, paths, is_leaf, children,
    logp) of N = min(n_nodes - 1, C) + 1 nodes. ``out``: the eight output tensors to write (else new ones)."""
    B, C = score.shape
    F = frontier.shape[1]
    N = min(n_nodes - 1, C) + 1
    dtype = torch.promote_types(score.dtype, penalty.dtype)
    dev = score.device
    if out is None:
        new = lambda *shape, dtype=torch.long: torch.empty(shape, dtype=dtype, device=dev)
        out = (new(B, N, dtype=tokens.dtype), new(B, N), new(B, N, N, dtype=torch.bool), new(B, N),
               new(B, N, max_depth + 1), new(B, N, dtype=torch.bool), new(B, N, max_children),
               new(B, N, dtype=logp.dtype))
    node_tokens, parents, mask, depth, paths, is_leaf, children, node_logp = out
    before = torch.empty((B, C), dtype=torch.int32, device=dev)  # scratch: taken candidates before each one
    taken = torch.empty((B, C), dtype=torch.int8, device=dev)
    block_nodes = min(64, triton.next_power_of_2(N))
    _tree_select_kernel[(B,)](
        score.to(dtype).contiguous(), penalty.to(dtype).contiguous(), frontier.to(torch.long).contiguous(),
        frontier_offset.to(torch.long).contiguous(), parent_col.to(torch.long).contiguous(), tokens.contiguous(),
        logp.contiguous(),
        node_tokens, parents, mask.view(torch.uint8), depth, paths, is_leaf.view(torch.uint8), children, node_logp,
        before, taken,
        C, F, N, N - 1,
        MAX_DEPTH=max_depth, MAX_CHILDREN=max_children, POS_FILL=torch.finfo(dtype).max, NEG_FILL=-1e30,
        BLOCK_I=64, BLOCK_J=64, BLOCK_R=block_nodes, BLOCK_K=block_nodes,
        BLOCK_P=triton.next_power_of_2(max_depth + 1), BLOCK_CH=triton.next_power_of_2(max(max_children, 1)))
    return out
