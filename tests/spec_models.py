"""Small random models for the speculative-decoding tests (float64 so greedy ties cannot flip)."""
from __future__ import annotations

import torch

from vvs_engine.drafting.drafter import Drafter, DrafterConfig
from vvs_engine.engine import Engine
from vvs_engine.models.gpt import GPT, GPTConfig
from vvs_engine.models.vq import VQConfig, VQModel


LABELS = [0, 3, 4]  # the labels of conftest's greedy_ar fixture (test_scd.py, test_sjd_pac.py)


def tiny_engine(vocab=64, block=16, seed=0, peak=1.0, dtype=torch.float64, with_vq=True, dim=32, n_layer=2):
    """A random c2i target + drafter (+ a VQ whose codebook defines LANTERN neighbours). ``peak``
    scales the output heads so the distributions are less flat than at initialisation."""
    torch.manual_seed(seed)
    g = GPT(GPTConfig(dim=dim, n_layer=n_layer, n_head=4, vocab_size=vocab, num_classes=5, block_size=block,
                      multiple_of=32))
    with torch.no_grad():
        g.output.weight.mul_(peak)
    d = Drafter(DrafterConfig(dim=dim, n_head=4)).attach(g)
    vq = None
    if with_vq:
        vq = VQModel(VQConfig(codebook_size=vocab, codebook_embed_dim=8, encoder_ch_mult=[1, 2],
                              decoder_ch_mult=[1, 2], z_channels=32, base_channels=32))
    e = Engine(g, vq, d)
    g.to(dtype)
    d.to(dtype)
    e.dtype = dtype
    return e


NUM_CLASSES = 10  # the CLI tests' tiny checkpoints (tests/conftest.py's ckpts)


def tiny_gpt_config(**kw) -> GPTConfig:
    base = dict(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=64, num_classes=NUM_CLASSES, block_size=16)
    base.update(kw)
    return GPTConfig(**base)


def tiny_vq_config() -> VQConfig:
    return VQConfig(codebook_size=64, codebook_embed_dim=8, encoder_ch_mult=[1, 1], decoder_ch_mult=[1, 1],
                    z_channels=32, base_channels=32, num_res_blocks=1)
