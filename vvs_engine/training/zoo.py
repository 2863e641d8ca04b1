"""Train the Zoo from scratch: VQ tokenizer -> (classifier) -> class-conditional GPT -> drafter.

One entry point, :func:`train_all`, retrains everything with fixed seeds and writes

    <out_dir>/zoo-vq.safetensors|json          tokenizer (fp32)
    <out_dir>/zoo-classifier.safetensors|json  small CNN used by vvs_engine.evaluation.quality (fp32)
    <out_dir>/zoo-gpt.safetensors|json         target (weights stored in bf16 to keep the repo small)
    <out_dir>/zoo-drafter.safetensors|json     EAGLE-style draft head (bf16)
    <out_dir>/train_report.json                timings, step counts, held-out figures

Intermediate arrays (crops, codes, the drafter's training tokens) go to ``work_dir`` so a stage that
crashed can be resumed (``resume=True`` skips stages whose outputs exist).

All randomness comes from explicitly seeded generators (data crops, init, batches, class dropout), so
the same seed, step counts and thread count give the same checkpoints on CPU; bf16 autocast on CPU
is deterministic for a fixed thread count.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint import save_safetensors
from ..models.gpt import GPT, GPTConfig
from ..models.vq import VQConfig, VQModel
from ..zoo import data as zdata
from .family_images import encode_crops
from .state import load_train_state, save_train_state

# The shipped configurations. 64x64 crops -> 16x16 = 256 tokens (LlamaGen's 256-px grid).
IMAGE_SIZE = 64
VQ_CONFIG = dict(codebook_size=1024, codebook_embed_dim=8, encoder_ch_mult=[1, 2, 2], decoder_ch_mult=[1, 2, 2],
                 z_channels=64, base_channels=32, num_res_blocks=1)
GPT_CONFIG = dict(dim=256, n_layer=6, n_head=8, multiple_of=64, vocab_size=1024, block_size=256,
                  class_dropout_prob=0.1, model_type="c2i", cls_token_num=1)

# Default schedule: sized so the whole run fits in about 1 h on 2 CPU cores shared with other jobs
# (measured times in docs/zoo.md); a free machine or a GPU can afford more steps.
DEFAULTS = dict(n_train_per_class=1000, n_encode_per_class=600, n_heldout_per_class=100,
                vq_steps=650, vq_batch=16, vq_lr=2e-3,
                cls_steps=1000, cls_batch=64, cls_lr=2e-3, cls_recon_per_class=400,
                gpt_steps=500, gpt_batch=32, gpt_lr=2e-3,
                drafter_steps=200, drafter_batch=16, drafter_lr=1e-3)


def _autocast(enabled: bool):
    # bf16 autocast on CPU was ~1.3-1.5x faster per step than fp32 for both VQ and GPT here.
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def _lr_factor(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor`` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _bar(n: int, desc: str, start: int = 0):
    from tqdm import tqdm

    # mininterval keeps background logs short; the one-line summaries carry the figures.
    return tqdm(range(start, n), desc=desc, initial=start, total=n, mininterval=15, dynamic_ncols=True,
                file=sys.stderr)


def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB of images in [-1, 1] (peak-to-peak 2), after clamping x."""
    mse = (x.clamp(-1, 1) - y).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(4.0 / mse.clamp_min(1e-10))


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------
def train_vq(crops: np.ndarray, steps: int, batch: int, lr: float, seed: int, log: Callable = print,
             config: Optional[dict] = None, amp: bool = True, reinit_every: int = 100) -> VQModel:
    """Train the VQ tokenizer on uint8 crops [N, H, W, 3] with L1 + L2 reconstruction plus the codebook
    and commitment losses (no GAN, no perceptual loss: no pretrained weights are available).

    Dead-code re-initialisation: every ``reinit_every`` steps, codes unused since the last check are
    moved onto randomly chosen encoder outputs of the current batch. A 1024-entry codebook on a tiny
    dataset otherwise collapses to a few dozen live codes, which costs several dB of PSNR. It stops
    for the last 20 % of steps so the final codebook settles."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    vq = VQModel(VQConfig(**(config or VQ_CONFIG))).train()
    opt = torch.optim.Adam(vq.parameters(), lr=lr, betas=(0.9, 0.99))
    K = vq.config.codebook_size
    used = torch.zeros(K, dtype=torch.long)
    n = crops.shape[0]
    bar = _bar(steps, "train vq")
    run = []
    for step in bar:
        for pg in opt.param_groups:
            pg["lr"] = lr * _lr_factor(step, steps, warmup=50)
        idx = torch.randint(0, n, (batch,), generator=g)
        x = zdata.to_tensor(crops[idx.numpy()])
        with _autocast(amp):
            z = vq.quant_conv(vq.encoder(x))
        zq, cb, cm, codes = vq.quantize(z.float())
        with _autocast(amp):
            rec = vq.decoder(vq.post_quant_conv(zq))
        rec = rec.float()
        rec_loss = F.l1_loss(rec, x) + F.mse_loss(rec, x)
        loss = rec_loss + cb + cm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        used += torch.bincount(codes.flatten(), minlength=K)
        if reinit_every and (step + 1) % reinit_every == 0:
            dead = (used == 0).nonzero().flatten()
            if step < 0.8 * steps and len(dead):
                with torch.no_grad():
                    zf = F.normalize(z.detach().float().permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=-1)
                    pick = torch.randint(0, zf.shape[0], (len(dead),), generator=g)
                    vq.quantize.embedding.weight[dead] = zf[pick] + 0.01 * torch.randn(len(dead), zf.shape[1],
                                                                                       generator=g)
            live = int((used > 0).sum())
            run.append(float(psnr(rec.detach(), x).mean()))
            bar.set_postfix(loss=f"{loss.item():.4f}", psnr=f"{run[-1]:.2f}", live=live, dead_reinit=len(dead))
            used.zero_()
    log(f"vq: {steps} steps, last train-batch PSNR {run[-1] if run else float('nan'):.2f} dB")
    return vq.eval()


@torch.no_grad()
def decode_codes(vq: VQModel, codes: torch.Tensor, batch: int = 64) -> torch.Tensor:
    return torch.cat([vq.decode(codes[i:i + batch]).float() for i in range(0, len(codes), batch)])


# --------------------------------------------------------------------------------------------------
# Classifier (for class accuracy and classifier-space Frechet distance)
# --------------------------------------------------------------------------------------------------
def train_classifier(images: torch.Tensor, labels: torch.Tensor, num_classes: int, steps: int, batch: int,
                     lr: float, seed: int, log: Callable = print):
    """``images`` float [N, 3, 64, 64] in [-1, 1] (real crops and their VQ reconstructions, so the
    classifier judges content, not tokenizer artefacts). Augmentation: flips and small noise."""
    from ..evaluation.quality import SmallCNN

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 2)
    net = SmallCNN(num_classes).train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    n = images.shape[0]
    for step in (bar := _bar(steps, "train classifier")):
        for pg in opt.param_groups:
            pg["lr"] = lr * _lr_factor(step, steps, warmup=50, floor=0.02)
        idx = torch.randint(0, n, (batch,), generator=g)
        x, y = images[idx], labels[idx]
        flip = torch.rand(batch, generator=g) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        x = x + 0.03 * torch.randn(x.shape, generator=g)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return net.eval()


@torch.no_grad()
def classifier_accuracy(net, images: torch.Tensor, labels: torch.Tensor, batch: int = 256) -> float:
    pred = torch.cat([net(images[i:i + batch]).argmax(-1) for i in range(0, len(images), batch)])
    return float((pred == labels).float().mean())


# --------------------------------------------------------------------------------------------------
# Target GPT
# --------------------------------------------------------------------------------------------------
def train_gpt(tokens: torch.Tensor, labels: torch.Tensor, num_classes: int, steps: int, batch: int, lr: float,
              seed: int, log: Callable = print, config: Optional[dict] = None, amp: bool = True,
              state_path: Optional[str] = None, save_every: int = 0, log_every: int = 0,
              init: Optional[tuple] = None) -> GPT:
    """Teacher-forced next-token CE on VQ codes [N, T] with class dropout (label -> null class with
    probability ``class_dropout_prob``) so the model supports classifier-free guidance.

    ``state_path``: with ``save_every`` > 0 the model, optimizer, batch generator and smoothed loss are
    saved there every ``save_every`` steps, and a state found there at the start is resumed (same
    schedule required). The batches and class dropout come from one seeded generator saved with the
    state, so a resumed run draws the batches an uninterrupted one would. ``log_every``: a one-line
    progress report (loss, s/step, time left) every that many steps. ``init``: (name, state dict) of
    weights to start from instead of the seeded random ones (a warm start; the name is part of the
    schedule, so a state saved from another start is never resumed)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 3)
    cfg = GPTConfig(**dict(config or GPT_CONFIG, num_classes=num_classes))
    gpt = GPT(cfg).train()
    if init is not None:
        from ..checkpoint import load_into

        load_into(gpt, init[1], "gpt")
    decay = [p for n_, p in gpt.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in gpt.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    n = tokens.shape[0]
    ema = None
    start = 0
    schedule = dict(steps=steps, batch=batch, lr=lr, seed=seed, n_sequences=n, config=cfg.to_dict())
    if init is not None:  # (a from-scratch schedule keeps its old form: its saved states still resume)
        schedule["init"] = init[0]
    state = load_train_state(state_path, schedule) if state_path and save_every else None
    if state is not None:
        gpt.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        start, ema = int(state["step"]), state["ema"]
        log(f"gpt: resumed at step {start}/{steps} from {state_path}")
    seconds_before = float(state["seconds"]) if state is not None else 0.0
    t_start = time.perf_counter()
    for step in (bar := _bar(steps, "train gpt", start)):
        for pg in opt.param_groups:
            pg["lr"] = lr * _lr_factor(step, steps, warmup=min(100, steps // 10))
        idx = torch.randint(0, n, (batch,), generator=g)
        tok, lab = tokens[idx], labels[idx].clone()
        drop = torch.rand(batch, generator=g) < cfg.class_dropout_prob
        lab[drop] = cfg.num_classes
        with _autocast(amp):
            logits = gpt(lab, tok)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), tok.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        done = step + 1
        if save_every and state_path and (done % save_every == 0 or done == steps):
            # seconds: training wall time over every process of a resumed run
            save_train_state(state_path, schedule=schedule, step=done, ema=ema, model=gpt.state_dict(),
                             optimizer=opt.state_dict(), generator=g.get_state(),
                             seconds=seconds_before + time.perf_counter() - t_start)
        if log_every and (done % log_every == 0 or done == steps):
            per_step = (time.perf_counter() - t_start) / (done - start)
            log(f"gpt step {done}/{steps}: smoothed loss {ema:.3f}, lr {opt.param_groups[0]['lr']:.2e}, "
                f"{per_step:.2f} s/step, about {per_step * (steps - done) / 60:.0f} min left")
    log(f"gpt: {steps} steps, {gpt.num_params() / 1e6:.2f} M params, smoothed train loss {ema:.3f}")
    return gpt.eval()


@torch.no_grad()
def gpt_loss(gpt: GPT, tokens: torch.Tensor, labels: torch.Tensor, batch: int = 64) -> float:
    """Mean teacher-forced CE (nats/token) with the true labels, in fp32."""
    tot, cnt = 0.0, 0
    for i in range(0, len(tokens), batch):
        lg = gpt(labels[i:i + batch], tokens[i:i + batch])
        tot += float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tokens[i:i + batch].reshape(-1), reduction="sum"))
        cnt += tokens[i:i + batch].numel()
    return tot / cnt


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------
def save_model(model: torch.nn.Module, path: str, config: dict, kind: str, extra: dict, dtype=torch.float32):
    """save_safetensors on a copy cast to ``dtype`` (bf16 halves the repository size of the big models;
    loading copies into the fp32 model)."""
    m = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model
    save_safetensors(m, path, config, kind=kind, extra=dict(extra, weights_dtype=str(dtype).replace("torch.", "")))


