"""The Zoo: the project's own small, trained visual AR model family, shipped with the package.

    zoo-vq          VQ tokenizer, 64x64 RGB -> 16x16 = 256 codes from a 1024-entry codebook
    zoo-gpt         LlamaGen GPT c2i target (dim 256, 6 layers, 8 heads, 5.3 M parameters), 16 classes
    zoo-drafter     EAGLE-style draft head trained on zoo-gpt's teacher-forced features
    zoo-classifier  small CNN used by ``vvs_engine.evaluation.quality`` (class accuracy, classifier-space FD)

Classes are the 16 built-in photographs of ``vvs_engine.zoo.data.PHOTO_CLASSES`` (index = class).
Training recipe, figures and commands: docs/zoo.md; retrain with ``vvs_engine.training.zoo.train_all``.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

from ..errors import VVSError

CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


def _dir(checkpoint_dir: str | None) -> str:
    # $VVS_ZOO_DIR points the default model at a retrained Zoo (e.g. ``vvs-engine zoo train --out D``).
    return checkpoint_dir or os.environ.get("VVS_ZOO_DIR") or CHECKPOINT_DIR

# name -> (kind, one-line description). The kind is the "kind" field of the checkpoint's JSON.
MODELS: Dict[str, tuple] = {
    "zoo-gpt": ("gpt", "class-conditional LlamaGen GPT target (16 photo classes, 256 tokens/image)"),
    "zoo-vq": ("vq", "VQ tokenizer, 64x64 -> 16x16 codes, codebook 1024 x 8"),
    "zoo-drafter": ("drafter", "EAGLE-style draft head for zoo-gpt"),
    "zoo-classifier": ("classifier", "small CNN for class accuracy and classifier-space FD"),
}
_ROLE = {"gpt": "gpt", "vq": "vq", "drafter": "drafter", "classifier": "classifier"}


def model_path(name: str, checkpoint_dir: str | None = None) -> str:
    """Absolute path of a shipped checkpoint's .safetensors file, by name (``zoo-gpt`` ...) or by
    role (``gpt``, ``vq``, ``drafter``, ``classifier``)."""
    d = _dir(checkpoint_dir)
    if name in _ROLE:
        name = "zoo-" + name
    if name.endswith(".safetensors"):
        name = name[: -len(".safetensors")]
    if name not in MODELS:
        raise VVSError(f"unknown zoo model '{name}'; known: {', '.join(MODELS)}")
    p = os.path.join(d, name + ".safetensors")
    if not os.path.exists(p):
        raise VVSError(f"zoo model '{name}' is not installed ({p} missing); retrain with "
                       f"'vvs-engine zoo train'")
    return p


def default_paths(checkpoint_dir: str | None = None) -> Dict[str, str]:
    """The default model of ``Engine.load()`` / ``vvs-engine generate``: {"gpt", "vq"} plus
    "drafter" and "classifier" when installed (absolute paths)."""
    out = {"gpt": model_path("zoo-gpt", checkpoint_dir), "vq": model_path("zoo-vq", checkpoint_dir)}
    for role in ("drafter", "classifier"):
        p = os.path.join(_dir(checkpoint_dir), f"zoo-{role}.safetensors")
        if os.path.exists(p):
            out[role] = p
    return out


def _meta(path: str) -> dict:
    j = path[: -len(".safetensors")] + ".json"
    try:
        with open(j) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _n_params(path: str) -> int:
    """Count parameters from the safetensors header (no tensor data is read)."""
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    total = 0
    for k, v in header.items():
        if k == "__metadata__" or k.endswith("codebook_used"):
            continue
        c = 1
        for s in v["shape"]:
            c *= s
        total += c
    return total


def list_models(checkpoint_dir: str | None = None) -> List[dict]:
    """Shipped models: name, kind, description, path, installed, size_bytes, params, weights_dtype."""
    d = _dir(checkpoint_dir)
    out = []
    for name, (kind, desc) in MODELS.items():
        p = os.path.join(d, name + ".safetensors")
        row = dict(name=name, kind=kind, description=desc, path=p, installed=os.path.exists(p))
        if row["installed"]:
            meta = _meta(p)
            row.update(size_bytes=os.path.getsize(p), params=_n_params(p),
                       weights_dtype=meta.get("weights_dtype", "float32"))
        out.append(row)
    return out


def class_names(checkpoint_dir: str | None = None) -> List[str]:
    """The shipped target's class names (index = class label)."""
    try:
        meta = _meta(model_path("zoo-gpt", checkpoint_dir))
    except VVSError:
        meta = {}
    if meta.get("classes"):
        return list(meta["classes"])
    from .data import CLASS_NAMES

    return list(CLASS_NAMES)


def cli_list() -> int:
    """``vvs-engine zoo list``: one line per shipped model, then the class list."""
    rows = list_models()
    for r in rows:
        if r["installed"]:
            print(f"{r['name']:<15} {r['kind']:<10} {r['params'] / 1e6:6.2f} M params  "
                  f"{r['size_bytes'] / 2**20:5.1f} MiB {r['weights_dtype']:<8}  {r['description']}")
        else:
            print(f"{r['name']:<15} {r['kind']:<10} (not installed)  {r['description']}")
    names = class_names()
    print("classes: " + ", ".join(f"{i}={n}" for i, n in enumerate(names)))
    print(f"checkpoints: {_dir(None)}")
    return 0
