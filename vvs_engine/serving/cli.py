"""``vvs-engine serve``: flags, checks before loading, warm-up, bind, graceful SIGTERM.

Order: every flag is checked first (milliseconds), then the model loads, the engine thread starts and
decodes one warm-up image (every round kind compiled and captured), and only then the port is bound
(``listening on http://HOST:PORT`` on stderr, the real port with ``--port 0``). SIGTERM or Ctrl-C:
``/ready`` and new requests answer 503, accepted requests finish within ``--shutdown-timeout``
seconds, the rest are aborted (503), and the process exits 0. A second signal aborts what is left
and exits at once (130 for Ctrl-C, 143 for SIGTERM), as does a signal during loading and warm-up:
the engine thread may then be inside a round, so the process ends with ``os._exit`` instead of
unwinding the interpreter around it (which aborted with ``terminate called without an active
exception``).
"""
from __future__ import annotations

import os
import sys
import threading

from ..errors import Terminated, VVSError
from .server import (API_KEY_ENV, DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS,
                     DEFAULT_MAX_N, DEFAULT_ROWS, RAY_HEADROOM_REQUESTS, bind, build_server, check_args)



# generate's flags that serve copies (so the two commands cannot drift apart): the model group, the
# method options, and these
COPIED = {"compile", "threads", "batch_size"}  # batch_size: only its type (an integer or 'auto'), for --rows


def add_serve_parser(sub, generate_parser):
    """The ``serve`` subcommand's parser (the caller sets its function)."""
    import copy

    from ..methods import method_names

    p = sub.add_parser("serve", help="serve images over HTTP (OpenAI-style /v1/images/generations; needs the "
                                     "[serve] extra)",
                       description="An image-generation HTTP server: one model, one method, one image size; "
                                   "requests join the running batch between rounds (continuous batching).")
    copied = {}
    for group in generate_parser._action_groups:
        title = group.title or ""
        if title == "model" or title.startswith("method options"):
            mine = p.add_argument_group(title)
            for action in group._group_actions:
                mine._add_action(copy.copy(action))
        for action in group._group_actions:
            if action.dest in COPIED:
                copied[action.dest] = action
    s = p.add_argument_group("decoding (the defaults; a request may set its own)")
    s.add_argument("--method", default="ar", help=f"decoding method (default ar): {', '.join(method_names())}")
    s.add_argument("--cfg-scale", type=float, default=4.0, help="guidance scale (default 4.0; 1 = no guidance rows: "
                                                                 "then every request must ask for 1)")
    s.add_argument("--temperature", type=float, default=1.0, help="temperature (default 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="top-k (default 0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="top-p (default 1.0 = off)")
    s.add_argument("--rows", type=copied["batch_size"].type, default=DEFAULT_ROWS, metavar="N",
                   help=f"images in flight (batch rows, fixed for the server's life; default {DEFAULT_ROWS}). "
                        f"'auto': the most that fit the device's free memory once the model is loaded (one "
                        f"process; not with --ray)")
    s.add_argument("--static-batches", action="store_true",
                   help="admit images only when every row is free (static batches, for comparison)")
    s._add_action(copy.copy(copied["compile"]))
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    h.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id in the API (default: zoo-gpt for the Zoo, else the checkpoint's name)")
    h.add_argument("--queue-size", type=int, default=None, metavar="N",
                   help="images that may wait for a row; beyond, 429 (default 4 x --rows)")
    h.add_argument("--max-n", type=int, default=None, metavar="N",
                   help=f"images per request at most (default {DEFAULT_MAX_N}, or --rows + --queue-size where that "
                        "is less; more is refused at start-up: such a request could never be accepted)")
    h.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="deadline of a request in seconds (default 600; a request may ask for less): 504")
    h.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds to let accepted requests finish before aborting them (default 30)")
    h._add_action(copy.copy(copied["threads"]))
    g = p.add_argument_group("security and slow clients")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/ routes (/health, /ready, /metrics and the page "
                        f"stay open); default ${API_KEY_ENV}, which unlike the flag does not show in ps")
    g.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host header names answered ('*' = any); default: loopback names when --host is a loopback "
                        "address (against DNS rebinding), else any")
    g.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help=f"close a connection whose request headers take longer (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    g.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help=f"answer 408 to a request whose body takes longer (default {DEFAULT_BODY_TIMEOUT_S:g})")
    g.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help=f"open connections at most; beyond, 503 and closed (default {DEFAULT_MAX_CONNECTIONS})")
    r = p.add_argument_group("scale-out (Ray Serve; needs the [ray] and [serve] extras)")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="serve the same app as a Ray Serve deployment: with no ADDRESS a local Ray cluster is "
                        "started here; 'auto' or ray://... joins a running one")
    r.add_argument("--num-replicas", type=int, default=None, metavar="N",
                   help="replicas, each one engine on one device (1 GPU on CUDA, --threads CPUs otherwise; "
                        "default 1)")
    r.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                   help="requests Ray hands one replica at a time (default: rows + queue size + "
                        f"{RAY_HEADROOM_REQUESTS}, so the replica's own queue answers 429)")
    r.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests Ray itself may hold when every replica is at --max-ongoing-requests; beyond, "
                        "Ray answers 429 (default: --max-ongoing-requests x --num-replicas)")
    return p


