"""LlamaGen's GPT (class- and text-conditional), written for a static KV cache.

Parameter names and shapes are those of the official checkpoints (FoundationVision/LlamaGen
``autoregressive/models/gpt.py``), so their state_dicts load unchanged. What differs is the inference
interface: every call says where its K/V go (``slots``) and what each query may see (``mask``), so plain
decoding, tree verification and Jacobi windows all run through the same ``forward_hidden``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import ConfigField, check_config_fields, check_weight_shape, clean_state_dict, check_layer_count
from ..errors import VVSError
from ..sampling import mean_last
from .fused import FusedLinear, fuse_linears


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTConfig:
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    # Position interpolation: grid cell (row, col) rotates as (row * s, col * s). 1 everywhere but a
    # model that starts from one trained on a smaller grid (zoo-gpt-32 from zoo-gpt: s = 0.5 maps the
    # 32x32 grid onto the 16x16 model's angles, so its weights are a good start; docs/zoo.md).
    rope_grid_scale: float = 1.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"  # "c2i" or "t2i"
    cls_token_num: int = 1  # 1 for c2i, 120 for t2i
    block_size: int = 256  # image tokens per image, a perfect square
    token_dropout_p: float = 0.0  # LlamaGen trains with 0.1; inference ignores dropout
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        return int(round(math.sqrt(self.block_size)))

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


# The fields GPTConfig.from_dict reads from a project config, checked before a model is built. Required:
# those that set a weight's shape or the numbers; a default would build another model than the file's.
GPT_CONFIG_FIELDS = {
    "dim": ConfigField("int", 1), "n_layer": ConfigField("int", 1), "n_head": ConfigField("int", 1),
    "multiple_of": ConfigField("int", 1), "ffn_dim_multiplier": ConfigField("number", 0, nullable=True),
    "rope_base": ConfigField("number", 1), "rope_grid_scale": ConfigField("number", 0, required=False),
    "norm_eps": ConfigField("number", 0), "vocab_size": ConfigField("int", 1),
    "model_type": ConfigField("text", choices=("c2i", "t2i")), "block_size": ConfigField("int", 1),
    "num_classes": ConfigField("int", 1, required=False), "caption_dim": ConfigField("int", 1, required=False),
    "cls_token_num": ConfigField("int", 1, required=False),
    # training only: checked when given, the defaults do not change inference
    "class_dropout_prob": ConfigField("number", 0, required=False), "token_dropout_p": ConfigField("number", 0, required=False),
    "resid_dropout_p": ConfigField("number", 0, required=False), "ffn_dropout_p": ConfigField("number", 0, required=False),
}


def checked_gpt_config(config: dict, where: str, sd: Optional[dict] = None) -> GPTConfig:
    """A project config as a GPTConfig: every field present (when required), typed and in range, and,
    given the state dict ``sd``, matching the weights; a one-line error naming the field and ``where``."""
    fields = dict(GPT_CONFIG_FIELDS)
    for name in (("num_classes",) if config.get("model_type") == "c2i" else ("caption_dim", "cls_token_num")):
        fields[name] = ConfigField("int", 1)  # the condition embedding's shape
    check_config_fields(config, fields, where)
    cfg = GPTConfig.from_dict(config)
    if cfg.dim % cfg.n_head or cfg.head_dim % 4:
        raise VVSError(f"{where}: \"dim\" {cfg.dim} / \"n_head\" {cfg.n_head} must give a whole head width "
                       f"divisible by 4 (2-D RoPE)")
    if cfg.rope_grid_scale <= 0:
        raise VVSError(f"{where}: \"rope_grid_scale\" {cfg.rope_grid_scale} must be > 0")
    if cfg.grid_size ** 2 != cfg.block_size:
        raise VVSError(f"{where}: \"block_size\" {cfg.block_size} must be a perfect square (tokens of a square image)")
    if sd is None:
        return cfg
    sd = clean_state_dict(sd)
    check_layer_count(sd, cfg.n_layer, where)
    check_weight_shape(sd, "tok_embeddings.weight", (cfg.vocab_size, cfg.dim), '"vocab_size" and "dim"', where)
    check_weight_shape(sd, "output.weight", (cfg.vocab_size, cfg.dim), '"vocab_size" and "dim"', where)
    check_weight_shape(sd, "layers.0.attention.wqkv.weight", (3 * cfg.dim, cfg.dim), '"dim"', where)
    check_weight_shape(sd, "layers.0.feed_forward.w1.weight", (cfg.ffn_hidden, cfg.dim),
                       '"multiple_of" and "ffn_dim_multiplier"', where)
    if cfg.model_type == "c2i":
        check_weight_shape(sd, "cls_embedding.embedding_table.weight", (cfg.num_classes + 1, cfg.dim),
                           '"num_classes" (+1 for the null class)', where)
    else:
        check_weight_shape(sd, "cls_embedding.uncond_embedding", (cfg.cls_token_num, cfg.caption_dim),
                           '"cls_token_num" and "caption_dim"', where)
    return cfg


# Published LlamaGen sizes (layers, heads, dim).
GPT_PRESETS = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    if name not in GPT_PRESETS:
        raise VVSError(f"unknown model '{name}'; known: {', '.join(GPT_PRESETS)}")
    cfg = dict(GPT_PRESETS[name])
    cfg.update(overrides)
    if cfg.get("model_type", "c2i") == "t2i" and "cls_token_num" not in overrides:
        cfg["cls_token_num"] = 120
    return GPTConfig(**cfg)


def rope_table_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int,
                  grid_scale: float = 1.0) -> torch.Tensor:
    """LlamaGen's 2-D RoPE table ``[cls_token_num + grid², head_dim/2, 2]`` of (cos, sin).

    The first half of each head rotates with the row index, the second half with the column index.
    The condition rows are all zeros (not the identity): LlamaGen zeroes q and k at condition
    positions, so they get a constant attention logit of 0 and act through their values only.
    ``grid_scale``: row and column indices are multiplied by it (``GPTConfig.rope_grid_scale``).
    """
    half = head_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].double() / half))
    t = torch.arange(grid_size, dtype=torch.float64) * grid_scale
    f = torch.outer(t, inv)  # [grid, head_dim/4]
    grid = torch.cat(
        [f[:, None, :].expand(-1, grid_size, -1), f[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # [grid, grid, head_dim/2]: row angles then column angles
    table = torch.stack([torch.cos(grid), torch.sin(grid)], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(cls_token_num, half, 2, dtype=torch.float64), table]).float()


# --- KV writes --------------------------------------------------------------------------------------
# torch.compile functionalises a write through a view of a persistent buffer (one layer ``k[i]`` of the
# [L, ...] cache) or a ``scatter_`` into it as an out-of-place copy of the whole buffer plus a copy back;
# Inductor turns ``index_put_`` on the base tensor back into an in-place write. So the model writes the
# static cache (runtime.kv_cache.StaticKVCache) only through write_kv, the layer as a tensor index.


class LayerKV:
    """Layer ``index`` of a static cache (``StaticKVCache``: k, v [L, B, H, S, D] and the index vectors
    layer_ids, row_ids, head_ids): unpacks to its (K, V) views for reading
    (``k, v = layer``); :func:`write_kv` writes it through the base buffers."""

    def __init__(self, cache, index: int):  # cache: runtime.kv_cache.StaticKVCache
        self.cache, self.index = cache, index

    def __iter__(self):
        return iter((self.cache.k[self.index], self.cache.v[self.index]))

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.cache.k, self.cache.v)[i][self.index]


def write_kv(layer, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``/``v`` [B, H, T, D] into ``layer`` at ``slots``: [T] (the same slots for every row) or
    [B, T] (per row: each sequence of a batch at its own length). One ``index_put_`` per buffer.
    ``layer``: a :class:`LayerKV` (written through the whole [L, ...] cache), or a (K, V) pair of
    [B, H, S, D] tensors of its own (a one-layer cache outside the engine's sessions)."""
    B, H, T, _ = k.shape
    s = slots.view(1, 1, T) if slots.dim() == 1 else slots.view(B, 1, T)
    if isinstance(layer, LayerKV):
        cache = layer.cache
        k_buf, v_buf = cache.k, cache.v
        index = (cache.layer_ids[layer.index], cache.row_ids[:B].view(B, 1, 1), cache.head_ids.view(1, H, 1), s)
    else:
        k_buf, v_buf = layer
        index = (torch.arange(B, device=k.device).view(B, 1, 1), torch.arange(H, device=k.device).view(1, H, 1), s)
    k_buf.index_put_(index, k.to(k_buf.dtype))
    v_buf.index_put_(index, v.to(v_buf.dtype))


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; rope: [T, hd/2, 2] or [B, T, hd/2, 2] (cos, sin). Rotates adjacent pairs in
    fp32 with the real-valued formula (the bits of a complex multiply; Inductor generates code for it,
    not for complex dtypes). q and k go through one call (heads concatenated): one rotation op."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    r = rope.float() if rope.dim() == 4 else rope.float().unsqueeze(0)
    cos, sin = r[..., 0].unsqueeze(2), r[..., 1].unsqueeze(2)  # [B|1, T, 1, hd/2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(mean_last(xf.pow(2)) + self.eps)  # mean_last: ATen's order in CPU compiles
        return out.type_as(x) * self.weight


