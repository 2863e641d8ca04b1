"""Torch reference implementations of the engine's kernels (the CPU path and the test oracle)."""
from __future__ import annotations

import torch


def kv_compact(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place, for K and V ``[L, B, H, S, D]``: slots ``dst`` take the values slots ``src`` held
    before the call. ``src``/``dst`` are ``[n]`` (same for all rows) device int64; the gather happens
    before any write, so overlapping ranges are fine."""
    for buf in (k, v):
        buf.index_copy_(3, dst, buf.index_select(3, src))
