"""The first seconds of the ``vvs-engine`` command, before :func:`vvs_engine.cli.main` runs.

Importing torch takes seconds; a Ctrl-C in that time would end in Python's traceback of the import
(15 lines, none of them ours). While the command starts, SIGINT therefore prints the CLI's own
``error: interrupted`` line and exits 130; ``cli.main`` restores Python's handler (a
KeyboardInterrupt it reports the same way) as soon as it runs. A library import is left alone.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

COMMAND_NAMES = ("vvs-engine", "vvs-engine.exe", "vvs-engine-script.py")  # the installed console script


def started_as_command() -> bool:
    """This process is the ``vvs-engine`` console script or ``python -m vvs_engine``."""
    if sys.argv and os.path.basename(sys.argv[0]) in COMMAND_NAMES:
        return True
    # while `python -m vvs_engine` imports the package, sys.argv[0] is still "-m"; orig_argv names the module
    args = list(getattr(sys, "orig_argv", []))
    for flag, module in zip(args, args[1:] + [""]):
        if flag.startswith("-m"):
            name = flag[2:] or module
            return name == "vvs_engine" or name.startswith("vvs_engine.")
    return False


def interrupted_while_starting(signum, frame) -> None:
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)  # nothing has been written yet; no import is left half-done to clean up


def quiet_interrupts_while_starting() -> None:
    if started_as_command() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupted_while_starting)


def end_of_startup() -> None:
    """From here on a Ctrl-C is a KeyboardInterrupt again (the CLI reports it, after its clean-up)."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
