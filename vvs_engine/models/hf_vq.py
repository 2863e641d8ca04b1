"""Image decoders of Hugging Face checkpoint families: codes -> pixels.

* Janus-Pro: LlamaGen's VQ-16 (``decoder.up[i]`` lowest resolution first, l2-normalised codebook);
  names of transformers' ``JanusVQVAE`` below ``model.vqmodel.``.
* Lumina-mGPT: Chameleon's VQGAN, taming's own layout (``decoder.up[level]``, plain codebook,
  attention where ``attn_resolutions`` says); names of the taming checkpoint.
* Emu3: the MoVQ decoder (spatially conditioned norms, a causal temporal stage); names of
  transformers' ``Emu3VQVAE``.

Only the decoding halves are built: the engine never encodes images at inference time. Lumina-mGPT
and Emu3 decoders take the methods' tokens (rows closed by the end-of-line index) and drop that column.
"""
from __future__ import annotations

import math
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


# --- Lumina-mGPT / Chameleon: the taming VQGAN decoder ------------------------------------------------
@dataclass
class ChameleonVQConfig:
    """Chameleon's VQGAN, described by the folder's ``vq_config`` (transformers' ``ChameleonVQVAEConfig``
    fields; taming's ``ch``, ``ch_mult``, ``z_channels``, ``attn_resolutions``, ``resolution``)."""

    codebook_size: int  # codes plus the layout's end-of-line token (the methods' vocabulary)
    codebook_embed_dim: int
    latent_channels: int
    base_channels: int
    channel_multiplier: List[int]
    num_res_blocks: int
    attn_resolutions: List[int]
    resolution: int
    grid_h: int
    grid_w: int
    out_channels: int = 3

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.channel_multiplier) - 1)

    @property
    def grid(self) -> int:
        return self.grid_h

    def to_dict(self) -> dict:
        return asdict(self)


