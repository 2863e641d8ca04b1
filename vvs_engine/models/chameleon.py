"""Lumina-mGPT (``ChameleonForConditionalGeneration`` weights) as a target.

Chameleon is a Llama with a per-head q/k LayerNorm (:mod:`.hf_decoder`); image codes are ordinary
entries of its vocabulary (the ``IMGIMG…`` names of ``vocabulary_map``). Lumina-mGPT's layout (its
``FlexARItemProcessor`` and ``Conversation``):

    BOS instruction <reserved08706> <racm3:break> <h> <w> | row 0 codes, EOL | row 1 codes, EOL | … | EOI

The instruction is the human turn, closed by the conversation separator ``<reserved08706>``; the
assistant's answer is the image: ``<racm3:break>`` and two resolution tokens ``<reserved{8800 + n}>``
(id 8804 + n) where n counts 32-px patches (2 x 2 codes) of the height, then of the width: a 768 px image
is 24 patches, 48 x 48 codes. The condition ends with the separator, the image-start token and the two
resolution tokens (forced: they are part of the condition, never sampled). The decoding methods see the image part as ``h * (w + 1)`` tokens over a
vocabulary of the ``n`` codes (in VQ-index order) plus the end-of-line token at index ``n``; the
layout forces EOL after each row and forbids it elsewhere (``layout_forbidden``, applied by
:class:`~vvs_engine.runtime.target.TargetSession`). The unconditional CFG row is the image-start and
resolution tokens alone, as Lumina-mGPT's guidance processor feeds them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Sequence

import torch
import torch.nn as nn

from ..errors import VVSError
from .hf_decoder import Decoder, DecoderConfig, rope_table_1d
from .invariant import linear

LUMINA_PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
LUMINA_BOI, LUMINA_EOI, LUMINA_EOL, LUMINA_RESOLUTION_BASE = 8197, 8196, 8803, 8804
# <reserved08706>, the end of a conversation turn. Chameleon's <reservedNNNNN> has id NNNNN + 4 (EOL is
# <reserved08799> = 8803, the resolution base <reserved08800> = 8804); a folder that names it wins.
LUMINA_SEPARATOR, LUMINA_SEPARATOR_NAME = 8710, "<reserved08706>"
LUMINA_RESOLUTION_PX = 32  # a resolution token counts 32-px patches (2 x 2 codes of 16 px)
ROPE_MARGIN = 64


@dataclass
class ChameleonFamilyConfig:
    family: str
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab_size: int  # image codes + the end-of-line token (the methods' vocabulary)
    cls_token_num: int
    block_size: int  # grid_h * (grid_w + 1): codes and one EOL per row
    text_vocab_size: int
    grid_h: int
    grid_w: int
    patch_px: int
    bos_token_id: int
    pad_token_id: int
    boi_token_id: int = LUMINA_BOI
    eol_token_id: int = LUMINA_EOL
    resolution_base: int = LUMINA_RESOLUTION_BASE
    model_type: str = "t2i"
    num_classes: int = 0
    prompt_template: str = LUMINA_PROMPT_TEMPLATE
    image_wrapper_token_id: int = -1  # Emu3: "<|image token|>" after the size text
    negative_prompt: str = ""  # Emu3: the unconditional row's prompt
    separator_token_id: int = LUMINA_SEPARATOR  # Lumina-mGPT: ends the human turn, before the image
    resolution_px: int = LUMINA_RESOLUTION_PX  # Lumina-mGPT: pixels per unit of a resolution token

    @property
    def n_codes(self) -> int:
        return self.vocab_size - 1

    @property
    def grid_size(self) -> int:
        return int(round(math.sqrt(self.grid_h * self.grid_w)))

    def to_dict(self) -> dict:
        return asdict(self)


class ChameleonTarget(nn.Module):
    batch_invariant = False  # the logits' projection (a slice of lm_head) follows models.invariant's switch

    def __init__(self, cfg: ChameleonFamilyConfig, dcfg: DecoderConfig, code_ids: torch.Tensor):
        super().__init__()
        self.config, self.decoder_config = cfg, dcfg
        self.embed_tokens_text = nn.Embedding(cfg.text_vocab_size, cfg.dim)
        self.decoder = Decoder(dcfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.text_vocab_size, bias=False)
        # Vocabulary ids of the methods' tokens: codes in VQ-index order, then EOL.
        self.register_buffer("vocab_ids", torch.cat([code_ids.long(), torch.tensor([cfg.eol_token_id])]),
                             persistent=False)
        self.tokenizer = None
        n_pos = cfg.cls_token_num + cfg.block_size + ROPE_MARGIN
        self.rope = rope_table_1d(n_pos, dcfg.head_dim, dcfg.rope_base)
        self.layout_forbidden = layout_forbidden(cfg, n_pos)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        dev = fn(torch.zeros(0, device=self.rope.device)).device  # a dtype-only fn keeps the device
        self.rope, self.layout_forbidden = self.rope.to(dev), self.layout_forbidden.to(dev)
        return out

    # --- the target interface -----------------------------------------------------------------
    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens_text(cond)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Method tokens (code index or the EOL index) -> their vocabulary embeddings."""
        return self.embed_tokens_text(self.vocab_ids[tokens])

    def forward_hidden(self, x, positions, kv=None, slots=None, mask=None) -> torch.Tensor:
        return self.decoder(x, self.rope[positions], kv, slots, mask)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Features -> logits over the codes and EOL only (rows of the text head, fp32)."""
        w = self.lm_head.weight.index_select(0, self.vocab_ids)
        return linear(self, h, w).float()  # batch-invariant while self.batch_invariant (models.invariant)

    # --- prompts and layout -------------------------------------------------------------------
    @staticmethod
    def resolution_ids(c: ChameleonFamilyConfig) -> List[int]:
        """Lumina-mGPT's resolution tokens: the height, then the width, in 32-px patches."""
        height, width = c.grid_h * c.patch_px, c.grid_w * c.patch_px
        return [c.resolution_base + height // c.resolution_px, c.resolution_base + width // c.resolution_px]

    def image_prefix(self) -> List[int]:
        """Image start, then the two resolution tokens."""
        return [self.config.boi_token_id] + self.resolution_ids(self.config)

    def prompt_ids(self, prompt: str) -> List[int]:
        """BOS + Lumina-mGPT's instruction with the prompt + the turn separator + image start +
        resolution tokens."""
        if self.tokenizer is None:
            raise VVSError("this Chameleon folder has no tokenizer.json: text prompts cannot be encoded")
        c = self.config
        text = c.prompt_template.format(width=c.grid_w * c.patch_px, height=c.grid_h * c.patch_px, prompt=prompt)
        return ([c.bos_token_id] + self.tokenizer.encode(text, add_special_tokens=False).ids + [c.separator_token_id]
                + self.image_prefix())

    def uncond_ids(self) -> List[int]:
        """Lumina-mGPT's unconditional row: the image-start and resolution tokens alone (its guidance
        processor starts the unconditional context at the image-start token)."""
        return self.image_prefix()

    def condition_rows(self, prompts: Sequence[str], use_cfg: bool, device):
        c, cfg = self.config.cls_token_num, self.config
        rows = [self.prompt_ids(str(p)) for p in prompts]
        if use_cfg:
            rows += [self.uncond_ids()] * len(prompts)
        ids = torch.full((len(rows), c), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), c, dtype=torch.bool)
        for i, row in enumerate(rows):
            if len(row) > c:
                raise VVSError(f"prompt {i} is {len(row)} tokens with its template; the limit is {c} "
                               f"(raise max_prompt_tokens)")
            ids[i, c - len(row):] = torch.tensor(row)
            mask[i, c - len(row):] = True
        return ids.to(device), mask.to(device)

    def codes_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, h*(w+1)] method tokens -> [n, h*w] VQ codes (the EOL column of each row dropped)."""
        c = self.config
        return tokens.view(tokens.shape[0], c.grid_h, c.grid_w + 1)[:, :, : c.grid_w].reshape(tokens.shape[0], -1)


def layout_forbidden(cfg: ChameleonFamilyConfig, n_positions: int) -> torch.Tensor:
    """[n_positions, V] bool: at sequence position p (predicting image token t = p + 1 - c), EOL is
    the only token allowed when t closes a row, and forbidden otherwise."""
    t = torch.arange(n_positions) + 1 - cfg.cls_token_num
    row_end = (t >= 0) & (t % (cfg.grid_w + 1) == cfg.grid_w)
    forbid = torch.zeros(n_positions, cfg.vocab_size, dtype=torch.bool)
    forbid[:, -1] = ~row_end
    forbid[row_end, :-1] = True
    return forbid


def code_ids_from_vocabulary_map(vocab_map: dict, what: str) -> torch.Tensor:
    """Chameleon's ``IMGIMG<letters>Z`` vocabulary names -> ids ordered by VQ code (A..J = digits)."""
    digits = {chr(ord("A") + i): str(i) for i in range(10)}
    by_code = {}
    for name, idx in vocab_map.items():
        if name.startswith("IMGIMG"):
            try:
                by_code[int("".join(digits[ch] for ch in name[len("IMGIMG"):-1]))] = int(idx)
            except (KeyError, ValueError):
                raise VVSError(f"{what}: malformed image token name '{name}' in vocabulary_map") from None
    if not by_code or sorted(by_code) != list(range(len(by_code))):
        raise VVSError(f"{what}: vocabulary_map does not name image codes 0..n-1")
    return torch.tensor([by_code[i] for i in range(len(by_code))])


