"""Self-speculative decoding: a weight-only quantized copy of the target drafts, the target verifies.

No trained drafter: the draft model is the target with its linear weights quantized through torchao
(``drafting/quantized.py``), kept on the engine, with its own ``TargetSession``. One round per image:
the copy drafts a chain d_1..d_k (k forwards, d_j ~ q_{j-1}; greedy: argmax); ONE target forward over
[last, d_1..d_k] gives p_0..p_k; the exact speculative rule keeps the longest passing prefix d_1..d_n
and draws one more token from norm(max(p_n - q_n, 0)) (from p_k when all k passed). Every committed
token is distributed as the target's, whatever the copy: lossless by construction (chi-square test in
``tests/test_quant_draft.py``); greedy it gives greedy AR's tokens.

Both caches use slot = sequence position, so moving the committed count is the whole rewind; the
copy's first forward of a round re-runs the token at P - 1 beside the last one (after a round that
accepted all k drafts, d_k never ran through the copy; always re-running it keeps the shapes static).
One counter-RNG draw per round, keyed by the image and its own round number. In full:
docs/quantization.md "A quantized copy of the target as its drafter".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..acceptance.verify import ExactRule
from ..drafting.quantized import draft_dtype, quantized_copy
from ..errors import VVSError
from ..models.quantize import check_quantize
from ..rng import Streams, sample_inverse_cdf
from ..runtime.masks import causal_local
from ..runtime.target import TargetSession
from ..sampling import guided_logits, process_logits, value_at
from .common import DecodeBatch, row_sampling, declare_decoder_rows, RowState
from .options import MethodOptions, check_choice, check_int, option
from .registry import register

DRAFT_MODES = ("int8", "fp8", "int4")  # where check_quantize lets them run (int4: CUDA and bf16; never run here)
MAX_DRAFT = 32
QUANT_DRAFT_STREAM = 17  # counter-RNG stream of a round's uniforms (distinct from rng.Streams)


@dataclass
class QuantDraftOptions(MethodOptions):
    draft_length: int = option(4, "quant-draft: chain length k drafted by the quantized copy per round")
    draft_quantize: str = option("int8", "quant-draft: weight-only quantization of the drafting copy of the "
                                         "target: int8, fp8 or int4 (CUDA, bf16)")

    def validate(self):
        check_int("draft-length", self.draft_length, 1, MAX_DRAFT)
        check_choice("draft-quantize", self.draft_quantize, DRAFT_MODES)
        return self

    def check_engine(self, engine):
        if getattr(engine, "quantization", "none") != "none":
            raise VVSError(f"quant-draft verifies with the full-precision target, but this engine's weights are "
                           f"already quantized ({engine.quantization}): load it unquantized")
        check_quantize(self.draft_quantize, engine.device, draft_dtype(engine.dtype), flag="draft-quantize")

    def decode_shape(self, shape) -> tuple:
        # the copy's KV cache is as deep as the target's: counted as a second set of the target's slots
        extra = 2 * self.draft_length + 1
        return self.draft_length + 1, 2 * extra + shape.cls_token_num + shape.tokens_per_image, False


@dataclass
class QuantDraftState(RowState):
    tokens: torch.Tensor  # [B, T + 2k + 1] committed tokens; a round writes k + 1 from the count
    count: torch.Tensor  # [B] tokens committed
    last: torch.Tensor  # [B] the last committed token (not yet run through either model)
    passes: torch.Tensor  # [B] target forwards (rounds) while unfinished
    accepted_hist: torch.Tensor  # [B, k + 1] rounds that accepted exactly n drafts


class QuantDraftDecoder:
    """A ``runtime.loop`` decoder (protocol at the end of the class)."""

    inductor_options: dict = {}
    RESULTS = ("tokens", "passes", "accepted_hist")

    def __init__(self, engine, batch: DecodeBatch, params, opts: QuantDraftOptions):
        self.engine, self.rng, self.k = engine, batch.rng, opts.draft_length
        k = self.k
        self.params = params = row_sampling(params, batch, batch.cond.device)
        self.rule = ExactRule()
        B = self.B = batch.size
        self.target = TargetSession(engine.gpt, batch.cond, B, params.use_cfg, batch.key_mask, extra_slots=2 * k + 1)
        drafter = quantized_copy(engine, opts.draft_quantize)
        cond = batch.cond.to(draft_dtype(engine.dtype)) if batch.cond.is_floating_point() else batch.cond
        self.draft = TargetSession(drafter, cond, B, params.use_cfg, batch.key_mask, extra_slots=2 * k + 1)
        t = self.target
        self.c, self.T, self.V, dev = t.c, t.T, engine.config.vocab_size, t.device
        self.device, self.dtype = dev, t.dtype
        self.lanes = torch.arange(k + 1, device=dev)
        self.image_ids = torch.arange(B, device=dev)
        self.verify_mask = causal_local(k + 1, dev)[None].expand(B, k + 1, k + 1)
        self.one_query = causal_local(1, dev)[None].expand(B, 1, 1)
        self.scratch_slot = self.c + self.T + 2 * k  # the first round's throwaway query (past every row's use)
        self.stream = self.rng.stream_offsets([QUANT_DRAFT_STREAM])
        self.rng.stream_offsets([Streams.SAMPLE])
        self.rng.lane_offsets(1)
        p0 = self.processed(t, t.prefill()[:, -1])
        self.draft.prefill()
        first = self.rng.sample(p0, 0, Streams.SAMPLE)  # token 0 as AR draws it
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        self.state = QuantDraftState(tokens=z(B, self.T + 2 * k + 1), count=torch.ones(B, dtype=torch.long, device=dev),
                                     last=first.clone(), passes=z(B), accepted_hist=z(B, k + 1))
        self.state.tokens[:, 0] = first

    def processed(self, session, h: torch.Tensor) -> torch.Tensor:
        return process_logits(guided_logits(session.logits(h).to(self.dtype), self.params), self.params)

    def first_draft_forward(self, st, P):
        """The copy's first forward of a round: the token before the last one (slot P - 1; a scratch slot
        in the first round) and the last one (slot P). -> features of the last one [rows, D]."""
        d = self.draft
        before = st.tokens.gather(1, (st.count - 2).clamp(min=0)[:, None])[:, 0]
        slot0 = torch.where(st.count >= 2, P - 1, self.scratch_slot)
        slots = d.rows_of(torch.stack([slot0, P], 1))  # [rows, 2]
        positions = d.rows_of(torch.stack([P - 1, P], 1)).clamp(max=self.c + self.T - 1)
        prefix = d.rows_of(torch.stack([P - 1, P], 1))
        visible = (d.slot_ids < prefix[..., None]) | (d.slot_ids == slots[..., None])  # [rows, 2, S]
        if d.has_key_mask:
            visible = visible & (d.key_valid[:, None] | (d.slot_ids == slots[..., None]))
        return d.forward_at(torch.stack([before, st.last], 1), positions, slots, visible)[:, -1]

    def round(self) -> None:
        """One draft chain and one verification for every row: static shapes, no host read."""
        st, k, V, B = self.state, self.k, self.V, self.B
        active = st.count < self.T
        P = self.c + st.count - 1  # the last committed token's position
        last_pos = self.c + self.T - 1  # positions past it only feed discarded overshoot
        u = self.rng_round(st)  # [B, 2k + 1]
        drafts, qs = [], []
        h = self.first_draft_forward(st, P)
        for j in range(k):
            if j:
                pos = (P + j)[:, None]
                h = self.draft.forward_per_sequence(drafts[-1][:, None], pos.clamp(max=last_pos), P + j,
                                                    self.one_query)[:, -1]
            q = self.processed(self.draft, h)
            uj = u[:, j]
            drafts.append(self.params.pick(lambda: q.argmax(-1), lambda: sample_inverse_cdf(q, uj)))
            qs.append(q)
        d = torch.stack(drafts, 1)  # [B, k]
        q = torch.stack(qs + [torch.zeros_like(qs[0])], 1)  # [B, k + 1, V]; row k: no draft (q = 0)
        chain = torch.cat([st.last[:, None], d], 1)  # [B, k + 1]
        positions = (P[:, None] + self.lanes).clamp(max=last_pos)
        p = self.processed(self.target, self.target.forward_per_sequence(chain, positions, P, self.verify_mask))
        ok = self.params.pick(lambda: p[:, :k].argmax(-1) == d, lambda: self.test_drafts(p, q, d, u[:, k: 2 * k]))
        n = ok.long().cumprod(1).sum(1)  # [B] accepted drafts, 0..k
        residual = self.rule.residual(p.reshape(-1, V), q.reshape(-1, V), None, None).view(B, k + 1, V)
        us = u[:, 2 * k, None].expand(B, k + 1)
        nxt = self.params.pick(lambda: p.argmax(-1), lambda: sample_inverse_cdf(residual, us))
        nxt = nxt.gather(1, n[:, None])[:, 0]
        values = torch.where(self.lanes == n[:, None], nxt[:, None], torch.cat([d, d[:, -1:]], 1))
        st.tokens.index_put_((self.image_ids[:, None], st.count[:, None] + self.lanes), values)
        st.accepted_hist.add_(((self.lanes == n[:, None]) & active[:, None]).long())
        st.passes.add_(active.long())
        st.last.copy_(nxt)
        st.count.add_((n + 1) * active.long())

    def test_drafts(self, p, q, d, u_test) -> torch.Tensor:
        """[B, k] bool: draft d_{j+1} passes the exact rule against p_j (u * q(x) < p(x))."""
        B, k, V = d.shape[0], self.k, self.V
        ok, _ = self.rule.accept(p[:, :k].reshape(-1, V), d.reshape(-1), value_at(q[:, :k], d).reshape(-1),
                                 u_test.reshape(-1), None)
        return ok.view(B, k)

    def rng_round(self, st) -> torch.Tensor:
        return kernels.counter_uniform(self.rng.key, st.passes + 1, self.stream, 2 * self.k + 1,
                                       fuse_when_compiled=True)[:, 0]

    # --- the decoder protocol of runtime.loop ----------------------------------------------------------
    def round_functions(self) -> dict:
        return {"quant_draft": self.round}

    def round_buffers(self) -> list:
        return self.state.tensors()

    def status(self) -> torch.Tensor:
        return self.state.count

    def next_kind(self, last_kind, late) -> str:
        return "quant_draft"

    def declare_rows(self, table) -> None:
        d = self.draft
        table.add("draft_k", d.kv.k, dim=1, model_rows=True)
        table.add("draft_v", d.kv.v, dim=1, model_rows=True)
        table.add("draft_key_valid", d.key_valid, model_rows=True)
        table.add("draft_cond_rows", d.cond_rows, model_rows=True)
        declare_decoder_rows(table, self.target, self.params, self.rng, self.state)

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        hist = counters["accepted_hist"].sum(0).tolist()
        rounds = sum(hist)
        accepted = sum(n * c for n, c in enumerate(hist))
        return {"target_forward_passes": rounds, "draft_forward_passes": rounds * self.k,
                "draft_length": self.k, "accepted_drafts_histogram": hist,
                "mean_accepted_length": accepted / rounds + 1 if rounds else 0.0}


@register("quant-draft", QuantDraftOptions)
def run_quant_draft(engine, batch: DecodeBatch, params, opts: QuantDraftOptions) -> QuantDraftDecoder:
    return QuantDraftDecoder(engine, batch, params, opts)
