"""The Zoo: the project's own small, trained visual AR model family, shipped with the package.

    zoo-vq          VQ tokenizer, 64x64 RGB -> 16x16 = 256 codes from a 1024-entry codebook (convolutional:
                    128x128 -> 32x32 = 1024 codes with the same weights)
    zoo-gpt         LlamaGen GPT c2i target (dim 256, 6 layers, 8 heads, 5.3 M parameters), 16 classes, 16x16
    zoo-drafter     EAGLE-style draft head trained on zoo-gpt's teacher-forced features
    zoo-gpt-32      the same GPT at 128 px: 32x32 = 1024 tokens per image, on zoo-vq
    zoo-drafter-32  zoo-gpt-32's draft head
    zoo-classifier  small CNN used by ``vvs_engine.evaluation.quality`` (class accuracy, classifier-space FD);
                    64-px input, larger images are resized to it

The targets (``TARGETS``) each have their own drafter and share the tokenizer and the classifier.

Classes are the 16 built-in photographs of ``vvs_engine.zoo.data.PHOTO_CLASSES`` (index = class).
Training recipe, figures and commands: docs/zoo.md; retrain with ``vvs_engine.training.zoo.train_all``
(``train_grid32`` for the 32x32 member).
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
    "zoo-vq": ("vq", "VQ tokenizer, 64x64 -> 16x16 codes (128x128 -> 32x32), codebook 1024 x 8"),
    "zoo-drafter": ("drafter", "EAGLE-style draft head for zoo-gpt"),
    "zoo-gpt-32": ("gpt", "the same GPT at 128 px: 32x32 = 1024 tokens/image on zoo-vq"),
    "zoo-drafter-32": ("drafter", "EAGLE-style draft head for zoo-gpt-32"),
    "zoo-classifier": ("classifier", "small CNN for class accuracy and classifier-space FD"),
}
# target name -> its drafter; every target uses zoo-vq and zoo-classifier. The first is the default model.
TARGETS: Dict[str, str] = {"zoo-gpt": "zoo-drafter", "zoo-gpt-32": "zoo-drafter-32"}
DEFAULT_TARGET = "zoo-gpt"
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
        how = ("python -m vvs_engine.training.zoo OUT --grid 32 --threads 1" if name.endswith("-32")
               else "vvs-engine zoo train")
        raise VVSError(f"zoo model '{name}' is not installed ({p} missing); train it with '{how}'")
    return p


def check_target(name: str) -> str:
    """``name`` if it is a Zoo target (``zoo-gpt``, ``zoo-gpt-32``), else a one-line error."""
    if name not in TARGETS:
        other = f" ('{name}' is a {MODELS[name][0]}, not a target)" if name in MODELS else ""
        raise VVSError(f"unknown Zoo model '{name}'{other}; targets: {', '.join(TARGETS)}")
    return name


def default_paths(checkpoint_dir: str | None = None, target: str = DEFAULT_TARGET) -> Dict[str, str]:
    """The files of a Zoo target for ``Engine.load(model=...)`` / ``vvs-engine generate --model``
    (default: ``zoo-gpt``, the default model): {"gpt", "vq"} plus "drafter" (the target's own) and
    "classifier" when installed (absolute paths)."""
    check_target(target)
    out = {"gpt": model_path(target, checkpoint_dir), "vq": model_path("zoo-vq", checkpoint_dir)}
    for role, name in (("drafter", TARGETS[target]), ("classifier", "zoo-classifier")):
        p = os.path.join(_dir(checkpoint_dir), f"{name}.safetensors")
        if os.path.exists(p):
            out[role] = p
    return out


def resolve_model(model: str | None, gpt_ckpt: str | None, vq_ckpt: str | None, drafter: str | None,
                  model_dir: str | None = None, cli: bool = False):
    """``Engine.load``'s and the CLI's ``model`` name -> (gpt_ckpt, vq_ckpt, drafter) paths: the named
    Zoo target's files where ``vq_ckpt`` / ``drafter`` are not given. Without a name the arguments pass
    through unchanged (no ``gpt_ckpt`` there means the default Zoo target, resolved by the loader)."""
    if model is None:
        return gpt_ckpt, vq_ckpt, drafter
    flag = (lambda a: "--" + a.replace("_", "-")) if cli else (lambda a: a)
    for arg, value in (("gpt_ckpt", gpt_ckpt), ("model_dir", model_dir)):
        if value is not None:
            raise VVSError(f"{flag('model')} names a Zoo target; {flag(arg)} names another model: give one of them")
    paths = default_paths(target=check_target(model))
    return paths["gpt"], vq_ckpt or paths["vq"], drafter or paths.get("drafter")


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
