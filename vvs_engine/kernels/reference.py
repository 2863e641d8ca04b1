"""Torch reference implementations of the engine's kernels: the CPU path and the test oracle.

Conventions shared with the Triton/CUDA versions (see ``vvs_engine/kernels/__init__.py``):
KV cache ``[L, B, H, S, D]`` (one layer: ``[B, H, S, D]``); slot indices and lengths are device int64
tensors so nothing here needs a host sync.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..rng import STEP, bits_to_uniform, lane_offsets, mix64


def local_visibility(prefix_len: torch.Tensor, local: torch.Tensor, n_slots: int,
                     key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dense boolean visibility ``[B|1, Q, S]`` of the (prefix + local block) layout: query i sees
    slot s if ``s < P`` (and ``key_valid[b, s]``), or if ``P <= s < P + Q`` and ``local[i, s - P]``.
    ``prefix_len`` is ``[1]`` (every row) or ``[B]`` (one length per row); ``local`` is ``[Q, Q]`` or
    ``[B, Q, Q]`` (one tree per row)."""
    Q = local.shape[-1]
    s = torch.arange(n_slots, device=local.device)
    P = prefix_len.reshape(-1, 1)  # [B|1, 1]
    in_prefix = (s[None, :] < P)[:, None, :]  # [B|1, 1, S]
    rel = s[None, :] - P  # [B|1, S]
    in_local = (rel >= 0) & (rel < Q)
    local3 = local if local.dim() == 3 else local[None]
    rows = max(local3.shape[0], rel.shape[0])
    idx = rel.clamp(0, Q - 1)[:, None, :].expand(rows, Q, n_slots)
    loc = local3.expand(rows, Q, Q).gather(2, idx) & in_local[:, None, :]  # [B|1, Q, S]
    if key_valid is not None:
        in_prefix = in_prefix & key_valid[:, None, :]
    return in_prefix | loc


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                   local: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of Q queries (tree nodes, a pending chain, a Jacobi window) whose K/V already sit in
    slots ``[P, P+Q)`` of the cache, over the committed prefix ``[0, P)`` without a mask plus the local
    ``Q x Q`` block under ``local``. q [B, H, Q, D]; k, v [B, H, S, D]; prefix_len [1] or [B] int64;
    local [Q, Q] or [B, Q, Q] bool; key_valid [B, S] bool or None (hides padded condition slots)."""
    vis = local_visibility(prefix_len, local, k.shape[2], key_valid)  # [B|1, Q, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis.unsqueeze(1))



# The smallest row count of a batch-invariant CPU GEMM: MKL (torch 2.13, MKL 2024.2, AVX-512, 1 and 2
# threads, fp32) rounds a row the same for every M >= 16 whatever its position, while M = 1, 2..10
# (K = 256) or 2..15 (K >= 512) each give other bits (benchmarks/batch_invariance_cost.py --probe).
GEMM_ROW_FLOOR = 16
_HALF = (torch.bfloat16, torch.float16)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] whose every output row has the bits it has in any GEMM
    of at least :data:`GEMM_ROW_FLOOR` rows (the CPU path of ``vvs::invariant_linear``): fewer rows are
    padded with zero rows to the floor (and dropped after); bf16 / fp16 run in fp32 (exact casts up,
    one rounding of the output), because oneDNN's bf16 GEMM has no such floor."""
    m, k = x.shape
    out_dtype = x.dtype
    if out_dtype in _HALF:
        x, weight = x.float(), weight.float()
        bias = None if bias is None else bias.float()
    if m < GEMM_ROW_FLOOR:
        x = torch.cat([x, x.new_zeros(GEMM_ROW_FLOOR - m, k)])
    y = F.linear(x, weight, bias)
    return (y[:m] if m < GEMM_ROW_FLOOR else y).to(out_dtype)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                        local: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`tree_attention`: on the CPU, SDPA reduces each (row, head) on its own with kernels and
    split sizes chosen by the query and key lengths, not by the batch, so the reference is already
    batch-invariant (the Triton kernel fixes its key split size for the same reason)."""
    return tree_attention(q, k, v, prefix_len, local, key_valid)


def kv_compact(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place, for K and V ``[L, B, H, S, D]``: slots ``dst`` take the values slots ``src`` held
    before the call (every layer and row). ``src``/``dst`` are ``[n]`` (the same for every row) or
    ``[B, n]`` (per row) device int64; the gather happens before any write, so overlapping ranges are
    fine."""
    if src.dim() == 2:
        return kv_move_rows(k, v, src, dst)
    for buf in (k, v):
        buf.index_copy_(3, dst, buf.index_select(3, src))


