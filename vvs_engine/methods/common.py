"""Shared pieces of the decoding methods: the batch a runner decodes and what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..rng import CounterRNG


@dataclass
class DecodeBatch:
    """B images decoded together by one runner call.

    ``cond`` holds the condition rows as ``Engine.condition_rows`` builds them: the B conditional rows,
    then (with CFG) the B unconditional rows. ``rng`` is keyed by (seed, global image index), so an
    image's draws never depend on the batch it sits in. Rows ``n_real..B-1`` are bucket padding: decoded
    like the others (static shapes) and dropped by the caller.
    """

    cond: torch.Tensor
    key_mask: Optional[torch.Tensor]
    rng: CounterRNG
    n_real: int
    on_tokens: Optional[Callable[[int], None]] = None  # progress: called with newly committed tokens (host-side counts only)
    use_graphs: Optional[bool] = None  # CUDA graphs for the decode rounds; None = on for CUDA, off elsewhere

    @property
    def size(self) -> int:
        return self.rng.batch


@dataclass
class MethodResult:
    tokens: torch.Tensor  # [B, tokens_per_image] int64, on the device
    stats: dict = field(default_factory=dict)  # method counters; target_forward_passes required
    image_passes: Optional[torch.Tensor] = None  # [B] target forwards while each image was unfinished


def progress(it, show: bool, desc: str):
    if not show:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, leave=False, dynamic_ncols=True)


class LateCounter:
    """Host view of one device counter that only decides when to stop (Jacobi). On CUDA it is read one
    iteration late (copy to pinned memory + event), so the host never stalls the GPU; on the CPU at
    once. ``push(t)`` starts the copy of ``t`` [1] and returns the last value read (also ``value``)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.buf = torch.zeros(1, dtype=torch.long, pin_memory=self.cuda)
        self.event = None
        self.value = 0

    def push(self, t: torch.Tensor) -> int:
        if not self.cuda:
            self.value = int(t)
            return self.value
        if self.event is not None:
            self.event.synchronize()
            self.value = int(self.buf)
        self.buf.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        return self.value
