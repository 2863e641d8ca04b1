"""Drafter training data from the user's images for a Hugging Face family: images -> the family's VQ
codes -> the methods' token rows (an end-of-line index closing each row where the layout has one).

The engine decodes natively and never encodes; the encoder halves of the families' tokenizers
(taming/MoVQ encoders with their quantizers) are run here with transformers' VQ classes, built from
the folder's ``vq_config`` and loaded with the folder's own ``vqmodel`` weights. This is data
preparation for training only: generation never reaches this module.
"""
from __future__ import annotations

import os
from typing import List

import numpy as np
import torch

from ..errors import VVSError
from ..models.hf_loader import read_folder_config, read_json, read_weights

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def list_images(folder: str) -> List[str]:
    """Image files of ``folder`` sorted by name (the order that pairs them with the prompts file); in a
    ``vvs-engine generate`` output folder (it holds tokens.npz) its contact sheet grid.png is no image."""
    if not os.path.isdir(folder):
        raise VVSError(f"--images: not a folder: {folder}")
    sheet = "grid.png" if os.path.exists(os.path.join(folder, "tokens.npz")) else None
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_SUFFIXES) and n != sheet)
    if not names:
        raise VVSError(f"--images: no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    return [os.path.join(folder, n) for n in names]


def load_pixels(paths: List[str], side: int, mean, std) -> torch.Tensor:
    """-> [N, 3, side, side]: shorter side resized to ``side`` (bicubic), centre crop, normalised."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for p in paths:
        try:
            im = Image.open(p).convert("RGB")
        except (OSError, UnidentifiedImageError) as e:
            raise VVSError(f"--images: unreadable image {p} ({str(e).splitlines()[0]})") from None
        s = side / min(im.size)
        im = im.resize((max(side, round(im.size[0] * s)), max(side, round(im.size[1] * s))), Image.BICUBIC)
        left, top = (im.size[0] - side) // 2, (im.size[1] - side) // 2
        x = np.asarray(im.crop((left, top, left + side, top + side)), dtype=np.float32) / 255.0
        out.append((torch.from_numpy(x).permute(2, 0, 1) - torch.tensor(mean)[:, None, None])
                   / torch.tensor(std)[:, None, None])
    return torch.stack(out)


def family_vq_encoder(model_dir: str):
    """-> (transformers VQ model with the folder's weights, family, its downsampling factor)."""
    import transformers as tf

    cfg = read_folder_config(model_dir)
    family, qc = cfg.get("model_type"), dict(cfg.get("vq_config") or {})
    classes = {"janus": ("JanusVQVAEConfig", "JanusVQVAE"), "chameleon": ("ChameleonVQVAEConfig", "ChameleonVQVAE"),
               "emu3": ("Emu3VQVAEConfig", "Emu3VQVAE")}
    if family not in classes:
        raise VVSError(f"{model_dir}: model_type '{family}' has no VQ encoder here")
    config_cls, model_cls = (getattr(tf, n) for n in classes[family])
    qc.pop("model_type", None)
    vq = model_cls(config_cls(**qc)).eval()
    prefixes = ("model.vqmodel.", "vqmodel.")
    sd = read_weights(model_dir, prefixes)
    sd = {k.split("vqmodel.", 1)[1]: v.float() for k, v in sd.items()}
    missing = [k for k in vq.state_dict() if k.startswith(("encoder.", "quant_conv.", "quantize.")) and k not in sd]
    if missing:
        raise VVSError(f"{model_dir}: the folder lacks the VQ encoder weights ({', '.join(missing[:3])}): "
                       f"--images needs them; use --prompts alone to train on sampled images")
    vq.load_state_dict(sd, strict=False)
    return vq, family, 2 ** (len(qc.get("channel_multiplier") or vq.config.channel_multiplier) - 1)


@torch.no_grad()
def encode_images(eng, model_dir: str, paths: List[str], batch: int = 8) -> torch.Tensor:
    """Images -> the engine's token rows [N, tokens_per_image] through the family's VQ encoder."""
    vq, family, ds = family_vq_encoder(model_dir)
    cfg = eng.config
    grid_h, grid_w = (getattr(cfg, "grid_h", cfg.grid_size), getattr(cfg, "grid_w", cfg.grid_size))
    pre = os.path.join(model_dir, "preprocessor_config.json")
    pp = read_json(pre, "preprocessor_config.json") if os.path.exists(pre) else {}
    mean, std = pp.get("image_mean", [0.5] * 3), pp.get("image_std", [0.5] * 3)
    from tqdm import tqdm

    rows = []
    for i in tqdm(range(0, len(paths), batch), desc="encode images", disable=len(paths) <= batch,
                  dynamic_ncols=True):
        px = load_pixels(paths[i:i + batch], grid_h * ds, mean, std)
        if family == "emu3":
            sizes = torch.tensor([[grid_h * ds, grid_w * ds]] * px.shape[0])
            codes = torch.stack(vq.encode(px, sizes).image_tokens)
        else:
            codes = vq.encode(px).image_tokens
        codes = codes.reshape(px.shape[0], grid_h, grid_w).long()
        if family != "janus":  # close every row with the end-of-line index, as the layout forces it
            eol = torch.full((px.shape[0], grid_h, 1), cfg.vocab_size - 1, dtype=torch.long)
            codes = torch.cat([codes, eol], 2)
        rows.append(codes.reshape(px.shape[0], -1))
    return torch.cat(rows)


@torch.no_grad()
def encode_crops(vq, crops: np.ndarray, batch: int = 128, desc: str = "encode") -> torch.Tensor:
    """Zoo image crops (uint8 [n, H, W, 3]) -> VQ codes [n, T], ``batch`` crops per encoder call."""
    import sys

    from tqdm import tqdm

    from ..zoo import data as zdata

    out = []
    # mininterval keeps background logs short; the one-line summaries carry the figures.
    for i in tqdm(range((len(crops) + batch - 1) // batch), desc=desc, mininterval=15, dynamic_ncols=True,
                  file=sys.stderr):
        out.append(vq.encode(zdata.to_tensor(crops[i * batch:(i + 1) * batch])))
    return torch.cat(out)
