"""Relaxed acceptance masses for a whole tree level at once.

``lantern_mass``: LANTERN's latent-neighbour mass. Per row: gather the drafted token's ``k``
neighbours from the ``[V, k]`` table, gather their target probabilities, prefix-sum them, and take the
longest prefix whose mass stays within the bound (TVD budget ``delta`` or LANTERN++'s
``(delta - 1) * p[x]``). ``group_mass``: GSD's grouped acceptance, the p and q masses of each row's
token group. One program per row; both are a few gathers, a scan and a reduction.

Bounds: an index outside the vocabulary (or the neighbour table) is never read; the row's results
become NaN (``m_star`` -1) and ``error_flag`` is raised (see ``vvs_engine.kernels.bounds``).

Reference: ``vvs_engine.kernels.reference.lantern_mass`` / ``group_mass``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lantern_mass_kernel(
    p_ptr, tokens_ptr, neighbors_ptr, relaxed_ptr, m_star_ptr, error_ptr,
    n_vocab, n_table_rows, n_neighbors, stride_pr, stride_pv, stride_n0, stride_n1, delta,
    RATIO: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    in_k = j < n_neighbors
    token = tl.load(tokens_ptr + row)
    token_ok = (token >= 0) & (token < n_vocab) & (token < n_table_rows)
    token = tl.where(token_ok, token, 0)  # a bad token reads row 0 and poisons the result
    nb = tl.load(neighbors_ptr + token * stride_n0 + j * stride_n1, mask=in_k, other=-1)
    bad = (token_ok == 0) | (tl.sum((nb >= n_vocab).to(tl.int32), 0) > 0)
    vals = tl.load(p_ptr + row * stride_pr + nb * stride_pv, mask=(nb >= 0) & (nb < n_vocab), other=0.0).to(tl.float32)
    c = tl.cumsum(vals, 0)  # c[j] = c_{j+1}; non-decreasing because p >= 0
    p_x = tl.load(p_ptr + row * stride_pr + token * stride_pv).to(tl.float32)
    if RATIO:
        bound = (delta - 1.0) * p_x
    else:
        bound = delta
    within = in_k & (c <= bound)  # a prefix of the neighbour list
    m_star = tl.sum(within.to(tl.int64), 0)
    c_star = tl.max(tl.where(within, c, 0.0), 0)  # c_{m*} (c_0 = 0)
    tl.store(relaxed_ptr + row, tl.where(bad, float("nan"), p_x + c_star))
    tl.store(m_star_ptr + row, tl.where(bad, -1, m_star))
    if bad:
        tl.atomic_max(error_ptr, 1)


@triton.jit
def _group_mass_kernel(
    p_ptr, q_ptr, members_ptr, sum_p_ptr, sum_q_ptr, error_ptr,
    n_vocab, group_size, stride_pr, stride_pv, stride_qr, stride_qv, stride_mr, stride_mg,
    BLOCK_G: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    tok = tl.load(members_ptr + row * stride_mr + g * stride_mg, mask=g < group_size, other=-1)
    listed = (tok >= 0) & (tok < n_vocab)
    bad = tl.sum((tok >= n_vocab).to(tl.int32), 0) > 0
    p = tl.load(p_ptr + row * stride_pr + tok * stride_pv, mask=listed, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + row * stride_qr + tok * stride_qv, mask=listed, other=0.0).to(tl.float32)
    tl.store(sum_p_ptr + row, tl.where(bad, float("nan"), tl.sum(p, 0)))
    tl.store(sum_q_ptr + row, tl.where(bad, float("nan"), tl.sum(q, 0)))
    if bad:
        tl.atomic_max(error_ptr, 1)


def lantern_mass(p: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor, delta: float, ratio: bool,
                 *, out: tuple[torch.Tensor, torch.Tensor] | None = None, error_flag: torch.Tensor | None = None):
    """p [M, V]; tokens [M] int64; neighbors [V, k] int64 (negative = padding) -> (relaxed [M] fp32,
    m_star [M] int64), written into ``out`` if given. ``error_flag``: int32 [1] raised on a bad index."""
    M = p.shape[0]
    k = neighbors.shape[1]
    if out is None:
        out = (torch.empty(M, dtype=torch.float32, device=p.device), torch.empty(M, dtype=torch.int64, device=p.device))
    relaxed, m_star = out
    if M == 0:
        return relaxed, m_star
    if error_flag is None:
        error_flag = torch.zeros(1, dtype=torch.int32, device=p.device)
    _lantern_mass_kernel[(M,)](
        p, tokens, neighbors, relaxed, m_star, error_flag,
        p.shape[1], neighbors.shape[0], k, p.stride(0), p.stride(1), neighbors.stride(0), neighbors.stride(1), float(delta),
        RATIO=bool(ratio), BLOCK_K=max(2, triton.next_power_of_2(k)), num_warps=1,
    )
    return relaxed, m_star


def group_mass(p: torch.Tensor, q: torch.Tensor, members: torch.Tensor, *,
               out: tuple[torch.Tensor, torch.Tensor] | None = None, error_flag: torch.Tensor | None = None):
    """p, q [M, V]; members [M, G] int64 (-1 = padding) -> (sum_p [M], sum_q [M]) fp32, written into
    ``out`` if given. ``error_flag``: int32 [1] raised on a member index >= V."""
    M, G = members.shape
    if out is None:
        out = (torch.empty(M, dtype=torch.float32, device=p.device), torch.empty(M, dtype=torch.float32, device=p.device))
    sum_p, sum_q = out
    if M == 0:
        return sum_p, sum_q
    if error_flag is None:
        error_flag = torch.zeros(1, dtype=torch.int32, device=p.device)
    _group_mass_kernel[(M,)](
        p, q, members, sum_p, sum_q, error_flag,
        p.shape[1], G, p.stride(0), p.stride(1), q.stride(0), q.stride(1), members.stride(0), members.stride(1),
        BLOCK_G=max(2, triton.next_power_of_2(G)), num_warps=1,
    )
    return sum_p, sum_q
