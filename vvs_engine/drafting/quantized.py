"""The quant-draft method's draft model: the engine's target, copied and quantized weight-only
(``models/quantize.py``), kept on the engine (``methods/quant_draft.py`` drafts with it)."""
from __future__ import annotations

import copy

import torch

from ..models.quantize import quantize_module


def draft_dtype(dtype: torch.dtype) -> torch.dtype:
    """The copy's dtype: fp64 (the reference mode) has no quantized matmul, so its copy drafts in fp32."""
    return torch.float32 if dtype == torch.float64 else dtype


def quantized_copy(engine, mode: str):
    """The engine's target, copied and quantized weight-only (``mode``): built once per (mode, device,
    dtype) and kept on the engine (a second decode, an admitted batch and a kept decoder reuse it)."""
    key = (mode, str(engine.device), engine.dtype, id(engine.gpt))
    copies = engine.__dict__.setdefault("_quantized_copies", {})
    if key not in copies:
        copies.clear()  # a copy of an older device/dtype is of no further use
        model = copy.deepcopy(engine.gpt).to(dtype=draft_dtype(engine.dtype))
        quantize_module(model, mode)
        copies[key] = model.eval()
    return copies[key]
