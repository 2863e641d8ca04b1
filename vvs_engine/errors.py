"""User-facing errors.

Every problem caused by bad input (a wrong path, a bad flag value, a checkpoint that does not fit)
raises :class:`VVSError` with a one-line message. The CLI prints that line and exits non-zero without a
traceback; the Python API leaves the engine object usable after it.
"""


class VVSError(ValueError):
    """A one-line error caused by the caller's input."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise VVSError(msg)
