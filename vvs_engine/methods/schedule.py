"""When a sequence skips verification (VVS module 3).

Every sequence follows its own schedule (``SpeculativeRounds.wants_skip``, on the device): a round
kind is run for the batch, and a sequence takes part only if it is the kind it wants; the others sit
it out (their state is restored), so a sequence's rounds depend on nothing but itself — not on its
batch-mates, not on when it was admitted. Rules common to every policy: never two skips in a row;
never while 5 or fewer tokens are committed (the feature cache must hold enough target features to
reuse).

* ``uniform`` (VVS-U): skip on the sequence's own rounds ``r >= 5`` with ``r % interval == 1``
  (interval 2 = every other round, 4 = one in four, 1 = never), counting the rounds it took part in.
  The host follows each sequence's schedule exactly and runs the kind most of them want.
* ``dynamic`` (VVS-D): a sequence wants to skip when its draft tree's paths agree: keep every other
  root-to-leaf path, map tokens (root excluded) to L2-normalised VQ codebook vectors, per-depth cosine
  similarity of every pair of paths (0 where one is shorter), weighted by ``0.9^l / sum 0.9^l``,
  averaged over pairs; it wants to skip iff that mean >= threshold. Decided on the device from the tree
  the round consumes; the host picks the kind from the count of sequences wanting to skip, read one
  round late (that choice only decides who waits, never a token).
"""
from __future__ import annotations

import torch

MIN_TOKENS_BEFORE_SKIP = 5
FIRST_SKIP_ROUND = MIN_TOKENS_BEFORE_SKIP  # rounds 0..4 commit >= 5 tokens after the root
DEPTH_DECAY = 0.9


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
