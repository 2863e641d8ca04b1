"""What ``vvs-engine serve`` builds from its parsed flags, shared by the one-process server
(:mod:`.cli`) and the Ray Serve replicas (:mod:`.ray_serve`): the checks before loading, the engine
with its warm-up, worker and app, the queue size, and the listening socket."""
from __future__ import annotations

import os
import socket
import sys

from ..errors import VVSError

DEFAULT_ROWS = 8
DEFAULT_MAX_N = 16
API_KEY_ENV = "VVS_API_KEY"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 512
# Under --ray, the requests a replica may hold beyond rows + queue size: the ones it answers at once
# (429 when its queue is full, /health, /metrics, bad requests), so that they reach the app instead of
# waiting in Ray's queue behind long generations (see ray_serve.max_ongoing_requests).
RAY_HEADROOM_REQUESTS = 8


def _model_name(args) -> str:
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
    from .schemas import check_sampling_bounds

    if args.rows == "auto":
        if getattr(args, "ray", None) is not None:  # each replica would pick its own: the routing needs one figure
            raise VVSError("--rows auto is for the one-process server: under --ray give a number")
    elif args.rows < 1:
        raise VVSError(f"--rows must be an integer >= 1, got {args.rows}")
    if args.queue_size is not None and args.queue_size < 0:
        raise VVSError(f"--queue-size must be an integer >= 0, got {args.queue_size}")
    if args.max_n is not None and args.max_n < 1:
        raise VVSError(f"--max-n must be an integer >= 1, got {args.max_n}")
    if args.rows != "auto":  # with auto, checked once the rows are known (build_server)
        check_room(args)
    for name, value in (("--request-timeout", args.request_timeout), ("--shutdown-timeout", args.shutdown_timeout),
                        ("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0 or value == float("inf"):
            raise VVSError(f"{name} must be a finite number of seconds > 0, got {value}")
    if args.max_connections < 1:
        raise VVSError(f"--max-connections must be an integer >= 1, got {args.max_connections}")
    if api_key(args) == "":
        raise VVSError(f"the API key (--api-key or ${API_KEY_ENV}) is empty")
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
    check_sampling_bounds(SamplingParams(args.temperature, args.top_k, args.top_p, args.cfg_scale).validate())
    if args.method not in method_names():
        raise VVSError(f"unknown method '{args.method}'; known: {', '.join(method_names())}")
    get_method_options(args.method, method_opts)
    from ..models.quantize import check_quantize

    check_quantize(args.quantize, resolve_device(device), resolve_dtype(args.dtype), flag="--quantize")


def check_room(args) -> None:
    room = args.rows + queue_size(args)
    if args.max_n is not None and args.max_n > room:
        # a request of more images than rows + queue can never be accepted: it would get 429 forever
        raise VVSError(f"--max-n {args.max_n} is more than --rows + --queue-size = {room} images: a request of "
                       f"n > {room} could never be accepted; lower --max-n or raise --queue-size")


def build_server(args, method_opts: dict, device: str):
    """Load the engine, start its thread, decode the warm-up image and build the FastAPI app over it:
    ``(worker, app, model name)``. The one-process server and each Ray Serve replica call this with
    the same parsed flags, so the two serve the same app."""
    from ..engine import Engine
    from ..sampling import SamplingParams
    from ..threads import apply_threads, default_threads
    from .app import AppState, allowed_hosts_for, create_app
    from .schemas import Limits
    from .worker import EngineWorker

    threads = apply_threads(default_threads() if args.threads is None else args.threads, "--threads")
    engine = Engine.load(gpt_ckpt=args.gpt_ckpt, gpt_model=args.gpt_model, vq_ckpt=args.vq_ckpt,
                         vq_model=args.vq_model, image_size=args.image_size, drafter=args.drafter,
                         device=device, dtype=args.dtype, t5_path=args.t5_path,
                         model_dir=args.model_dir, max_prompt_tokens=args.max_prompt_tokens, threads=threads,
                         quantize=args.quantize,
                         deterministic=getattr(args, "deterministic", None) is not False)  # on unless --no-deterministic
    defaults = SamplingParams(args.temperature, args.top_k, args.top_p, args.cfg_scale)
    if args.rows == "auto":  # the weights are loaded: the free memory left is the decode state's
        args.rows = engine.auto_rows(args.method, args.cfg_scale, **method_opts)
        print(f"vvs-engine serve: --rows auto: {args.rows} rows fit the {engine.device.type.upper()}'s free memory",
              file=sys.stderr, flush=True)
        check_room(args)
    name = _model_name(args)
    worker = EngineWorker(engine, args.method, method_opts, args.rows, defaults, queue_size(args),
                          static=args.static_batches, compile=args.compile, model_name=name)
    c2i = engine.config.model_type == "c2i"
    warm_prompt = None if c2i else "a photo"
    print(f"vvs-engine serve: {name} loaded; warming up (one image through every round kind)", file=sys.stderr,
          flush=True)
    worker.start(warmup_label=0 if c2i else None, warmup_prompt=warm_prompt)
    class_names = []
    if c2i and args.gpt_ckpt is None and args.model_dir is None:
        from ..zoo import class_names as zoo_class_names

        class_names = zoo_class_names()
    limits = Limits(engine, args.method, worker.options, defaults, name, max_n(args), args.request_timeout,
                    worker.scope, image_size=worker.image_size, class_names=class_names)
    state = AppState(worker, limits, api_key=api_key(args), allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
                     body_timeout_s=args.body_timeout)
    return worker, create_app(state), name


def queue_size(args) -> int:
    """Images that may wait for a row (``--queue-size``, default 4 x rows)."""
    return 4 * args.rows if args.queue_size is None else args.queue_size


def max_n(args) -> int:
    """Images per request at most (``--max-n``; default 16, or rows + queue size where that is less)."""
    return min(DEFAULT_MAX_N, args.rows + queue_size(args)) if args.max_n is None else args.max_n


def api_key(args):
    """``--api-key``, else ``$VVS_API_KEY``, else None (no key)."""
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)


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
