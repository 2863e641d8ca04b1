"""Sampling: CFG combination, logits processing (temperature, top-k, top-p) and seeded sampling.

Everything stays on the device and is shape-static: no ``.item()``, no data-dependent shapes. Sampling
uses the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` drawn from a caller-owned
``torch.Generator``, which equals a categorical draw from ``p`` and needs no host sync.
Temperature 0 means greedy: the processed distribution is the one-hot of the argmax.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from typing import Callable, Optional, Sequence

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


def guided_logits(logits: torch.Tensor, params) -> torch.Tensor:
    """CFG combination of rows ``[cond; uncond]`` with one scale (``SamplingParams``) or each row's own
    (``RowSampling``: a row whose scale is 1 gets its conditional logits exactly)."""
    if isinstance(params, RowSampling):
        if params.uniform is not None:
            return guided_logits(logits, params.uniform) if params.use_cfg else logits
        if not params.use_cfg:
            return logits
        cond, uncond = logits.chunk(2, dim=0)
        scale = params.per_row(params.cfg_scale, cond)
        return torch.where(scale == 1.0, cond, uncond + scale * (cond - uncond))
    return cfg_combine(logits, params.cfg_scale) if params.use_cfg else logits


def process_logits(logits: torch.Tensor, params) -> torch.Tensor:
    """Guided logits [..., V] -> the processed distribution p [..., V] (float32) that every method
    samples from and every lossless acceptance rule must reproduce. ``params``: one setting for every
    row (``SamplingParams``), or each row's own (``RowSampling``; the leading dim of ``logits`` is the
    row), computed with the same arithmetic per row, so a row's p does not depend on its batch-mates'
    settings."""
    if isinstance(params, RowSampling):
        if params.uniform is not None:
            return process_logits(logits, params.uniform)
        return _process_rows(logits.float(), params)
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


# --- per-row settings (continuous batching: images with different settings share a batch) --------------
@dataclass(frozen=True)
class SamplingScope:
    """What sampling settings a decoder's rows may have; static, fixed when its rounds are compiled.

    ``uniform``: every row has these settings, and the rounds run exactly today's single-setting
    arithmetic (``generate`` with one setting per call). Otherwise each row has its own settings
    (device tensors, written at admission) and the flags say which code paths a round needs: greedy
    rows, sampled rows, top-k, top-p, and whether condition rows come with unconditional (CFG) rows."""

    uniform: Optional[SamplingParams] = None
    greedy: bool = True
    sampled: bool = True
    top_k: bool = True
    top_p: bool = True
    use_cfg: bool = True

    @classmethod
    def of(cls, settings: Sequence[SamplingParams]) -> "SamplingScope":
        settings = list(settings)
        if not settings:
            raise VVSError("no sampling settings")
        first = settings[0]
        if all(x == first for x in settings):
            return cls(first, first.greedy, not first.greedy, first.top_k > 0, first.top_p < 1.0, first.use_cfg)
        return cls(None, any(x.greedy for x in settings), any(not x.greedy for x in settings),
                   any(x.top_k > 0 for x in settings), any(x.top_p < 1.0 for x in settings),
                   any(x.use_cfg for x in settings))

    @classmethod
    def server(cls, use_cfg: bool = True) -> "SamplingScope":
        """Any settings per row (a server's requests); ``use_cfg=False``: no guidance rows at all (every
        request's cfg_scale must then be 1)."""
        return cls(None, True, True, True, True, use_cfg)

    def allows(self, params: SamplingParams) -> Optional[str]:
        """None if a row with ``params`` can join, else why not (one line)."""
        if self.uniform is not None:
            return None if params == self.uniform else "this batch decodes one setting only"
        if params.use_cfg and not self.use_cfg:
            return "this server runs without classifier-free guidance (cfg_scale must be 1)"
        if (params.greedy and not self.greedy) or (not params.greedy and not self.sampled) or \
                (params.top_k > 0 and not self.top_k) or (params.top_p < 1.0 and not self.top_p):
            return "these sampling settings are outside what this batch was built for"
        return None


@dataclass
class RowSettings:
    """Sampling settings of n images, one per row, as tensors (what a ``DecodeBatch`` carries)."""

    temperature: torch.Tensor  # [n] float32 (0 = greedy)
    top_k: torch.Tensor  # [n] int64 (0 = off)
    top_p: torch.Tensor  # [n] float32 (1 = off)
    cfg_scale: torch.Tensor  # [n] float32

    @classmethod
    def of(cls, settings: Sequence[SamplingParams], device) -> "RowSettings":
        settings = list(settings)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.tensor([float(x.temperature) for x in settings], **f32),
                   torch.tensor([int(x.top_k) for x in settings], dtype=torch.long, device=device),
                   torch.tensor([float(x.top_p) for x in settings], **f32),
                   torch.tensor([float(x.cfg_scale) for x in settings], **f32))

    def tensors(self) -> list:
        return [self.temperature, self.top_k, self.top_p, self.cfg_scale]


