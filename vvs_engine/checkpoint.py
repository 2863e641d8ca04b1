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
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Dict, Optional

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
    with open(path, "rb") as f:
        head = f.read(4)
    # a torch file is a zip archive (or, before torch 1.6, a pickle: protocol 2+ starts with 0x80); a text
    # file or an image passed by mistake is named as such, not as an unsafe pickle
    if not head.startswith(b"PK\x03\x04") and not head.startswith(b"\x80"):
        raise VVSError(f"not a checkpoint: {path} (neither a torch file nor .safetensors)")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError,
            AttributeError, TypeError, KeyError, IndexError, MemoryError, OverflowError) as e:
        # torch wraps the refusal in a multi-line message; the class it refused is on a later line.
        # torch wraps a refusal in a multi-line message that starts the same way whatever it refused
        if str(e).startswith("Weights only load failed"):
            raise VVSError(f"refused to unpickle {path} as unsafe: it holds {_refused_content(str(e))}, and only "
                           f"tensors are loaded (arbitrary pickles can run code)") from None
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


def _refused_content(message: str) -> str:
    """What torch's safe unpickler refused, from its message: a class or function, else a pickle
    instruction it does not allow (a plain ``pickle.dump`` file, not a torch checkpoint)."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return f"a {found.group(1)} object"
    found = re.search(r"Unsupported operand (\d+)", message)
    if found:
        return f"a pickle instruction the safe loader does not allow (opcode {found.group(1)})"
    return "objects other than tensors"


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


# --- project configs, validated ------------------------------------------------------------------
# What each "kind" of a project checkpoint is, in messages.
KIND_NAMES = {"gpt": "target model", "vq": "VQ tokenizer", "drafter": "drafter", "classifier": "Zoo classifier"}


@dataclass(frozen=True)
class ConfigField:
    """One field of a project config. ``kind``: "int", "number", "bool", "text" or "int list";
    ``minimum``: the lowest value allowed (each element of a list); ``required``: a field whose default
    would silently build another model than the weights (widths, depths, vocabulary, normalisation);
    ``nullable``: null is a value; ``choices``: the allowed texts."""

    kind: str
    minimum: Optional[float] = None
    required: bool = True
    nullable: bool = False
    choices: tuple = ()

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.kind == "int list":
            return (isinstance(value, list) and len(value) > 0
                    and all(ConfigField("int", self.minimum).accepts(v) for v in value))
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "text":
            return isinstance(value, str) and (not self.choices or value in self.choices)
        number = (int,) if self.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            return False
        return self.minimum is None or value >= self.minimum

    def describe(self) -> str:
        if self.kind == "text":
            return " or ".join(json.dumps(c) for c in self.choices) if self.choices else "a string"
        what = {"int": "an integer", "number": "a number", "bool": "true or false",
                "int list": "a non-empty list of integers"}[self.kind]
        if self.minimum is not None and self.kind != "bool":
            what += f" >= {self.minimum:g}" if self.kind != "int list" else f", each >= {self.minimum:g}"
        return what + (" or null" if self.nullable else "")


def check_config_fields(config: dict, fields: Dict[str, ConfigField], where: str) -> None:
    """Every field of ``fields`` is present (when required), of its type and in range; a one-line
    error names the field and ``where`` (the config file) otherwise."""
    for name, field in fields.items():
        if name not in config:
            if field.required:
                raise VVSError(f"{where}: \"{name}\" is missing ({field.describe()})")
            continue
        if not field.accepts(config[name]):
            raise VVSError(f"{where}: \"{name}\" must be {field.describe()}, got {json.dumps(config[name])}")


def read_project_config(weights_path: str, kind: str) -> Optional[dict]:
    """The ``"config"`` object of the JSON file next to a project checkpoint of ``kind`` (``"gpt"``,
    ``"vq"``, ``"drafter"``), or None when there is no such file (an official checkpoint). A file of
    another kind, or one that is not ``{"kind": ..., "config": {...}}``, is a one-line error saying so."""
    meta = read_config(weights_path)
    if meta is None:
        return None
    p = config_path(weights_path)
    if not isinstance(meta, dict):
        raise VVSError(f"config {p} must be a JSON object with \"kind\" and \"config\", got {_json_type(meta)}")
    if "kind" not in meta:
        raise VVSError(f"config {p}: \"kind\" is missing (expected \"{kind}\" for a {KIND_NAMES[kind]})")
    found = meta["kind"]
    if found != kind:
        if isinstance(found, str) and found in KIND_NAMES:
            raise VVSError(f"{weights_path} is a {KIND_NAMES[found]} checkpoint (\"kind\": \"{found}\" in {p}), not a "
                           f"{KIND_NAMES[kind]}")
        raise VVSError(f"config {p}: \"kind\" is {json.dumps(found)}, expected \"{kind}\" for a {KIND_NAMES[kind]}")
    if "config" not in meta:
        raise VVSError(f"config {p}: \"config\" is missing (the {KIND_NAMES[kind]}'s settings, a JSON object)")
    if not isinstance(meta["config"], dict):
        raise VVSError(f"config {p}: \"config\" must be a JSON object, got {_json_type(meta['config'])}")
    return meta["config"]


def _json_type(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number")


def layer_count(sd: Dict[str, torch.Tensor], prefix: str = "layers.") -> int:
    """How many numbered blocks ``prefix0.``, ``prefix1.``, ... a state dict holds (after cleaning); 0
    when there are none or the numbers have gaps (stray or missing keys: load_into names those)."""
    found = {int(m.group(1)) for k in sd for m in [re.match(re.escape(prefix) + r"(\d+)\.", k)] if m}
    return len(found) if found == set(range(len(found))) else 0


def check_layer_count(sd: Dict[str, torch.Tensor], n_layer: int, where: str) -> None:
    """The config's ``n_layer`` is the number of blocks the weights hold (when they number them cleanly)."""
    layers = layer_count(sd)
    if layers and layers != n_layer:
        raise VVSError(f"{where}: \"n_layer\" is {n_layer} but the weights hold {layers} layers")


def check_weight_shape(sd: Dict[str, torch.Tensor], key: str, want: tuple, fields: str, where: str) -> None:
    """The weight ``key`` has shape ``want`` (None: any size on that axis); otherwise a one-line error
    that names the config ``fields`` that set it and the file ``where``."""
    if key not in sd:
        return  # load_into names missing keys
    got = tuple(sd[key].shape)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        shown = tuple("*" if w is None else w for w in want)
        raise VVSError(f"{where}: {fields} give {key} the shape {shown}, but the weights have {got}")