def _exists(out_dir, name):
    return os.path.exists(os.path.join(out_dir, name + ".safetensors"))


def classifier_stage(vq, tr_x, tr_yt, tr_codes, enc_y, nc, hp, seed, log=print):
    """The classifier trains on all real train crops plus VQ reconstructions of
    ``cls_recon_per_class`` x classes of them: generated images carry the tokenizer's artefacts, and
    a classifier that has only seen real photos mistakes those artefacts for other classes."""
    g = torch.Generator().manual_seed(seed + 4)
    sub = torch.randperm(len(tr_codes), generator=g)[: min(len(tr_codes), hp["cls_recon_per_class"] * nc)]
    rec = decode_codes(vq, tr_codes[sub])
    imgs = torch.cat([zdata.to_tensor(tr_x), rec])
    labs = torch.cat([tr_yt, enc_y[sub]])
    return train_classifier(imgs, labs, nc, hp["cls_steps"], hp["cls_batch"], hp["cls_lr"], seed, log)


def train_all(out_dir: str, seed: int = 0, work_dir: Optional[str] = None, data_root: Optional[str] = None,
              resume: bool = False, log: Callable = print, threads: Optional[int] = None, **overrides) -> dict:
    """Retrain the whole Zoo from scratch with fixed seeds. ``data_root``: an image folder (one
    sub-folder per class) instead of the built-in photos. ``overrides``: any key of ``DEFAULTS``
    (step counts, batch sizes, learning rates). Returns the training report (also written as
    ``train_report.json``)."""
    from ..checkpoint import load_into, read_state_dict

    hp = dict(DEFAULTS)
    unknown = set(overrides) - set(hp)
    if unknown:
        raise ValueError(f"unknown training options: {sorted(unknown)}")
    hp.update(overrides)
    if threads:
        torch.set_num_threads(threads)
    os.makedirs(out_dir, exist_ok=True)
    if work_dir is None:  # never inside out_dir: that may be the package's checkpoints folder
        cache = os.path.expanduser(os.environ.get("VVS_CACHE", "~/.cache/vvs_engine"))
        work_dir = os.path.join(cache, "zoo_work", os.path.basename(os.path.abspath(out_dir)))
    os.makedirs(work_dir, exist_ok=True)
    report_path = os.path.join(out_dir, "train_report.json")
    report = {}
    if resume and os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
    report.update(seed=seed, hyperparameters=hp, threads=torch.get_num_threads(),
                  torch=torch.__version__, data_root=data_root)

    def save_report():
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)

    t_all = time.perf_counter()
    # ---- data ----
    t0 = time.perf_counter()
    if data_root:
        sources, class_names = zdata.folder_sources(data_root)
    else:
        sources, class_names = zdata.photo_sources(), list(zdata.CLASS_NAMES)
    nc = len(class_names)
    tr_x, tr_y = zdata.make_crops(hp["n_train_per_class"], seed, "train", IMAGE_SIZE, sources)
    ho_x, ho_y = zdata.make_crops(hp["n_heldout_per_class"], seed, "heldout", IMAGE_SIZE, sources)
    report["data"] = dict(classes=class_names, n_train=len(tr_x), n_heldout=len(ho_x),
                          n_target_train=hp["n_encode_per_class"] * nc,
                          heldout="right-most 25% of each photo's width", seconds=time.perf_counter() - t0)
    log(f"data: {nc} classes, {len(tr_x)} train crops, {len(ho_x)} held-out crops "
        f"({report['data']['seconds']:.0f} s)")
    tr_yt, ho_yt = torch.from_numpy(tr_y), torch.from_numpy(ho_y)
    extra_common = dict(classes=class_names, image_size=IMAGE_SIZE, seed=seed)

    # ---- tokenizer ----
    vq_path = os.path.join(out_dir, "zoo-vq.safetensors")
    if resume and _exists(out_dir, "zoo-vq"):
        vq = VQModel(VQConfig(**VQ_CONFIG))
        load_into(vq, read_state_dict(vq_path), "vq", optional=("quantize.codebook_used",))
        vq.eval()
        log("vq: resumed from " + vq_path)
    else:
        t0 = time.perf_counter()
        vq = train_vq(tr_x, hp["vq_steps"], hp["vq_batch"], hp["vq_lr"], seed, log)
        report["vq_seconds"] = time.perf_counter() - t0
        save_model(vq, vq_path, vq.config.to_dict(), "vq", extra_common)
        save_report()
    n_enc = min(hp["n_encode_per_class"], hp["n_train_per_class"])
    enc_idx = (np.arange(nc)[:, None] * hp["n_train_per_class"] + np.arange(n_enc)[None]).reshape(-1)
    enc_y = tr_yt[torch.from_numpy(enc_idx)]
    codes_path = os.path.join(work_dir, "codes.pt")
    if resume and os.path.exists(codes_path):
        c = torch.load(codes_path)
        tr_codes, ho_codes = c["train"], c["heldout"]
    else:
        t0 = time.perf_counter()
        # The target trains on the first n_encode_per_class crops of each class (a prefix of each
        # class's crop stream, so it equals make_crops(n_encode_per_class)): encoding is slow on CPU.
        tr_codes = encode_crops(vq, tr_x[enc_idx], desc="encode train")
        ho_codes = encode_crops(vq, ho_x, desc="encode held-out")
        torch.save({"train": tr_codes, "heldout": ho_codes, "train_labels": enc_y, "heldout_labels": ho_yt},
                   codes_path)
        report["encode_seconds"] = time.perf_counter() - t0
    ho_img = zdata.to_tensor(ho_x)
    ho_rec = decode_codes(vq, ho_codes)
    report["vq_heldout_psnr"] = float(psnr(ho_rec, ho_img).mean())
    report["vq_codebook_usage_train"] = int(torch.unique(tr_codes).numel())
    log(f"vq: held-out PSNR {report['vq_heldout_psnr']:.2f} dB on {len(ho_x)} crops; "
        f"{report['vq_codebook_usage_train']}/{vq.config.codebook_size} codes used on train crops")
    save_report()

    # ---- classifier (real crops + VQ reconstructions) ----
    from ..evaluation.quality import SmallCNN

    cls_path = os.path.join(out_dir, "zoo-classifier.safetensors")
    if resume and _exists(out_dir, "zoo-classifier"):
        net = SmallCNN(nc)
        load_into(net, read_state_dict(cls_path), "classifier")
        net.eval()
    else:
        t0 = time.perf_counter()
        net = classifier_stage(vq, tr_x, tr_yt, tr_codes, enc_y, nc, hp, seed, log)
        report["classifier_seconds"] = time.perf_counter() - t0
        save_model(net, cls_path, dict(num_classes=nc, width=net.width), "classifier", extra_common)
    report["classifier_heldout_acc_real"] = classifier_accuracy(net, ho_img, ho_yt)
    report["classifier_heldout_acc_recon"] = classifier_accuracy(net, ho_rec, ho_yt)
    log(f"classifier: held-out accuracy {report['classifier_heldout_acc_real']:.3f} (real), "
        f"{report['classifier_heldout_acc_recon']:.3f} (VQ reconstructions)")
    save_report()

    # ---- target ----
    gpt_path = os.path.join(out_dir, "zoo-gpt.safetensors")
    if resume and _exists(out_dir, "zoo-gpt"):
        gpt = GPT(GPTConfig(**dict(GPT_CONFIG, num_classes=nc)))
        load_into(gpt, read_state_dict(gpt_path), "gpt")
        gpt.eval()
    else:
        t0 = time.perf_counter()
        gpt = train_gpt(tr_codes, enc_y, nc, hp["gpt_steps"], hp["gpt_batch"], hp["gpt_lr"], seed, log)
        report["gpt_seconds"] = time.perf_counter() - t0
        # Round to the shipped bf16 weights before measuring, so the figures describe what ships.
        gpt.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in gpt.state_dict().items()})
        save_model(gpt, gpt_path, gpt.config.to_dict(), "gpt", extra_common, dtype=torch.bfloat16)
    report["gpt_params"] = gpt.num_params()
    report["gpt_heldout_loss"] = gpt_loss(gpt, ho_codes, ho_yt)
    g = torch.Generator().manual_seed(seed + 5)
    sub = torch.randperm(len(tr_codes), generator=g)[: len(ho_codes)]
    report["gpt_train_loss"] = gpt_loss(gpt, tr_codes[sub], enc_y[sub])
    log(f"gpt: held-out loss {report['gpt_heldout_loss']:.3f} nats/token "
        f"(train subset {report['gpt_train_loss']:.3f}; uniform would be {math.log(1024):.3f})")
    save_report()

    # ---- drafter (last: needs the trained target) ----
    tok_path = os.path.join(work_dir, "drafter_train_tokens.pt")
    torch.save({"tokens": tr_codes, "labels": enc_y}, tok_path)
    if not (resume and _exists(out_dir, "zoo-drafter")):
        from .drafter import train_drafter

        t0 = time.perf_counter()
        torch.manual_seed(seed)
        dr = train_drafter(gpt, tr_codes, enc_y, steps=hp["drafter_steps"], batch_size=hp["drafter_batch"],
                           lr=hp["drafter_lr"], seed=seed, log=log)
        report["drafter_seconds"] = time.perf_counter() - t0
        save_model(dr, os.path.join(out_dir, "zoo-drafter.safetensors"), dr.config.to_dict(), "drafter",
                   extra_common, dtype=torch.bfloat16)
    report["total_seconds"] = time.perf_counter() - t_all
    save_report()
    log(f"zoo: trained in {report['total_seconds'] / 60:.1f} min -> {out_dir}")
    return report


