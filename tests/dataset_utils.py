"""Shared by the dataset tests: tiny checkpoint files and an engine that fails at a chosen image."""
from __future__ import annotations

import os

import numpy as np
import torch

from vvs_engine.checkpoint import save_safetensors
from vvs_engine.drafting.drafter import Drafter, DrafterConfig
from vvs_engine.models.gpt import GPT, GPTConfig
from vvs_engine.models.vq import VQConfig, VQModel

TINY_CLASSES = 10
TINY_IMAGE_SIZE = 8  # 4x4 tokens with the tiny tokenizer's downsampling of 2


def write_tiny_checkpoints(d, drafter: bool = False) -> dict:
    """A random c2i GPT (16 tokens per image) and VQ saved as safetensors + JSON config -> model dict;
    ``drafter``: also a random EAGLE drafter for it (the speculative methods), its output head scaled so
    the target's distributions are peaked enough for drafts to be accepted."""
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    gcfg = GPTConfig(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=64, num_classes=TINY_CLASSES,
                     block_size=16)
    vcfg = VQConfig(codebook_size=64, codebook_embed_dim=8, encoder_ch_mult=[1, 1], decoder_ch_mult=[1, 1],
                    z_channels=32, base_channels=32, num_res_blocks=1)
    gpt_path, vq_path = os.path.join(d, "gpt.safetensors"), os.path.join(d, "vq.safetensors")
    gpt = GPT(gcfg)
    if drafter:
        with torch.no_grad():
            gpt.output.weight.mul_(3.0)
    save_safetensors(gpt, gpt_path, gcfg.to_dict(), kind="gpt")
    save_safetensors(VQModel(vcfg), vq_path, vcfg.to_dict(), kind="vq")
    model = {"gpt_ckpt": gpt_path, "vq_ckpt": vq_path, "image_size": TINY_IMAGE_SIZE, "device": "cpu"}
    if drafter:
        draft = Drafter(DrafterConfig(dim=gcfg.dim, n_head=gcfg.n_head))
        model["drafter"] = os.path.join(d, "drafter.safetensors")
        save_safetensors(draft, model["drafter"], draft.config.to_dict(), kind="drafter")
    return model


class FailingEngine:
    """Wraps an engine; generating image ``fail_index`` raises (``how="raise"``) or ends the process
    (``how="exit"``, a killed worker). With a ``marker`` file it fails only the first time."""

    def __init__(self, engine, fail_index: int, how: str = "raise", marker=None):
        self.engine, self.fail_index, self.how, self.marker = engine, fail_index, how, marker

    @property
    def device(self):
        return self.engine.device

    def generate(self, **kw):
        if self.fail_index in kw["image_indices"] and not (self.marker and os.path.exists(self.marker)):
            if self.marker:
                open(self.marker, "w").close()
            if self.how == "exit":
                os._exit(1)
            raise RuntimeError("simulated worker crash")
        return self.engine.generate(**kw)


def failing_factory(fail_index: int, how: str = "raise", marker=None):
    def factory(model):
        from vvs_engine.dataset import load_engine

        return FailingEngine(load_engine(model), fail_index, how, marker)
    return factory


def read_all(out_dir) -> dict:
    """Every shard of a dataset folder concatenated (tokens, index, labels), plus the PNG names."""
    names = sorted(f for f in os.listdir(out_dir) if f.startswith("shard-"))
    zs = [np.load(os.path.join(out_dir, f)) for f in names]
    out = {k: np.concatenate([z[k] for z in zs]) for k in ("tokens", "index", "labels")}
    out["pngs"] = sorted(f for f in os.listdir(out_dir) if f.endswith(".png"))
    out["shards"] = names
    out["other"] = sorted(f for f in os.listdir(out_dir) if not f.endswith((".png", ".npz")) and f != "manifest.json")
    return out
