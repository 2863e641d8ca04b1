"""The asyncio front end: a FastAPI app over an :class:`~vvs_engine.serving.worker.EngineWorker`.

It never touches the device: a request is checked, handed to the engine thread's queue, and its
events (progress, finished images as PNG, errors) are awaited on an ``asyncio.Queue`` the engine
side fills. A client that disconnects (or drops its stream) and a request past its deadline are
cancelled: their waiting images leave the queue at once and their rows are freed at the next round.

Every route is a module-level function over one :class:`AppState` (``request.app.state.vvs``). The
:class:`Guard` middleware in front of them checks the ``Host`` header (DNS rebinding) and the API key,
adds ``X-Content-Type-Options: nosniff``, and turns anything unexpected into a one-line JSON 500 and
one log line (never a traceback).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .metrics import ServerMetrics
from .page import PAGE_HEADERS, PAGE_HTML
from .schemas import (MAX_BODY_BYTES, ApiError, ImageRequest, Limits, Resolved, class_prompt, resolve,
                      validation_message)
from .worker import EngineWorker, NotAccepting, QueueFull
from .worker import Request as EngineRequest

log = logging.getLogger("vvs_engine.serve")
OPEN_PATHS = ("/health", "/ready", "/metrics", "/")  # answered without the API key (as vLLM leaves /health)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class AppState:
    """What every route reads: the engine side, the server's limits, and its security settings."""

    worker: EngineWorker
    limits: Limits
    api_key: Optional[str] = None  # clients send ``Authorization: Bearer KEY``; None = no key
    allowed_hosts: Optional[frozenset] = None  # ``Host`` header names accepted; None = any
    body_timeout_s: float = 30.0  # the whole body must arrive within this after the headers
    draining: bool = False
    # under Ray Serve: an awaitable of every replica's metrics in one exposition (None: this process's)
    metrics_view: Optional[Callable[[], Awaitable[str]]] = None

    @property
    def metrics(self) -> ServerMetrics:
        return self.worker.metrics

    @property
    def tokens_per_image(self) -> int:
        return self.worker.engine.tokens_per_image


def allowed_hosts_for(bind_host: str, allowed: Optional[str]) -> Optional[frozenset]:
    """``--allowed-hosts``: a comma list, or ``*`` for any. Default: a server bound to a loopback address
    answers only loopback names (a web page that rebinds its own name to 127.0.0.1 cannot read it);
    one bound elsewhere answers any name unless a list is given."""
    if allowed is not None:
        names = [h.strip().lower() for h in allowed.split(",") if h.strip()]
        return None if "*" in names else frozenset(names)
    if bind_host in LOOPBACK_HOSTS or bind_host.startswith("127."):
        return frozenset(LOOPBACK_HOSTS + (bind_host,))
    return None


