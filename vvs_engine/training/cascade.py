"""CASCADE's drafter-training change (docs/methods.md §3): redundancy re-weighting.

Inside each training image, a position t whose target logit vector (or last-layer hidden state) has
cosine similarity above 0.625 with that of some *later* position t' > t is where inference-time
merging tends to fire; its classification (soft cross-entropy) term gets weight 2, the others 1.
:func:`train_drafter` normalises by the weight sum (the authors' 723b562 variant).

``cascade_loss_weights(...)`` is the ``loss_weights`` callable of :func:`vvs_engine.training.drafter.train_drafter`;
:func:`train_cascade_drafter` wraps the two. ``vvs-engine train-drafter --cascade-weighting`` uses it.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import List, Optional

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


def train_cascade_drafter(target, tokens: torch.Tensor, labels: torch.Tensor, source: str = "logits",
                          threshold: float = 0.625, weight: float = 2.0, **train_kw):
    """``train_drafter`` with CASCADE's redundancy re-weighting of the classification loss."""
    from .drafter import train_drafter

    return train_drafter(target, tokens, labels, loss_weights=cascade_loss_weights(source, threshold, weight),
                         **train_kw)


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


# --- command line ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vvs-engine train-drafter",
                                description="Train an EAGLE-style drafter on a class-conditional target "
                                            "(optionally with CASCADE's redundancy re-weighting).")
    p.add_argument("--tokens", required=True, metavar="PT",
                   help="torch file with 'tokens' [n, T] and 'labels' [n] (e.g. the Zoo trainer's "
                        "drafter_train_tokens.pt)")
    p.add_argument("--out", required=True, metavar="PATH", help="output .safetensors (+ .json)")
    p.add_argument("--gpt-ckpt", default=None, metavar="PATH", help="target checkpoint (default: the Zoo target)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cascade-weighting", action="store_true",
                   help="CASCADE: weight the classification loss of redundant tokens")
    p.add_argument("--cascade-weight", type=float, default=2.0, help="weight of marked tokens (default 2.0)")
    p.add_argument("--cascade-threshold", type=float, default=0.625, help="cosine threshold (default 0.625)")
    p.add_argument("--cascade-source", default="logits", help="logits|hidden (default logits)")
    return p


def cli_train_cascade_drafter(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    from ..checkpoint import save_safetensors
    from ..engine import Engine

    if a.cascade_weighting:
        check_weighting(a.cascade_source, a.cascade_threshold, a.cascade_weight)
    if not os.path.exists(a.tokens):
        raise VVSError(f"no such token file: {a.tokens}")
    data = torch.load(a.tokens)
    if not isinstance(data, dict) or "tokens" not in data or "labels" not in data:
        raise VVSError(f"{a.tokens}: expected a dict with 'tokens' and 'labels'")
    eng = Engine.load(gpt_ckpt=a.gpt_ckpt) if a.gpt_ckpt else Engine.load()
    target = eng.gpt.float()
    kw = dict(steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed)
    if a.cascade_weighting:
        d = train_cascade_drafter(target, data["tokens"], data["labels"], a.cascade_source, a.cascade_threshold,
                                  a.cascade_weight, **kw)
    else:
        from .drafter import train_drafter

        d = train_drafter(target, data["tokens"], data["labels"], **kw)
    extra = dict(cascade_weighting=bool(a.cascade_weighting), train=kw)
    if a.cascade_weighting:
        extra.update(cascade_source=a.cascade_source, cascade_threshold=a.cascade_threshold,
                     cascade_weight=a.cascade_weight)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_safetensors(d, a.out, d.config.to_dict(), kind="drafter", extra=extra)
    print(f"drafter written to {a.out}")
    return 0