def state_dict_from_hf(sd: dict, lm: str = "model.", head: str = "lm_head.") -> dict:
    """transformers' names -> ours; ``lm``/``head``: the language model's and text head's prefixes
    (Emu3 folders: ``text_model.model.`` and ``text_model.lm_head.``)."""
    out = {}
    for k, v in sd.items():
        if k.startswith(lm + "embed_tokens."):
            out["embed_tokens_text." + k[len(lm + "embed_tokens."):]] = v
        elif k.startswith((lm + "layers.", lm + "norm.")):
            out["decoder." + k[len(lm):]] = v
        elif k.startswith(head):
            out["lm_head." + k[len(head):]] = v
    return out


class Emu3Target(ChameleonTarget):
    """Emu3: a Llama (no q/k norm) with visual tokens in its text vocabulary. Condition:
    ``BOS prompt <|image start|> {h}*{w} <|image token|>`` (sizes in tokens, as transformers' Emu3
    processor writes them); rows of w visual tokens each closed by ``<|extra_200|>`` (EOL, forced);
    the unconditional row is the negative prompt with the same image prefix."""

    def image_prefix(self) -> List[int]:
        c = self.config
        if self.tokenizer is None:
            raise VVSError("this Emu3 folder has no tokenizer.json: the image prefix cannot be encoded")
        size = self.tokenizer.encode(f"{c.grid_h}*{c.grid_w}", add_special_tokens=False).ids
        return [c.boi_token_id] + size + [c.image_wrapper_token_id]

    def prompt_ids(self, prompt: str) -> List[int]:
        c = self.config
        if self.tokenizer is None:
            raise VVSError("this Emu3 folder has no tokenizer.json: text prompts cannot be encoded")
        return [c.bos_token_id] + self.tokenizer.encode(prompt, add_special_tokens=False).ids + self.image_prefix()

    def uncond_ids(self) -> List[int]:
        return self.prompt_ids(self.config.negative_prompt)


