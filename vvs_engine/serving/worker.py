"""The engine thread: it owns the device and runs the one decode loop (``runtime.loop.serve``) over
the images of every request; the asyncio front end hands it requests and cancellations through a
:class:`RequestQueue` and gets progress, finished images and errors back as events on each request's
``asyncio.Queue`` (``loop.call_soon_threadsafe``). Nothing here needs FastAPI: the front end could move
to another process without touching the decoding side.

A request of ``n`` images is ``n`` independent :class:`ImageJob` units: image ``j`` of a request with
seed ``s`` draws its random numbers from ``(s, j)``, exactly as image ``j`` of ``vvs-engine generate
--seed s`` does, so a request returns the images the offline command makes. Its images join the
running batch one by one as rows free up (a request with ``n > 1`` never waits for ``n`` free rows).
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from ..errors import VVSError
from ..sampling import SamplingParams
from .metrics import ServerMetrics

PROGRESS_INTERVAL_S = 0.25  # at most four progress events a second per image


class QueueFull(Exception):
    """The waiting room is full: the front end answers 429 with ``retry_after_s``."""

    def __init__(self, retry_after_s: int):
        super().__init__("the server's queue is full")
        self.retry_after_s = retry_after_s


class NotAccepting(Exception):
    """The server is warming up, draining or its engine thread has stopped: 503."""


@dataclass(eq=False)
class ImageJob:
    """One image of a request: the unit the loop admits into a row (a row pair with CFG)."""

    request: "Request"
    position: int  # its index in the request = its image index in the random-number key
    label: Optional[int]
    prompt: Optional[str]
    last_progress: float = 0.0


class Request:
    """A generation request as the engine thread sees it. Events to the front end (tuples):
    ``("progress", j, committed)``, ``("image", j, PIL image, target forwards, extra counters)``,
    ``("error", status, message)``. ``deliver`` is where they go (the front end's queue)."""

    def __init__(self, n: int, labels: Optional[List[int]], prompts: Optional[List[str]], seed: int,
                 sampling: SamplingParams, deliver: Callable[[tuple], None]):
        self.id = f"img-{uuid.uuid4().hex}"
        self.n = n
        self.seed = seed
        self.sampling = sampling
        self.deliver = deliver
        self.jobs = [ImageJob(self, j, labels[j] if labels is not None else None,
                              prompts[j] if prompts is not None else None) for j in range(n)]
        self.created = time.monotonic()
        self.admitted_at: Optional[float] = None
        self.first_token_at: Optional[float] = None
        self.images_done = 0
        self.images_admitted = 0
        self.cancelled = False
        self.finished = False

    @staticmethod
    def asyncio_delivery(aloop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[tuple], None]:
        """Events from the engine thread into an asyncio queue of the front end's loop."""

        def deliver(event: tuple) -> None:
            try:
                aloop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the front end's loop is closed (shutdown): nobody is listening
                pass

        return deliver


class RequestQueue:
    """The loop's image source (``runtime.loop.ImageSource``) for a server: a bounded FIFO of waiting
    images, the set in flight, and cancellation. ``submit`` and ``cancel`` are called from the front
    end's thread, everything else from the engine thread; one condition variable guards it all."""

    def __init__(self, engine, max_waiting_images: int, metrics: ServerMetrics, rows: int):
        self.engine = engine
        self.max_waiting = max_waiting_images
        self.rows = rows  # images the loop holds in flight at most (free ones take waiting images next round)
        self.metrics = metrics
        self.T = engine.tokens_per_image
        self.cond = threading.Condition()
        self.waiting: deque = deque()
        self.in_flight: set = set()
        self.active: dict = {}  # request id -> Request (accepted, not finished)
        self.closed = False
        self.accepting = False  # from the end of warm-up until draining starts
        self.done_times: deque = deque(maxlen=64)  # completion times of recent images (Retry-After)

    # --- the front end's side -------------------------------------------------------------------
    def submit(self, request: Request, internal: bool = False) -> None:
        with self.cond:
            if (not self.accepting and not internal) or self.closed:
                raise NotAccepting("the server is not accepting requests (starting or shutting down)")
            # the bound is on images that will still wait after the next admission: rows that are
            # free now take waiting images at the next round, so a burst into an idle server is not refused
            free_rows = max(0, self.rows - len(self.in_flight))
            if len(self.waiting) + request.n > self.max_waiting + free_rows and not internal:
                raise QueueFull(self._retry_after())
            self.waiting.extend(request.jobs)
            if not internal:
                self.active[request.id] = request
            self.cond.notify_all()

    def cancel(self, request: Request) -> None:
        """Abandon a request (client gone, deadline, shutdown): its waiting images leave the queue now,
        its rows are freed at the next round (``dropped``). Idempotent."""
        with self.cond:
            if request.finished:
                return
            request.cancelled = True
            request.finished = True
            self.waiting = deque(job for job in self.waiting if job.request is not request)
            self.active.pop(request.id, None)

    def _retry_after(self) -> int:
        """Seconds until the waiting images would be served at the recent rate (at least 1)."""
        times = self.done_times
        if len(times) >= 2 and times[-1] > times[0]:
            rate = (len(times) - 1) / (times[-1] - times[0])
            return max(1, min(600, int(len(self.waiting) / rate + 0.999)))
        return 5

    def snapshot(self) -> dict:
        """Running/waiting requests and images (the metrics' gauges)."""
        with self.cond:
            running = sum(1 for r in self.active.values() if r.images_admitted)
            return {"requests_running": running, "requests_waiting": len(self.active) - running,
                    "images_running": len(self.in_flight), "images_waiting": len(self.waiting)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # --- the engine thread's side (runtime.loop.ImageSource) ------------------------------------
    def pending(self) -> int:
        return len(self.waiting)

    def take(self, k: int) -> list:
        now = time.monotonic()
        with self.cond:
            jobs = [self.waiting.popleft() for _ in range(min(k, len(self.waiting)))]
            for job in jobs:
                self.in_flight.add(job)
                request = job.request
                request.images_admitted += 1
                if request.admitted_at is None:
                    request.admitted_at = now
                    if request.id in self.active:
                        self.metrics.queue_time.observe(now - request.created)
            return jobs

    def wait(self) -> bool:
        with self.cond:
            while not self.waiting and not self.closed:
                self.cond.wait()
            return bool(self.waiting)

    def dropped(self, images: list) -> list:
        gone = [job for job in images if job.request.cancelled]
        if gone:
            with self.cond:
                self.in_flight.difference_update(gone)
        return gone

    def progress(self, job: ImageJob, committed: int) -> None:
        request = job.request
        now = time.monotonic()
        if request.first_token_at is None:
            request.first_token_at = now
            if request.id in self.active:
                self.metrics.time_to_first_token.observe(now - request.created)
        if committed < self.T and now - job.last_progress < PROGRESS_INTERVAL_S:
            return
        job.last_progress = now
        if not request.cancelled:
            request.deliver(("progress", job.position, committed))

    def finished(self, job: ImageJob, result: dict) -> None:
        request = job.request
        with self.cond:
            self.in_flight.discard(job)
            self.done_times.append(time.monotonic())
        tokens = result["tokens"]
        passes = float(result["passes"])
        rounds = float(result["rounds"]) if "rounds" in result else passes
        self.metrics.image_done(self.T, passes, rounds)
        if request.cancelled:
            return
        image = None
        if self.engine.vq is not None and getattr(self.engine.vq, "can_decode", True):
            # one image at a time: the fp32 tokenizer's rounding then never depends on which images
            # finished in the same round
            image = self.engine.decode_images(tokens[None])[0]
        request.deliver(("image", job.position, image, passes, tokens))
        request.images_done += 1
        if request.images_done == request.n:
            with self.cond:
                request.finished = True
                self.active.pop(request.id, None)

    def round_done(self, kind: str, seconds: float, live_rows: int) -> None:
        self.metrics.round_seconds.observe(seconds, kind=kind)

    def fail_all(self, status: int, message: str) -> None:
        """Every accepted request ends with an error (the engine thread died, or the drain timed out)."""
        with self.cond:
            requests = list(self.active.values())
        for request in requests:
            self.cancel(request)
            request.deliver(("error", status, message))


class EngineWorker:
    """Owns the engine and its thread. ``start()`` loads nothing (the engine is given), builds the
    method's decoder factory, starts the thread and decodes one warm-up image through the loop
    (every round kind compiled and captured before that); ``ready`` is set when it is done."""

    def __init__(self, engine, method: str, method_opts: dict, rows: int, defaults: SamplingParams,
                 max_waiting_images: int, static: bool = False, compile: Optional[bool] = None,
                 cuda_graphs: Optional[bool] = None, model_name: str = "vvs-engine"):
        from ..engine import check_batch_fits, check_method_fits
        from ..runtime.compiled import resolve as resolve_compile
        from ..sampling import SamplingScope

        self.engine = engine
        self.method = method
        self.defaults = defaults.validate()
        # any settings per row (each request its own); guidance rows unless the server's default is
        # no guidance (then every request must ask for none)
        self.scope = SamplingScope.server(use_cfg=self.defaults.use_cfg)
        self.make_decoder, self.opts = engine.decoder_for(method, method_opts, self.scope)
        check_method_fits(engine.shape, self.opts)
        check_batch_fits(engine.shape, self.opts, rows, rows, self.scope.use_cfg, engine.device, engine.dtype)
        self.rows = rows
        self.static = static
        self.compile = resolve_compile(compile, engine.device)
        self.use_graphs = engine.device.type == "cuda" and (cuda_graphs is None or bool(cuda_graphs))
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name, method)
        self.queue = RequestQueue(engine, max_waiting_images, self.metrics, rows)
        self.ready = threading.Event()
        self.image_size: Optional[tuple] = None  # (width, height) of the warm-up image
        self.error: Optional[BaseException] = None
        self.stats: dict = {}
        self.thread = threading.Thread(target=self._run, name="vvs-engine-loop", daemon=True)

    @property
    def options(self) -> dict:
        from dataclasses import asdict, is_dataclass

        return asdict(self.opts) if is_dataclass(self.opts) else {}

    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    # --- the batch a decoder is prefilled / admitted with ---------------------------------------
    def make_batch(self, jobs: list, pad_to: int):
        """Image j of a request with seed s is image index j of seed s, with the request's settings:
        what image j of ``vvs-engine generate --seed s`` is."""
        from ..engine import ImageSpec

        specs = [ImageSpec(job.label, job.prompt, job.request.seed, job.position, job.request.sampling)
                 for job in jobs]
        return self.engine.image_batch(specs, pad_to, self.scope)

    # --- the thread -----------------------------------------------------------------------------
    def start(self, warmup_label: Optional[int] = 0, warmup_prompt: Optional[str] = None) -> None:
        """Start the thread and decode one warm-up image; returns once the server can take requests."""
        done = threading.Event()
        errors = []

        def deliver(event):
            if event[0] == "image":
                self.image_size = event[2].size if event[2] is not None else None
                done.set()
            elif event[0] == "error":
                errors.append(event[2])
                done.set()

        warm = Request(1, [warmup_label] if warmup_prompt is None else None,
                       [warmup_prompt] if warmup_prompt is not None else None, 0, self.defaults, deliver)
        self.queue.submit(warm, internal=True)
        self.thread.start()
        while not done.wait(0.2):
            if not self.thread.is_alive():
                break
        if self.error is not None:
            raise VVSError(f"warm-up failed: {self.error}")
        if errors:
            raise VVSError(f"warm-up failed: {errors[0]}")
        with self.queue.cond:
            self.queue.accepting = True
        self.ready.set()

    def _run(self) -> None:
        from ..runtime import loop

        try:
            with torch.inference_mode():
                self.stats = loop.serve(self.make_decoder, self.make_batch, self.queue, self.rows,
                                        self.engine.tokens_per_image, static=self.static, compile=self.compile,
                                        use_graphs=self.use_graphs)
        except BaseException as e:  # the front end turns this into 503s and /health says so
            self.error = e
            self.queue.fail_all(500, f"the engine stopped: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        finally:
            with self.queue.cond:
                self.queue.accepting = False

    # --- shutdown ---------------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        with self.queue.cond:
            self.queue.accepting = False

    def drain(self, timeout_s: float) -> bool:
        """Stop accepting; wait up to ``timeout_s`` for every accepted request to finish; abort the rest
        (503). True when nothing had to be aborted."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            with self.queue.cond:
                if not self.queue.active:
                    return True
            time.sleep(0.05)
        with self.queue.cond:
            left = bool(self.queue.active)
        self.queue.fail_all(503, "the server is shutting down: the request was aborted")
        return not left

    def close(self, join_timeout_s: float = 30.0) -> None:
        self.queue.close()
        self.thread.join(join_timeout_s)
