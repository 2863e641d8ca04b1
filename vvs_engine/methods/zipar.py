"""ZipAR: several image rows decoded at once (He et al., ICML 2025, arXiv 2412.04062), plain and with
each row's frontier decoded as a Jacobi window verified by the SJD rule (``--zipar-verify sjd``); PJD's
rules on top (``--method pjd``). The full account, with what is exact and what the release does
differently, is docs/zipar.md.

Row r + 1 starts once row r holds ``window`` codes (s) and every forward advances each row in flight
(a diagonal wavefront). The target sees a *partial* context, the slots already filled at their raster
positions: that is the approximation (ZipAR is lossy). The rest is exact: K/V at each token's raster
slot, RoPE at raster positions, a mask built on the device from per-row counts of written codes (an
unfilled slot is never attended), a forced end-of-line token placed up front (Lumina-mGPT, Emu3), and
a row start without one fed a *stand-in* whose K/V only its own query sees. A fixed-window decode takes
``(H - 1) * min(s, W) + W - 1`` forwards (:func:`fixed_window_forwards`); the round function serves
``R`` rows in flight and the device state decides which lanes commit, with no host read, so images at
different steps share a forward. With SJD each row feeds L lanes (its last code + L - 1 drafts) and
commits the accepted prefix plus one token; with s >= W the tokens are raster AR's (tested).

Randomness is keyed by image and raster index (batch-invariant): the token at raster index t is drawn
at step t of the ``SAMPLE`` stream, as AR draws it; drafts are tested with ``ACCEPT`` uniforms at their
raster index and Jacobi samples use the row's forward counter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .. import kernels
from ..acceptance.verify import ExactRule
from ..errors import VVSError
from ..rng import Streams, sample_inverse_cdf
from ..runtime.target import TargetSession
from ..sampling import guided_logits, process_logits
from .registry import register
from .common import DecodeBatch, row_sampling, declare_decoder_rows, RowState
from .options import MethodOptions, check_choice, check_int, option

VERIFY_MODES = ("none", "sjd")
COMMIT_RULES = ("sjd", "drafts")  # every row by the SJD rule (exact per forward: PJD-E1), or PJD's release
INIT_POLICIES = ("copy-above", "random")
# PJD's options at the values that give ZipAR's tokens of before they existed: benchmark cache keys leave
# them out at these values (benchmarks/harness.py::setting_key), so ZipAR caches made before stay valid
PJD_OPTION_DEFAULTS = {"zipar_commit_lag": 0, "zipar_commit": "sjd", "zipar_init": "copy-above", "zipar_keep": 0.0,
                       "zipar_max_rows": 0}
# s = 2: the fastest window at AR parity on the Zoo (TPF 5.69; s = 4: 3.41; 512 images:
# benchmarks/results/quality_speed.md "Defaults against the evidence"; docs/zipar.md)
DEFAULT_WINDOW = 2
DEFAULT_JACOBI_WINDOW = 4
MAX_JACOBI_WINDOW = 64


# --- geometry and the fixed-window schedule (host side, pure Python) -----------------------------
@dataclass(frozen=True)
class RowGeometry:
    """An image as the methods see it: ``rows`` rows of ``codes`` VQ codes, each closed by the token
    ``eol`` (a method-vocabulary index) when the family's layout has one."""

    rows: int
    codes: int
    eol: Optional[int] = None

    @property
    def width(self) -> int:
        """Tokens per row (W'): the codes plus the end-of-line token, if any."""
        return self.codes + (self.eol is not None)

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def row_geometry(model) -> RowGeometry:
    """The target's row layout: Lumina-mGPT/Emu3 configs name their grid (``grid_h`` rows of
    ``grid_w`` codes, EOL = method token ``n_codes``); LlamaGen and Janus are square grids."""
    cfg = model.config
    T = cfg.block_size
    grid_h, grid_w = getattr(cfg, "grid_h", None), getattr(cfg, "grid_w", None)
    if grid_h is not None and grid_w is not None and grid_h * (grid_w + 1) == T:
        return RowGeometry(int(grid_h), int(grid_w), int(getattr(cfg, "n_codes", cfg.vocab_size - 1)))
    side = math.isqrt(T)
    if side * side != T:
        raise VVSError(f"zipar needs a square token grid or a family with a row layout, got {T} tokens per image")
    return RowGeometry(side, side, None)


def fixed_window_forwards(geometry: RowGeometry, window: int) -> int:
    """Forwards of a fixed-window decode (prefill excluded): ``(H - 1) * min(s, W) + W - 1``."""
    return (geometry.rows - 1) * min(window, geometry.codes) + geometry.codes - 1