def _host_name(header: str) -> str:
    """The name in a ``Host`` header, without the port (``[::1]:8000`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class Guard:
    """Pure ASGI middleware (streams pass through untouched)."""

    def __init__(self, app, state: AppState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        started = False

        async def send_nosniff(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = list(message.get("headers", [])) + [(b"x-content-type-options", b"nosniff")]
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            if refusal.status == 401 and scope["path"] == "/v1/images/generations":
                self.state.metrics.rejected.inc(reason="unauthorized")
            return await error_response(refusal)(scope, receive, send_nosniff)

        try:
            await self.app(scope, receive, send_nosniff)
        except ClientDisconnect:  # the client left while its body was read: nobody to answer
            pass
        except Exception as e:  # one line in the log, one line of JSON to the client
            log.error("vvs-engine serve: %s %s failed: %s: %s", scope.get("method"), scope.get("path"),
                      type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            if not started:
                await error_response(ApiError(500, "internal error (logged by the server)",
                                              code="internal_error"))(scope, receive, send_nosniff)

    def _refusal(self, scope, headers: dict) -> Optional[ApiError]:
        state = self.state
        if state.allowed_hosts is not None:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in state.allowed_hosts:
                return ApiError(400, f"Host '{host}' is not served here (--allowed-hosts)", code="invalid_host")
        if state.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            # compare_digest: the time taken does not tell how much of the key was right
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), state.api_key.encode()):
                return ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None


# --- routes -----------------------------------------------------------------------------------------
def _state(request: Request) -> AppState:
    return request.app.state.vvs


async def http_error(request: Request, exc: StarletteHTTPException):  # unknown paths and methods
    return error_response(ApiError(exc.status_code, str(exc.detail)))


async def validation_error(request: Request, exc: RequestValidationError):
    return error_response(ApiError(422, "invalid request"))


async def health(request: Request):
    if not _state(request).worker.alive():
        return error_response(ApiError(503, "the engine thread has stopped", code="engine_dead"))
    return {"status": "ok"}


async def ready(request: Request):
    state = _state(request)
    worker = state.worker
    if not worker.alive() or not worker.ready.is_set() or state.draining:
        return error_response(ApiError(503, "draining" if state.draining else "not ready", code="not_ready"))
    return {"status": "ready"}


def model_card(state: AppState) -> dict:
    worker, limits = state.worker, state.limits
    return {"id": limits.model_name, "object": "model", "created": 0, "owned_by": "vvs-engine",
            "method": worker.method, "method_options": worker.options, "size": limits.size,
            "conditioning": limits.conditional,
            "num_classes": worker.engine.config.num_classes if limits.conditional == "c2i" else None,
            "class_names": limits.class_names, "defaults": worker.defaults.to_dict(),
            "per_request_sampling": limits.scope.uniform is None, "max_n": limits.max_n, "rows": worker.rows,
            "tokens_per_image": state.tokens_per_image, "static_batches": worker.static}


async def models(request: Request):
    return {"object": "list", "data": [model_card(_state(request))]}


async def model(request: Request, model_id: str):
    state = _state(request)
    if model_id != state.limits.model_name:
        return error_response(ApiError(404, f"the model '{model_id}' does not exist on this server",
                                       "model", "model_not_found"))
    return model_card(state)


async def metrics_text(request: Request):
    state = _state(request)
    text = await state.metrics_view() if state.metrics_view is not None else state.metrics.render()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def page(request: Request):
    return HTMLResponse(PAGE_HTML, headers=PAGE_HEADERS)


def _rejection_reason(error: ApiError, draining: bool) -> str:
    return {413: "too_large", 429: "queue_full", 408: "timeout"}.get(
        error.status, ("draining" if draining else "not_ready") if error.status == 503 else "bad_request")


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The body, at most MAX_BODY_BYTES, all of it within ``timeout_s`` (a slow client gets a 408)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body too large: {length} bytes (at most {MAX_BODY_BYTES})")
    end = time.monotonic() + timeout_s
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, end - time.monotonic()))
        except StopAsyncIteration:
            return bytes(body)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout",
                           headers={"Connection": "close"}) from None
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body too large (at most {MAX_BODY_BYTES} bytes)")


async def read_request(request: Request, state: AppState) -> Resolved:
    worker = state.worker
    if not worker.alive():
        raise ApiError(503, "the engine thread has stopped", code="engine_dead")
    if state.draining or not worker.ready.is_set():
        raise ApiError(503, "the server is shutting down" if state.draining else "the server is starting",
                       code="not_ready", headers={"Retry-After": "5"})
    # JSON only: a form or text/plain body is what any web page may send cross-origin without asking
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got '{media_type or 'none'}'",
                       code="unsupported_media_type")
    body = await read_body(request, state.body_timeout_s)
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        parsed = ImageRequest.model_validate(data)
    except ValidationError as e:
        message, where = validation_message(e)
        raise ApiError(422, message, where) from None
    return resolve(parsed, state.limits)


async def generations(request: Request):
    state = _state(request)
    arrival = time.monotonic()
    try:
        resolved = await read_request(request, state)
    except ApiError as e:
        state.metrics.rejected.inc(reason=_rejection_reason(e, state.draining))
        return error_response(e)
    events: asyncio.Queue = asyncio.Queue()
    job = EngineRequest(resolved.n, resolved.labels, resolved.prompts, resolved.seed, resolved.sampling,
                        EngineRequest.asyncio_delivery(asyncio.get_running_loop(), events), resolved.partial_images)
    job.created = arrival
    try:
        state.worker.queue.submit(job)
    except QueueFull as e:
        state.metrics.rejected.inc(reason="queue_full")
        return error_response(ApiError(429, "the server's queue is full; retry later", code="queue_full",
                                       headers={"Retry-After": str(e.retry_after_s)}))
    except NotAccepting as e:
        state.metrics.rejected.inc(reason="draining" if state.draining else "not_ready")
        return error_response(ApiError(503, str(e), code="not_ready", headers={"Retry-After": "5"}))
    if resolved.stream:
        return StreamingResponse(stream(state, job, events, resolved), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await answer(request, state, job, events, resolved)


# --- answers ----------------------------------------------------------------------------------------
def sse(event: str, data: dict) -> bytes:
    """One server-sent event (the type is also inside the data, as OpenAI's stream events carry it)."""
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, separators=(',', ':'))}\n\n".encode()


