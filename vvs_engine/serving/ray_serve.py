"""``vvs-engine serve --ray --num-replicas N``: the one-process server's app as a Ray Serve deployment.

A replica is what one ``vvs-engine serve`` process is: one engine on one device, its engine thread
running the one decode loop, and the same FastAPI app in front of it (:func:`.cli.build_server`, warm-up
included, from the same parsed flags). Ray's HTTP proxy spreads requests over the replicas; within a
replica everything (continuous batching, the bounded image queue and its 429, deadlines, streams,
metrics) is the one-process server's.

Sizing (why not Ray's defaults): Ray hands a replica at most ``max_ongoing_requests`` requests at a
time (default 5) and queues the rest in its proxy. A replica holds ``rows`` images in flight and
``queue size`` waiting, so with 5 a server of 8 rows would never fill its batch. The default here is
rows + queue size (the most requests a replica can hold work for: every request has at least one
image) plus a headroom of requests the app answers at once, so that a request beyond the replica's
capacity reaches the app and gets its 429 with a Retry-After from the recent image rate, and so that
/health and /metrics are not stuck behind long generations. Requests beyond that (every replica at
``max_ongoing_requests``) wait in Ray's own queue up to ``max_queued_requests`` per proxy; Ray's
default is no limit (they would hang), so it is bounded, and Ray 2.60's ``BackpressureConfig`` makes
those rejections 429 with a Retry-After too (Ray's own default status is 503). Ray's 429 body is Ray's
plain text, not the app's one-line JSON.

**One view of the replicas.** Every replica reports to a small Ray actor, the board
(:class:`ReplicaBoard`, no CPU of its own), once a second: its metrics, each series labelled with its
``replica``, and whether it holds accepted work. ``/metrics`` on any replica answers the board's view
of all of them (its own freshly), so a scrape through Ray's proxy, whichever replica answers it, sees
every replica's counters (one replica per scrape made them look like resets to Prometheus).

**Shutdown.** On SIGTERM the driver tells the board to drain; each replica sees it within a second and
does what the one-process server does on SIGTERM (``/ready`` and new requests answer the app's 503
JSON, accepted requests go on); once every replica is idle (or ``--shutdown-timeout`` has passed) the
application is deleted. (Deleting it first made ``/ready`` and ``/health`` Ray's plain-text 404.)

**Ports.** Ray's proxy binds ``--host``/``--port``: the API is there only. Ray's own processes (the
replicas' core workers among them) also listen for Ray's internal gRPC on every interface; with Ray
2.60 that held even with the node address set to 127.0.0.1 (checked with ``ss -ltnp``). That is Ray's
cluster traffic, not this API: keep a Ray cluster on a private network or behind a firewall, as Ray's
security notes ask.

Ray and FastAPI are imported only here, when ``--ray`` is given.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from ..errors import VVSError
from .metrics import merge_texts

APP_NAME = "vvs-engine"
DEPLOYMENT_NAME = "VVSEngineReplica"
RAY_RETRY_AFTER_S = 5  # Ray's own 429s know no image rate: the app's answer when it knows none either
BOARD_NAME, BOARD_NAMESPACE = "vvs-engine-board", "vvs-engine"
REPORT_INTERVAL_S = 1.0
STALE_AFTER_S = 30.0  # a replica that has not reported for this long is gone from the view


class ReplicaBoard:
    """What the replicas report (a Ray actor: ``board()``): each one's metrics text and whether it is
    idle, and the driver's drain flag, which ``report`` answers."""

    def __init__(self):
        self.reports: dict = {}  # replica id -> (time, metrics text, idle)
        self.draining = False

    def report(self, replica: str, text: str, idle: bool) -> bool:
        self.reports[replica] = (time.monotonic(), text, idle)
        return self.draining

    def view(self) -> dict:
        now = time.monotonic()
        return {r: text for r, (t, text, _) in self.reports.items() if now - t <= STALE_AFTER_S}

    def drain(self) -> None:
        self.draining = True

    def all_idle(self) -> bool:
        now = time.monotonic()
        return all(idle for t, _, idle in self.reports.values() if now - t <= STALE_AFTER_S)

    def reset(self) -> None:
        self.reports, self.draining = {}, False


def board():
    """The board actor of this Ray cluster (made on first use; it takes no CPU from the replicas)."""
    import ray

    return ray.remote(ReplicaBoard).options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True,
                                            num_cpus=0).remote()


def max_ongoing_requests(args) -> int:
    from .server import RAY_HEADROOM_REQUESTS, queue_size

    if args.max_ongoing_requests is not None:
        return args.max_ongoing_requests
    return args.rows + queue_size(args) + RAY_HEADROOM_REQUESTS


