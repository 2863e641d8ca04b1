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

import torch

from .checkpoint import load_into, read_config, read_state_dict
from .errors import VVSError, check
from .models.gpt import GPT, GPTConfig, gpt_config
from .models.vq import VQ_PRESETS, VQConfig, VQModel, to_uint8
from .sampling import SamplingParams, make_generator
from .runtime.target import TargetSession

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


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


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise VVSError(f"seed must be an integer, got {seed!r}")
    if not -2 ** 63 <= seed < 2 ** 63:
        raise VVSError(f"seed must fit in 64 bits (|seed| < 2**63), got {seed}")
    return seed


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise VVSError(f"unknown dtype '{dtype}'; use fp32, bf16 or fp16")
    return DTYPES[dtype]


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [n_images, tokens_per_image] int64 (CPU)
    labels: Optional[List[int]]
    prompts: Optional[List[str]]
    images: List[Any] = field(default_factory=list)  # PIL images when a tokenizer is loaded
    stats: dict = field(default_factory=dict)


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
        self.cuda_graphs = False

    # --- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, gpt_ckpt: Optional[str] = None, gpt_model: Optional[str] = None, vq_ckpt: Optional[str] = None,
             vq_model: str = "VQ-16", image_size: Optional[int] = None, drafter: Optional[str] = None,
             device="cpu", dtype="fp32", t5_path: Optional[str] = None, model_dir: Optional[str] = None,
             max_prompt_tokens: Optional[int] = None) -> "Engine":
        """Load a target (official LlamaGen file or the project's safetensors), optionally a VQ tokenizer
        and a drafter. With no ``gpt_ckpt`` the shipped Zoo model (target, tokenizer, drafter) is used.
        ``model_dir``: a local Hugging Face folder of another family (Janus-Pro, Lumina-mGPT, Emu3);
        its prompts are left-padded to ``max_prompt_tokens`` (default 128); ``image_size`` (pixels)
        sets the Lumina-mGPT/Emu3 image."""
        device, dtype = resolve_device(device), resolve_dtype(dtype)
        info = {}
        if model_dir is not None:
            from .models.hf_loader import DEFAULT_MAX_PROMPT_TOKENS, load_hf_folder

            target, image_decoder, info = load_hf_folder(model_dir, max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS,
                                                         image_size)
            dr = None
            if drafter:
                from .drafting.drafter import load_drafter

                dr = load_drafter(drafter, target)
            info["drafter"] = drafter
            return cls(target, image_decoder, dr, None, info).to(device, dtype)
        if gpt_ckpt is None and gpt_model is not None:
            raise VVSError("gpt_model names the architecture of a gpt_ckpt file; give the checkpoint too "
                           "(the default Zoo model has its own config)")
        if gpt_ckpt is None:
            from . import zoo

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
        return eng.to(device, dtype)

    def to(self, device, dtype=None) -> "Engine":
        device = resolve_device(device)
        dtype = resolve_dtype(dtype) if dtype is not None else self.dtype
        self.gpt.to(device=device, dtype=dtype)
        if self.vq is not None:
            self.vq.to(device=device)  # the tokenizer stays fp32: decoding is a small share of the work
        if self.drafter is not None:
            self.drafter.to(device=device, dtype=dtype)
        if self.caption_encoder is not None:
            self.caption_encoder.to(device)
        self.device, self.dtype = device, dtype
        self._codebook_cache = {}
        from .runtime.runner import clear_runners

        clear_runners(self.gpt)
        return self

    # --- conditions ---------------------------------------------------------------------------
    @property
    def config(self) -> GPTConfig:
        return self.gpt.config

    @property
    def tokens_per_image(self) -> int:
        return self.config.block_size

    def check_labels(self, labels) -> List[int]:
        check(self.config.model_type == "c2i", "this model is text-conditional: pass prompts, not class labels")
        if isinstance(labels, (int, str)) or not hasattr(labels, "__iter__"):
            raise VVSError(f"class_labels must be a list of integers (one image each), e.g. [3], got {labels!r}")
        out = []
        for x in labels:
            if isinstance(x, bool) or not isinstance(x, int):
                if isinstance(x, str) and x.strip().lstrip("-").isdigit():
                    x = int(x)
                elif isinstance(x, float) and x.is_integer():
                    x = int(x)
                else:
                    raise VVSError(f"class labels must be integers, got {x!r}")
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
    def generate(self, class_labels: Optional[Sequence[int]] = None, prompts: Optional[Sequence[str]] = None,
                 method: str = "ar", temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 cfg_scale: float = 4.0, seed: int = 0, decode_images: bool = True, progress: bool = False,
                 cuda_graphs: Optional[bool] = None, clean_captions: bool = True,
                 image_indices: Optional[Sequence[int]] = None, batch_size: int = 16,
                 **method_opts) -> GenerationOutput:
        """Generate one image per label (or prompt). Returns tokens, PIL images (when a tokenizer is
        loaded) and stats. ``method_opts`` are the method's options (see ``vvs_engine.methods``).
        ``clean_captions``: clean prompts as LlamaGen does before T5 (``models.t5.clean_caption``).
        With ``image_indices`` (global image numbers), image i depends only on (seed, i, its condition),
        not on the batch it is generated in."""
        from .methods import get_method

        if image_indices is not None:
            return generate_by_index(self, class_labels, prompts, seed, image_indices, method=method,
                                     temperature=temperature, top_k=top_k, top_p=top_p, cfg_scale=cfg_scale,
                                     decode_images=decode_images, cuda_graphs=cuda_graphs, clean_captions=clean_captions,
                                     **method_opts)

        params = SamplingParams(temperature, top_k, top_p, cfg_scale).validate()
        run, opts = get_method(method, self, method_opts)
        check_seed(seed)
        labels = self.check_labels(class_labels) if class_labels is not None else None
        if labels is None and prompts is None:
            raise VVSError("give class labels or prompts")
        if prompts is not None and (isinstance(prompts, str) or not all(isinstance(x, str) for x in prompts)):
            raise VVSError("prompts must be a list of strings (one image each), e.g. [\"a cat\"]")

        n = len(labels) if labels is not None else len(prompts)
        gen = make_generator(seed, self.device)
        from .runtime.runner import graphs_default

        # CUDA graphs: on by default on CUDA; on the CPU the same static-buffer path runs eagerly.
        self.cuda_graphs = graphs_default(self.device) if cuda_graphs is None else bool(cuda_graphs)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if getattr(run, "batched", False):  # runners taking a DecodeBatch
                res = self._run_batched(run, labels, prompts, n, params, opts, seed, batch_size, progress,
                                        clean_captions)
            else:
                cond, key_mask = self.condition_rows(labels, prompts, params.use_cfg, clean_captions)
                res = run(self, cond, key_mask, n, params, gen, opts, progress)
            tokens = res.tokens.cpu()  # the one host sync of the whole generation
        from .kernels.bounds import raise_if_set

        raise_if_set(self.device, f"{method} generation")  # bad indices met by a compiled kernel
        wall = time.perf_counter() - t0
        stats = {"method": method, "n_images": n, "tokens_per_image": self.tokens_per_image}
        stats.update(res.stats)
        stats["tokens_generated"] = n * self.tokens_per_image
        f = stats["target_forward_passes"]
        stats["tpf"] = stats["tokens_generated"] / f if f else float("inf")
        stats["wall_time_s"] = wall
        stats["sampling"] = params.to_dict()
        stats["seed"] = seed
        stats["device"], stats["dtype"] = str(self.device), str(self.dtype).replace("torch.", "")
        stats["cuda_graphs"] = self.cuda_graphs
        from .kernels.flash import describe

        # prompts are the conditions that carry a caption key mask
        stats["attention_backend"] = describe(self.device, self.dtype, self.gpt.config.head_dim, prompts is not None)
        images = []
        if decode_images and self.vq is not None and getattr(self.vq, "can_decode", True):
            from .runtime.profiling import nvtx_range

            with nvtx_range("vq_decode"):
                images = self.decode_images(tokens)
        return GenerationOutput(tokens, labels, list(prompts) if prompts is not None else None, images, stats)

    def _run_batched(self, run, labels, prompts, n, params, opts, seed, batch_size, show_progress,
                     clean_captions=True):
        """Batches of ``batch_size`` images; the last is padded to the next power of two (padding
        repeats its last image and is dropped). Random draws are keyed by the global image index."""
        from .methods.common import DecodeBatch, MethodResult, progress
        from .rng import CounterRNG

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise VVSError(f"batch-size must be an integer >= 1, got {batch_size!r}")
        tokens, stats, passes = [], [], []
        for start in progress(range(0, n, batch_size), show_progress, "batches"):
            index = list(range(start, min(start + batch_size, n)))
            n_real = len(index)
            index += index[-1:] * (min(batch_size, 1 << (n_real - 1).bit_length()) - n_real)
            cond, key_mask = self.condition_rows([labels[i] for i in index] if labels is not None else None,
                                                 [prompts[i] for i in index] if prompts is not None else None,
                                                 params.use_cfg, clean_captions)
            rng = CounterRNG(seed, torch.tensor(index, dtype=torch.long, device=self.device))
            res = run(self, DecodeBatch(cond, key_mask, rng, n_real), params, opts)
            tokens.append(res.tokens[:n_real])
            stats.append(res.stats)
            passes.append(res.image_passes[:n_real])
        merge = getattr(run, "merge_stats", None)
        merged = merge(stats) if merge is not None else dict(
            stats[0], target_forward_passes=sum(st["target_forward_passes"] for st in stats))
        tpf = (self.tokens_per_image / torch.cat(passes).double().clamp(min=1)).cpu()
        merged["batch_size"] = batch_size
        merged["tpf_per_image"] = {"min": float(tpf.min()), "median": float(tpf.median()), "max": float(tpf.max())}
        return MethodResult(torch.cat(tokens), merged, torch.cat(passes))

    def session(self, cond, key_mask, n, params, extra_slots=0) -> TargetSession:
        return TargetSession(self.gpt, cond, n, params.use_cfg, key_mask, extra_slots)

    @torch.inference_mode()
    def decode_images(self, tokens: torch.Tensor, batch: int = 16):
        """tokens [n, T] -> list of PIL images (clamped to [-1, 1], mapped to uint8 with rounding)."""
        from PIL import Image

        check(self.vq is not None, "no VQ tokenizer loaded")
        check(int(tokens.max()) < self.vq.config.codebook_size if tokens.numel() else True,
              "token ids exceed the tokenizer's codebook")
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
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        check(tokens.dim() == 2 and tokens.shape[1] <= self.tokens_per_image,
              f"tokens must be [n, <= {self.tokens_per_image}]")
        check(0 <= int(tokens.min()) and int(tokens.max()) < self.config.vocab_size, "token ids out of range")
        labels = self.check_labels(class_labels) if class_labels is not None else None
        use_cfg = cfg_scale != 1.0
        cond, key_mask = self.condition_rows(labels, prompts, use_cfg)
        check(cond.shape[0] // (2 if use_cfg else 1) == tokens.shape[0], "one condition per token row")
        toks = torch.cat([tokens, tokens]) if use_cfg else tokens
        c = self.config.cls_token_num
        x = torch.cat([self.gpt.embed_condition(cond), self.gpt.embed_tokens(toks[:, :-1])], 1) if toks.shape[1] > 1 \
            else self.gpt.embed_condition(cond)
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


# --- batch-invariant generation ----------------------------------------------------------------
def image_seed(seed: int, index: int) -> int:
    """A 63-bit seed for image ``index`` of a run with ``seed`` (splitmix64 of the pair)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def generate_by_index(engine: "Engine", class_labels, prompts, seed, image_indices, **kw) -> GenerationOutput:
    """Image by image, each with its own seed from (seed, index): tokens do not depend on batching.
    Slower than one batch; a batched counter-based version replaces it."""
    from .stats import merge_stats

    n = len(class_labels) if class_labels is not None else len(prompts or [])
    check(n > 0, "give class labels or prompts")
    check(len(image_indices) == n, f"{len(image_indices)} image indices for {n} images")
    check(isinstance(seed, int) and not isinstance(seed, bool), f"seed must be an integer, got {seed!r}")
    outs = []
    for j, idx in enumerate(image_indices):
        check(isinstance(idx, numbers.Integral) and not isinstance(idx, bool) and idx >= 0,
              f"image indices must be non-negative integers, got {idx!r}")
        outs.append(engine.generate(class_labels=None if class_labels is None else [class_labels[j]],
                                    prompts=None if prompts is None else [prompts[j]],
                                    seed=image_seed(seed, idx), **kw))
    stats = merge_stats([o.stats for o in outs])
    stats["seed"] = seed
    stats["per_image"] = {"target_forward_passes": [o.stats["target_forward_passes"] for o in outs],
                          "wall_time_s": [o.stats["wall_time_s"] for o in outs]}
    labels = None if class_labels is None else [x for o in outs for x in o.labels]
    texts = None if prompts is None else [x for o in outs for x in o.prompts]
    return GenerationOutput(torch.cat([o.tokens for o in outs]), labels, texts, [x for o in outs for x in o.images],
                            stats)


# --- model loading --------------------------------------------------------------------------------
def load_vq(path: str, preset: str = "VQ-16") -> VQModel:
    meta = read_config(path)
    sd = read_state_dict(path)
    if meta is not None and meta.get("kind") == "vq":
        cfg = VQConfig.from_dict(meta["config"])
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
    meta = read_config(path)
    sd = read_state_dict(path)
    if meta is not None and meta.get("kind") == "gpt":
        cfg = GPTConfig.from_dict(meta["config"])
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