def rows_in_flight(geometry: RowGeometry, window: int) -> int:
    """Most rows a forward can serve: the rows still decoding lag one another by at least s codes
    (``(W - 1) // s + 1`` of them), plus one complete row whose last code is fed for its K/V."""
    return min(geometry.rows, (geometry.codes - 1) // window + 2)


# --- options ---------------------------------------------------------------------------------------
@dataclass
class ZipAROptions(MethodOptions):
    zipar_window: int = option(DEFAULT_WINDOW, "ZipAR: local window s; row r + 1 starts once row r holds s codes "
                                               "(>= the row length: raster order)")
    zipar_verify: str = option("none", "ZipAR: none (one code per row in flight per forward) or sjd (each row's "
                                       "frontier as a Jacobi window verified by the SJD rule)")
    zipar_jacobi_window: int = option(DEFAULT_JACOBI_WINDOW, "ZipAR with --zipar-verify sjd: lanes per row "
                                                             "(its last committed code + L - 1 drafts)")
    # PJD (docs/jacobi.md "PJD"): the window s above is the start lag; these options are PJD's other rules
    zipar_commit_lag: int = option(0, "ZipAR/PJD: commit lag; row r + 1 may commit column c while row r holds "
                                      "c + lag codes (0: the window s, ZipAR's rule; PJD: 2, the window s "
                                      "then only gates a row's start)")
    zipar_commit: str = option("sjd", "ZipAR/PJD with --zipar-verify sjd: sjd (every row commits its accepted "
                                      "drafts plus the residual or bonus token: exact per forward, PJD-E1) or "
                                      "drafts (rows below the top unfinished one commit accepted drafts only: "
                                      "the released PJD rule, lossy)")
    zipar_init: str = option("copy-above", "ZipAR/PJD with --zipar-verify sjd: drafts of new columns: copy-above "
                                           "(the code above) or random (uniform image codes, PJD)")
    zipar_keep: float = option(0.0, "ZipAR/PJD with --zipar-verify sjd: keep rule; after a row's first "
                                    "rejection a later draft whose ratio min(1, p/q) exceeds this stays the "
                                    "column's draft with its old q (PJD's release: 0.5; lossy). 0: off")
    zipar_max_rows: int = option(0, "ZipAR/PJD: most rows served per forward (0: as many as the commit lag "
                                    "allows); a row beyond waits")

    def validate(self):
        s = self.zipar_window
        check_int("zipar-window", s, 1)
        check_choice("zipar-verify", self.zipar_verify, VERIFY_MODES)
        check_int("zipar-jacobi-window", self.zipar_jacobi_window, 1, MAX_JACOBI_WINDOW)
        lag = self.zipar_commit_lag
        if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= s:
            raise VVSError(f"zipar-commit-lag must be an integer in [0, zipar-window = {s}], got {lag!r}")
        check_choice("zipar-commit", self.zipar_commit, COMMIT_RULES)
        check_choice("zipar-init", self.zipar_init, INIT_POLICIES)
        keep = self.zipar_keep
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 <= keep < 1:
            raise VVSError(f"zipar-keep must be a number in [0, 1), got {keep!r}")
        check_int("zipar-max-rows", self.zipar_max_rows, 0)
        needs_drafts = [name for name, on in (("zipar-commit drafts", self.zipar_commit == "drafts"),
                                              ("zipar-init random", self.zipar_init == "random"),
                                              ("zipar-keep", keep > 0)) if on]
        if needs_drafts and self.lanes < 2:
            raise VVSError(f"{needs_drafts[0]} needs drafts: --zipar-verify sjd with --zipar-jacobi-window >= 2")
        return self

    def check_engine(self, engine):
        row_geometry(engine.gpt)

    @property
    def lanes(self) -> int:
        return self.zipar_jacobi_window if self.zipar_verify == "sjd" else 1

    @property
    def commit_lag(self) -> int:
        return self.zipar_commit_lag or self.zipar_window


@dataclass
class PJDOptions(ZipAROptions):
    """``--method pjd``: the row-parallel method with PJD's published defaults (start lag 8, commit lag
    2, 8 lanes per row, random drafts) and the exact commit rule E1; ``--zipar-commit drafts`` (and
    ``--zipar-keep 0.5``) give the released rule."""

    zipar_window: int = 8
    zipar_verify: str = "sjd"
    zipar_jacobi_window: int = 8
    zipar_commit_lag: int = 2
    zipar_init: str = "random"


# --- the device decode -----------------------------------------------------------------------------
@dataclass
class ZipARState(RowState):
    """Device state of a batched ZipAR decode (static shapes, updated in place by each forward).
    Per-row arrays have H + R + 2 entries: row r at index r + 1, index 0 a complete virtual row above
    row 0, rows >= H never start, and the last entry takes the writes of lanes that write nothing."""

    tokens: torch.Tensor  # [B, T + 1] committed tokens, raster order; EOLs placed up front; column T: write sink
    codes: torch.Tensor  # [B, H + R + 2] committed codes per row
    written: torch.Tensor  # [B, H + R + 2] codes of the row whose K/V are in the cache (a prefix of the row)
    eol_written: torch.Tensor  # [B, H + R + 2] bool: the row's EOL K/V are in the cache
    lo: torch.Tensor  # [B] finished rows: lane j serves row lo + j
    row_rounds: torch.Tensor  # [B, H + R + 2] forwards the row took part in (step of its Jacobi samples)
    draft: torch.Tensor  # [B, H + R + 2, L] lane i >= 1: the draft of column codes - 1 + i
    draft_q: torch.Tensor  # [B, H + R + 2, L, V] what a carried draft was drawn from ([B, 1, 1, 1] when L = 1)
    fresh: torch.Tensor  # [B, H + R + 2, L] bool: a copied draft (q one-hot)
    passes: torch.Tensor  # [B] forwards while the image was unfinished
    committing_rows: torch.Tensor  # [B] (row, forward) pairs that committed codes
    testing_rows: torch.Tensor  # [B] (row, forward) pairs that could commit (drafts-only rows may commit none)
    accepted: torch.Tensor  # [B] drafts accepted
    busiest: torch.Tensor  # [B] most rows that took part in one forward
    cap_waits: torch.Tensor  # [B] forwards in which the row after the served ones could have committed
    committed: torch.Tensor  # [B] codes committed, T once the image is done: the loop's one read


@dataclass(frozen=True)
class ZipARLayout:
    """The host constants of one batched ZipAR decode: the row layout, the window rules and the rows a
    forward serves (a compiled round reads them as constants)."""

    rows: int  # H image rows
    codes: int  # W codes per row
    width: int  # W' tokens per row (the codes, then the end-of-line token, if any)
    eol: Optional[int]  # the end-of-line token (a method-vocabulary index), or None
    window: int  # the start lag s
    commit_lag: int  # the window s unless PJD's separate commit lag is set
    commit_drafts: bool  # PJD's released commit rule
    random_init: bool  # new drafts: uniform image codes (PJD)
    keep: float  # PJD's keep rule (0: off)
    n_image_codes: int  # random drafts draw image codes only (not the EOL)
    rows_served: int  # R: the rows of the round function
    capped: bool  # --zipar-max-rows below the rows the commit lag allows

    @classmethod
    def of(cls, geo: RowGeometry, opts: ZipAROptions, vocab_size: int) -> "ZipARLayout":
        R = rows_in_flight(geo, opts.commit_lag)
        capped = 0 < opts.zipar_max_rows < R
        return cls(geo.rows, geo.codes, geo.width, geo.eol, opts.zipar_window, opts.commit_lag,
                   opts.zipar_commit == "drafts", opts.zipar_init == "random", float(opts.zipar_keep),
                   geo.eol if geo.eol is not None else vocab_size, opts.zipar_max_rows if capped else R, capped)

    @property
    def has_eol(self) -> bool:
        return self.eol is not None

    @property
    def n_row_entries(self) -> int:
        """Entries of the per-row arrays (``ZipARState``)."""
        return self.rows + self.rows_served + 2

    @property
    def sink_row(self) -> int:
        """The per-row entry that takes the writes of lanes that write nothing."""
        return self.n_row_entries - 1


@dataclass(frozen=True)
class ZipARIndex:
    """Constant index tensors of the rounds and their random-number streams, made once: a dict filled
    while a round is traced is a guard that fails on the next call (one recompile of every ZipAR/PJD
    round), and a round spends no op on them."""

    scratch: torch.Tensor  # [R, L] a scratch slot per lane
    window_lanes: torch.Tensor  # [L]
    row_lanes: torch.Tensor  # [R]
    vocab: torch.Tensor  # [V]
    stored_rows: torch.Tensor  # [H] where rows 0 .. H - 1 sit in the per-row arrays
    batch_ids: torch.Tensor  # [B, 1]
    slot_row: torch.Tensor  # [S] row of an image slot (others: -1)
    slot_col: torch.Tensor  # [S] column of an image slot (others: a column no count reaches)
    slot_is_code: torch.Tensor  # [S]
    slot_is_eol: torch.Tensor  # [S]
    cond_visible: torch.Tensor  # [rows, S] condition slots each row sees (follows admitted rows' key masks)
    sample_stream: torch.Tensor
    accept_stream: torch.Tensor
    update_stream: torch.Tensor
    init_stream: torch.Tensor

    @classmethod
    def of(cls, decoder: "ZipARDecoder", s: TargetSession) -> "ZipARIndex":
        c, T, Wp, W, dev, rng = decoder.c, decoder.T, decoder.Wp, decoder.W, s.device, decoder.rng
        t = s.slot_ids - c
        image = (t >= 0) & (t < T)
        col = torch.where(image, t.remainder(Wp), Wp + 1)
        return cls((c + T + torch.arange(decoder.R * decoder.L, device=dev)).view(decoder.R, decoder.L),
                   torch.arange(decoder.L, device=dev), torch.arange(decoder.R, device=dev),
                   torch.arange(decoder.V, device=dev), torch.arange(1, decoder.H + 1, device=dev),
                   torch.arange(decoder.B, device=dev)[:, None], torch.where(image, t.div(Wp, rounding_mode="floor"), -1),
                   col, image & (col < W), image & (col == W) if decoder.layout.has_eol else torch.zeros_like(image),
                   (s.slot_ids < c) & s.key_valid, *(rng.stream_offsets([stream]) for stream in (
                       Streams.SAMPLE, Streams.ACCEPT, Streams.JACOBI_UPDATE, Streams.JACOBI_INIT)))


class Frontier(NamedTuple):
    """The served rows of one ZipAR round as it reads them ([B, R] each): row, its per-row entry, codes,
    K/V written, codes of the row above, forwards so far; whether it is an image row, codes the window
    rule allows it now, whether it takes part, starts, starts from a stand-in, or re-feeds lane 0."""

    row: torch.Tensor
    at: torch.Tensor
    codes: torch.Tensor
    written: torch.Tensor
    above: torch.Tensor
    rounds_before: torch.Tensor
    real_row: torch.Tensor
    allowed: torch.Tensor
    active: torch.Tensor
    start: torch.Tensor
    stand_in: torch.Tensor
    refeed: torch.Tensor


class Feed(NamedTuple):
    """The R x L lanes of one round ([B, R, L]): raster index fed, live, input tokens, positions, K/V slots,
    whether a lane writes its own slot; with drafts (L > 1) the drafts, which are fresh, and their q."""

    raster: torch.Tensor
    live: torch.Tensor
    inputs: torch.Tensor
    position: torch.Tensor
    slot: torch.Tensor
    own_slot: torch.Tensor
    drafts: Optional[torch.Tensor]
    fresh: Optional[torch.Tensor]
    stored_q: Optional[torch.Tensor]


class ZipARDecoder:
    """Constants and buffers of one batched decode; :meth:`zipar_round` is the round function. A
    decoder of ``runtime.loop`` (protocol at the end of the class): :meth:`start` builds and prefills one."""

    inductor_options: dict = {}
    RESULTS = ("tokens", "passes", "committing_rows", "testing_rows", "accepted", "busiest", "cap_waits")

    @classmethod
    def start(cls, engine, batch: DecodeBatch, params, opts: ZipAROptions, rule=None) -> "ZipARDecoder":
        decoder = cls(engine, batch, params, opts, rule)
        decoder.state = decoder.prefill()
        return decoder

    def __init__(self, engine, batch: DecodeBatch, params, opts: ZipAROptions, rule=None):
        self.engine, self.opts = engine, opts
        self.params, self.rng = row_sampling(params, batch, batch.cond.device), batch.rng
        self.rule = rule if rule is not None else ExactRule()
        self.layout = layout = ZipARLayout.of(row_geometry(engine.gpt), opts, engine.config.vocab_size)
        self.B, self.L, self.R = batch.size, opts.lanes, layout.rows_served
        self.H, self.W, self.Wp = layout.rows, layout.codes, layout.width
        self.session = s = TargetSession(engine.gpt, batch.cond, self.B, self.params.use_cfg, batch.key_mask,
                                         extra_slots=self.R * self.L)
        self.c, self.T, self.V = s.c, s.T, engine.config.vocab_size
        if layout.rows * layout.width != self.T:
            raise VVSError(f"zipar: the row layout has {layout.rows * layout.width} tokens but the model {self.T}")
        self.index = ZipARIndex.of(self, s)

    def processed(self, h: torch.Tensor) -> torch.Tensor:
        return process_logits(guided_logits(self.session.logits(h), self.params), self.params)

    def uniforms(self, step: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """Counter-RNG uniforms keyed by (image, ``step`` [B, ...]) on one stream -> [B, ...]."""
        key = self.rng.key.view(self.B, *([1] * (step.dim() - 1))).expand(step.shape)
        return kernels.counter_uniform(key.reshape(-1), step.reshape(-1), stream, 1).view(step.shape)

    def random_codes(self, step: torch.Tensor) -> torch.Tensor:
        """PJD's new drafts: uniform image codes keyed by (image, ``step``) on the JACOBI_INIT stream."""
        u = self.uniforms(step, self.index.init_stream)
        return (u * self.layout.n_image_codes).long().clamp(max=self.layout.n_image_codes - 1)

    # --- prefill (eager) ----------------------------------------------------------------------------
    def prefill(self) -> ZipARState:
        B, L, V, T, dev = self.B, self.L, self.V, self.T, self.session.device
        n = self.layout.n_row_entries
        p0 = self.processed(self.session.prefill()[:, -1])
        first = self.rng.sample(p0, 0, Streams.SAMPLE)  # as AR draws image token 0
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        tokens = zeros(B, T + 1)
        if self.layout.has_eol:  # the layout's end-of-line tokens: placed, never sampled
            eol_cols = torch.arange(self.H, device=dev) * self.Wp + self.W
            tokens.index_put_((self.index.batch_ids.expand(B, self.H), eol_cols.expand(B, self.H)),
                              torch.tensor(self.layout.eol, device=dev))
        tokens.index_put_((self.index.batch_ids[:, 0], zeros(B)), first)
        entry = torch.arange(n, device=dev)  # index 0: the complete virtual row above row 0; 1: row 0
        codes = torch.where(entry == 0, self.W, (entry == 1).long()).expand(B, n).clone()
        written = torch.where(entry == 0, self.W, 0).expand(B, n).clone()
        Vq = V if L > 1 else 1
        draft = first[:, None, None].expand(B, n, L).clone()  # row 0: copy-left
        if self.layout.random_init:  # row 0's drafts (lane i: column i), as a row's first drafts are drawn in a round
            draft[:, 1] = self.random_codes(self.index.window_lanes.expand(B, L) + 1)
        return ZipARState(tokens=tokens, codes=codes, written=written,
                          eol_written=torch.zeros(B, n, dtype=torch.bool, device=dev), lo=zeros(B),
                          row_rounds=zeros(B, n), draft=draft,
                          draft_q=torch.zeros(B, n if L > 1 else 1, L if L > 1 else 1, Vq, device=dev),
                          fresh=torch.ones(B, n, L, dtype=torch.bool, device=dev), passes=zeros(B),
                          committing_rows=zeros(B), testing_rows=zeros(B), accepted=zeros(B), busiest=zeros(B), cap_waits=zeros(B),
                          committed=zeros(B))

    # --- the decoder protocol of runtime.loop ----------------------------------------------------------
    def round_functions(self) -> dict:
        return {"zipar": lambda: self.zipar_round(self.state, self.R)}

    def round_buffers(self) -> list:
        return self.state.tensors()

    def status(self) -> torch.Tensor:
        return self.state.committed

    def next_kind(self, last_kind, late) -> str:
        return "zipar"

    def declare_rows(self, table) -> None:
        declare_decoder_rows(table, self.session, self.params, self.rng, self.state)

    def rows_written(self, rows: torch.Tensor) -> None:
        """Rows took other images (admission, compaction): the condition visibility follows their key masks."""
        self.index.cond_visible.copy_((self.session.slot_ids < self.c) & self.session.key_valid)

    def committed_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, T] bool: the final positions of rows ``rows`` (several image rows commit at once: each row's
        committed codes are a prefix of that row; end-of-line tokens are placed up front)."""
        codes = self.state.codes.index_select(0, rows)[:, 1: self.H + 1]  # image row i sits at entry i + 1
        column = torch.arange(self.Wp, device=codes.device)
        mask = (column < codes[:, :, None]) | (column >= self.W)
        return mask.reshape(rows.numel(), self.H * self.Wp)

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        passes, rows = int(counters["passes"].sum()), int(counters["committing_rows"].sum())
        return {"target_forward_passes": passes, "batch_iterations": loop_stats["batch_rounds"],
                "zipar_window": self.layout.window, "zipar_verify": self.opts.zipar_verify, "zipar_lanes": self.L,
                "committing_rows": rows, "accepted_drafts": int(counters["accepted"].sum()),
                "rows_per_forward": rows / passes if passes else 0.0,
                "zipar_commit_lag": self.layout.commit_lag, "zipar_commit": self.opts.zipar_commit,
                "zipar_init": self.opts.zipar_init, "zipar_keep": self.layout.keep, "zipar_rows": self.R,
                "most_rows_per_forward": int(counters["busiest"].max()) if passes else 0,
                "cap_waits": int(counters["cap_waits"].sum()), "testing_rows": int(counters["testing_rows"].sum())}

    # --- one forward: static shapes, no host read ---------------------------------------------------
    def zipar_round(self, st: ZipARState, R: int) -> None:
        """One target forward serving rows ``lo .. lo + R - 1`` of every image: feed each row's last
        committed code (or its start, or its tail) and, with SJD, its drafts; commit. Stages: the served
        rows and the window rule (:meth:`frontier`), the lanes' inputs (:meth:`feed`), the attention mask
        over the filled slots (:meth:`attention_mask`), the forward, acceptance (:meth:`accept`), the
        commit (:meth:`commit`), the next drafts (:meth:`next_drafts`) and the counters (:meth:`count_round`)."""
        B, L, V, s = self.B, self.L, self.V, self.session
        f = self.frontier(st, R)
        x = self.feed(st, f, R)
        mask = self.attention_mask(st, f, x, R)
        Q = R * L
        h = s.forward_at(x.inputs.view(B, Q), s.rows_of(x.position.view(B, Q)), s.rows_of(x.slot.view(B, Q)), mask)
        p = self.processed(h).view(B, R, L, V)
        k, nxt, tested = self.accept(p, f, x, R)
        commits, new_codes = self.commit(st, f, x, k, nxt, R)
        if L > 1:
            self.next_drafts(st, f, x, p, k, tested, commits, new_codes, R)
        self.count_round(st, R, f.codes, f.active, f.allowed, commits)

    def frontier(self, st: ZipARState, R: int) -> "Frontier":
        """The served rows as this round reads them, and what the window rule allows each."""
        L, H, W = self.L, self.H, self.W
        row = st.lo[:, None] + self.index.row_lanes[:R]  # [B, R]
        at = row + 1  # index into the per-row arrays
        codes, written = st.codes.gather(1, at), st.written.gather(1, at)
        above, below = st.codes.gather(1, at - 1), st.codes.gather(1, at + 1)
        rounds_before = st.row_rounds.gather(1, at)
        real_row = row < H
        above_done = above >= W
        # the window rule: a row starts once the row above holds s codes (the start lag) and then commits
        # column c while the row above holds c + commit lag codes (ZipAR: the same s; PJD: 8 and 2)
        started = (codes > 0) | (above >= self.layout.window)
        last_allowed = torch.where(above_done, W - 1, torch.where(started, above - self.layout.commit_lag, -1))
        allowed = torch.where(real_row, (last_allowed - codes + 1).clamp(0, L), 0)  # codes it may commit now
        tail = real_row & (codes == W) & (written == W - 1) & (row < H - 1)  # K/V of the last code
        if not self.layout.has_eol:
            tail = tail & (below > 0)  # else the next row's start feeds the real token itself
        active = (allowed > 0) | tail
        start = active & (codes == 0)
        stand_in = start & ~above_done if not self.layout.has_eol else torch.zeros_like(start)
        # lane 0 feeds a token whose K/V are already in its slot (drafts-only commits: the last accepted
        # draft; or a row that started and committed nothing): it writes a scratch slot instead, so a
        # filled slot is never rewritten, and sees its own new K/V there, not the old ones
        if self.layout.has_eol:
            fed_is_written = st.eol_written.gather(1, at - 1)
        else:
            fed_is_written = st.written.gather(1, at - 1) >= W
        refeed = active & torch.where(codes > 0, written >= codes, start & ~stand_in & fed_is_written)
        return Frontier(row, at, codes, written, above, rounds_before, real_row, allowed, active, start, stand_in, refeed)

    def feed(self, st: ZipARState, f: "Frontier", R: int) -> "Feed":
        """Inputs, positions and K/V slots of the R x L lanes."""
        B, L, V, W, Wp, c, T = self.B, self.L, self.V, self.W, self.Wp, self.c, self.T
        lanes = self.index.window_lanes
        row, at, codes, above, active, stand_in, refeed = f.row, f.at, f.codes, f.above, f.active, f.stand_in, f.refeed
        column = codes[..., None] - 1 + lanes  # [B, R, L] column of the token each lane feeds (-1: start)
        live = active[..., None] & (column < W)
        raster = row[..., None] * Wp + column  # a start's lane 0: r * W' - 1, the raster predecessor
        committed = st.tokens.gather(1, raster[..., 0].clamp(0, T - 1))  # lane 0: a committed token
        newest_above = st.tokens.gather(1, ((row - 1) * Wp + above - 1).clamp(0, T - 1))
        lane0 = torch.where(stand_in, newest_above, committed)
        if L > 1:
            stored = st.draft.gather(1, at[..., None].expand(B, R, L))
            stored_q = st.draft_q.gather(1, at[..., None, None].expand(B, R, L, V))
            stored_fresh = st.fresh.gather(1, at[..., None].expand(B, R, L))
            # a row that starts now: copies of the codes above (or of its input beyond them), or random codes
            above_col = (row - 1)[..., None] * Wp + lanes - 1
            if self.layout.random_init:
                copy = self.random_codes(row[..., None] * Wp + lanes)  # step: raster index + 1, row round 0
            else:
                copy_above = st.tokens.gather(1, above_col.clamp(0, T - 1).view(B, -1)).view(B, R, L)
                copy = torch.where(lanes - 1 < above[..., None], copy_above, lane0[..., None])
            new_row = ((codes == 0) & (f.rounds_before == 0))[..., None]  # not a started row that committed nothing
            drafts = torch.where(new_row, copy, stored)
            fresh = new_row | stored_fresh
            inputs = torch.cat([lane0[..., None], drafts[..., 1:]], -1)
        else:
            inputs = lane0[..., None]
            drafts = fresh = stored_q = None
        position = (c + raster).clamp(0, c + T - 1)
        own_slot = live & ~((stand_in | refeed)[..., None] & (lanes == 0))
        slot = torch.where(own_slot, c + raster, self.index.scratch[:R])  # [B, R, L]
        return Feed(raster, live, inputs, position, slot, own_slot, drafts, fresh, stored_q)

    def attention_mask(self, st: ZipARState, f: "Frontier", x: "Feed", R: int) -> torch.Tensor:
        """The cache after this forward's writes (per-row counts -> filled slots) and what each lane sees."""
        B, L, W, c = self.B, self.L, self.W, self.c
        s, lanes, b = self.session, self.index.window_lanes, self.index.batch_ids
        at, codes, active, start, stand_in, refeed = f.at, f.codes, f.active, f.start, f.stand_in, f.refeed
        raster, slot, own_slot = x.raster, x.slot, x.own_slot
        trash = self.layout.sink_row
        feeds_own = active & (codes > 0) & ~refeed  # lane 0 writes the row's last committed code
        real_start = start & ~stand_in
        if self.layout.has_eol:
            st.eol_written.index_put_((b.expand(B, R), torch.where(real_start, at - 1, trash)),
                                      torch.ones_like(real_start))
            st.written.index_put_((b.expand(B, R), torch.where(feeds_own, at, trash)), codes)
        else:  # a real start writes the last code of the row above
            index = torch.cat([torch.where(feeds_own, at, trash), torch.where(real_start, at - 1, trash)], 1)
            st.written.index_put_((b.expand(B, 2 * R), index), torch.cat([codes, torch.full_like(codes, W)], 1))
        slot_row = (self.index.slot_row + 1).expand(B, -1)
        filled = self.index.slot_is_code & (self.index.slot_col < st.written.gather(1, slot_row))
        if self.layout.has_eol:
            filled = filled | (self.index.slot_is_eol & st.eol_written.gather(1, slot_row))
        before = s.slot_ids <= (c + raster[..., 0])[..., None]  # [B, R, S]: raster order
        context = (filled[:, None, :] & before)[:, :, None, :]  # [B, R, 1, S]
        if self.layout.commit_drafts:  # a re-fed lane 0 sees its new K/V (scratch), not the old ones in its slot
            old_self = refeed[..., None] & (s.slot_ids == (c + raster[..., 0])[..., None])  # [B, R, S]
            context = context & ~(old_self[:, :, None, :] & (lanes == 0)[:, None])
        mine = slot[..., None] == s.slot_ids  # [B, R, L, S]
        # lane i also sees lanes < i of its row (causal window), but not a stand-in (it is no context) nor
        # a re-fed lane 0 (its row sees the token's K/V in its slot)
        shared = mine & own_slot[..., None]
        window = shared.long().cumsum(2) > 0
        visible = (context | window | mine).view(B, R * L, -1)
        mask = s.rows_of(visible) | self.index.cond_visible[:, None, :]
        return mask

    def accept(self, p: torch.Tensor, f: "Frontier", x: "Feed", R: int):
        """The longest passing prefix of the drafts the window rule allows -> (accepted drafts k [B, R], the
        token after them [B, R], (drafts, their q(x)) for PJD's keep rule, or None without drafts)."""
        B, L, V, Wp, T = self.B, self.L, self.V, self.Wp, self.T
        lanes, row, codes, allowed = self.index.window_lanes, f.row, f.codes, f.allowed
        inputs, fresh, raster, live, stored_q, rounds_before = x.inputs, x.fresh, x.raster, x.live, x.stored_q, f.rounds_before
        pick = self.params.pick  # greedy rows' result, sampled rows' result
        if L > 1:
            d = inputs[..., 1:]  # [B, R, L-1]: draft of lane i tested against lane i-1's output
            q = stored_q[..., 1:, :]
            qx = torch.where(fresh[..., 1:], 1.0, q.gather(3, d[..., None])[..., 0])
            testable = live[..., 1:] & (lanes[1:] <= allowed[..., None] - 1)
            def sampled_test():
                # keyed by raster index: tested at most once, unless lower rows commit drafts only (they
                # re-test a column in a later forward: then by row round too)
                test_step = raster[..., 1:] + (rounds_before[..., None] * (T + 1) if self.layout.commit_drafts else 0)
                u = self.uniforms(test_step, self.index.accept_stream)
                passed, _ = self.rule.accept(p[..., :-1, :].reshape(-1, V), d.reshape(-1), qx.reshape(-1),
                                             u.reshape(-1), None)
                return passed.view(B, R, L - 1)

            ok = pick(lambda: p[..., :-1, :].argmax(-1) == d, sampled_test)
            ok = ok & testable
            k = ok.long().cumprod(-1).sum(-1)  # [B, R] accepted drafts
            n_tested = testable.long().sum(-1)
            after = (k + 1).clamp(max=L - 1)[..., None]  # the draft that failed (if one did)
            rejected = d.gather(2, after - 1)[..., 0]
            one_hot = (self.index.vocab == rejected[..., None]).to(p.dtype)
            rejected_q = torch.where(fresh.gather(2, after), one_hot,  # fresh: [B, R, 1]
                                     q.gather(2, (after - 1)[..., None].expand(B, R, 1, V))[..., 0, :])
            q_k = torch.where((k < n_tested)[..., None], rejected_q, 0.0)  # the bonus token: q = 0
        else:
            k = torch.zeros_like(codes)
            d = qx = None
            rejected, q_k = torch.zeros_like(codes), torch.zeros(B, R, V, device=self.session.device, dtype=p.dtype)
        p_k = p.gather(2, k[..., None, None].expand(B, R, 1, V))[..., 0, :]
        residual = self.rule.residual(p_k.reshape(-1, V), q_k.reshape(-1, V), rejected.reshape(-1), None).view(B, R, V)
        decided = row * Wp + codes + k  # raster index of the token after the accepted prefix
        nxt = pick(lambda: residual.argmax(-1),
                   lambda: sample_inverse_cdf(residual, self.uniforms(decided, self.index.sample_stream)))
        return k, nxt, (d, qx)

    def commit(self, st: ZipARState, f: "Frontier", x: "Feed", k, nxt, R: int):
        """Accepted drafts, then the residual / bonus token -> (codes committed per row, new code counts)."""
        B, L, W, Wp, T = self.B, self.L, self.W, self.Wp, self.T
        lanes, b, trash = self.index.window_lanes, self.index.batch_ids, self.layout.sink_row
        row, at, codes, allowed, active, real_row, inputs = f.row, f.at, f.codes, f.allowed, f.active, f.real_row, x.inputs
        commits = torch.where(allowed > 0, k + 1, 0)
        if self.layout.commit_drafts:  # PJD's release: below the top unfinished row, the accepted drafts only
            unfinished_row = real_row & (codes < W)
            top = unfinished_row & (unfinished_row.long().cumsum(1) == 1)
            commits = torch.where(allowed > 0, k + top.long(), 0)
        values = torch.where(lanes < k[..., None], inputs.roll(-1, 2), nxt[..., None])
        target = torch.where(lanes < commits[..., None], (row * Wp + codes)[..., None] + lanes, T)
        st.tokens.index_put_((b[..., None].expand(B, R, L), target), values)
        new_codes = codes + commits
        st.codes.index_put_((b.expand(B, R), at), new_codes)
        if L > 1:  # accepted drafts were fed at their own slots: their K/V are in place (filled from now on)
            st.written.index_put_((b.expand(B, R), torch.where((allowed > 0) & (k > 0), at, trash)), codes + k)
        st.row_rounds.index_put_((b.expand(B, R), at), st.row_rounds.gather(1, at) + active.long())
        return commits, new_codes

    def next_drafts(self, st: ZipARState, f: "Frontier", x: "Feed", p, k, tested, commits, new_codes, R: int) -> None:
        """The next drafts (SJD lanes): the Jacobi update of carried columns, copies (or random codes) for new ones."""
        B, L, V, Wp, T = self.B, self.L, self.V, self.Wp, self.T
        lanes, b, pick = self.index.window_lanes, self.index.batch_ids, self.params.pick
        row, at, above, allowed, live, raster, inputs = f.row, f.at, f.above, f.allowed, x.live, x.raster, x.inputs
        drafts, fresh, stored_q, (d, qx) = x.drafts, x.fresh, x.stored_q, tested
        rounds = st.row_rounds.gather(1, at)  # after this forward: a new step for the next samples
        y = pick(lambda: p.argmax(-1),
                 lambda: sample_inverse_cdf(p, self.uniforms(rounds[..., None] * (T + 1) + raster + 1,
                                                             self.index.update_stream)))
        source = commits[..., None] - 1 + lanes  # new lane i holds the column old lane (commits - 1 + i) decided
        src = source.clamp(0, L - 1)
        carried = (source >= 0) & (source <= L - 1) & live.gather(2, src)
        new_column = new_codes[..., None] - 1 + lanes
        if self.layout.random_init:
            copy = self.random_codes(rounds[..., None] * (T + 1) + row[..., None] * Wp + new_column + 1)
        else:
            copy_above = st.tokens.gather(1, ((row - 1)[..., None] * Wp + new_column).clamp(0, T - 1).view(B, -1))
            last = st.tokens.gather(1, (row * Wp + new_codes - 1).clamp(0, T - 1))
            copy = torch.where((new_column < above[..., None]) & (row > 0)[..., None], copy_above.view(B, R, L),
                               last[..., None])
        new_drafts = torch.where(carried, y.gather(2, src), copy)
        new_q = p.gather(2, src[..., None].expand(B, R, L, V))
        new_fresh = ~carried
        if self.layout.keep > 0:  # PJD's keep rule (lossy): the old draft of the column, fed at old lane src + 1
            old_lane = (src + 1).clamp(max=L - 1)
            ratio = (p[..., :-1, :].gather(3, d[..., None])[..., 0] / qx).clamp(max=1.0)  # [B, R, L-1]
            kept = (carried & (source > k[..., None]) & (source + 1 <= L - 1) & live.gather(2, old_lane)
                    & (ratio.gather(2, (old_lane - 1).clamp(min=0)) > self.layout.keep))
            new_drafts = torch.where(kept, inputs.gather(2, old_lane), new_drafts)
            new_q = torch.where(kept[..., None], stored_q.gather(2, old_lane[..., None].expand(B, R, L, V)), new_q)
            new_fresh = torch.where(kept, fresh.gather(2, old_lane), new_fresh)
        update = (allowed > 0)[..., None]  # the row took part in the test (plain ZipAR + SJD: it committed)
        st.draft.index_put_((b.expand(B, R), at), torch.where(update, new_drafts, drafts))
        st.fresh.index_put_((b.expand(B, R), at), torch.where(update, new_fresh, fresh))
        st.draft_q.index_put_((b.expand(B, R), at), torch.where(update[..., None], new_q, stored_q))
        st.accepted.add_(torch.where(allowed > 0, k, 0).sum(1))

    def count_round(self, st: ZipARState, R: int, codes, active, allowed, commits) -> None:
        """The round's counters, then the finished rows (``lo``) and the committed count the loop reads.
        ``codes`` [B, R]: the served rows' codes before this round's commits."""
        H, W, T = self.H, self.W, self.T
        unfinished = st.lo < H
        st.passes.add_(unfinished.long())
        st.committing_rows.add_((commits > 0).long().sum(1))
        st.testing_rows.add_((allowed > 0).long().sum(1))
        st.busiest.copy_(torch.maximum(st.busiest, active.long().sum(1)))
        if self.layout.capped:  # the row after the served ones, had it been served (rows further down cannot start)
            next_row = st.lo + R
            next_codes = st.codes.gather(1, (next_row + 1)[:, None])[:, 0]
            next_above = codes[:, R - 1]  # before this forward's commits, as the rule read it
            next_last = torch.where(next_above >= W, W - 1,
                                    torch.where((next_codes > 0) | (next_above >= self.layout.window),
                                                next_above - self.layout.commit_lag, -1))
            st.cap_waits.add_((unfinished & (next_row < H) & (next_last >= next_codes)).long())
        rows = self.index.stored_rows
        done = (st.codes[:, rows] == W) & ((st.written[:, rows] == W) | (rows == H))
        if not self.layout.has_eol:
            done = done | ((st.codes[:, rows] == W) & (st.codes[:, rows + 1] == 0))
        st.lo.copy_(done.long().cumprod(1).sum(1))
        # tokens committed, for the loop: T once every row is done, else the codes so far (< T)
        st.committed.copy_(torch.where(st.lo >= H, T, st.codes[:, rows].sum(1).clamp(max=T - 1)))


@register("zipar", ZipAROptions)
def run_zipar(engine, batch: DecodeBatch, params, opts: ZipAROptions) -> ZipARDecoder:
    return ZipARDecoder.start(engine, batch, params, opts)


@register("pjd", PJDOptions)
def run_pjd(engine, batch: DecodeBatch, params, opts: PJDOptions) -> ZipARDecoder:
    return ZipARDecoder.start(engine, batch, params, opts)
