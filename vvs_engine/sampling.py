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


# --- reductions that keep compiled CPU rounds bitwise equal to eager ones ----------------------------
# Inductor's C++ code sums a row in another order than ATen's kernels (and divides where ATen's softmax
# multiplies by a reciprocal), so a compiled round's sampling distribution can differ from eager's in the
# last bit, and a sampled token on a CDF boundary then flips. Inside a round compiled for the CPU the
# sampling path's normalisers are therefore ATen's own kernels, called as opaque ops: compiled and eager
# CPU rounds give the same tokens. On a GPU Inductor fuses them as usual (its bf16 kernels differ from
# eager anyway; GPU checks compare a graph replay with the compiled round).
@torch.library.custom_op("vvs::aten_softmax", mutates_args=())
def _aten_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


@_aten_softmax.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("vvs::aten_mean_last", mutates_args=())
def _aten_mean_last(x: torch.Tensor) -> torch.Tensor:
    return x.mean(-1, keepdim=True)


@_aten_mean_last.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], 1))


def _eager_exact(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and torch.compiler.is_compiling()


def softmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.softmax(-1)``; ATen's kernel inside a CPU compile (see above)."""
    return _aten_softmax(x.contiguous()) if _eager_exact(x) else x.softmax(-1)


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1, keepdim=True)``; ATen's kernel inside a CPU compile (see above; RMSNorm's mean)."""
    return _aten_mean_last(x.contiguous()) if _eager_exact(x) else x.mean(-1, keepdim=True)


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
    return softmax_last(logits)


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
