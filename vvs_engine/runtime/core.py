"""A persistent decode core: one method's decoders, built once and reused by every later call.

Why: building a decoder allocates its caches and, on CUDA, captures every round kind as a CUDA graph
after two warm-up rounds (``runner.RoundGraphs``); doing that on every ``generate`` call (and again at
every tail shrink) is a fixed tax per call that an engine called in a loop, or a server, pays over and
over. A :class:`DecodeCore` keeps one decoder per row count it has run at (the rows in flight and the
powers of two below them, ``scheduler.row_buckets``), each with its compiled, captured rounds:

* a new batch reuses the decoder of its row count: its images are *admitted* into it (prefilled on a
  decoder of their own and copied in, ``runtime.rows``), exactly as images join a running batch;
* a tail shrink moves the live rows into the smaller decoder (``RowTable.copy_rows``), built at its first
  use and kept;
* nothing a round reads is rebuilt, so the graphs captured over a decoder's buffers stay valid.

An image's tokens never depend on which decoder it ran in or what ran there before: every row's state
is its own (the loop's identity tests run on reused cores). Memory: a core holds one decoder per row
count it has used (at most rows + rows/2 + ... ~ twice the largest one's caches).

The core is model-free (``make_decoder(batch)`` builds a prefilled decoder); ``Engine`` keeps one core per
(method, options, sampling scope, compile, CUDA graphs) and ``serving`` uses the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Sequence

import torch

from .compiled import compile_count
from .rows import RowTable
from .runner import RoundGraphs, capture_count


@dataclass
class Slot:
    """One kept decoder and its rounds."""

    decoder: object
    graphs: RoundGraphs

    @cached_property
    def table(self) -> RowTable:
        decoder = self.decoder
        table = RowTable(_images(decoder), _use_cfg(decoder), decoder.status().device)
        decoder.declare_rows(table)
        return table

    @property
    def rows(self) -> int:
        return self.table.images


def _images(decoder) -> int:
    for name in ("B", "batch"):
        value = getattr(decoder, name, None)
        if isinstance(value, int):
            return value
    return decoder.session.n


def _use_cfg(decoder) -> bool:
    return bool(decoder.params.use_cfg)


class DecodeCore:
    """Decoders of one method (``make_decoder(batch)`` -> a prefilled decoder) kept per row count."""

    def __init__(self, make_decoder: Callable, compile: bool = False, use_graphs: bool = False):
        self.make_decoder, self.compile, self.use_graphs = make_decoder, bool(compile), bool(use_graphs)
        self.slots: Dict[int, Slot] = {}
        self.decoders_built = 0
        self.options = None  # the method options its decoders are built with (the engine sets it)

    def slot(self, rows: int, batch: Callable[[], object], warm: bool = False):
        """-> (the slot of ``rows`` rows, fresh): built now from ``batch()`` (prefilled with its images)
        if the core has none yet; ``warm``: compile and capture every round kind of a new slot now."""
        if rows in self.slots:
            return self.slots[rows], False
        decoder = self.make_decoder(batch())
        graphs = RoundGraphs(decoder.round_functions(), decoder.round_buffers(), use_graphs=self.use_graphs,
                             compile=self.compile, options=getattr(decoder, "inductor_options", None))
        slot = self.slots[rows] = Slot(decoder, graphs)
        self.decoders_built += 1
        if warm:
            graphs.warm()
        return slot, True

    def admit(self, slot: Slot, rows: Sequence[int], batch) -> None:
        """Rows ``rows`` of ``slot`` take ``batch``'s images: prefilled on a decoder of their own, copied in."""
        newcomers = self.make_decoder(batch)
        source = Slot(newcomers, None).table
        slot.table.copy_rows(list(rows), source, list(range(len(rows))))
        _written(slot.decoder, rows)

    def move(self, source: Slot, keep: List[int], target: Slot) -> None:
        """The tail of a run: rows ``keep`` of ``source`` become rows 0.. of ``target`` (a smaller slot)."""
        target.table.copy_rows(list(range(len(keep))), source.table, keep)
        _written(target.decoder, list(range(len(keep))))

    @staticmethod
    def collect(slot: Slot, rows: Sequence[int], tokens_per_image: int) -> dict:
        """{name: [n, ...] CPU tensor} of finished rows: the decoder's ``RESULTS`` (one host read)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=slot.table.device)
        out = slot.table.gather(slot.decoder.RESULTS, index)
        finish = getattr(slot.decoder, "finish_results", None)
        if finish is not None:
            out = finish(out)
        out["tokens"] = out["tokens"][:, :tokens_per_image]
        return {name: value.cpu() for name, value in out.items()}

    @staticmethod
    def committed(slot: Slot, rows: Sequence[int], tokens_per_image: int):
        """(tokens [n, T], committed [n, T] bool) of rows in flight, read now (a partial image: one host
        read, rare). Raster-order decoders commit a prefix (the status count); a decoder that commits
        elsewhere says which positions (``committed_mask``)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=slot.table.device)
        tokens = DecodeCore.collect(slot, rows, tokens_per_image)["tokens"]
        mask_of = getattr(slot.decoder, "committed_mask", None)
        if mask_of is not None:
            mask = mask_of(index).cpu()
        else:
            count = slot.decoder.status().index_select(0, index).cpu()
            mask = torch.arange(tokens_per_image)[None, :] < count[:, None]
        return tokens, mask

    def compiled(self, rows=None) -> dict:
        """Per round kind: compiled in every slot that ran it (``stats["compiled"]``); ``rows``: only the
        slots of these row counts (those a call ran on)."""
        out: dict = {}
        for size, slot in self.slots.items():
            if rows is not None and size not in rows:
                continue
            for kind, ok in slot.graphs.compiled().items():
                out[kind] = out.get(kind, True) and bool(ok)
        return out


def _written(decoder, rows) -> None:
    hook = getattr(decoder, "rows_written", None)
    if hook is not None:
        hook(torch.as_tensor(list(rows), dtype=torch.long, device=decoder.status().device))


class CallCounters:
    """Graph captures and Dynamo compiles during one call (``stats["graph_captures"]``, ``["compiles"]``)."""

    def __init__(self):
        self.captures, self.compiles = capture_count(), compile_count()

    def stats(self) -> dict:
        return {"graph_captures": capture_count() - self.captures, "compiles": compile_count() - self.compiles}

