"""Row-parallel drafts verified exactly in raster order (``--method row-drafts``; PJD spec E3, "ZipAR as a
draft source"). ZipAR's rows run ahead as a *draft source*; nothing is committed except by SJD's exact
test at the raster frontier, so the tokens are distributed as raster AR's whatever the rows propose
(docs/zipar.md "Row drafts verified in raster order").

One target forward per round serves two kinds of lanes:

* **the verifier**: an SJD window of ``jacobi_window`` (Lv) lanes at the raster frontier: lane 0 the
  last committed token (position n - 1), lane j the current draft of position n - 1 + j. It sees the
  committed prefix only (its K/V were computed with full raster context) and its own lanes causally:
  draft j + 1 is tested against lane j's target p with its declared q (accept iff u q(x) < p(x)); the
  accepted prefix and one residual / bonus token are committed (the speculative-sampling lemma: each
  committed token is a sample of the raster target). Lanes past the accepted prefix leave Jacobi
  samples (q = p) as drafts, as SJD.
* **draft rows**: up to R image rows below the verifier's reach, each a ZipAR(+SJD) row window of
  ``zipar_jacobi_window`` (Ld) lanes at its *provisional* frontier. A row starts once the row above
  holds ``zipar_window`` (s) codes and then decides column c while the row above holds c +
  ``zipar_commit_lag`` codes (PJD's adaptive lag: start 8, commit 2; 0 = s, ZipAR's rule). What ZipAR
  would commit is stored as a provisional draft with q = the distribution of the lane that decided it
  (a tested draft or a residual sample of it is a sample of that p, so the declared q is its law).
  Rows see the filled slots before them in raster order (committed, the verifier's lanes, the rows'
  provisional K/V) and their own lanes causally.

Why it is exact: every draft the verifier tests was drawn from its declared q with random numbers of its
own, and which draft sits at a position when the verifier reaches it depends only on events at earlier
raster positions (a row decides column c only after its tests at columns < c; the verifier's Jacobi
samples see its lanes before them). Draft lanes never write a slot the verifier reads (they feed
positions >= n + Lv only), and the verifier reads committed slots and its own lanes only. Greedy, the
verifier commits greedy AR's tokens. ``row_after_reject`` picks what a rejection does to the
row-drafted tokens after it in the verifier's window: ``jacobi`` (SJD's Jacobi samples replace them) or
``keep``. Random numbers are keyed by image and raster index (the verifier's residual or bonus token at
index t: step t of ``SAMPLE``, as AR draws it), by the image's round and raster index (the verifier's
tests and Jacobi samples) and by the row's round and raster index (draft rows), so tokens do not depend
on the batch.

Square grids without end-of-line tokens (LlamaGen, Janus-Pro, the Zoo). State per image: the token
buffer (committed prefix, then drafts) with each draft's q [T, V] (T x V floats per image).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..acceptance.verify import ExactRule
from ..errors import VVSError
from ..rng import Streams, sample_inverse_cdf
from ..runtime.target import TargetSession
from ..sampling import guided_logits, process_logits, value_at
from .common import DecodeBatch, RowState, declare_decoder_rows, row_sampling
from .jacobi import GSDOptions, SJDOptions
from .options import MethodOptions, check_choice, check_int, help_of, option
from .registry import register
from .zipar import ZipAROptions, row_geometry, rows_in_flight

AFTER_REJECT = ("jacobi", "keep")
COUPLINGS = ("none", "maximal")
MAX_LANES = 64
ROW_TEST_STREAM = 19  # draft rows' acceptance uniforms (step: row round x stride + raster index)
ROW_SAMPLE_STREAM = 20  # draft rows' residual / bonus samples
ROW_UPDATE_STREAM = 21  # draft rows' Jacobi samples


@dataclass
class RowDraftOptions(MethodOptions):
    # the flags shared with SJD and ZipAR keep their help (row-drafts: jacobi_window = the raster verifier's
    # lanes, zipar_jacobi_window = lanes per draft row)
    jacobi_window: int = option(32, help_of(SJDOptions, "jacobi_window"))
    zipar_window: int = option(4, help_of(ZipAROptions, "zipar_window"))
    zipar_commit_lag: int = option(2, help_of(ZipAROptions, "zipar_commit_lag"))
    zipar_jacobi_window: int = option(1, help_of(ZipAROptions, "zipar_jacobi_window"))
    row_after_reject: str = option("jacobi", "row-drafts: after the raster verifier rejects a token, the row-drafted "
                                             "tokens after it in its window: jacobi (replaced by the verifier's "
                                             "Jacobi samples, as SJD) or keep")
    coupling: str = option("maximal", help_of(GSDOptions, "coupling"))
    row_redraw: int = option(0, "row-drafts: when the verifier rejects the draft of row r, column c, the row-drafted "
                                "tokens after it in row r and from column c - j on in row r + j (j <= this) are "
                                "drawn again with the new context (0: off)")
    # negative control for the exactness tests only: the verifier commits row-drafted tokens untested (what
    # ZipAR commits: samples of a partial-context target)
    row_drafts_untested: bool = False

    def validate(self):
        check_int("jacobi-window", self.jacobi_window, 2, MAX_LANES)
        check_int("zipar-jacobi-window", self.zipar_jacobi_window, 1, MAX_LANES)
        check_int("zipar-window", self.zipar_window, 1)
        check_int(f"zipar-commit-lag (zipar-window = {self.zipar_window})", self.zipar_commit_lag, 0, self.zipar_window)
        check_int("row-redraw", self.row_redraw, 0)
        check_choice("coupling", self.coupling, COUPLINGS)
        check_choice("row-after-reject", self.row_after_reject, AFTER_REJECT)
        return self

    def check_engine(self, engine):
        if row_geometry(engine.gpt).eol is not None:
            raise VVSError("row-drafts needs a square token grid without end-of-line tokens (LlamaGen, Janus-Pro); "
                           "use zipar or pjd on this family")

    @property
    def commit_lag(self) -> int:
        return self.zipar_commit_lag or self.zipar_window

    def decode_shape(self, shape) -> tuple:
        side = max(1, round(shape.tokens_per_image ** 0.5))
        q = self.jacobi_window + min(side, (side - 1) // self.commit_lag + 2) * self.zipar_jacobi_window
        return q, q, False


@dataclass
class RowDraftState(RowState):
    """Device state of a batched decode (static shapes, updated in place). Per-row arrays have H + R + 2
    entries: image row r at entry r + 1, entry 0 a complete virtual row above row 0, the last entry a
    write sink; the token buffer's last position is a write sink too."""

    tokens: torch.Tensor  # [B, T + Lv + 1] committed tokens (< n), then the current draft of each position
    q: torch.Tensor  # [B, T + Lv + 1, V] the law each stored draft was drawn from
    drawn: torch.Tensor  # [B, T + Lv + 1] bool: a drawn draft is stored (else a copy of the token above is fed)
    row_drafted: torch.Tensor  # [B, T + Lv + 1] bool: the stored draft was decided by a draft row
    n: torch.Tensor  # [B] committed tokens (raster order): the loop's one read
    provisional: torch.Tensor  # [B, H + R + 2] codes of the row decided (committed or row-drafted)
    written: torch.Tensor  # [B, H + R + 2] codes of the row whose K/V the rows below may read
    row_rounds: torch.Tensor  # [B, H + R + 2] forwards the row took part in
    passes: torch.Tensor  # [B] forwards while the image was unfinished
    accepted: torch.Tensor  # [B] drafts the verifier accepted
    accepted_row_drafts: torch.Tensor  # [B] ... of which row-drafted (provisional) tokens
    row_tokens: torch.Tensor  # [B] provisional tokens the draft rows decided
    busiest: torch.Tensor  # [B] most draft rows in one forward


