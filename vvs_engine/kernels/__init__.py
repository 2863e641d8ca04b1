"""Kernel dispatch: the ops the engine calls.

Every op has a torch reference (also the CPU path) in ``reference.py``; Triton kernels live in
``vvs_engine.triton_kernels`` and CUDA kernels in ``vvs_engine._C``. Per op the first available of
cuda -> triton -> reference runs (``backends.choose``); ``VVS_KERNELS=reference|triton|cuda`` forces
one. Off the CPU fast path the calls go through the ``torch.ops.vvs.*`` custom ops (``ops.py``), which
carry fake implementations for torch.compile and CUDA graphs.

Conventions: KV cache ``[L, B, H, S, D]`` (one layer ``[B, H, S, D]``); lengths and indices are device
int64 tensors; nothing syncs with the host; shapes are static.
"""
from __future__ import annotations

import os

import torch

from . import ops
from . import reference
from .backends import ENV, BACKENDS, choose, describe  # noqa: F401
from .reference import local_visibility, sibling_links  # noqa: F401

__all__ = [
    "tree_attention", "local_visibility", "sibling_links", "draft_topk", "lantern_mass", "group_mass", "tree_meta",
    "accept_walk", "tree_verify", "tree_level", "tree_select", "counter_uniform", "counter_sample", "kv_compact",
    "kv_move_rows", "gather_rows", "scatter_rows_", "choose", "describe", "BACKENDS", "ENV",
]


def _reference_fast_path(t: torch.Tensor) -> bool:
    # CPU tensors and no forced backend: call the reference directly, skipping the custom-op layer
    # (the engine calls tree_attention in every layer of every step). Not under torch.compile: there
    # the op stays one opaque node (Inductor makes many small loops of an inlined reference).
    return t.device.type == "cpu" and not os.environ.get(ENV) and not torch.compiler.is_compiling()


def tree_attention(q, k, v, prefix_len, local, key_valid=None):
    """q [B, H, Q, D] over the prefix ``[0, P)`` of k, v [B, H, S, D] plus the local block
    ``[P, P + Q)`` under ``local`` [Q, Q] -> [B, H, Q, D]. See ``reference.tree_attention``.
    Per-row layouts (``prefix_len`` [B], ``local`` [B, Q, Q]: batched speculative decoding) run the
    same kernel (one program per row and head reads its row's length and mask)."""
    if _reference_fast_path(q):
        return reference.tree_attention(q, k, v, prefix_len, local, key_valid)
    return ops.tree_attention(q, k, v, prefix_len, local, key_valid)


def draft_topk(logits, cfg_scale: float, temperature: float, top_k: int, top_p: float, k: int, noise=None):
    """-> (tokens [B, k] int64, logp [B, k] float32). See ``reference.draft_topk``."""
    if _reference_fast_path(logits):
        return reference.draft_topk(logits, cfg_scale, temperature, top_k, top_p, k, noise)
    return ops.draft_topk(logits, float(cfg_scale), float(temperature), int(top_k), float(top_p), int(k), noise)


def lantern_mass(p, tokens, neighbors, delta: float, ratio: bool):
    """-> (relaxed [M] float32, m_star [M] int64). See ``reference.lantern_mass``."""
    if _reference_fast_path(p):
        return reference.lantern_mass(p, tokens, neighbors, delta, ratio)
    return ops.lantern_mass(p, tokens, neighbors, float(delta), bool(ratio))


def group_mass(p, q, members):
    """-> (sum_p [M], sum_q [M]) float32. See ``reference.group_mass``."""
    if _reference_fast_path(p):
        return reference.group_mass(p, q, members)
    return ops.group_mass(p, q, members)


def tree_meta(parents, max_depth: int):
    """-> (ancestor_mask [N, N] bool, depth [N] int64, paths [N, max_depth + 1] int64, is_leaf [N] bool).
    See ``reference.tree_meta``."""
    if _reference_fast_path(parents):
        return reference.tree_meta(parents, max_depth)
    return ops.tree_meta(parents, int(max_depth))


def accept_walk(accepted, first_child, next_sibling, max_depth: int):
    """-> (path [max_depth + 1] int64, n_accepted [1] int64, last [1] int64). See ``reference.accept_walk``."""
    if _reference_fast_path(accepted):
        return reference.accept_walk(accepted, first_child, next_sibling, max_depth)
    return ops.accept_walk(accepted, first_child, next_sibling, int(max_depth))


def tree_verify(tokens, children, p, q, u_accept, u_sample, neighbors, delta: float, ratio: bool,
                reference_residual: bool, greedy: bool, max_depth: int):
    """Fused batched tree verification (exact rule, or LANTERN(++) with a neighbour table) ->
    (path [B, max_depth + 1], n_accepted [B], last [B], next_token [B]) int64. See ``reference.tree_verify``."""
    if _reference_fast_path(p):
        return reference.tree_verify(tokens, children, p, q, u_accept, u_sample, neighbors, delta, ratio,
                                     reference_residual, greedy, max_depth)
    return ops.tree_verify(tokens, children, p, q, u_accept, u_sample, neighbors, float(delta), bool(ratio),
                           bool(reference_residual), bool(greedy), int(max_depth))


