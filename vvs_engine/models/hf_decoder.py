"""A Llama-style decoder on the engine's static KV cache, for Hugging Face checkpoint families.

Janus-Pro's language model is a plain Llama; Chameleon (Lumina-mGPT) adds a per-head q/k LayerNorm.
Parameter names are those of ``transformers``' Llama-like classes below the
``layers.`` prefix, so a state dict loads after its family prefix is stripped. RoPE is the 1-D
half-split form (``rotate_half``) with the angles computed in fp32 like transformers does, so logits
match transformers on the same inputs. Grouped-query attention keeps only the K/V heads in the cache.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fused import fuse_linears
from .gpt import RMSNorm, write_kv


@dataclass
class DecoderConfig:
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn_hidden: int
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Chameleon: per-head LayerNorm of q and k before RoPE

    def to_dict(self) -> dict:
        return asdict(self)


def rope_table_1d(n_positions: int, head_dim: int, base: float) -> torch.Tensor:
    """``[n_positions, head_dim/2, 2]`` (cos, sin) of the standard 1-D RoPE, in fp32 as transformers
    computes it (fp32 inverse frequencies times fp32 positions)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = torch.arange(n_positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]; rope [T, hd/2, 2] or [B, T, hd/2, 2]: rotates (x_i, x_{i+hd/2}) pairs."""
    if rope.dim() == 3:
        rope = rope.unsqueeze(0)
    c, s = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)  # [B|1, T, 1, hd/2]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)


class HeadLayerNorm(nn.Module):
    """Chameleon's q/k norm: statistics over each head's features, a separate gain and bias per head."""

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, head_dim))

    def forward(self, x):  # x [B, T, H, hd]
        return F.layer_norm(x, x.shape[-1:], None, None, eps=1e-5) * self.weight + self.bias


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # One GEMM for q/k/v (grouped-query: k and v narrower); the state dict keeps transformers' names.
        fuse_linears(self, "qkv_proj", cfg.dim, [("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)],
                     bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * hd, cfg.dim, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = HeadLayerNorm(h, hd), HeadLayerNorm(kv, hd)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        c = self.cfg
        B, T, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(B, T, c.n_head, c.head_dim)
        k = k.view(B, T, c.n_kv_head, c.head_dim)
        v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope_half(q, rope).transpose(1, 2)
        k = apply_rope_half(k, rope).transpose(1, 2)
        if kv is not None:
            write_kv(kv, slots, k, v)  # slots [T], or [B, T]: each sequence at its own length
            k, v = kv
        rep = c.n_head // c.n_kv_head
        if rep > 1:  # the cache holds K/V heads only; attention sees them shared by their query groups
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
        elif isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        else:  # a LocalMask (chain, tree, Jacobi window over the committed prefix)
            from ..kernels import tree_attention

            y = tree_attention(q, k, v, mask.prefix_len, mask.local, mask.key_valid)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        fuse_linears(self, "gate_up_proj", cfg.dim, [("gate_proj", cfg.ffn_hidden), ("up_proj", cfg.ffn_hidden)],
                     bias=cfg.mlp_bias)  # one GEMM
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = DecoderAttention(cfg)
        self.mlp = DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        h = x + self.self_attn(self.input_layernorm(x), rope, kv, slots, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """The layer stack and final norm; embeddings and heads belong to the family module."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv is None else kv.layer(i), slots, mask)
        return self.norm(x)
