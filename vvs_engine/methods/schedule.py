"""When to skip verification (VVS module 3).

Rules common to every policy: never two skips in a row; never while 5 or fewer tokens are committed
(the feature cache must hold enough target features to reuse).

* ``uniform`` (VVS-U): skip on rounds where ``step % interval == 1`` (interval 2 = every other round,
  4 = one in four, 1 = never). Known to the host ahead of time.
* ``dynamic`` (VVS-D): skip when the draft tree's paths agree: keep every other root-to-leaf path,
  map tokens (root excluded) to L2-normalised VQ codebook vectors, per-depth cosine similarity of
  every pair of paths (0 where one is shorter), weighted by ``0.9^l / Σ 0.9^l``, averaged over pairs;
  skip iff that mean ≥ threshold. The decision is a device value read by the host (one sync).
"""
from __future__ import annotations

import torch

MIN_TOKENS_BEFORE_SKIP = 5
DEPTH_DECAY = 0.9


class Never:
    def skip(self, step, committed, last_skip, tree) -> bool:
        return False


class Uniform:
    def __init__(self, interval: int):
        self.interval = interval

    def skip(self, step, committed, last_skip, tree) -> bool:
        if last_skip or committed <= MIN_TOKENS_BEFORE_SKIP or self.interval == 1:
            return False
        return step % self.interval == 1


class Dynamic:
    def __init__(self, threshold: float, codebook: torch.Tensor):
        self.threshold = threshold
        self.codebook = torch.nn.functional.normalize(codebook.float(), dim=-1)

    def skip(self, step, committed, last_skip, tree) -> bool:
        if last_skip or committed <= MIN_TOKENS_BEFORE_SKIP:
            return False
        return bool(path_similarity(tree.leaf_paths(), tree.tokens, self.codebook) >= self.threshold)


def path_similarity(paths: torch.Tensor, tokens: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """paths [P, D+1] (-1 padded, column 0 = root) -> mean over path pairs of the depth-weighted
    cosine similarity of their tokens' codebook vectors (every other path kept)."""
    paths = paths[::2, 1:]  # stride-2 down-sampling; drop the root
    P, D = paths.shape
    if P < 2 or D == 0:
        return torch.zeros((), device=paths.device)
    valid = paths >= 0
    vec = codebook[tokens[paths.clamp(min=0)].clamp(max=codebook.shape[0] - 1)]  # [P, D, c]
    vec = vec * valid[..., None]
    sim = torch.einsum("idc,jdc->ijd", vec, vec)  # zero where either path is shorter
    w = DEPTH_DECAY ** torch.arange(D, device=paths.device, dtype=torch.float32)
    w = w / w.sum()
    per_pair = (sim * w).sum(-1)
    iu = torch.triu_indices(P, P, offset=1, device=paths.device)
    return per_pair[iu[0], iu[1]].mean()


def make(opts, engine):
    if opts.skip_policy == "uniform":
        return Uniform(opts.skip_interval)
    if opts.skip_policy == "dynamic":
        return Dynamic(opts.skip_threshold, engine.codebook_vectors())
    return Never()
