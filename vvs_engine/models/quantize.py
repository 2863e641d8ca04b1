"""Weight-only quantization of a target and its drafter through torchao, applied once at load.

Why: a 7-8B family (Janus-Pro-7B, Lumina-mGPT-7B, Emu3-Gen-8B) holds 14-16 GB of bf16 weights before its
KV cache; int8 weights halve that, int4 quarters it, so the model fits a 12-24 GB card. Only the linear
layers' weights are quantized (they are almost all of a decoder's bytes); activations, the KV cache,
embeddings, norms and the VQ decoder keep the model's dtype. Every forward dequantizes inside the
matmul, so the engine, the methods and the compiled rounds see ordinary modules.

Modes (``QUANTIZE_MODES``), and where torchao 0.18 runs them:

* ``int8``: torchao's ``Int8WeightOnlyConfig`` (int8 per output row, a scale per row). CPU and CUDA.
* ``fp8``: ``Float8WeightOnlyConfig`` (e4m3, a scale per row). On the CPU torchao runs it as an upcast
  before the matmul (fewer weight bytes, no speed); on CUDA its kernels need compute capability >= 8.9
  (Ada, Hopper), refused below.
* ``int4``: ``Int4WeightOnlyConfig`` with the tile-packed (tinygemm) layout, groups of 128 (or 64/32 where
  a layer's input width needs it): CUDA and bf16 only. torchao's int4 layouts that run on a CPU are
  either unpacked (one byte per value: no saving over int8) or need an Arm/KleidiAI build, so int4 is
  refused on the CPU.

Quantized weights compute in fp32, bf16 or fp16; fp64 (the engine's no-rounding reference mode) is
refused: torchao's int8 matmul has no fp64 path and the point of fp64 is to have no rounding anyway.
A layer whose weight is read as a matrix instead of called (Chameleon's text head, whose image rows
are picked with ``index_select``: :data:`KEEP_FULL`) keeps its dtype.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterable, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import VVSError

QUANTIZE_MODES = ("none", "int8", "fp8", "int4")
TORCHAO_PIN = "torchao>=0.18,<0.19"  # the version tested with torch 2.13 (setup.py's [quantize] extra)
INT4_GROUPS = (128, 64, 32)  # int4 group sizes, largest first: a layer takes the largest its width allows
FP8_MIN_CAPABILITY = (8, 9)

# Linear layers read as weight matrices rather than called: quantized tensors do not support every op
# (torchao 0.18's Int8Tensor has no index_select), so these keep the model's dtype. Keyed by class name
# (subclasses included).
KEEP_FULL = {"ChameleonTarget": ("lm_head",)}


def check_quantize(mode, device=None, dtype=None, flag: str = "quantize") -> str:
    """``mode`` ("none"/None or a quantization) checked against the device and dtype before any weights
    are read: -> the mode ("none" when off). One-line ``VVSError`` otherwise."""
    if mode is None or mode == "none":
        return "none"
    if mode not in QUANTIZE_MODES:
        raise VVSError(f"unknown {flag} '{mode}'; use {', '.join(QUANTIZE_MODES)}")
    if dtype is not None and dtype == torch.float64:
        raise VVSError(f"{flag} {mode} computes in fp32, bf16 or fp16, not fp64 (fp64 is the unrounded reference "
                       f"mode): drop one of them")
    device = torch.device(device) if device is not None else None
    if mode == "int4":
        if device is None or device.type != "cuda":
            raise VVSError(f"{flag} int4 needs a CUDA GPU (torchao's packed int4 kernels are CUDA-only; on the CPU "
                           f"use int8 or fp8)")
        if dtype is not None and dtype != torch.bfloat16:
            raise VVSError(f"{flag} int4 needs dtype bf16 (torchao's int4 kernels take bf16 activations)")
    if mode == "fp8" and device is not None and device.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < FP8_MIN_CAPABILITY:
            raise VVSError(f"{flag} fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper); this one is "
                           f"{cap[0]}.{cap[1]} (use int8)")
    _torchao()
    return mode


@contextlib.contextmanager
def _quiet():
    """torchao logs a line for each CUDA extension it cannot load (none exist on a CPU build) and warns that
    its tensor subclasses lack a cache hash under torch.compile: noise for a user, not errors."""
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
            warnings.filterwarnings("ignore", message=".*register_constant.*")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _torchao():
    try:
        with _quiet():
            import torchao.quantization as q
    except ImportError:
        raise VVSError(f"quantized weights need torchao: pip install 'vvs-engine[quantize]' ({TORCHAO_PIN})") from None
    return q


def _config(mode: str, group: Optional[int] = None):
    q = _torchao()
    if mode == "int8":
        return q.Int8WeightOnlyConfig()
    if mode == "fp8":
        return q.Float8WeightOnlyConfig()
    if mode == "int4":
        return q.Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d")
    raise VVSError(f"unknown quantization '{mode}'")


def _linear_layers(module: nn.Module, keep: Iterable[str] = ()) -> list:
    """(name, layer) of the ``nn.Linear`` layers to quantize: every one except ``keep`` and the layers
    :data:`KEEP_FULL` names for a class in ``module``."""
    skip = set(keep)
    for name, sub in module.named_modules():
        for cls in type(sub).__mro__:  # subclasses too (Emu3Target is a ChameleonTarget)
            for attr in KEEP_FULL.get(cls.__name__, ()):
                skip.add(f"{name}.{attr}" if name else attr)
    return [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear) and name not in skip]


def quantize_module(module: nn.Module, mode: str, device=None, keep: Iterable[str] = ()) -> int:
    """Quantize ``module``'s linear weights in place (``mode`` from :data:`QUANTIZE_MODES`); with
    ``device``, each layer is moved there just before it is quantized, so a model larger than the device in
    full precision is never there whole. -> the number of layers quantized."""
    if mode == "none":
        return 0
    chosen = _linear_layers(module, keep)
    if mode == "int4":  # the largest group that divides the layer's input width; a layer none divides stays
        by_group = {g: {id(m) for _, m in chosen if m.in_features % g == 0} for g in INT4_GROUPS}
        seen = set()
        for g in INT4_GROUPS:
            by_group[g] -= seen
            seen |= by_group[g]
        plans = [(_config(mode, g), ids) for g, ids in by_group.items() if ids]
    else:
        plans = [(_config(mode), {id(m) for _, m in chosen})]
    q = _torchao()
    # torch.compile warns once per subclass that torchao's tensors lack a cache hash: noise for users
    warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching.*")
    count = 0
    with _quiet():
        for config, ids in plans:
            q.quantize_(module, config, filter_fn=lambda m, fqn, ids=ids: id(m) in ids, device=device)
            count += len(ids)
    return count


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor subclass counts its inner tensors (data, scales, zero points)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters (shared ones once), quantized ones at their stored size."""
    return sum(tensor_bytes(p) for p in module.parameters())


def linear_weight_bytes(module: nn.Module) -> Tuple[int, int]:
    """(bytes of the linear layers' weights, bytes of every other parameter)."""
    lin = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    a = b = 0
    for p in module.parameters():
        if id(p) in lin:
            a += tensor_bytes(p)
        else:
            b += tensor_bytes(p)
    return a, b


def is_quantized(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a torchao quantized tensor."""
    return any(type(p) not in (torch.Tensor, nn.Parameter) and hasattr(p, "__tensor_flatten__")
               for p in module.parameters())
