"""The one decode loop: every method is a *decoder* driven here, and images join the running batch
between rounds (continuous batching).

A decoder owns its caches and ``[rows, ...]`` device state and knows its rounds; everything between
rounds lives here and in two model-free helpers, once for every method:

* :class:`~vvs_engine.runtime.core.DecodeCore`: the method's decoders kept per row count, with their
  rounds compiled and captured once (``runner.RoundGraphs``) and reused by every later call: a new batch
  is admitted into a kept decoder; a tail shrink moves the live rows into the kept smaller one;
* :class:`~vvs_engine.runtime.scheduler.Scheduler`: which image each row holds, the one-round-late
  validity of a row's status, admission, retirement, partial-image points and the stuck guard;
* the one-round-late read of the decoder's status (:class:`LateRead`: the host never waits for the
  device on CUDA, and the CPU makes the same decisions one round late too), progress and loop stats.

``run`` (a known list of images: ``Engine.generate``) and ``serve`` (images from a thread-safe source: a
server) are one path, :func:`drive`, over an image source.

An image's tokens never depend on when it was admitted, on its batch-mates, or on which kept decoder
it ran in: every random draw is keyed by (seed, image index, the row's own step), and a row's state is
its own.

The decoder protocol (duck-typed; :class:`Decoder` documents it):

==========================  ==========================================================================
``round_functions()``       {round kind: function of no arguments} updating device state in place,
                            static shapes, no host read
``round_buffers()``         every tensor a round writes that a rerun must restore (capture warm-up)
``inductor_options``        Inductor options of its compiled rounds (dict, may be empty)
``status()``                int64 device tensor ``[rows + k]``: tokens committed per row (>= the
                            image's tokens: finished), then k flags of the decoder's own; always the
                            same tensor object
``next_kind(last, late)``   the next round kind from the last kind and the late status (a list)
``declare_rows(table)``     every per-row buffer, once (``runtime.rows.RowTable``): admission,
                            compaction and collection are generic
``RESULTS``                 row buffers collected per finished image: ``tokens`` [n, >= T] and
                            ``passes`` [n] (target forwards while unfinished) at least; ``rounds``
                            where some rounds are no target forward (row utilisation counts those)
``summarize(counters, loop)`` the method's stats from the finished images' collected counters
optional                    ``rows_written(rows)`` (derived state after rows took other images),
                            ``finish_results(out)`` (rename or derive collected results),
                            ``start_run()`` (a kept decoder starts a new run), ``committed_mask(rows)``
                            (which positions are final, for decoders that do not commit in raster order)
==========================  ==========================================================================
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from .core import CallCounters, DecodeCore
from .scheduler import STALL_ROUNDS, Scheduler, batch_bucket  # noqa: F401  (re-exported)


class Decoder(Protocol):  # pragma: no cover - documentation of the protocol above
    inductor_options: dict
    RESULTS: tuple

    def round_functions(self) -> dict: ...
    def round_buffers(self) -> list: ...
    def status(self) -> torch.Tensor: ...
    def next_kind(self, last_kind: Optional[str], late: list) -> str: ...
    def declare_rows(self, table) -> None: ...
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


class FixedImages:
    """The pending images of one ``generate`` call: ``0..n-1``, all known at the start; each finished
    image's collected results are kept here by image. ``partial_points(image)``: committed-token counts
    at which the image's partial images are due (none by default); ``on_partial(image, index, tokens,
    committed)`` receives them on the loop's thread."""

    def __init__(self, n_images: int, partial_points: Optional[Callable] = None,
                 on_partial: Optional[Callable] = None):
        self.queue = deque(range(n_images))
        self.results: dict = {}  # image -> {name: tensor}
        self._points, self._on_partial = partial_points, on_partial

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

    def partial_points(self, image) -> list:
        return self._points(image) if self._points is not None else []

    def partial(self, image, index: int, tokens, committed) -> None:
        if self._on_partial is not None:
            self._on_partial(image, index, tokens, committed)


class ImageSource(Protocol):  # pragma: no cover - documentation of what the loop reads its images from
    """Where the loop takes pending images from (a server's queue; :class:`FixedImages` for ``run``).
    Every method is called on the loop's thread between two rounds; a server's implementation is
    thread-safe because its front end submits and cancels from another thread."""

    def pending(self) -> int: ...                      # images waiting for a row (a hint: take may give fewer)
    def take(self, k: int) -> list: ...                # up to k pending images, oldest first, never blocks
    def wait(self) -> bool: ...                        # block until an image is pending (True) or closed (False)
    def dropped(self, images: list) -> list: ...       # of these images in flight, those to abandon now
    def finished(self, image, result: dict) -> None: ...  # an image is done: its collected results
    # optional: progress(image, committed_tokens), round_done(kind, seconds, live_rows);
    # partial images: partial_points(image) -> committed counts at which partials are due, or
    # partial_images(image) -> 0..3 (evenly spaced); partial(image, index, tokens [T], committed [T] bool)


