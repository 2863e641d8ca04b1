"""CASCADE's drafter-training change (docs/methods.md §3): redundancy re-weighting.

Inside each training image, a position t whose target logit vector (or last-layer hidden state) has
cosine similarity above 0.625 with that of some *later* position t' > t is where inference-time
merging tends to fire; its classification (soft cross-entropy) term gets weight 2, the others 1.
:func:`train_drafter` normalises by the weight sum (the authors' 723b562 variant).

``cascade_loss_weights(...)`` is the ``loss_weights`` callable of :func:`vvs_engine.training.drafter.train_drafter`;
:func:`vvs_engine.training.drafter.train_cascade_drafter` wraps the two; ``vvs-engine train-drafter
--cascade-weighting`` uses the weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import VVSError

WEIGHT_SOURCES = ("logits", "hidden")


def redundancy_mask(vectors: torch.Tensor, threshold: float = 0.625, chunk: int = 64) -> torch.Tensor:
    """vectors [B, T, F] -> [B, T] bool: position t has a later position t' > t of the same row with
    cos(vectors[t], vectors[t']) > threshold. Rows of ``chunk`` query positions at a time keep the
    [B, chunk, T] similarity block small."""
    B, T, _ = vectors.shape
    z = F.normalize(vectors.float(), dim=-1)
    out = torch.zeros(B, T, dtype=torch.bool, device=vectors.device)
    later = torch.arange(T, device=vectors.device)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        cos = torch.einsum("bqf,bkf->bqk", z[:, s:e], z)  # [B, e-s, T]
        is_later = later[None, :] > torch.arange(s, e, device=vectors.device)[:, None]  # [e-s, T]
        out[:, s:e] = ((cos > threshold) & is_later[None]).any(-1)
    return out


def redundancy_weights(vectors: torch.Tensor, threshold: float = 0.625, weight: float = 2.0) -> torch.Tensor:
    """[B, T] weights: ``weight`` where :func:`redundancy_mask` marks a position, 1 elsewhere."""
    m = redundancy_mask(vectors, threshold)
    return torch.where(m, torch.full(m.shape, float(weight), device=m.device), torch.ones(m.shape, device=m.device))


def check_weighting(source: str, threshold: float, weight: float) -> None:
    if source not in WEIGHT_SOURCES:
        raise VVSError(f"cascade-source for drafter training must be logits or hidden, got {source!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
        raise VVSError(f"cascade-threshold must be a cosine in [-1, 1], got {threshold!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise VVSError(f"cascade-weight must be a finite number > 0, got {weight!r}")


def cascade_loss_weights(source: str = "logits", threshold: float = 0.625, weight: float = 2.0):
    """The ``loss_weights(feats [B,T,D], logits [B,T,V]) -> [B,T]`` callable of ``train_drafter``:
    similarity measured on the target's logits (the authors' LlamaGen runs) or hidden states (their
    final Lumina run). Weights carry no gradient."""
    check_weighting(source, threshold, weight)

    def loss_weights(feats: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return redundancy_weights(logits if source == "logits" else feats, threshold, weight)

    loss_weights.describe = dict(source=source, threshold=threshold, weight=weight)
    return loss_weights


def marked_fraction(target, tokens: torch.Tensor, labels: torch.Tensor, source: str = "logits",
                    threshold: float = 0.625, batch: int = 32) -> float:
    """Share of training positions the re-weighting marks (a diagnostic: near 0 or 1 it is a no-op)."""
    tc = target.config
    marked, total = 0, 0
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch):
            tok, lab = tokens[i:i + batch], labels[i:i + batch]
            c = tc.cls_token_num
            x = torch.cat([target.embed_condition(lab), target.embed_tokens(tok[:, :-1])], 1)
            f = target.forward_hidden(x, torch.arange(x.shape[1]))[:, c:]
            v = target.logits(f) if source == "logits" else f
            m = redundancy_mask(v, threshold)
            marked += int(m.sum())
            total += m.numel()
    return marked / max(1, total)
