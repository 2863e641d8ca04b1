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

    def __init__(self, args, port: int = 0, start_timeout_s: float = 300.0, env: dict = None):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
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


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
    messages ended by NUL on file descriptors 3 and 4), so no driver or client library is needed."""

    def __init__(self, binary: str, profile_dir: str, width: int = 960, height: int = 600):
        import fcntl
        import json  # noqa: F401

        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # move the child's ends above 4, so placing them on 3 and 4 cannot overwrite one with the other
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)

        def place_pipes():
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             f"--user-data-dir={profile_dir}", f"--window-size={width},{height}", "--remote-debugging-pipe",
             "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(3, 4), preexec_fn=place_pipes)
        os.close(child_r)
        os.close(child_w)
        self.write_fd, self.read_fd = to_browser_w, from_browser_r
        self.buffer = b""
        self.next_id = 0
        self.session = None

    def call(self, method: str, timeout_s: float = 60.0, **params) -> dict:
        import json
        import select

        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        end = time.monotonic() + timeout_s
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {method} within {timeout_s} s")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe: " + self.proc.stderr.read().decode()[-500:])
            self.buffer += chunk

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def screenshot(self, path: str) -> None:
        import base64

        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