class RowSampling:
    """A decoder's sampling settings: its scope (static) and, unless uniform, each row's settings as
    persistent device tensors that admission overwrites in place (declared in the decoder's row table),
    so a compiled, captured round reads the newcomers' settings without being rebuilt."""

    def __init__(self, scope, rows: Optional[RowSettings], n: int, device):
        if isinstance(scope, SamplingParams):  # one setting for every row
            scope = SamplingScope.of([scope])
        self.scope = scope
        self.uniform = scope.uniform
        self.use_cfg = scope.use_cfg
        if self.uniform is not None:
            rows = RowSettings.of([self.uniform] * n, device)
        elif rows is None:
            raise VVSError("per-row sampling settings are missing for a batch of mixed settings")
        self.rows = rows

    @property
    def temperature(self) -> torch.Tensor:
        return self.rows.temperature

    @property
    def top_k(self) -> torch.Tensor:
        return self.rows.top_k

    @property
    def top_p(self) -> torch.Tensor:
        return self.rows.top_p

    @property
    def cfg_scale(self) -> torch.Tensor:
        return self.rows.cfg_scale

    def declare_rows(self, table) -> None:
        """The rows' settings in a decoder's row table (``runtime.rows``): admission overwrites them."""
        for name, value in zip(("temperature", "top_k", "top_p", "cfg_scale"), self.rows.tensors()):
            table.add("sampling_" + name, value)

    @staticmethod
    def per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[B] per-row values shaped to broadcast against ``like`` [B, ...]."""
        return values.view(values.shape[0], *([1] * (like.dim() - 1)))

    def pick(self, greedy: Callable, sampled: Callable):
        """The greedy rows' result of ``greedy()`` and the sampled rows' of ``sampled()`` (tensors
        [B, ...] or tuples/dataclasses of them). With one setting, or rows of one kind, only the
        needed function runs (today's arithmetic); a mixed batch runs both and picks per row."""
        if self.uniform is not None:
            return greedy() if self.uniform.greedy else sampled()
        if not self.scope.sampled:
            return greedy()
        if not self.scope.greedy:
            return sampled()
        return _pick_rows(self.temperature == 0, greedy(), sampled())

    def draft_view(self) -> "RowSampling":
        """The settings a drafter ranks its drafts under: greedy rows at temperature 1 (a one-hot
        would leave nothing to rank), everything else as the row's own."""
        if self.uniform is not None:
            u = self.uniform
            return RowSampling(SamplingParams(u.temperature if u.temperature > 0 else 1.0, u.top_k, u.top_p,
                                              u.cfg_scale), None, self.rows.temperature.shape[0],
                               self.rows.temperature.device)
        view = object.__new__(RowSampling)
        view.scope = SamplingScope(None, False, True, self.scope.top_k, self.scope.top_p, self.scope.use_cfg)
        view.uniform, view.use_cfg = None, self.use_cfg
        view.rows = RowSettings(torch.where(self.temperature > 0, self.temperature, 1.0), self.top_k, self.top_p,
                                self.cfg_scale)
        return view


def _pick_rows(greedy_rows: torch.Tensor, greedy_value, sampled_value):
    if isinstance(greedy_value, torch.Tensor):
        mask = greedy_rows.view(greedy_rows.shape[0], *([1] * (greedy_value.dim() - 1)))
        return torch.where(mask, greedy_value, sampled_value)
    if isinstance(greedy_value, (tuple, list)):
        return type(greedy_value)(_pick_rows(greedy_rows, g, s) for g, s in zip(greedy_value, sampled_value))
    if is_dataclass(greedy_value):
        return replace(greedy_value, **{f.name: _pick_rows(greedy_rows, getattr(greedy_value, f.name),
                                                           getattr(sampled_value, f.name))
                                        for f in fields(greedy_value)
                                        if isinstance(getattr(greedy_value, f.name), torch.Tensor)})
    if greedy_value is None or isinstance(greedy_value, (bool, int, float)):
        return greedy_value
    raise TypeError(f"cannot pick rows of {type(greedy_value).__name__}")


def _process_rows(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    """``process_logits`` with each row's own settings: per row the same operations, in the same order,
    as the single-setting path, so a row's distribution is bitwise the one it gets alone."""
    scope, V = params.scope, logits.shape[-1]
    temperature = params.per_row(params.temperature, logits)
    greedy_rows = temperature == 0
    x = logits / torch.where(greedy_rows, 1.0, temperature)
    if scope.top_k:
        k = params.per_row(params.top_k, logits)
        use = (k > 0) & (k < V)
        ordered = torch.sort(x, dim=-1, descending=True).values
        kth = ordered.gather(-1, (k - 1).clamp(0, V - 1).expand(*x.shape[:-1], 1))
        x = x.masked_fill(use & (x < kth), float("-inf"))
    if scope.top_p:
        top_p = params.per_row(params.top_p, logits)
        srt, idx = torch.sort(x, dim=-1, descending=True)
        probs = srt.softmax(-1)
        remove_sorted = ((probs.cumsum(-1) - probs) > top_p) & (top_p < 1.0)
        remove = torch.zeros_like(remove_sorted).scatter_(-1, idx, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    probs = softmax_last(x)
    if scope.greedy:
        one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy_rows, one_hot, probs)
    return probs
