"""Image decoders of Hugging Face checkpoint families: codes -> pixels.

Janus-Pro's generation tokenizer is LlamaGen's VQ-16 in the taming layout (``decoder.up[i]``, l2-
normalised codebook). Only the decoding half is built: the engine never encodes images through the
target's tokenizer at inference time. Parameter names follow transformers' ``JanusVQVAE`` below its
``model.vqmodel.`` prefix, so the weights load as they are.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from .vq import AttnBlock, ResnetBlock, Upsample, _norm


@dataclass
class TamingVQConfig:
    codebook_size: int
    codebook_embed_dim: int
    latent_channels: int
    base_channels: int
    channel_multiplier: List[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    grid: int = 24  # codes per side
    out_channels: int = 3

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.channel_multiplier) - 1)

    def to_dict(self) -> dict:
        return asdict(self)


class TamingDecoder(nn.Module):
    def __init__(self, cfg: TamingVQConfig):
        super().__init__()
        mult, n_res = cfg.channel_multiplier, cfg.num_res_blocks
        block_in = cfg.base_channels * mult[-1]
        self.conv_in = nn.Conv2d(cfg.latent_channels, block_in, 3, 1, 1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        self.up = nn.ModuleList()
        for level in reversed(range(len(mult))):  # stored lowest resolution first
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            block_out = cfg.base_channels * mult[level]
            for _ in range(n_res + 1):
                up.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if level == len(mult) - 1:  # attention only at the lowest resolution
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = Upsample(block_in)
            self.up.append(up)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_channels, 3, 1, 1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for i, up in enumerate(self.up):
            for j, block in enumerate(up.block):
                h = block(h)
                if len(up.attn):
                    h = up.attn[j](h)
            if i != len(self.up) - 1:
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class _Quantize(nn.Module):
    def __init__(self, n: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(n, dim)


class TamingVQDecoder(nn.Module):
    """codes [B, grid²] -> images [B, 3, H, W] in about [-1, 1]; the engine's tokenizer interface
    (``config.codebook_size``, ``decode``, ``codebook_vectors``, ``downsample``)."""

    def __init__(self, cfg: TamingVQConfig):
        super().__init__()
        self.config = cfg
        self.quantize = _Quantize(cfg.codebook_size, cfg.codebook_embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.latent_channels, 1)
        self.decoder = TamingDecoder(cfg)

    @property
    def downsample(self) -> int:
        return self.config.downsample

    def codebook_vectors(self) -> torch.Tensor:
        """The l2-normalised codebook: the space LANTERN neighbourhoods and GSD distances use."""
        return F.normalize(self.quantize.embedding.weight, p=2, dim=-1).detach()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, grid: int | None = None) -> torch.Tensor:
        g = grid or self.config.grid
        cb = self.codebook_vectors()
        z = cb[codes].view(codes.shape[0], g, codes.shape[1] // g, -1).permute(0, 3, 1, 2).contiguous()
        return self.decoder(self.post_quant_conv(z.to(self.post_quant_conv.weight.dtype)))
