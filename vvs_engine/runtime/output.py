"""An output worker: one thread that runs the work a decode loop hands over (VQ decoding, PNG
encoding, delivery), in the order it was handed over, so that the loop thread only launches rounds.

Why one thread and a FIFO: images reach their clients in the order they finished, and each job runs
alone (a tokenizer that decodes one image at a time gives the same pixels whatever finished beside
it). A job that raises does not stop the worker: its exception goes to the job's ``on_error`` (the
server turns it into the request's error event), or, without one, is kept in ``errors``.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, List, Optional

_STOP = object()


class OutputWorker:
    """``submit(job, on_error)`` from any thread; ``close()`` runs what was submitted, then ends the
    thread. ``context`` (optional) is a context-manager factory entered once on the worker thread
    (the server passes ``torch.inference_mode``: it is per thread)."""

    def __init__(self, name: str = "vvs-output", context: Optional[Callable] = None):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._context = context
        self.errors: List[BaseException] = []  # exceptions of jobs submitted without on_error
        self.done = 0  # jobs run (for tests and the benchmark)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], on_error: Optional[Callable[[BaseException], None]] = None) -> None:
        if self._closed:
            raise RuntimeError("the output worker is closed")
        self._jobs.put((job, on_error))

    def pending(self) -> int:
        return self._jobs.qsize()

    def _run(self) -> None:
        if self._context is None:
            self._loop()
        else:
            with self._context():
                self._loop()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            job, on_error = item
            try:
                job()
            except BaseException as e:  # delivered, never lost: the worker keeps serving the next job
                if on_error is None:
                    self.errors.append(e)
                else:
                    try:
                        on_error(e)
                    except BaseException as again:
                        self.errors.append(again)
            self.done += 1

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Run every job submitted so far, then stop; True when the thread has ended."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def alive(self) -> bool:
        return self._thread.is_alive()
