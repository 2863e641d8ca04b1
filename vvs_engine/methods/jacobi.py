"""Training-free Jacobi decoding: SJD (lossless) and GSD (grouped acceptance).

SJD (Teng et al., ICLR 2025, arXiv 2410.01699) is speculative sampling whose drafts are the target's
own predictions from the previous Jacobi iteration; GSD (So et al., ICCV 2025, arXiv 2508.07747) is the
same loop with the grouped acceptance rule of :mod:`vvs_engine.acceptance.gsd`. Spec:
``docs/methods.md`` §1-2. One image at a time (both CFG rows), static KV cache,
device-side lengths, like the drafter-based loop in ``speculative.py``:

    prefill; x0 ~ p; window = [x0, L-1 fresh drafts (q one-hot)]
    loop:
      one target forward over the window W[0..L-1] at positions P..P+L-1 (causal inside the window);
        p[j] = processed target distribution of the token after W[j]
      draft W[j+1] is tested against p[j] with its q (accept iff u < min(1, p(x)/q(x)), or GSD's rule);
      k = accepted prefix length; commit W[1..k] and one more token drawn from norm(max(0, p[k] - q[k]))
        (= p[L-1] itself when every draft passed: the bonus token)
      next window = [that token, samples y[k+1..L-1] ~ p[k+1..L-1] with q = p (the Jacobi update),
                     fresh drafts (random / copy-left / argmax-left / copy-above) with one-hot q]

Why no KV bookkeeping is needed: the window starts at the prefix length P, so the accepted tokens'
K/V are already in the right slots and the next window simply starts after them; the rejected slots
are overwritten by the next forward (rollback = not advancing P), for both CFG rows at once.

The one host read per round is the committed-token count (termination). Lossless for SJD: each draft
is drawn from its q independently of the tokens it is tested after, so the standard speculative
argument applies (checked by a chi-square test in ``tests/test_jacobi.py``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..acceptance.verify import ExactRule
from ..errors import VVSError
from ..runtime.masks import causal_local
from ..sampling import guided_logits, process_logits, sample
from ..runtime.target import TargetSession
from ..acceptance.gsd import (DEFAULT_DIST_THRESHOLD, DEFAULT_GROUP, DEFAULT_PROB_THRESHOLD, check_gsd_values,
                        make_grouped_rule)
from . import register
from .common import MethodResult, progress
from .options import option

INIT_POLICIES = ("random", "copy-left", "argmax-left", "copy-above")
MAX_WINDOW = 1024


@dataclass
class SJDOptions:
    # New window positions: "copy-left" (the SJD repository's LlamaGen setting, repeat_horizon),
    # "random" (uniform, its Lumina-mGPT/Emu3 setting), "argmax-left" (top-1 of the left neighbour's
    # distribution, sample_horizon), "copy-above" (the token one image row up; the paper's vertical
    # variant, which its Fig. 9 found fastest).
    jacobi_window: int = option(16, "SJD/GSD: Jacobi window L (last committed token + L - 1 drafts per forward)")
    jacobi_init: str = option("copy-left", "SJD/GSD: new window positions: copy-left, random, argmax-left or "
                                           "copy-above")

    def validate(self):
        w = self.jacobi_window
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_WINDOW:
            raise VVSError(f"jacobi-window must be an integer in [1, {MAX_WINDOW}], got {w!r}")
        if self.jacobi_init not in INIT_POLICIES:
            raise VVSError(f"jacobi-init must be one of {', '.join(INIT_POLICIES)}, got {self.jacobi_init!r}")
        return self

    def check_engine(self, engine):
        if self.jacobi_init == "copy-above":
            _grid_width(engine.tokens_per_image)


@dataclass
class GSDOptions(SJDOptions):
    gsd_group: int = option(DEFAULT_GROUP, "GSD: group size G (tokens that may share a draft's acceptance)")
    gsd_prob_threshold: float = option(DEFAULT_PROB_THRESHOLD, "GSD: keep a group member j only if "
                                                               "|p(j) - p(x)| < this")
    gsd_dist_threshold: float = option(DEFAULT_DIST_THRESHOLD, "GSD: ... and its squared distance to x on "
                                                               "the unit codebook < this")
    gsd_static_clusters: bool = False  # the paper's ablation: x's nearest codes instead of its p-rank window

    def validate(self):
        super().validate()
        check_gsd_values(self.gsd_group, self.gsd_prob_threshold, self.gsd_dist_threshold, self.gsd_static_clusters)
        return self

    def check_engine(self, engine):
        super().check_engine(engine)
        self.rule(engine)  # builds the rule once: reports a missing tokenizer or a too large group

    def rule(self, engine):
        return make_grouped_rule(engine, gsd_group=self.gsd_group, gsd_prob_threshold=self.gsd_prob_threshold,
                                 gsd_dist_threshold=self.gsd_dist_threshold,
                                 gsd_static_clusters=self.gsd_static_clusters)


def _grid_width(T: int) -> int:
    w = math.isqrt(T)
    if w * w != T:
        raise VVSError(f"jacobi-init copy-above needs a square token grid, got {T} tokens per image")
    return w


@register("sjd", SJDOptions)
def run_sjd(engine, cond, key_mask, n, params, gen, opts: SJDOptions, show_progress=False) -> MethodResult:
    return run(engine, cond, key_mask, n, params, gen, opts, ExactRule(), show_progress)


@register("gsd", GSDOptions)
def run_gsd(engine, cond, key_mask, n, params, gen, opts: GSDOptions, show_progress=False) -> MethodResult:
    return run(engine, cond, key_mask, n, params, gen, opts, opts.rule(engine), show_progress)


def run(engine, cond, key_mask, n, params, gen, opts: SJDOptions, rule, show_progress=False) -> MethodResult:
    st = Stats(opts.jacobi_window)
    out = []
    for i in progress(range(n), show_progress, "images"):
        idx = torch.tensor([i, i + n] if params.use_cfg else [i], device=cond.device)
        c_i = cond.index_select(0, idx)
        km = key_mask.index_select(0, idx) if key_mask is not None else None
        out.append(decode_one(engine, c_i, km, params, gen, opts, rule, st))
    return MethodResult(torch.stack(out), st.summary())


@dataclass
class JacobiContext:
    """What a rule may look at besides (p, x, q(x), u): the full draft distributions (GSD needs
    q over the whole cluster)."""

    draft_q: torch.Tensor  # [L-1, V]
    engine: object = None


class Stats:
    def __init__(self, window: int):
        self.window = window
        self.rounds = 0
        self.accepted = []  # device [1] tensors: accepted drafts per round
        self.accepted_carried = []  # of which were Jacobi-carried drafts (the rest were fresh inits)
        self.t = {"forward": 0.0, "accept": 0.0}

    def summary(self) -> dict:
        acc = torch.cat(self.accepted).cpu() if self.accepted else torch.zeros(0, dtype=torch.long)
        carried = int(torch.cat(self.accepted_carried).sum()) if self.accepted_carried else 0
        hist = torch.bincount(acc, minlength=self.window).tolist() if acc.numel() else []
        by_pos = {str(d): float((acc >= d).float().mean()) for d in range(1, int(acc.max()) + 1)} if acc.numel() else {}
        return {
            "target_forward_passes": self.rounds,  # prefill excluded, as for AR
            "jacobi_rounds": self.rounds,
            "jacobi_window": self.window,
            # committed tokens per forward (accepted drafts + the residual/bonus token)
            "mean_accepted_length": float(acc.double().mean() + 1) if acc.numel() else 0.0,
            "accepted_drafts_histogram": hist,  # index k: rounds that accepted exactly k drafts
            "acceptance_rate_by_depth": by_pos,  # P(at least d drafts accepted)
            "accepted_drafts_carried": carried,
            "accepted_drafts_fresh": int(acc.sum()) - carried,
            "time_split_s": {k: round(v, 4) for k, v in self.t.items()},
        }


def decode_one(engine, cond, key_mask, params, gen, o: SJDOptions, rule, st: Stats) -> torch.Tensor:
    dev = engine.device
    L = o.jacobi_window
    s = TargetSession(engine.gpt, cond, 1, params.use_cfg, key_mask, extra_slots=L + 1)
    c, T = s.c, s.T
    V = engine.config.vocab_size
    grid_w = _grid_width(T) if o.jacobi_init == "copy-above" else 0
    ar = lambda k: torch.arange(k, device=dev)
    local = causal_local(L, dev)
    last_pos = c + T - 1  # positions past the last image token only feed discarded overshoot

    def p_of(h):
        return process_logits(guided_logits(s.logits(h), params), params)

    H0 = s.prefill()
    p0 = p_of(H0[:, -1])  # [1, V]
    first = sample(p0, gen)  # [1]
    # Committed tokens. Slack: a round writes up to L tokens past the count (overshoot is dropped).
    out = torch.zeros(T + L + 1, dtype=torch.long, device=dev)
    out[:1] = first
    n_out = torch.ones(1, dtype=torch.long, device=dev)
    window = torch.zeros(L, dtype=torch.long, device=dev)
    window[:1] = first
    n_kept = torch.ones(1, dtype=torch.long, device=dev)  # window[:n_kept] are valid; the rest get drafts
    window, fresh = _fill_fresh(o.jacobi_init, window, n_kept, p0[0], out, n_out, grid_w, V, gen)
    # draft_q[j]: the distribution window[j + 1] was drawn from; one-hot for deterministic fresh drafts
    draft_q = torch.zeros(L - 1, V, dtype=torch.float32, device=dev).scatter_(1, window[1:, None], 1.0)
    no_draft = torch.zeros(1, V, dtype=torch.float32, device=dev)  # q after the window: residual = p

    while True:
        if int(n_out) >= T:  # the one host read per round
            break
        t0 = time.perf_counter()
        P = c + n_out - 1  # the window's first token is the last committed one, not yet in the cache
        pos = (P + ar(L)).clamp(max=last_pos)
        H = s.forward(window[None], pos, P, local)  # K/V of the window land in slots [P, P + L)
        p = p_of(H)[0]  # [L, V]
        st.t["forward"] += time.perf_counter() - t0
        t0 = time.perf_counter()

        # --- accept the longest passing prefix of drafts -----------------------------------------
        drafts = window[1:]
        u = torch.rand(L - 1, device=dev, generator=gen)
        if L > 1:
            qx = draft_q.gather(1, drafts[:, None])[:, 0]
            ok, _ = rule.accept(p[:-1], drafts, qx, u, JacobiContext(draft_q, engine))
            if params.greedy:  # greedy: exactly the argmax, whatever the rule
                ok = p[:-1].argmax(-1) == drafts
            k = ok.long().cumprod(0).sum().reshape(1)  # accepted drafts, 0..L-1
        else:
            k = torch.zeros(1, dtype=torch.long, device=dev)
        # Fresh samples at every position: the Jacobi update (next round's carried drafts).
        y = sample(p, gen)  # [L]
        # The token after the accepted prefix: residual at the first rejection, p itself after the
        # last draft (q = 0 there). moved = None: GSD's reference resamples SJD's residual too.
        q_all = torch.cat([draft_q, no_draft])
        p_k, q_k = p.index_select(0, k), q_all.index_select(0, k)
        residual = rule.residual(p_k, q_k, window.index_select(0, (k + 1).clamp(max=L - 1)), None)
        nxt = residual.argmax(-1) if params.greedy else sample(residual, gen)  # [1]

        # --- commit ---------------------------------------------------------------------------------
        if L > 1:
            out.index_copy_(0, n_out + ar(L - 1), drafts)  # entries past k are overwritten later
        out.index_copy_(0, n_out + k, nxt)
        st.accepted.append(k)
        st.accepted_carried.append(((~fresh[1:]) & (ar(L - 1) < k)).long().sum().reshape(1))
        n_out = n_out + k + 1

        # --- next window: [nxt, y[k+1..L-1] (q = p), fresh drafts] --------------------------------
        src = (k + ar(L)).clamp(max=L - 1)  # new position i came from old prediction k + i
        window = torch.where(ar(L) == 0, nxt, y.index_select(0, src))
        n_kept = L - k  # nxt and the L - 1 - k carried samples
        window, fresh = _fill_fresh(o.jacobi_init, window, n_kept, p[L - 1], out, n_out, grid_w, V, gen)
        if L > 1:
            carried_q = p.index_select(0, src[1:])
            one_hot = torch.zeros_like(carried_q).scatter_(1, window[1:, None], 1.0)
            draft_q = torch.where(fresh[1:, None], one_hot, carried_q)
        st.t["accept"] += time.perf_counter() - t0
        st.rounds += 1
    return out[:T]


def _fill_fresh(policy, window, n_kept, left_dist, out, n_out, grid_w, V, gen):
    """Fill window positions ``i >= n_kept`` with fresh drafts. ``left_dist`` is the distribution
    the last kept token was drawn from. Returns (window [L], fresh [L] bool)."""
    L = window.shape[0]
    dev = window.device
    i = torch.arange(L, device=dev)
    fresh = i >= n_kept
    # The generator is used the same way every round for a given policy, so SJD and GSD with the
    # same settings consume identical random streams (GSD with a group of one reproduces SJD).
    if policy == "random":
        guess = torch.randint(V, (L,), device=dev, generator=gen)
    elif policy == "argmax-left":
        # the left neighbour of the first fresh slot was drawn from left_dist; later fresh slots
        # copy their one-hot left neighbour, i.e. the same argmax
        guess = left_dist.argmax(-1).expand(L)
    else:  # copy-left, and copy-above's fallback in the first image row
        guess = window.index_select(0, (n_kept - 1).clamp(min=0)).expand(L)
    window = torch.where(fresh, guess, window)
    if policy == "copy-above":
        # image index of window slot i is n_out - 1 + i; the token above is grid_w earlier: committed
        # (in ``out``) or itself in the window (resolved in a few passes, nearest rows first).
        above = n_out - 1 + i - grid_w
        has_above = fresh & (above >= 0)
        in_window = above >= n_out - 1
        for _ in range((L - 1) // max(grid_w, 1) + 1):
            from_window = window.index_select(0, (i - grid_w).clamp(min=0))
            from_out = out.index_select(0, above.clamp(0, out.shape[0] - 1))  # used only below n_out
            window = torch.where(has_above, torch.where(in_window, from_window, from_out), window)
    return window, fresh
