"""A decoding session on the target model: one static KV cache, the condition prefix, CFG rows.

Every method (plain AR, tree verification, VVS post-verification, Jacobi windows) calls the target
through :meth:`TargetSession.forward`, which takes token ids, their RoPE positions, the cache slots
their K/V go to, and a boolean visibility mask over the cache. Row layout for CFG is
``[cond_0..cond_{n-1}; uncond_0..uncond_{n-1}]``; both halves always see the same token ids.

The target model interface (LlamaGen's GPT and the Hugging Face families in ``vvs_engine.models``):
``config`` (cls_token_num = condition length, block_size = image tokens, vocab_size = image vocabulary,
dim, n_layer, n_head, head_dim, optional n_kv_head, model_type), ``embed_condition(cond)``,
``embed_tokens(tokens)``, ``forward_hidden(x, positions, kv, slots, mask)``, ``logits(h)``, the fp32
``rope`` table indexed by position, and optionally ``layout_forbidden`` [positions, V] bool: tokens a
family's layout rules out at each predicting position (forced end-of-line tokens), applied by
:meth:`TargetSession.logits` to the features of the last forward.
"""
from __future__ import annotations

import torch

from ..kernels import flash
from ..models.gpt import GPT
from .kv_cache import StaticKVCache
from .masks import LocalMask, causal_local


class TargetSession:
    def __init__(self, model: GPT, cond_rows: torch.Tensor, n_images: int, use_cfg: bool,
                 cond_key_mask: torch.Tensor | None = None, extra_slots: int = 0):
        cfg = model.config
        self.model, self.n, self.use_cfg = model, n_images, use_cfg
        self.rows = cond_rows.shape[0]
        self.c = cfg.cls_token_num
        self.T = cfg.block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Committed sequence (condition + image tokens) plus scratch slots for drafts.
        self.kv = StaticKVCache.for_model(model, self.rows, self.c + self.T + extra_slots)
        S = self.kv.n_slots
        self.S = S
        # key_valid[r, s]: False only for padded caption positions of t2i conditions.
        self.key_valid = torch.ones(self.rows, S, dtype=torch.bool, device=self.device)
        self.has_key_mask = cond_key_mask is not None
        if cond_key_mask is not None:
            self.key_valid[:, : self.c] = cond_key_mask.to(self.device, torch.bool)
        self.slot_ids = torch.arange(S, device=self.device)
        self.cond_rows = cond_rows.clone()  # its own: admission writes newcomers' conditions into it
        self.layout_forbidden = getattr(model, "layout_forbidden", None)
        self.last_positions = None  # positions of the last forward: which layout rules its logits obey

    # --- primitives ---------------------------------------------------------------------------
    def rows_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n, T] token ids -> [rows, T] (duplicated for the unconditional half under CFG)."""
        return torch.cat([tokens, tokens], 0) if self.use_cfg else tokens

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, prefix_len: torch.Tensor,
                local: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` [n, Q] at RoPE ``positions`` [Q] with their K/V written to slots
        ``[prefix_len, prefix_len + Q)``; each query sees the committed prefix and the local block
        allowed by ``local`` [Q, Q] (see :class:`~vvs_engine.runtime.masks.LocalMask`). Returns features
        [rows, Q, D]. ``prefix_len`` is a [1] device tensor: no host sync, one shape for all lengths."""
        Q = tokens.shape[1]
        slots = prefix_len + torch.arange(Q, device=self.device)
        x = self.model.embed_tokens(self.rows_of(tokens))
        mask = LocalMask(prefix_len, local, self.key_valid if self.has_key_mask else None)
        self.last_positions = positions
        return self.model.forward_hidden(x, positions, self.kv, slots, mask)

    def forward_per_sequence(self, tokens: torch.Tensor, positions: torch.Tensor, prefix_len: torch.Tensor,
                             local: torch.Tensor) -> torch.Tensor:
        """Like :meth:`forward` with one layout per image: ``tokens`` and RoPE ``positions`` [n, Q],
        ``prefix_len`` [n] (each image's committed length; its K/V go to ``[prefix_len, prefix_len + Q)``)
        and ``local`` [n, Q, Q] (each image's own tree mask). Returns features [rows, Q, D]."""
        Q = tokens.shape[1]
        slots = prefix_len[:, None] + torch.arange(Q, device=self.device)
        x = self.model.embed_tokens(self.rows_of(tokens))
        mask = LocalMask(self.rows_of(prefix_len), self.rows_of(local), self.key_valid if self.has_key_mask else None)
        self.last_positions = positions  # [n, Q]: the layout rules of each image's logits
        return self.model.forward_hidden(x, self.rows_of(positions), self.kv, self.rows_of(slots), mask)

    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   visible: torch.Tensor) -> torch.Tensor:
        """The general forward: ``tokens`` [n, Q] (per image; both CFG rows see them) at RoPE
        ``positions`` ([Q] or [rows, Q]), their K/V written to ``slots`` ([Q] or [rows, Q]); query q sees
        the cache slots ``visible`` [rows, Q, S] (bool) marks. Returns features [rows, Q, D]; the
        logits of the next :meth:`logits` call obey the family's layout at these positions."""
        x = self.model.embed_tokens(self.rows_of(tokens))
        self.last_positions = positions
        return self.model.forward_hidden(x, positions, self.kv, slots, visible[:, None])

    # --- row selection: the decode loop's admission and retirement ---------------------------------
    def declare_rows(self, table) -> None:
        """This session's per-row buffers (model rows) in a decoder's ``runtime.rows.RowTable``."""
        table.add("target_k", self.kv.k, dim=1, model_rows=True)
        table.add("target_v", self.kv.v, dim=1, model_rows=True)
        table.add("key_valid", self.key_valid, model_rows=True)
        table.add("cond_rows", self.cond_rows, model_rows=True)

    # --- prefill ------------------------------------------------------------------------------
    def prefill(self) -> torch.Tensor:
        """Run the condition; returns the features of every condition position [rows, c, D] (the
        last one's logits predict image token 0)."""
        c = self.c
        pos = torch.arange(c, device=self.device)
        x = self.model.embed_condition(self.cond_rows)
        self.last_positions = pos
        if not self.has_key_mask and flash.usable(self.device, self.dtype, self.model.config.head_dim):
            mask = LocalMask(torch.zeros(1, dtype=torch.long, device=self.device), causal_local(c, self.device), causal=True)
            return self.model.forward_hidden(x, pos, self.kv, pos, mask)
        vis = (self.slot_ids[None, :] <= pos[:, None])[None] & self.key_valid[:, None, :]
        vis = vis | (self.slot_ids[None, None, :] == pos[None, :, None])  # a padded query sees itself
        h = self.model.forward_hidden(x, pos, self.kv, pos, vis.unsqueeze(1))
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of features ``h`` from the last forward or prefill: all of its positions ([rows, Q, D])
        or its last one ([rows, D]). Tokens the family's layout forbids there get -1e9 in both CFG
        rows, so guidance keeps them out and a forced token has probability one."""
        lg = self.model.logits(h)
        if self.layout_forbidden is None:
            return lg
        pos = self.last_positions if h.dim() == 3 else self.last_positions[..., -1:]
        forbid = self.layout_forbidden[pos]  # [Q, V], or [B, Q, V] for per-row positions
        if forbid.dim() == 3 and forbid.shape[0] != lg.shape[0]:  # CFG: the unconditional rows repeat them
            forbid = forbid.repeat(lg.shape[0] // forbid.shape[0], 1, 1)
        return lg.masked_fill(forbid if h.dim() == 3 else forbid[..., 0, :], -1e9)