def max_queued_requests(args) -> int:
    """Ray's queue bound, per proxy. With rows + queue size as the default, a burst of 8 requests at 2
    replicas with room for 12 each once got a Ray 429 (seemingly: a request counts as queued until a
    replica is picked), so the default holds as many requests as all replicas take at once."""
    if args.max_queued_requests is not None:
        return args.max_queued_requests
    return max_ongoing_requests(args) * (args.num_replicas or 1)


def replica_args(args) -> argparse.Namespace:
    """The parsed flags a replica builds its server from (without the CLI's function, and with the
    CPU threads it is given by Ray)."""
    kept = {k: v for k, v in vars(args).items() if k != "func"}
    kept["threads"] = replica_cpus(args)
    return argparse.Namespace(**kept)


def replica_cpus(args) -> int:
    """CPUs Ray reserves for a replica, and its torch threads: --threads, 1 by default (as
    ``generate-dataset --ray`` does), so that N replicas fit in N CPUs."""
    return 1 if args.threads is None else args.threads


def replica_device(device: str) -> str:
    """Ray gives a CUDA replica one GPU (CUDA_VISIBLE_DEVICES), which it sees as ``cuda``."""
    return "cuda" if device.startswith("cuda") else device


class EngineReplica:
    """One Ray Serve replica: the one-process server's engine, engine thread and app. Wrapped with
    ``serve.ingress()`` (no app at definition: the app exists only once the engine is loaded, so Ray
    asks ``__serve_build_asgi_app__`` for it after ``__init__``)."""

    def __init__(self, args: argparse.Namespace, method_opts: dict, device: str):
        from ray import serve

        from .server import build_server

        # (not ``self.app``: Ray's ASGI wrapper, which this class becomes a base of, has that property)
        self.engine_worker, self.http_app, _ = build_server(args, method_opts, replica_device(device))
        context = serve.get_replica_context()
        self.replica = str(getattr(getattr(context, "replica_id", None), "unique_id", None)
                           or getattr(context, "replica_tag", "replica"))
        self.engine_worker.metrics.add_label("replica", self.replica)
        self.board = board()
        state = self.http_app.state.vvs
        state.metrics_view = self.metrics_view
        self.stopped = threading.Event()
        self.reporter = threading.Thread(target=self._report, name="vvs-board", daemon=True)
        self.reporter.start()

    def _report(self) -> None:
        import ray

        state, worker = self.http_app.state.vvs, self.engine_worker
        while not self.stopped.wait(REPORT_INTERVAL_S):
            try:
                with worker.queue.cond:
                    idle = not worker.queue.active
                draining = ray.get(self.board.report.remote(self.replica, worker.metrics.render(), idle), timeout=10)
            except Exception:  # the board is gone (shutdown): nothing to report to
                continue
            if draining and not state.draining:  # the driver's SIGTERM: drain as one process does
                state.draining = True
                worker.stop_accepting()

    async def metrics_view(self) -> str:
        own = self.engine_worker.metrics.render()
        try:
            others = await self.board.view.remote()
        except Exception:
            others = {}
        return merge_texts([own] + [text for replica, text in sorted(others.items()) if replica != self.replica])

    def __serve_build_asgi_app__(self):
        return self.http_app

    def __del__(self):
        # Ray calls this after its graceful shutdown (no new requests routed here, the ongoing ones
        # given graceful_shutdown_timeout_s): whatever is left is aborted with 503, then the engine
        # thread ends.
        worker = getattr(self, "engine_worker", None)
        if worker is None:  # __init__ failed
            return
        self.stopped.set()
        self.http_app.state.vvs.draining = True
        worker.drain(1.0)
        worker.close(10.0)