def kv_move_rows(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``kv_compact`` with one slot list per row: src, dst [B, n]. index_put_ on the base buffer, so
    torch.compile writes it in place."""
    L, B, H, S, D = k.shape
    dev = k.device
    lbh = (torch.arange(L, device=dev).view(L, 1, 1, 1), torch.arange(B, device=dev).view(1, B, 1, 1),
           torch.arange(H, device=dev).view(1, 1, H, 1))
    src_i, dst_i = (*lbh, src[None, :, None, :]), (*lbh, dst[None, :, None, :])
    for buf in (k, v):
        buf.index_put_(dst_i, buf[src_i])


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` [n] of ``x`` [B, S, D] -> a new [B, n, D] (read stale features of committed tokens)."""
    return x.index_select(1, idx)


def scatter_rows_(x: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """In place: ``x[:, idx[j]] = src[:, j]`` for x [B, S, D], idx [n], src [B, n, D] (append or
    overwrite stale features). Duplicate indices leave one of the candidate rows (unspecified which)."""
    x.index_copy_(1, idx, src.to(x.dtype))


# ----------------------------------------------------------------------------------------------------
# Fused draft sampling


def draft_probs(logits: torch.Tensor, cfg_scale: float, temperature: float, top_k: int,
                top_p: float) -> torch.Tensor:
    """The processed draft distribution p [B, V] float32: CFG combine of rows ``[cond; uncond]`` (when
    ``cfg_scale != 1``), then exactly ``vvs_engine.sampling.process_logits`` (temperature > 0)."""
    from ..sampling import SamplingParams, cfg_combine, process_logits

    if not temperature > 0:
        raise ValueError(f"draft sampling needs temperature > 0 (pass 1.0 for greedy runs), got {temperature}")
    x = logits.float()
    if cfg_scale != 1.0:
        x = cfg_combine(x, cfg_scale)
    return process_logits(x, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, cfg_scale=1.0))


def draft_topk(logits: torch.Tensor, cfg_scale: float, temperature: float, top_k: int, top_p: float,
               k: int, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` draft candidates of every row: ``(tokens [B, k] int64, logp [B, k] float32)``.

    Without ``noise`` the ``k`` most probable tokens under the processed p (ties: lower index first);
    with ``noise`` [B, V] of Exp(1) samples the ``k`` largest ``p / noise``, i.e. ``k`` draws without
    replacement from p (the exponential race). ``logp`` is ``log p`` of each token (-inf where p = 0)."""
    p = draft_probs(logits, cfg_scale, temperature, top_k, top_p)
    score = p if noise is None else p / noise.float()
    tokens = stable_topk(score, k)
    return tokens, p.gather(1, tokens).log()


def stable_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row of ``score`` [R, V], largest first, ties to the
    lower index: the first ``k`` of a stable descending sort, without sorting whole
    rows (the drafter asks for 10 of 1024+ tokens per node). ``score`` must be free of NaN."""
    R, V = score.shape
    if k >= V:
        return torch.sort(score, dim=-1, descending=True, stable=True).indices
    top = score.topk(k, dim=-1)  # the right values; which of several tied tokens it picks is unspecified
    kth = top.values[:, -1:]
    n_above = (top.values > kth).sum(-1, keepdim=True)  # tokens strictly above the k-th value: all taken
    idx = torch.arange(V, device=score.device)
    # the lowest-index tokens tied at the k-th value fill the remaining k - n_above places
    tied = torch.where(score == kth, -idx, -V).topk(k, dim=-1).values.neg()  # ascending index
    col = torch.arange(k, device=score.device)
    chosen = torch.where(col < n_above, top.indices, tied.gather(1, (col - n_above).clamp(min=0)))
    chosen = chosen.sort(dim=-1).values  # index order, then a stable sort by value
    order = torch.sort(score.gather(1, chosen), dim=-1, descending=True, stable=True).indices
    return chosen.gather(1, order)


def tree_level(score: torch.Tensor, child_logp: torch.Tensor, child_tokens: torch.Tensor, feats: torch.Tensor,
               anc: torch.Tensor, prefix_len: torch.Tensor, n_slots: int, embedding: Optional[torch.Tensor] = None):
    """One expansion step of the dynamic (EAGLE-2) draft tree: from a frontier's children to the next
    frontier and everything the drafter needs to run it.

    score [B, K] cumulative log-probs of the K frontier nodes; child_logp, child_tokens [B, K, C] each
    node's C best children; feats [R, K, D] the drafter outputs at the frontier (R = B, or 2B under CFG:
    row r belongs to sequence r % B); anc [R, K, W] the scratch columns each frontier node sees;
    prefix_len [R] the committed drafter length of each row; ``n_slots`` S the drafter cache size.

    -> cum [B, K*C] (every child's cumulative log-prob), best [B, K] (the K best children, best first,
    as ``cum.topk``), tokens [R, K] (their tokens, per row), score_next [B, K], feats_next [R, K, D] (the
    parent's drafter output for each new node), anc_next [R, K, W + K] (the parent's columns + its own),
    mask_next [R, K, S] in feats' dtype (the drafter's additive attention mask of the new frontier: 0 at
    the committed prefix and its scratch ancestors at slots prefix_len + column, -inf elsewhere; additive
    so that SDPA adds it as it is: a boolean mask costs one conversion kernel per level).

    With ``embedding`` [V, D] (the target's token-embedding table), feats_next is instead the drafter's
    whole input [R, K, 2D] = [embedding of the new node's token (in feats' dtype) | its parent's
    output]: the drafter's fc reads it directly, so no kernel runs between this op and the fc GEMM."""
    B, K, C = child_logp.shape
    R, _, D = feats.shape
    W = anc.shape[2]
    rep = R // B
    cum = (score[:, :, None] + child_logp).flatten(1)
    best = cum.topk(K, dim=1).indices
    parent = (best // C).repeat(rep, 1)  # [R, K]
    tokens = child_tokens.flatten(1).gather(1, best).repeat(rep, 1)
    score_next = cum.gather(1, best)
    feats_next = feats.gather(1, parent[:, :, None].expand(R, K, D))
    eye = torch.eye(K, dtype=torch.bool, device=anc.device).expand(R, K, K)
    anc_next = torch.cat([anc.gather(1, parent[:, :, None].expand(R, K, W)), eye], 2)
    slots = torch.arange(n_slots, device=anc.device)
    col = slots[None, :] - prefix_len[:, None]  # [R, S]: scratch column of each slot
    in_tree = (col >= 0) & (col < W + K)
    seen = anc_next.gather(2, col.clamp(0, W + K - 1)[:, None, :].expand(R, K, n_slots))
    vis_next = (col < 0)[:, None, :] | (in_tree[:, None, :] & seen)
    mask_next = additive_mask(vis_next, feats.dtype)
    if embedding is not None:
        feats_next = torch.cat([embedding[tokens].to(feats.dtype), feats_next], 2)
    return cum, best, tokens, score_next, feats_next, anc_next, mask_next


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility -> the additive mask SDPA makes of it (0 where visible, -inf elsewhere)."""
    return torch.where(visible, 0.0, float("-inf")).to(dtype)


def tree_structure(parents: torch.Tensor, max_depth: int, max_children: int):
    """parents [B, N] -> (mask [B, N, N], depth [B, N], paths [B, N, max_depth + 1], is_leaf [B, N],
    children [B, N, max_children]). Vectorised over sequences and nodes: loops over depth levels only."""
    mask, depth, paths, is_leaf = tree_meta_batched(parents, max_depth)
    return mask, depth, paths, is_leaf, children_table_batched(parents, max_children)


def tree_meta_batched(parents: torch.Tensor, max_depth: int):
    """``kernels.tree_meta`` for B trees at once (parents [B, N], ``parents[b, i] < i``): ancestor
    masks, depths, root -> node paths and leaf flags. Follows parent links ``max_depth`` times (one
    gather of [B, N] each) instead of propagating whole [N, N] masks."""
    B, N = parents.shape
    dev = parents.device
    # up[b, i]: the parent of i; the root's parent is a sentinel N that is its own parent.
    up = torch.nn.functional.pad(parents % (N + 1), (0, 1), value=N)  # -1 % (N + 1) == N
    hop = torch.arange(N, device=dev).expand(B, N)
    hops = [hop]
    for _ in range(max_depth):
        hop = up.gather(1, hop)
        hops.append(hop)
    chain = torch.stack(hops, 2)  # [B, N, max_depth + 1]: the ancestor t steps up (N past the root)
    anc = torch.zeros(B, N, N + 1, dtype=torch.bool, device=dev).scatter_(2, chain, True)[:, :, :N]
    depth = anc.sum(2) - 1
    # Path column j (root first) is the ancestor depth - j steps up.
    up_steps = depth[:, :, None] - torch.arange(max_depth + 1, device=dev)
    paths = torch.where(up_steps >= 0, chain.gather(2, up_steps.clamp(min=0)), -1)
    has_child = torch.zeros(B, N + 1, dtype=torch.bool, device=dev).scatter_(1, up[:, :N], True)
    return anc, depth, paths, ~has_child[:, :N]


def children_table_batched(parents: torch.Tensor, max_children: int) -> torch.Tensor:
    """[B, N] parents -> [B, N, max_children] children ids in increasing id order, -1 padded."""
    B, N = parents.shape
    ids = torch.arange(N, device=parents.device)
    is_child = parents[:, None, :] == ids[None, :, None]  # [B, N parent, N child]
    rank = is_child.cumsum(2) - 1
    out = torch.full((B, N, max_children + 1), -1, dtype=torch.long, device=parents.device)
    # Non-children (and ranks past the table) land in a spill column that is dropped.
    col = torch.where(is_child & (rank < max_children), rank, max_children)
    out.scatter_(2, col, ids.expand(B, N, N))
    return out[:, :, :max_children]


def tree_select(score: torch.Tensor, penalty: torch.Tensor, frontier: torch.Tensor, frontier_offset: torch.Tensor,
                parent_col: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, n_nodes: int, max_depth: int,
                max_children: int):
    """The end of a dynamic (EAGLE-2) draft tree build: from every candidate the levels produced to the
    tree of the best ``n_nodes - 1`` of them under the root, with its structure.

    score [B, C] the candidates' cumulative log-probs (global candidate ids: the level-1 candidates, then
    each expansion's in order); penalty [C] the per-level penalty subtracted from them (it makes every
    child rank strictly below its parent); frontier [B, F] the frontier table (column 0: -1 = no parent,
    then each level's expanded candidates as within-level indices), frontier_offset [F] the first global
    id of each column's level; parent_col [C] the frontier column of each candidate's parent; tokens,
    logp [B, 1 + C] the root's then every candidate's token and draft log-prob.

    Selection: the ``min(n_nodes - 1, C)`` best scores after ``nan_to_num(score - penalty, neginf=-1e30)``,
    ties to the lower candidate id (``stable_topk``), numbered in increasing candidate id (node 0 is the
    root, the j-th selected candidate is node j + 1). A parent's node is found by ``searchsorted`` among
    the selected ids.

    -> (tokens [B, N], parents [B, N] (root -1), mask [B, N, N], depth [B, N], paths [B, N, max_depth + 1],
    is_leaf [B, N], children [B, N, max_children], logp [B, N]) with N = min(n_nodes - 1, C) + 1; the
    structure is ``tree_structure(parents, max_depth, max_children)``."""
    B, C = score.shape
    ranked = torch.nan_to_num(score - penalty, neginf=-1e30)
    sel = stable_topk(ranked, min(n_nodes - 1, C)).sort(dim=1).values
    no_parent = torch.full((B, 1), -1, dtype=torch.long, device=score.device)
    # Parent of each selected candidate (a global candidate id, -1 for the root's children), then its
    # node index among [root | selected ids in increasing order].
    par_gid = (frontier + frontier_offset).gather(1, parent_col[sel])
    sel_nodes = torch.cat([no_parent, sel], 1)  # node i <- candidate sel_nodes[i] (root: -1)
    parents = torch.cat([no_parent, torch.searchsorted(sel_nodes, par_gid)], 1)
    node_cand = sel_nodes + 1  # columns of [root | candidates]
    mask, depth, paths, is_leaf, children = tree_structure(parents, max_depth, max_children)
    return tokens.gather(1, node_cand), parents, mask, depth, paths, is_leaf, children, logp.gather(1, node_cand)


# ----------------------------------------------------------------------------------------------------
# Relaxed acceptance (LANTERN) and grouped acceptance (GSD)


def lantern_mass(p: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor, delta: float,
                 ratio: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """LANTERN's relaxed acceptance mass for M draft tokens at once.

    p [M, V] target probabilities, tokens [M] the drafted tokens x, neighbors [V, k] each token's
    latent-space neighbours in order (negative entries = padding, contributing 0). With
    ``c_m = sum_{j<m} p[neighbors[x, j]]`` (m = 1..k), ``bound = delta`` (TVD budget, ``ratio=False``)
    or ``(delta - 1) * p[x]`` (LANTERN++ lambda, ``ratio=True``), ``m* = #{m : c_m <= bound}``; returns
    ``relaxed = p[x] + c_{m*}`` [M] float32 and ``m*`` [M] int64."""
    p = p.float()
    nb = neighbors.index_select(0, tokens)  # [M, k]
    vals = p.gather(1, nb.clamp(min=0)).masked_fill(nb < 0, 0.0)
    c = vals.cumsum(1)  # c_1..c_k, non-decreasing since p >= 0
    p_x = p.gather(1, tokens[:, None]).squeeze(1)
    bound = (delta - 1.0) * p_x if ratio else torch.full_like(p_x, delta)
    m_star = (c <= bound[:, None]).sum(1)
    c_pad = torch.cat([torch.zeros_like(c[:, :1]), c], dim=1)  # c_0 = 0
    relaxed = p_x + c_pad.gather(1, m_star[:, None]).squeeze(1)
    return relaxed, m_star


def group_mass(p: torch.Tensor, q: torch.Tensor, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GSD grouped acceptance: ``(sum_p [M], sum_q [M])`` float32, the masses of p and q over the
    tokens listed in ``members`` [M, G] (-1 = padding)."""
    valid = members >= 0
    idx = members.clamp(min=0)
    sum_p = p.float().gather(1, idx).masked_fill(~valid, 0.0).sum(1)
    sum_q = q.float().gather(1, idx).masked_fill(~valid, 0.0).sum(1)
    return sum_p, sum_q


# ----------------------------------------------------------------------------------------------------
# Tree metadata and the acceptance walk


def tree_meta(parents: torch.Tensor, max_depth: int):
    """Metadata of a draft tree given by ``parents`` [N] int64 (node 0 is the root with parent -1,
    ``parents[i] < i`` otherwise; depth at most ``max_depth``):

    - ``ancestor_mask`` [N, N] bool: node i sees j iff j is i or an ancestor of i;
    - ``depth`` [N] int64 (root 0);
    - ``paths`` [N, max_depth + 1] int64: row i lists the root -> i path, -1 padded;
    - ``is_leaf`` [N] bool.

    Vectorised: one step per depth level, no per-node Python loop."""
    N = parents.shape[0]
    dev = parents.device
    eye = torch.eye(N, dtype=torch.bool, device=dev)
    has_parent = (parents >= 0)[:, None]
    par = parents.clamp(min=0)
    anc = eye
    # After t steps every ancestor within distance t is set; the deepest node needs max_depth steps.
    for _ in range(max_depth):
        anc = eye | (anc.index_select(0, par) & has_parent)
    depth = anc.sum(1) - 1
    # parents[i] < i, so sorting a node's ancestors by index gives the root -> node order: the
    # ancestor j of i lands in column (number of ancestors of i with index <= j) - 1.
    col = anc.long().cumsum(1) - 1
    spill = max_depth + 1  # extra column that swallows non-ancestors (and anything deeper than max_depth)
    col = torch.where(anc & (col <= max_depth), col, torch.full_like(col, spill))
    nodes = torch.arange(N, device=dev).expand(N, N)
    paths = torch.full((N, max_depth + 2), -1, dtype=torch.long, device=dev).scatter_(1, col, nodes)
    # The spill column receives arbitrary nodes; drop it.
    paths = paths[:, : max_depth + 1].contiguous()
    n_children = torch.zeros(N, dtype=torch.long, device=dev).scatter_add_(0, par, has_parent.squeeze(1).long())
    return anc, depth, paths, n_children == 0


def first_accepted_sibling(accepted: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """For every node x: the first node at or after x in its sibling list (``next_sibling`` order) with
    ``accepted`` set, or -1. Pointer jumping: ceil(log2 N) + 1 vectorised rounds."""
    N = accepted.shape[0]
    idx = torch.arange(N, device=accepted.device)
    found = torch.where(accepted, idx, torch.full_like(idx, -1))
    nxt = next_sibling.clone()
    for _ in range(max(1, (N - 1).bit_length()) + 1):
        # Invariant: found[x] covers the 2^r list entries starting at x; nxt[x] is the entry after them.
        has_next = nxt >= 0
        nxt_c = nxt.clamp(min=0)
        found = torch.where((found < 0) & has_next, found.index_select(0, nxt_c), found)
        nxt = torch.where(has_next, nxt.index_select(0, nxt_c), nxt)
    return found


def accept_walk(accepted: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                max_depth: int):
    """Walk a verified draft tree: from the root (node 0), move to the first child (first-child /
    next-sibling order) whose ``accepted`` flag is set, until none is. Returns ``path``
    [max_depth + 1] int64 (node indices from the root, -1 padded), ``n_accepted`` [1] int64 (accepted
    non-root nodes) and ``last`` [1] int64 (the last node on the path). One step per depth level plus
    a pointer-jumping pass over the sibling lists; no host sync."""
    dev = accepted.device
    first_ok = first_accepted_sibling(accepted.bool(), next_sibling)
    # A node "-1" (walk ended) maps to -1 through a padded lookup table at index N.
    neg = torch.full((1,), -1, dtype=torch.long, device=dev)
    step = torch.cat([torch.where(first_child >= 0, first_ok.index_select(0, first_child.clamp(min=0)), -1), neg])
    N = accepted.shape[0]
    cur = torch.zeros(1, dtype=torch.long, device=dev)
    path = [cur]
    for _ in range(max_depth):
        cur = step.index_select(0, torch.where(cur >= 0, cur, N))
        path.append(cur)
    path = torch.cat(path)
    n_accepted = (path[1:] >= 0).sum().reshape(1)
    last = path.index_select(0, n_accepted)
    return path, n_accepted, last


def sibling_links(children: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[N, C]`` children table (row i = children of node i in sibling order, -1 padded; the
    layout of ``vvs_engine.drafting.tree.children_table``) -> ``(first_child [N], next_sibling [N])`` int64,
    the linked-list form ``accept_walk`` takes. Vectorised, no host sync."""
    N, C = children.shape
    first_child = children[:, 0].clone() if C > 0 else torch.full((N,), -1, dtype=torch.long, device=children.device)
    following = torch.cat([children[:, 1:], torch.full((N, 1), -1, dtype=children.dtype, device=children.device)], 1)
    # Scatter "the entry after me" to every listed child; padding goes to a spill slot at index N.
    slot = torch.where(children >= 0, children, torch.full_like(children, N))
    next_sibling = torch.full((N + 1,), -1, dtype=torch.long, device=children.device)
    next_sibling.scatter_(0, slot.reshape(-1), following.reshape(-1).long())
    return first_child.long(), next_sibling[:N]



def tree_verify(tokens: torch.Tensor, children: torch.Tensor, p: torch.Tensor, q: Optional[torch.Tensor],
                u_accept: torch.Tensor, u_sample: torch.Tensor, neighbors: Optional[torch.Tensor], delta: float,
                ratio: bool, reference_residual: bool, greedy: bool, max_depth: int):
    """Verify B draft trees with the exact rule (``neighbors`` None) or LANTERN(++) (neighbour table
    [V, K], budget ``delta``, ``ratio`` for LANTERN++; ``reference_residual``: drop all K neighbours
    from the residual as the published code does): tokens [B, N], children [B, N, C] in rank order,
    p [B, N, V], q [B, N, V] (sampled drafts) or None, u_accept [B, N], u_sample [B] in (0, 1] ->
    (path [B, max_depth + 1] -1 padded, n_accepted [B], last [B], next_token [B]) int64.

    The B trees are one forest of B*N nodes; a loop over sibling ranks tests every node's rank-th
    child at once against the node's residual r (accept iff u * q(x) < r(x) + credit; greedy: x is
    the argmax of the credited r), rejections update r to norm(max(0, r' - q)) with r' = r minus the
    credited mass; then a loop over depth follows the accepted children, and the next token is drawn
    from the last node's r by inverse CDF."""
    B, N, V = p.shape
    M, C = B * N, children.shape[2]
    dev = p.device
    offset = (torch.arange(B, device=dev) * N).view(B, 1, 1)
    kids = torch.where(children >= 0, children + offset, children).reshape(M, C)
    node_tokens = tokens.reshape(M)
    r = p.reshape(M, V).clone()
    q = None if q is None else q.reshape(M, V).clone()
    u_node = u_accept.reshape(M)
    ones = torch.ones(M, dtype=r.dtype, device=dev)
    accepted_child = torch.full((M,), -1, dtype=torch.long, device=dev)
    for rank in range(C):
        child = kids[:, rank]
        valid = (child >= 0) & (accepted_child < 0)
        child_ids = child.clamp(min=0)
        x = node_tokens[child_ids]
        q_norm = None if q is None else q / q.sum(-1, keepdim=True).clamp(min=1e-30)
        q_x = ones if q is None else q_norm.gather(1, x[:, None])[:, 0]
        moved = None
        if neighbors is None:
            score = r.gather(1, x[:, None])[:, 0]
        else:
            score, m_star = lantern_mass(r, x, neighbors, delta, ratio)
            nb = neighbors[x]
            n_moved = torch.full_like(m_star, nb.shape[1]) if reference_residual else m_star
            cols = torch.arange(nb.shape[1], device=dev)[None] < n_moved[:, None]
            if reference_residual:
                cols = cols & (m_star[:, None] > 0)
            moved = torch.zeros_like(r, dtype=torch.bool).scatter_(1, nb, cols)
        if greedy:
            ok = credited_argmax(r, x, moved) == x
        else:
            ok = u_node[child_ids] * q_x < score
        accept = valid & ok
        reject = valid & ~accept
        accepted_child = torch.where(accept, child, accepted_child)
        r = torch.where(reject[:, None], residual_distribution(r, q_norm, x, moved), r)
        if q is not None:
            q = torch.where(reject[:, None], q.scatter(1, x[:, None], 0.0), q)
    path, n_accepted, last = walk_accepted(accepted_child.view(B, N), max_depth)
    dist = r.view(B, N, V).gather(1, last.view(B, 1, 1).expand(B, 1, V))[:, 0]
    if greedy:
        next_token = dist.argmax(-1)
    else:
        from ..rng import sample_inverse_cdf

        next_token = sample_inverse_cdf(dist, u_sample.reshape(B))
    return path, n_accepted, last, next_token


def credited_argmax(r: torch.Tensor, x: torch.Tensor, moved: Optional[torch.Tensor]) -> torch.Tensor:
    """Argmax of r [M, V] after the ``moved`` mass is credited to x (greedy relaxed acceptance)."""
    if moved is None:
        return r.argmax(-1)
    relaxed = r.masked_fill(moved, 0.0)
    relaxed = relaxed.scatter(1, x[:, None], r.gather(1, x[:, None]) + (r * moved).sum(-1, keepdim=True))
    return relaxed.argmax(-1)


def residual_distribution(r: torch.Tensor, q: Optional[torch.Tensor], x: torch.Tensor,
                          moved: Optional[torch.Tensor]) -> torch.Tensor:
    """norm(max(0, r' - q)) with r' = r without the ``moved`` mass; q None = one-hot(x) (deterministic
    drafts). If nothing is left, r' renormalised (never NaN)."""
    if moved is not None:
        r = r.masked_fill(moved, 0.0)
    res = r.scatter(1, x[:, None], 0.0) if q is None else (r - q).clamp(min=0)
    total = res.sum(-1, keepdim=True)
    fallback = r / r.sum(-1, keepdim=True).clamp(min=1e-30)
    return torch.where(total > 1e-12, res / total.clamp(min=1e-30), fallback)


def walk_accepted(accepted_child: torch.Tensor, max_depth: int):
    """accepted_child [B, N] of flat ids (node b*N + i) of each node's accepted child, -1 if none ->
    (path [B, max_depth + 1] local ids, -1 padded; n_accepted [B]; last [B]). A loop over depth."""
    B, N = accepted_child.shape
    dev = accepted_child.device
    table = torch.cat([accepted_child.reshape(-1), accepted_child.new_full((1,), -1)])  # spill slot: walk ended
    cur = torch.arange(B, device=dev) * N  # the roots
    steps = [cur]
    for _ in range(max_depth):
        cur = table[torch.where(cur >= 0, cur, B * N)]
        steps.append(cur)
    flat_path = torch.stack(steps, 1)
    offset = (torch.arange(B, device=dev) * N)[:, None]
    path = torch.where(flat_path >= 0, flat_path - offset, flat_path)
    n_accepted = (path[:, 1:] >= 0).sum(1)
    last = path.gather(1, n_accepted[:, None])[:, 0]
    return path, n_accepted, last


# ----------------------------------------------------------------------------------------------------
# Counter-based random numbers


def counter_uniform(key: torch.Tensor, step: torch.Tensor, stream_offsets: torch.Tensor, n_lanes: int,
                    lanes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``CounterRNG`` uniforms of several streams at once: key [B] (``CounterRNG.key``), step [B] or
    [1] int64, stream_offsets [S] (``CounterRNG.stream_offsets``) -> float32 [B, S, n_lanes] in (0, 1],
    entry [b, s, j] equal to ``uniform(step, stream s)[b, j]`` (the same bits). ``lanes``: at least
    ``n_lanes`` of ``CounterRNG.lane_offsets`` (else computed here)."""
    offsets = lane_offsets(n_lanes, key.device) if lanes is None else lanes[:n_lanes]
    base = mix64((key + step * STEP)[:, None] + stream_offsets[None, :])  # [B, S]
    return bits_to_uniform(mix64(base[:, :, None] + offsets[None, None, :]))

