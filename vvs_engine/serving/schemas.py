"""The request body of ``POST /v1/images/generations`` and its checks.

The OpenAI shape (``prompt``, ``model``, ``n``, ``size``, ``response_format``, ``output_format``,
``seed``, ``user``, ``stream``) plus the engine's extensions (``class_label``, ``cfg_scale`` or its
alias ``guidance_scale``, ``temperature``, ``top_k``, ``top_p``, ``negative_prompt``, ``method``,
``method_options``, ``timeout``, ``return_tokens``: each image's VQ token ids too; ``progress``:
progress events in the stream). OpenAI fields this server has no use for (``quality``, ``style``,
``background``, ``moderation``, ``output_compression``, ``safety_identifier``) are accepted and
ignored with a warning in the log, as vLLM does; ``size: "auto"`` is the server's size.

Schema errors (a missing condition, a wrong type, an unknown field, a value out of its range) are
422; a request the schema allows but this server does not run (``n`` over the limit, another size
or method, a prompt too long, ``url`` output) is 400; an unknown model is 404; a body over the size
limit is 413. Every error is one line of JSON: ``{"error": {"message", "type", "param", "code"}}``,
with ``type`` from the status (:data:`ERROR_TYPES`) and ``code`` a name or null.
"""
from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import VVSError
from ..sampling import SamplingParams

MAX_BODY_BYTES = 64 * 1024
MAX_PROMPT_CHARS = 2000
# Upper bounds of the sampling settings a request may set: beyond them the logits overflow (a guidance
# scale of 1e308 gives inf - inf = nan: every token 0) or the setting means nothing more (a temperature
# of 100 is already uniform sampling); a positive temperature under MIN_TEMPERATURE divides the logits
# past float range.
MAX_CFG_SCALE = 100.0
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-3
MAX_PARTIAL_IMAGES = 3
# OpenAI's fields that change nothing here: accepted, ignored, named once in the log
IGNORED_FIELDS = ("quality", "style", "background", "moderation", "output_compression", "safety_identifier")
# (``partial_images`` is used: 0-3 partial images per image in a stream, as OpenAI streams them; without
# ``stream`` it is ignored, as OpenAI does)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
log = logging.getLogger("vvs_engine.serve")
_warned: set = set()


