"""When a batch skips verification (VVS module 3).

Rules common to every policy: never two skips in a row; never while 5 or fewer tokens are committed
(the feature cache must hold enough target features to reuse). A skip round saves the target forward
only if no sequence of the batch verifies in it, so the whole batch skips or verifies together.

* ``uniform`` (VVS-U, a shared schedule): skip on rounds ``r >= 5`` with ``r % interval == 1``
  (interval 2 = every other round, 4 = one in four, 1 = never). Every round of an unfinished sequence
  commits at least one token, so after 5 rounds every sequence has more than 5; the schedule is a
  function of the round number alone, hence the same for an image at any batch size.
* ``dynamic`` (VVS-D): each sequence wants to skip when its draft tree's paths agree: keep every other
  root-to-leaf path, map tokens (root excluded) to L2-normalised VQ codebook vectors, per-depth cosine
  similarity of every pair of paths (0 where one is shorter), weighted by ``0.9^l / Σ 0.9^l``, averaged
  over pairs; it wants to skip iff that mean >= threshold (and it has more than 5 tokens). The batch
  skips only when every unfinished sequence wants to. The decision is computed on the device and read
  one round late: round r + 1 is decided from the tree that round r consumed. An image's tokens then
  depend on its batch-mates (they can veto its skips): VVS-D is not batch-invariant; VVS-U is.
"""
from __future__ import annotations

import torch

MIN_TOKENS_BEFORE_SKIP = 5
FIRST_SKIP_ROUND = MIN_TOKENS_BEFORE_SKIP  # rounds 0..4 commit >= 5 tokens after the root
DEPTH_DECAY = 0.9


class Never:
    def skip(self, round_index: int, last_skip: bool, batch_wants_skip: bool) -> bool:
        return False


class Uniform:
    def __init__(self, interval: int):
        self.interval = interval

    def skip(self, round_index: int, last_skip: bool, batch_wants_skip: bool) -> bool:
        if last_skip or round_index < FIRST_SKIP_ROUND or self.interval == 1:
            return False
        return round_index % self.interval == 1


class Dynamic:
    def skip(self, round_index: int, last_skip: bool, batch_wants_skip: bool) -> bool:
        return batch_wants_skip and not last_skip


def path_similarity(tree, codebook: torch.Tensor) -> torch.Tensor:
    """B trees -> [B] mean over pairs of kept root-to-leaf paths (every other leaf, by node id) of the
    depth-weighted cosine similarity of their tokens' codebook vectors. Static shapes: every node's
    path is scored and the pairs are masked."""
    leaf = tree.is_leaf  # [B, N]
    keep = leaf & ((leaf.long().cumsum(1) - 1) % 2 == 0)  # stride-2 down-sampling of the leaves
    paths = tree.paths[:, :, 1:]  # drop the root: [B, N, D]
    B, N, D = paths.shape
    if D == 0:
        return torch.zeros(B, device=paths.device)
    valid = paths >= 0
    tokens = tree.tokens.gather(1, paths.clamp(min=0).flatten(1)).view(B, N, D)
    vec = codebook[tokens.clamp(max=codebook.shape[0] - 1)] * valid[..., None]  # [B, N, D, c]
    sim = torch.einsum("bidc,bjdc->bijd", vec, vec)  # zero where either path is shorter
    w = DEPTH_DECAY ** torch.arange(D, device=paths.device, dtype=torch.float32)
    per_pair = (sim * (w / w.sum())).sum(-1)  # [B, N, N]
    upper = torch.ones(N, N, dtype=torch.bool, device=paths.device).triu(1)
    pairs = keep[:, :, None] & keep[:, None, :] & upper
    n_pairs = pairs.sum((1, 2))
    mean = (per_pair * pairs).sum((1, 2)) / n_pairs.clamp(min=1)
    return torch.where(n_pairs > 0, mean, torch.zeros_like(mean))


def make(opts, engine):
    if opts.skip_policy == "uniform":
        return Uniform(opts.skip_interval)
    if opts.skip_policy == "dynamic":
        return Dynamic()
    return Never()
