"""Training data for the Zoo: random crops of real photographs that ship inside installed wheels.

Nothing is downloaded. Each class is one source photo (``PHOTO_CLASSES``, fixed order = class index).
A crop is a square box of log-uniform side, placed uniformly, flipped left-right with probability 1/2
and resized to ``size`` x ``size`` (PIL bicubic, antialiased).

Held-out split: the right-most ``HOLDOUT_FRAC`` (25 %) of every photo's width is never used for
``split="train"`` crops; ``split="heldout"`` crops come only from that band. So held-out PSNR, loss and
classifier accuracy measure generalisation to unseen parts of each photo, not a re-draw of seen pixels.
Both splits use the same crop-side range (capped at the band width), so their scale statistics match.

Crops are a pure function of (sources, split, n_per_class, seed): each class draws from its own
``numpy.random.default_rng([seed, class, split])`` stream, so adding classes never changes others.

Users' data: :func:`folder_sources` reads an image folder with one sub-folder per class; the same
crop machinery applies (several images per class are drawn from uniformly).
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from ..errors import VVSError

# (class name, loader spec). The order is the class index and is part of the shipped models' contract.
PHOTO_CLASSES: List[Tuple[str, str]] = [
    ("astronaut", "skimage:astronaut"),
    ("coffee", "skimage:coffee"),
    ("chelsea", "skimage:chelsea"),
    ("rocket", "skimage:rocket"),
    ("hubble_deep_field", "skimage:hubble_deep_field"),
    ("immunohistochemistry", "skimage:immunohistochemistry"),
    ("retina", "skimage:retina"),
    ("camera", "skimage:camera"),  # grey
    ("coins", "skimage:coins"),  # grey
    ("moon", "skimage:moon"),  # grey
    ("china", "sklearn:china.jpg"),
    ("flower", "sklearn:flower.jpg"),
    ("grace_hopper", "matplotlib:grace_hopper.jpg"),
    ("brick", "skimage:brick"),  # grey
    ("motorcycle", "skimage:stereo_motorcycle"),  # left view of the stereo pair
    ("gravel", "skimage:gravel"),  # grey
]
CLASS_NAMES: List[str] = [n for n, _ in PHOTO_CLASSES]

HOLDOUT_FRAC = 0.25  # right-most share of each photo's width reserved for held-out crops
MIN_SCALE, MAX_SCALE = 0.12, 0.35  # crop side as a share of min(H, W), before the band cap
_SPLITS = {"train": 0, "heldout": 1}

_cache: Dict[str, np.ndarray] = {}


def _to_rgb(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == bool:
        a = a.astype(np.uint8) * 255
    if a.dtype != np.uint8:
        a = np.clip(a * (255.0 if a.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    if a.ndim == 2:
        a = np.stack([a] * 3, axis=-1)
    return np.ascontiguousarray(a[..., :3])


def load_photo(spec: str) -> np.ndarray:
    """Load one built-in photo as uint8 RGB [H, W, 3] (grey photos are replicated to 3 channels)."""
    if spec in _cache:
        return _cache[spec]
    src, name = spec.split(":", 1)
    if src == "skimage":
        import skimage.data

        a = getattr(skimage.data, name)()
        if isinstance(a, tuple):  # stereo_motorcycle returns (left, right, disparity)
            a = a[0]
    elif src == "sklearn":
        from sklearn.datasets import load_sample_image

        a = load_sample_image(name)
    elif src == "matplotlib":
        import matplotlib.cbook as cbook
        from PIL import Image

        with cbook.get_sample_data(name) as f:
            a = np.asarray(Image.open(f).convert("RGB"))
    else:
        raise VVSError(f"unknown photo source '{spec}'")
    _cache[spec] = _to_rgb(a)
    return _cache[spec]


def photo_sources() -> List[List[np.ndarray]]:
    """The built-in classes: one list of images (here a single photo) per class."""
    return [[load_photo(spec)] for _, spec in PHOTO_CLASSES]


_IMG_EXT = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def folder_sources(root: str) -> Tuple[List[List[np.ndarray]], List[str]]:
    """An image folder with one sub-folder per class (sorted names = class indices) ->
    (images per class, class names). Raises a one-line VVSError for an empty or malformed folder."""
    from PIL import Image

    if not os.path.isdir(root):
        raise VVSError(f"not a directory: {root}")
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not names:
        raise VVSError(f"{root} has no class sub-folders (expected one sub-folder per class)")
    out = []
    for n in names:
        d = os.path.join(root, n)
        files = sorted(f for f in os.listdir(d) if f.lower().endswith(_IMG_EXT))
        if not files:
            raise VVSError(f"class folder {d} holds no images")
        out.append([_to_rgb(np.asarray(Image.open(os.path.join(d, f)).convert("RGB"))) for f in files])
    return out, names


def _crop_one(rng: np.random.Generator, img: np.ndarray, split: int, size: int):
    from PIL import Image

    H, W = img.shape[:2]
    band = max(1, int(round(W * HOLDOUT_FRAC)))
    x_lo, x_hi = (0, W - band) if split == 0 else (W - band, W)
    m = min(H, W)
    hi = min(band, H, MAX_SCALE * m)  # same cap for both splits: matched scale statistics
    lo = min(hi, MIN_SCALE * m)
    side = float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) if hi > lo else float(hi)
    x = rng.uniform(x_lo, max(x_lo, x_hi - side))
    y = rng.uniform(0, max(0.0, H - side))
    flip = rng.random() < 0.5
    pil = Image.fromarray(img)
    out = pil.resize((size, size), Image.BICUBIC, box=(x, y, x + side, y + side))
    a = np.asarray(out)
    return a[:, ::-1] if flip else a


def make_crops(n_per_class: int, seed: int = 0, split: str = "train", size: int = 64,
               sources: Sequence[Sequence[np.ndarray]] | None = None) -> Tuple[np.ndarray, np.ndarray]:
    """-> (uint8 crops [n_classes * n_per_class, size, size, 3], int64 labels), class-major order.
    Deterministic for (sources, n_per_class, seed, split, size)."""
    if split not in _SPLITS:
        raise VVSError(f"split must be 'train' or 'heldout', got '{split}'")
    sources = photo_sources() if sources is None else sources
    crops = np.empty((len(sources) * n_per_class, size, size, 3), np.uint8)
    labels = np.repeat(np.arange(len(sources), dtype=np.int64), n_per_class)
    i = 0
    for c, imgs in enumerate(sources):
        rng = np.random.default_rng([seed, c, _SPLITS[split]])
        for _ in range(n_per_class):
            img = imgs[int(rng.integers(len(imgs)))] if len(imgs) > 1 else imgs[0]
            crops[i] = _crop_one(rng, img, _SPLITS[split], size)
            i += 1
    return crops, labels


def to_tensor(crops: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W] in [-1, 1]."""
    t = torch.from_numpy(np.ascontiguousarray(crops)).permute(0, 3, 1, 2).float()
    return t / 127.5 - 1.0


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """float [N, 3, H, W] in [-1, 1] -> uint8 [N, H, W, 3] (clamped, rounded)."""
    x = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()