class ApiError(Exception):
    """An HTTP error answered as one line of JSON."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Optional[str] = None
    model: Optional[str] = None
    n: int = Field(1, ge=1)
    size: Optional[str] = None
    response_format: str = "b64_json"
    output_format: str = "png"
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    user: Optional[str] = None
    stream: bool = False
    partial_images: Optional[int] = Field(None, ge=0, le=MAX_PARTIAL_IMAGES)
    quality: Optional[str] = None
    style: Optional[str] = None
    background: Optional[str] = None
    moderation: Optional[str] = None
    output_compression: Optional[int] = Field(None, ge=0, le=100)
    safety_identifier: Optional[str] = None
    class_label: Optional[Union[int, List[int]]] = None
    cfg_scale: Optional[float] = None
    guidance_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = Field(None, ge=0, le=2 ** 31 - 1)  # (a larger int overflowed the row tensors)
    top_p: Optional[float] = None
    negative_prompt: Optional[str] = None
    method: Optional[str] = None
    method_options: Optional[Dict[str, Union[int, float, str, bool]]] = None
    timeout: Optional[float] = Field(None, gt=0)
    return_tokens: bool = False
    progress: bool = False


def validation_message(error: ValidationError) -> tuple:
    """(one-line message, field name) of pydantic's first error."""
    first = error.errors()[0]
    loc = first.get("loc", ())
    # the field (and an index into a list), not pydantic's union branch names ("class_label.int")
    where = ".".join([str(loc[0])] + [str(x) for x in loc[1:] if isinstance(x, int)]) if loc else None
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{where}'", where
    return (f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid body")), where


@dataclass
class Resolved:
    """A request the server will run: one label or prompt per image, the seed, the sampling settings."""

    n: int
    labels: Optional[List[int]]
    prompts: Optional[List[str]]
    seed: int
    sampling: SamplingParams
    stream: bool
    timeout_s: float
    seed_given: bool
    return_tokens: bool = False
    progress: bool = False  # the engine's progress events in the stream (the page asks for them)
    partial_images: int = 0
    quality: str = "auto"


class Limits:
    """What one server accepts (set from its flags and model)."""

    def __init__(self, engine, method: str, options: dict, defaults: SamplingParams, model_name: str,
                 max_n: int, request_timeout_s: float, scope, image_size: Optional[tuple],
                 class_names: Optional[list] = None):
        self.engine = engine
        self.method = method
        self.options = options
        self.defaults = defaults
        self.model_name = model_name
        self.max_n = max_n
        self.request_timeout_s = request_timeout_s
        self.scope = scope  # which per-request sampling settings the server's decoder allows
        self.class_names = class_names or []
        # (width, height) of the warm-up image: what the tokenizer really decodes to
        self.size = f"{image_size[0]}x{image_size[1]}" if image_size else None
        self.conditional = engine.config.model_type  # "c2i" or "t2i"


def _label_from_prompt(prompt: str, limits: Limits) -> Optional[int]:
    """A class-conditional model's prompt may name its class: a number or a class name."""
    text = prompt.strip()
    if text.isdigit():
        return int(text)
    names = [n.lower() for n in limits.class_names]
    return names.index(text.lower()) if text.lower() in names else None


def resolve(req: ImageRequest, limits: Limits) -> Resolved:
    """Check a parsed request against the server; -> what to run. Raises :class:`ApiError`."""
    if req.model is not None and req.model != limits.model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist on this server (it runs "
                            f"'{limits.model_name}')", "model", "model_not_found")
    for name in IGNORED_FIELDS:
        if getattr(req, name) is not None and name not in _warned:
            _warned.add(name)  # once per field: a client that always sends it does not flood the log
            log.warning("vvs-engine serve: the request field '%s' is accepted and ignored (not used by this "
                        "server)", name)
    if req.n > limits.max_n:
        raise ApiError(400, f"n must be <= {limits.max_n} on this server, got {req.n}", "n")
    if req.size is not None and req.size != "auto" and req.size != limits.size:
        raise ApiError(400, f"size must be {limits.size} (this server's image size), got '{req.size}'", "size")
    if req.response_format != "b64_json":
        raise ApiError(400, f"response_format must be b64_json (this server stores no images), got "
                            f"'{req.response_format}'", "response_format")
    if req.output_format != "png":
        raise ApiError(400, f"output_format must be png, got '{req.output_format}'", "output_format")
    if req.method is not None and req.method != limits.method:
        raise ApiError(400, f"this server runs method '{limits.method}', not '{req.method}'", "method")
    if req.method_options:
        for name, value in req.method_options.items():
            if name not in limits.options:
                raise ApiError(400, f"method '{limits.method}' on this server has no option '{name}'",
                               "method_options")
            if value != limits.options[name]:
                raise ApiError(400, f"this server runs {limits.method} with {name}={limits.options[name]!r}, "
                                    f"not {value!r}", "method_options")
    if req.prompt is not None and len(req.prompt) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"prompt too long: {len(req.prompt)} characters (at most {MAX_PROMPT_CHARS})", "prompt")
    labels = prompts = None
    if limits.conditional == "c2i":
        if req.negative_prompt is not None:
            raise ApiError(400, "negative_prompt needs a text-conditional model; this one is class-conditional",
                           "negative_prompt")
        label = req.class_label
        if label is not None and req.prompt is not None:
            # (the OpenAI SDK always sends a prompt): a prompt that names another class is a conflict;
            # any other prompt is not used, and each image's revised_prompt says what ran
            named = _label_from_prompt(req.prompt, limits)
            if named is not None and named not in (label if isinstance(label, list) else [label]):
                raise ApiError(400, f"the prompt names class {named} but class_label is {label}: give one",
                               "prompt")
        if label is None and req.prompt is not None:
            label = _label_from_prompt(req.prompt, limits)
            if label is None:
                raise ApiError(422, "this model is class-conditional: give class_label (an integer), or a prompt "
                                    "that is a class number or name", "class_label")
        if label is None:
            raise ApiError(422, "give class_label (this model is class-conditional)", "class_label")
        labels = list(label) if isinstance(label, list) else [label] * req.n
        if len(labels) != req.n:
            raise ApiError(422, f"class_label has {len(labels)} entries for n={req.n} images", "class_label")
        try:
            labels = limits.engine.check_labels(labels)
        except VVSError as e:
            raise ApiError(422, str(e), "class_label") from None
    else:
        if req.class_label is not None:
            raise ApiError(400, "class_label needs a class-conditional model; this one takes a prompt", "class_label")
        if req.prompt is None or not req.prompt.strip():
            raise ApiError(422, "give a prompt (this model is text-conditional)", "prompt")
        if req.negative_prompt is not None:
            raise ApiError(400, "negative_prompt is not supported by this model family", "negative_prompt")
        prompts = [req.prompt] * req.n
    if req.cfg_scale is not None and req.guidance_scale is not None and req.cfg_scale != req.guidance_scale:
        raise ApiError(422, "cfg_scale and guidance_scale (its alias) differ", "cfg_scale")
    d = limits.defaults
    cfg = req.cfg_scale if req.cfg_scale is not None else req.guidance_scale
    top_k = d.top_k if req.top_k is None else req.top_k
    sampling = SamplingParams(d.temperature if req.temperature is None else float(req.temperature),
                              top_k, d.top_p if req.top_p is None else float(req.top_p),
                              d.cfg_scale if cfg is None else float(cfg))
    for name in ("temperature", "top_p", "cfg_scale"):
        if not math.isfinite(getattr(sampling, name)):
            raise ApiError(422, f"{name} must be a finite number", name)
    if sampling.cfg_scale > MAX_CFG_SCALE:
        raise ApiError(422, f"cfg_scale must be <= {MAX_CFG_SCALE:g}, got {sampling.cfg_scale:g}", "cfg_scale")
    if sampling.temperature > MAX_TEMPERATURE or 0 < sampling.temperature < MIN_TEMPERATURE:
        raise ApiError(422, f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                            f"got {sampling.temperature:g}", "temperature")
    try:
        sampling.validate()
    except VVSError as e:
        param = str(e).split(" ")[0].replace("-", "_")
        raise ApiError(422, str(e), param if param in ("temperature", "top_k", "top_p", "cfg_scale") else None) from None
    refused = limits.scope.allows(sampling)
    if refused:
        raise ApiError(422, refused, "cfg_scale"
                       if sampling.use_cfg and not limits.scope.use_cfg else None)
    timeout = limits.request_timeout_s if req.timeout is None else float(req.timeout)
    if timeout > limits.request_timeout_s:
        raise ApiError(422, f"timeout must be <= {limits.request_timeout_s} s on this server", "timeout")
    seed = req.seed if req.seed is not None else secrets.randbits(31)
    return Resolved(req.n, labels, prompts, seed, sampling, req.stream, timeout, req.seed is not None,
                    req.return_tokens, req.progress, (req.partial_images or 0) if req.stream else 0,
                    req.quality or "auto")


def class_prompt(label: int, limits: Limits) -> str:
    """What a class-conditional image was made from, as its ``revised_prompt``."""
    names = limits.class_names
    return names[label] if 0 <= label < len(names) else f"class {label}"


def check_sampling_bounds(sampling: SamplingParams) -> None:
    """The server's flags get the requests' bounds (VVSError)."""
    if sampling.cfg_scale > MAX_CFG_SCALE:
        raise VVSError(f"--cfg-scale must be <= {MAX_CFG_SCALE:g} on a server, got {sampling.cfg_scale:g}")
    if sampling.temperature > MAX_TEMPERATURE or 0 < sampling.temperature < MIN_TEMPERATURE:
        raise VVSError(f"--temperature must be 0 or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] on a server, "
                       f"got {sampling.temperature:g}")
