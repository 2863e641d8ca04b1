"""Shared pieces of the decoding methods: the batch of images a decoder is prefilled with."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

import torch

from ..rng import CounterRNG
from ..sampling import RowSampling, RowSettings


@dataclass
class DecodeBatch:
    """Images a decoder is prefilled with (all of them at its start, or the newcomers of an admission).

    ``cond`` holds the condition rows as ``Engine.condition_rows`` builds them: the conditional rows,
    then (with CFG) the unconditional rows. ``rng`` is keyed by (seed, global image index), so an
    image's draws never depend on the batch it sits in. Rows ``n_real..`` are padding (a repeat of the
    first image: static shapes) that the decode loop never collects.
    """

    cond: torch.Tensor
    key_mask: Optional[torch.Tensor]
    rng: CounterRNG
    n_real: int
    sampling: Optional[RowSettings] = None  # each row's settings (None: the decoder's one setting)

    @property
    def size(self) -> int:
        return self.rng.batch


def row_sampling(scope, batch: DecodeBatch, device) -> RowSampling:
    """A decoder's sampling settings for ``batch``: ``scope`` is a ``SamplingScope`` (or one
    ``SamplingParams`` for every row); the batch's rows bring their own settings where it is mixed."""
    return RowSampling(scope, batch.sampling, batch.size, device)


class RowState:
    """Base of a decoder's state dataclass: every field a ``[rows, ...]`` device buffer the rounds update
    in place (what a rerun of a round must restore)."""

    def tensors(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]


def declare_decoder_rows(table, session, params, rng, state) -> None:
    """The row buffers of a decoder on one target session: the session's (KV cache, conditions), the rows'
    sampling settings and random-number keys, and every field of its state dataclass."""
    session.declare_rows(table)
    params.declare_rows(table)
    table.add("rng_key", rng.key)
    for f in fields(state):
        table.add(f.name, getattr(state, f.name))


RETIRE_ENV = "VVS_RETIRE_FINISHED"


def retire_finished() -> bool:
    """The decode loop shrinks the batch once nothing is pending and at most half its rows still
    decode (finished rows stop costing compute); ``VVS_RETIRE_FINISHED=0`` keeps every row to the end
    (the benchmarks' before/after switch). Tokens are the same either way."""
    return os.environ.get(RETIRE_ENV, "1") != "0"