class FeedForward(nn.Module):
    """SwiGLU MLP. The gate (w1) and up (w3) projections are one GEMM (``w13``); the state dict keeps
    the checkpoints' ``w1.weight`` / ``w3.weight`` (see :mod:`.fused`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.ffn_hidden
        fuse_linears(self, "w13", cfg.dim, [("w1", h), ("w3", h)])
        self.w2 = nn.Linear(h, cfg.dim, bias=False)
        self.drop = nn.Dropout(cfg.ffn_dropout_p)

    def forward(self, x):
        gate, up = self.w13.split(self.w13(x))
        return self.drop(self.w2(F.silu(gate) * up))


class Attention(nn.Module):
    batch_invariant = False  # models.invariant's switch: on CUDA the fixed-split attention kernel

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim, self.dim = cfg.n_head, cfg.head_dim, cfg.dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.drop = nn.Dropout(cfg.resid_dropout_p)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        B, T, _ = x.shape
        H = self.n_head
        qkv = self.wqkv(x).view(B, T, 3 * H, self.head_dim)
        if torch.compiler.is_compiling():
            # q and k rotated separately: the rotated k then has the shape of the cache writes and
            # Inductor computes it inside their kernel, q's rotation joining it (one kernel for RoPE and
            # the K/V writes, where the joint rotation was a kernel of its own). The same arithmetic.
            q = apply_rope(qkv[:, :, :H], rope).transpose(1, 2)
            k = apply_rope(qkv[:, :, H : 2 * H], rope).transpose(1, 2)
        else:
            qk = apply_rope(qkv[:, :, : 2 * H], rope)  # q and k rotated in one op
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        v = qkv[:, :, 2 * H :].transpose(1, 2)
        if kv is not None:
            # Static cache: write the new K/V at their slots, attend over the whole buffer; the mask
            # hides slots that are not (yet) part of this query's context.
            write_kv(kv, slots, k, v)
            k, v = kv
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # a LocalMask: committed prefix + a small local block (tree, chain, Jacobi window)
            from ..kernels import flash, invariant_attention, tree_attention

            if self.batch_invariant and q.is_cuda:  # a fixed key split whatever the batch (models.invariant)
                y = invariant_attention(q, k, v, mask.prefix_len, mask.local, mask.key_valid)
            elif (T == 1 or mask.causal) and mask.key_valid is None and flash.usable(q.device, q.dtype, self.head_dim):
                # AR decode / causal prefill: plain attention over [0, P + T), flash-attn's case.
                y = flash.attend(q, k, v, mask.prefix_len + T, causal=mask.causal)
            else:
                y = tree_attention(q, k, v, mask.prefix_len, mask.local, mask.key_valid)
        return self.drop(self.wo(y.transpose(1, 2).reshape(B, T, self.dim)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        h = x + self.attention(self.attention_norm(x), rope, kv, slots, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedder(nn.Module):
    """c2i condition: one row per class plus the null class (index ``num_classes``) for CFG."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels).unsqueeze(1)


