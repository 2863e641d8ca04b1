"""Draft trees: the shape a drafter's guesses take before one target pass verifies them all.

A :class:`DraftTree` holds one tree per sequence of a batch, ``N`` nodes each; node 0 is the root (the last committed-but-unverified token:
EAGLE's bonus token), ``parents[i] < i``. Everything is a fixed-shape device tensor so the verify
step can be captured in a CUDA graph: tokens, parents, the ancestor mask (the target's ``N x N``
local attention mask), depths (RoPE position offsets), every root-to-node path, and a children table
(sibling order = drafter rank) that acceptance rules walk.

Trees come from :mod:`vvs_engine.drafting.session`: dynamic EAGLE-2 trees (best ``total - 1`` nodes by
cumulative draft log-probability), static EAGLE-1 trees from choice lists (LANTERN++), and chains.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..errors import VVSError
# The batched structure (ancestor masks, depths, paths, leaves, children tables) lives with the kernels'
# references: kernels.tree_select builds it too, and kernels sit below drafting.
from ..kernels.reference import children_table_batched, tree_meta_batched, tree_structure  # noqa: F401


@dataclass
class DraftTree:
    """B draft trees of N nodes each (one per sequence of a batch), every field batched."""

    tokens: torch.Tensor  # [B, N] int64, node 0 = root
    parents: torch.Tensor  # [B, N] int64, -1 for the root
    mask: torch.Tensor  # [B, N, N] bool: node i sees node j iff j is i or an ancestor of i
    depth: torch.Tensor  # [B, N] int64, root 0
    paths: torch.Tensor  # [B, N, max_depth + 1] node ids of the root -> i path, -1 padded
    is_leaf: torch.Tensor  # [B, N] bool
    children: torch.Tensor  # [B, N, max_children] child ids in sibling order, -1 padded
    q: Optional[torch.Tensor] = None  # [B, N, V] drafter distribution at each node (for its children)
    draft_logp: Optional[torch.Tensor] = None  # [B, N] drafter log-prob of each node given its parent
    draft_feats: Optional[torch.Tensor] = None  # [rows, N, D] drafter features (CASCADE, ablations)
    sampled: bool = False  # drafts were sampled from q (static trees): acceptance divides by q(x)
    draft_logits: Optional[torch.Tensor] = None  # [B, N, V] guided drafter logits at each node (static trees)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def n(self) -> int:
        return self.tokens.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1] - 1


def children_table(parents: torch.Tensor, max_children: int) -> torch.Tensor:
    """[N] parents -> [N, max_children] children ids in increasing id order (= sibling rank order,
    since builders number nodes by rank), -1 padded."""
    return children_table_batched(parents[None], max_children)[0]


# --- static trees ------------------------------------------------------------------------------
# EAGLE-1 / LANTERN++ choice lists: each entry is the list of child ranks from the root to a node.
def _naive_extend_57() -> List[List[int]]:
    # 57 nodes: 5, 13, 16, 14, 9 per depth (LANTERN's LlamaGen static default has this profile).
    per_depth_children = [
        [5],  # root -> 5
        [4, 3, 2, 2, 2],  # depth-1 ranks 0..4 -> 13
        [3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 0, 0],  # -> 16
        [2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0],  # -> 14
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],  # -> 9
    ]
    return _choices_from_profile(per_depth_children)


def _mc_sim_25() -> List[List[int]]:
    return _choices_from_profile([[4], [3, 2, 2, 1], [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0]])


def _choices_from_profile(profile) -> List[List[int]]:
    level = [[]]
    out = []
    for counts in profile:
        nxt = []
        for parent, c in zip(level, counts):
            for r in range(c):
                nxt.append(parent + [r])
        out += nxt
        level = nxt
    return out


STATIC_TREES = {
    "naive_extend_57": _naive_extend_57,
    "mc_sim_25": _mc_sim_25,
    "chain5": lambda: [[0] * d for d in range(1, 6)],
}


def static_layout(choices: Sequence[Sequence[int]], device) -> dict:
    """Choice list -> fixed tree layout: per node its parent, depth and rank (node 0 = root).
    Nodes are ordered by depth, then by (parent, rank) so siblings are consecutive in rank order."""
    ch = sorted((list(c) for c in choices), key=lambda c: (len(c), c))
    if not ch:
        raise VVSError("empty static tree")
    index = {(): 0}
    parents, ranks, depths = [-1], [0], [0]
    for c in ch:
        if tuple(c[:-1]) not in index:
            raise VVSError(f"static tree choice {c} has no parent {c[:-1]}")
        index[tuple(c)] = len(parents)
        parents.append(index[tuple(c[:-1])])
        ranks.append(c[-1])
        depths.append(len(c))
    max_depth = max(depths)
    max_rank = max(ranks) + 1
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    by_level = [t([i for i, d in enumerate(depths) if d == lvl]) for lvl in range(max_depth + 1)]
    # Nodes are numbered by depth, so each level is a contiguous range (host ints: slicing needs no sync).
    level_ranges = [(depths.index(lvl), len(depths) - depths[::-1].index(lvl)) for lvl in range(max_depth + 1)]
    return dict(parents=t(parents), ranks=t(ranks), depths=t(depths), max_depth=max_depth,
                max_rank=max_rank, by_level=by_level, level_ranges=level_ranges, n=len(parents))


def chain_choices(depth: int) -> List[List[int]]:
    return [[0] * d for d in range(1, depth + 1)]