def deployment(args, method_opts: dict, device: str):
    """The bound Ray Serve application (``serve.run`` it)."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    cuda = device.startswith("cuda")
    replica = serve.deployment(
        serve.ingress()(EngineReplica),
        name=DEPLOYMENT_NAME,
        num_replicas=args.num_replicas or 1,
        # one device per replica: one GPU on CUDA; on a CPU, the CPUs its torch threads use
        ray_actor_options={"num_cpus": replica_cpus(args) if not cuda else 1, "num_gpus": 1 if cuda else 0},
        max_ongoing_requests=max_ongoing_requests(args),
        max_queued_requests=max_queued_requests(args),
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RAY_RETRY_AFTER_S),
        # accepted requests get the one-process server's --shutdown-timeout to finish
        graceful_shutdown_timeout_s=args.shutdown_timeout + 5.0,
        graceful_shutdown_wait_loop_s=0.5,
    )
    return replica.bind(replica_args(args), method_opts, device)


def deploy(args, method_opts: dict, device: str, port: int) -> str:
    """Deploy on the Ray cluster this process is connected to (``ray.init`` done) and wait until every
    replica has warmed up; returns the URL. Errors are VVSError lines."""
    import ray
    from ray import serve

    ray.get(board().reset.remote())  # a new deployment starts with no reports and no drain
    serve.start(http_options={"host": args.host, "port": port})
    try:
        serve.run(deployment(args, method_opts, device), name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as e:  # a replica that cannot start (bad model path, out of memory): Ray's last line
        serve.shutdown()
        lines = str(e).strip().splitlines()
        raise VVSError(f"the Ray Serve deployment failed: {lines[-1] if lines else type(e).__name__}") from None
    return f"http://{args.host}:{port}"


def deploy_checked(args, method_opts: dict, device: str) -> str:
    """Check the parsed ``serve`` flags as the CLI does and deploy on the Ray cluster this process is
    connected to, without waiting; returns the URL (the tests' entry: they parse with the CLI's parser,
    which this package does not import; stop with ``ray.serve.shutdown()``)."""
    _check(args, method_opts, device)
    return deploy(args, method_opts, device, _free_port(args.host, args.port))


def _check(args, method_opts: dict, device: str) -> None:
    from .server import check_args

    check_args(args, method_opts, device)
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
        from ray.serve.config import BackpressureConfig  # noqa: F401 (Ray >= 2.60)
    except ImportError:
        raise VVSError("--ray needs Ray Serve >= 2.60: pip install 'vvs-engine[ray,serve]' (from a checkout: "
                       "pip install -e \".[ray,serve]\")") from None


def _free_port(host: str, port: int) -> int:
    """``port`` if it is free (a port in use fails now, before minutes of loading), or with 0 a free
    one: Ray's proxy binds the port itself, so it is checked and released here (a small race)."""
    from .server import bind

    listener = bind(host, port)
    try:
        return listener.getsockname()[1]
    finally:
        listener.close()


def serve_with_ray(args, method_opts: dict, device: str) -> int:
    """``vvs-engine serve --ray [ADDRESS]``: deploy, print ``listening on``, wait for SIGTERM or
    Ctrl-C, then delete the application (replicas get --shutdown-timeout for their accepted requests)
    and shut Serve down."""
    _check(args, method_opts, device)
    import ray
    from ray import serve

    port = _free_port(args.host, args.port)
    started_here = False
    if not ray.is_initialized():
        if args.ray == "local":
            cpus = (args.num_replicas or 1) * replica_cpus(args)
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=args.ray, log_to_driver=False, configure_logging=False)
        started_here = True
    # Ray's core replaces the SIGTERM handler with its own (it aborts the process, exit 134): the first
    # SIGTERM or Ctrl-C stops the server below; a second one stops at once (the default action).
    previous = {sig: signal.signal(sig, _interrupt_once) for sig in (signal.SIGTERM, signal.SIGINT)}
    url = None
    try:
        url = deploy(args, method_opts, device, port)
        print(f"vvs-engine serve (Ray Serve): method {args.method}, {args.rows} {'row' if args.rows == 1 else 'rows'} x {args.num_replicas or 1} "
              f"replicas, max_ongoing_requests {max_ongoing_requests(args)}; listening on {url}",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        if url is None:  # stopped while the replicas were warming up: the CLI's "interrupted"
            raise
    finally:
        # Deleting the application first (blocking) lets the replicas finish their accepted requests
        # (graceful_shutdown_timeout_s) while the proxy still carries their answers; serve.shutdown()
        # alone stops the proxy at once and cuts open streams.
        try:
            if url is not None:
                drain(args.shutdown_timeout)
                serve.delete(APP_NAME)
        finally:
            serve.shutdown()
            if started_here:
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print("vvs-engine serve: stopped (Ray Serve shut down)", file=sys.stderr, flush=True)
    return 0



def drain(timeout_s: float) -> bool:
    """Every replica stops accepting (503 JSON) and finishes its accepted requests; True when all were
    idle within ``timeout_s`` (the replicas' graceful shutdown aborts the rest)."""
    import ray

    handle = board()
    ray.get(handle.drain.remote())
    time.sleep(REPORT_INTERVAL_S * 2.5)  # every replica has read the flag and reported since
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.get(handle.all_idle.remote()):
            return True
        time.sleep(0.25)
    return False


def _interrupt_once(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise KeyboardInterrupt