class VQGANDecoder(nn.Module):
    """Taming's decoder in its own layout: ``up[level]`` with level 0 the full resolution, attention
    after each block of a level whose side (in the training ``resolution``) is in ``attn_resolutions``."""

    def __init__(self, cfg: ChameleonVQConfig):
        super().__init__()
        mult, n_res = cfg.channel_multiplier, cfg.num_res_blocks
        block_in = cfg.base_channels * mult[-1]
        side = cfg.resolution // cfg.downsample
        self.conv_in = nn.Conv2d(cfg.latent_channels, block_in, 3, 1, 1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        levels = []
        for level in reversed(range(len(mult))):  # built from the lowest resolution up
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            block_out = cfg.base_channels * mult[level]
            for _ in range(n_res + 1):
                up.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if side in cfg.attn_resolutions:
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = Upsample(block_in)
                side *= 2
            levels.append(up)
        self.up = nn.ModuleList(levels[::-1])  # stored by level, as the checkpoints name them
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_channels, 3, 1, 1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for j, block in enumerate(up.block):
                h = block(h)
                if len(up.attn):
                    h = up.attn[j](h)
            if level != 0:
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def codes_without_row_ends(tokens: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Method tokens [B, h*(w+1)] (each row closed by the end-of-line token) -> codes [B, h, w]."""
    return tokens.view(tokens.shape[0], grid_h, grid_w + 1)[:, :, :grid_w]


class _RowEndDecoder(nn.Module):
    """What the Lumina and Emu3 decoders share: codebook vectors with a far end-of-line row, the
    downsampling factor of their config and the number of real codes."""

    can_decode = True

    @property
    def downsample(self) -> int:
        return self.config.downsample

    @property
    def n_codes(self) -> int:
        """Rows of ``codebook_vectors`` that are codes (the last one stands for end-of-line)."""
        return self.config.codebook_size - 1

    def codebook_vectors(self) -> torch.Tensor:
        return codebook_with_far_row_end(self.quantize.embedding.weight)


class ChameleonVQDecoder(_RowEndDecoder):
    """Lumina-mGPT's image decoder: method tokens [B, h*(w+1)] -> images [B, 3, 16h, 16w] in about
    [-1, 1]. Plain (not normalised) codebook lookup, ``post_quant_conv``, taming decoder. The codebook
    vectors (LANTERN/GSD neighbourhoods) are the VQ embeddings; end-of-line sits far from every code."""

    def __init__(self, cfg: ChameleonVQConfig):
        super().__init__()
        self.config = cfg
        self.quantize = _Quantize(cfg.codebook_size - 1, cfg.codebook_embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.latent_channels, 1)
        self.decoder = VQGANDecoder(cfg)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, grid: int | None = None) -> torch.Tensor:
        c = self.config
        codes = codes_without_row_ends(tokens, c.grid_h, c.grid_w)
        z = self.quantize.embedding(codes).permute(0, 3, 1, 2).to(self.post_quant_conv.weight.dtype)
        return self.decoder(self.post_quant_conv(z))


def codebook_with_far_row_end(weight: torch.Tensor) -> torch.Tensor:
    """VQ embeddings plus one row for the end-of-line token, far from every code in L2, so LANTERN's
    neighbour table never pairs it with a code (GSD's unit codebook drops it: ``n_codes``)."""
    w = weight.detach()
    far = -1e4 * F.normalize(w.float().mean(0, keepdim=True), dim=-1).to(w.dtype)
    return torch.cat([w, far])


# --- Emu3: the MoVQ decoder (spatially conditioned norms, a causal temporal stage) --------------------
@dataclass
class Emu3VQConfig:
    """Emu3's vision tokenizer, described by the folder's ``vq_config`` (transformers' ``Emu3VQVAEConfig``)."""

    codebook_size: int  # codes plus the end-of-line token
    embed_dim: int
    latent_channels: int
    base_channels: int
    channel_multiplier: List[int]
    num_res_blocks: int
    attn_resolutions: List[int]  # level indices (not sides) with attention after each block
    hidden_size: int  # attention width
    num_attention_heads: int
    temporal_downsample_factor: int
    grid_h: int
    grid_w: int
    out_channels: int = 3
    # The normalisation of the tokenizer's pixels (the folder's preprocessor_config.json): decoded
    # values are pixel/255 = x * std + mean; decode() maps them to the engine's [-1, 1] convention.
    pixel_mean: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    pixel_std: List[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.channel_multiplier) - 1)

    @property
    def grid(self) -> int:
        return self.grid_h

    def to_dict(self) -> dict:
        return asdict(self)


class CausalConv3d(nn.Module):
    """Conv3d padded causally in time (two frames before, none after) and 'same' in space."""

    def __init__(self, cin: int, cout: int, kernel: tuple):
        super().__init__()
        kt, kh, kw = kernel
        self.pad = ((kw - 1) // 2 + (kw - 1) % 2, (kw - 1) // 2, (kh - 1) // 2 + (kh - 1) % 2, (kh - 1) // 2, 2, 0)
        self.conv = nn.Conv3d(cin, cout, kernel)

    def forward(self, x):
        return self.conv(F.pad(x, self.pad))


class TemporalResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm3d(c), CausalConv3d(c, c, (3, 3, 3))
        self.norm2, self.conv2 = nn.BatchNorm3d(c), CausalConv3d(c, c, (3, 3, 3))

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class TemporalUpsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = CausalConv3d(c, c, (3, 3, 3))

    def forward(self, x):  # [B, C, T, H, W] -> [B, C, 2T, H, W]
        return self.conv(x.repeat_interleave(2, dim=2))


class SpatialNorm(nn.Module):
    """GroupNorm whose scale and shift are 1x1 convolutions of the (nearest-upsampled) code vectors."""

    def __init__(self, quant_channels: int, c: int):
        super().__init__()
        self.norm_layer = _norm(c)
        self.conv_y = nn.Conv2d(quant_channels, c, 1)
        self.conv_b = nn.Conv2d(quant_channels, c, 1)

    def forward(self, x, q):
        q = F.interpolate(q, size=x.shape[-2:], mode="nearest")
        return self.norm_layer(x) * self.conv_y(q) + self.conv_b(q)


class MoVQResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, quant_channels: int):
        super().__init__()
        self.norm1, self.conv1 = SpatialNorm(quant_channels, cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.conv2 = SpatialNorm(quant_channels, cout), nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x, q):
        h = self.conv1(F.silu(self.norm1(x, q)))
        h = self.conv2(F.silu(self.norm2(h, q)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class PixelAttention(nn.Module):
    """Multi-head self-attention over the pixels of a feature map (linear projections)."""

    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):  # [B, C, H, W], already normalised
        b, c, hh, ww = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = (p(t).view(b, hh * ww, self.n_head, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, hh * ww, c)
        return self.out_proj(y).transpose(1, 2).reshape(b, c, hh, ww)


class MoVQDecoder(nn.Module):
    def __init__(self, cfg: Emu3VQConfig):
        super().__init__()
        qc, lat, mult = cfg.embed_dim, cfg.latent_channels, cfg.channel_multiplier
        self.time_res_stack = nn.ModuleList(TemporalResBlock(lat) for _ in range(cfg.num_res_blocks))
        n_up = int(math.log2(cfg.temporal_downsample_factor))
        self.time_conv = nn.ModuleList(TemporalUpsample(lat) for _ in range(n_up))
        block_in = cfg.base_channels * mult[-1]
        self.conv_in = nn.Conv2d(lat, block_in, 3, 1, 1)
        self.middle_block = nn.Module()
        self.middle_block.block_1 = MoVQResBlock(block_in, block_in, qc)
        self.middle_block.attn_norm = SpatialNorm(qc, block_in)
        self.middle_block.attn_1 = PixelAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.middle_block.block_2 = MoVQResBlock(block_in, block_in, qc)
        levels = []
        for level in reversed(range(len(mult))):
            up = nn.Module()
            up.block, up.attn, up.attn_norms = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
            block_out = cfg.base_channels * mult[level]
            for _ in range(cfg.num_res_blocks + 1):
                up.block.append(MoVQResBlock(block_in, block_out, qc))
                block_in = block_out
                if level in cfg.attn_resolutions:
                    up.attn.append(PixelAttention(cfg.hidden_size, cfg.num_attention_heads))
                    up.attn_norms.append(SpatialNorm(qc, block_in))
            if level != 0:
                up.upsample = Upsample(block_in)
            levels.append(up)
        self.up_block = nn.Module()
        self.up_block.up = nn.ModuleList(levels[::-1])
        self.norm_out = SpatialNorm(qc, block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_channels, 3, 1, 1)

    def temporal(self, x):
        """[B, C, T, H, W] -> [B, C, T * factor, H, W]: causal residual blocks, then time upsampling."""
        for block in self.time_res_stack:
            x = block(x)
        for up in self.time_conv:
            x = F.silu(up(x))
        return x

    def forward(self, z, q):
        """z: post-quant latents, q: code vectors, both [B, C, T, H, W] -> first frame [B, 3, H', W']."""
        both = self.temporal(torch.cat([z, q]))[:, :, 0]  # the spatial decoder is per frame: keep frame 0
        h, q = both.chunk(2)
        m = self.middle_block
        h = m.block_1(self.conv_in(h), q)
        h = m.block_2(h + m.attn_1(m.attn_norm(h, q)), q)
        for level in reversed(range(len(self.up_block.up))):
            up = self.up_block.up[level]
            for j, block in enumerate(up.block):
                h = block(h, q)
                if len(up.attn):
                    h = h + up.attn[j](up.attn_norms[j](h, q))
            if level != 0:
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h, q)))


class Emu3VQDecoder(_RowEndDecoder):
    """Emu3's image decoder: method tokens [B, h*(w+1)] -> images [B, 3, 8h, 8w] in about [-1, 1].
    An image is one code frame; the decoder's causal temporal stage makes ``factor`` frames from it
    and the first is the image (as Emu3 decodes images). Names follow transformers' ``Emu3VQVAE``."""

    def __init__(self, cfg: Emu3VQConfig):
        super().__init__()
        self.config = cfg
        self.quantize = _Quantize(cfg.codebook_size - 1, cfg.embed_dim)
        self.post_quant_conv = CausalConv3d(cfg.embed_dim, cfg.latent_channels, (3, 1, 1))
        self.decoder = MoVQDecoder(cfg)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, grid: int | None = None) -> torch.Tensor:
        c = self.config
        codes = codes_without_row_ends(tokens, c.grid_h, c.grid_w)
        q = self.quantize.embedding(codes).permute(0, 3, 1, 2).unsqueeze(2)  # [B, C, 1, h, w]
        q = q.to(self.post_quant_conv.conv.weight.dtype)
        x = self.decoder(self.post_quant_conv(q), q)
        mean = torch.tensor(c.pixel_mean, dtype=x.dtype, device=x.device)[:, None, None]
        std = torch.tensor(c.pixel_std, dtype=x.dtype, device=x.device)[:, None, None]
        return 2 * (x * std + mean) - 1
