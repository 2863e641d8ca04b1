"""Shared by the server tests: a real ``vvs-engine serve`` process on 127.0.0.1 and small helpers."""
from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


class ServerProcess:
    """``python -m vvs_engine serve ARGS --port P`` (P = 0: any free port, read from its stderr)."""

    def __init__(self, args, port: int = 0, start_timeout_s: float = 300.0):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.args = list(args)
        self.proc = subprocess.Popen([sys.executable, "-m", "vvs_engine", "serve", *self.args, "--port", str(port),
                                      "--threads", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list = []
        self.port = None
        self._found = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._found.wait(start_timeout_s) or self.port is None:
            self.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            match = LISTENING.search(line)
            if match:
                self.port = int(match.group(2))
                self._found.set()
        self._found.set()  # the process ended

    def output(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout_s: float = 120.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def png_pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll ``predicate()`` until it returns a true value (returned) or the time is up (None)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return None


def metric(client, name: str, **labels) -> float:
    from vvs_engine.serving.metrics import parse_text, sample

    value = sample(parse_text(client.get("/metrics").text), name, **labels)
    assert value is not None, f"/metrics has no {name} {labels}"
    return value
