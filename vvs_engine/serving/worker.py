"""The engine thread: it owns the device and runs the one decode loop (``runtime.loop.serve``) over
the images of every request; the asyncio front end hands it requests and cancellations through a
:class:`RequestQueue` and gets progress, finished images and errors back as events on each request's
``asyncio.Queue`` (``loop.call_soon_threadsafe``). Nothing here needs FastAPI: the front end could move
to another process without touching the decoding side.

The loop thread only launches rounds: a finished image's tokens are handed to an
:class:`~vvs_engine.runtime.output.OutputWorker` (one thread, first in first out), which runs the VQ
decoder on that image alone (the pixels never depend on what finished beside it), encodes the PNG and
delivers it. Before, the decode and the PNG ran on the loop thread and stalled every row in flight
(``benchmarks/serve_load.py --output-split`` measures both ways).

A request of ``n`` images is ``n`` independent :class:`ImageJob` units: image ``j`` of a request with
seed ``s`` draws its random numbers from ``(s, j)``, exactly as image ``j`` of ``vvs-engine generate
--seed s`` does, so a request returns the images the offline command makes. Its images join the
running batch one by one as rows free up (a request with ``n > 1`` never waits for ``n`` free rows).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, is_dataclass
from typing import Callable, List, Optional

import torch

from ..engine import ImageSpec, check_batch_fits, check_method_fits
from ..errors import VVSError
from ..runtime import loop
from ..runtime.output import OutputWorker
from ..sampling import SamplingParams, SamplingScope
from .metrics import ServerMetrics

PROGRESS_INTERVAL_S = 0.25  # at most four progress events a second per image
ROUND_EMA = 0.1  # weight of the newest loop iteration in the Retry-After estimate's round time
RETRY_AFTER_MAX_S = 600


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


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
    committed: int = 0  # tokens committed so far (the Retry-After estimate counts what is left)


class Request:
    """A generation request as the engine thread sees it. Events to the front end (tuples):
    ``("progress", j, committed)``, ``("partial", j, partial index, PNG as base64)``, ``("image", j, PNG
    as base64 or None, target forwards, token list, (width, height) or None)``, ``("error", status,
    message)``. ``deliver`` is where they go (the front
    end's queue); images are delivered from the output worker's thread."""

    def __init__(self, n: int, labels: Optional[List[int]], prompts: Optional[List[str]], seed: int,
                 sampling: SamplingParams, deliver: Callable[[tuple], None], partial_images: int = 0):
        self.id = f"img-{uuid.uuid4().hex}"
        self.n = n
        self.partial_images = partial_images  # per image, 0-3 (OpenAI's streamed partial images)
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

    def __init__(self, engine, max_waiting_images: int, metrics: ServerMetrics, rows: int,
                 output: Optional[OutputWorker] = None):
        self.engine = engine
        self.max_waiting = max_waiting_images
        self.rows = rows  # images the loop holds in flight at most (free ones take waiting images next round)
        self.metrics = metrics
        self.T = engine.tokens_per_image
        self.output = output  # None: decode and encode on the loop thread (the old way, for the benchmark)
        self.cond = threading.Condition()
        self.waiting: deque = deque()
        self.in_flight: set = set()
        self.active: dict = {}  # request id -> Request (accepted, not finished)
        self.closed = False
        self.accepting = False  # from the end of warm-up until draining starts
        # the Retry-After estimate: seconds per loop iteration (round, admission and collection) while
        # busy, and tokens a row commits per round, both from what the loop did recently
        self.iteration_s: Optional[float] = None
        self.tokens_per_row_round = 1.0
        self._last_round_end: Optional[float] = None
        self._idled = True
        # the benchmark's trace: (launch time, round seconds, live rows, images finished since the last round,
        # the loop thread's CPU time then: unlike wall time, not stretched when a busy machine deschedules it)
        self.trace: Optional[list] = None
        self._finished_since_round = 0

    # --- the front end's side -------------------------------------------------------------------
    def submit(self, request: Request, internal: bool = False) -> None:
        with self.cond:
            if (not self.accepting and not internal) or self.closed:
                raise NotAccepting("the server is not accepting requests (starting or shutting down)")
            # the bound is on images that will still wait after the next admission: rows that are
            # free now take waiting images at the next round, so a burst into an idle server is not refused
            free_rows = max(0, self.rows - len(self.in_flight))
            if len(self.waiting) + request.n > self.max_waiting + free_rows and not internal:
                raise QueueFull(self.retry_after_s())
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

    def drain_estimate_s(self) -> Optional[float]:
        """Seconds until the accepted images (in flight and waiting) are all decoded at the loop's
        recent pace: tokens left / (rows x tokens a row commits per round) x seconds per loop
        iteration. None before the loop has run busy."""
        if self.iteration_s is None:
            return None
        with self.cond:
            left = sum(max(0, self.T - job.committed) for job in self.in_flight) + self.T * len(self.waiting)
        return left / (max(1, self.rows) * self.tokens_per_row_round) * self.iteration_s

    def retry_after_s(self) -> int:
        """Retry-After of a 429: when the work accepted now will have drained (at least 1 s)."""
        estimate = self.drain_estimate_s()
        if estimate is None:
            return 5
        return max(1, min(RETRY_AFTER_MAX_S, int(math.ceil(estimate))))

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
        self._idled = True  # the next loop iteration's time includes waiting: not a decode pace
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
        job.committed = committed
        if committed < self.T and now - job.last_progress < PROGRESS_INTERVAL_S:
            return
        job.last_progress = now
        if not request.cancelled:
            request.deliver(("progress", job.position, committed))

    def partial_images(self, job: ImageJob) -> int:
        """How many partial images the loop hands over for this image (asked when it is admitted)."""
        decodes = self.engine.vq is not None and getattr(self.engine.vq, "can_decode", True)
        return job.request.partial_images if decodes else 0

    def partial(self, job: ImageJob, index: int, tokens: torch.Tensor, committed: torch.Tensor) -> None:
        """On the loop thread: hand the committed tokens to the output worker, which decodes the partial
        image (uncommitted positions grey) and delivers it before the image itself."""
        request = job.request
        if request.cancelled:
            return

        def deliver() -> None:
            if not request.cancelled:
                request.deliver(("partial", job.position, index,
                                 png_base64(self.engine.partial_image(tokens, committed))))

        if self.output is None:
            deliver()
        else:
            self.output.submit(deliver, on_error=lambda e: self._image_failed(request, e))

    def finished(self, job: ImageJob, result: dict) -> None:
        """On the loop thread: book-keeping only; the VQ decode, the PNG and the delivery go to the
        output worker (or run here without one)."""
        request = job.request
        with self.cond:
            self.in_flight.discard(job)
        self._finished_since_round += 1
        tokens = result["tokens"]
        passes = float(result["passes"])
        rounds = float(result["rounds"]) if "rounds" in result else passes
        if rounds > 0:
            self.tokens_per_row_round += ROUND_EMA * (self.T / rounds - self.tokens_per_row_round)
        self.metrics.image_done(self.T, passes, rounds)
        if request.cancelled:
            return

        def deliver() -> None:
            self._deliver_image(job, tokens, passes)

        if self.output is None:
            deliver()
        else:
            self.output.submit(deliver, on_error=lambda e: self._image_failed(request, e))

    def _deliver_image(self, job: ImageJob, tokens: torch.Tensor, passes: float) -> None:
        request = job.request
        if request.cancelled:  # the client left while the image waited for the output worker
            return
        encoded = size = None
        if self.engine.vq is not None and getattr(self.engine.vq, "can_decode", True):
            # one image at a time: the fp32 tokenizer's rounding then never depends on which images
            # finished in the same round
            image = self.engine.decode_images(tokens[None])[0]
            encoded, size = png_base64(image), image.size
        request.deliver(("image", job.position, encoded, passes, tokens.tolist(), size))
        with self.cond:
            request.images_done += 1
            if request.images_done == request.n:
                request.finished = True
                self.active.pop(request.id, None)

    def _image_failed(self, request: Request, error: BaseException) -> None:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        with self.cond:
            if request.finished:
                return
            request.finished = request.cancelled = True
            self.waiting = deque(job for job in self.waiting if job.request is not request)
            self.active.pop(request.id, None)
        request.deliver(("error", 500, f"decoding the image failed: {message}"))

    def round_done(self, kind: str, seconds: float, live_rows: int) -> None:
        now = time.perf_counter()
        self.metrics.round_seconds.observe(seconds, kind=kind)
        if self._last_round_end is not None and not self._idled and live_rows:
            iteration = now - self._last_round_end
            self.iteration_s = (iteration if self.iteration_s is None
                                else self.iteration_s + ROUND_EMA * (iteration - self.iteration_s))
        if self.trace is not None:
            self.trace.append((now - seconds, seconds, live_rows, self._finished_since_round, time.thread_time()))
        self._finished_since_round = 0
        self._last_round_end, self._idled = now, False

    def fail_all(self, status: int, message: str) -> None:
        """Every accepted request ends with an error (the engine thread died, or the drain timed out)."""
        with self.cond:
            requests = list(self.active.values())
        for request in requests:
            self.cancel(request)
            request.deliver(("error", status, message))


class EngineWorker:
    """Owns the engine, its thread and the output worker. ``start()`` loads nothing (the engine is
    given), starts the threads and decodes one warm-up image through the loop (every round kind
    compiled and captured before that); ``ready`` is set when it is done.

    ``output_thread=False`` decodes and encodes finished images on the loop thread, as the server did
    before the output worker (kept for ``benchmarks/serve_load.py --output-split``'s before/after)."""

    def __init__(self, engine, method: str, method_opts: dict, rows: int, defaults: SamplingParams,
                 max_waiting_images: int, static: bool = False, compile: Optional[bool] = None,
                 cuda_graphs: Optional[bool] = None, model_name: str = "vvs-engine", output_thread: bool = True):
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
        # one resolution of compile / CUDA graphs for the API, the CLI and the server (Engine.run_config),
        # and the engine's persistent core for this setting: a server and generate calls share its decoders
        self.config = engine.run_config(compile, cuda_graphs)
        self.compile, self.use_graphs = self.config.compile, self.config.cuda_graphs
        self.core = engine.core(method, self.opts, self.scope, self.config, self.make_decoder)
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name, method)
        self.output = OutputWorker("vvs-output", context=self._output_context) if output_thread else None
        self.queue = RequestQueue(engine, max_waiting_images, self.metrics, rows, self.output)
        self.ready = threading.Event()
        self.image_size: Optional[tuple] = None  # (width, height) of the warm-up image
        self.error: Optional[BaseException] = None
        self.stats: dict = {}
        self.thread = threading.Thread(target=self._run, name="vvs-engine-loop", daemon=True)

    @contextlib.contextmanager
    def _output_context(self):
        """The output thread's lasting context: inference mode, and on CUDA a side stream of its own, so
        that its VQ decodes (of host tokens, with read-only weights) can overlap the loop's rounds."""
        with torch.inference_mode():
            if self.engine.device.type == "cuda":
                with torch.cuda.device(self.engine.device), torch.cuda.stream(torch.cuda.Stream(self.engine.device)):
                    yield
            else:
                yield

    @property
    def options(self) -> dict:
        return asdict(self.opts) if is_dataclass(self.opts) else {}

    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    # --- the batch a decoder is prefilled / admitted with ---------------------------------------
    def make_batch(self, jobs: list, pad_to: int):
        """Image j of a request with seed s is image index j of seed s, with the request's settings:
        what image j of ``vvs-engine generate --seed s`` is."""
        specs = [ImageSpec(job.label, job.prompt, job.request.seed, job.position, job.request.sampling)
                 for job in jobs]
        return self.engine.image_batch(specs, pad_to, self.scope)

    # --- the thread -----------------------------------------------------------------------------
    def start(self, warmup_label: Optional[int] = 0, warmup_prompt: Optional[str] = None) -> None:
        """Start the thread and decode one warm-up image; returns once the server can take requests.
        (An interrupt while it waits propagates: the caller ends the process without joining the
        engine thread, which may be inside a compiled round.)"""
        done = threading.Event()
        errors = []

        def deliver(event):
            if event[0] == "image":
                self.image_size = event[5]
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
        try:
            with torch.inference_mode():
                self.stats = loop.serve(self.make_decoder, self.make_batch, self.queue, self.rows,
                                        self.engine.tokens_per_image, static=self.static, core=self.core)
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
        return not self.abort()

    def abort(self) -> bool:
        """Every accepted request ends now with a 503 (its rows are freed at the next round); True when
        there was one."""
        self.stop_accepting()
        with self.queue.cond:
            left = bool(self.queue.active)
        self.queue.fail_all(503, "the server is shutting down: the request was aborted")
        return left

    def close(self, join_timeout_s: float = 30.0) -> bool:
        """Stop the loop (after its current round) and the output worker; True when both threads ended."""
        self.queue.close()
        self.thread.join(join_timeout_s)
        ended = not self.thread.is_alive()
        if self.output is not None:
            ended = self.output.close(join_timeout_s if ended else 0.5) and ended
        return ended
