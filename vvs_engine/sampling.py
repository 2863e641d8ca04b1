"""Sampling: CFG combination, logits processing (temperature, top-k, top-p) and seeded sampling.

Everything stays on the device and is shape-static: no ``.item()``, no data-dependent shapes. Sampling
uses the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` drawn from a caller-owned
``torch.Generator``, which equals a categorical draw from ``p`` and needs no host sync.
Temperature 0 means greedy: the processed distribution is the one-hot of the argmax.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .errors import VVSError


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    cfg_scale: float = 4.0  # 1 = no guidance (no unconditional rows)

    def validate(self) -> "SamplingParams":
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise VVSError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise VVSError(f"top-k must be an integer >= 0 (0 = off), got {self.top_k}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0 < p <= 1):
            raise VVSError(f"top-p must be in (0, 1], got {p}")
        c = self.cfg_scale
        if not isinstance(c, (int, float)) or math.isnan(c) or math.isinf(c) or c < 0:
            raise VVSError(f"cfg-scale must be a finite number >= 0, got {c}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0

    def to_dict(self):
        return asdict(self)


def cfg_combine(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows ``[cond; uncond]`` (first dim 2B) -> ``uncond + scale * (cond - uncond)`` (first dim B)."""
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + scale * (cond - uncond)


def guided_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return cfg_combine(logits, params.cfg_scale) if params.use_cfg else logits


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Guided logits [..., V] -> the processed distribution p [..., V] (float32) that every method
    samples from and every lossless acceptance rule must reproduce."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        srt, idx = torch.sort(logits, dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        # Remove a token when the mass strictly before it already exceeds top_p (keeps >= 1 token).
        remove_sorted = (cum - srt.softmax(-1)) > params.top_p
        remove = torch.zeros_like(remove_sorted).scatter_(-1, idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One categorical draw per row of ``probs`` [..., V] -> int64 [...] (exponential race)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / e).argmax(-1)


def make_generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed))
    return g


def value_at(dist: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``dist[..., tokens]`` [...] for dist [..., V] as a masked sum over V: exactly the gathered value
    (one non-zero term), but a reduction over the row, which a compiled round computes in the kernel
    that computes ``dist`` (a gather needs dist in memory first, so it waits for a later kernel)."""
    V = dist.shape[-1]
    return torch.where(tokens[..., None] == torch.arange(V, device=dist.device), dist, 0).sum(-1)
