"""The reference of ZipAR's fixed-window schedule for tests/test_zipar.py: a host simulation of the
window rules, written apart from the device code it checks (docs/zipar.md "the schedule")."""
from __future__ import annotations

from typing import List, NamedTuple, Optional

from vvs_engine.methods.zipar import RowGeometry


class PlanLane(NamedTuple):
    row: int
    fed_column: int  # column of the token fed; -1: the row's start (the raster predecessor, or a stand-in)
    decided_column: Optional[int]  # the code its output decides; None: a K/V-only feed (the row's tail)


def fixed_window_plan(geometry: RowGeometry, window: int) -> List[List[PlanLane]]:
    """The fixed-window schedule, step by step: which rows each forward serves and with which
    columns. It simulates the rules the device applies (per-row code counts, one code per row per
    forward), independently of the device code; the rows of a step are always the first unfinished
    row and the ones after it."""
    H, W, has_eol = geometry.rows, geometry.codes, geometry.eol is not None
    codes = [1] + [0] * H  # row 0's first code comes from the prefill; a sentinel row after the last
    written = [0] * (H + 1)

    def finished(r):
        return codes[r] == W and (written[r] == W or r == H - 1 or (not has_eol and codes[r + 1] == 0))

    plan = []
    while not all(finished(r) for r in range(H)):
        lanes = []
        for r in range(H):
            above = codes[r - 1] if r else W
            last_allowed = W - 1 if above == W else above - window
            if codes[r] <= last_allowed:
                lanes.append(PlanLane(r, codes[r] - 1, codes[r]))
            elif (codes[r] == W and written[r] == W - 1 and r < H - 1
                  and (has_eol or codes[r + 1] > 0)):  # no-EOL: else the next row's start feeds it
                lanes.append(PlanLane(r, W - 1, None))
        rows = [lane.row for lane in lanes]
        first = next(r for r in range(H) if not finished(r))
        assert rows == list(range(first, first + len(rows))), rows  # contiguous from the first unfinished row
        for lane in lanes:  # K/V writes, then commits (all rules above read the state before the step)
            if lane.fed_column >= 0:
                written[lane.row] = lane.fed_column + 1
            elif not has_eol and codes[lane.row - 1] == W:
                written[lane.row - 1] = W  # the row starts from the real end of the row above
            if lane.decided_column is not None:
                codes[lane.row] += 1
        plan.append(lanes)
    return plan