def emu3_code_ids(vocab_map: dict, what: str) -> torch.Tensor:
    """``<|visual token NNNNNN|>`` vocabulary names -> ids ordered by VQ code."""
    by_code = {}
    for name, idx in vocab_map.items():
        if name.startswith("<|visual token"):
            try:
                by_code[int(name[-8:-2])] = int(idx)
            except ValueError:
                raise VVSError(f"{what}: malformed visual token name '{name}' in vocabulary_map") from None
    if not by_code or sorted(by_code) != list(range(len(by_code))):
        raise VVSError(f"{what}: vocabulary_map does not name visual tokens 0..n-1")
    return torch.tensor([by_code[i] for i in range(len(by_code))])


class ChameleonCodebook(nn.Module):
    """The tokenizer interface without pixels, for a folder that lacks its VQ decoder weights: tokens are
    the output (``can_decode`` is False); codebook vectors (LANTERN/GSD neighbourhoods) are the VQ
    embeddings, with the end-of-line row far from every code."""

    can_decode = False

    def __init__(self, n_codes: int, dim: int, grid: int):
        super().__init__()
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(n_codes, dim)
        self.config = type("CodebookConfig", (), {"codebook_size": n_codes + 1, "grid": grid})()

    @property
    def n_codes(self) -> int:
        return self.config.codebook_size - 1

    def codebook_vectors(self) -> torch.Tensor:
        from .hf_vq import codebook_with_far_row_end

        return codebook_with_far_row_end(self.quantize.embedding.weight)

    def decode(self, codes, grid=None):
        raise VVSError("this folder has no VQ decoder weights: only tokens are produced (use --no-images)")
