"""Safe checkpoint loading and saving.

Official LlamaGen files are ``torch.save`` pickles: ``{"model": sd, "optimizer": ..., "args": Namespace}``
(DDP), ``{"module": sd}`` (DeepSpeed), ``{"state_dict": sd}`` or a raw state_dict (FSDP
``consolidated.pth``). We load them with ``torch.load(weights_only=True)`` and allow-list only
``argparse.Namespace`` (the one non-tensor class those containers carry), so no arbitrary code is ever
unpickled. The project's own checkpoints are safetensors plus a JSON config.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import zipfile
from typing import Dict

import torch

from .errors import VVSError

_CONTAINER_KEYS = ("model", "module", "state_dict")
# Keys that appear in state_dicts saved after setup_caches() or by some converters; never weights.
_IGNORED_SUFFIXES = (".kv_cache.k_cache", ".kv_cache.v_cache", "freqs_cis", "causal_mask")


def read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """Read a checkpoint file into a flat ``{name: tensor}`` dict, or raise a one-line VVSError."""
    if not path or not os.path.exists(path):
        raise VVSError(f"checkpoint not found: {path}")
    if os.path.isdir(path):
        raise VVSError(f"checkpoint path is a directory, expected a file: {path}")
    if os.path.getsize(path) == 0:
        raise VVSError(f"checkpoint is empty: {path}")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(path))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise VVSError(f"not a readable safetensors file: {path} ({_first_line(e)})") from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError,
            AttributeError, TypeError, KeyError, IndexError, MemoryError, OverflowError) as e:
        # torch wraps the refusal in a multi-line message; the class it refused is on a later line.
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if refused:
            raise VVSError(f"refusing to unpickle {path}: it contains objects other than tensors "
                           f"({refused.group(1)})") from None
        raise VVSError(f"not a readable checkpoint (truncated or not a torch file): {path}") from None
    if isinstance(obj, dict):
        for k in _CONTAINER_KEYS:
            if k in obj and isinstance(obj[k], dict):
                obj = obj[k]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise VVSError(f"{path} holds no state_dict (expected a dict of tensors, or one under "
                       f"'model', 'module' or 'state_dict')")
    return obj


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def clean_state_dict(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        for prefix in ("_orig_mod.", "module."):
            if k.startswith(prefix):
                k = k[len(prefix):]
        if k.endswith(_IGNORED_SUFFIXES):
            continue
        out[k] = v
    return out


def load_into(model: torch.nn.Module, sd: Dict[str, torch.Tensor], what: str, optional=()) -> None:
    """Strictly load ``sd`` into ``model``: missing, unexpected and mis-shaped keys are one-line errors
    that name the keys. ``optional`` lists keys that may be absent (buffers like codebook_used)."""
    sd = clean_state_dict(sd)
    own = model.state_dict()
    missing = [k for k in own if k not in sd and k not in optional]
    unexpected = [k for k in sd if k not in own]
    if missing:
        raise VVSError(f"{what}: missing keys {_names(missing)}")
    if unexpected:
        raise VVSError(f"{what}: unexpected keys {_names(unexpected)}")
    bad = [f"{k} {tuple(sd[k].shape)} vs expected {tuple(own[k].shape)}" for k in sd if sd[k].shape != own[k].shape]
    if bad:
        raise VVSError(f"{what}: shape mismatch: {'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")
    model.load_state_dict(sd, strict=False)


def _names(keys) -> str:
    keys = list(keys)
    return ", ".join(keys[:5]) + (f" ... ({len(keys)} in all)" if len(keys) > 5 else "")


def save_safetensors(model: torch.nn.Module, path: str, config: dict, kind: str, extra: dict | None = None) -> None:
    """Write ``path`` (.safetensors) and ``path`` with .json (the config, ``kind`` and ``extra``)."""
    from safetensors.torch import save_file

    sd = {k: _owning(v.detach().contiguous().cpu()) for k, v in model.state_dict().items()}
    save_file(sd, path)
    meta = {"kind": kind, "config": config}
    if extra:
        meta.update(extra)
    with open(config_path(path), "w") as f:
        json.dump(meta, f, indent=2)


def _owning(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of its own: a fused layer's state dict names its parts as views of one
    tensor, and safetensors refuses tensors that share storage."""
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def config_path(weights_path: str) -> str:
    base = weights_path
    for ext in (".safetensors", ".pt", ".pth", ".bin"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return base + ".json"


def read_config(weights_path: str) -> dict | None:
    p = config_path(weights_path)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise VVSError(f"unreadable config {p}: {_first_line(e)}") from None