def image_usage(state: AppState, images: int) -> dict:
    """OpenAI's usage shape: the condition positions the model reads (a class token, or the padded
    prompt) as input, the image tokens as output."""
    config = state.worker.engine.config
    condition = getattr(config, "cls_token_num", 1) * images
    output = state.tokens_per_image * images
    return {"input_tokens": condition, "input_tokens_details": {"image_tokens": 0, "text_tokens": condition},
            "output_tokens": output, "total_tokens": condition + output}


def openai_fields(state: AppState, resolved: Resolved) -> dict:
    return {"background": "opaque", "output_format": "png", "quality": resolved.quality, "size": state.limits.size}


def summary(state: AppState, job: EngineRequest, resolved: Resolved, passes: list) -> dict:
    forwards = sum(passes)
    T = state.tokens_per_image
    usage = image_usage(state, resolved.n)
    usage.update({"images": resolved.n, "tokens": resolved.n * T,
                  "target_forward_passes": int(forwards) if float(forwards).is_integer() else forwards,
                  "tpf": resolved.n * T / forwards if forwards else None})
    return {"id": job.id, "created": int(time.time()), "model": state.limits.model_name, "seed": resolved.seed,
            **openai_fields(state, resolved), "usage": usage,
            "timings": {"queue_s": (job.admitted_at - job.created) if job.admitted_at else None,
                        "total_s": time.monotonic() - job.created}}


def revised_prompt(state: AppState, resolved: Resolved, j: int) -> Optional[str]:
    return class_prompt(resolved.labels[j], state.limits) if resolved.labels is not None else None


def finish(state: AppState, job: EngineRequest, reason: str) -> None:
    if reason != "completed":
        state.worker.queue.cancel(job)
    else:
        state.metrics.e2e_latency.observe(time.monotonic() - job.created)
    state.metrics.success.inc(finished_reason=reason)


def engine_error(event: tuple) -> ApiError:
    """An error event of the engine side: 503 when the request was aborted (shutdown), else 500."""
    return ApiError(event[1], event[2], code="aborted" if event[1] == 503 else "engine_error")


async def collect(state: AppState, job: EngineRequest, events: asyncio.Queue, resolved: Resolved) -> dict:
    n = resolved.n
    images, passes, tokens, done = [None] * n, [0.0] * n, [None] * n, 0
    while done < n:
        event = await events.get()
        if event[0] == "image":
            images[event[1]], passes[event[1]], tokens[event[1]] = event[2], event[3], event[4]
            done += 1
        elif event[0] == "error":
            raise engine_error(event)
    out = summary(state, job, resolved, passes)
    out["data"] = [{"b64_json": images[j], "revised_prompt": revised_prompt(state, resolved, j), "image_index": j,
                    "target_forward_passes": passes[j]} for j in range(n)]
    if resolved.return_tokens:
        for j, item in enumerate(out["data"]):
            item["tokens"] = tokens[j]
    return out


