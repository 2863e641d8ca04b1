"""Output paths, checked before any work: a run that would fail to write its result fails first."""
from __future__ import annotations

import os

from .errors import VVSError


def check_writable_file(path: str, what: str) -> None:
    """``path`` can be written: not a folder, and its folder exists or can be made, writable.
    ``what`` names it in the message (a flag such as ``--out``)."""
    if os.path.isdir(path):
        raise VVSError(f"{what} {path} is a folder, not a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise VVSError(f"{what} {path} is not writable")
    head = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(head):
        head = os.path.dirname(head)
    if not os.path.isdir(head):
        raise VVSError(f"{what} {path}: {head} is a file, not a folder")
    if not os.access(head, os.W_OK | os.X_OK):
        raise VVSError(f"{what} {path}: the folder {head} is not writable")
