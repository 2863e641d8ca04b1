"""The user-facing engine: load models once, generate with any method, score tokens.

    from vvs_engine import Engine
    eng = Engine.load()                                  # the shipped Zoo model
    out = eng.generate(class_labels=[0, 1, 2], method="vvs", seed=0)
    out.images[0].save("a.png"); print(out.stats["tpf"])
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from .checkpoint import config_path, load_into, read_project_config, read_state_dict
from .errors import VVSError, check
from .models.gpt import GPT, GPT_PRESETS, GPTConfig, checked_gpt_config, gpt_config
from .models.invariant import set_batch_invariant
from .models.vq import VQ_PRESETS, VQConfig, VQModel, checked_vq_config, to_uint8
from .sampling import RowSettings, SamplingParams, SamplingScope
from .runtime.target import TargetSession
from . import threads as _threads  # noqa: F401  (records torch's thread count at import, see threads.py)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16,
          # fp64: slow, but no batch composition can change an image's tokens (reproducibility checks)
          "fp64": torch.float64, "float64": torch.float64}


def resolve_device(device) -> torch.device:
    try:
        d = torch.device(device) if not isinstance(device, torch.device) else device
    except (RuntimeError, TypeError):
        raise VVSError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise VVSError("CUDA was requested but no CUDA device is available (use the device 'cpu')")
    if d.type not in ("cpu", "cuda"):
        raise VVSError(f"unsupported device {device!r}; use cpu, cuda or cuda:N")
    return d


AUTO_ROWS_CAP = 256  # --rows auto / --batch-size auto never takes more images in flight than this
AUTO_ROWS_SLACK = 1 << 30  # kept free besides the decode state (the memory table's CUDA slack; allocator, VQ decode)


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise VVSError(f"seed must be an integer, got {seed!r}")
    if not -2 ** 63 <= seed < 2 ** 63:
        raise VVSError(f"seed must fit in 64 bits (|seed| < 2**63), got {seed}")
    return seed


def check_load_args(gpt_ckpt=None, gpt_model=None, vq_ckpt=None, drafter=None, t5_path=None, model_dir=None,
                    max_prompt_tokens=None, image_size=None, cli: bool = False, vq_model=None) -> None:
    """The ``Engine.load`` arguments that can be checked without reading a file: combinations, numbers,
    and that every named file or folder exists. ``cli``: name the flags (``--gpt-ckpt``) in messages."""
    import os

    def name(arg: str) -> str:
        return "--" + arg.replace("_", "-") if cli else arg

    if model_dir is not None and (gpt_ckpt or vq_ckpt):
        raise VVSError(f"{name('model_dir')} replaces {name('gpt_ckpt')}/{name('vq_ckpt')}: give one or the other")
    if gpt_model is not None and gpt_ckpt is None:
        raise VVSError(f"{name('gpt_model')} names the architecture of a {name('gpt_ckpt')} file; give the "
                       f"checkpoint too (the default Zoo model has its own config)")
    # a preset is checked even where a config file makes it unused: a typo is a typo
    if gpt_model is not None and gpt_model not in GPT_PRESETS:
        raise VVSError(f"unknown model '{gpt_model}' ({name('gpt_model')}); known: {', '.join(GPT_PRESETS)}")
    if vq_model is not None and vq_model not in VQ_PRESETS:
        raise VVSError(f"unknown tokenizer '{vq_model}' ({name('vq_model')}); known: {', '.join(VQ_PRESETS)}")
    if max_prompt_tokens is not None:
        if model_dir is None:
            raise VVSError(f"{name('max_prompt_tokens')} pads the prompts of a {name('model_dir')} family; without "
                           f"{name('model_dir')} it would do nothing")
        if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 2:
            raise VVSError(f"{name('max_prompt_tokens')} must be an integer >= 2, got {max_prompt_tokens!r}")
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                   or image_size < 1):
        raise VVSError(f"{name('image_size')} must be a positive integer (pixels), got {image_size!r}")
    for arg, path, what in (("gpt_ckpt", gpt_ckpt, "checkpoint"), ("vq_ckpt", vq_ckpt, "checkpoint"),
                            ("drafter", drafter, "drafter checkpoint")):
        if path and not os.path.isfile(path):
            raise VVSError(f"{what} not found: {path}" if not os.path.isdir(path) else
                           f"{name(arg)} {path} is a folder, not a checkpoint file")
    for path, what in ((model_dir, "model folder"), (t5_path, "T5 folder")):
        if path is not None and not os.path.isdir(path):
            raise VVSError(f"{what} not found: {path}")
    for kind, path in (("gpt", gpt_ckpt), ("vq", vq_ckpt), ("drafter", drafter)):
        if path:
            read_project_config(path, kind)  # a file of another kind (or a broken config) named before any weights


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise VVSError(f"unknown dtype '{dtype}'; use fp32, bf16, fp16 or fp64")
    return DTYPES[dtype]


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [n_images, tokens_per_image] int64 (CPU)
    labels: Optional[List[int]]
    prompts: Optional[List[str]]
    images: List[Any] = field(default_factory=list)  # PIL images when a tokenizer is loaded
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    """How rounds run: compiled by Inductor, captured as CUDA graphs (never off CUDA)."""

    compile: bool
    cuda_graphs: bool

    @classmethod
    def resolve(cls, device, compile: Optional[bool] = None, cuda_graphs: Optional[bool] = None) -> "RunConfig":
        from .runtime.compiled import resolve as resolve_compile

        device = torch.device(device)
        return cls(resolve_compile(compile, device), device.type == "cuda" and (cuda_graphs is None or bool(cuda_graphs)))


@dataclass
class PartialImage:
    """An image in the making (``Engine.generate(on_partial=...)``)."""

    image_index: int  # position in the call's list of images
    partial_index: int  # 0, 1, ... in order
    tokens: torch.Tensor  # [T] int64: the row's tokens now (only the committed ones are final)
    committed: torch.Tensor  # [T] bool: final positions (a raster prefix; ZipAR: a prefix of every image row)
    image: Any  # PIL image: the VQ decode, positions not yet final grey


@dataclass
class ImageSpec:
    """One image to decode: its condition (a class label or a prompt), the key of its random numbers
    (``seed``, ``index``: image ``index`` of a generation with that seed) and its sampling settings."""

    label: Optional[int] = None
    prompt: Optional[str] = None
    seed: int = 0
    index: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)


def _both(first, second):
    """One callback calling both (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda k: (first(k), second(k))


def _per_image(name: str, value, n: int) -> list:
    """One value for every image, or a list with one per image -> a list of n values."""
    if isinstance(value, (list, tuple)):
        check(len(value) == n, f"{name} has {len(value)} values for {n} images (give one, or one per image)")
        return list(value)
    return [value] * n


def _deterministic_per_call(generate):
    """``generate(..., deterministic=None)``: True / False switch batch-invariant decoding for this
    call only (the engine's setting is restored after it)."""
    import functools

    @functools.wraps(generate)
    def call(self, *args, deterministic: Optional[bool] = None, **kwargs):
        if deterministic is None or bool(deterministic) == self.deterministic:
            return generate(self, *args, **kwargs)
        before = self.deterministic
        self.set_deterministic(bool(deterministic))
        try:
            return generate(self, *args, **kwargs)
        finally:
            self.set_deterministic(before)
    return call


class Engine:
    def __init__(self, gpt: GPT, vq: Optional[VQModel] = None, drafter=None, caption_encoder=None,
                 info: Optional[dict] = None):
        self.gpt = gpt.eval()
        self.vq = vq.eval() if vq is not None else None
        self.drafter = drafter.eval() if drafter is not None else None
        self.caption_encoder = caption_encoder
        self.info = info or {}
        p = next(gpt.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._codebook_cache = {}
        self._cores = {}  # (method, options, sampling scope, run config, mode) -> runtime.core.DecodeCore
        self.quantization = "none"  # quantize_weights() sets it
        self.set_deterministic(False)

    # --- batch invariance (issue 53; docs/batching.md, *Batch-invariant mode*) -------------------
    def set_deterministic(self, on: bool = True) -> "Engine":
        """Batch-invariant decoding on or off for this engine's later calls: every GEMM of the target
        and drafter computes each row as in any batch (``models.invariant``) and the tokenizer decodes
        one image at a time, so an image's tokens and pixels do not depend on its batch-mates."""
        self.deterministic = bool(on)
        set_batch_invariant(self.deterministic, self.gpt, self.drafter)
        return self

    # --- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, gpt_ckpt: Optional[str] = None, gpt_model: Optional[str] = None, vq_ckpt: Optional[str] = None,
             vq_model: str = "VQ-16", image_size: Optional[int] = None, drafter: Optional[str] = None,
             device="cpu", dtype="fp32", t5_path: Optional[str] = None, model_dir: Optional[str] = None,
             max_prompt_tokens: Optional[int] = None, threads: Optional[int] = None,
             model: Optional[str] = None, quantize: Optional[str] = None,
             deterministic: bool = False) -> "Engine":
        """Load a target (official LlamaGen file or the project's safetensors), optionally a VQ tokenizer
        and a drafter. With no ``gpt_ckpt`` the shipped Zoo model (target, tokenizer, drafter) is used.
        ``model``: a Zoo target by name instead, ``zoo-gpt`` (the default) or ``zoo-gpt-32`` (32x32
        tokens, 128 px): its file, its own drafter and ``zoo-vq`` (``vq_ckpt`` / ``drafter`` override them).
        ``model_dir``: a local Hugging Face folder of another family (Janus-Pro, Lumina-mGPT, Emu3);
        its prompts are left-padded to ``max_prompt_tokens`` (default 128); ``image_size`` (pixels)
        sets the Lumina-mGPT/Emu3 image. ``threads``: torch's CPU threads, set here for the whole
        process; default: the CLI's (``$OMP_NUM_THREADS``, else half the cores, at most 4), unless you
        already called ``torch.set_num_threads`` after importing vvs_engine (then yours is kept).
        ``quantize``: ``none`` (default), ``int8``, ``fp8`` or ``int4``: the target's and drafter's linear
        weights quantized at load through torchao (weight-only; docs/quantization.md).
        ``deterministic``: batch-invariant decoding (:meth:`set_deterministic`), off by default."""
        from .models.quantize import check_quantize
        from .threads import apply_threads

        device, dtype = resolve_device(device), resolve_dtype(dtype)
        quantize = check_quantize(quantize, device, dtype)
        from . import zoo

        gpt_ckpt, vq_ckpt, drafter = zoo.resolve_model(model, gpt_ckpt, vq_ckpt, drafter, model_dir)
        check_load_args(gpt_ckpt, gpt_model, vq_ckpt, drafter, t5_path, model_dir, max_prompt_tokens, image_size,
                        vq_model=vq_model)
        apply_threads(threads)
        info = {}
        if model_dir is not None:
            from .models.hf_loader import DEFAULT_MAX_PROMPT_TOKENS, load_hf_folder

            target, image_decoder, info = load_hf_folder(
                model_dir, DEFAULT_MAX_PROMPT_TOKENS if max_prompt_tokens is None else max_prompt_tokens, image_size)
            dr = None
            if drafter:
                from .drafting.drafter import load_drafter

                dr = load_drafter(drafter, target)
            info["drafter"] = drafter
            return cls(target, image_decoder, dr, None, info).quantize_weights(quantize, device, dtype).to(
                device, dtype).set_deterministic(deterministic)
        if model is not None:
            info["model"] = model
        elif gpt_ckpt is None:
            paths = zoo.default_paths()
            gpt_ckpt = paths["gpt"]
            vq_ckpt = vq_ckpt or paths["vq"]
            drafter = drafter or paths.get("drafter")
            info["model"] = "zoo"
        vq = load_vq(vq_ckpt, vq_model) if vq_ckpt else None
        gpt = load_gpt(gpt_ckpt, gpt_model, image_size, vq)
        info.update(gpt_ckpt=gpt_ckpt, vq_ckpt=vq_ckpt, drafter=drafter)
        dr = None
        if drafter:
            from .drafting.drafter import load_drafter

            dr = load_drafter(drafter, gpt)
        enc = None
        if gpt.config.model_type == "t2i" and t5_path:
            from .models.t5 import CaptionEncoder

            enc = CaptionEncoder(t5_path, gpt.config.cls_token_num)
        eng = cls(gpt, vq, dr, enc, info)
        return eng.quantize_weights(quantize, device, dtype).to(device, dtype).set_deterministic(deterministic)

    def quantize_weights(self, mode: str, device=None, dtype=None) -> "Engine":
        """Quantize the target's and the drafter's linear weights in place (``mode``: int8, fp8, int4;
        ``none`` does nothing), weight-only, through torchao; the VQ decoder keeps its dtype. With
        ``device`` / ``dtype`` the weights are cast first and each layer moves to the device just before it
        is quantized (a model too large for the device in full precision still loads)."""
        from .models.quantize import check_quantize, quantize_module

        device = resolve_device(device) if device is not None else self.device
        dtype = resolve_dtype(dtype) if dtype is not None else self.dtype
        mode = check_quantize(mode, device, dtype)
        if mode == "none":
            return self
        check(self.quantization == "none", f"the weights are already quantized ({self.quantization})")
        for model in (self.gpt, self.drafter):
            if model is not None:
                model.to(dtype=dtype)
                quantize_module(model, mode, device)
        self.dtype = dtype
        self.quantization = mode
        self.info["quantize"] = mode
        self._cores = {}  # kept decoders and their compiled rounds were built over the old weights
        return self

    def to(self, device, dtype=None) -> "Engine":
        device = resolve_device(device)
        dtype = resolve_dtype(dtype) if dtype is not None else self.dtype
        check(self.quantization == "none" or dtype == self.dtype,
              f"the weights are quantized ({self.quantization}) for {str(self.dtype).replace('torch.', '')}: load "
              f"again to compute in another dtype")
        self.gpt.to(device=device, dtype=dtype)
        if self.vq is not None:
            self.vq.to(device=device)  # the tokenizer stays fp32: decoding is a small share of the work
        if self.drafter is not None:
            self.drafter.to(device=device, dtype=dtype)
        if self.caption_encoder is not None:
            self.caption_encoder.to(device)
        self.device, self.dtype = device, dtype
        self._codebook_cache = {}
        self._cores = {}  # decoders hold caches of the old device and dtype
        return self

    # --- conditions ---------------------------------------------------------------------------
    @property
    def config(self) -> GPTConfig:
        return self.gpt.config

    @property
    def tokens_per_image(self) -> int:
        return self.config.block_size

    @property
    def shape(self) -> "ModelShape":
        return ModelShape.of(self.config, self.vq)

    def auto_rows(self, method: str = "ar", cfg_scale: float = 4.0, cap: int = AUTO_ROWS_CAP, flag: str = "--rows",
                  **options) -> int:
        """The most images in flight whose decode state fits this engine's device now (``rows_that_fit``):
        what ``--batch-size auto`` (generate) and ``--rows auto`` (serve) decode with."""
        from .methods import get_method_options

        opts = get_method_options(method, options)
        free = available_bytes(self.device)
        if free is not None and method == "quant-draft" and not self.__dict__.get("_quantized_copies"):
            from .models.quantize import weight_bytes

            free -= weight_bytes(self.gpt)  # the quantized copy, built at the first decode (at most the target's size)
        return rows_that_fit(self.shape, opts, cfg_scale != 1.0, self.device, self.dtype, cap, free=free, flag=flag)

    def check_labels(self, labels) -> List[int]:
        """Class labels: a list (or 1-D integer array / tensor) of integers in [0, num_classes)."""
        check(self.config.model_type == "c2i", "this model is text-conditional: pass prompts, not class labels")
        if isinstance(labels, (torch.Tensor, np.ndarray)):
            check(labels.ndim == 1, f"class_labels must be 1-D (one label per image), got shape {tuple(labels.shape)}")
            is_int = (not labels.is_floating_point() and not labels.is_complex() and labels.dtype != torch.bool
                      if isinstance(labels, torch.Tensor) else np.issubdtype(labels.dtype, np.integer))
            check(is_int, f"class labels must be integers, got an array of {labels.dtype}")
            labels = labels.tolist()
        if isinstance(labels, (int, str)) or not hasattr(labels, "__iter__"):
            raise VVSError(f"class_labels must be a list of integers (one image each), e.g. [3], got {labels!r}")
        out = []
        for x in labels:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise VVSError(f"class labels must be integers, got {x!r} ({type(x).__name__})")
            x = int(x)
            if not 0 <= x < self.config.num_classes:
                raise VVSError(f"class label {x} out of range [0, {self.config.num_classes})")
            out.append(x)
        check(len(out) > 0, "no class labels given")
        return out

    def condition_rows(self, labels=None, prompts=None, use_cfg=True, clean_captions=True):
        """-> (cond rows [rows, ...], key mask [rows, cls] or None): cond rows then uncond rows."""
        if labels is not None:
            lab = torch.tensor(labels, dtype=torch.long, device=self.device)
            if use_cfg:
                lab = torch.cat([lab, torch.full_like(lab, self.gpt.null_class)])
            return lab, None
        check(prompts is not None and len(prompts) > 0, "give class labels or prompts")
        check(self.config.model_type == "t2i", "this model is class-conditional: pass class labels, not prompts")
        if hasattr(self.gpt, "condition_rows"):  # a Hugging Face family: prompt token ids + its own CFG row
            return self.gpt.condition_rows(list(prompts), use_cfg, self.device)
        check(self.caption_encoder is not None, "text-conditional generation needs a T5 encoder (--t5-path)")
        emb, mask = self.caption_encoder.encode(list(prompts), clean=clean_captions)
        emb = emb.to(self.device, self.dtype)
        mask = mask.to(self.device)
        if use_cfg:
            unc = self.gpt.cls_embedding.uncond_embedding.to(emb.dtype)[None].expand_as(emb)
            emb = torch.cat([emb, unc])
            mask = torch.cat([mask, mask])
        return emb, mask

    # --- generation ---------------------------------------------------------------------------
    def image_batch(self, specs: Sequence[ImageSpec], pad_to: int, scope: SamplingScope,
                    clean_captions: bool = True):
        """The ``DecodeBatch`` of ``specs`` (a decoder's start or an admission), padded to ``pad_to`` rows
        by repeating the first image; each row carries its own seed, image index and (unless ``scope``
        is one setting) sampling settings."""
        from .methods.common import DecodeBatch
        from .rng import CounterRNG

        pick = list(specs) + [specs[0]] * (pad_to - len(specs))
        by_label = pick[0].label is not None
        cond, key_mask = self.condition_rows([x.label for x in pick] if by_label else None,
                                             None if by_label else [x.prompt for x in pick], scope.use_cfg,
                                             clean_captions)
        index = torch.tensor([x.index for x in pick], dtype=torch.long, device=self.device)
        rng = CounterRNG([x.seed for x in pick], index)
        rows = None if scope.uniform is not None else RowSettings.of([x.sampling for x in pick], self.device)
        return DecodeBatch(cond, key_mask, rng, len(specs), rows)

    def decoder_for(self, method: str, method_opts: dict, scope: SamplingScope):
        """(make_decoder(batch) -> a prefilled decoder of ``runtime.loop``, the method's resolved options)."""
        from .methods import get_method

        make, opts = get_method(method, self, dict(method_opts))
        return (lambda batch: make(self, batch, scope, opts)), opts

    @_deterministic_per_call
    def generate(self, class_labels: Optional[Sequence[int]] = None, prompts: Optional[Sequence[str]] = None,
                 method: str = "ar", temperature=1.0, top_k=0, top_p=1.0, cfg_scale=4.0, seed=0,
                 decode_images: bool = True, progress: bool = False,
                 batch_size: int = 16, image_indices: Optional[Sequence[int]] = None,
                 cuda_graphs: Optional[bool] = None, clean_captions: bool = True, compile: Optional[bool] = None,
                 static_batches: bool = False, on_images=None, on_partial=None, partial_images: int = 0,
                 partial_every: Optional[int] = None, preset: Optional[str] = None,
                 **method_opts) -> GenerationOutput:
        """Generate one image per label (or prompt), ``batch_size`` images in flight. Returns tokens,
        PIL images (when a tokenizer is loaded) and stats. Image i draws its random numbers from
        (seed, ``image_indices[i]``) (default i), so its tokens do not depend on the batch size, on
        when it was admitted or on the other images in flight (exactly so in fp64; in fp32 another
        batch composition can round a matmul differently and flip a near-tie: docs/batching.md).
        ``clean_captions``: clean prompts as LlamaGen does before T5
        (``models.t5.clean_caption``). ``method_opts`` are the method's options (see
        ``vvs_engine.methods``). ``compile``: the decode rounds compiled by torch.compile (Inductor; None
        = on for CUDA, off on the CPU; see docs/compile.md); ``stats["compiled"]`` says, per round kind,
        whether it ran compiled (a round that fails to compile warns and runs eagerly). ``cuda_graphs``:
        each round kind captured as a CUDA graph (None = on for CUDA; never off CUDA). Continuous
        batching: a finished image's rows are given to the next pending image between rounds;
        ``static_batches=True`` decodes ``batch_size`` images at a time to the end instead (for
        comparison; the same tokens, to the extent just said). ``seed``, ``temperature``, ``top_k``,
        ``top_p`` and ``cfg_scale`` take one value for every image or a list with one per image: images
        with different settings share the batch, each decoded as it would be alone. ``on_images(k)``: called
        as k more images finish. ``deterministic``: batch-invariant decoding for this call (None: the
        engine's setting, :meth:`set_deterministic`).

        The engine keeps one decode core per (method, options, sampling scope, compile, CUDA graphs):
        decoders and their compiled, captured rounds are built at the first call that needs them and reused
        by every later one (``stats["graph_captures"]`` and ``stats["compiles"]`` count what this call built).

        Partial images: ``partial_images`` (0-3, evenly spaced) or ``partial_every`` (every K rows of the
        token grid) with ``on_partial(p)``, ``p`` a :class:`PartialImage` (image ``p.image_index``'s partial
        ``p.partial_index``: its tokens, which of them are final, and ``p.image``, the VQ decode with the
        pixels of positions not yet final grey), called from an output thread in order; all are delivered
        before ``generate`` returns. Partials add no round.

        ``preset``: ``exact``, ``near-lossless`` or ``fastest`` instead of ``method`` and its options: the
        fastest committed setting of that level of fidelity for this target's grid (``vvs_engine.presets``)."""
        from .methods import get_method

        if preset is not None:
            from .presets import resolve_preset

            check(method == "ar" and not method_opts, "give preset or method and its options, not both")
            method, method_opts = resolve_preset(preset, self.tokens_per_image)
        from .methods.common import retire_finished
        from .runtime import loop

        for name, value in (("temperature", temperature), ("top-k", top_k), ("top-p", top_p), ("cfg-scale", cfg_scale),
                            ("seed", seed)):  # the scalars checked before anything else, as always
            for x in (value if isinstance(value, (list, tuple)) else [value]):
                check_seed(x) if name == "seed" else SamplingParams(**{name.replace("-", "_"): x}).validate()
        make_method, opts = get_method(method, self, method_opts)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise VVSError(f"batch-size must be an integer >= 1, got {batch_size!r}")
        if class_labels is not None and prompts is not None:
            raise VVSError("give either class_labels or prompts, not both")
        labels = self.check_labels(class_labels) if class_labels is not None else None
        if labels is None and prompts is None:
            raise VVSError("give class labels or prompts")
        if prompts is not None and (isinstance(prompts, str) or not all(isinstance(x, str) for x in prompts)):
            raise VVSError("prompts must be a list of strings (one image each), e.g. [\"a cat\"]")
        n = len(labels) if labels is not None else len(prompts)
        check(n > 0, "no prompts given")
        settings = [SamplingParams(*values) for values in zip(
            _per_image("temperature", temperature, n), _per_image("top-k", top_k, n),
            _per_image("top-p", top_p, n), _per_image("cfg-scale", cfg_scale, n))]
        seeds = _per_image("seed", seed, n)
        scope = SamplingScope.of(settings)
        params = settings[0]

        def make_decoder(batch):
            return make_method(self, batch, scope, opts)

        # Before any compute: options the model and image allow, and a batch the device can hold.
        check_method_fits(self.shape, opts)
        check_batch_fits(self.shape, opts, n, batch_size, scope.use_cfg, self.device, self.dtype)

        if image_indices is None:
            image_indices = list(range(n))
        check(len(image_indices) == n, f"image_indices has {len(image_indices)} entries for {n} images")
        for idx in image_indices:
            check(isinstance(idx, numbers.Integral) and not isinstance(idx, bool) and 0 <= idx < 2 ** 62,
                  f"image indices must be non-negative integers, got {idx!r}")
        image_indices = [int(i) for i in image_indices]
        t0 = time.perf_counter()
        config = self.run_config(compile, cuda_graphs)
        compile, use_graphs = config.compile, config.cuda_graphs
        bar = _progress_bar(n, progress, method, self.tokens_per_image)

        specs = [ImageSpec(labels[i] if labels is not None else None, prompts[i] if labels is None else None,
                           seeds[i], image_indices[i], settings[i]) for i in range(n)]

        def batch_of(images, pad_to):
            """The DecodeBatch of images (positions in this call's lists), padded by repeating the first."""
            return self.image_batch([specs[i] for i in images], pad_to, scope, clean_captions)

        core = self.core(method, opts, scope, config, make_decoder)
        source, output = self._partial_source(n, on_partial, partial_images, partial_every)
        try:
            with torch.inference_mode():  # the one loop (runtime.loop): every method is a decoder on it
                out = loop.run(make_decoder, batch_of, n, min(batch_size, n),
                               self.tokens_per_image, static=static_batches, compile=compile, use_graphs=use_graphs,
                               retire=retire_finished(), on_tokens=bar.tokens if bar is not None else None,
                               on_images=_both(bar.images if bar is not None else None, on_images), core=core,
                               source=source)
        finally:
            if output is not None:
                output.close()  # every partial delivered (or its error raised below)
        if output is not None and output.errors:
            raise output.errors[0]
        if bar is not None:
            bar.close()
        tokens = out.tokens
        from .kernels.bounds import raise_if_set

        raise_if_set(self.device, f"{method} generation")  # bad indices met by a compiled kernel
        wall = time.perf_counter() - t0
        stats = {"method": method, "n_images": n, "tokens_per_image": self.tokens_per_image,
                 "batch_size": batch_size, "static_batches": bool(static_batches), **out.stats}
        stats["tokens_generated"] = n * self.tokens_per_image
        f = stats["target_forward_passes"]
        stats["tpf"] = stats["tokens_generated"] / f if f else float("inf")
        all_passes = out.counters["passes"].double()
        per_image = self.tokens_per_image / all_passes.clamp(min=1e-9)  # TPF of each image
        stats["tpf_per_image"] = {"min": float(per_image.min()), "median": float(per_image.median()),
                                  "max": float(per_image.max())}
        stats["wall_time_s"] = wall
        stats["per_image"] = {"target_forward_passes": [int(x) if float(x).is_integer() else float(x)
                                                        for x in all_passes.tolist()]}
        from dataclasses import asdict, is_dataclass

        # the method's options, defaults filled in, as the core's decoders were built with them (a method may
        # fill defaults in at build time; a kept core was built by an earlier call's options object)
        used = core.options if core.options is not None else opts
        stats["options"] = asdict(used) if is_dataclass(used) else {}
        stats["sampling"] = (params.to_dict() if scope.uniform is not None
                             else {"per_image": [x.to_dict() for x in settings]})
        stats["seed"] = seed if not isinstance(seed, (list, tuple)) else list(seeds)
        stats["device"], stats["dtype"] = str(self.device), str(self.dtype).replace("torch.", "")
        stats["quantize"] = self.quantization
        from .kernels.flash import describe

        # prompts are the conditions that carry a caption key mask
        stats["attention_backend"] = describe(self.device, self.dtype, self.gpt.config.head_dim, prompts is not None)
        images = []
        if decode_images and self.vq is not None and getattr(self.vq, "can_decode", True):
            from .measure.profiling import nvtx_range

            with nvtx_range("vq_decode"):
                images = self.decode_images(tokens)
        return GenerationOutput(tokens, labels, list(prompts) if prompts is not None else None, images, stats)

    def clear_cores(self) -> None:
        """Drop every kept decoder (their caches and captured graphs): memory back; the next call rebuilds."""
        self._cores = {}

    def run_config(self, compile: Optional[bool] = None, cuda_graphs: Optional[bool] = None) -> "RunConfig":
        """Compile and CUDA graphs as this engine runs them (None: the device's default), resolved here
        for the API, the CLI, ``generate-dataset``, the server and its Ray replicas alike."""
        return RunConfig.resolve(self.device, compile, cuda_graphs)

    def core(self, method: str, opts, scope: SamplingScope, config: "RunConfig", make_decoder):
        """The persistent decode core of (method, options, sampling scope, run config): built once, kept
        (``runtime.core``); ``make_decoder(batch)`` builds its decoders."""
        from .runtime.core import DecodeCore

        # the batch-invariant mode is part of the key: a captured graph replays the kernels of the mode it
        # was captured in (on CUDA the invariant matmul and attention), so each mode keeps its own decoders
        key = (method, repr(opts), repr(scope), config, self.deterministic)
        if key not in self._cores:
            self._cores[key] = DecodeCore(make_decoder, config.compile, config.cuda_graphs)
            self._cores[key].options = opts
        return self._cores[key]

    def _partial_source(self, n: int, on_partial, count: int, every: Optional[int]):
        """The loop's image source for one call and, when partial images are asked for, the output thread
        that decodes them (VQ decode off the loop's thread)."""
        from .runtime.loop import FixedImages, partial_points

        for name, value in (("partial_images", count), ("partial_every", every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise VVSError(f"{name} must be a non-negative integer, got {value!r}")
        check(count <= 3, f"partial_images must be 0 to 3 (OpenAI's range), got {count}")
        check(not (count and every), "give partial_images or partial_every, not both")
        if not (count or every):
            return FixedImages(n), None
        check(on_partial is not None, "partial images need on_partial (it receives each PartialImage)")
        check(self.vq is not None and getattr(self.vq, "can_decode", True), "partial images need a VQ decoder")
        T = self.tokens_per_image
        side = self.partial_grid()[0]
        points = (partial_points(count, T) if count
                  else [k * T // side for k in range(every, side, every)] if every else [])
        from .runtime.output import OutputWorker

        output = OutputWorker("vvs-output", context=torch.inference_mode)

        def decode(image, index, tokens, committed):
            on_partial(PartialImage(image, index, tokens, committed, self.partial_image(tokens, committed)))

        # the loop thread only hands the tokens over; the VQ decode runs on the output thread, in order
        source = FixedImages(n, lambda image: points,
                             lambda *args: output.submit(lambda: decode(*args)))
        return source, output

    def partial_grid(self):
        """(token rows, codes per row, tokens per row) of an image as the methods lay it out."""
        cfg, T = self.config, self.tokens_per_image
        grid_h, grid_w = getattr(cfg, "grid_h", None), getattr(cfg, "grid_w", None)
        if grid_h is not None and grid_w is not None and grid_h * (grid_w + 1) == T:
            return int(grid_h), int(grid_w), int(grid_w) + 1
        import math

        side = math.isqrt(T)
        return (side, side, side) if side * side == T else (1, T, T)

    @torch.inference_mode()
    def partial_image(self, tokens: torch.Tensor, committed: torch.Tensor):
        """A partial image: the VQ decode of ``tokens`` [T] with the pixels of uncommitted positions grey."""
        from PIL import Image

        picture = to_uint8(self.vq.decode(tokens[None].long().to(self.device)))[0].clone()  # [H, W, 3]
        rows, codes, per_row = self.partial_grid()
        mask = committed.reshape(rows, per_row)[:, :codes].float()[None, None]
        H, W = picture.shape[:2]
        pixels = torch.nn.functional.interpolate(mask, size=(H, W), mode="nearest")[0, 0].bool()
        picture[~pixels] = 128
        return Image.fromarray(picture.numpy())

    def session(self, cond, key_mask, n, params, extra_slots=0) -> TargetSession:
        return TargetSession(self.gpt, cond, n, params.use_cfg, key_mask, extra_slots)

    @torch.inference_mode()
    def decode_images(self, tokens: torch.Tensor, batch: int = 16):
        """tokens [n, T] -> list of PIL images (clamped to [-1, 1], mapped to uint8 with rounding)."""
        from PIL import Image

        check(self.vq is not None, "no VQ tokenizer loaded")
        check(getattr(self.vq, "can_decode", True), "this tokenizer has no decoder weights: only tokens can be made")
        tokens = torch.as_tensor(tokens)
        check(not tokens.is_floating_point() and tokens.dim() == 2 and tokens.shape[1] == self.tokens_per_image,
              f"tokens must be integers [n, {self.tokens_per_image}], got {tuple(tokens.shape)} {tokens.dtype}")
        tokens = tokens.long()
        # the methods' vocabulary (a family's end-of-line index included), which the decoder reads
        limit = min(self.vq.config.codebook_size, self.config.vocab_size)
        check(tokens.numel() == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < limit),
              f"token ids must lie in [0, {limit}) (the tokenizer's codebook)")
        if self.deterministic:  # a convolution's bits depend on the batch: one image at a time
            batch = 1
        out = []
        for i in range(0, tokens.shape[0], batch):
            imgs = to_uint8(self.vq.decode(tokens[i:i + batch].to(self.device)))
            out += [Image.fromarray(x.numpy()) for x in imgs]
        return out

    @torch.inference_mode()
    def score(self, class_labels=None, prompts=None, tokens=None, cfg_scale: float = 1.0) -> torch.Tensor:
        """Teacher-forced next-token logits ``[n, T, V]`` for given conditions and tokens [n, T]:
        row t is the (CFG-combined when cfg_scale != 1) logit vector predicting tokens[:, t]."""
        check(tokens is not None, "score() needs tokens")
        SamplingParams(cfg_scale=cfg_scale).validate()  # a finite guidance scale
        check(class_labels is None or prompts is None, "give either class_labels or prompts, not both")
        tokens = torch.as_tensor(tokens)
        check(not tokens.is_floating_point(), f"tokens must be integer ids, got {tokens.dtype}")
        tokens = tokens.to(dtype=torch.long, device=self.device)
        check(tokens.dim() == 2 and tokens.shape[1] <= self.tokens_per_image,
              f"tokens must be [n, <= {self.tokens_per_image}]")
        check(0 <= int(tokens.min()) and int(tokens.max()) < self.config.vocab_size, "token ids out of range")
        labels = self.check_labels(class_labels) if class_labels is not None else None
        use_cfg = cfg_scale != 1.0
        cond, key_mask = self.condition_rows(labels, prompts, use_cfg)
        check(cond.shape[0] // (2 if use_cfg else 1) == tokens.shape[0], "one condition per token row")
        toks = torch.cat([tokens, tokens]) if use_cfg else tokens
        c = self.config.cls_token_num
        x = (torch.cat([self.gpt.embed_condition(cond), self.gpt.embed_tokens(toks[:, :-1])], 1)
             if toks.shape[1] > 1 else self.gpt.embed_condition(cond))
        L = x.shape[1]
        vis = torch.ones(L, L, dtype=torch.bool, device=self.device).tril()[None].expand(x.shape[0], L, L).clone()
        if key_mask is not None:
            vis[:, :, :c] &= key_mask[:, None, :].bool()
            vis |= torch.eye(L, dtype=torch.bool, device=self.device)[None]
        h = self.gpt.forward_hidden(x, torch.arange(L, device=self.device), mask=vis.unsqueeze(1))
        logits = self.gpt.logits(h[:, c - 1:])
        if use_cfg:
            from .sampling import cfg_combine

            logits = cfg_combine(logits, cfg_scale)
        return logits

    def codebook_vectors(self) -> torch.Tensor:
        check(self.vq is not None, "this needs the VQ tokenizer (for codebook vectors); load one with --vq-ckpt")
        return self.vq.codebook_vectors().to(self.device)

    def codebook_neighbors(self, k: int) -> torch.Tensor:
        """``[codebook, k]`` nearest other codes (L2 in the codebook space), for LANTERN; cached."""
        if k not in self._codebook_cache:
            from .acceptance.verify import neighbor_table

            self._codebook_cache[k] = neighbor_table(self.codebook_vectors(), k)
        return self._codebook_cache[k]


# --- what a generation needs: option bounds and a memory estimate, checked before any compute --------
@dataclass
class ModelShape:
    """The sizes of a target that bound the method options and the memory of a decode."""

    tokens_per_image: int
    vocab_size: int  # the methods' vocabulary
    codebook_size: Optional[int]  # VQ codebook vectors (LANTERN neighbourhoods); None without a tokenizer
    cls_token_num: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    dim: int

    @classmethod
    def of(cls, config, vq=None) -> "ModelShape":
        book = getattr(getattr(vq, "config", None), "codebook_size", None) if vq is not None else None
        return cls(config.block_size, config.vocab_size, book, config.cls_token_num, config.n_layer, config.n_head,
                   getattr(config, "n_kv_head", config.n_head), config.head_dim, config.dim)


def peek_shape(gpt_ckpt: Optional[str] = None, vq_ckpt: Optional[str] = None) -> Optional[ModelShape]:
    """The shape of a project checkpoint (the Zoo's when none is given) from its JSON config, without
    reading the weights; None where only loading tells (official files, Hugging Face folders)."""
    if gpt_ckpt is None:
        from . import zoo

        paths = zoo.default_paths()
        gpt_ckpt, vq_ckpt = paths["gpt"], vq_ckpt or paths["vq"]
    # a config of the wrong kind or shape is an error here already, before any weights are read
    config = read_project_config(gpt_ckpt, "gpt")
    if config is None:
        return None
    cfg = checked_gpt_config(config, f"config {config_path(gpt_ckpt)}")
    vq_config = read_project_config(vq_ckpt, "vq") if vq_ckpt else None
    book = checked_vq_config(vq_config, f"config {config_path(vq_ckpt)}").codebook_size if vq_config else None
    return ModelShape(cfg.block_size, cfg.vocab_size, book, cfg.cls_token_num, cfg.n_layer, cfg.n_head, cfg.n_head,
                      cfg.head_dim, cfg.dim)


def check_method_fits(shape: ModelShape, opts) -> None:
    """Method options bounded by the model and the image, checked by the options class itself
    (``MethodOptions.check_fits``); messages use the option names (the CLI maps them to flags)."""
    if opts is not None:
        opts.check_fits(shape)


def decode_bytes(shape: ModelShape, opts, batch: int, use_cfg: bool, dtype) -> int:
    """A rough upper estimate of the memory one decode batch needs beyond the weights: the static KV
    caches (target and drafter), the logits of one verification forward (fp32, a few working copies),
    its attention scores and masks, and LANTERN's neighbour table."""
    elt = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
    from .runtime.loop import batch_bucket

    rows = batch_bucket(batch) * (2 if use_cfg else 1)  # at most: the rows in flight, or a padded static batch
    T, V = shape.tokens_per_image, shape.vocab_size
    queries, extra, drafter = opts.decode_shape(shape) if opts is not None else (1, 8, False)
    slots = shape.cls_token_num + T + extra
    kv = 2 * shape.n_layer * rows * slots * shape.n_kv_head * shape.head_dim * elt
    if drafter:
        kv += 2 * rows * slots * shape.n_head * shape.head_dim * elt
    logits = 4 * rows * queries * V * 4
    scores = 2 * rows * shape.n_head * queries * slots * 4 + rows * queries * slots
    hidden = 8 * rows * queries * shape.dim * 4
    k = (opts.lantern_k if drafter else None) or (V // 16 if drafter else 0)
    neighbours = (shape.codebook_size or V) * (k * 8 + (shape.codebook_size or V) * 4) if drafter else 0
    return kv + logits + scores + hidden + neighbours


def available_bytes(device) -> Optional[int]:
    """Free memory of the device (CUDA: the driver's figure; CPU: MemAvailable), None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_batch_fits(shape: ModelShape, opts, n_images: int, batch_size: int, use_cfg: bool, device, dtype) -> None:
    """Refuse, in one line and before any compute, a batch whose decode state cannot fit the device."""
    batch = min(batch_size, n_images)
    free = available_bytes(device)
    if free is None:
        return
    need = decode_bytes(shape, opts, batch, use_cfg, dtype)
    if need <= free:
        return
    fits = batch
    while fits > 1 and decode_bytes(shape, opts, fits, use_cfg, dtype) > free:
        fits //= 2
    hint = (f"use batch-size <= {fits}" if decode_bytes(shape, opts, fits, use_cfg, dtype) <= free
            else "even one image does not fit: use a smaller tree or window")
    raise VVSError(f"a batch of {batch} images needs about {need / 2 ** 30:.1f} GiB for its decode state (KV cache, "
                   f"logits) but the {torch.device(device).type.upper()} has {free / 2 ** 30:.1f} GiB free; {hint}")


def rows_that_fit(shape: ModelShape, opts, use_cfg: bool, device, dtype, cap: int = AUTO_ROWS_CAP,
                  free: Optional[int] = None, flag: str = "--rows") -> int:
    """``auto`` rows: the most images in flight (a power of two, as the loop pads to, at most ``cap``) whose
    decode state (``decode_bytes``: KV cache, logits, attention scores; the memory table's model) fits the
    device's free memory less ``AUTO_ROWS_SLACK``. Called with the weights loaded, so the free figure
    (CUDA: the driver's; CPU: MemAvailable) has them counted already. One-line error when the free memory
    is unknown or not even one image fits."""
    free = available_bytes(device) if free is None else free
    if free is None:
        raise VVSError(f"{flag} auto needs the {torch.device(device).type.upper()}'s free memory, which cannot be "
                       f"read here: give a number")
    room = free - AUTO_ROWS_SLACK
    n = 1
    while n * 2 <= AUTO_ROWS_CAP and decode_bytes(shape, opts, n * 2, use_cfg, dtype) <= room:
        n *= 2
    if decode_bytes(shape, opts, n, use_cfg, dtype) > room:
        raise VVSError(f"{flag} auto: one image needs about {decode_bytes(shape, opts, 1, use_cfg, dtype) / 2 ** 30:.1f} "
                       f"GiB for its decode state but the {torch.device(device).type.upper()} has "
                       f"{free / 2 ** 30:.1f} GiB free ({AUTO_ROWS_SLACK / 2 ** 30:.0f} GiB kept as slack)")
    return max(1, min(n, cap))


# --- batching -----------------------------------------------------------------------------------
class _progress_bar:
    """Images finished, and the tokens committed over all images, on one tqdm bar."""

    def __new__(cls, n, show, method, tokens_per_image):
        if not show:
            return None
        return super().__new__(cls)

    def __init__(self, n, show, method, tokens_per_image):
        from tqdm import tqdm

        self.bar = tqdm(total=n, desc=f"{method} images", unit="img", dynamic_ncols=True, leave=False)
        self.token_count, self.total_tokens = 0, n * tokens_per_image

    def tokens(self, k: int) -> None:
        # The total is the ceiling (a guard: the methods' own counts add up to it exactly).
        self.token_count = min(self.total_tokens, self.token_count + int(k))
        self.bar.set_postfix(tokens=f"{self.token_count}/{self.total_tokens}", refresh=False)

    def images(self, k: int) -> None:
        self.bar.update(k)

    def close(self) -> None:
        self.bar.close()


# --- model loading --------------------------------------------------------------------------------
def load_vq(path: str, preset: str = "VQ-16") -> VQModel:
    config = read_project_config(path, "vq")
    sd = read_state_dict(path)
    if config is not None:
        cfg = checked_vq_config(config, f"config {config_path(path)}", sd)
    else:
        if preset not in VQ_PRESETS:
            raise VVSError(f"unknown tokenizer '{preset}'; known: {', '.join(VQ_PRESETS)}")
        cfg = VQConfig(**VQ_PRESETS[preset])
        w = sd.get("quantize.embedding.weight")
        if w is None:
            raise VVSError(f"VQ checkpoint {path}: missing keys quantize.embedding.weight")
        cfg.codebook_size, cfg.codebook_embed_dim = int(w.shape[0]), int(w.shape[1])
    vq = VQModel(cfg)
    load_into(vq, sd, f"VQ checkpoint {path}", optional=("quantize.codebook_used",))
    return vq.eval()


def load_gpt(path: str, preset: Optional[str], image_size: Optional[int], vq: Optional[VQModel]) -> GPT:
    config = read_project_config(path, "gpt")
    sd = read_state_dict(path)
    if config is not None:
        cfg = checked_gpt_config(config, f"config {config_path(path)}", sd)
        if image_size is not None and vq is not None:
            _check_image_size(image_size, vq)
            want = (image_size // vq.downsample) ** 2
            check(want == cfg.block_size, f"image size {image_size} gives {want} tokens but the model was "
                                          f"trained for {cfg.block_size}")
    else:
        if preset is None:
            raise VVSError(f"{path} has no config file next to it: pass --gpt-model (e.g. GPT-B)")
        ds = vq.downsample if vq is not None else 16
        image_size = image_size or 256
        _check_image_size(image_size, vq)
        t2i = any(k.startswith("cls_embedding.cap_proj") for k in sd)
        over = {"model_type": "t2i" if t2i else "c2i", "block_size": (image_size // ds) ** 2}
        if "tok_embeddings.weight" in sd:
            over["vocab_size"] = int(sd["tok_embeddings.weight"].shape[0])
        if not t2i and "cls_embedding.embedding_table.weight" in sd:
            over["num_classes"] = int(sd["cls_embedding.embedding_table.weight"].shape[0]) - 1
        if t2i and "cls_embedding.uncond_embedding" in sd:
            u = sd["cls_embedding.uncond_embedding"]
            over["cls_token_num"], over["caption_dim"] = int(u.shape[0]), int(u.shape[1])
        cfg = gpt_config(preset, **over)
    if vq is not None:
        if cfg.vocab_size != vq.config.codebook_size:
            raise VVSError(f"model vocabulary {cfg.vocab_size} != tokenizer codebook {vq.config.codebook_size}")
    gpt = GPT(cfg)
    load_into(gpt, sd, f"GPT checkpoint {path}")
    return gpt.eval()


def _check_image_size(image_size, vq):
    ds = vq.downsample if vq is not None else 16
    if not isinstance(image_size, int) or image_size <= 0 or image_size % ds:
        raise VVSError(f"image size {image_size} is not a positive multiple of the tokenizer's downsampling ({ds})")
