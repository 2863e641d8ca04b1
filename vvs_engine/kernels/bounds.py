"""Index bounds of the data-movement and mass kernels.

Preconditions (the references raise on a violation; the Triton and CUDA kernels never touch memory
out of range): ``kv_compact`` src/dst in ``[0, S)``; ``gather_rows``/``scatter_rows_`` idx in
``[0, S)``; ``lantern_mass`` tokens in ``[0, min(V, neighbour-table rows))`` and neighbours ``< V``
(negative = padding); ``group_mass`` members ``< V`` (negative = padding).

A compiled kernel that meets a bad index skips it (and writes NaN where a result depends on it) and
raises a per-device flag on the device, without a host sync. ``raise_if_set`` reads the flag once,
at the end of a generation. ``VVS_CHECK_BOUNDS=1`` (debug) reads it after every kernel call instead.
"""
from __future__ import annotations

import os

import torch

from ..errors import VVSError

DEBUG_ENV = "VVS_CHECK_BOUNDS"
_FLAGS: dict[torch.device, torch.Tensor] = {}


def _key(device) -> torch.device:
    """``cuda`` and ``cuda:0`` name one flag (kernels see ``tensor.device``, the engine may hold ``cuda``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def error_flag(device: torch.device) -> torch.Tensor:
    """The device's int32 [1] flag (0 = no bad index seen since the last check)."""
    device = _key(device)
    if device not in _FLAGS:
        _FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _FLAGS[device]


def raise_if_set(device, where: str = "a kernel") -> None:
    """Raise VVSError (and clear the flag) if a kernel on ``device`` met an out-of-range index."""
    flag = _FLAGS.get(_key(device))
    if flag is not None and int(flag.item()) != 0:  # the one host read, at the end of a generation
        flag.zero_()
        raise VVSError(f"{where} got an out-of-range index (see vvs_engine/kernels/bounds.py for the preconditions)")


def debug() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"
