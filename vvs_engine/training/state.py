"""Resumable training states: one file per training loop (model, optimizer, generator, step ...),
written atomically and read with ``weights_only=True``; the Zoo's target and drafter loops use it."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import VVSError


def save_train_state(path: str, **state) -> None:
    """Write a resumable training state (model, optimizer, generator, step ...) atomically: a run killed
    while writing keeps the previous state file."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_train_state(path: str, schedule: dict) -> Optional[dict]:
    """The state saved by :func:`save_train_state`, or None when ``path`` does not exist. ``schedule``
    (steps, batch, lr, seed ...) must equal the saved one: resuming under another schedule would give a
    model that neither schedule describes."""
    if not path or not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=True)
    if state.get("schedule") != schedule:
        raise VVSError(f"{path} was saved with schedule {state.get('schedule')}, not {schedule}: delete it to "
                       f"start over, or resume with the same options")
    return state
