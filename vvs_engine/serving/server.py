"""What ``vvs-engine serve`` builds from its parsed flags, shared by the one-process server
(:mod:`.cli`) and the Ray Serve replicas (:mod:`.ray_serve`): the checks before loading, the engine
with its warm-up, worker and app, the queue size, and the listening socket."""
from __future__ import annotations

import socket

from ..errors import VVSError

DEFAULT_ROWS = 8
# Under --ray, the requests a replica may hold beyond rows + queue size: the ones it answers at once
# (429 when its queue is full, /health, /metrics, bad requests), so that they reach the app instead of
# waiting in Ray's queue behind long generations (see ray_serve.max_ongoing_requests).
RAY_HEADROOM_REQUESTS = 8


def _model_name(args) -> str:
    import os

    if args.model_name:
        return args.model_name
    if args.model_dir:
        return os.path.basename(os.path.normpath(args.model_dir))
    if args.gpt_ckpt:
        return os.path.splitext(os.path.basename(args.gpt_ckpt))[0]
    return "zoo-gpt"


def check_args(args, method_opts: dict, device: str) -> None:
    """Every serve flag that can be checked without the model."""
    from ..engine import check_load_args, resolve_device, resolve_dtype
    from ..methods import get_method_options, method_names
    from ..sampling import SamplingParams

    for name, value, low in (("--rows", args.rows, 1), ("--max-n", args.max_n, 1)):
        if value < low:
            raise VVSError(f"{name} must be an integer >= {low}, got {value}")
    if args.queue_size is not None and args.queue_size < 0:
        raise VVSError(f"--queue-size must be an integer >= 0, got {args.queue_size}")
    for name, value in (("--request-timeout", args.request_timeout), ("--shutdown-timeout", args.shutdown_timeout)):
        if not value > 0 or value == float("inf"):
            raise VVSError(f"{name} must be a finite number of seconds > 0, got {value}")
    ray_only = [flag for flag, value in (("--num-replicas", args.num_replicas),
                                         ("--max-ongoing-requests", args.max_ongoing_requests),
                                         ("--max-queued-requests", args.max_queued_requests)) if value is not None]
    if ray_only and args.ray is None:
        raise VVSError(f"{ray_only[0]} is a Ray Serve setting: add --ray (without it one process serves)")
    for name, value in (("--num-replicas", args.num_replicas), ("--max-ongoing-requests", args.max_ongoing_requests),
                        ("--max-queued-requests", args.max_queued_requests)):
        if value is not None and value < 1:
            raise VVSError(f"{name} must be an integer >= 1, got {value}")
    if not 0 <= args.port <= 65535:
        raise VVSError(f"--port must be in [0, 65535], got {args.port}")
    check_load_args(gpt_ckpt=args.gpt_ckpt, gpt_model=args.gpt_model, vq_ckpt=args.vq_ckpt, drafter=args.drafter,
                    t5_path=args.t5_path, model_dir=args.model_dir, max_prompt_tokens=args.max_prompt_tokens,
                    image_size=args.image_size, cli=True, vq_model=args.vq_model)
    SamplingParams(args.temperature, args.top_k, args.top_p, args.cfg_scale).validate()
    if args.method not in method_names():
        raise VVSError(f"unknown method '{args.method}'; known: {', '.join(method_names())}")
    get_method_options(args.method, method_opts)
    resolve_device(device)
    resolve_dtype(args.dtype)


def build_server(args, method_opts: dict, device: str):
    """Load the engine, start its thread, decode the warm-up image and build the FastAPI app over it:
    ``(worker, app, model name)``. The one-process server and each Ray Serve replica call this with
    the same parsed flags, so the two serve the same app."""
    from ..engine import Engine
    from ..sampling import SamplingParams
    from ..threads import apply_threads, default_threads
    from .app import create_app
    from .schemas import Limits
    from .worker import EngineWorker

    threads = apply_threads(default_threads() if args.threads is None else args.threads, "--threads")
    engine = Engine.load(gpt_ckpt=args.gpt_ckpt, gpt_model=args.gpt_model, vq_ckpt=args.vq_ckpt,
                         vq_model=args.vq_model, image_size=args.image_size, drafter=args.drafter,
                         device=device, dtype=args.dtype, t5_path=args.t5_path,
                         model_dir=args.model_dir, max_prompt_tokens=args.max_prompt_tokens, threads=threads,
                         deterministic=getattr(args, "deterministic", None) is not False)  # on unless --no-deterministic
    defaults = SamplingParams(args.temperature, args.top_k, args.top_p, args.cfg_scale)
    name = _model_name(args)
    worker = EngineWorker(engine, args.method, method_opts, args.rows, defaults, queue_size(args),
                          static=args.static_batches, compile=args.compile, model_name=name)
    c2i = engine.config.model_type == "c2i"
    warm_prompt = None if c2i else "a photo"
    worker.start(warmup_label=0 if c2i else None, warmup_prompt=warm_prompt)
    class_names = []
    if c2i and args.gpt_ckpt is None and args.model_dir is None:
        from ..zoo import class_names as zoo_class_names

        class_names = zoo_class_names()
    limits = Limits(engine, args.method, worker.options, defaults, name, args.max_n, args.request_timeout,
                    worker.scope, image_size=worker.image_size, class_names=class_names)
    return worker, create_app(worker, limits), name


def queue_size(args) -> int:
    """Images that may wait for a row (``--queue-size``, default 4 x rows)."""
    return 4 * args.rows if args.queue_size is None else args.queue_size


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise VVSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener
