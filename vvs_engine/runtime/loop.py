"""The one decode loop: every method is a *decoder* driven here, and images join the running batch
between rounds (continuous batching).

A decoder owns its caches and ``[rows, ...]`` device state and knows its rounds; this loop owns
everything between rounds, once for every method:

* the one-round-late read of the decoder's status (:class:`LateRead`: the host never waits for the
  device on CUDA, and the CPU makes the same decisions one round late too);
* admission and retirement: a row whose image has finished is collected and freed, and the next
  pending images are admitted into free rows (their condition prefill runs for those rows only, then
  they join the next round of the same compiled, captured function); ``static=True`` admits only when
  every row is free (today's static batches, kept for comparison); when nothing is pending and at most
  half the rows still decode, the batch shrinks to the next power of two (fewer rows to compute);
* ``torch.compile`` and CUDA-graph capture of each round kind (:class:`~vvs_engine.runtime.runner.
  RoundGraphs`: one capture path, one pool);
* progress, the stuck guard, and the loop's statistics (rounds by kind, row utilisation).

An image's tokens never depend on when it was admitted or on its batch-mates: every random draw is
keyed by (seed, image index, the row's own step), and a row's state is its own.

The decoder protocol (duck-typed; :class:`Decoder` documents it):

==========================  ==========================================================================
``round_functions()``       {round kind: function of no arguments} updating device state in place,
                            static shapes, no host read
``round_buffers()``         every tensor a round writes that a rerun must restore (capture warm-up)
``inductor_options``        Inductor options of its compiled rounds (dict, may be empty)
``status()``                int64 device tensor ``[rows + k]``: tokens committed per row (>= the
                            image's tokens: finished), then k flags of the decoder's own; the same
                            tensor object until ``keep_rows``
``next_kind(last, late)``   the next round kind from the last kind and the late status (a list)
``admit(rows, batch)``      prefill ``batch``'s images into ``rows`` (a [n] device tensor)
``keep_rows(keep)``         go on with rows ``keep`` only (the tail of a run)
``collect(rows)``           {name: [n, ...] tensor} per-row results: ``tokens`` [n, T] and ``passes``
                            [n] (target forwards while unfinished) at least; ``rounds`` [n] where
                            some rounds are no target forward (row utilisation counts those)
``summarize(counters, loop)`` the method's stats from the finished images' collected counters
==========================  ==========================================================================
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from ..errors import VVSError
from .runner import RoundGraphs


class Decoder(Protocol):  # pragma: no cover - documentation of the protocol above
    inductor_options: dict

    def round_functions(self) -> dict: ...
    def round_buffers(self) -> list: ...
    def status(self) -> torch.Tensor: ...
    def next_kind(self, last_kind: Optional[str], late: list) -> str: ...
    def admit(self, rows: torch.Tensor, batch) -> None: ...
    def keep_rows(self, keep: torch.Tensor) -> None: ...
    def collect(self, rows: torch.Tensor) -> dict: ...
    def summarize(self, counters: dict, loop_stats: dict) -> dict: ...


class LateRead:
    """Host view of a device status tensor, always one round late (on every device, so the CPU and
    CUDA make the same decisions): the status written by round r is read before round r + 2, by then
    long copied (pinned memory + event on CUDA), so the host never waits for the device."""

    def __init__(self, status: torch.Tensor):
        self.status = status
        self.cuda = status.device.type == "cuda"
        self.slots = [torch.zeros_like(status, device="cpu").pin_memory() if self.cuda
                      else torch.zeros_like(status, device="cpu") for _ in range(2)]
        self.events = [None, None]
        self.pushes = 0

    def push(self) -> None:
        i = self.pushes % 2
        self.slots[i].copy_(self.status, non_blocking=self.cuda)
        if self.cuda:
            self.events[i] = torch.cuda.Event()
            self.events[i].record()
        self.pushes += 1

    @property
    def read_index(self) -> int:
        """The number (from 0) of the push whose values :meth:`read` returns."""
        return self.pushes - 2

    def read(self) -> Optional[list]:
        """The values of the push before the latest one, or None while there is none."""
        if self.pushes < 2:
            return None
        i = self.pushes % 2  # the older of the two slots: push number self.pushes - 2
        if self.events[i] is not None:
            self.events[i].synchronize()
        return self.slots[i].tolist()


@dataclass
class LoopResult:
    """What the loop hands back: per image (in the caller's order) its tokens [n, T] and collected
    counters (CPU tensors), the method's stats and the loop's own."""

    tokens: torch.Tensor
    counters: dict
    stats: dict = field(default_factory=dict)


STALL_ROUNDS = 16  # the stuck guard: rounds in a row that commit nothing in any image in flight


def batch_bucket(n: int) -> int:
    """Rows in flight for n images: the next power of two (few shapes to compile and capture)."""
    return 1 << max(0, (n - 1).bit_length())


class FixedImages:
    """The pending images of one ``generate`` call: ``0..n-1``, all known at the start; each finished
    image's collected results are kept here by image."""

    def __init__(self, n_images: int):
        self.queue = deque(range(n_images))
        self.results: dict = {}  # image -> {name: tensor}

    def pending(self) -> int:
        return len(self.queue)

    def take(self, k: int) -> list:
        return [self.queue.popleft() for _ in range(min(k, len(self.queue)))]

    def wait(self) -> bool:
        return False  # nothing more will come: the loop ends when its images are done

    def dropped(self, images: list) -> list:
        return []

    def finished(self, image, result: dict) -> None:
        self.results[image] = result


class ImageSource(Protocol):  # pragma: no cover - documentation of what ``serve`` reads its images from
    """Where the loop takes pending images from (a server's queue; :class:`FixedImages` for ``run``).
    Every method is called on the loop's thread between two rounds; a server's implementation is
    thread-safe because its front end submits and cancels from another thread."""

    def pending(self) -> int: ...                      # images waiting for a row (a hint: take may give fewer)
    def take(self, k: int) -> list: ...                # up to k pending images, oldest first, never blocks
    def wait(self) -> bool: ...                        # block until an image is pending (True) or closed (False)
    def dropped(self, images: list) -> list: ...       # of these images in flight, those to abandon now
    def finished(self, image, result: dict) -> None: ...  # an image is done: its collected results
    # optional: progress(image, committed_tokens), round_done(kind, seconds, live_rows)


def _new_stats() -> dict:
    return {"batch_rounds": 0, "rounds_by_kind": {}, "row_rounds": 0, "admissions": 0, "compiled": {}}


def run(make_decoder: Callable, make_batch: Callable, n_images: int, rows: int, tokens_per_image: int, *,
        static: bool = False, compile: bool = False, use_graphs: bool = False, retire: bool = True,
        on_tokens: Optional[Callable[[int], None]] = None, on_images: Optional[Callable[[int], None]] = None,
        on_round: Optional[Callable[[int], None]] = None) -> LoopResult:
    """Decode ``n_images`` images with at most ``rows`` in flight.

    ``make_batch(images, pad_to)`` -> the method's batch of those images (positions in the caller's
    list), padded to ``pad_to`` rows by repeating the first; ``make_decoder(batch)`` -> a decoder
    prefilled with it. ``on_tokens(k)``/``on_images(k)``: progress (k more tokens committed / images
    finished). ``on_round(round_index)``: called before every round (tests admit or inspect there)."""
    T = tokens_per_image
    source = FixedImages(n_images)
    stats = _new_stats()
    decoder = None
    while source.pending():  # one pass per static batch; continuous batching needs one pass in all
        first = source.take(rows)
        size = batch_bucket(len(first)) if static or len(first) < rows else rows
        decoder = make_decoder(make_batch(first, size))
        _drive(decoder, first + [None] * (size - len(first)), source, make_batch, T, stats, static, compile,
               use_graphs, retire, False, on_tokens, on_images, on_round)
    results = source.results
    names = sorted(results[0]) if results else []
    counters = {name: torch.stack([results[i][name] for i in range(n_images)]) for name in names}
    # rows busy with a real image: its rounds ("rounds" where a decoder has rounds that are no target
    # forward, VVS's skips; else its forwards)
    busy = counters["rounds"] if "rounds" in counters else counters["passes"]
    stats["row_utilisation"] = float(busy.sum()) / stats["row_rounds"] if stats["row_rounds"] else 1.0
    stats["cuda_graphs"] = bool(use_graphs)
    method_stats = decoder.summarize(counters, stats) if decoder is not None else {}
    return LoopResult(counters.pop("tokens"), counters, {**stats, **method_stats})


def serve(make_decoder: Callable, make_batch: Callable, source, rows: int, tokens_per_image: int, *,
          static: bool = False, compile: bool = False, use_graphs: bool = False,
          on_round: Optional[Callable[[int], None]] = None) -> dict:
    """Decode the images ``source`` hands over until it closes (a server's engine thread runs this).

    The same loop as :func:`run` with three differences: images come from ``source`` as they are
    submitted (admitted into free rows between rounds), a row whose image ``source.dropped`` names is
    freed at the next round, and the batch keeps ``rows`` rows to the end (no tail shrink: every
    round runs the one shape compiled and captured at warm-up). With nothing in flight the loop
    blocks in ``source.wait()``. Before the first image is decoded every round kind is compiled and
    captured (``RoundGraphs.warm``), so no request waits for a compile. Returns the loop's stats."""
    stats = _new_stats()
    if not source.wait():
        return stats
    first = source.take(rows)
    decoder = make_decoder(make_batch(first, rows))
    _drive(decoder, first + [None] * (rows - len(first)), source, make_batch, tokens_per_image, stats, static,
           compile, use_graphs, False, True, None, None, on_round)
    stats["cuda_graphs"] = bool(use_graphs)
    return stats


def _drive(decoder, row_image: list, source, make_batch, T: int, stats: dict, static: bool, compile: bool,
           use_graphs: bool, retire: bool, serving: bool, on_tokens, on_images, on_round) -> None:
    """Run ``decoder`` until its rows are all finished and nothing is pending (``serving``: until the
    source closes; rows fixed)."""
    graphs = _graphs(decoder, compile, use_graphs)
    if serving:
        graphs.warm()
    late = LateRead(decoder.status())
    late.push()
    # A row's late status is about its current image only from the push after it was admitted.
    valid_from = [0] * len(row_image)
    reported = [0] * len(row_image)  # tokens of each row's image counted for progress
    last_kind, stalled, last_total = None, 0, -1
    progress = getattr(source, "progress", None)
    round_done = getattr(source, "round_done", None)
    while True:
        status = late.read()
        if status is not None:
            counts = [status[r] if late.read_index >= valid_from[r] else 0 for r in range(len(row_image))]
            _report_tokens(counts, row_image, reported, T, on_tokens, progress)
            done = [r for r, image in enumerate(row_image) if image is not None and counts[r] >= T]
            if done:
                _collect(decoder, done, row_image, source)
                for r in done:
                    row_image[r], reported[r] = None, 0
                if on_images is not None:
                    on_images(len(done))
            in_flight = [image for image in row_image if image is not None]
            dropped = source.dropped(in_flight) if in_flight else []
            if dropped:  # abandoned images (a client gone, a deadline): their rows are free from now on
                gone = set(dropped)
                for r, image in enumerate(row_image):
                    if image is not None and image in gone:
                        row_image[r], reported[r] = None, 0
            live = sum(image is not None for image in row_image)
            if not live and not source.pending():
                if not source.wait():  # a server blocks here while idle; a generate call is done
                    break
            free = [r for r, image in enumerate(row_image) if image is None]
            if source.pending() and free and (not static or live == 0):
                if static and not serving:  # the next static batch is a new decoder (the caller's next pass)
                    break
                if _admit(decoder, free, row_image, source, make_batch, late, valid_from):
                    stats["admissions"] += 1
            elif retire and not source.pending() and 0 < live <= len(row_image) // 2:
                # the tail: at most log2(rows) times; go on with the live rows and as few idle ones as
                # the next power of two needs
                keep = [r for r, image in enumerate(row_image) if image is not None]
                keep += [r for r, image in enumerate(row_image) if image is None][: batch_bucket(live) - live]
                _merge_compiled(stats, graphs)
                decoder.keep_rows(torch.tensor(keep, dtype=torch.long, device=decoder.status().device))
                row_image[:] = [row_image[r] for r in keep]
                reported[:] = [reported[r] for r in keep]
                graphs = _graphs(decoder, compile, use_graphs)
                late = LateRead(decoder.status())
                late.push()  # the kept rows' status after the last round: read before the next round
                late.push()  # (one host wait here, at most log2(rows) times a run)
                valid_from = [0] * len(row_image)
                continue
            # every round of an unfinished image commits a token, or a few in a row feed what a later
            # commit needs (ZipAR's row ends)
            total = sum(counts[r] for r, image in enumerate(row_image) if image is not None)
            # (a server's round with no image in flight, its admission just cancelled, is no stall)
            stalled = stalled + 1 if total == last_total and live else 0
            last_total = total
            if stalled >= STALL_ROUNDS:
                raise VVSError(f"decoding made no progress for {STALL_ROUNDS} rounds (internal error)")
        if on_round is not None:
            on_round(stats["batch_rounds"])
        kind = decoder.next_kind(last_kind, status)
        started = time.perf_counter()
        graphs(kind)
        late.push()
        if round_done is not None:  # host time of the round (on CUDA: of its launch)
            round_done(kind, time.perf_counter() - started, sum(image is not None for image in row_image))
        last_kind = kind
        stats["batch_rounds"] += 1
        stats["rounds_by_kind"][kind] = stats["rounds_by_kind"].get(kind, 0) + 1
        stats["row_rounds"] += len(row_image)
    _merge_compiled(stats, graphs)


def _graphs(decoder, compile: bool, use_graphs: bool) -> RoundGraphs:
    return RoundGraphs(decoder.round_functions(), decoder.round_buffers(), use_graphs=use_graphs, compile=compile,
                       options=getattr(decoder, "inductor_options", None))


def _merge_compiled(stats: dict, graphs: RoundGraphs) -> None:
    """``stats["compiled"]``: per round kind, compiled in every decoder shape that ran it."""
    for kind, ok in graphs.compiled().items():
        stats["compiled"][kind] = stats["compiled"].get(kind, True) and bool(ok)


def _report_tokens(counts: list, row_image: list, reported: list, T: int, on_tokens, progress) -> None:
    if on_tokens is None and progress is None:
        return
    new = 0
    for r, image in enumerate(row_image):
        if image is not None:
            now = min(counts[r], T)
            if now > reported[r]:
                new += now - reported[r]
                reported[r] = now
                if progress is not None:
                    progress(image, now)
    if new and on_tokens is not None:
        on_tokens(new)


def _collect(decoder, rows: Sequence[int], row_image: list, source) -> None:
    """Move finished rows' results to the host (one read per batch of finished rows)."""
    index = torch.tensor(rows, dtype=torch.long, device=decoder.status().device)
    out = {name: value.cpu() for name, value in decoder.collect(index).items()}
    for j, r in enumerate(rows):
        source.finished(row_image[r], {name: value[j] for name, value in out.items()})


def _admit(decoder, free: list, row_image: list, source, make_batch, late: LateRead, valid_from: list) -> bool:
    images = source.take(len(free))
    if not images:  # a server's images were cancelled since pending() said otherwise
        return False
    rows = free[: len(images)]
    decoder.admit(torch.tensor(rows, dtype=torch.long, device=decoder.status().device),
                  make_batch(images, len(images)))
    for r, image in zip(rows, images):
        row_image[r] = image
        valid_from[r] = late.pushes  # pushes before this one still show the row's previous image
    return True