@dataclass(frozen=True)
class RowDraftLayout:
    """The host constants of one batched decode (a compiled round reads them as constants)."""

    B: int  # images (rows of the batch)
    H: int  # image rows
    W: int  # codes per row
    Lv: int  # the verifier's lanes
    Ld: int  # lanes per draft row
    R: int  # draft rows per forward
    Q: int  # query lanes per image and forward: Lv + R * Ld
    T: int  # tokens per image
    V: int  # vocabulary
    c: int  # condition slots
    start_lag: int  # a row starts once the row above holds this many codes
    lag: int  # ... and then decides column c while the row above holds c + lag
    keep: bool  # row_after_reject keep

    @classmethod
    def of(cls, geo, opts, B, R, c, T, V) -> "RowDraftLayout":
        Lv, Ld = opts.jacobi_window, opts.zipar_jacobi_window
        return cls(B, geo.rows, geo.codes, Lv, Ld, R, Lv + R * Ld, T, V, c, opts.zipar_window, opts.commit_lag,
                   opts.row_after_reject == "keep")

    @property
    def sink(self) -> int:
        """The token buffer's write sink (its last position)."""
        return self.T + self.Lv

    @property
    def stride(self) -> int:
        """Steps per round in the random-number keys of draws made every round (round x stride + position)."""
        return self.T + self.Lv + 1


