"""Shared pieces of the decoding methods: the batch a runner decodes and what it returns."""
from __future__ import annotations

import os
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
    compile: bool = False  # the decode rounds compiled by torch.compile (runtime.compiled)

    @property
    def size(self) -> int:
        return self.rng.batch


@dataclass
class MethodResult:
    tokens: torch.Tensor  # [B, tokens_per_image] int64, on the device
    stats: dict = field(default_factory=dict)  # method counters; target_forward_passes required
    image_passes: Optional[torch.Tensor] = None  # [B] target forwards while each image was unfinished


RETIRE_ENV = "VVS_RETIRE_FINISHED"


def retire_finished() -> bool:
    """Batched decodes drop their finished rows once at most half the batch is still decoding (so
    they stop costing compute); ``VVS_RETIRE_FINISHED=0`` keeps every row to the end (the benchmark's
    before/after switch). Tokens are the same either way."""
    return os.environ.get(RETIRE_ENV, "1") != "0"


def rows_to_keep(unfinished: torch.Tensor, n_real: int) -> tuple:
    """``unfinished`` [B] bool -> (rows [B'] int64, n_real'): the unfinished real rows first, then
    finished rows up to the next power of two B' (a batch bucket: few shapes for CUDA graphs).
    One host read; callers do this at most log2(B) times per batch."""
    flags = unfinished.tolist()
    real = [i for i in range(n_real) if flags[i]]
    size = 1 << max(0, len(real) - 1).bit_length()
    others = sorted((i for i in range(len(flags)) if i >= n_real or not flags[i]), key=lambda i: flags[i])
    keep = real + others[: size - len(real)]
    return torch.tensor(keep, dtype=torch.long, device=unfinished.device), len(real)


def progress(it, show: bool, desc: str):
    if not show:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, leave=False, dynamic_ncols=True)


class LateCounter:
    """Host view of a few device counters [n] that only decide when to stop or retire rows (Jacobi). On
    CUDA they are read one iteration late (copy to pinned memory + event), so the host never stalls the
    GPU; on the CPU at once. ``push(t)`` starts the copy of ``t`` and returns the last values read
    (also ``value``, a list of n ints; zeros before the first read, or ``initial`` [n] read now)."""

    def __init__(self, device, n: int = 1, initial: torch.Tensor | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.buf = torch.zeros(n, dtype=torch.long, pin_memory=self.cuda)
        self.event = None
        self.value = [0] * n if initial is None else initial.tolist()

    def push(self, t: torch.Tensor) -> list:
        if not self.cuda:
            self.value = t.tolist()
            return self.value
        if self.event is not None:
            self.event.synchronize()
            self.value = self.buf.tolist()
        self.buf.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        return self.value
