"""Torch reference implementations of the engine's kernels: the CPU path and the test oracle.

Conventions shared with the Triton/CUDA versions (see ``vvs_engine/kernels/__init__.py``):
KV cache ``[L, B, H, S, D]`` (one layer: ``[B, H, S, D]``); slot indices and lengths are device int64
tensors so nothing here needs a host sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def local_visibility(prefix_len: torch.Tensor, local: torch.Tensor, n_slots: int,
                     key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dense boolean visibility ``[B|1, Q, S]`` of the (prefix + local block) layout: query i sees
    slot s if ``s < P`` (and ``key_valid[b, s]``), or if ``P <= s < P + Q`` and ``local[i, s - P]``."""
    Q = local.shape[0]
    s = torch.arange(n_slots, device=local.device)
    P = prefix_len.reshape(-1)[:1]
    in_prefix = (s < P)[None, None, :]  # [1, 1, S]
    rel = s - P  # [S]
    in_local = (rel >= 0) & (rel < Q)
    loc = local.index_select(1, rel.clamp(0, Q - 1)) & in_local[None, :]  # [Q, S]
    if key_valid is not None:
        in_prefix = in_prefix & key_valid[:, None, :]
    return in_prefix | loc[None]


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                   local: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of Q queries (tree nodes, a pending chain, a Jacobi window) whose K/V already sit in
    slots ``[P, P+Q)`` of the cache, over the committed prefix ``[0, P)`` without a mask plus the local
    ``Q x Q`` block under ``local``. q [B, H, Q, D]; k, v [B, H, S, D]; prefix_len [1] int64;
    local [Q, Q] bool; key_valid [B, S] bool or None (hides padded condition slots)."""
    vis = local_visibility(prefix_len, local, k.shape[2], key_valid)  # [B|1, Q, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis.unsqueeze(1))


def kv_compact(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place, for K and V ``[L, B, H, S, D]``: slots ``dst`` take the values slots ``src`` held
    before the call (every layer and row). ``src``/``dst`` are ``[n]`` device int64; the gather happens
    before any write, so overlapping ranges are fine."""
    for buf in (k, v):
        buf.index_copy_(3, dst, buf.index_select(3, src))
