"""The CPU thread count torch uses: one default for the CLI and the Python API.

``OMP_NUM_THREADS`` if set, else half the cores, at most 4. The Zoo model's matrices are too small to
gain from more, and on a shared machine a thread per core oversubscribes it (one AR Zoo image on 2
busy cores: 150 s with 2 threads, 12 s with 1; the README's API example took 356 s with torch's own
default of one thread per core, 21.5 s with one thread).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .errors import VVSError

# torch's count when vvs_engine was imported: a different count later was set by the caller, and kept.
_AT_IMPORT = torch.get_num_threads()


def default_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def apply_threads(n: Optional[int], what: str = "threads") -> int:
    """Set torch's CPU threads to ``n``; returns the count in use. ``n=None``: :func:`default_threads`,
    unless the caller already chose a count with ``torch.set_num_threads`` (then that one is kept)."""
    if n is None:
        if torch.get_num_threads() != _AT_IMPORT:
            return torch.get_num_threads()
        n = default_threads()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise VVSError(f"{what} must be an integer >= 1, got {n!r}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