def serve(args, method_opts: dict, device: str) -> int:
    """Run the server (``vvs-engine serve``; the CLI passes the method options and device it parsed).
    Errors are VVSError lines (the CLI names the flags)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise VVSError("vvs-engine serve needs the [serve] extra: pip install 'vvs-engine[serve]' "
                       "(fastapi, uvicorn)") from None
    if getattr(args, "ray", None) is not None:
        from .ray_serve import serve_with_ray

        return serve_with_ray(args, method_opts, device)
    check_args(args, method_opts, device)
    from .protocol import guarded_protocol

    listener = bind(args.host, args.port)  # a port in use fails now, before minutes of loading
    try:
        worker, app, name = build_server(args, method_opts, device)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM while loading or warming up
        _exit_now(143 if isinstance(e, Terminated) else 130, f"error: {'terminated' if isinstance(e, Terminated) else 'interrupted'}")
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            lifespan="off", http=guarded_protocol(args.header_timeout, args.max_connections))
    server = DrainingServer(config, worker, app.state.vvs, args.shutdown_timeout)
    listener.listen(2048)
    host, port = listener.getsockname()[:2]
    print(f"vvs-engine serve: {name}, method {args.method}, {args.rows} {'row' if args.rows == 1 else 'rows'}; "
          f"listening on http://{host}:{port}", file=sys.stderr, flush=True)
    server.run(sockets=[listener])
    if server.forced is not None:
        _exit_now(128 + server.forced, "vvs-engine serve: stopped at once by a second signal (requests aborted)")
    ended = worker.close()
    print(f"vvs-engine serve: stopped ({'drained' if server.drained else 'requests aborted at shutdown'})",
          file=sys.stderr, flush=True)
    if not ended:  # the engine thread is still inside a round: do not unwind the interpreter around it
        _exit_now(0, None)
    return 0


def _exit_now(code: int, message) -> None:
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _server_class():
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's server whose first SIGTERM/SIGINT drains (503 to new requests, accepted ones
        finish within the timeout, the rest aborted) before it stops; a second one aborts what is
        left and stops at once (``forced``: its signal number)."""

        def __init__(self, config, worker, state, shutdown_timeout_s: float):
            super().__init__(config)
            self.worker, self.state, self.shutdown_timeout_s = worker, state, shutdown_timeout_s
            self.draining = None
            self.drained = True
            self.forced = None

        def handle_exit(self, sig, frame) -> None:
            if self.draining is not None:  # a second signal: stop now
                self.forced = int(sig)
                self.drained = False
                self.worker.abort()
                self.should_exit = self.force_exit = True
                return
            self.state.draining = True
            self.draining = threading.Thread(target=self._drain, name="vvs-drain", daemon=True)
            self.draining.start()

        def _drain(self) -> None:
            drained = self.worker.drain(self.shutdown_timeout_s)
            self.drained = self.drained and drained
            self.should_exit = True

    return Draining


def DrainingServer(config, worker, state, shutdown_timeout_s):  # noqa: N802 (a class made on first use)
    return _server_class()(config, worker, state, shutdown_timeout_s)