async def disconnected(request: Request) -> None:
    while True:  # after the body, the next ASGI message is the client going away
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def deadline_error(resolved: Resolved) -> ApiError:
    return ApiError(504, f"the request did not finish within its deadline of {resolved.timeout_s:g} s",
                    code="deadline_exceeded")


async def answer(request: Request, state: AppState, job: EngineRequest, events: asyncio.Queue, resolved: Resolved):
    collector = asyncio.ensure_future(collect(state, job, events, resolved))
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
            finish(state, job, "aborted" if e.status == 503 else "error")
            return error_response(e)
        finish(state, job, "completed")
        return JSONResponse(out)
    collector.cancel()
    if watcher in done:
        finish(state, job, "disconnected")
        return Response(status_code=499)  # nobody is there to read it
    finish(state, job, "deadline")
    return error_response(deadline_error(resolved))


async def stream(state: AppState, job: EngineRequest, events: asyncio.Queue, resolved: Resolved):
    """OpenAI's image stream: with ``partial_images`` k, k ``image_generation.partial_image`` events per
    image (the VQ decode of its committed tokens, the rest grey; ``partial_image_index`` 0..k-1), then
    an ``image_generation.completed`` event per image, with the image; the last one also carries the
    request's ``summary``. With ``progress: true`` (the page) the engine's own
    ``image_generation.started`` and ``image_generation.progress`` events come too (clients written
    for OpenAI would not know them). An error ends the stream with an ``error`` event."""
    T = state.tokens_per_image
    passes, done, reason = [0.0] * resolved.n, 0, "disconnected"
    try:
        if resolved.progress:
            yield sse("image_generation.started", {"id": job.id, "seed": resolved.seed, "n": resolved.n,
                                                   "total": T})
        while done < resolved.n:
            remaining = resolved.timeout_s - (time.monotonic() - job.created)
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                event = await asyncio.wait_for(events.get(), remaining)
            except asyncio.TimeoutError:
                reason = "deadline"
                yield sse("error", deadline_error(resolved).body())
                return
            if event[0] == "partial":
                yield sse("image_generation.partial_image",
                          {"b64_json": event[3], "created_at": int(time.time()), **openai_fields(state, resolved),
                           "partial_image_index": event[2], "image_index": event[1]})
            elif event[0] == "progress":
                if resolved.progress:
                    yield sse("image_generation.progress", {"image_index": event[1], "committed": event[2],
                                                            "total": T})
            elif event[0] == "image":
                passes[event[1]] = event[3]
                done += 1
                completed = {"b64_json": event[2], "created_at": int(time.time()), **openai_fields(state, resolved),
                             "usage": image_usage(state, 1), "image_index": event[1],
                             "revised_prompt": revised_prompt(state, resolved, event[1]),
                             "target_forward_passes": event[3]}
                if resolved.return_tokens:
                    completed["tokens"] = event[4]
                if done == resolved.n:
                    completed["summary"] = summary(state, job, resolved, passes)
                    reason = "completed"
                yield sse("image_generation.completed", completed)
            elif event[0] == "error":
                error = engine_error(event)
                reason = "aborted" if error.status == 503 else "error"
                yield sse("error", error.body())
                return
    finally:  # a dropped stream lands here too (the generator is cancelled or closed)
        finish(state, job, reason)


def create_app(state: AppState) -> FastAPI:
    """The FastAPI app: the routes above over ``state``, behind :class:`Guard`."""
    app = FastAPI(title="vvs-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.vvs = state
    state.metrics.bind_queue(state.worker.queue.snapshot, state.worker.rows)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id}", model, methods=["GET"])
    app.add_api_route("/metrics", metrics_text, methods=["GET"])
    app.add_api_route("/", page, methods=["GET"])
    app.add_api_route("/v1/images/generations", generations, methods=["POST"])
    app.add_middleware(Guard, state=state)
    return app