# --------------------------------------------------------------------------------------------------
# The 32x32-token member: zoo-gpt-32 and zoo-drafter-32 on the shipped tokenizer
# --------------------------------------------------------------------------------------------------
GRID32_IMAGE_SIZE = 128  # zoo-vq downsamples 4x and is convolutional: 128 px -> 32x32 = 1024 codes
GPT32_CONFIG = dict(GPT_CONFIG, block_size=32 * 32)  # the same net: 2-D RoPE, no learned positions

# Sized (docs/zoo.md) to finish on ONE niced CPU thread of the shared 2-core machine in about 2 h
# (measured: a batch-4 fp32 step took about 8 s of wall time at half a core, 3-4x that under heavy
# contention; encoding the crops about 28 min).
# Each sequence has 4x the tokens of the 16x16 member, so a batch holds fewer sequences: 4 x 1024 tokens
# per step. 200 crops per class (3 200 sequences, 3.3 M tokens) are more than the run reads (2.5 M), and
# encoding at 128 px costs minutes per thousand crops; the held-out set is the first 32 crops of each
# class's held-out stream (the 64-px Zoo's held-out band and seed), its loss costs ~0.5 s per sequence.
GRID32_DEFAULTS = dict(n_encode_per_class=200, n_heldout_per_class=32,
                       gpt_steps=600, gpt_batch=4, gpt_lr=1e-3,  # a fine-tune of zoo-gpt (2e-3 from scratch)
                       drafter_steps=120, drafter_batch=4, drafter_lr=1e-3,
                       save_every=10, log_every=10, train_loss_sequences=128)