class _MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """t2i condition: projected T5 caption features; the learned null caption is a buffer."""

    def __init__(self, caption_dim: int, dim: int, token_num: int):
        super().__init__()
        self.cap_proj = _MLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(caption)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        g = cfg.grid_size
        if g * g != cfg.block_size:
            raise VVSError(f"block_size {cfg.block_size} is not a perfect square")
        if cfg.model_type not in ("c2i", "t2i"):
            raise VVSError(f"model_type must be c2i or t2i, got '{cfg.model_type}'")
        self.config = cfg
        if cfg.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(cfg.num_classes, cfg.dim)
        else:
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not a buffer: official checkpoints do not carry it, and it must stay fp32.
        self.rope = rope_table_2d(g, cfg.head_dim, cfg.rope_base, cfg.cls_token_num, cfg.rope_grid_scale)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, FusedLinear):  # part by part: the weights an unfused model gets under a seed
            m.init_normal_(std=0.02)
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def _apply(self, fn, *args, **kwargs):
        # Keep the RoPE table on the model's device but always in fp32. The probe starts on the table's
        # own device: a dtype-only conversion (``.to(torch.bfloat16)``) must leave it where it is.
        out = super()._apply(fn, *args, **kwargs)
        probe = fn(torch.zeros(0, device=self.rope.device))
        self.rope = self.rope.to(device=probe.device)
        return out

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    # --- inputs -------------------------------------------------------------------------------
    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """c2i: labels [B] (the null class allowed) -> [B, 1, D]; t2i: captions [B, 120, C] -> [B, 120, D]."""
        return self.cls_embedding(cond)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_dropout(self.tok_embeddings(tokens))

    def token_embedding_table(self):
        """[V, D]: ``embed_tokens`` is a plain row lookup in it (kernels that gather embeddings
        themselves use it), or None while token dropout makes it something else (training)."""
        if self.training and self.tok_dropout.p > 0:
            return None
        return self.tok_embeddings.weight

    # --- forward ------------------------------------------------------------------------------
    def forward_hidden(self, x, positions, kv=None, slots=None, mask=None) -> torch.Tensor:
        """Run the decoder on embeddings ``x`` [B, T, D] at sequence ``positions`` ([T] or [B, T],
        indices into the RoPE table). With a cache ``kv`` (a :class:`~vvs_engine.runtime.kv_cache.StaticKVCache`)
        the new K/V are written at ``slots`` [T] and ``mask`` [B|1, 1, T, S] says which cache slots
        each query sees. Without a cache, attention is causal over ``x`` (training, scoring).
        Returns the last-layer features after the final norm (the input of ``output``)."""
        rope = self.rope[positions]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv is None else kv.layer(i), slots, mask)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h).float()

    def forward(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced next-token logits ``[B, n_tokens, V]``: row t predicts image token t given
        the condition and tokens[:, :t]. ``tokens`` may hold all block_size tokens (the last one is
        only a target, never an input)."""
        h = self.forward_features(cond, tokens)
        return self.logits(h)

    def forward_features(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        c = self.config.cls_token_num
        x = torch.cat([self.embed_condition(cond), self.embed_tokens(tokens[:, :-1])], dim=1)
        h = self.forward_hidden(x, torch.arange(x.shape[1], device=x.device))
        return h[:, c - 1 :]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
