"""Fused tree verification: the whole sibling walk of one draft tree per program.

Program b walks image b's tree from the root. At a node it holds the residual ``r`` (initially the
target distribution p after the node) and, for sampled drafts, the draft distribution ``q`` in
registers, and tests the node's children in rank order: child x (uniform ``u_accept[b, x]``) is
accepted iff ``u * q(x) < r(x) + credit`` (greedy: iff x is the argmax of the credited ``r``). A
rejection replaces ``r`` by the residual norm(max(0, r' - q)) (r' = r without the credited mass) and
removes x from q; an acceptance moves to the child and starts from its p. When a node has no child
left, the next token is drawn from ``r`` by inverse CDF with ``u_sample[b]`` (greedy: argmax). Each
step either tests one child or ends, so N steps always suffice.

Credit: 0 for the exact rule; LANTERN's latent-neighbour mass (TVD budget ``delta``) or LANTERN++'s
(``ratio``: at most (delta - 1) * r(x)) for the relaxed rules. The neighbour masses are gathered from
a per-program copy of ``r`` in global scratch (registers cannot be gathered by index), and the credited
("moved") tokens are marked in a scratch mask the residual then zeroes.

Reference: ``vvs_engine.kernels.reference.tree_verify`` (the vectorised torch walk).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_verify_kernel(
    tokens_ptr, children_ptr, p_ptr, q_ptr, u_accept_ptr, u_sample_ptr, neighbors_ptr,
    r_scratch_ptr, moved_scratch_ptr,
    path_ptr, n_accepted_ptr, last_ptr, next_token_ptr,
    N, C, V, K, max_depth, delta, stride_ua_b, stride_ua_n, stride_us_b,
    HAS_Q: tl.constexpr, RELAXED: tl.constexpr, RATIO: tl.constexpr, REF_RESIDUAL: tl.constexpr,
    GREEDY: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    v = tl.arange(0, BLOCK_V)
    in_v = v < V
    kk = tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    path_row = path_ptr + b * (max_depth + 1)
    tl.store(path_row + d, tl.where(d == 0, 0, -1).to(tl.int64), mask=d < max_depth + 1)

    node = tl.full((), 0, tl.int64)
    rank = tl.full((), 0, tl.int64)
    depth = tl.full((), 0, tl.int64)
    done = tl.full((), 0, tl.int1)
    r = tl.load(p_ptr + (b * N) * V + v, mask=in_v, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(q_ptr + (b * N) * V + v, mask=in_v, other=0.0).to(tl.float32)
    if RELAXED:
        tl.store(r_scratch_ptr + b * V + v, r, mask=in_v)
        tl.debug_barrier()

    for _ in range(0, N):
        active = done == 0
        child = tl.load(children_ptr + (b * N + node) * C + rank, mask=active & (rank < C), other=-1)
        testing = active & (child >= 0)
        child_id = tl.where(testing, child, 0)
        x = tl.load(tokens_ptr + b * N + child_id)
        is_x = v == x
        r_x = tl.sum(tl.where(is_x, r, 0.0), 0)
        if HAS_Q:
            q_norm = q / tl.maximum(tl.sum(q, 0), 1e-30)
            q_x = tl.sum(tl.where(is_x, q_norm, 0.0), 0)
        else:
            q_x = 1.0
        u = tl.load(u_accept_ptr + b * stride_ua_b + child_id * stride_ua_n).to(tl.float32)

        if RELAXED:
            nb = tl.load(neighbors_ptr + x * K + kk, mask=kk < K, other=-1)
            masses = tl.load(r_scratch_ptr + b * V + nb, mask=nb >= 0, other=0.0)
            cum = tl.cumsum(masses, 0)  # c_m for m = 1..K, non-decreasing
            if RATIO:
                bound = (delta - 1.0) * r_x
            else:
                bound = delta
            within = (kk < K) & (cum <= bound)
            m_star = tl.sum(within.to(tl.int32), 0)
            credit = tl.max(tl.where(within, cum, 0.0), 0)
            if REF_RESIDUAL:  # the published code drops all K neighbours whenever any was credited
                n_moved = tl.where(m_star > 0, K, 0)
            else:
                n_moved = m_star
            mark = kk < n_moved
            tl.store(moved_scratch_ptr + b * V + v, tl.zeros([BLOCK_V], tl.int8), mask=in_v)
            tl.debug_barrier()
            tl.store(moved_scratch_ptr + b * V + nb, tl.full([BLOCK_K], 1, tl.int8), mask=mark & (nb >= 0))
            tl.debug_barrier()
            moved = (tl.load(moved_scratch_ptr + b * V + v, mask=in_v, other=0) != 0) & in_v
        else:
            credit = 0.0
            moved = v < 0

        if GREEDY:
            moved_mass = tl.sum(tl.where(moved, r, 0.0), 0)
            relaxed_r = tl.where(is_x, r_x + moved_mass, tl.where(moved, 0.0, r))
            ok = tl.argmax(tl.where(in_v, relaxed_r, -1.0), 0) == x
        else:
            ok = u * q_x < r_x + credit
        accept = testing & ok
        reject = testing & (ok == 0)

        # rejection: residual of the parent; x leaves the draft distribution
        base = tl.where(moved, 0.0, r)
        if HAS_Q:
            res = tl.maximum(base - q_norm, 0.0)
        else:
            res = tl.where(is_x, 0.0, base)
        res_sum = tl.sum(res, 0)
        fallback = base / tl.maximum(tl.sum(base, 0), 1e-30)
        residual = tl.where(res_sum > 1e-12, res / tl.maximum(res_sum, 1e-30), fallback)
        r = tl.where(reject, residual, r)
        if HAS_Q:
            q = tl.where(reject & is_x, 0.0, q)
        rank = tl.where(reject, rank + 1, rank)

        # acceptance: descend to the child
        depth = tl.where(accept, depth + 1, depth)
        tl.store(path_row + depth, child, mask=accept)
        node = tl.where(accept, child, node)
        rank = tl.where(accept, 0, rank)
        r = tl.where(accept, tl.load(p_ptr + (b * N + node) * V + v, mask=in_v, other=0.0).to(tl.float32), r)
        if HAS_Q:
            q = tl.where(accept, tl.load(q_ptr + (b * N + node) * V + v, mask=in_v, other=0.0).to(tl.float32), q)
        if RELAXED:
            tl.store(r_scratch_ptr + b * V + v, r, mask=in_v)
            tl.debug_barrier()
        done = done | (active & (child < 0))

    if GREEDY:
        token = tl.argmax(tl.where(in_v, r, -1.0), 0).to(tl.int64)
    else:
        cdf = tl.cumsum(r, 0)
        target = tl.load(u_sample_ptr + b * stride_us_b).to(tl.float32) * tl.max(tl.where(in_v, cdf, 0.0), 0)
        token = tl.minimum(tl.sum((in_v & (cdf < target)).to(tl.int64), 0), V - 1)
    tl.store(n_accepted_ptr + b, depth)
    tl.store(last_ptr + b, node)
    tl.store(next_token_ptr + b, token)


def tree_verify(tokens: torch.Tensor, children: torch.Tensor, p: torch.Tensor, q, u_accept: torch.Tensor,
                u_sample: torch.Tensor, neighbors, delta: float, ratio: bool, reference_residual: bool,
                greedy: bool, max_depth: int, *, out=None):
    """tokens [B, N]; children [B, N, C] local ids in rank order (-1 padded); p [B, N, V]; q [B, N, V]
    or None (deterministic drafts); u_accept [B, N]; u_sample [B]; neighbors [V, K] or None (exact
    rule) -> (path [B, max_depth + 1], n_accepted [B], last [B], next_token [B]) int64, written into
    ``out`` if given."""
    B, N, V = p.shape
    C = children.shape[2]
    dev = p.device
    if out is None:
        out = (torch.empty(B, max_depth + 1, dtype=torch.int64, device=dev),
               *(torch.empty(B, dtype=torch.int64, device=dev) for _ in range(3)))
    path, n_accepted, last, next_token = out
    if B == 0:
        return out
    relaxed = neighbors is not None
    K = neighbors.shape[1] if relaxed else 1
    r_scratch = torch.empty(B, V, dtype=torch.float32, device=dev) if relaxed else p
    moved_scratch = torch.empty(B, V, dtype=torch.int8, device=dev) if relaxed else p
    block_v = triton.next_power_of_2(V)
    _tree_verify_kernel[(B,)](
        tokens.contiguous(), children.contiguous(), p.contiguous(), p if q is None else q.contiguous(),
        u_accept, u_sample, neighbors.contiguous() if relaxed else tokens,  # the uniforms: any strides
        r_scratch, moved_scratch, path, n_accepted, last, next_token,
        N, C, V, K, max_depth, float(delta), u_accept.stride(0), u_accept.stride(1), u_sample.stride(0),
        HAS_Q=q is not None, RELAXED=relaxed, RATIO=bool(ratio), REF_RESIDUAL=bool(reference_residual),
        GREEDY=bool(greedy), BLOCK_V=block_v, BLOCK_K=max(2, triton.next_power_of_2(K)),
        BLOCK_D=max(2, triton.next_power_of_2(max_depth + 1)), num_warps=4 if block_v <= 4096 else 8,
    )
    return out
