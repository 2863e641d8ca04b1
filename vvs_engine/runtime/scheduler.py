"""The schedule of the decode loop, with no model in it: which image each row holds, when a row's status
is about its image, when images finish, are admitted, or the batch shrinks, and the stuck guard.

``runtime.loop`` runs it over a decoder; ``benchmarks/continuous_batching.py`` replays it over per-image
forward counts (its simulator drives this same class), so the two cannot drift apart.

The host reads each row's committed-token count one round late (``LateRead``): the count read before
round r + 2 is the one round r wrote. A row's count is about its current image only from the first
read taken after the image was admitted (``valid_from``); earlier reads show the row's previous image.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import VVSError

STALL_ROUNDS = 16  # the stuck guard: rounds in a row that commit nothing in any image in flight


def batch_bucket(n: int) -> int:
    """Rows in flight for n images: the next power of two (few shapes to compile and capture)."""
    return 1 << max(0, (n - 1).bit_length())


def row_buckets(rows: int) -> List[int]:
    """The row counts a core builds decoders for: the rows in flight and every power of two below them
    (a run's tail shrinks into those)."""
    out, size = [rows], batch_bucket(rows) // 2
    while size >= 1:
        out.append(size)
        size //= 2
    return out


@dataclass
class Plan:
    """What the loop does at one read, in this order."""

    done: List[int] = field(default_factory=list)  # rows whose image finished: collect, then free
    partials: list = field(default_factory=list)  # (row, partial index) to deliver now
    admit: int = 0  # take up to this many pending images into free rows
    keep: Optional[List[int]] = None  # shrink: go on with these rows (the live ones first)
    stop: bool = False  # nothing in flight and nothing pending: wait (serving) or end (a run)


class Scheduler:
    """Rows, images in flight, late-read validity, admission, retirement, partial points, stuck guard."""

    def __init__(self, tokens_per_image: int, static: bool = False, retire: bool = True):
        self.T, self.static, self.retire = tokens_per_image, static, retire
        self.row_image: list = []
        self.valid_from: List[int] = []
        self.reported: List[int] = []
        self.partial_points: List[list] = []  # per row: committed counts at which the next partials are due
        self.partials_sent: List[int] = []
        self.stalled, self.last_total = 0, -1

    # --- rows ------------------------------------------------------------------------------------
    def start(self, size: int, images: list, points: Optional[list] = None) -> None:
        """A batch of ``size`` rows whose first rows hold ``images`` (their status valid from read 0)."""
        self.row_image = list(images) + [None] * (size - len(images))
        self.valid_from = [0] * size
        self.reported = [0] * size
        self.partial_points = [list(p) for p in (points or [[]] * len(images))] + [[] for _ in range(size - len(images))]
        self.partials_sent = [0] * size
        self.stalled, self.last_total = 0, -1

    @property
    def size(self) -> int:
        return len(self.row_image)

    def live(self) -> int:
        return sum(image is not None for image in self.row_image)

    def in_flight(self) -> list:
        return [image for image in self.row_image if image is not None]

    def free_rows(self) -> List[int]:
        return [r for r, image in enumerate(self.row_image) if image is None]

    def admitted(self, rows: List[int], images: list, read_number: int, points: Optional[list] = None) -> None:
        """``images`` took ``rows``; reads numbered before ``read_number`` still show the rows' previous images."""
        for j, (r, image) in enumerate(zip(rows, images)):
            self.row_image[r], self.valid_from[r], self.reported[r] = image, read_number, 0
            self.partial_points[r] = list(points[j]) if points else []
            self.partials_sent[r] = 0

    def free(self, rows: List[int]) -> None:
        for r in rows:
            self.row_image[r], self.reported[r], self.partial_points[r] = None, 0, []

    def drop(self, images: list) -> None:
        gone = set(images)
        self.free([r for r, image in enumerate(self.row_image) if image is not None and image in gone])

    def kept(self, keep: List[int]) -> None:
        """The batch went on with rows ``keep`` (now rows 0..); their statuses are read afresh."""
        for name in ("row_image", "reported", "partial_points", "partials_sent"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in keep])
        self.valid_from = [0] * len(keep)

    # --- one read ----------------------------------------------------------------------------------
    def counts(self, status: list, read_number: int) -> List[int]:
        """Each row's committed count for its current image (0 until its first valid read)."""
        return [status[r] if read_number >= self.valid_from[r] else 0 for r in range(self.size)]

    def new_tokens(self, counts: List[int]) -> list:
        """[(row, image, committed now, growth)] for rows whose count grew since it was last reported."""
        out = []
        for r, image in enumerate(self.row_image):
            if image is not None:
                now = min(counts[r], self.T)
                if now > self.reported[r]:
                    out.append((r, image, now, now - self.reported[r]))
                    self.reported[r] = now
        return out

    def plan(self, counts: List[int]) -> Plan:
        """The first decisions of one read: finished rows and partial images due. The caller applies
        ``done`` (collect + :meth:`free`), then asks its source for dropped images (:meth:`drop`) and calls
        :meth:`after_frees` for the rest."""
        plan = Plan()
        plan.done = [r for r, image in enumerate(self.row_image) if image is not None and counts[r] >= self.T]
        for r, image in enumerate(self.row_image):
            points = self.partial_points[r]
            if image is not None and counts[r] < self.T:
                while points and counts[r] >= points[0]:
                    points.pop(0)
                    plan.partials.append((r, self.partials_sent[r]))
                    self.partials_sent[r] += 1
        return plan

    def after_frees(self, plan: Plan, pending: int) -> Plan:
        """The rest of one read (``pending``: images waiting for a row): stop, admit, or shrink the tail
        (only with ``retire``: a server keeps its rows)."""
        live = self.live()
        if not live and not pending:
            plan.stop = True
            return plan
        free = self.free_rows()
        if pending and free and (not self.static or live == 0):
            plan.admit = len(free)
        elif self.retire and not pending and 0 < live <= self.size // 2:
            keep = [r for r, image in enumerate(self.row_image) if image is not None]
            plan.keep = keep + free[: batch_bucket(live) - live]
        return plan

    def check_progress(self, counts: List[int]) -> None:
        """The stuck guard: every round of an unfinished image commits a token, or a few in a row feed
        what a later commit needs (ZipAR's row ends). A server's round with no image in flight, its
        admission just cancelled, is no stall."""
        live = self.live()
        total = sum(counts[r] for r, image in enumerate(self.row_image) if image is not None)
        self.stalled = self.stalled + 1 if total == self.last_total and live else 0
        self.last_total = total
        if self.stalled >= STALL_ROUNDS:
            raise VVSError(f"decoding made no progress for {STALL_ROUNDS} rounds (internal error)")