@dataclass(frozen=True)
class RowDraftIndex:
    """Constant index tensors and random-number streams of the rounds, made once."""

    vlanes: torch.Tensor  # [Lv]
    dlanes: torch.Tensor  # [Ld]
    rlanes: torch.Tensor  # [R]
    image_rows: torch.Tensor  # [H]
    vocab: torch.Tensor  # [V]
    scratch: torch.Tensor  # [Q] a scratch slot per lane
    ids: torch.Tensor  # [B, 1]
    is_image: torch.Tensor  # [S] the slot holds an image token
    slot_pos: torch.Tensor  # [S] raster index of an image slot (others: past every position)
    slot_entry: torch.Tensor  # [S] per-row entry of an image slot's row (others: 0)
    slot_col: torch.Tensor  # [S] column of an image slot (others: W)
    streams: dict  # name -> stream offsets

    @classmethod
    def of(cls, lay: RowDraftLayout, s: TargetSession, rng) -> "RowDraftIndex":
        dev = s.device
        pos = s.slot_ids - lay.c
        is_image = (pos >= 0) & (pos < lay.T)
        streams = {name: rng.stream_offsets([k]) for name, k in (
            ("sample", Streams.SAMPLE), ("accept", Streams.ACCEPT), ("update", Streams.JACOBI_UPDATE),
            ("row_test", ROW_TEST_STREAM), ("row_sample", ROW_SAMPLE_STREAM), ("row_update", ROW_UPDATE_STREAM))}
        arange = lambda n: torch.arange(n, device=dev)
        return cls(arange(lay.Lv), arange(lay.Ld), arange(lay.R), arange(lay.H), arange(lay.V),
                   lay.c + lay.T + arange(lay.Q), arange(lay.B)[:, None], is_image,
                   torch.where(is_image, pos, lay.T + lay.Q + 1),
                   torch.where(is_image, pos.div(lay.W, rounding_mode="floor") + 1, 0),
                   torch.where(is_image, pos.remainder(lay.W), lay.W), streams)


