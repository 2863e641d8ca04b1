"""Janus-Pro (``JanusForConditionalGeneration``) as a target: text prompt in, 576 VQ codes out.

The language model is a Llama (:mod:`.hf_decoder`). Image generation does not use the text head: a
generated code is embedded by ``generation_embeddings`` + ``generation_aligner`` (a GELU MLP) and the
next code is predicted by ``generation_head`` over the VQ codebook only, so the "vocabulary" the
decoding methods see is the codebook itself. The condition is the chat-formatted prompt ending in
``<begin_of_image>``; the unconditional CFG row is the same sequence with every token except BOS
and ``<begin_of_image>`` replaced by the pad token (as Janus does). Prompts are left-padded to a fixed
length with a key mask (static shapes); RoPE positions count the padding, which changes nothing
because RoPE attention depends only on position differences and padded keys are masked.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import VVSError
from .hf_decoder import Decoder, DecoderConfig, rope_table_1d

JANUS_PROMPT_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
ROPE_MARGIN = 64  # RoPE rows past the last image token: speculative overruns stay in range


@dataclass
class FamilyConfig:
    """What the decoding methods read from a target's ``config`` (the LlamaGen GPT config has the
    same fields), plus the family's layout facts."""

    family: str
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab_size: int  # image codes the methods sample from
    cls_token_num: int  # condition length: the padded prompt
    block_size: int  # image tokens per image
    text_vocab_size: int
    bos_token_id: int
    boi_token_id: int
    pad_token_id: int
    model_type: str = "t2i"
    num_classes: int = 0
    prompt_template: str = JANUS_PROMPT_TEMPLATE

    @property
    def grid_size(self) -> int:
        return int(round(math.sqrt(self.block_size)))

    def to_dict(self) -> dict:
        return asdict(self)


class GenAligner(nn.Module):
    """``fc1`` then (GELU, linear) per hidden layer: transformers' ``JanusVQVAEAlignerMLP``."""

    def __init__(self, cin: int, dim: int, n_layers: int):
        super().__init__()
        self.fc1 = nn.Linear(cin, dim)
        self.hidden_layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(1, n_layers))

    def forward(self, x):
        x = self.fc1(x)
        for layer in self.hidden_layers:
            x = layer(F.gelu(x))
        return x


class GenHead(nn.Module):
    def __init__(self, dim: int, proj: int, n_codes: int):
        super().__init__()
        self.proj_out = nn.Linear(dim, proj)
        self.vision_head = nn.Linear(proj, n_codes)

    def forward(self, h):
        return self.vision_head(F.gelu(self.proj_out(h)))


class JanusTarget(nn.Module):
    def __init__(self, cfg: FamilyConfig, dcfg: DecoderConfig, code_dim: int, proj_dim: int, aligner_layers: int):
        super().__init__()
        self.config, self.decoder_config = cfg, dcfg
        self.text_embeddings = nn.Embedding(cfg.text_vocab_size, cfg.dim)
        self.generation_embeddings = nn.Embedding(cfg.vocab_size, code_dim)
        self.generation_aligner = GenAligner(code_dim, proj_dim, aligner_layers)
        self.generation_head = GenHead(cfg.dim, proj_dim, cfg.vocab_size)
        self.decoder = Decoder(dcfg)
        self.tokenizer = None  # a tokenizers.Tokenizer, set by the loader
        # Not a buffer: checkpoints do not carry it, and it stays fp32 whatever the model dtype.
        self.rope = rope_table_1d(cfg.cls_token_num + cfg.block_size + ROPE_MARGIN, dcfg.head_dim, dcfg.rope_base)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.rope = self.rope.to(device=fn(torch.zeros(0, device=self.rope.device)).device)  # dtype-only fn: stays
        return out

    # --- the target interface (see vvs_engine.runtime.target) ----------------------------------------
    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """Prompt token ids [rows, cls_token_num] (left-padded) -> [rows, c, D]."""
        return self.text_embeddings(cond)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image codes [rows, T] -> [rows, T, D] through the generation embedding and aligner."""
        return self.generation_aligner(self.generation_embeddings(tokens))

    def forward_hidden(self, x, positions, kv=None, slots=None, mask=None) -> torch.Tensor:
        return self.decoder(x, self.rope[positions], kv, slots, mask)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Features -> logits over the image codebook (fp32)."""
        return self.generation_head(h).float()

    # --- prompts ------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> List[int]:
        """BOS + the chat-formatted prompt + ``<begin_of_image>``."""
        if self.tokenizer is None:
            raise VVSError("this Janus folder has no tokenizer.json: text prompts cannot be encoded")
        text = self.config.prompt_template.format(prompt=prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.config.bos_token_id] + ids + [self.config.boi_token_id]

    def condition_rows(self, prompts: Sequence[str], use_cfg: bool, device):
        """-> (ids [rows, c], key mask [rows, c]): conditional rows, then Janus's unconditional rows."""
        c, cfg = self.config.cls_token_num, self.config
        ids = torch.full((len(prompts), c), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), c, dtype=torch.bool)
        for i, p in enumerate(prompts):
            row = self.prompt_ids(str(p))
            if len(row) > c:
                raise VVSError(f"prompt {i} is {len(row)} tokens with its template; the limit is {c} "
                               f"(raise max_prompt_tokens)")
            ids[i, c - len(row):] = torch.tensor(row)
            mask[i, c - len(row):] = True
        if use_cfg:
            unc = ids.clone()
            keep = (unc == cfg.bos_token_id) | (unc == cfg.boi_token_id)
            unc[~keep] = cfg.pad_token_id
            ids, mask = torch.cat([ids, unc]), torch.cat([mask, mask])
        return ids.to(device), mask.to(device)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def state_dict_from_hf(sd: dict) -> dict:
    """transformers' Janus names -> ours (language model, generation embedding/aligner/head);
    the understanding tower, text head and VQ encoder are dropped (image generation never uses them)."""
    out = {}
    for k, v in sd.items():
        for src, dst in (("model.language_model.embed_tokens.", "text_embeddings."),
                         ("model.language_model.", "decoder."),
                         ("model.generation_embeddings.", "generation_embeddings."),
                         ("model.generation_aligner.", "generation_aligner."),
                         ("model.generation_head.", "generation_head.")):
            if k.startswith(src):
                out[dst + k[len(src):]] = v
                break
    return out


def vq_state_dict_from_hf(sd: dict) -> dict:
    keep = ("model.vqmodel.quantize.embedding.", "model.vqmodel.post_quant_conv.", "model.vqmodel.decoder.")
    return {k[len("model.vqmodel."):]: v for k, v in sd.items() if k.startswith(keep)}
