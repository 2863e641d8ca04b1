"""GSD's grouped acceptance rule (Grouped Speculative Decoding, So et al., ICCV 2025, arXiv 2508.07747).

A draft token x is accepted when its *cluster* C(x) is likely enough under the target:

    accept  iff  u < min(1, sum_{j in C} p(j) / sum_{j in C} q(j))

with p the target's processed distribution and q the draft distribution. Merging tokens can only
shrink the total variation between p and q, so acceptance never drops below plain speculative
sampling's; the price is that the output is no longer exactly p (the rule is lossy).

The dynamic cluster (the paper's method, docs/methods.md §2):

1. rank the vocabulary by the target distribution (one argsort per call, for all positions at once);
2. take the ``group`` tokens ranked around x: ``group // 2`` less likely than x, x, and the rest more
   likely (the released code's ``sorted[r-7 : r+7]`` over an ascending sort, for ``group = 14``).
   ``window_edge``: ``shorten`` (default) drops ranks outside the vocabulary, so the window is the
   tokens that exist around x; ``sjd`` reproduces the released code, whose slice is empty when fewer
   than ``group // 2`` tokens rank below x (its exception handler then uses the plain SJD ratio
   p(x)/q(x): C(x) = {x}). Only drafts among the least likely tokens differ;
3. keep a candidate j only if ``|p(j) - p(x)| < prob_threshold`` and its codebook distance to x is
   below ``dist_threshold``. x itself is always a member, so ``group = 1`` is exactly SJD's rule.

The static variant (the paper's ablation (A)) ignores p: C(x) = x and its ``group - 1`` nearest codes
in the codebook, kept within ``dist_threshold``.

Distances. The published code measures squared L2 in Lumina-mGPT's input-embedding table with
threshold 0.5; that number is tied to that table's scale. We measure in the VQ codebook space
(``engine.codebook_vectors()``) after normalising every code to unit length (LlamaGen's tokenizer
already does), so the squared distance ``|e_j - e_x|^2 = 2 - 2 cos(e_j, e_x)`` lies in [0, 4] for any
tokenizer. Default 1.0 = codes at most 60 degrees apart. On the Zoo tokenizer's trained 1024 x 8
codebook 43% of all code pairs pass it (22% at 0.5, 74% at 2.0; a code's 14th nearest neighbour sits
at 0.08), on random 8-d codes 9%: it drops clearly unrelated codes and keeps the near ones, which is
what the filter is for. ``inf`` switches the filter off (and needs no tokenizer).

Defaults: ``group = 14``, ``prob_threshold = 0.15`` (the released code's values; the paper's tables use
``group = 25`` on COCO and 50 on PartiPrompts).

Residual on rejection: the released code resamples from SJD's ``norm(max(0, p - q))`` over the whole
vocabulary, not a group-level residual, and so does this rule (``moved`` is None). Under greedy
decoding the core accepts only the argmax, so GSD then behaves exactly like SJD.
"""
from __future__ import annotations

import math

import torch

from .verify import AcceptanceRule
from ..sampling import value_at
from ..errors import VVSError
from .registry import register_rule

DEFAULT_GROUP = 14
DEFAULT_PROB_THRESHOLD = 0.15
DEFAULT_DIST_THRESHOLD = 1.0
WINDOW_EDGES = ("shorten", "sjd")


def check_window_edge(value) -> None:
    if value not in WINDOW_EDGES:
        raise VVSError(f"gsd-window-edge must be shorten or sjd (the released code's fallback), got {value!r}")


