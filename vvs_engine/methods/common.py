"""Shared pieces of the decoding methods."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MethodResult:
    tokens: torch.Tensor  # [n_images, tokens_per_image] int64
    stats: dict = field(default_factory=dict)  # method-specific counters; target_forward_passes required


def progress(it, show: bool, desc: str):
    if not show:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, leave=False, dynamic_ncols=True)
