"""The sampling gap D: how far a decode's tokens are from the target's own sampling distribution.

For a sampler that draws every token from the target's processed distribution p(. | x_<t), whatever the
prefix, the surprisal of the drawn token has expectation equal to the entropy of p at that step:
E[-log p(x_t | x_<t) - H(p(. | x_<t))] = 0. Per image, D is the mean over its tokens of that difference
(nats per token), teacher-forced through the target (``Engine.score``: one forward per image, CFG
combined as the sampler combines it, then the sampler's own temperature / top-k / top-p processing).
Over images D averages to 0 for an exact method; a mode-seeking (low-temperature, greedy-leaning)
decode reads negative, an over-dispersed one (high temperature, loose acceptance) positive. The images
are independent, so D's 95 % interval is its mean +- 1.96 standard errors over images.

No reference images are needed, and its interval at 512 Zoo images is about +-0.008 nats/token, against
+0.25 for AR sampled at temperature 1.1: far sharper than class accuracy or a Frechet distance.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import VVSError

Z95 = 1.96


def sampling_gap_per_image(engine, tokens, class_labels: Optional[Sequence[int]] = None, prompts=None,
                           cfg_scale: float = 4.0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                           batch_size: int = 16) -> np.ndarray:
    """D of each row of ``tokens`` [n, T] under ``engine``'s target at the given sampling: float64 [n]
    (nats per token). A token the processed distribution gives probability 0 (outside top-k / top-p)
    makes its image's D infinite: those tokens cannot come from that sampling."""
    from ..sampling import SamplingParams, process_logits

    params = SamplingParams(temperature, top_k, top_p, cfg_scale).validate()
    if params.greedy:
        raise VVSError("the sampling gap needs a sampled distribution (temperature > 0), not greedy decoding")
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if tokens.dim() != 2 or tokens.shape[0] == 0:
        raise VVSError(f"tokens must be [n, T] with n >= 1, got shape {tuple(tokens.shape)}")
    n = tokens.shape[0]
    if class_labels is not None and len(class_labels) != n:
        raise VVSError(f"{n} token rows but {len(class_labels)} labels")
    if prompts is not None and len(prompts) != n:
        raise VVSError(f"{n} token rows but {len(prompts)} prompts")
    out = np.empty(n, dtype=np.float64)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            sl = slice(start, min(start + batch_size, n))
            logits = engine.score(class_labels=None if class_labels is None else list(class_labels[sl]),
                                  prompts=None if prompts is None else list(prompts[sl]), tokens=tokens[sl],
                                  cfg_scale=cfg_scale)
            p = process_logits(logits, params).double()  # [b, T, V]: the distribution the sampler draws from
            logp = torch.where(p > 0, p.clamp_min(1e-300).log(), torch.zeros_like(p))
            entropy = -(p * logp).sum(-1)  # [b, T]
            picked = p.gather(-1, tokens[sl].to(p.device)[..., None]).squeeze(-1)
            nll = torch.where(picked > 0, -picked.clamp_min(1e-300).log(), torch.full_like(picked, math.inf))
            out[sl] = (nll - entropy).mean(-1).cpu().numpy()
    return out


def summarise_gap(per_image) -> dict:
    """Per-image D -> {"value": mean, "ci": mean +- 1.96 standard errors, "half_width", "z", "n"}
    (z = mean / standard error: how many standard errors from exact)."""
    d = np.asarray(per_image, dtype=np.float64)
    if d.size == 0:
        raise VVSError("no images to summarise")
    mean = float(d.mean())
    if not np.isfinite(mean):
        return {"value": mean, "ci": (mean, mean), "half_width": math.inf, "z": math.inf, "n": int(d.size)}
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.inf
    half = Z95 * se
    z = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    return {"value": mean, "ci": (mean - half, mean + half), "half_width": half, "z": z, "n": int(d.size)}


def reads_exact(summary: dict) -> bool:
    """D's interval holds 0: the decode is not detectably off the target's distribution."""
    lo, hi = summary["ci"]
    return lo <= 0.0 <= hi


def format_gap(summary: dict, nd: int = 3) -> str:
    """'+0.004 ± 0.008' (the mean and the half width of its 95 % interval)."""
    if not math.isfinite(summary["value"]):
        return "inf (tokens outside the sampling's support)"
    return f"{summary['value']:+.{nd}f} ± {summary['half_width']:.{nd}f}"
