"""The asyncio front end: a FastAPI app over an :class:`~vvs_engine.serving.worker.EngineWorker`.

It never touches the device: a request is checked, handed to the engine thread's queue, and its
events (progress, finished images, errors) are awaited on an ``asyncio.Queue`` the engine thread fills.
PNG encoding runs in a small thread pool. A client that disconnects (or drops its stream) and a
request past its deadline are cancelled: their waiting images leave the queue at once and their rows
are freed at the next round.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import MAX_BODY_BYTES, ApiError, ImageRequest, Limits, Resolved, resolve, validation_message
from .worker import EngineWorker, NotAccepting, QueueFull
from .worker import Request as EngineRequest


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sse(event: str, data: dict) -> bytes:
    """One server-sent event (the type is also inside the data, as OpenAI's stream events carry it)."""
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, separators=(',', ':'))}\n\n".encode()


def _reason(error: ApiError, draining: bool) -> str:
    if error.status == 413:
        return "too_large"
    if error.status == 429:
        return "queue_full"
    if error.status == 503:
        return "draining" if draining else "not_ready"
    return "bad_request"


def create_app(worker: EngineWorker, limits: Limits) -> FastAPI:
    from .page import PAGE_HTML

    app = FastAPI(title="vvs-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.draining = False
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vvs-png")
    metrics = worker.metrics
    metrics.bind_queue(worker.queue.snapshot, worker.rows)
    T = worker.engine.tokens_per_image

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # unknown paths and methods, as one-line JSON too
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return error_response(ApiError(422, "invalid request"))

    @app.get("/health")
    async def health():
        if not worker.alive():
            return error_response(ApiError(503, "the engine thread has stopped", code="engine_dead"))
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not worker.alive() or not worker.ready.is_set() or app.state.draining:
            return error_response(ApiError(503, "draining" if app.state.draining else "not ready", code="not_ready"))
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": limits.model_name, "object": "model", "created": 0, "owned_by": "vvs-engine",
            "method": worker.method, "method_options": worker.options, "size": limits.size,
            "conditioning": limits.conditional, "num_classes": worker.engine.config.num_classes
            if limits.conditional == "c2i" else None, "class_names": limits.class_names,
            "defaults": worker.defaults.to_dict(), "per_request_sampling": limits.scope.uniform is None,
            "max_n": limits.max_n, "rows": worker.rows, "tokens_per_image": T,
            "static_batches": worker.static}]}

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE_HTML)

    async def read_request(request: Request) -> Resolved:
        if not worker.alive():
            raise ApiError(503, "the engine thread has stopped", code="engine_dead")
        if app.state.draining or not worker.ready.is_set():
            raise ApiError(503, "the server is shutting down" if app.state.draining else "the server is starting",
                           code="not_ready", headers={"Retry-After": "5"})
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body too large: {length} bytes (at most {MAX_BODY_BYTES})")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body too large (at most {MAX_BODY_BYTES} bytes)")
        try:
            data = json.loads(bytes(body))
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            parsed = ImageRequest.model_validate(data)
        except ValidationError as e:
            message, where = validation_message(e)
            raise ApiError(422, message, where) from None
        return resolve(parsed, limits)

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        arrival = time.monotonic()
        try:
            resolved = await read_request(request)
        except ApiError as e:
            metrics.rejected.inc(reason=_reason(e, app.state.draining))
            return error_response(e)
        events: asyncio.Queue = asyncio.Queue()
        job = EngineRequest(resolved.n, resolved.labels, resolved.prompts, resolved.seed, resolved.sampling,
                            EngineRequest.asyncio_delivery(asyncio.get_running_loop(), events))
        job.created = arrival
        try:
            worker.queue.submit(job)
        except QueueFull as e:
            metrics.rejected.inc(reason="queue_full")
            return error_response(ApiError(429, "the server's queue is full; retry later", code="queue_full",
                                           headers={"Retry-After": str(e.retry_after_s)}))
        except NotAccepting as e:
            draining = app.state.draining
            metrics.rejected.inc(reason="draining" if draining else "not_ready")
            return error_response(ApiError(503, str(e), code="not_ready", headers={"Retry-After": "5"}))
        if resolved.stream:
            return StreamingResponse(stream(job, events, resolved), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await answer(request, job, events, resolved)

    def summary(job: EngineRequest, resolved: Resolved, passes: list) -> dict:
        forwards = sum(passes)
        now = time.monotonic()
        return {"id": job.id, "created": int(time.time()), "model": limits.model_name, "seed": resolved.seed,
                "usage": {"images": resolved.n, "tokens": resolved.n * T,
                          "target_forward_passes": int(forwards) if float(forwards).is_integer() else forwards,
                          "tpf": resolved.n * T / forwards if forwards else None},
                "timings": {"queue_s": (job.admitted_at - job.created) if job.admitted_at else None,
                            "total_s": now - job.created}}

    def finish(job: EngineRequest, reason: str) -> None:
        if reason != "completed":
            worker.queue.cancel(job)
        else:
            metrics.e2e_latency.observe(time.monotonic() - job.created)
        metrics.success.inc(finished_reason=reason)

    async def next_image(events: asyncio.Queue, timeout: float):
        """The next event, with a finished image's PNG already encoded (in the thread pool)."""
        event = await asyncio.wait_for(events.get(), timeout)
        if event[0] == "image":
            image = event[2]
            encoded = await asyncio.get_running_loop().run_in_executor(pool, png_base64, image) \
                if image is not None else None
            return ("image", event[1], encoded, event[3], event[4].tolist())
        return event

    async def collect(job: EngineRequest, events: asyncio.Queue, resolved: Resolved) -> dict:
        images, passes, tokens, done = [None] * resolved.n, [0.0] * resolved.n, [None] * resolved.n, 0
        while done < resolved.n:
            event = await next_image(events, None)
            if event[0] == "image":
                images[event[1]], passes[event[1]], tokens[event[1]] = event[2], event[3], event[4]
                done += 1
            elif event[0] == "error":
                raise ApiError(event[1], event[2], code="aborted" if event[1] == 503 else "engine_error")
        out = summary(job, resolved, passes)
        out["data"] = [{"b64_json": images[j], "revised_prompt": None, "image_index": j,
                        "target_forward_passes": passes[j]} for j in range(resolved.n)]
        if resolved.return_tokens:
            for j, item in enumerate(out["data"]):
                item["tokens"] = tokens[j]
        return out

    async def disconnected(request: Request) -> None:
        while True:  # after the body, the next ASGI message is the client going away
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def answer(request: Request, job: EngineRequest, events: asyncio.Queue, resolved: Resolved):
        collector = asyncio.ensure_future(collect(job, events, resolved))
        watcher = asyncio.ensure_future(disconnected(request))
        remaining = resolved.timeout_s - (time.monotonic() - job.created)
        try:
            done, _ = await asyncio.wait({collector, watcher}, timeout=max(0.0, remaining),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if collector in done:
            try:
                out = collector.result()
            except ApiError as e:
                finish(job, "aborted" if e.status == 503 else "error")
                return error_response(e)
            finish(job, "completed")
            return JSONResponse(out)
        collector.cancel()
        if watcher in done:
            finish(job, "disconnected")
            return Response(status_code=499)  # nobody is there to read it
        finish(job, "deadline")
        return error_response(ApiError(504, f"the request did not finish within its deadline of "
                                            f"{resolved.timeout_s:g} s", code="deadline_exceeded"))

    async def stream(job: EngineRequest, events: asyncio.Queue, resolved: Resolved):
        passes, done, reason = [0.0] * resolved.n, 0, "disconnected"
        try:
            yield sse("image_generation.started", {"id": job.id, "seed": resolved.seed, "n": resolved.n,
                                                   "total": T})
            while done < resolved.n:
                remaining = resolved.timeout_s - (time.monotonic() - job.created)
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    event = await next_image(events, remaining)
                except asyncio.TimeoutError:
                    reason = "deadline"
                    yield sse("error", {"error": ApiError(504, f"the request did not finish within its deadline of "
                                                               f"{resolved.timeout_s:g} s",
                                                          code="deadline_exceeded").body()["error"]})
                    return
                if event[0] == "progress":
                    yield sse("image_generation.progress", {"image_index": event[1], "committed": event[2],
                                                            "total": T})
                elif event[0] == "image":
                    passes[event[1]] = event[3]
                    done += 1
                    completed = {"image_index": event[1], "b64_json": event[2], "target_forward_passes": event[3]}
                    if resolved.return_tokens:
                        completed["tokens"] = event[4]
                    yield sse("image_generation.completed", completed)
                elif event[0] == "error":
                    reason = "aborted" if event[1] == 503 else "error"
                    yield sse("error", {"error": ApiError(event[1], event[2]).body()["error"]})
                    return
            reason = "completed"
            yield sse("image_generation.done", summary(job, resolved, passes))
        finally:  # a dropped stream lands here too (the generator is cancelled or closed)
            finish(job, reason)

    return app