def check_gsd_values(group, prob_threshold, dist_threshold, static_clusters) -> None:
    """One-line errors for bad GSD settings (shared by the ``gsd`` method and the ``gsd`` rule)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise VVSError(f"gsd-group must be an integer >= 1, got {group!r}")
    d = prob_threshold
    if isinstance(d, bool) or not isinstance(d, (int, float)) or math.isnan(d) or not 0 <= d <= 1:
        raise VVSError(f"gsd-prob-threshold must be a number in [0, 1], got {d!r}")
    d = dist_threshold
    if isinstance(d, bool) or not isinstance(d, (int, float)) or math.isnan(d) or d < 0:
        raise VVSError(f"gsd-dist-threshold must be a number >= 0 (squared distance between unit codebook "
                       f"vectors, 0..4; inf = off), got {d!r}")
    if not isinstance(static_clusters, bool):
        raise VVSError(f"gsd-static-clusters must be true or false, got {static_clusters!r}")


def unit_codebook(engine, vocab: int) -> torch.Tensor:
    """Unit-length codebook vectors padded to ``vocab`` rows with NaN: a token without a code never
    passes the distance filter (NaN compares False)."""
    if engine is None or getattr(engine, "vq", None) is None:
        raise VVSError("GSD's distance filter needs the VQ tokenizer's codebook (load one with --vq-ckpt), "
                       "or set gsd-dist-threshold to inf")
    cb = torch.nn.functional.normalize(engine.codebook_vectors().float(), dim=-1)
    cb = cb[:getattr(engine.vq, "n_codes", cb.shape[0])]  # layout tokens (end of line) have no code
    if cb.shape[0] < vocab:
        pad = torch.full((vocab - cb.shape[0], cb.shape[1]), float("nan"), device=cb.device)
        cb = torch.cat([cb, pad])
    return cb[:vocab]


class GroupedRule(AcceptanceRule):
    """GSD's rule behind the core's :class:`~vvs_engine.acceptance.verify.AcceptanceRule` interface."""

    name = "gsd"
    lossless = False

    def __init__(self, group: int = DEFAULT_GROUP, prob_threshold: float = DEFAULT_PROB_THRESHOLD,
                 dist_threshold: float = DEFAULT_DIST_THRESHOLD, codebook: torch.Tensor | None = None,
                 static_neighbors: torch.Tensor | None = None, window_edge: str = "shorten"):
        check_window_edge(window_edge)
        self.window_edge = window_edge
        self.group = int(group)
        self.prob_threshold = float(prob_threshold)
        self.dist_threshold = float(dist_threshold)
        self.codebook = codebook  # [V, c] unit vectors (NaN rows for tokens without a code) or None
        self.static_neighbors = static_neighbors  # [V, group - 1] for the static variant, else None
        if self.dist_threshold != math.inf and codebook is None:
            raise VVSError("GSD's distance filter needs codebook vectors (or dist_threshold = inf)")

    # --- the cluster --------------------------------------------------------------------------
    def cluster(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Members of each draft's cluster: p [M, V] target distributions, x [M] drafts ->
        [M, group] distinct token ids, -1 for dropped candidates (x itself is always present)."""
        if self.static_neighbors is not None:
            nb = self.static_neighbors[x]  # [M, group - 1], -1 where a token has no code
            cand = torch.cat([x[:, None], nb.clamp(min=0)], 1)
            keep = torch.cat([torch.ones_like(x[:, None], dtype=torch.bool), nb >= 0], 1)
            centre = 0
        else:
            cand, keep = self._rank_window(p, x)
            centre = self.group - 1 - self.group // 2
            if self.window_edge == "sjd":  # the released empty slice: the least likely candidate (last
                keep = keep & keep[:, -1:]  # column) does not exist -> only x is left (set below)
            px = p.gather(1, x[:, None])
            keep &= (p.gather(1, cand) - px).abs() < self.prob_threshold
        if self.codebook is not None and self.dist_threshold != math.inf:
            d2 = (self.codebook[cand] - self.codebook[x][:, None, :]).pow(2).sum(-1)  # [M, G]
            keep &= d2 < self.dist_threshold
        # The draft itself always counts (so group = 1 is SJD). By column, not by token equality:
        # a clamped out-of-range candidate may repeat x and must not be counted twice.
        keep[:, centre] = True
        return torch.where(keep, cand, torch.full_like(cand, -1))

    def _rank_window(self, p, x):
        """The ``group`` tokens ranked around x under p (one argsort for all M rows) -> (cand [M, G],
        inside [M, G]): column j holds the token of rank r - (G - 1 - G // 2) + j, r = x's rank (ties
        by id, as a stable sort orders them); ``inside``: that rank exists."""
        if torch.compiler.is_compiling():
            return rank_window_by_reductions(p, x, self.group)
        M, V = p.shape
        G = self.group
        order = torch.argsort(p, dim=-1, descending=True, stable=True)  # order[m, r] = token at rank r
        # x's rank in that order, counted: the tokens more likely than x and the equally likely ones with
        # a lower id (a stable sort keeps them first). The same number as inverting the permutation, but a
        # count over the row, which the compiled round computes in the pass that computes p (an inverse
        # permutation is a scatter and kernels of its own)
        ids = torch.arange(V, device=p.device)
        px = value_at(p, x)[:, None]
        r = ((p > px) | ((p == px) & (ids < x[:, None]))).sum(1, keepdim=True)  # [M, 1]
        # more likely side first: ranks r - (G - 1 - G//2) .. r + G//2
        cand_rank = r + torch.arange(G, device=p.device)[None] - (G - 1 - G // 2)
        inside = (cand_rank >= 0) & (cand_rank < V)
        cand = order.gather(1, cand_rank.clamp(0, V - 1))
        return cand, inside

    # --- the AcceptanceRule interface ---------------------------------------------------------
    def accept(self, r, x, qx, u, ctx):
        """r [M, V] target (residual) distributions, x [M] drafts, qx [M] their draft probabilities.
        The draft distribution over the cluster comes from ``ctx.draft_q`` [M, V] (the Jacobi loop),
        from the draft tree's q (tree verification with sampled drafts), or is one-hot at x with mass
        qx (deterministic drafts)."""
        members = self.cluster(r, x)
        q = _draft_distribution(r, x, qx, ctx)
        from .. import kernels

        sum_p, sum_q = kernels.group_mass(r, q, members)
        return u * sum_q < sum_p, None


def rank_window_by_reductions(p: torch.Tensor, x: torch.Tensor, group: int):
    """``GSDRule._rank_window`` without a sort: the neighbours of x in the order (p descending, id
    ascending) picked one at a time by reductions over the row (the next more likely token: the
    least likely of those ranked before x, the highest id among equals; the next less likely: the
    most likely of those ranked after, the lowest id among equals). The same tokens wherever the rank
    exists; elsewhere the column is token 0 and ``inside`` False. Compiled, these reductions join the
    pass over p that ranks x, where ``argsort`` was an aten fallback with a launch of its own; eagerly
    the sort is fewer ops (the group is 8: 7 picks, 14 reductions)."""
    M, V = p.shape
    above, below = group - 1 - group // 2, group // 2
    ids = torch.arange(V, device=p.device)
    px = value_at(p, x)[:, None]
    x_col = x[:, None]
    before = (p > px) | ((p == px) & (ids < x_col))
    after = (p < px) | ((p == px) & (ids > x_col))
    picks_above, found_above, picks_below, found_below = [], [], [], []
    for _ in range(above):  # ranks r - 1, r - 2, ...
        least = torch.where(before, p, float("inf")).amin(1, keepdim=True)
        pick = torch.where(before & (p == least), ids, -1).amax(1, keepdim=True)
        picks_above.append(pick)
        found_above.append(pick >= 0)
        before = before & (ids != pick)
    for _ in range(below):  # ranks r + 1, r + 2, ...
        most = torch.where(after, p, float("-inf")).amax(1, keepdim=True)
        pick = torch.where(after & (p == most), ids, V).amin(1, keepdim=True)
        picks_below.append(pick)
        found_below.append(pick < V)
        after = after & (ids != pick)
    cand = torch.cat(picks_above[::-1] + [x_col] + picks_below, 1)
    inside = torch.cat(found_above[::-1] + [torch.ones_like(x_col, dtype=torch.bool)] + found_below, 1)
    return torch.where(inside, cand, 0), inside


def _draft_distribution(r, x, qx, ctx):
    q = getattr(ctx, "draft_q", None)
    if q is not None:
        return q
    tree = getattr(ctx, "tree", None)
    if tree is not None and getattr(tree, "sampled", False) and getattr(tree, "q", None) is not None:
        # The same q verify_tree divides by: the parent's draft distribution with the siblings
        # already rejected in this round removed (they are tested rank by rank), renormalised.
        q = tree.q[ctx.parent].float()
        siblings = tree.children[ctx.parent]  # [M, C] in rank order
        rank = (siblings == ctx.child[:, None]).long().argmax(1)
        earlier = (torch.arange(siblings.shape[1], device=q.device)[None] < rank[:, None]) & (siblings >= 0)
        sib_tok = tree.tokens[siblings.clamp(min=0)]
        rejected = torch.zeros_like(q).scatter_add_(1, sib_tok, earlier.float()) > 0
        q = q.masked_fill(rejected, 0.0)
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
        # x's own entry exactly as verify_tree computed it, so group = 1 is bit-identical to exact
        return q.scatter(1, x[:, None], qx.float()[:, None])
    return torch.zeros_like(r, dtype=torch.float32).scatter_(1, x[:, None], qx.float()[:, None])


def make_grouped_rule(engine, gsd_group: int = DEFAULT_GROUP, gsd_prob_threshold: float = DEFAULT_PROB_THRESHOLD,
                      gsd_dist_threshold: float = DEFAULT_DIST_THRESHOLD, gsd_static_clusters: bool = False,
                      gsd_window_edge: str = "shorten", **unknown) -> GroupedRule:
    """Factory registered as ``gsd`` (``--accept gsd``); options use the GSD method's names."""
    if unknown:
        raise VVSError(f"unknown option(s) for the gsd rule: {', '.join(sorted(unknown))}")
    check_gsd_values(gsd_group, gsd_prob_threshold, gsd_dist_threshold, gsd_static_clusters)
    vocab = engine.config.vocab_size
    if gsd_group > vocab:
        raise VVSError(f"gsd-group must be at most the vocabulary size {vocab}, got {gsd_group}")
    codebook = None
    if gsd_dist_threshold != math.inf or gsd_static_clusters:
        codebook = unit_codebook(engine, vocab)
    neighbors = None
    if gsd_static_clusters:
        neighbors = _static_neighbors(codebook, gsd_group - 1)
    return GroupedRule(gsd_group, gsd_prob_threshold, gsd_dist_threshold, codebook, neighbors, gsd_window_edge)


def _static_neighbors(codebook: torch.Tensor, k: int, chunk: int = 2048) -> torch.Tensor:
    """[V, k] nearest other codes of every token in the unit codebook space; -1 for tokens without
    a code and for missing neighbours. Rows in chunks: a full V x V distance matrix is 1 GiB at
    LlamaGen's 16384 codes."""
    V = codebook.shape[0]
    has_code = ~codebook.isnan().any(-1)
    k_eff = min(k, max(int(has_code.sum()) - 1, 0))
    out = torch.full((V, k), -1, dtype=torch.long, device=codebook.device)
    if k_eff == 0:
        return out
    cb = torch.nan_to_num(codebook)
    for start in range(0, V, chunk):
        rows = torch.arange(start, min(start + chunk, V), device=cb.device)
        d = torch.cdist(cb[rows], cb)
        d[:, ~has_code] = float("inf")
        d[torch.arange(len(rows), device=cb.device), rows] = float("inf")  # not its own neighbour
        out[rows, :k_eff] = d.topk(k_eff, dim=1, largest=False).indices
    return torch.where(has_code[:, None], out, torch.full_like(out, -1))


register_rule("gsd", make_grouped_rule)