def partial_points(count: int, tokens_per_image: int) -> list:
    """``count`` partial images evenly spaced over an image: due at k * T / (count + 1) tokens."""
    return [max(1, (k * tokens_per_image) // (count + 1)) for k in range(1, count + 1)]


def _new_stats() -> dict:
    # round_seconds: host time inside the rounds (the CPU's compute; on CUDA only the launches)
    return {"batch_rounds": 0, "rounds_by_kind": {}, "row_rounds": 0, "admissions": 0, "compiled": {},
            "round_seconds": 0.0}


def run(make_decoder: Callable, make_batch: Callable, n_images: int, rows: int, tokens_per_image: int, *,
        static: bool = False, compile: bool = False, use_graphs: bool = False, retire: bool = True,
        on_tokens: Optional[Callable[[int], None]] = None, on_images: Optional[Callable[[int], None]] = None,
        on_round: Optional[Callable[[int], None]] = None, core: Optional[DecodeCore] = None,
        source: Optional[FixedImages] = None) -> LoopResult:
    """Decode ``n_images`` images with at most ``rows`` in flight.

    ``make_batch(images, pad_to)`` -> the method's batch of those images (positions in the caller's
    list), padded to ``pad_to`` rows by repeating the first; ``make_decoder(batch)`` -> a decoder
    prefilled with it. ``core``: the persistent core to run on (kept by the caller; a new one otherwise).
    ``on_tokens(k)``/``on_images(k)``: progress (k more tokens committed / images finished).
    ``on_round(round_index)``: called before every round (tests admit or inspect there)."""
    core = core if core is not None else DecodeCore(make_decoder, compile, use_graphs)
    source = source if source is not None else FixedImages(n_images)
    counters = CallCounters()
    stats, decoder = drive(core, source, make_batch, rows, tokens_per_image, static=static, retire=retire,
                           serving=False, on_tokens=on_tokens, on_images=on_images, on_round=on_round)
    results = source.results
    names = sorted(results[0]) if results else []
    per_image = {name: torch.stack([results[i][name] for i in range(n_images)]) for name in names}
    # rows busy with a real image: its rounds ("rounds" where a decoder has rounds that are no target
    # forward, VVS's skips; else its forwards)
    busy = per_image["rounds"] if "rounds" in per_image else per_image["passes"]
    stats["row_utilisation"] = float(busy.sum()) / stats["row_rounds"] if stats["row_rounds"] else 1.0
    stats["cuda_graphs"] = bool(core.use_graphs)
    stats.update(counters.stats())
    method_stats = decoder.summarize(per_image, stats) if decoder is not None else {}
    return LoopResult(per_image.pop("tokens"), per_image, {**stats, **method_stats})


def serve(make_decoder: Callable, make_batch: Callable, source, rows: int, tokens_per_image: int, *,
          static: bool = False, compile: bool = False, use_graphs: bool = False,
          on_round: Optional[Callable[[int], None]] = None, core: Optional[DecodeCore] = None) -> dict:
    """Decode the images ``source`` hands over until it closes (a server's engine thread runs this).

    The same loop as :func:`run` with three differences: images come from ``source`` as they are
    submitted (admitted into free rows between rounds), a row whose image ``source.dropped`` names is
    freed at the next round, and the batch keeps ``rows`` rows to the end (no tail shrink: every
    round runs the one shape compiled and captured at warm-up). With nothing in flight the loop
    blocks in ``source.wait()``. Before the first image is decoded every round kind is compiled and
    captured (``RoundGraphs.warm``), so no request waits for a compile. Returns the loop's stats."""
    core = core if core is not None else DecodeCore(make_decoder, compile, use_graphs)
    stats, _ = drive(core, source, make_batch, rows, tokens_per_image, static=static, retire=False, serving=True,
                     on_round=on_round)
    stats["cuda_graphs"] = bool(core.use_graphs)
    return stats


def drive(core: DecodeCore, source, make_batch: Callable, rows: int, T: int, *, static: bool, retire: bool,
          serving: bool, on_tokens=None, on_images=None, on_round=None):
    """Decode until nothing is in flight or pending (``serving``: until the source closes). Returns the
    loop's stats and the decoder that ran last (its ``summarize`` makes the method's stats)."""
    stats = _new_stats()
    sched = Scheduler(T, static=static, retire=retire)
    slot, late = None, None
    used = set()  # row counts of the kept decoders this call ran on
    progress = getattr(source, "progress", None)
    round_done = getattr(source, "round_done", None)
    last_kind = None
    while True:
        if slot is None or not sched.live():
            if not source.pending() and not source.wait():  # a server blocks here while idle
                break
            first = source.take(rows)
            if not first:  # a server's images were cancelled since pending() said otherwise
                continue
            size = rows if serving else batch_bucket(len(first)) if static or len(first) < rows else rows
            slot, fresh = core.slot(size, lambda: make_batch(first, size), warm=serving)
            if not fresh:  # a batch's start on a kept decoder: for a run as on a new one (stats must not
                # depend on what the engine ran before); a server admits into its one running decoder
                core.admit(slot, range(len(first)), make_batch(first, len(first)))
                if serving:
                    stats["admissions"] += 1
            used.add(size)
            hook = getattr(slot.decoder, "start_run", None)
            if hook is not None:
                hook()
            sched.start(size, first, [_points(source, image, T) for image in first])
            late = LateRead(slot.decoder.status())
            late.push()
            last_kind = None
        status = late.read()
        if status is not None:
            counts = sched.counts(status, late.read_index)
            _report(sched.new_tokens(counts), on_tokens, progress)
            plan = sched.plan(counts)
            if plan.partials:
                _partials(core, slot, plan.partials, sched, source, T)
            if plan.done:
                _collect(core, slot, plan.done, sched, source, T)
                sched.free(plan.done)
                if on_images is not None:
                    on_images(len(plan.done))
            in_flight = sched.in_flight()
            dropped = source.dropped(in_flight) if in_flight else []
            if dropped:  # abandoned images (a client gone, a deadline): their rows are free from now on
                sched.drop(dropped)
            plan = sched.after_frees(plan, source.pending())
            if plan.stop:
                if serving:
                    continue  # the top of the loop waits for the next image
                break
            if plan.admit:
                if static and not serving and sched.live() == 0:
                    continue  # the next static batch starts afresh at the top of the loop
                if _admit(core, slot, sched, source, make_batch, late, T):
                    stats["admissions"] += 1
            elif plan.keep is not None:
                # the tail: at most log2(rows) times; the live rows (and as few idle ones as the next
                # power of two needs) move into the kept decoder of that size
                smaller, _ = core.slot(len(plan.keep), lambda: make_batch(sched.in_flight()[:1], len(plan.keep)))
                used.add(len(plan.keep))
                core.move(slot, plan.keep, smaller)
                slot = smaller
                sched.kept(plan.keep)
                late = LateRead(slot.decoder.status())
                late.push()  # the kept rows' status after the last round: read before the next round
                late.push()  # (one host wait here, at most log2(rows) times a run)
                continue
            sched.check_progress(counts)
        if on_round is not None:
            on_round(stats["batch_rounds"])
        kind = slot.decoder.next_kind(last_kind, status)
        started = time.perf_counter()
        slot.graphs(kind)
        late.push()
        seconds = time.perf_counter() - started
        stats["round_seconds"] += seconds
        if round_done is not None:  # host time of the round (on CUDA: of its launch)
            round_done(kind, seconds, sched.live())
        last_kind = kind
        stats["batch_rounds"] += 1
        stats["rounds_by_kind"][kind] = stats["rounds_by_kind"].get(kind, 0) + 1
        stats["row_rounds"] += sched.size
    stats["compiled"] = core.compiled(used) if core.compile else {}
    return stats, slot.decoder if slot is not None else None


def _points(source, image, T: int) -> list:
    """The committed counts at which ``image``'s partial images are due (none unless the source asks)."""
    points = getattr(source, "partial_points", None)
    if points is not None:
        return sorted(points(image))
    count = getattr(source, "partial_images", None)
    return partial_points(int(count(image)), T) if count is not None else []


def _report(new: list, on_tokens, progress) -> None:
    if progress is not None:
        for _, image, now, _ in new:
            progress(image, now)
    grown = sum(step for *_, step in new)
    if grown and on_tokens is not None:
        on_tokens(grown)


def _collect(core: DecodeCore, slot, rows: list, sched: Scheduler, source, T: int) -> None:
    """Move finished rows' results to the host (one read per batch of finished rows)."""
    out = core.collect(slot, rows, T)
    for j, r in enumerate(rows):
        source.finished(sched.row_image[r], {name: value[j] for name, value in out.items()})


def _partials(core: DecodeCore, slot, due: list, sched: Scheduler, source, T: int) -> None:
    """Hand the source the committed tokens of rows whose partial images are due (one read for all)."""
    rows = [r for r, _ in due]
    tokens, committed = core.committed(slot, rows, T)
    for j, (r, index) in enumerate(due):
        source.partial(sched.row_image[r], index, tokens[j], committed[j])


def _admit(core: DecodeCore, slot, sched: Scheduler, source, make_batch, late: LateRead, T: int) -> bool:
    free = sched.free_rows()
    images = source.take(len(free))
    if not images:  # a server's images were cancelled since pending() said otherwise
        return False
    rows = free[: len(images)]
    core.admit(slot, rows, make_batch(images, len(images)))
    # reads numbered before this push still show the rows' previous images
    sched.admitted(rows, images, late.pushes, [_points(source, image, T) for image in images])
    return True
