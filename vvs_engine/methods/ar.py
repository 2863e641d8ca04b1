"""Plain autoregressive decoding: the baseline every speed-up is measured against.

A decoder of the one loop (``runtime.loop``) with one round kind, ``ar_step``: one target forward per
token for every row, both CFG rows of an image in the same batch, static KV cache. Each row has its
own position (rows admitted at different times sit at different tokens), so the step runs the target
with per-row positions and prefix lengths. Token t of an image is drawn with the counter RNG at step
t, keyed by the image, so its tokens do not depend on its batch or on when it was admitted. A
finished row keeps running (static shapes) but commits nothing: its count stops and its sampled
token goes to a spare column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..rng import Streams
from ..runtime.masks import causal_local
from ..runtime.target import TargetSession
from ..sampling import guided_logits, process_logits
from .registry import register
from .common import DecodeBatch, row_sampling, declare_decoder_rows, RowState


@dataclass
class ARState(RowState):
    tokens: torch.Tensor  # [B, T + 1] committed tokens; column T takes finished rows' samples
    count: torch.Tensor  # [B] tokens committed (the next token's index: its random-number step)
    last: torch.Tensor  # [B] the last sampled token (the next forward's input)
    passes: torch.Tensor  # [B] target forwards while the image was unfinished


class ARDecoder:
    """Plain AR as a ``runtime.loop`` decoder (the protocol is documented there)."""

    inductor_options: dict = {}
    RESULTS = ("tokens", "passes")  # what the loop collects per finished row (runtime.rows)

    def __init__(self, engine, batch: DecodeBatch, params):
        self.engine, self.rng = engine, batch.rng
        self.params = params = row_sampling(params, batch, batch.cond.device)
        self.session = s = TargetSession(engine.gpt, batch.cond, batch.size, params.use_cfg, batch.key_mask)
        self.c, self.T, self.device = s.c, s.T, s.device
        # The RNG's stream- and lane-offset caches are filled here, eagerly: filled inside a compiled step
        # they change what Dynamo guards on, and lane offsets made in a traced step overflow Inductor's
        # index arithmetic.
        self.rng.stream_offsets([Streams.SAMPLE])
        self.rng.lane_offsets(1)
        self._constants(batch.size)
        logits = self.processed(s.prefill()[:, -1])
        first = self.rng.sample(logits, 0, Streams.SAMPLE)  # token 0: step 0
        B = batch.size
        tokens = torch.zeros(B, self.T + 1, dtype=torch.long, device=self.device)
        tokens[:, 0] = first
        self.state = ARState(tokens=tokens, count=torch.ones(B, dtype=torch.long, device=self.device),
                             last=first.clone(), passes=torch.zeros(B, dtype=torch.long, device=self.device))

    def _constants(self, B: int) -> None:
        self.image_ids = torch.arange(B, device=self.device)
        self.one_query = causal_local(1, self.device)[None].expand(B, 1, 1)  # each row sees its prefix + itself

    def processed(self, h: torch.Tensor) -> torch.Tensor:
        return process_logits(guided_logits(self.session.logits(h), self.params), self.params)

    def ar_step(self) -> None:
        """One token for every row: static shapes, no host read."""
        st, s = self.state, self.session
        active = st.count < self.T
        position = self.c + st.count - 1  # the last token's position; its K/V go to that slot
        h = s.forward_per_sequence(st.last[:, None], position[:, None], position, self.one_query)[:, -1]
        token = kernels.counter_sample(self.rng, self.processed(h), st.count, Streams.SAMPLE)
        # index_put_ on the base buffer: in place under torch.compile
        st.tokens.index_put_((self.image_ids, st.count.clamp(max=self.T)), token)
        st.last.copy_(token)
        st.passes.add_(active.long())
        st.count.add_(active.long())

    # --- the decoder protocol of runtime.loop ----------------------------------------------------------
    def round_functions(self) -> dict:
        return {"ar_step": self.ar_step}

    def round_buffers(self) -> list:
        return self.state.tensors()

    def status(self) -> torch.Tensor:
        return self.state.count

    def next_kind(self, last_kind, late) -> str:
        return "ar_step"

    def declare_rows(self, table) -> None:
        declare_decoder_rows(table, self.session, self.params, self.rng, self.state)

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        return {"target_forward_passes": int(counters["passes"].sum())}


@register("ar")
def run_ar(engine, batch: DecodeBatch, params, opts) -> ARDecoder:
    return ARDecoder(engine, batch, params)
