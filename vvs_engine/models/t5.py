"""Caption features for text-conditional (t2i) LlamaGen models: a local flan-t5 encoder.

LlamaGen's text path (``language/t5.py`` + ``sample_t2i.py``): tokenize with ``padding="max_length"``,
``max_length=120``, run the T5 encoder, then LEFT-pad: the valid tokens move to the end of the 120
positions, the mask moves with them, and the padded positions' features are zeroed. The GPT's
condition prefix then ends with the caption's last token, right before image token 0.
"""
from __future__ import annotations

import os
from typing import Sequence, Tuple

import torch

from ..errors import VVSError


class CaptionEncoder:
    """``CaptionEncoder(path, n_tokens=120).encode(prompts) -> (emb [B, n, C] float32, mask [B, n] bool)``.

    ``path`` is a local directory with a transformers ``T5EncoderModel`` (or full T5) checkpoint and its
    tokenizer (e.g. a download of ``google/flan-t5-xl``, C = 2048). Nothing is fetched from the network.
    """

    def __init__(self, path: str, n_tokens: int = 120):
        if not path or not os.path.isdir(path):
            raise VVSError(f"T5 path is not a directory: {path}")
        try:
            from transformers import AutoTokenizer, T5EncoderModel
        except ImportError as e:  # pragma: no cover - transformers is a dependency
            raise VVSError(f"text-conditional models need transformers ({e})") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = T5EncoderModel.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise VVSError(f"cannot load a T5 encoder and tokenizer from {path}: {first}") from None
        self.model = self.model.float().eval().requires_grad_(False)
        self.n_tokens = int(n_tokens)
        self.dim = int(self.model.config.d_model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device) -> "CaptionEncoder":
        self.model.to(device)
        return self

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise VVSError("prompts must be a non-empty list of strings")
        batch = self.tokenizer(prompts, padding="max_length", max_length=self.n_tokens, truncation=True,
                               return_tensors="pt")
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device).bool()
        emb = self.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state.float()
        return left_pad(emb, mask)


def left_pad(emb: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Move the valid positions of each row to the end (keeping their order), the padding to the front,
    and zero the padded features. For the usual right-padded tokenizer output this is LlamaGen's
    "roll by the number of valid tokens, flip the mask" step; written as a stable sort on the mask so it
    does not depend on the tokenizer's padding side.

    emb [B, n, C], mask [B, n] bool -> (emb [B, n, C], mask [B, n] bool)."""
    order = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices  # padding (0) first, valid (1) last
    new_mask = torch.gather(mask, 1, order)
    new_emb = torch.gather(emb, 1, order[..., None].expand_as(emb))
    return new_emb * new_mask[..., None].to(new_emb.dtype), new_mask