class RowDraftDecoder:
    """A ``runtime.loop`` decoder (protocol at the end of the class); :meth:`round` is the round function."""

    inductor_options: dict = {}
    RESULTS = ("tokens", "passes", "accepted", "accepted_row_drafts", "row_tokens", "busiest")

    @classmethod
    def start(cls, engine, batch: DecodeBatch, params, opts: RowDraftOptions) -> "RowDraftDecoder":
        decoder = cls(engine, batch, params, opts)
        decoder.state = decoder.prefill()
        return decoder

    def __init__(self, engine, batch: DecodeBatch, params, opts: RowDraftOptions):
        self.engine, self.opts, self.rng, self.rule = engine, opts, batch.rng, ExactRule()
        self.params = row_sampling(params, batch, batch.cond.device)
        geo = row_geometry(engine.gpt)
        R = rows_in_flight(geo, opts.commit_lag)
        Q = opts.jacobi_window + R * opts.zipar_jacobi_window
        self.session = s = TargetSession(engine.gpt, batch.cond, batch.size, self.params.use_cfg, batch.key_mask,
                                         extra_slots=Q)
        self.layout = RowDraftLayout.of(geo, opts, batch.size, R, s.c, s.T, engine.config.vocab_size)
        self.index = RowDraftIndex.of(self.layout, s, self.rng)

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.params.use_cfg else x

    def processed(self, h: torch.Tensor) -> torch.Tensor:
        return process_logits(guided_logits(self.session.logits(h), self.params), self.params)

    def uniforms(self, step: torch.Tensor, stream: str) -> torch.Tensor:
        """Counter-RNG uniforms keyed by (image, ``step`` [B, ...]) on one stream -> [B, ...]."""
        key = self.rng.key.view(self.layout.B, *([1] * (step.dim() - 1))).expand(step.shape)
        return kernels.counter_uniform(key.reshape(-1), step.reshape(-1), self.index.streams[stream], 1).view(step.shape)

    def sample(self, dist: torch.Tensor, step: torch.Tensor, stream: str) -> torch.Tensor:
        return self.params.pick(lambda: dist.argmax(-1), lambda: sample_inverse_cdf(dist, self.uniforms(step, stream)))

    def redraw(self, p, fed, fed_q, passed, step, stream):
        """The Jacobi samples y[j] ~ p[j] (lane j's target) that become the next drafts. ``maximal`` coupling
        (SCD): the draft fed at lane j + 1 itself where its test against p[j] passed (``passed`` [..., L - 1]),
        else a sample of norm(max(0, p[j] - q)) (a sample of p[j] either way: the speculative-sampling lemma);
        the last lane has no draft and samples p."""
        y = self.sample(p, step, stream)
        if self.opts.coupling == "none":
            return y
        V = p.shape[-1]
        res = self.rule.residual(p[..., :-1, :].reshape(-1, V), fed_q[..., 1:, :].reshape(-1, V),
                                 fed[..., 1:].reshape(-1), None).view(p[..., :-1, :].shape)
        replaced = self.sample(res, step[..., :-1], stream)
        coupled = torch.where(passed, fed[..., 1:], replaced)
        return torch.cat([coupled, y[..., -1:]], -1)

    # --- prefill (eager) ----------------------------------------------------------------------------
    def prefill(self) -> RowDraftState:
        B, T, V, W, dev = self.layout.B, self.layout.T, self.layout.V, self.layout.W, self.session.device
        p0 = self.processed(self.session.prefill()[:, -1])
        first = self.rng.sample(p0, 0, Streams.SAMPLE)  # as AR draws image token 0
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        n_entries = self.layout.H + self.layout.R + 2
        tokens = zeros(B, T + self.layout.Lv + 1)
        tokens[:, 0] = first
        entry = torch.arange(n_entries, device=dev)
        provisional = torch.where(entry == 0, W, (entry == 1).long()).expand(B, n_entries).clone()
        written = torch.where(entry == 0, W, 0).expand(B, n_entries).clone()
        return RowDraftState(tokens=tokens, q=torch.zeros(B, T + self.layout.Lv + 1, V, device=dev),
                             drawn=torch.zeros(B, T + self.layout.Lv + 1, dtype=torch.bool, device=dev),
                             row_drafted=torch.zeros(B, T + self.layout.Lv + 1, dtype=torch.bool, device=dev),
                             n=torch.ones(B, dtype=torch.long, device=dev), provisional=provisional, written=written,
                             row_rounds=zeros(B, n_entries), passes=zeros(B), accepted=zeros(B),
                             accepted_row_drafts=zeros(B), row_tokens=zeros(B), busiest=zeros(B))

    # --- one forward: static shapes, no host read ---------------------------------------------------
    def drafts_at(self, st: RowDraftState, position: torch.Tensor):
        """The draft fed at raster ``position`` [B, ...] and its declared law: the stored draft with its q,
        or (nothing drawn there yet) a copy of the token above, one row up (row 0: of token 0), one-hot q."""
        B, V, W = self.layout.B, self.layout.V, self.layout.W
        flat = position.reshape(B, -1).clamp(0, self.layout.sink)
        stored = st.tokens.gather(1, flat)
        drawn = st.drawn.gather(1, flat)
        above = st.tokens.gather(1, (flat - W).clamp(min=0))
        token = torch.where(drawn, stored, above)
        q = st.q.gather(1, flat[..., None].expand(*flat.shape, V))
        q = torch.where(drawn[..., None], q, (token[..., None] == self.index.vocab).to(q.dtype))
        return token.view(position.shape), q.view(*position.shape, V)

    def round(self) -> None:
        st, s = self.state, self.session
        B, Lv, Ld, R, V, T, W, H, c = self.layout.B, self.layout.Lv, self.layout.Ld, self.layout.R, self.layout.V, self.layout.T, self.layout.W, self.layout.H, self.layout.c
        n = st.n
        live_image = n < T

        # --- the verifier's window at the raster frontier ------------------------------------------
        vpos = n[:, None] - 1 + self.index.vlanes  # [B, Lv]
        vlive = vpos < T
        vtok, vq = self.drafts_at(st, vpos)
        vtok = torch.where(self.index.vlanes == 0, st.tokens.gather(1, (n - 1)[:, None]), vtok)
        vslot = torch.where(vlive, c + vpos, self.index.scratch[:Lv])
        v_row_drafted = st.row_drafted.gather(1, vpos.clamp(0, self.layout.sink))

        # --- the draft rows: the first row not fully decided and R - 1 after it. The verifier decides positions
        # < n + Lv (its reach): they count as decided, so a row's lanes feed positions >= n + Lv - 1 and write
        # no slot and decide no token the verifier does
        reach_cols = (n[:, None] + Lv - self.index.image_rows * W).clamp(0, W)  # [B, H]
        decided_cols = st.provisional.clone()
        decided_cols[:, 1: H + 1] = torch.maximum(st.provisional[:, 1: H + 1], reach_cols)
        top = torch.where(decided_cols[:, 1: H + 1] < W, self.index.image_rows, H).amin(1)
        row = top[:, None] + self.index.rlanes  # [B, R]
        at = row + 1
        codes, above = decided_cols.gather(1, at), decided_cols.gather(1, at - 1)
        started = (codes > 0) | (above >= self.layout.start_lag)
        last_allowed = torch.where(above >= W, W - 1, torch.where(started, above - self.layout.lag, -1))
        serve = (row < H) & (codes < W) & live_image[:, None]
        allowed = torch.where(serve, (last_allowed - codes + 1).clamp(0, Ld), 0)  # columns it may decide now
        active = allowed > 0
        stand_in = active & (codes == 0) & (above < W)  # a start before the row above is complete
        column = codes[..., None] - 1 + self.index.dlanes  # [B, R, Ld] column fed (-1: the row's start)
        rpos = row[..., None] * W + column  # lane 0 of a start: the raster predecessor
        rlive = active[..., None] & (column < W)
        rtok, rq = self.drafts_at(st, rpos)
        newest_above = st.tokens.gather(1, ((row - 1) * W + above - 1).clamp(0, T - 1))
        lane0 = torch.where(stand_in, newest_above, st.tokens.gather(1, rpos[..., 0].clamp(0, T - 1)))
        rtok = torch.cat([lane0[..., None], rtok[..., 1:]], -1)
        own_slot = rlive & ~(stand_in[..., None] & (self.index.dlanes == 0))
        rslot = torch.where(own_slot, c + rpos, self.index.scratch[Lv:].view(R, Ld))

        # --- what each lane sees ------------------------------------------------------------------
        slot_ids = s.slot_ids
        committed = self.index.is_image & (self.index.slot_pos < (n - 1)[:, None])  # [B, S]: K/V of full raster context
        vmine = vslot[..., None] == slot_ids  # [B, Lv, S]
        v_visible = committed[:, None] | (vmine.long().cumsum(1) > 0)
        in_window = self.index.is_image & (self.index.slot_pos >= (n - 1)[:, None]) & (self.index.slot_pos < (n - 1 + Lv)[:, None])
        rows_written = st.written.gather(1, self.index.slot_entry.expand(B, -1))
        filled = committed | in_window | (self.index.is_image & (self.index.slot_col < rows_written))
        before = self.index.slot_pos < rpos[..., 0, None]  # [B, R, S]: raster order
        rmine = rslot[..., None] == slot_ids  # [B, R, Ld, S]
        window = (rmine & own_slot[..., None]).long().cumsum(2) > 0
        r_visible = (filled[:, None] & before)[:, :, None] | window | rmine
        visible = torch.cat([v_visible, r_visible.view(B, R * Ld, -1)], 1)
        mask = self.rows_of(visible) | ((slot_ids < c) & s.key_valid)[:, None, :]

        inputs = torch.cat([vtok, rtok.view(B, -1)], 1)
        positions = (c + torch.cat([vpos, rpos.view(B, -1)], 1)).clamp(c, c + T - 1)
        slots = torch.cat([vslot, rslot.view(B, -1)], 1)
        p = self.processed(s.forward_at(inputs, self.rows_of(positions), self.rows_of(slots), mask))
        pv, pr = p[:, :Lv], p[:, Lv:].view(B, R, Ld, V)

        self.verify(st, pv, vtok, vq, vpos, vlive, v_row_drafted, live_image)
        self.draft_rows(st, pr, rtok, rq, row, codes, allowed, rpos, active, stand_in)
        self.count(st, active, live_image)

    def verify(self, st, pv, vtok, vq, vpos, vlive, v_row_drafted, live_image) -> None:
        """SJD's exact test of the window's drafts against the raster target; commit the accepted prefix
        and one residual / bonus token; Jacobi samples after it."""
        B, Lv, V, T, W = self.layout.B, self.layout.Lv, self.layout.V, self.layout.T, self.layout.W
        n, lanes = st.n, self.index.vlanes
        d, qd = vtok[:, 1:], vq[:, 1:]  # draft j + 1, tested against lane j's p
        testable = vlive[:, 1:] & live_image[:, None]
        round_key = st.passes[:, None] * self.layout.stride
        ok = self.params.pick(lambda: pv[:, :-1].argmax(-1) == d,
                              lambda: self.uniforms(round_key + vpos[:, 1:], "accept") * value_at(qd, d)
                              < value_at(pv[:, :-1], d))
        if self.opts.row_drafts_untested:  # negative control: row-drafted tokens pass untested
            ok = ok | v_row_drafted[:, 1:]
        k = (ok & testable).long().cumprod(1).sum(1)  # [B] accepted drafts
        rejected = k < testable.long().sum(1)
        after = (k + 1).clamp(max=Lv - 1)
        q_k = torch.where(rejected[:, None], vq.gather(1, after[:, None, None].expand(B, 1, V))[:, 0], 0.0)
        p_k = pv.gather(1, k[:, None, None].expand(B, 1, V))[:, 0]
        residual = self.rule.residual(p_k, q_k, vtok.gather(1, after[:, None])[:, 0], None)
        nxt = self.params.pick(lambda: p_k.argmax(-1),
                               lambda: sample_inverse_cdf(residual, self.uniforms(n + k, "sample")))
        # lane j decides position n + j: the accepted drafts, the token after them, then Jacobi samples
        y = self.redraw(pv, vtok, vq, ok & testable, round_key + n[:, None] + lanes, "update")
        values = torch.where(lanes < k[:, None], torch.cat([d, d[:, :1]], 1), torch.where(lanes == k[:, None], nxt[:, None], y))
        decided = n[:, None] + lanes
        replace = (lanes > k[:, None]) & (decided < T)
        if self.layout.keep:  # row-drafted tokens stay until the verifier tests them
            replace = replace & ~st.row_drafted.gather(1, decided.clamp(max=self.layout.sink))
        write = live_image[:, None] & ((lanes <= k[:, None]) | replace)
        target = torch.where(write, decided, self.layout.sink)
        st.tokens.index_put_((self.index.ids.expand(B, Lv), target), values)
        st.q.index_put_((self.index.ids.expand(B, Lv), target), pv)
        st.drawn.index_put_((self.index.ids.expand(B, Lv), target), torch.ones_like(write))
        st.row_drafted.index_put_((self.index.ids.expand(B, Lv), target), torch.zeros_like(write))
        st.accepted.add_(torch.where(live_image, k, 0))
        st.accepted_row_drafts.add_(((lanes[:-1] < k[:, None]) & v_row_drafted[:, 1:] & live_image[:, None]).long().sum(1))
        st.n.copy_(torch.where(live_image, (n + k + 1).clamp(max=T), n))
        if self.opts.row_redraw:  # the rows' drafts that saw the rejected draft are drawn again
            at = n + k  # the residual's position
            dist = self.index.image_rows - at[:, None] // W  # [B, H]
            keep_cols = torch.where(dist == 0, at[:, None] % W + 1, (at[:, None] % W - dist).clamp(min=0))
            roll = (rejected & live_image)[:, None] & (dist >= 0) & (dist <= self.opts.row_redraw)
            rows = st.provisional[:, 1: self.layout.H + 1]
            st.provisional[:, 1: self.layout.H + 1] = torch.where(roll, torch.minimum(rows, keep_cols), rows)
            st.written[:, 1: self.layout.H + 1] = torch.minimum(st.written[:, 1: self.layout.H + 1], st.provisional[:, 1: self.layout.H + 1])
            position = torch.arange(T, device=n.device)
            still = (position % W) < st.provisional.gather(1, (position // W + 1).expand(B, T))
            st.row_drafted[:, :T] &= still

    def draft_rows(self, st, pr, rtok, rq, row, codes, allowed, rpos, active, stand_in) -> None:
        """Each active row's window as ZipAR + SJD against its partial-context target: its accepted drafts
        and one residual / bonus token become provisional drafts (q = the deciding lane's p), Jacobi samples
        after them; nothing is committed."""
        B, R, Ld, V, T, W = self.layout.B, self.layout.R, self.layout.Ld, self.layout.V, self.layout.T, self.layout.W
        lanes = self.index.dlanes
        rounds = st.row_rounds.gather(1, row + 1)
        key = rounds[..., None] * self.layout.stride  # [B, R, 1]
        decided = row[..., None] * W + codes[..., None] + lanes  # lane j decides this position
        if Ld > 1:
            d, qd = rtok[..., 1:], rq[..., 1:, :]
            testable = (lanes[1:] <= allowed[..., None] - 1) & (rpos[..., 1:] < T)
            ok = self.params.pick(lambda: pr[..., :-1, :].argmax(-1) == d,
                                  lambda: self.uniforms(key + rpos[..., 1:], "row_test") * value_at(qd, d)
                                  < value_at(pr[..., :-1, :], d))
            k = (ok & testable).long().cumprod(-1).sum(-1)  # [B, R]
            rejected = k < testable.long().sum(-1)
            after = (k + 1).clamp(max=Ld - 1)
            q_k = torch.where(rejected[..., None], rq.gather(2, after[..., None, None].expand(B, R, 1, V))[..., 0, :], 0.0)
            rejected_token = rtok.gather(2, after[..., None])[..., 0]
            shifted = torch.cat([d, d[..., :1]], -1)
        else:
            k = torch.zeros_like(codes)
            q_k = torch.zeros(B, R, V, device=pr.device, dtype=pr.dtype)
            rejected_token, shifted = k, rtok
        p_k = pr.gather(2, k[..., None, None].expand(B, R, 1, V))[..., 0, :]
        residual = self.rule.residual(p_k.reshape(-1, V), q_k.reshape(-1, V), rejected_token.reshape(-1), None).view(B, R, V)
        nxt = self.params.pick(lambda: p_k.argmax(-1), lambda: sample_inverse_cdf(
            residual, self.uniforms(key[..., 0] + row * W + codes + k, "row_sample")))
        y = self.redraw(pr, rtok, rq, ok & testable, key + decided, "row_update") if Ld > 1 else \
            self.sample(pr, key + decided, "row_update")
        values = torch.where(lanes < k[..., None], shifted, torch.where(lanes == k[..., None], nxt[..., None], y))
        q = pr
        write = active[..., None] & (codes[..., None] + lanes < W)
        target = torch.where(write, decided, self.layout.sink)
        ids = self.index.ids[..., None].expand(B, R, Ld)
        st.tokens.index_put_((ids, target), values)
        st.q.index_put_((ids, target), q)
        st.drawn.index_put_((ids, target), torch.ones_like(write))
        st.row_drafted.index_put_((ids, target), lanes <= k[..., None])
        commits = torch.where(active, torch.minimum(k + 1, allowed), 0)
        sink_entry = st.provisional.shape[1] - 1
        at = torch.where(active, row + 1, sink_entry)
        st.provisional.index_put_((self.index.ids.expand(B, R), at), codes + commits)
        st.written.index_put_((self.index.ids.expand(B, R), at), torch.maximum(st.written.gather(1, row + 1), codes + k))
        real_start = active & (codes == 0) & ~stand_in  # its lane 0 wrote the last code of the row above
        st.written.index_put_((self.index.ids.expand(B, R), torch.where(real_start, row, sink_entry)),
                              torch.full_like(codes, W))
        st.row_rounds.index_put_((self.index.ids.expand(B, R), at), rounds + 1)
        st.row_tokens.add_(commits.sum(1))

    def count(self, st, active, live_image) -> None:
        """Committed columns count as decided for the rows' window rule; the round's counters."""
        H, W = self.layout.H, self.layout.W
        committed_cols = (st.n[:, None] - self.index.image_rows * W).clamp(0, W)
        st.provisional[:, 1: H + 1] = torch.maximum(st.provisional[:, 1: H + 1], committed_cols)
        st.passes.add_(live_image.long())
        st.busiest.copy_(torch.maximum(st.busiest, active.long().sum(1)))

    # --- the decoder protocol of runtime.loop ----------------------------------------------------------
    def round_functions(self) -> dict:
        return {"row_drafts": self.round}

    def round_buffers(self) -> list:
        return self.state.tensors()

    def status(self) -> torch.Tensor:
        return self.state.n

    def next_kind(self, last_kind, late) -> str:
        return "row_drafts"

    def declare_rows(self, table) -> None:
        declare_decoder_rows(table, self.session, self.params, self.rng, self.state)

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        passes, accepted = int(counters["passes"].sum()), int(counters["accepted"].sum())
        return {"target_forward_passes": passes, "batch_iterations": loop_stats["batch_rounds"],
                "jacobi_window": self.layout.Lv, "zipar_window": self.layout.start_lag, "zipar_commit_lag": self.layout.lag,
                "zipar_lanes": self.layout.Ld, "zipar_rows": self.layout.R, "row_after_reject": self.opts.row_after_reject,
                "accepted_drafts": accepted, "accepted_row_drafts": int(counters["accepted_row_drafts"].sum()),
                "row_draft_tokens": int(counters["row_tokens"].sum()),
                "mean_accepted_length": (accepted + passes) / passes if passes else 0.0,
                "most_rows_per_forward": int(counters["busiest"].max()) if passes else 0}


@register("row-drafts", RowDraftOptions)
def run_row_drafts(engine, batch: DecodeBatch, params, opts: RowDraftOptions) -> RowDraftDecoder:
    return RowDraftDecoder.start(engine, batch, params, opts)
