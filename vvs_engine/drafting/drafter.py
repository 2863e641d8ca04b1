"""EAGLE-style draft head (LANTERN's LlamaGen drafter).

``f̂_{t+1} = layers(fc([embed(x_{t+1}); f_t]))``: the target's last-layer feature at position t and the
embedding of the next token go through one (or L) Llama decoder layers with LlamaGen's 2-D RoPE; the
target's frozen token embedding and output head turn features into logits. Drafter position t uses
the RoPE row of the token it embeds (target position t + 1), which is LANTERN's shifted table
(``cls_token_num - 1`` zero rows). The drafter runs both CFG rows (cond and uncond target features,
same tokens) and applies CFG to its own logits.

Parameter names follow LANTERN's released drafters (``fc``, ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.input_layernorm`` for N > 0,
``layers.N.post_attention_layernorm``), so their ``config.json + pytorch_model.bin`` load directly.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint import (ConfigField, check_config_fields, check_layer_count, check_weight_shape, clean_state_dict,
                          config_path, load_into, read_project_config, read_state_dict)
from ..errors import VVSError
from ..runtime.kv_cache import StaticKVCache
from ..models.fused import fuse_linears
from ..models.gpt import RMSNorm, apply_rope, write_kv


@dataclass
class DrafterConfig:
    dim: int
    n_head: int
    n_layer: int = 1
    ffn_hidden: int = 0  # 0 = LlamaGen's rule for dim
    norm_eps: float = 1e-6

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @property
    def head_dim(self):
        return self.dim // self.n_head


# The fields DrafterConfig.from_dict reads, checked before a drafter is built (the project's JSON, or
# LANTERN's config.json mapped onto them).
DRAFTER_CONFIG_FIELDS = {
    "dim": ConfigField("int", 1), "n_head": ConfigField("int", 1), "n_layer": ConfigField("int", 1),
    "ffn_hidden": ConfigField("int", 0), "norm_eps": ConfigField("number", 0),
}


def checked_drafter_config(config: dict, where: str, sd: Optional[dict] = None) -> DrafterConfig:
    """A drafter config checked field by field and, given the state dict ``sd``, against the weights;
    a one-line error naming the field and ``where``."""
    check_config_fields(config, DRAFTER_CONFIG_FIELDS, where)
    cfg = DrafterConfig.from_dict(config)
    if cfg.dim % cfg.n_head:
        raise VVSError(f"{where}: \"dim\" {cfg.dim} is not a multiple of \"n_head\" {cfg.n_head}")
    if sd is None:
        return cfg
    sd = clean_state_dict(sd)
    check_layer_count(sd, cfg.n_layer, where)
    check_weight_shape(sd, "fc.weight", (cfg.dim, 2 * cfg.dim), '"dim"', where)
    check_weight_shape(sd, "layers.0.mlp.gate_proj.weight", (cfg.ffn_hidden or _llamagen_ffn(cfg.dim), cfg.dim),
                       '"ffn_hidden" (0: LlamaGen\'s width for "dim")', where)
    return cfg


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_head, self.hd = cfg.n_head, cfg.head_dim
        # One GEMM for q/k/v; the state dict keeps LANTERN's q_proj/k_proj/v_proj names.
        fuse_linears(self, "qkv_proj", cfg.dim, [("q_proj", cfg.dim), ("k_proj", cfg.dim), ("v_proj", cfg.dim)])
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = apply_rope(q.view(B, T, self.n_head, self.hd), rope).transpose(1, 2)
        k = apply_rope(k.view(B, T, self.n_head, self.hd), rope).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.hd).transpose(1, 2)
        if kv is not None:
            write_kv(kv, slots, k, v)
            k, v = kv
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


class DraftMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        fuse_linears(self, "gate_up_proj", dim, [("gate_proj", hidden), ("up_proj", hidden)])  # one GEMM
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int, hidden: int):
        super().__init__()
        self.index = index
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg.dim, hidden)
        if index != 0:  # EAGLE: fc's output is already normalised enough; layer 0 has no input norm
            self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        h = self.input_layernorm(x) if self.index != 0 else x
        x = x + self.self_attn(h, rope, kv, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        hidden = cfg.ffn_hidden or _llamagen_ffn(cfg.dim)
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.layers = nn.ModuleList(DraftLayer(cfg, i, hidden) for i in range(cfg.n_layer))
        self.target = None  # set by attach(): frozen embedding, head and RoPE table come from it

    def attach(self, target) -> "Drafter":
        tc = target.config
        if tc.dim != self.config.dim:
            raise VVSError(f"drafter width {self.config.dim} does not match the target's {tc.dim}")
        if tc.head_dim != self.config.head_dim:
            raise VVSError(f"drafter head_dim {self.config.head_dim} != target head_dim {tc.head_dim}")
        object.__setattr__(self, "target", target)  # not a submodule: its weights are not ours
        return self

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        # Drafter position t embeds the token at target position t+1; past the end, zero rows
        # (LANTERN pads the table the same way) keep speculative overruns in range.
        table = self.target.rope
        return table[(positions + 1).clamp(max=table.shape[0] - 1)]

    def forward(self, feats, tokens, positions, kv=None, slots=None, mask=None, fc_input=None):
        """feats [rows, T, D] (target or stale or own features at positions t), tokens [rows, T]
        (x_{t+1}), positions [T] -> predicted features [rows, T, D]. ``fc_input`` [rows, T, 2D]: the
        already concatenated [embedding of tokens | feats] (``kernels.tree_level`` writes it; then
        ``feats`` and ``tokens`` are not read)."""
        if fc_input is None:
            fc_input = torch.cat([self.target.embed_tokens(tokens).to(feats.dtype), feats], dim=-1)
        x = self.fc(fc_input)
        rope = self.rope_rows(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv is None else kv.layer(i), slots, mask)
        return x

    def embedding_table(self):
        """The target's token-embedding table [V, D] when its ``embed_tokens`` is a plain lookup
        (LlamaGen), else None (Janus-Pro's aligner MLP, Chameleon's id remapping)."""
        table = getattr(self.target, "token_embedding_table", None)
        return table() if table is not None else None

    def logits(self, h, position=None):
        """Features [rows, F, D] -> target-head logits; with the drafter ``position`` of each row
        ([rows], or [1] for all rows), tokens the target family's layout forbids there (forced
        end-of-line tokens) get -1e9."""
        lg = self.target.logits(h)
        forbid = getattr(self.target, "layout_forbidden", None)
        if forbid is None or position is None:
            return lg
        # Drafter position t predicts the token the target predicts at position t + 1.
        banned = forbid[(position.reshape(-1) + 1).clamp(max=forbid.shape[0] - 1)]  # [rows or 1, V]
        if lg.dim() == 3:
            banned = banned[:, None]  # the same position for every node of a row
        return lg.masked_fill(banned, -1e9)

    def new_cache(self, rows: int, n_slots: int) -> StaticKVCache:
        p = self.fc.weight
        c = self.config
        return StaticKVCache(c.n_layer, rows, c.n_head, n_slots, c.head_dim, p.dtype, p.device)

    def new_session(self, rows: int, n_slots: int, params, tree_spec):
        """A draft session (per-image cache and tree state) over this head; the runtime builds draft
        sessions through this method so that it never imports the drafting layer."""
        from .session import DraftSession

        return DraftSession(self, rows, n_slots, params, tree_spec)


def _llamagen_ffn(dim: int) -> int:
    h = int(2 * (4 * dim) / 3)
    return h if h % 256 == 0 else h + 256 - h % 256


# --- loading ------------------------------------------------------------------------------------
def load_drafter(path: str, target) -> Drafter:
    """The project's safetensors (+ json, kind "drafter") or LANTERN's format: a directory (or the
    ``pytorch_model.bin`` inside it) with ``config.json`` (HF Llama fields)."""
    if os.path.isdir(path):
        path = os.path.join(path, "pytorch_model.bin")
    config = read_project_config(path, "drafter")  # a file of another kind (--drafter zoo-vq...) says so
    where = f"config {config_path(path)}"
    if config is None:
        cj = os.path.join(os.path.dirname(path), "config.json")
        where = f"drafter config {cj}"
        if not os.path.exists(cj):
            raise VVSError(f"drafter {path}: no config next to it (expected {os.path.basename(path)}'s .json "
                           f"or LANTERN's config.json)")
        try:
            with open(cj) as f:
                hf = json.load(f)
        except (OSError, ValueError) as e:
            raise VVSError(f"{where} is not readable JSON ({e})") from None
        if not isinstance(hf, dict):
            raise VVSError(f"{where} must be a JSON object (LANTERN's Llama config)")
        # LANTERN's Hugging Face Llama names -> ours; the checks below name the Llama field
        llama_names = {"hidden_size": "dim", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                       "intermediate_size": "ffn_hidden", "rms_norm_eps": "norm_eps"}
        defaults = {"num_hidden_layers": 1, "intermediate_size": 0, "rms_norm_eps": 1e-6}
        llama = {name: hf.get(name, defaults.get(name)) for name in llama_names if name in hf or name in defaults}
        check_config_fields(llama, {name: DRAFTER_CONFIG_FIELDS[ours] for name, ours in llama_names.items()}, where)
        config = {ours: llama[name] for name, ours in llama_names.items()}
    sd = read_state_dict(path)
    cfg = checked_drafter_config(config, where, sd)
    sd = {k: v for k, v in sd.items() if not k.startswith("embed_tokens.")}  # the target's embedding is used
    d = Drafter(cfg)
    load_into(d, sd, f"drafter {path}")
    return d.attach(target).eval()