def tree_level(score, child_logp, child_tokens, feats, anc, prefix_len, n_slots: int, embedding=None):
    """One dynamic-tree expansion step in one op -> (cum [B, K*C], best [B, K], tokens [R, K],
    score_next [B, K], feats_next [R, K, D] (with the target's ``embedding`` table: the drafter's input
    [R, K, 2D]), anc_next [R, K, W + K], mask_next [R, K, S] additive, in feats' dtype). See ``reference.tree_level``. Compiled,
    it stays one opaque launch: inlined, Inductor made three of it (cumulative scores, top-K, the gathers)."""
    if _reference_fast_path(score):
        return reference.tree_level(score, child_logp, child_tokens, feats, anc, prefix_len, n_slots, embedding)
    return ops.tree_level(score, child_logp, child_tokens, feats, anc, prefix_len, int(n_slots), embedding)


def tree_select(score, penalty, frontier, frontier_offset, parent_col, tokens, logp, n_nodes: int, max_depth: int,
                max_children: int):
    """The end of a dynamic tree build in one op: the best ``n_nodes - 1`` candidates and the tree they
    form -> (tokens, parents, mask, depth, paths, is_leaf, children, logp), every field [B, N, ...]. See
    ``reference.tree_select``."""
    if _reference_fast_path(score):
        return reference.tree_select(score, penalty, frontier, frontier_offset, parent_col, tokens, logp, n_nodes,
                                     max_depth, max_children)
    # Compiled too (unlike tree_level): inlined, the selection and the structure are ~11 kernels and
    # aten fallbacks (topk, sort, searchsorted, the structure's scatters); the op is one launch.
    return ops.tree_select(score, penalty, frontier, frontier_offset, parent_col, tokens, logp, int(n_nodes),
                           int(max_depth), int(max_children))


def counter_uniform(key, step, stream_offsets, n_lanes: int, lanes=None, fuse_when_compiled: bool = False):
    """-> float32 [B, S, n_lanes]: ``CounterRNG`` uniforms of S streams in one op (the same bits as
    ``CounterRNG.uniform``). See ``reference.counter_uniform``. ``fuse_when_compiled``: when
    torch.compile lowers the caller to Triton, the reference's torch arithmetic instead of the op (the
    same bits): Inductor then computes each hash inside the kernel that reads the number, with no launch
    of its own. Not for Inductor's C++ backend, the CPU's default: it compiles the hash's wrapping int64
    multiplies as signed C++ arithmetic, where overflow is undefined (on the tests' tiny models: other
    bits, an Inductor error, a crash); Triton's int64 multiply wraps. ``lanes``: the generator's
    ``lane_offsets(n)`` (n >= n_lanes), made before compiling: ``arange * GOLDEN`` computed inside a
    traced round can become an index expression whose 64-bit constants overflow Inductor's printer."""
    if _reference_fast_path(key) or (fuse_when_compiled and torch.compiler.is_compiling()
                                     and _inductor_emits_triton(key)):
        return reference.counter_uniform(key, step, stream_offsets, n_lanes, lanes)
    return ops.counter_uniform(key, step, stream_offsets, int(n_lanes))


def _inductor_emits_triton(t: torch.Tensor) -> bool:
    """Whether Inductor generates Triton code for ``t``'s device: CUDA, or the CPU when its backend is
    Triton (``measure.launches.recording("gpu")``, the GPU-style launch count)."""
    import torch._inductor.config as inductor_config

    return t.device.type == "cuda" or (t.device.type == "cpu" and inductor_config.cpu_backend == "triton")


def counter_sample(rng, probs, step, stream: int):
    """``CounterRNG.sample`` (one categorical draw per row of ``probs`` [B, V]) with its uniform from
    :func:`counter_uniform`: the same token, one op for the random number."""
    from ..rng import sample_inverse_cdf

    step = torch.as_tensor(step, dtype=torch.long, device=probs.device)
    u = counter_uniform(rng.key, step, rng.stream_offsets([stream]), 1, rng.lane_offsets(1), fuse_when_compiled=True)
    return sample_inverse_cdf(probs, u[:, 0, 0])


def kv_compact(k, v, src, dst) -> None:
    """In place on K and V [L, B, H, S, D]: slots ``dst`` take what slots ``src`` held (overlap-safe).
    ``src``/``dst`` [n] for every row, or [B, n] per row (:func:`kv_move_rows`)."""
    if src.dim() == 2:
        return kv_move_rows(k, v, src, dst)
    if _reference_fast_path(k):
        return reference.kv_compact(k, v, src, dst)
    ops.kv_compact(k, v, src, dst)


def kv_move_rows(k, v, src, dst) -> None:
    """``kv_compact`` with one slot list per row (src, dst [B, n]): ``vvs::kv_move_rows``, one launch
    where torch needs a gather and a scatter. See ``reference.kv_move_rows``. Compiled, the torch code:
    Inductor's combo kernels already launch its gather and scatter together with the round's other
    bookkeeping (the op made the Zoo's compiled verify round one launch longer: its index inputs need a
    kernel of their own)."""
    if _reference_fast_path(k) or torch.compiler.is_compiling():
        return reference.kv_move_rows(k, v, src, dst)
    ops.kv_move_rows(k, v, src, dst)


def gather_rows(x, idx):
    """x [B, S, D], idx [n] -> x[:, idx] as a new [B, n, D]."""
    if _reference_fast_path(x):
        return reference.gather_rows(x, idx)
    return ops.gather_rows(x, idx)


def scatter_rows_(x, idx, src) -> None:
    """In place: x[:, idx] = src for x [B, S, D], idx [n], src [B, n, D]."""
    if _reference_fast_path(x):
        return reference.scatter_rows_(x, idx, src)
    ops.scatter_rows_(x, idx, src)
