"""Attention layouts for the static KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LocalMask:
    """Queries whose K/V occupy slots ``[prefix_len, prefix_len + Q)``: each sees the whole committed
    prefix ``[0, prefix_len)`` (minus padded condition slots in ``key_valid``) plus the slots of the
    local block allowed by ``local`` [Q, Q] (causal for a chain or Jacobi window, ancestor mask for a
    tree, both for VVS post-verification). One shape serves every prefix length."""

    prefix_len: torch.Tensor  # [1] int64, on the device
    local: torch.Tensor  # [Q, Q] bool
    key_valid: Optional[torch.Tensor] = None  # [rows, S] bool


def causal_local(q: int, device) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()
