"""User-facing errors.

Every problem caused by bad input (a wrong path, a bad flag value, a checkpoint that does not fit)
raises :class:`VVSError` with a one-line message. The CLI prints that line and exits non-zero without a
traceback; the Python API leaves the engine object usable after it.
"""
import argparse


class VVSError(ValueError):
    """A one-line error caused by the caller's input."""


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise VVSError(msg)


class UsageError(Exception):
    """A bad command-line argument: the CLI prints one ``error:`` line and exits 2 (no usage dump)."""


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UsageError` instead of printing the whole
    usage and exiting, so every subcommand (``bench`` and ``train-drafter`` parse their own flags)
    reports a bad argument as one line."""

    def error(self, message: str):  # argparse calls this for every bad argument
        raise UsageError(message)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that the same clean-up runs
    (generate-dataset keeps its finished shards and records the run in its manifest)."""


def raise_terminated(signum, frame):
    raise Terminated()
