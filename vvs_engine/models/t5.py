"""Caption features for text-conditional (t2i) LlamaGen models: a local flan-t5 encoder.

LlamaGen's text path (``language/t5.py`` + ``sample_t2i.py``): tokenize with ``padding="max_length"``,
``max_length=120``, run the T5 encoder, then LEFT-pad: the valid tokens move to the end of the 120
positions, the mask moves with them, and the padded positions' features are zeroed. The GPT's
condition prefix then ends with the caption's last token, right before image token 0.

LlamaGen also cleans every caption before tokenization (its T5 embedder's caption cleaning, applied
twice); its t2i checkpoints were trained on features of cleaned captions, and the flan-t5 tokenizer is
case-sensitive, so :func:`clean_caption` does the same by default (``clean=False`` turns it off). It is
written here with the standard library only; where LlamaGen uses ``ftfy.fix_text`` (mojibake repair)
and BeautifulSoup (HTML to text) this uses ``html.unescape`` and ``html.parser``, so captions with
broken encodings may still differ.
"""
from __future__ import annotations

import html
import os
import re
import urllib.parse
from html.parser import HTMLParser
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
    def encode(self, prompts: Sequence[str], clean: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise VVSError("prompts must be a non-empty list of strings")
        if clean:
            prompts = [clean_caption(clean_caption(p)) for p in prompts]
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


# --- caption cleaning (LlamaGen / DeepFloyd-IF style) ---------------------------------------------
_URL_RES = [re.compile(r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)"
                       r"[\w/-]*\b\/?(?!@)))"),
            re.compile(r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)"
                       r"[\w/-]*\b\/?(?!@)))")]
_CJK = re.compile("[\u31c0-\u31ef\u31f0-\u31ff\u3200-\u32ff\u3300-\u33ff\u3400-\u4dbf\u4dc0-\u4dff"
                  "\u4e00-\u9fff]+")
_DASHES = re.compile("[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40"
                     "\u301C\u3030\u30A0\uFE31\uFE32\uFE58\uFE63\uFF0D]+")
_BAD_PUNCT = re.compile(r"[#®•©™&@·º½¾¿¡§~\)\(\]\[\}\{\|\\/\*]{1,}")
_JUNK = [
    (re.compile(r"\b\d{1,3}[\s,.]\d{3}[\s,.]\d{3}\b"), ""),  # long grouped numbers
    (re.compile(r"(?:\d{1,3}\.){3}\d{1,3}"), " "),  # IP addresses
    (re.compile(r"\d:\d\d\s+$"), ""),  # trailing article ids
    (re.compile(r"\\n"), " "),
    (re.compile(r"#\d{1,3}\b"), ""),
    (re.compile(r"#\d{5,}\b"), ""),
    (re.compile(r"\b\d{6,}\b"), ""),
    (re.compile(r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)"), ""),
    (re.compile(r"[\"']{2,}"), '"'),
    (re.compile(r"[\.]{2,}"), " "),
]
_JUNK_WORDS = [
    (re.compile(r"\b[a-zA-Z]+\d+[a-zA-Z]+\b"), ""),  # jkp12, 6g7h8, ...: catalogue codes
    (re.compile(r"\b\d+[a-zA-Z]+\d+\b"), ""),
    (re.compile(r"\b[a-zA-Z]{1,3}\d{3,15}\b"), ""),
    (re.compile(r"(worldwide\s+)?(free\s+)?shipping"), ""),
    (re.compile(r"(free\s)?download(\sfree)?"), ""),
    (re.compile(r"\bclick\b\s(?:for|on)\s\w+"), ""),
    (re.compile(r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?"), ""),
    (re.compile(r"\bpage\s+\d+\b"), ""),
    (re.compile(r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b"), " "),
    (re.compile(r"\b\d+\.?\d*[xх×]\d+\.?\d*\b"), ""),  # 1920x1080
    (re.compile(r"\b\s+\:\s+"), r": "),
    (re.compile(r"(\D[,\./])\b"), r"\1 "),
    (re.compile(r"\s+"), " "),
]


class _TextOnly(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts = []

    def handle_data(self, data):
        self.parts.append(data)


def _html_text(text: str) -> str:
    if "<" not in text:
        return text
    p = _TextOnly()
    p.feed(text)
    p.close()
    return "".join(p.parts)


def clean_caption(caption: str) -> str:
    """One pass of LlamaGen's caption cleaning (it applies two): URL-unquote, lower-case, drop URLs,
    HTML markup, @names, CJK blocks, IPs, file names and shop boilerplate; unify unicode dashes and
    quotes; turn stray punctuation into spaces; squeeze whitespace."""
    c = urllib.parse.unquote_plus(str(caption)).strip().lower()
    c = re.sub("<person>", "person", c)
    for r in _URL_RES:
        c = r.sub("", c)
    c = _html_text(c)
    c = re.sub(r"@[\w\d]+\b", "", c)
    c = _CJK.sub("", c)
    c = _DASHES.sub("-", c)
    c = re.sub(r"[`´«»“”¨]", '"', c)
    c = re.sub(r"[‘’]", "'", c)
    c = re.sub(r"&quot;?", "", c)
    c = re.sub(r"&amp", "", c)
    for r, rep in _JUNK:
        c = r.sub(rep, c)
    c = _BAD_PUNCT.sub(" ", c)
    c = re.sub(r"\s+\.\s+", r" ", c)
    if len(re.findall(r"(?:\-|\_)", c)) > 3:  # this-is-a-slug_name -> words
        c = re.sub(r"(?:\-|\_)", " ", c)
    c = html.unescape(html.unescape(c))
    for r, rep in _JUNK_WORDS:
        c = r.sub(rep, c)
    c = c.strip()
    c = re.sub(r"^[\"']([\w\W]+)[\"']$", r"\1", c)
    c = re.sub(r"^[\'\_,\-\:;]", r"", c)
    c = re.sub(r"[\'\_,\-\:\-\+]$", r"", c)
    c = re.sub(r"^\.\S+$", "", c)
    return c.strip()
