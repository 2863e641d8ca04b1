"""The kernels as ``torch.library`` custom ops (namespace ``vvs``), each with a fake (meta)
implementation, so torch.compile and CUDA-graph capture trace them as opaque nodes of known shape.

Each op's real implementation asks ``backends.choose`` which backend runs it and calls that backend's
launcher; the launchers and the references have the same signatures.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import bounds, reference
from .backends import choose, cuda_module, triton_module


# Compiled kernels of these ops take the device's bounds flag (vvs_engine/kernels/bounds.py).
BOUNDS_CHECKED = {"cuda": {"kv_compact", "gather_rows", "scatter_rows_"}, "triton": {"lantern_mass", "group_mass"}}


def _impl(op: str, device: torch.device):
    backend = choose(op, device)
    if backend == "reference":
        return getattr(reference, op)
    fn = getattr(cuda_module() if backend == "cuda" else triton_module(), op)
    if op not in BOUNDS_CHECKED[backend]:
        return fn
    flag = bounds.error_flag(device)

    def checked(*args):
        out = fn(*args, flag) if backend == "cuda" else fn(*args, error_flag=flag)
        if bounds.debug():
            bounds.raise_if_set(device, f"{backend} {op}")
        return out

    return checked


# ---------------------------------------------------------------------------------------------- attention


def head_major_empty(q: Tensor) -> Tensor:
    """An empty [B, H, Q, D] tensor laid out as [B, Q, H, D] (the layout of tree_attention's output):
    the caller's ``y.transpose(1, 2).reshape(B, Q, H * D)`` for the output projection is then a view,
    where a [B, H, Q, D]-contiguous output would need one transpose-copy kernel per layer."""
    B, H, Q, D = q.shape
    return q.new_empty((B, Q, H, D)).transpose(1, 2)


# flexible_layout: inputs come in whatever layout Inductor has (q: a strided slice of the fused q/k/v
# projection; the CFG rows' prefix lengths and masks: expanded views), with no copy kernel before the
# op: every backend reads any strides (the reference through SDPA, Triton through its stride arguments).
@torch.library.custom_op("vvs::tree_attention", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_len: Tensor, local: Tensor,
                   key_valid: Optional[Tensor]) -> Tensor:
    # The output layout is the fake's whatever the backend: [B, Q, H, D] memory seen as [B, H, Q, D]
    # (see head_major_empty); Inductor asserts that the real strides match the fake's.
    out = _impl("tree_attention", q.device)(q, k, v, prefix_len, local, key_valid)
    if out.stride() != head_major_empty(q).stride():
        out = head_major_empty(q).copy_(out)
    return out


@tree_attention.register_fake
def _(q, k, v, prefix_len, local, key_valid):
    return head_major_empty(q)


# --------------------------------------------------------------------------------- batch-invariant mode


@torch.library.custom_op("vvs::invariant_attention", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def invariant_attention(q: Tensor, k: Tensor, v: Tensor, prefix_len: Tensor, local: Tensor,
                        key_valid: Optional[Tensor]) -> Tensor:
    # tree_attention's contract and output layout, with a fixed key split size (models.invariant)
    out = _impl("invariant_attention", q.device)(q, k, v, prefix_len, local, key_valid)
    if out.stride() != head_major_empty(q).stride():
        out = head_major_empty(q).copy_(out)
    return out


@invariant_attention.register_fake
def _(q, k, v, prefix_len, local, key_valid):
    return head_major_empty(q)


@torch.library.custom_op("vvs::invariant_linear", mutates_args=())
def invariant_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    # x [M, K] -> [M, N] contiguous in x's dtype, each row's bits independent of M (models.invariant)
    return _impl("invariant_linear", x.device)(x, weight, bias).contiguous()


@invariant_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


# ----------------------------------------------------------------------------------------------- sampling


@torch.library.custom_op("vvs::draft_topk", mutates_args=())
def draft_topk(logits: Tensor, cfg_scale: float, temperature: float, top_k: int, top_p: float, k: int,
               noise: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    tokens, logp = _impl("draft_topk", logits.device)(logits, cfg_scale, temperature, top_k, top_p, k, noise)
    return tokens.contiguous(), logp.contiguous()


@draft_topk.register_fake
def _(logits, cfg_scale, temperature, top_k, top_p, k, noise):
    rows = logits.shape[0] // 2 if cfg_scale != 1.0 else logits.shape[0]
    return (logits.new_empty((rows, k), dtype=torch.int64), logits.new_empty((rows, k), dtype=torch.float32))


# ------------------------------------------------------------------------------------- relaxed acceptance


@torch.library.custom_op("vvs::lantern_mass", mutates_args=())
def lantern_mass(p: Tensor, tokens: Tensor, neighbors: Tensor, delta: float, ratio: bool) -> tuple[Tensor, Tensor]:
    return _impl("lantern_mass", p.device)(p, tokens, neighbors, delta, ratio)


@lantern_mass.register_fake
def _(p, tokens, neighbors, delta, ratio):
    M = p.shape[0]
    return p.new_empty((M,), dtype=torch.float32), p.new_empty((M,), dtype=torch.int64)


@torch.library.custom_op("vvs::group_mass", mutates_args=())
def group_mass(p: Tensor, q: Tensor, members: Tensor) -> tuple[Tensor, Tensor]:
    return _impl("group_mass", p.device)(p, q, members)


@group_mass.register_fake
def _(p, q, members):
    M = members.shape[0]
    return p.new_empty((M,), dtype=torch.float32), p.new_empty((M,), dtype=torch.float32)


# ----------------------------------------------------------------------------------------- tree and walk


@torch.library.custom_op("vvs::tree_meta", mutates_args=())
def tree_meta(parents: Tensor, max_depth: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _impl("tree_meta", parents.device)(parents, max_depth))


@tree_meta.register_fake
def _(parents, max_depth):
    N = parents.shape[0]
    return (parents.new_empty((N, N), dtype=torch.bool), parents.new_empty((N,), dtype=torch.int64),
            parents.new_empty((N, max_depth + 1), dtype=torch.int64), parents.new_empty((N,), dtype=torch.bool))


@torch.library.custom_op("vvs::accept_walk", mutates_args=())
def accept_walk(accepted: Tensor, first_child: Tensor, next_sibling: Tensor,
                max_depth: int) -> tuple[Tensor, Tensor, Tensor]:
    return _impl("accept_walk", accepted.device)(accepted, first_child, next_sibling, max_depth)


@accept_walk.register_fake
def _(accepted, first_child, next_sibling, max_depth):
    new = accepted.new_empty
    return new((max_depth + 1,), dtype=torch.int64), new((1,), dtype=torch.int64), new((1,), dtype=torch.int64)


# flexible_layout: the uniforms arrive as strided slices of one counter-RNG draw (no copy kernel before
# the op); the kernel reads them through their strides, and every other input is contiguous as made.
@torch.library.custom_op("vvs::tree_verify", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def tree_verify(tokens: Tensor, children: Tensor, p: Tensor, q: Optional[Tensor], u_accept: Tensor, u_sample: Tensor,
                neighbors: Optional[Tensor], delta: float, ratio: bool, reference_residual: bool, greedy: bool,
                max_depth: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = _impl("tree_verify", p.device)(tokens, children, p, q, u_accept, u_sample, neighbors, delta, ratio,
                                         reference_residual, greedy, max_depth)
    return tuple(t.contiguous() for t in out)


@tree_verify.register_fake
def _(tokens, children, p, q, u_accept, u_sample, neighbors, delta, ratio, reference_residual, greedy, max_depth):
    B = tokens.shape[0]
    new = tokens.new_empty
    return new((B, max_depth + 1), dtype=torch.int64), *(new((B,), dtype=torch.int64) for _ in range(3))


# ----------------------------------------------------------------------------------------- data movement


@torch.library.custom_op("vvs::kv_compact", mutates_args=("k", "v"))
def kv_compact(k: Tensor, v: Tensor, src: Tensor, dst: Tensor) -> None:
    _impl("kv_compact", k.device)(k, v, src, dst)


@kv_compact.register_fake
def _(k, v, src, dst):
    return None


@torch.library.custom_op("vvs::kv_move_rows", mutates_args=("k", "v"))
def kv_move_rows(k: Tensor, v: Tensor, src: Tensor, dst: Tensor) -> None:
    _impl("kv_move_rows", k.device)(k, v, src, dst)


@kv_move_rows.register_fake
def _(k, v, src, dst):
    return None


@torch.library.custom_op("vvs::gather_rows", mutates_args=())
def gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    return _impl("gather_rows", x.device)(x, idx)


@gather_rows.register_fake
def _(x, idx):
    return x.new_empty((x.shape[0], idx.shape[0], x.shape[2]))


@torch.library.custom_op("vvs::scatter_rows_", mutates_args=("x",))
def scatter_rows_(x: Tensor, idx: Tensor, src: Tensor) -> None:
    _impl("scatter_rows_", x.device)(x, idx, src)


@scatter_rows_.register_fake
def _(x, idx, src):
    return None


# ------------------------------------------------------------------------------------------ draft trees


@torch.library.custom_op("vvs::tree_level", mutates_args=())
def tree_level(score: Tensor, child_logp: Tensor, child_tokens: Tensor, feats: Tensor, anc: Tensor,
               prefix_len: Tensor, n_slots: int, embedding: Optional[Tensor] = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _impl("tree_level", score.device)(score, child_logp, child_tokens, feats, anc, prefix_len, n_slots,
                                             embedding)


@tree_level.register_fake
def _(score, child_logp, child_tokens, feats, anc, prefix_len, n_slots, embedding=None):
    B, K, C = child_logp.shape
    R, _, D = feats.shape
    dtype = torch.promote_types(score.dtype, child_logp.dtype)
    return (score.new_empty((B, K * C), dtype=dtype), score.new_empty((B, K), dtype=torch.long),
            score.new_empty((R, K), dtype=torch.long), score.new_empty((B, K), dtype=dtype),
            feats.new_empty((R, K, 2 * D if embedding is not None else D)), anc.new_empty((R, K, anc.shape[2] + K)),
            feats.new_empty((R, K, n_slots)))


@torch.library.custom_op("vvs::tree_select", mutates_args=())
def tree_select(score: Tensor, penalty: Tensor, frontier: Tensor, frontier_offset: Tensor, parent_col: Tensor,
                tokens: Tensor, logp: Tensor, n_nodes: int, max_depth: int,
                max_children: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = _impl("tree_select", score.device)(score, penalty, frontier, frontier_offset, parent_col, tokens, logp,
                                             n_nodes, max_depth, max_children)
    return tuple(t.contiguous() for t in out)  # the reference's mask and children are slices


@tree_select.register_fake
def _(score, penalty, frontier, frontier_offset, parent_col, tokens, logp, n_nodes, max_depth, max_children):
    B, C = score.shape
    N = min(n_nodes - 1, C) + 1
    new = score.new_empty
    return (new((B, N), dtype=tokens.dtype), new((B, N), dtype=torch.long), new((B, N, N), dtype=torch.bool),
            new((B, N), dtype=torch.long), new((B, N, max_depth + 1), dtype=torch.long),
            new((B, N), dtype=torch.bool), new((B, N, max_children), dtype=torch.long), new((B, N), dtype=logp.dtype))


# ------------------------------------------------------------------------------------ random numbers


@torch.library.custom_op("vvs::counter_uniform", mutates_args=())
def counter_uniform(key: Tensor, step: Tensor, stream_offsets: Tensor, n_lanes: int) -> Tensor:
    return _impl("counter_uniform", key.device)(key, step, stream_offsets, n_lanes)


@counter_uniform.register_fake
def _(key, step, stream_offsets, n_lanes):
    return key.new_empty((key.shape[0], stream_offsets.shape[0], n_lanes), dtype=torch.float32)

