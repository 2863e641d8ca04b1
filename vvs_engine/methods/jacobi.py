"""Training-free Jacobi decoding, batched: SJD (lossless) and GSD (grouped acceptance).

SJD (Teng et al., ICLR 2025, arXiv 2410.01699) is speculative sampling whose drafts are the target's
own predictions from the previous Jacobi iteration; GSD (So et al., ICCV 2025, arXiv 2508.07747) is the
same loop with the grouped acceptance rule of :mod:`vvs_engine.acceptance.gsd` (spec: ``docs/methods.md``
§1-2). B images decode together (both CFG rows of each in the same batch); every image has its own
window, accepted prefix, committed count and prefix length, all in static-shape ``[B, ...]`` device
buffers. One iteration, per image:

    one target forward over the window W[0..L-1] at positions P..P+L-1 (causal inside the window);
      p[j] = processed target distribution of the token after W[j]
    draft W[j+1] is tested against p[j] with its q (accept iff u < min(1, p(x)/q(x)), or GSD's rule);
    k = accepted prefix length; commit W[1..k] and one more token drawn from norm(max(0, p[k] - q[k]))
      (= p[L-1] itself when every draft passed: the bonus token)
    next window = [that token, samples y[k+1..L-1] ~ p[k+1..L-1] with q = p (the Jacobi update),
                   fresh drafts (random / copy-left / argmax-left / copy-above) with one-hot q]

``coupling`` (SCD, ``methods/scd.py``; also an option of GSD) changes only how y is drawn: ``maximal``
keeps a draft that passed its test and replaces one that failed by a residual sample, ``gumbel`` takes
argmax(log p + G) with Gumbel noise keyed by the absolute token index (:meth:`JacobiDecoder.redraw`).
SJD-PAC (``methods/sjd_pac.py``) runs a product tree on the same session, KV layout and loop.

:func:`jacobi_iteration` is the whole iteration with static shapes and no host read (one CUDA graph).
The window's K/V go to L scratch slots (the model writes one slot list for the whole batch) and reach
each row's own slots at the start of the next iteration; rollback = not advancing the prefix. Every
draw is keyed by the image's own iteration number, so its tokens do not depend on its batch. The KV
layout, the compiled launches and the randomness in full: docs/jacobi.md. Lossless for SJD: each
draft is drawn from its q independently of the tokens it is tested after (chi-square test in
``tests/test_jacobi.py``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import kernels
from ..acceptance.gsd import (DEFAULT_DIST_THRESHOLD, DEFAULT_GROUP, DEFAULT_PROB_THRESHOLD, check_gsd_values,
                              check_window_edge, make_grouped_rule)
from ..acceptance.verify import AcceptanceRule, ExactRule
from ..errors import VVSError
from ..rng import Streams, sample_inverse_cdf_one_pass
from ..runtime.target import TargetSession
from ..sampling import guided_logits, process_logits, value_at
from .registry import register
from .common import DecodeBatch, row_sampling, declare_decoder_rows, RowState
from .options import MethodOptions, check_choice, check_int, help_of, option

INIT_POLICIES = ("random", "copy-left", "argmax-left", "copy-above")
COUPLINGS = ("none", "maximal", "gumbel")
MAX_WINDOW = 1024
# Counter-RNG streams of the coupled re-drafting (distinct from rng.Streams): Gumbel noise is keyed by
# the absolute token index instead of the iteration, so a position keeps its noise until committed.
GUMBEL_STREAM = 16


# Inductor options of the compiled iteration on top of runtime.compiled.INDUCTOR_OPTIONS: no peak-memory
# gate on combo kernels. The gate refuses a combo that raises the graph's peak of intermediates by 5 %;
# an iteration's intermediates are a few hundred KB (the Zoo: the tree verifier's inputs alone are 14 %
# of that peak), so it split independent kernels of the same step into separate launches (SJD-PAC: 2)
# to save tens of KB next to a KV cache of megabytes to gigabytes.
JACOBI_INDUCTOR_OPTIONS = {"combo_kernel_peak_memory_pct_threshold": None}


@dataclass
class SJDOptions(MethodOptions):
    # New window positions: "copy-left" (the SJD repository's LlamaGen setting, repeat_horizon),
    # "random" (uniform, its Lumina-mGPT/Emu3 setting), "argmax-left" (top-1 of the left neighbour's
    # distribution, sample_horizon), "copy-above" (the token one image row up; the paper's vertical
    # variant, which its Fig. 9 found fastest).
    jacobi_window: int = option(16, "Jacobi methods: window L = query rows per forward (the last committed token + "
                                            "L - 1 drafts; sjd-pac: every tree node)")
    jacobi_init: str = option("copy-left", "Jacobi methods: new window positions: copy-left, random, argmax-left or "
                                           "copy-above")

    def validate(self):
        check_int("jacobi-window", self.jacobi_window, 1, MAX_WINDOW)
        check_choice("jacobi-init", self.jacobi_init, INIT_POLICIES)
        return self

    def check_engine(self, engine):
        if self.jacobi_init == "copy-above":
            _grid_width(engine.tokens_per_image)

    def jacobi_positions(self) -> int:
        """Positions of the image one forward covers (SJD-PAC: its main chain, not every tree node)."""
        return self.jacobi_window

    def check_fits(self, shape) -> None:
        """A window no longer than the image; the default window is exempt (on a tiny test model it may be
        longer, and the positions past the last token are clamped)."""
        T, window = shape.tokens_per_image, self.jacobi_window
        default = {f.name: f.default for f in dataclasses.fields(self)}["jacobi_window"]
        span = self.jacobi_positions()
        if span > T and window != default:
            raise VVSError(f"jacobi-window {window} is longer than an image ({T} tokens; use <= {window + T - span})")

    def decode_shape(self, shape) -> tuple:
        return self.jacobi_window, 3 * self.jacobi_window, False


@dataclass
class GSDOptions(SJDOptions):
    # G = 14, the paper's (and the rule's DEFAULT_GROUP, which VVS + GSD uses): on the Zoo's 512-image frontier
    # it is GSD's fastest setting at AR parity (benchmarks/results/quality_speed.md "Defaults against the
    # evidence"; it was 8 for a day, when the frontier had not yet measured 14)
    gsd_group: int = option(DEFAULT_GROUP, "GSD: group size G (tokens that may share a draft's acceptance)")
    gsd_prob_threshold: float = option(DEFAULT_PROB_THRESHOLD, "GSD: keep a group member j only if "
                                                               "|p(j) - p(x)| < this")
    gsd_dist_threshold: float = option(DEFAULT_DIST_THRESHOLD, "GSD: ... and its squared distance to x on "
                                                               "the unit codebook < this")
    gsd_static_clusters: bool = False  # the paper's ablation: x's nearest codes instead of its p-rank window
    gsd_window_edge: str = option("shorten", "GSD: shorten, or sjd (the released code's plain SJD ratio when "
                                             "the window falls off the lowest ranks)")
    coupling: str = option("none", "SCD/GSD: how unverified drafts are re-drawn: none (SJD's independent "
                                   "samples), maximal (keep-or-replace by rejection sampling) or gumbel "
                                   "(Gumbel-max with noise fixed per absolute position)")
    # The Lumina-mGPT/Janus-Pro SCD code's bug, kept as a negative control for the exactness tests only:
    # a kept stale draft declares the distribution it was drawn from, not the target it was tested against.
    coupling_declares_old_q: bool = False

    def validate(self):
        super().validate()
        check_gsd_values(self.gsd_group, self.gsd_prob_threshold, self.gsd_dist_threshold, self.gsd_static_clusters)
        check_window_edge(self.gsd_window_edge)
        check_choice("coupling", self.coupling, COUPLINGS)
        return self

    def check_engine(self, engine):
        super().check_engine(engine)
        self.rule(engine)  # builds the rule once: reports a missing tokenizer or a too large group

    def rule(self, engine):
        return make_grouped_rule(engine, gsd_group=self.gsd_group, gsd_prob_threshold=self.gsd_prob_threshold,
                                 gsd_dist_threshold=self.gsd_dist_threshold,
                                 gsd_static_clusters=self.gsd_static_clusters, gsd_window_edge=self.gsd_window_edge)


def _grid_width(T: int) -> int:
    w = math.isqrt(T)
    if w * w != T:
        raise VVSError(f"jacobi-init copy-above needs a square token grid, got {T} tokens per image")
    return w


@register("sjd", SJDOptions)
def run_sjd(engine, batch: DecodeBatch, params, opts: SJDOptions) -> "JacobiDecoder":
    return JacobiDecoder.start(engine, batch, params, opts, ExactRule())


@dataclass
class SCDOptions(SJDOptions):
    """SCD (So et al., ICML 2026, arXiv 2510.24211): SJD whose unverified drafts are re-drawn with a
    coupling (``methods/scd.py`` registers it)."""

    # L = 32: the fastest SCD window at AR parity on the Zoo (TPF 3.65 against 3.19 at 16 and 2.48 at 8,
    # 512 images: benchmarks/results/quality_speed.md "Defaults against the evidence"); SCD is exact, so
    # a longer window costs only the wider forward
    jacobi_window: int = 32  # help: SJDOptions'
    coupling: str = option("maximal", help_of(GSDOptions, "coupling"))
    coupling_declares_old_q: bool = False  # negative control only (see GSDOptions)

    def validate(self):
        super().validate()
        check_choice("coupling", self.coupling, COUPLINGS)
        if not isinstance(self.coupling_declares_old_q, bool):
            raise VVSError("coupling_declares_old_q must be true or false")
        return self


@register("gsd", GSDOptions)
def run_gsd(engine, batch: DecodeBatch, params, opts: GSDOptions) -> "JacobiDecoder":
    return JacobiDecoder.start(engine, batch, params, opts, opts.rule(engine))


@dataclass
class JacobiContext:
    """What a rule may look at besides (p, x, q(x), u): the full draft distributions (GSD needs
    q over the whole cluster)."""

    draft_q: torch.Tensor  # [M, V]
    engine: object = None


@dataclass
class JacobiState(RowState):
    """Device state of a batched Jacobi decode; static shapes, updated in place by each iteration."""

    window: torch.Tensor  # [B, L] the last committed token, then L - 1 drafts
    draft_q: torch.Tensor  # [B, L, V] row j: the distribution window[:, j + 1] was drawn from; row L-1 is 0
    fresh: torch.Tensor  # [B, L] bool: a fresh initialisation (not a carried Jacobi draft)
    tokens: torch.Tensor  # [B, T + 2L] committed tokens; an iteration may write up to L past the count
    n_committed: torch.Tensor  # [B]
    passes: torch.Tensor  # [B] target forwards while the image was unfinished (+ 1: the random-number step)
    accepted_hist: torch.Tensor  # [B, L] iterations that accepted exactly k drafts
    accepted_carried: torch.Tensor  # [B] accepted drafts that were carried Jacobi samples
    window_start: torch.Tensor  # [B] the last forward's first slot among the row's own (c + committed - 1
    #                             then): where the next iteration first copies that window's K/V


@dataclass(frozen=True)
class JacobiLayout:
    """The host constants of one batched Jacobi decode (a compiled round reads them as constants)."""

    policy: str  # the init policy of fresh drafts
    coupling: str  # none (SJD), maximal or gumbel (SCD)
    declare_old_q: bool  # SCD's negative control: kept drafts declare the q they were drawn from
    grid_w: int  # copy-above: tokens per image row (0: other policies)
    last_position: int  # positions past the last image token only feed discarded overshoot
    scratch: int  # the window's first scratch slot (c + T + 2L: after every row's prefix and overshoot)
    n_uniforms: int  # uniforms per image and iteration

    @classmethod
    def of(cls, opts, c: int, T: int, L: int) -> "JacobiLayout":
        return cls(opts.jacobi_init, getattr(opts, "coupling", "none"), bool(getattr(opts, "coupling_declares_old_q", False)),
                   _grid_width(T) if opts.jacobi_init == "copy-above" else 0, c + T - 1, c + T + 2 * L,
                   3 * L if opts.jacobi_init == "random" else 2 * L)


@dataclass(frozen=True)
class JacobiIndex:
    """Constant index tensors and random-number streams of the rounds, made once (a round spends no op
    on them)."""

    lanes: torch.Tensor  # [L]
    scratch_slots: torch.Tensor  # [L] the window's scratch slots
    window_block: torch.Tensor  # [L, S] query i sees scratch slots scratch..scratch+i (on top of its prefix)
    update_stream: torch.Tensor
    gumbel_stream: torch.Tensor

    @classmethod
    def of(cls, layout: JacobiLayout, L: int, session, rng) -> "JacobiIndex":
        lanes = torch.arange(L, device=session.device)
        rel = session.slot_ids[None, :] - layout.scratch
        return cls(lanes, layout.scratch + lanes, (rel >= 0) & (rel <= lanes[:, None]),
                   rng.stream_offsets([Streams.JACOBI_UPDATE]), rng.stream_offsets([GUMBEL_STREAM]))


class JacobiDecoder:
    """Constants and buffers of one batched decode; :meth:`jacobi_iteration` is the round function.
    A decoder of ``runtime.loop`` (its protocol is at the end of the class): :meth:`start` builds and
    prefills one."""

    inductor_options = JACOBI_INDUCTOR_OPTIONS
    RESULTS = ("tokens", "passes", "accepted_hist", "accepted_carried")  # what collect() hands the loop per row

    @classmethod
    def start(cls, engine, batch: DecodeBatch, params, opts: SJDOptions, rule) -> "JacobiDecoder":
        decoder = cls(engine, batch, params, opts, rule)
        decoder.state = decoder.prefill()
        return decoder

    def __init__(self, engine, batch: DecodeBatch, params, opts: SJDOptions, rule):
        self.engine, self.opts, self.rule, self.rng = engine, opts, rule, batch.rng
        self.params = params = row_sampling(params, batch, batch.cond.device)
        self.B, self.L = batch.size, opts.jacobi_window
        # slots [0, c + T + 2L): prefix and overshoot of every row; then the window's scratch slots
        self.session = s = TargetSession(engine.gpt, batch.cond, self.B, params.use_cfg, batch.key_mask,
                                         extra_slots=3 * self.L)
        self.c, self.T, self.V = s.c, s.T, engine.config.vocab_size
        self.layout = JacobiLayout.of(opts, self.c, self.T, self.L)
        self.index = JacobiIndex.of(self.layout, self.L, s, self.rng)

    def processed(self, h: torch.Tensor) -> torch.Tensor:
        return process_logits(guided_logits(self.session.logits(h), self.params), self.params)

    def batch_rows(self) -> torch.Tensor:
        return torch.arange(self.B, device=self.session.device)

    # --- prefill (eager) ----------------------------------------------------------------------------
    def prefill(self) -> JacobiState:
        B, L, V, T, dev = self.B, self.L, self.V, self.T, self.session.device
        p0 = self.processed(self.session.prefill()[:, -1])  # [B, V]
        first = self.rng.sample(p0, 0, Streams.SAMPLE)  # [B]; iterations use steps 1, 2, ...
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        # window_start = c: no window yet; the first iteration copies the scratch slots (zeros) to slots
        # [c, c + L), which its prefix (length c) hides
        st = JacobiState(window=zeros(B, L), draft_q=torch.zeros(B, L, V, device=dev),
                         fresh=torch.zeros(B, L, dtype=torch.bool, device=dev), tokens=zeros(B, T + 2 * L),
                         n_committed=torch.ones(B, dtype=torch.long, device=dev), passes=zeros(B),
                         accepted_hist=zeros(B, L), accepted_carried=zeros(B),
                         window_start=torch.full((B,), self.c, dtype=torch.long, device=dev))
        st.tokens.index_put_((self.batch_rows(), torch.zeros_like(first)), first)
        window = torch.where(self.index.lanes == 0, first[:, None], 0)
        u_init = self.rng.uniform(0, Streams.JACOBI_INIT, L) if self.layout.policy == "random" else None
        window, fresh = self.fill_fresh(window, torch.ones_like(first), p0, st.tokens, st.n_committed, u_init)
        st.window.copy_(window)
        st.fresh.copy_(fresh)
        st.draft_q.copy_(self.draft_rows(one_hot(window[:, 1:], V)))  # fresh drafts: one-hot q
        return st

    def draft_rows(self, q_drafts: torch.Tensor) -> torch.Tensor:
        """[B, L - 1, V] distributions of drafts 1..L-1 -> the [B, L, V] ``draft_q`` layout (row L-1 zero)."""
        return torch.cat([q_drafts, q_drafts.new_zeros(q_drafts.shape[0], 1, q_drafts.shape[2])], 1)

    # --- one Jacobi iteration: static shapes, no host read ------------------------------------------
    def jacobi_iteration(self, st: JacobiState) -> None:
        B, L, V, T = self.B, self.L, self.V, self.T
        s, lanes, params = self.session, self.index.lanes, self.params
        rows_b = self.batch_rows()
        self.place_last_window_kv(st)
        active = st.n_committed < T  # [B] finished images keep running but commit nothing
        prefix = self.session.rows_of(self.c + st.n_committed - 1)  # [rows] the window starts at the last committed token
        positions = (prefix[:, None] + lanes).clamp(max=self.layout.last_position)  # [rows, L]
        visible = s.slot_ids < prefix[:, None]  # [rows, S]
        if s.has_key_mask:
            visible = visible & s.key_valid
        mask = visible[:, None, :] | self.index.window_block  # [rows, L, S]
        h = s.forward_at(st.window, positions, self.index.scratch_slots, mask)
        p = self.processed(h)  # [B, L, V]
        st.window_start.copy_(self.c + st.n_committed - 1)  # its K/V go there next iteration

        # One counter-RNG draw per iteration, split by lane: L - 1 acceptance tests, L Jacobi samples
        # (with maximal coupling: the L - 1 replacement samples and the last one), the residual sample,
        # and L fresh random drafts (random init only).
        u = kernels.counter_uniform(self.rng.key, random_step(st), self.index.update_stream, self.layout.n_uniforms,
                                     fuse_when_compiled=True)[:, 0]

        # --- every prediction p[j] at once: one pass over the vocabulary when compiled --------------
        # Row j gives the test of draft j + 1, the Jacobi sample y[j] and the token committed if the
        # walk stops at j: a sample of the residual norm(max(0, p[j] - q[j])) (row L - 1 has q = 0: p
        # itself, the bonus token). Drawing it in every row and picking row k afterwards costs L - 1
        # unused draws but no dependent pass after the walk (the same arithmetic per row as drawing it
        # in row k alone). moved = None: GSD's reference resamples SJD's residual too.
        next_tokens = st.window.roll(-1, 1)  # [B, L] draft j + 1 (lane L - 1 wraps around: never used)
        # ok[j]: draft j + 1 passed; lane L - 1 has no draft (False: its test, which reads the first
        # Jacobi sample's uniform, is dropped). Lanes as wide as the window: the compiled walk below is
        # then one loop with the commit and refill that follow it.
        ok = self.test_drafts(p, next_tokens, st.draft_q, u[:, :L]) & (lanes < L - 1)  # [B, L]
        residual = self.rule.residual(p.reshape(-1, V), st.draft_q.reshape(-1, V), next_tokens.reshape(-1),
                                      None).view(B, L, V)
        stop_token = params.pick(lambda: residual.argmax(-1),
                                 lambda: sample_inverse_cdf_one_pass(residual, u[:, 2 * L - 1, None].expand(B, L)))
        # The next iteration's carried drafts, one per prediction p[j] (j = 0..L-1).
        y = self.redraw(p, next_tokens, ok, residual, u[:, L - 1: 2 * L - 1], st.n_committed)

        # --- the walk: the longest passing prefix of drafts ------------------------------------------
        k = ok.long().cumprod(1).sum(1)  # [B] accepted drafts, 0..L-1
        nxt = stop_token.gather(1, k[:, None])[:, 0]

        # --- commit (drafts past k are overwritten later; finished images write past T) -------------
        values = torch.where(lanes == k[:, None], nxt[:, None], next_tokens)
        st.tokens.index_put_((rows_b[:, None], st.n_committed[:, None] + lanes), values)
        carried = ((~st.fresh) & (lanes >= 1) & (lanes <= k[:, None])).sum(1)  # accepted drafts not fresh
        st.accepted_carried.add_(carried * active)
        n_new = self.count_iteration(st, k, active)

        # --- next window: [nxt, y[k+1..L-1] (q = p), fresh drafts] ------------------------------------
        src = (k[:, None] + lanes).clamp(max=L - 1)  # new position i came from old prediction k + i
        window = torch.where(lanes == 0, nxt[:, None], y.gather(1, src))
        window, fresh = self.fill_fresh(window, L - k, p[:, L - 1], st.tokens, n_new, u[:, 2 * L:])
        if L > 1:
            src_q = src[:, 1:, None].expand(B, L - 1, V)
            carried_q = p.gather(1, src_q)
            if self.layout.declare_old_q and self.layout.coupling == "maximal":
                # negative control: a kept draft (its test passed) declares the q it was drawn from
                kept = ok.gather(1, src[:, 1:])  # [B, L-1]
                carried_q = torch.where(kept[..., None], st.draft_q.gather(1, src_q), carried_q)
            st.draft_q.copy_(self.draft_rows(torch.where(fresh[:, 1:, None], one_hot(window[:, 1:], V), carried_q)))
        st.window.copy_(window)
        st.fresh.copy_(fresh)
        st.n_committed.copy_(n_new)  # the host's one read (decode)

    def test_drafts(self, p, next_tokens, draft_q, u_test):
        """[B, L] bool: token ``next_tokens[j]`` (drawn from ``draft_q[j]``) passes its test against p[j]
        (greedy: it is the argmax, whatever the rule). Every row is tested, the last one too (it has no
        draft; the caller drops it): compiled, a test over rows 0..L-2 only would be a loop of its own.
        The exact rule's test u * q(x) < p(x) reads p(x) as a masked sum (the same number as a gather:
        one non-zero term), so the compiled round computes it in the pass that computes p; other rules
        get the flat batch of rows through their ``accept``."""
        return self.params.pick(lambda: p.argmax(-1) == next_tokens,
                                lambda: self._test_sampled(p, next_tokens, draft_q, u_test))

    def _test_sampled(self, p, next_tokens, draft_q, u_test):
        B, L, V = p.shape
        qx = draft_q.gather(2, next_tokens[..., None])[..., 0]
        if type(self.rule).accept is AcceptanceRule.accept:
            return u_test * qx < value_at(p, next_tokens)
        ok, _ = self.rule.accept(p.reshape(-1, V), next_tokens.reshape(-1), qx.reshape(-1), u_test.reshape(-1),
                                 JacobiContext(draft_q.reshape(-1, V), self.engine))
        return ok.view(B, L)

    def count_iteration(self, st, n_accepted: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The iteration's histogram entry and forward of each image that is still decoding (``active``
        [B]) after it accepted ``n_accepted`` [B] drafts (< L) -> the new committed counts [B]."""
        lanes = self.index.lanes
        st.accepted_hist.add_(((lanes == n_accepted[:, None]) & active[:, None]).long())  # rows are distinct
        st.passes.add_(active.long())
        # Lanes 0..n_accepted commit a token; lane 0 also carries the old count, so the new count is one
        # sum over the lanes, a reduction of its own that the counters' writes join. Written as old count
        # + accepted + 1, those writes join another per-row reduction instead (SJD-PAC's carried-draft
        # count), which must then wait for the refill's reads of the old counts: one more launch.
        committed = ((lanes <= n_accepted[:, None]) & active[:, None]).long()
        return torch.where(lanes == 0, st.n_committed[:, None] + committed, committed).sum(1)

    def redraw(self, p, next_tokens, ok, residual, u_y, n_committed):
        """The carried drafts of the next iteration, y [B, L] with y[j] ~ p[j] (its declared q):
        ``none``: independent samples (SJD); ``maximal``: draft j + 1 (``next_tokens[j]``) itself where
        its test passed (``ok`` [B, L]), else a sample of ``residual[j]`` = norm(max(0, p[j] - q[j])) (the
        speculative-sampling lemma: a sample of p[j], equal to the old draft with probability 1 - TV);
        the last prediction has no draft and is sampled. ``gumbel``: argmax(log p[j] + G[t]) with G keyed
        by the absolute token index t. Samples are drawn in every row and selected (compiled, a draw over
        some of the rows would be a loop of its own)."""
        B, L, V = p.shape
        y = sample_inverse_cdf_one_pass(p, u_y)  # [B, L]
        if self.layout.coupling == "maximal":
            replaced = sample_inverse_cdf_one_pass(residual, u_y)
            y = torch.where(self.index.lanes < L - 1, torch.where(ok, next_tokens, replaced), y)
        elif self.layout.coupling == "gumbel":
            y = (p.clamp(min=0).log() + self.gumbel_noise(n_committed[:, None] + self.index.lanes, V)).argmax(-1)
        return y

    def gumbel_noise(self, token_index: torch.Tensor, V: int) -> torch.Tensor:
        """Gumbel noise [B, n, V] for tokens ``token_index`` [B, n] of each image: a pure function of
        (seed, image, token index), the same in every iteration until that token is committed."""
        B, n = token_index.shape
        key = self.rng.key[:, None].expand(B, n).reshape(-1)
        u = kernels.counter_uniform(key, token_index.reshape(-1), self.index.gumbel_stream, V, fuse_when_compiled=True)
        u = u[:, 0].view(B, n, V)
        return gumbel(u)

    # --- the decoder protocol of runtime.loop ----------------------------------------------------------
    def round_functions(self) -> dict:
        return {"jacobi": lambda: self.jacobi_iteration(self.state)}

    def status(self) -> torch.Tensor:
        return self.state.n_committed  # the loop's one read: each row's committed count

    def next_kind(self, last_kind, late) -> str:
        return "jacobi"

    def declare_rows(self, table) -> None:
        declare_decoder_rows(table, self.session, self.params, self.rng, self.state)

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        return summary(counters["accepted_hist"].sum(0).tolist(), int(counters["accepted_carried"].sum()),
                       loop_stats["batch_rounds"], self.L)

    def place_last_window_kv(self, st) -> None:
        """Copy the last forward's window K/V from the scratch slots to the row's slots
        ``[window_start, window_start + L)``: its accepted prefix is then in place (slots past it are
        hidden by the prefix length and overwritten later). Done at the start of the next iteration,
        before its forward overwrites the scratch slots, rather than at the end of the last one:
        compiled, the copy's gather and write then run beside the round's first kernels instead of as
        two launches of their own after the forward. Attention sees the same cache either way."""
        dst = self.session.rows_of(st.window_start)[:, None] + self.index.lanes
        self.session.kv.move(self.index.scratch_slots.expand_as(dst), dst)  # index_put_: in place when compiled

    def round_buffers(self) -> list:
        """What a rerun of an iteration (the warm-up runs of a CUDA graph capture, a failed compile)
        must restore: the state and the scratch slots' K/V (views), which an iteration first copies to
        the rows."""
        kv, window = self.session.kv, slice(self.layout.scratch, self.layout.scratch + self.L)
        return self.state.tensors() + [kv.k[:, :, :, window], kv.v[:, :, :, window]]

    def fill_fresh(self, window, n_kept, left_dist, tokens, n_committed, u_init):
        """Fill window positions ``i >= n_kept[b]`` with fresh drafts. ``left_dist`` [B, V] is the
        distribution the last kept token was drawn from; ``u_init`` [B, n] uniforms for random drafts.
        Works on any window length n (SJD-PAC passes its main chain). Returns (window [B, n], fresh [B, n] bool)."""
        V, n = self.V, window.shape[1]
        lanes = torch.arange(n, device=window.device)
        fresh = lanes >= n_kept[:, None]
        if self.layout.policy == "random":
            guess = (u_init * V).ceil().long().clamp(1, V) - 1  # (0, 1] -> 0..V-1
        elif self.layout.policy == "argmax-left":
            # the left neighbour of the first fresh slot was drawn from left_dist; later fresh slots
            # copy their one-hot left neighbour, i.e. the same argmax
            guess = left_dist.argmax(-1, keepdim=True)
        else:  # copy-left, and copy-above's fallback in the first image row
            guess = window.gather(1, (n_kept - 1).clamp(min=0)[:, None])
        window = torch.where(fresh, guess, window)
        if self.layout.policy == "copy-above":
            # image index of window slot i is n - 1 + i; the token above is grid_w earlier: committed
            # (in ``tokens``) or itself in the window (resolved in a few passes, nearest rows first).
            grid_w = self.layout.grid_w
            above = n_committed[:, None] - 1 + lanes - grid_w
            has_above = fresh & (above >= 0)
            in_window = above >= n_committed[:, None] - 1
            from_tokens = tokens.gather(1, above.clamp(0, tokens.shape[1] - 1))  # used only below n
            left_in_window = (lanes - grid_w).clamp(min=0).expand_as(window)
            for _ in range((n - 1) // max(grid_w, 1) + 1):
                from_window = window.gather(1, left_in_window)
                window = torch.where(has_above, torch.where(in_window, from_window, from_tokens), window)
        return window, fresh


def random_step(st) -> torch.Tensor:
    """[B] the counter-RNG step of each image's iteration: its own iteration number 1, 2, ... (the
    prefill draws at step 0), i.e. its forwards so far + 1. Finished images stop counting and draw
    numbers nobody uses; no counter of its own means no update of its own to launch."""
    return st.passes + 1


def one_hot(tokens: torch.Tensor, V: int) -> torch.Tensor:
    """float32 one-hot [..., V] by comparison (no scatter into a persistent buffer)."""
    return (tokens[..., None] == torch.arange(V, device=tokens.device)).float()


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from uniforms in (0, 1]: -log(-log u). u = 1 (probability 2^-24) would give
    +inf and beat even zero-probability tokens; -log u is floored at 2^-30 instead."""
    return -torch.log((-torch.log(u)).clamp(min=2.0 ** -30))


def summary(hist, carried: int, batch_iterations: int, window: int) -> dict:
    """Stats from the per-iteration counts of real images: ``hist[k]`` iterations accepted k drafts."""
    rounds = sum(hist)
    accepted = sum(k * n for k, n in enumerate(hist))
    deepest = max((k for k, n in enumerate(hist) if n), default=0)
    return {
        "target_forward_passes": rounds,  # per image (a batched forward counts once per image); prefill excluded
        "jacobi_rounds": rounds,
        "batch_iterations": batch_iterations,  # batched forwards actually run
        "jacobi_window": window,
        # committed tokens per forward (accepted drafts + the residual/bonus token)
        "mean_accepted_length": accepted / rounds + 1 if rounds else 0.0,
        "accepted_drafts_histogram": list(hist),  # index k: rounds that accepted exactly k drafts
        "acceptance_rate_by_depth": {str(d): sum(hist[d:]) / rounds for d in range(1, deepest + 1)},
        "accepted_drafts_carried": carried,
        "accepted_drafts_fresh": accepted - carried,
    }
