"""LlamaGen's VQ tokenizer (encoder, l2-normalised codebook quantizer, decoder).

Module names follow ``tokenizer/tokenizer_image/vq_model.py`` so official ``vq_ds16_*.pt`` weights load
unchanged. Two fields that the official code fixes (``base_channels`` 128, ``num_res_blocks`` 2) are
configurable here so the project can train small tokenizers; their defaults are the official values.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import ConfigField, check_config_fields, check_weight_shape, clean_state_dict, layer_count
from ..errors import VVSError


@dataclass
class VQConfig:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    commit_loss_beta: float = 0.25
    encoder_ch_mult: List[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    decoder_ch_mult: List[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    z_channels: int = 256
    base_channels: int = 128
    num_res_blocks: int = 2
    dropout_p: float = 0.0

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VQConfig":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


# The fields VQConfig.from_dict reads from a project config, checked before a tokenizer is built.
VQ_CONFIG_FIELDS = {
    "codebook_size": ConfigField("int", 1), "codebook_embed_dim": ConfigField("int", 1),
    "codebook_l2_norm": ConfigField("bool"), "encoder_ch_mult": ConfigField("int list", 1),
    "decoder_ch_mult": ConfigField("int list", 1), "z_channels": ConfigField("int", 1),
    "base_channels": ConfigField("int", 1), "num_res_blocks": ConfigField("int", 1),
    # training only: checked when given
    "codebook_show_usage": ConfigField("bool", required=False), "commit_loss_beta": ConfigField("number", 0, required=False),
    "dropout_p": ConfigField("number", 0, required=False),
}


def checked_vq_config(config: dict, where: str, sd: Optional[dict] = None) -> "VQConfig":
    """A project config as a VQConfig, checked field by field and, given the state dict ``sd``, against
    the weights; a one-line error naming the field and ``where``."""
    check_config_fields(config, VQ_CONFIG_FIELDS, where)
    cfg = VQConfig.from_dict(config)
    if sd is None:
        return cfg
    sd = clean_state_dict(sd)
    check_weight_shape(sd, "quantize.embedding.weight", (cfg.codebook_size, cfg.codebook_embed_dim),
                       '"codebook_size" and "codebook_embed_dim"', where)
    check_weight_shape(sd, "encoder.conv_in.weight", (cfg.base_channels, None, None, None), '"base_channels"', where)
    check_weight_shape(sd, "quant_conv.weight", (cfg.codebook_embed_dim, cfg.z_channels, 1, 1), '"z_channels"', where)
    for part in ("encoder", "decoder"):
        blocks = layer_count(sd, f"{part}.conv_blocks.")
        levels = len(getattr(cfg, f"{part}_ch_mult"))
        if blocks and blocks != levels:
            raise VVSError(f"{where}: \"{part}_ch_mult\" has {levels} levels but the weights hold {blocks}")
    res = layer_count(sd, "encoder.conv_blocks.0.res.")
    if res and res != cfg.num_res_blocks:
        raise VVSError(f"{where}: \"num_res_blocks\" is {cfg.num_res_blocks} but the weights hold {res}")
    return cfg


VQ_PRESETS = {
    "VQ-16": dict(),
    "VQ-8": dict(encoder_ch_mult=[1, 2, 2, 4], decoder_ch_mult=[1, 2, 2, 4]),
}


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2 = _norm(cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1, 1, 0)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm = _norm(c)
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)
        self.v = nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        h = self.norm(x)
        b, c, hh, ww = h.shape
        q = self.q(h).reshape(b, c, hh * ww).transpose(1, 2)
        k = self.k(h).reshape(b, c, hh * ww).transpose(1, 2)
        v = self.v(h).reshape(b, c, hh * ww).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(y.transpose(1, 2).reshape(b, c, hh, ww))


class Downsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        return self.conv(F.interpolate(x.float(), scale_factor=2.0, mode="nearest").to(x.dtype))


class Encoder(nn.Module):
    def __init__(self, ch: int, ch_mult, num_res_blocks: int, z_channels: int, dropout: float, in_channels=3):
        super().__init__()
        self.num_res_blocks = num_res_blocks
        self.conv_in = nn.Conv2d(in_channels, ch, 3, 1, 1)
        in_mult = (1,) + tuple(ch_mult)
        self.conv_blocks = nn.ModuleList()
        n = len(ch_mult)
        for i in range(n):
            blk = nn.Module()
            blk.res, blk.attn = nn.ModuleList(), nn.ModuleList()
            cin, cout = ch * in_mult[i], ch * ch_mult[i]
            for _ in range(num_res_blocks):
                blk.res.append(ResnetBlock(cin, cout, dropout))
                cin = cout
                if i == n - 1:
                    blk.attn.append(AttnBlock(cin))
            if i != n - 1:
                blk.downsample = Downsample(cin)
            self.conv_blocks.append(blk)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin, dropout), AttnBlock(cin), ResnetBlock(cin, cin, dropout)])
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for blk in self.conv_blocks:
            for j in range(self.num_res_blocks):
                h = blk.res[j](h)
                if len(blk.attn):
                    h = blk.attn[j](h)
            if hasattr(blk, "downsample"):
                h = blk.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch: int, ch_mult, num_res_blocks: int, z_channels: int, dropout: float, out_channels=3):
        super().__init__()
        self.num_res_blocks = num_res_blocks
        n = len(ch_mult)
        cin = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, cin, 3, 1, 1)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin, dropout), AttnBlock(cin), ResnetBlock(cin, cin, dropout)])
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(n)):
            blk = nn.Module()
            blk.res, blk.attn = nn.ModuleList(), nn.ModuleList()
            cout = ch * ch_mult[i]
            for _ in range(num_res_blocks + 1):
                blk.res.append(ResnetBlock(cin, cout, dropout))
                cin = cout
                if i == n - 1:
                    blk.attn.append(AttnBlock(cin))
            if i != 0:
                blk.upsample = Upsample(cin)
            self.conv_blocks.append(blk)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, out_channels, 3, 1, 1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for blk in self.conv_blocks:
            for j in range(self.num_res_blocks + 1):
                h = blk.res[j](h)
                if len(blk.attn):
                    h = blk.attn[j](h)
            if hasattr(blk, "upsample"):
                h = blk.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, n_e: int, e_dim: int, beta: float, l2_norm: bool, show_usage: bool):
        super().__init__()
        self.n_e, self.e_dim, self.beta, self.l2_norm = n_e, e_dim, beta, l2_norm
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.uniform_(-1.0 / n_e, 1.0 / n_e)
        if l2_norm:
            self.embedding.weight.data = F.normalize(self.embedding.weight.data, p=2, dim=-1)
        if show_usage:
            self.register_buffer("codebook_used", torch.zeros(65536))

    def codebook(self) -> torch.Tensor:
        w = self.embedding.weight
        return F.normalize(w, p=2, dim=-1) if self.l2_norm else w

    def forward(self, z: torch.Tensor):
        """z: [B, C, h, w] -> (z_q with straight-through gradient, codebook loss, commit loss, codes [B, h*w])."""
        z = z.permute(0, 2, 3, 1).contiguous()
        if self.l2_norm:
            z = F.normalize(z, p=2, dim=-1)
        flat = z.view(-1, self.e_dim)
        emb = self.codebook()
        d = flat.pow(2).sum(1, keepdim=True) + emb.pow(2).sum(1) - 2 * flat @ emb.t()
        idx = d.argmin(1)
        zq = emb[idx].view(z.shape)
        codebook_loss = F.mse_loss(zq, z.detach())
        commit_loss = self.beta * F.mse_loss(zq.detach(), z)
        zq = z + (zq - z).detach()
        return zq.permute(0, 3, 1, 2).contiguous(), codebook_loss, commit_loss, idx.view(z.shape[0], -1)

    def lookup(self, codes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """codes [B, h*w] -> [B, C, h, w]"""
        return self.codebook()[codes].view(codes.shape[0], h, w, self.e_dim).permute(0, 3, 1, 2).contiguous()


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg.base_channels, cfg.encoder_ch_mult, cfg.num_res_blocks, cfg.z_channels, cfg.dropout_p)
        self.decoder = Decoder(cfg.base_channels, cfg.decoder_ch_mult, cfg.num_res_blocks, cfg.z_channels, cfg.dropout_p)
        self.quantize = VectorQuantizer(cfg.codebook_size, cfg.codebook_embed_dim, cfg.commit_loss_beta,
                                        cfg.codebook_l2_norm, cfg.codebook_show_usage)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    @property
    def downsample(self) -> int:
        return self.config.downsample

    def forward(self, images: torch.Tensor):
        """Training pass: images in [-1, 1] -> (reconstruction, codebook loss, commit loss, codes)."""
        zq, cb, cm, codes = self.quantize(self.quant_conv(self.encoder(images)))
        return self.decoder(self.post_quant_conv(zq)), cb, cm, codes

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> codes [B, (H/ds)*(W/ds)] (int64, row-major)."""
        return self.quantize(self.quant_conv(self.encoder(images)))[3]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, grid: int | None = None) -> torch.Tensor:
        """codes [B, n] (n a perfect square unless ``grid`` given) -> images [B, 3, H, W], unclamped."""
        if grid is None:
            grid = int(round(codes.shape[1] ** 0.5))
        zq = self.quantize.lookup(codes, grid, codes.shape[1] // grid)
        return self.decoder(self.post_quant_conv(zq.to(self.post_quant_conv.weight.dtype)))

    def codebook_vectors(self) -> torch.Tensor:
        """The (normalised) codebook ``[codebook_size, embed_dim]``: VVS-D path similarity, LANTERN
        neighbours and GSD distances all live in this space."""
        return self.quantize.codebook().detach()


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Decoder output -> uint8 HWC, as LlamaGen's sample scripts: clamp to [-1, 1], map to [0, 255], round."""
    x = (images.float().clamp(-1, 1) + 1) * 127.5
    return x.round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