def train_grid32(out_dir: str, seed: int = 0, work_dir: Optional[str] = None, zoo_dir: Optional[str] = None,
                 resume: bool = False, log: Callable = print, threads: Optional[int] = None,
                 gpt_config: Optional[dict] = None, init_from: Optional[str] = "shipped", **overrides) -> dict:
    """Train the 32x32-token member of the Zoo: ``zoo-gpt-32`` and its drafter ``zoo-drafter-32``.

    The recipe of :func:`train_all`, at 128 px: the same classes, crop boxes (``make_crops`` draws a
    crop's box before resizing it, so the 128-px crops are the 64-px crops' boxes at twice the
    resolution), held-out band and seeds. The shipped ``zoo-vq`` (from ``zoo_dir``, default the
    package's checkpoints) encodes them; it and ``zoo-classifier`` are reused, not retrained.

    Writes ``zoo-gpt-32`` and ``zoo-drafter-32`` (bf16 safetensors + json) and ``train_report-32.json``
    to ``out_dir``. ``work_dir`` (default ``$VVS_CACHE/zoo_work/<out name>``) holds the encoded codes
    and the training states, saved every ``save_every`` steps; ``resume=True`` continues from them
    (and skips finished stages), otherwise stale states are deleted first. ``gpt_config``: another
    target architecture (default ``GPT32_CONFIG``; its ``block_size`` must stay 1024), e.g. a tiny one
    for tests. ``init_from``: a folder whose ``zoo-gpt`` (the 16x16 member; default "shipped", the
    package's, as the shipped zoo-gpt-32 was trained) the target starts from, or None for random weights: the same architecture, and 2-D RoPE has no
    weight that depends on the grid, so the 16x16 model's weights load as they are (a warm start, as
    LlamaGen fine-tunes its 384-px models at 512 px); the target's ``rope_grid_scale`` becomes the
    ratio of the grids (0.5: position interpolation, each 32x32 cell at the angles of the 16x16 grid,
    which the weights were trained on; held-out loss before any step 3.85 nats/token against 6.21 at
    scale 1, and 3.74 for the 600-step model trained from scratch).

    The target trains in fp32: bf16 autocast, faster for the 256-token member, was 7x slower per step
    at 1024 tokens on this CPU (27.9 vs 3.9 s of CPU for one batch-2 step)."""
    from ..checkpoint import load_into, read_state_dict
    from ..checkpoint import read_config
    from ..engine import load_vq
    from ..zoo import model_path

    gpt_config = dict(gpt_config or GPT32_CONFIG)

    hp = dict(GRID32_DEFAULTS)
    unknown = set(overrides) - set(hp)
    if unknown:
        raise ValueError(f"unknown training options for the 32x32 member: {sorted(unknown)}")
    hp.update(overrides)
    if threads:
        torch.set_num_threads(threads)
    os.makedirs(out_dir, exist_ok=True)
    if work_dir is None:  # never inside out_dir: that may be the package's checkpoints folder
        cache = os.path.expanduser(os.environ.get("VVS_CACHE", "~/.cache/vvs_engine"))
        work_dir = os.path.join(cache, "zoo_work", os.path.basename(os.path.abspath(out_dir)))
    os.makedirs(work_dir, exist_ok=True)
    gpt_state = os.path.join(work_dir, "zoo-gpt-32.state.pt")
    drafter_state = os.path.join(work_dir, "zoo-drafter-32.state.pt")
    if not resume:
        for p in (gpt_state, drafter_state):
            if os.path.exists(p):
                os.remove(p)
    report_path = os.path.join(out_dir, "train_report-32.json")
    report = {}
    if resume and os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
    vq_path = model_path("zoo-vq", zoo_dir)
    # the start is checked before any work (a missing file would otherwise end the run after encoding)
    init_path = None if init_from is None else model_path("zoo-gpt", None if init_from == "shipped" else init_from)
    report.update(seed=seed, hyperparameters=hp, threads=torch.get_num_threads(), torch=torch.__version__,
                  image_size=GRID32_IMAGE_SIZE, tokenizer="zoo-vq" + (f" from {zoo_dir}" if zoo_dir else " (shipped)"))

    def save_report():
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)

    t_all = time.perf_counter()
    vq = load_vq(vq_path)
    grid = GRID32_IMAGE_SIZE // vq.downsample
    if grid * grid != gpt_config["block_size"]:
        raise ValueError(f"{vq_path} downsamples {vq.downsample}x: {GRID32_IMAGE_SIZE} px gives a {grid}x{grid} "
                         f"grid, not 32x32")
    class_names = list(zdata.CLASS_NAMES)
    nc = len(class_names)
    extra_common = dict(classes=class_names, image_size=GRID32_IMAGE_SIZE, seed=seed, tokenizer="zoo-vq")

    # ---- data: the target's crops (the first n_encode_per_class of each class's stream) and held-out ----
    codes_path = os.path.join(work_dir, "codes-32.pt")
    if resume and os.path.exists(codes_path):
        c = torch.load(codes_path, weights_only=True)
        tr_codes, ho_codes, tr_y, ho_y = c["train"], c["heldout"], c["train_labels"], c["heldout_labels"]
        log(f"data: {len(tr_codes)} train and {len(ho_codes)} held-out code grids from {codes_path}")
    else:
        t0 = time.perf_counter()
        sources = zdata.photo_sources()
        tr_x, tr_y_np = zdata.make_crops(hp["n_encode_per_class"], seed, "train", GRID32_IMAGE_SIZE, sources)
        ho_x, ho_y_np = zdata.make_crops(hp["n_heldout_per_class"], seed, "heldout", GRID32_IMAGE_SIZE, sources)
        report["crop_seconds"] = time.perf_counter() - t0
        log(f"data: {nc} classes, {len(tr_x)} train and {len(ho_x)} held-out {GRID32_IMAGE_SIZE}-px crops "
            f"({report['crop_seconds']:.0f} s)")
        t0 = time.perf_counter()
        with torch.no_grad():
            tr_codes = encode_crops(vq, tr_x, batch=64, desc="encode train")
            ho_codes = encode_crops(vq, ho_x, batch=64, desc="encode held-out")
        tr_y, ho_y = torch.from_numpy(tr_y_np), torch.from_numpy(ho_y_np)
        del tr_x
        torch.save({"train": tr_codes, "heldout": ho_codes, "train_labels": tr_y, "heldout_labels": ho_y},
                   codes_path)
        report["encode_seconds"] = time.perf_counter() - t0
        ho_rec = decode_codes(vq, ho_codes, batch=32)
        report["vq_heldout_psnr"] = float(psnr(ho_rec, zdata.to_tensor(ho_x)).mean())
        del ho_rec, ho_x
        log(f"vq at {GRID32_IMAGE_SIZE} px: held-out PSNR {report['vq_heldout_psnr']:.2f} dB; encoding took "
            f"{report['encode_seconds'] / 60:.1f} min")
    if tr_codes.shape[1] != gpt_config["block_size"]:
        raise ValueError(f"{codes_path} holds {tr_codes.shape[1]} codes per image, not {gpt_config['block_size']}")
    report["data"] = dict(classes=class_names, n_target_train=len(tr_codes), n_heldout=len(ho_codes),
                          heldout="right-most 25% of each photo's width")
    report["vq_codebook_usage_train"] = int(torch.unique(tr_codes).numel())
    save_report()

    # ---- target ----
    gpt_path = os.path.join(out_dir, "zoo-gpt-32.safetensors")
    if resume and _exists(out_dir, "zoo-gpt-32"):
        gpt = GPT(GPTConfig.from_dict(read_config(gpt_path)["config"]))
        load_into(gpt, read_state_dict(gpt_path), "gpt")
        gpt.eval()
        log("gpt: loaded the finished " + gpt_path)
    else:
        t0 = time.perf_counter()
        init = None
        if init_path is not None:
            with open(init_path, "rb") as f:
                init_digest = hashlib.sha256(f.read()).hexdigest()[:16]
            init = (f"zoo-gpt sha256:{init_digest}", {k: v.float() for k, v in read_state_dict(init_path).items()})
            # position interpolation: the 32x32 grid's rows and columns at the init model's angles
            init_cfg = GPTConfig.from_dict(read_config(init_path)["config"])
            scale = init_cfg.rope_grid_scale * init_cfg.grid_size / GPTConfig.from_dict(gpt_config).grid_size
            gpt_config = dict(gpt_config, rope_grid_scale=scale)
            report["init_from"] = dict(path=os.path.abspath(init_path), sha256_16=init_digest, rope_grid_scale=scale)
            log(f"gpt: starting from {init_path} (positions x{scale:g})")
        gpt = train_gpt(tr_codes, tr_y, nc, hp["gpt_steps"], hp["gpt_batch"], hp["gpt_lr"], seed, log,
                        config=gpt_config, amp=False, state_path=gpt_state, save_every=hp["save_every"],
                        log_every=hp["log_every"], init=init)
        # the training loop's wall time summed over the processes of a resumed run (saved in the state)
        report["gpt_seconds"] = float(torch.load(gpt_state, weights_only=True)["seconds"])
        report["gpt_seconds_this_process"] = time.perf_counter() - t0
        # Round to the shipped bf16 weights before measuring, so the figures describe what ships.
        gpt.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in gpt.state_dict().items()})
        save_model(gpt, gpt_path, gpt.config.to_dict(), "gpt", extra_common, dtype=torch.bfloat16)
        save_report()
    if "gpt_heldout_loss" not in report:
        t0 = time.perf_counter()
        report["gpt_params"] = gpt.num_params()
        report["gpt_heldout_loss"] = gpt_loss(gpt, ho_codes, ho_y, batch=16)
        g = torch.Generator().manual_seed(seed + 5)
        sub = torch.randperm(len(tr_codes), generator=g)[: hp["train_loss_sequences"]]
        report["gpt_train_loss"] = gpt_loss(gpt, tr_codes[sub], tr_y[sub], batch=16)
        report["loss_eval_seconds"] = time.perf_counter() - t0
        save_report()
    log(f"gpt: held-out loss {report['gpt_heldout_loss']:.3f} nats/token on {len(ho_codes)} crops "
        f"(train subset of {hp['train_loss_sequences']}: {report['gpt_train_loss']:.3f}; uniform "
        f"{math.log(1024):.3f})")

    # ---- drafter ----
    if not (resume and _exists(out_dir, "zoo-drafter-32")):
        from .drafter import train_drafter

        t0 = time.perf_counter()
        torch.manual_seed(seed)
        dr = train_drafter(gpt, tr_codes, tr_y, steps=hp["drafter_steps"], batch_size=hp["drafter_batch"],
                           lr=hp["drafter_lr"], seed=seed, log=log, progress=False, state_path=drafter_state,
                           save_every=max(1, hp["save_every"] // 2))
        report["drafter_seconds"] = time.perf_counter() - t0
        save_model(dr, os.path.join(out_dir, "zoo-drafter-32.safetensors"), dr.config.to_dict(), "drafter",
                   extra_common, dtype=torch.bfloat16)
    report["total_seconds_last_process"] = time.perf_counter() - t_all
    save_report()
    log(f"zoo-gpt-32: done -> {out_dir} (this process {report['total_seconds_last_process'] / 60:.1f} min)")
    return report


def main(argv=None):
    """``python -m vvs_engine.training.zoo OUT_DIR [--grid 16|32] [--seed S] [--resume] [--data DIR]
    [--threads N] [--key value]``"""
    from ..errors import OneLineParser, UsageError, VVSError

    p = OneLineParser(prog="python -m vvs_engine.training.zoo",
                      description="Retrain the Zoo (tokenizer, classifier, target, drafter) from scratch; "
                                  "--grid 32: train the 32x32-token member (zoo-gpt-32, zoo-drafter-32) on "
                                  "the shipped tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--grid", type=int, default=16, choices=(16, 32),
                   help="16: the whole 64-px Zoo (default); 32: zoo-gpt-32 + zoo-drafter-32 at 128 px")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--data", default=None, help="image folder with one sub-folder per class (--grid 16)")
    p.add_argument("--zoo-dir", default=None, help="--grid 32: folder of the zoo-vq to reuse (default: shipped)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="--grid 32: start the target from the zoo-gpt in DIR (default 'shipped': the package's, "
                        "as the shipped zoo-gpt-32 was trained; 'none': random weights, then consider "
                        "--gpt-lr 2e-3)")
    keys = dict(DEFAULTS)
    keys.update({k: v for k, v in GRID32_DEFAULTS.items() if k not in keys})
    for k, v in keys.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                       help=f"default {DEFAULTS.get(k, '-')} (--grid 16), {GRID32_DEFAULTS.get(k, '-')} (--grid 32)")
    try:
        a = p.parse_args(argv)
        defaults = DEFAULTS if a.grid == 16 else GRID32_DEFAULTS
        given = {k: getattr(a, k) for k in keys if getattr(a, k) is not None}
        wrong = [k for k in given if k not in defaults]
        if wrong:
            raise UsageError(f"--grid {a.grid} has no option {', '.join('--' + k.replace('_', '-') for k in wrong)}")
        if a.grid == 16:
            if a.zoo_dir or a.init_from:
                raise UsageError(f"--{'zoo-dir' if a.zoo_dir else 'init-from'} is for --grid 32")
            train_all(a.out_dir, seed=a.seed, work_dir=a.work_dir, data_root=a.data, resume=a.resume,
                      threads=a.threads, **given)
        else:
            if a.data:
                raise UsageError("--data is for --grid 16: the 32x32 member uses the built-in photos")
            init_from = "shipped" if a.init_from is None else (None if a.init_from == "none" else a.init_from)
            train_grid32(a.out_dir, seed=a.seed, work_dir=a.work_dir, zoo_dir=a.zoo_dir, resume=a.resume,
                         threads=a.threads, init_from=init_from, **given)
    except UsageError as e:  # the CLI's codes: 2 bad arguments, 1 other user errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except VVSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
