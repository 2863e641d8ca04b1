"""The draft -> (skip | verify) loop shared by EAGLE, LANTERN(++), VVS and CASCADE, for B images at once.

Each sequence of the batch has its own draft tree, acceptance length, residual sample, KV layout,
feature cache, pending chain and committed count, all in static-shape [B, ...] device buffers
(:class:`DecodeState`); the constants sit in :class:`SpecLayout` (tree sizes) and :class:`SpecIndex`
(index vectors, random-number streams). A round is one function that updates the state in place:

    prefill: target over the condition; root ~ p; drafter eats the condition features; tree = draft(root)
    verify_round:  _verify_forward (one target forward over [pending chain | tree] per sequence, the tree
                   verified with the rule) -> _commit_path (KV compacted, features cached, tokens
                   committed) -> [_roll_back] -> _draft_next (drafter eats the fresh features; tree = draft)
    skip_round:    (VVS) commit a truncated random tree path unverified; its last token becomes the root;
                   drafter eats stale cached target features; tree = draft(root)

The decode loop (``runtime.loop``) only picks the next round kind and reads the status (tokens
committed, sequences wanting to skip) one round late, so it never waits for the device. Sequences
that finish stop committing (their lengths freeze) while the batch runs on.
Every random draw comes from the batch's :class:`~vvs_engine.rng.CounterRNG` keyed by the image
index and the round number, so an image's tokens do not depend on its batch-mates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple, Optional

import torch

from .. import kernels
from ..acceptance.verify import check_lantern_reference, default_lantern_k, make_rule, verify_tree
from ..drafting.session import DraftSession, TreeSpec
from ..drafting.tree import STATIC_TREES, DraftTree, static_layout
from ..errors import VVSError
from ..rng import Streams, sample_inverse_cdf
from ..runtime.target import TargetSession
from ..sampling import guided_logits, process_logits
from .common import DecodeBatch, row_sampling
from .options import MethodOptions, check_int, option
from . import schedule as sched


@dataclass
class RuleOptions:
    """The acceptance rule and LANTERN's parameters (SpecOptions' rule part)."""

    accept: Optional[str] = option(None, "acceptance rule: exact, lantern, lantern++, gsd or cascade")
    lantern_k: Optional[int] = option(None, "LANTERN: codebook neighbours k; default codebook size // 16")
    lantern_delta: float = option(0.2, "LANTERN: total-variation budget delta per step")
    lantern_lambda: float = option(2.0, "LANTERN++: cap lambda on the relaxed mass (<= lambda * p(x))")
    lantern_reference_residual: str = option("off", "LANTERN: off, or llamagen / lumina-mgpt to reproduce that "
                                                    "family's released residual and greedy test")

    def check_rule(self) -> None:
        d = self.lantern_delta
        if not isinstance(d, (int, float)) or math.isnan(d) or not 0 <= d <= 1:
            raise VVSError(f"lantern-delta must be in [0, 1], got {d}")
        lam = self.lantern_lambda
        if not isinstance(lam, (int, float)) or math.isnan(lam) or lam < 1:
            raise VVSError(f"lantern-lambda must be >= 1, got {lam}")
        if self.lantern_k is not None:
            check_int("lantern-k", self.lantern_k, 1)
        self.lantern_reference_residual = check_lantern_reference(self.lantern_reference_residual)


@dataclass
class TreeOptions:
    """The draft tree (SpecOptions' tree part)."""

    tree: Optional[str] = option(None, "draft tree: dynamic (EAGLE-2), static (naive_extend_57) or chain")
    tree_total: int = option(59, "dynamic tree: nodes including the root")
    tree_depth: int = option(4, "dynamic tree: expansion steps (levels = depth + 1); chain length")
    tree_topk: int = option(10, "dynamic tree: children per expanded node")
    static_tree: str = "naive_extend_57"

    def check_tree(self) -> None:
        if self.tree not in (None, "dynamic", "static", "chain"):
            raise VVSError(f"tree must be dynamic, static or chain, got '{self.tree}'")
        for name in ("tree_total", "tree_depth", "tree_topk"):
            check_int(name.replace("_", "-"), getattr(self, name), 1)
        if self.tree_total < 2:
            raise VVSError("tree-total must be >= 2 (root + one draft)")
        if self.static_tree not in STATIC_TREES:
            raise VVSError(f"unknown static tree '{self.static_tree}'; known: {', '.join(STATIC_TREES)}")

    def tree_spec(self) -> TreeSpec:
        return TreeSpec(self.tree or "dynamic", self.tree_total, self.tree_depth, self.tree_topk, self.static_tree)


@dataclass
class SkipOptions:
    """VVS's verification skipping (SpecOptions' skip part; skip_policy never: no skips)."""

    skip_policy: str = option("never", "VVS: never, uniform (skip every interval-th round) or dynamic "
                                       "(skip when the draft paths agree)")
    skip_interval: int = option(2, "VVS uniform: skip on rounds r >= 5 with r % interval == 1 (1 = never)")
    skip_threshold: float = option(0.65, "VVS dynamic: path-agreement threshold in [-1, 1]")
    select: str = option("random", "VVS: tree path a skipped round commits: random or confidence")
    post_verify: str = option("fill", "VVS: skipped chain at the next verification: fill (keep) or reject "
                                      "(roll back to the first rejected token)")
    feature_reuse: str = "latest"  # latest | repeat

    def check_skip(self) -> None:
        if self.skip_policy not in ("never", "uniform", "dynamic"):
            raise VVSError(f"skip-policy must be never, uniform or dynamic, got '{self.skip_policy}'")
        check_int("skip-interval", self.skip_interval, 1)
        s = self.skip_threshold
        if not isinstance(s, (int, float)) or math.isnan(s) or not -1 <= s <= 1:
            raise VVSError(f"skip-threshold must be in [-1, 1], got {s}")
        if self.select not in ("random", "confidence"):
            raise VVSError(f"select must be random or confidence, got '{self.select}'")
        if self.post_verify not in ("fill", "reject"):
            raise VVSError(f"post-verify must be fill or reject, got '{self.post_verify}'")
        if self.feature_reuse not in ("latest", "repeat"):
            raise VVSError(f"feature-reuse must be latest or repeat, got '{self.feature_reuse}'")


@dataclass
class RegisteredRuleOptions:
    """Options of registered rules, GSD's among them (the rule part's rest: after the skip part, so the
    flags, the README table and the options' repr keep their order)."""

    rule_options: dict = field(default_factory=dict)  # extra options for registered rules
    # GSD's grouped rule under any drafter-based method (--accept gsd); None = the rule's default
    gsd_group: Optional[int] = option(None, "GSD: group size G (tokens that may share a draft's acceptance)")
    gsd_prob_threshold: Optional[float] = option(None, "GSD: keep a group member j only if |p(j) - p(x)| < this")
    gsd_dist_threshold: Optional[float] = option(None, "GSD: ... and its squared distance to x on the unit "
                                                       "codebook < this")
    gsd_window_edge: Optional[str] = option(None, "GSD: shorten, or sjd (the released code's plain SJD ratio "
                                                  "when the window falls off the lowest ranks)")


@dataclass
class SpecOptions(RegisteredRuleOptions, SkipOptions, TreeOptions, RuleOptions, MethodOptions):
    """The drafter methods' options: rule, tree and skip parts (dataclass bases; fields in that order)."""

    def validate(self):
        self.check_tree()
        self.check_rule()
        self.check_skip()
        return self

    def check_engine(self, engine):
        if engine.drafter is None:
            raise VVSError("this method needs a drafter (--drafter PATH, or use the Zoo model)")

    def check_fits(self, shape) -> None:
        """A tree no deeper than the image, a dynamic tree's top-k no wider than the vocabulary (static and
        chain trees draw only the ranks their layout names), a node count the tree can hold, LANTERN
        neighbours inside the codebook."""
        T, V, spec = shape.tokens_per_image, shape.vocab_size, self.tree_spec()
        if spec.kind == "dynamic" and spec.topk > V:
            raise VVSError(f"tree-topk {spec.topk} exceeds the model's vocabulary of {V} tokens")
        if spec.kind in ("dynamic", "chain") and spec.depth >= T:
            raise VVSError(f"tree-depth {spec.depth} is too deep: a round commits at most depth + 1 tokens and an "
                           f"image has {T} (use <= {T - 1})")
        if spec.kind == "dynamic":
            capacity = 1 + spec.topk + spec.depth * spec.topk ** 2  # root + first level + topk^2 per deeper level
            if spec.total > capacity:
                raise VVSError(f"tree-total {spec.total} is more nodes than a dynamic tree of tree-depth {spec.depth} "
                               f"and tree-topk {spec.topk} can hold ({capacity}: root + topk + depth * topk^2)")
        k, book = self.lantern_k, shape.codebook_size
        if k is not None and book is not None and k >= book:
            raise VVSError(f"lantern-k {k} must be smaller than the codebook ({book} codes: a code has at most "
                           f"{book - 1} neighbours)")

    def decode_shape(self, shape) -> tuple:
        spec = self.tree_spec()
        depth = spec.depth + 1 if spec.kind != "static" else min(spec.max_nodes, shape.tokens_per_image)
        queries = spec.max_nodes + depth + 1
        return queries, 2 * queries + 8, True


def run(engine, batch: DecodeBatch, params, opts: SpecOptions) -> "SpeculativeRounds":
    """A prefilled decoder of ``runtime.loop`` for the configured tree, rule and skip schedule."""
    gsd_keys = ("gsd_group", "gsd_prob_threshold", "gsd_dist_threshold", "gsd_window_edge")
    if opts.accept == "gsd":
        gsd = {k: getattr(opts, k) for k in gsd_keys if getattr(opts, k) is not None}
        opts.rule_options = {**gsd, **opts.rule_options}
    elif any(getattr(opts, k) is not None for k in gsd_keys):
        raise VVSError("--gsd-* options need --accept gsd (or --method gsd)")
    return SpeculativeRounds(engine, batch, params, opts, make_rule_for(engine, opts))


def with_defaults(opts: SpecOptions, accept: str, tree: str) -> SpecOptions:
    """A method's rule and tree where the user named none (eagle, lantern, lantern++, vvs)."""
    if opts.accept is None:
        opts.accept = accept
    if opts.tree is None:
        opts.tree = tree
    return opts


def make_rule_for(engine, opts: SpecOptions):
    return make_rule(opts.accept or "exact", engine,
                     lantern_k=opts.lantern_k or default_lantern_k(_codebook(engine)),
                     lantern_delta=opts.lantern_delta, lantern_lambda=opts.lantern_lambda,
                     reference_residual=opts.lantern_reference_residual, **opts.rule_options)


def _codebook(engine):
    return engine.vq.config.codebook_size if engine.vq is not None else engine.config.vocab_size


@dataclass
class DecodeState:
    """Everything a round reads and writes, as device buffers updated in place (static shapes)."""

    out: torch.Tensor  # [B, T + slack] committed tokens (slack absorbs overruns past the image)
    n_out: torch.Tensor  # [B] tokens in out (pending chain and root included)
    target_len: torch.Tensor  # [B] committed target KV length (condition included)
    draft_len: torch.Tensor  # [B] drafter KV length (= target_len + pending chain length)
    feats: torch.Tensor  # [rows, S, D] target features of every committed position
    tree: DraftTree  # the tree the next round verifies or skips along
    chain_tokens: torch.Tensor  # [B, Cmax] the skipped chain (old root + drafts) awaiting post-verification
    chain_len: torch.Tensor  # [B] its length (0: nothing pending or the sequence had finished)
    round: torch.Tensor  # [B] the sequence's own round counter (rounds it took part in): its random-number step
    status: torch.Tensor  # [B + 1] what the loop reads: tokens committed without a pending chain per sequence
    #                       (>= T: finished), then how many unfinished sequences want to skip next
    # statistics, per sequence
    target_passes: torch.Tensor  # [B] verify rounds while the sequence was unfinished
    skipped: torch.Tensor  # [B] skip rounds while unfinished
    accepted_hist: torch.Tensor  # [B, Dmax + 1] verify rounds by accepted drafts
    skip_hist: torch.Tensor  # [B, Dmax + 1] skip rounds by tokens committed unverified
    rolled_back: torch.Tensor  # [B] post_verify=reject rollbacks

    def buffers(self):
        """Every tensor a round writes (saved and restored around CUDA-graph warm-up)."""
        own = [getattr(self, f.name) for f in fields(self) if f.name != "tree"]
        return own + [getattr(self.tree, f) for f in TREE_BUFFERS if getattr(self.tree, f) is not None]


# Per-sequence statistics (collected per image by the loop).
SEQUENCE_STATS = ("target_passes", "skipped", "accepted_hist", "skip_hist", "rolled_back")
# Per-sequence state a round restores for the sequences that sit it out (VVS: a sequence takes part
# only in the round kind it wants); the tree's fields come on top. Slots past a sequence's committed
# lengths (KV caches, features, out) need no restoring: nothing reads them before they are rewritten.
SEQUENCE_STATE = ("n_out", "target_len", "draft_len", "chain_tokens", "chain_len", "round") + SEQUENCE_STATS

# The tensors of a DraftTree that rounds rewrite in place (optional ones may be None).
TREE_BUFFERS = ("tokens", "parents", "mask", "depth", "paths", "is_leaf", "children", "q", "draft_logp",
                "draft_feats", "draft_logits")


def _copy_tree_(dst: DraftTree, src: DraftTree) -> None:
    for f in TREE_BUFFERS:
        d = getattr(dst, f)
        if d is not None:
            d.copy_(getattr(src, f))


def _own_tree(tree: DraftTree) -> DraftTree:
    """A tree whose fields are fresh dense buffers (static trees share expanded structure views)."""
    c = lambda t: None if t is None else t.contiguous().clone()
    return DraftTree(**{f: c(getattr(tree, f)) for f in TREE_BUFFERS}, sampled=tree.sampled)


@dataclass(frozen=True)
class SpecLayout:
    """The draft tree's sizes: nodes per tree, the deepest path, a pending chain's width."""

    nodes: int
    max_depth: int
    chain_width: int  # a pending chain: old root + up to max_depth drafts

    @classmethod
    def of(cls, spec: TreeSpec) -> "SpecLayout":
        if spec.kind == "dynamic":
            depth = spec.depth + 1
        elif spec.kind == "chain":
            depth = spec.depth
        else:
            depth = static_layout(STATIC_TREES[spec.static_name](), "cpu")["max_depth"]
        return cls(spec.max_nodes, depth, depth + 1)


@dataclass(frozen=True)
class SpecIndex:
    """Constant index vectors and random-number streams of the rounds, made once, outside any compiled
    round (a round spends no op on them), and VVS-D's normalised codebook."""

    path_slots: torch.Tensor  # [max_depth + 1]
    chain_slots: torch.Tensor  # [chain_width]
    verify_streams: torch.Tensor
    skip_stream: torch.Tensor
    node_lanes: torch.Tensor
    seq_ids: torch.Tensor  # [B] index vectors of the buffer writes
    row_ids: torch.Tensor  # [rows]
    skip_codebook: Optional[torch.Tensor]

    @classmethod
    def of(cls, layout: SpecLayout, rng, B: int, rows: int, dev, codebook_engine=None) -> "SpecIndex":
        codebook = None
        if codebook_engine is not None:
            codebook = torch.nn.functional.normalize(codebook_engine.codebook_vectors().float(), dim=-1)
        return cls(torch.arange(layout.max_depth + 1, device=dev), torch.arange(layout.chain_width, device=dev),
                   rng.stream_offsets([Streams.ACCEPT, Streams.SAMPLE]), rng.stream_offsets([Streams.SKIP]),
                   rng.lane_offsets(layout.nodes), torch.arange(B, device=dev), torch.arange(rows, device=dev), codebook)


class VerifyStep(NamedTuple):
    """A verify round's results before they are written back: the sequences' new lengths, the accepted
    drafts, and the drafter's pairs (features, tokens) from ``extend_start`` with the new root at
    ``root_index``."""

    n_out: torch.Tensor
    target_len: torch.Tensor
    draft_len: torch.Tensor
    n_acc: torch.Tensor
    pair_feats: torch.Tensor
    pair_tokens: torch.Tensor
    extend_start: torch.Tensor
    root_index: torch.Tensor
    root: torch.Tensor


class SpeculativeRounds:
    """The caches, buffers and round functions of one batch. ``verify_round``, ``verify_after_skip``
    and ``skip_round`` take no arguments, update :attr:`state` in place and never read the host."""

    RESULTS = ("out",) + SEQUENCE_STATS  # collected per finished sequence; ``out`` is its tokens

    def __init__(self, engine, batch: DecodeBatch, params, opts: SpecOptions, rule):
        self.engine, self.opts, self.rule, self.rng = engine, opts, rule, batch.rng
        self.params = params = row_sampling(params, batch, batch.cond.device)
        B = self.batch = batch.size
        spec = opts.tree_spec()
        self.layout = layout = SpecLayout.of(spec)
        extra = 2 * (layout.nodes + layout.chain_width) + 8
        self.target = s = TargetSession(engine.gpt, batch.cond, B, params.use_cfg, batch.key_mask, extra_slots=extra)
        self.draft = DraftSession(engine.drafter, s.rows, s.S, params, spec)
        self.c, self.T = s.c, s.T
        self.index = SpecIndex.of(layout, self.rng, B, s.rows, s.device, engine if opts.skip_policy == "dynamic" else None)
        self.state = self._prefill()
        # VVS-U's per-sequence schedule, followed on the host (it is a function of each sequence's own
        # rounds): rounds taken part in, and whether the last one was a skip
        self.own_rounds, self.own_skipped = [0] * B, [False] * B
        self.verifies_since_skip = 0

    # --- helpers ---------------------------------------------------------------------------------------
    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.target.rows_of(x)

    def _gather_positions(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [rows, S, D], idx [B, n] -> x at each sequence's positions [rows, n, D]."""
        r = self.rows_of(idx)
        return x.gather(1, r[:, :, None].expand(r.shape[0], r.shape[1], x.shape[2]))

    # Writes into persistent buffers are index_put_ on the buffer itself: torch.compile re-inplaces
    # those (a scatter_ would become a copy of the whole buffer).
    def _scatter_positions_(self, x: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
        """x[r, idx[r, j]] = src[r, j] for x [rows, S, D], idx [B, n] (both CFG halves)."""
        r = self.rows_of(idx.clamp(max=x.shape[1] - 1))
        x.index_put_((self.index.row_ids[: r.shape[0], None], r), src.to(x.dtype))

    def _write_out_(self, idx: torch.Tensor, tokens: torch.Tensor) -> None:
        out = self.state.out
        out.index_put_((self.index.seq_ids[: idx.shape[0], None], idx.clamp(max=out.shape[1] - 1)), tokens)

    def _count_(self, hist: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor) -> None:
        """hist[b, bins[b]] += counts[b] (the per-sequence histograms), as a one-hot add: compiled, it
        joins a kernel of the round (an accumulating index_put_ is an aten fallback, a launch of its own)."""
        one_hot = bins[:, None] == torch.arange(hist.shape[1], device=hist.device)
        hist.add_(one_hot * counts[:, None])

    # --- prefill (eager) -------------------------------------------------------------------------------
    def _prefill(self) -> DecodeState:
        s, B, dev = self.target, self.batch, self.target.device
        Dmax = self.layout.max_depth
        step = torch.full((B,), -1, dtype=torch.long, device=dev)  # round -1: before the first round
        H0 = s.prefill()  # [rows, c, D]
        root = self.rng.sample(process_logits(guided_logits(s.logits(H0[:, -1]), self.params), self.params),
                               step, Streams.SAMPLE)  # [B]
        out = torch.zeros(B, self.T + 3 * (Dmax + 1) + self.layout.chain_width, dtype=torch.long, device=dev)
        out[:, 0] = root
        feats = torch.zeros(s.rows, s.S, H0.shape[-1], dtype=H0.dtype, device=dev)
        feats[:, : s.c] = H0
        drafter_tokens = torch.cat([torch.zeros(B, s.c - 1, dtype=torch.long, device=dev), root[:, None]], 1)
        start = torch.zeros(B, dtype=torch.long, device=dev)
        h_draft = self.draft.extend(H0, drafter_tokens, start)
        length = torch.full((B,), s.c, dtype=torch.long, device=dev)
        round0 = torch.zeros(B, dtype=torch.long, device=dev)
        tree = _own_tree(self.draft.build(root, h_draft[:, -1], length, self.rng, round0))
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        st = DecodeState(out=out, n_out=torch.ones(B, dtype=torch.long, device=dev), target_len=length.clone(),
                         draft_len=length.clone(), feats=feats, tree=tree, chain_tokens=zeros(B, self.layout.chain_width),
                         chain_len=zeros(B), round=round0, status=zeros(B + 1), target_passes=zeros(B), skipped=zeros(B),
                         accepted_hist=zeros(B, Dmax + 1), skip_hist=zeros(B, Dmax + 1), rolled_back=zeros(B))
        self._update_status(st)
        return st

    def _update_status(self, st: DecodeState) -> None:
        """[committed tokens without a pending chain per sequence, sequences wanting to skip]."""
        wants = self.wants_skip(st)
        st.status.copy_(torch.cat([st.n_out - st.chain_len, wants.long().sum()[None]]))

    def wants_skip(self, st: DecodeState) -> torch.Tensor:
        """[B] bool: the sequence would take part in a skip round now (VVS). Never twice in a row (a
        pending chain), never before it has more than 5 tokens, never when finished; VVS-U: on its own
        rounds r >= 5 with r % interval == 1; VVS-D: when its tree's paths agree."""
        policy = self.opts.skip_policy
        if policy == "never":
            return torch.zeros_like(st.chain_len, dtype=torch.bool)
        can = ((st.n_out - st.chain_len) < self.T) & (st.chain_len == 0) & (st.n_out > sched.MIN_TOKENS_BEFORE_SKIP)
        if policy == "uniform":
            interval = self.opts.skip_interval
            return can & (st.round >= sched.FIRST_SKIP_ROUND) & (st.round % interval == 1) & (interval > 1)
        return can & (sched.path_similarity(st.tree, self.index.skip_codebook) >= self.opts.skip_threshold)

    # --- rounds ----------------------------------------------------------------------------------------
    def verify_round(self) -> None:
        self._take_part(lambda: self._verify(with_chain=False), skip=False)

    def verify_after_skip(self) -> None:
        """The verify round right after a skip: the skipped chain rides along, causal, for post-verification
        (a sequence without a chain verifies as in a plain verify round)."""
        self._take_part(lambda: self._verify(with_chain=True), skip=False)

    def skip_round(self) -> None:
        """VVS: commit a truncated tree path without the target; draft the next tree from stale features."""
        self._take_part(self._skip, skip=True)

    def _take_part(self, body, skip: bool) -> None:
        """Run a round for the sequences that want this kind; with a skip schedule the others sit it
        out: their per-sequence state is restored, so a sequence's rounds depend on its own state alone
        (not on its batch-mates, nor on when it was admitted)."""
        st = self.state
        if self.opts.skip_policy == "never":
            body()
            self._update_status(st)
            return
        moving = self.wants_skip(st) == skip  # [B]
        names = list(SEQUENCE_STATE) + [f for f in TREE_BUFFERS if getattr(st.tree, f) is not None]
        owner = lambda name: st.tree if name in TREE_BUFFERS else st
        saved = [getattr(owner(name), name).clone() for name in names]
        body()
        for name, old in zip(names, saved):
            buf = getattr(owner(name), name)
            rows = self.rows_of(moving) if buf.shape[0] != self.batch else moving
            buf.copy_(torch.where(rows.view(-1, *[1] * (buf.dim() - 1)), buf, old))
        self._update_status(st)

    def _verify(self, with_chain: bool) -> None:
        """A verify round in four stages: the target forward over [pending chain | tree] and the tree's
        verification; the accepted path committed; (post_verify=reject) the rollback of a rejected
        skipped chain; the drafter fed and the next tree drafted."""
        a = self.state.chain_len if with_chain else None
        H, logits, res, off, tree_start, active = self._verify_forward(a)
        step = self._commit_path(H, res, off, tree_start, active, a)
        if with_chain and self.opts.post_verify == "reject":
            step = self._roll_back(step, logits[:, :self.layout.chain_width], H, a, active)
        self._draft_next(step, active, with_chain)

    def _verify_forward(self, a):
        """One target forward per sequence over its pending chain (``a``: chain lengths, or None without
        one) and its tree, then the tree verified -> (features H [rows, Q, D], guided logits, the
        verification, the tree's first query, its root position, active [B])."""
        st, s, tree, params = self.state, self.target, self.state.tree, self.params
        B, T, Cmax = self.batch, self.T, self.layout.chain_width
        P_t = st.target_len
        if a is not None:
            tree_start = P_t + a  # the tree's root position: after the skipped chain
            active = st.n_out - a < T
            tokens = torch.cat([st.chain_tokens, tree.tokens], 1)
            positions = torch.cat([P_t[:, None] + self.index.chain_slots, tree_start[:, None] + tree.depth], 1)
            local, off = post_verify_mask(tree.mask, a, Cmax), Cmax
        else:
            tree_start = P_t
            active = st.n_out < T
            tokens, positions, local, off = tree.tokens, P_t[:, None] + tree.depth, tree.mask, 0
        positions = positions.clamp(max=self.c + T - 1)  # overrun past the last image token is discarded
        H = s.forward_per_sequence(tokens, positions, P_t, local)  # [rows, Q, D]
        logits = guided_logits(s.logits(H), params)  # [B, Q, V]
        p = process_logits(logits[:, off:], params)
        u = kernels.counter_uniform(self.rng.key, st.round, self.index.verify_streams, self.layout.nodes,
                                    self.index.node_lanes, fuse_when_compiled=True)
        u_accept, u_sample = u[:, 0], u[:, 1, 0]
        # a greedy row verifies its drafts as deterministic ones, whatever the batch-mates drew
        res = params.pick(lambda: verify_tree(replace(tree, sampled=False) if tree.sampled else tree, p, self.rule, u_accept, u_sample, True,
                                              logits=logits[:, off:], hidden=H[:B, off:], engine=self.engine),
                          lambda: verify_tree(tree, p, self.rule, u_accept, u_sample, False, logits=logits[:, off:],
                                              hidden=H[:B, off:], engine=self.engine))  # conditional rows' features
        return H, logits, res, off, tree_start, active

    def _commit_path(self, H, res, off, tree_start, active, a) -> "VerifyStep":
        """The accepted path's K/V and features moved after the chain, its tokens committed."""
        st, s = self.state, self.target
        P_t, path_slots = st.target_len, self.index.path_slots
        path, n_acc, next_token = res.path, res.n_accepted, res.next_token
        node = off + path.clamp(min=0)  # [B, Dmax + 1] query index of each accepted node
        dst = tree_start[:, None] + path_slots
        s.kv.move(self.rows_of(P_t[:, None] + node), self.rows_of(dst))  # accepted path -> after the chain
        if a is not None:  # the skipped chain's fresh features replace the stale ones it was drafted from
            self._scatter_positions_(st.feats, P_t[:, None] + self.index.chain_slots, H[:, :self.layout.chain_width])
        path_feats = self._gather_positions(H, node)
        self._scatter_positions_(st.feats, dst, path_feats)
        accepted = st.tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, Dmax]
        # Drafter pairs: (fresh feature at each accepted node, the token after it); the last is the new root.
        # They are also the committed tokens: the accepted drafts, then the next token at n_acc (slots
        # past it are rewritten by later rounds).
        pair_tokens = torch.cat([accepted, next_token[:, None]], 1).scatter(1, n_acc[:, None], next_token[:, None])
        self._write_out_(st.n_out[:, None] + path_slots, pair_tokens)
        committed = torch.where(active, n_acc + 1, 0)
        n_out = st.n_out + committed
        target_len = (P_t + torch.where(active, a, 0) if a is not None else P_t) + committed
        return VerifyStep(n_out, target_len, st.draft_len + committed, n_acc, path_feats, pair_tokens, st.draft_len,
                          n_acc, next_token)

    def _roll_back(self, step: "VerifyStep", chain_logits, H, a, active) -> "VerifyStep":
        """post_verify=reject: a sequence whose skipped chain fails its test goes back to the first
        rejected token, resampled: one drafter pair (the fresh feature there, the new token)."""
        st, P_t = self.state, self.state.target_len
        rollback, keep, token = self._check_chain(chain_logits, a, active)
        restart = st.n_out - a + keep - 1  # out index of the rejected skipped token
        self._write_out_(torch.where(rollback, restart, step.n_out + self.layout.max_depth + 1)[:, None], token[:, None])
        n_out = torch.where(rollback, restart + 1, step.n_out)
        target_len = torch.where(rollback, P_t + keep, step.target_len)
        draft_len = torch.where(rollback, P_t + keep, step.draft_len)
        chain_feat = self._gather_positions(H, (keep - 1)[:, None])
        row_rollback = self.rows_of(rollback)[:, None, None]
        pair_feats = torch.where(row_rollback, torch.cat([chain_feat, step.pair_feats[:, 1:]], 1), step.pair_feats)
        pair_tokens = torch.where(rollback[:, None], torch.cat([token[:, None], step.pair_tokens[:, 1:]], 1),
                                  step.pair_tokens)
        extend_start = torch.where(rollback, P_t + keep - 1, step.extend_start)
        root_index = torch.where(rollback, 0, step.root_index)
        root = torch.where(rollback, token, step.root)
        n_acc = torch.where(rollback, 0, step.n_acc)
        st.rolled_back.add_(rollback.long())
        return VerifyStep(n_out, target_len, draft_len, n_acc, pair_feats, pair_tokens, extend_start, root_index, root)

    def _draft_next(self, step: "VerifyStep", active, with_chain: bool) -> None:
        """The drafter eats the round's pairs; the counters and lengths advance; the next tree is drafted."""
        st = self.state
        h_draft = self.draft.extend(step.pair_feats, step.pair_tokens, step.extend_start)
        h_root = self._gather_positions(h_draft, step.root_index[:, None])[:, 0]
        counted = active.long()
        st.target_passes.add_(counted)
        self._count_(st.accepted_hist, step.n_acc, counted)
        st.n_out.copy_(step.n_out)
        st.target_len.copy_(step.target_len)
        st.draft_len.copy_(step.draft_len)
        if with_chain:  # a plain verify round follows a verify round: its chain is already empty
            st.chain_len.zero_()
        st.round.add_(1)
        _copy_tree_(st.tree, self.draft.build(step.root, h_root, step.draft_len, self.rng, st.round))

    def _check_chain(self, chain_logits, a, active):
        """post_verify=reject: test the a tokens committed unverified (chain[1:a] and the new root)
        against the chain's fresh logits. -> (rollback [B], keep [B] chain entries that stay, the
        resampled token [B])."""
        st, B, Cmax = self.state, self.batch, self.layout.chain_width
        j = torch.arange(Cmax, device=self.target.device)
        skipped = torch.where(j[None] + 1 < a[:, None], st.chain_tokens.roll(-1, 1), st.tree.tokens[:, :1])
        p = process_logits(chain_logits, self.params)  # [B, Cmax, V]
        u = self.rng.uniform(st.round, Streams.CHAIN, (Cmax + 1,))
        def sampled_test():
            passed, _ = self.rule.accept(p.flatten(0, 1), skipped.flatten(), torch.ones(B * Cmax, device=self.target.device),
                                         u[:, :Cmax].flatten(), None)
            return passed.view(B, Cmax)

        ok = self.params.pick(lambda: p.argmax(-1) == skipped, sampled_test)
        bad = ~ok & (j[None] < a[:, None])
        rollback = bad.any(1) & active
        k = torch.where(bad, j[None], Cmax - 1).min(1).values  # first rejected chain position
        p_k = p.gather(1, k[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]
        residual = self.rule.residual(p_k, None, skipped.gather(1, k[:, None])[:, 0], None)
        token = self.params.pick(lambda: residual.argmax(-1), lambda: sample_inverse_cdf(residual, u[:, Cmax]))
        return rollback, k + 1, token

    def _skip(self) -> None:
        st, tree = self.state, self.state.tree
        B, Dmax = self.batch, self.layout.max_depth
        active = st.n_out < self.T
        choice = self._select_path(tree)  # [B] leaf node
        leaf = tree.is_leaf
        mean_len = ((tree.depth + 1) * leaf).sum(1) // leaf.sum(1)  # floor of the mean path length, root incl.
        a = torch.minimum(tree.depth.gather(1, choice[:, None])[:, 0], mean_len - 1).clamp(min=1)  # truncation
        path = tree.paths.gather(1, choice[:, None, None].expand(B, 1, Dmax + 1))[:, 0]  # [B, Dmax + 1]
        drafted = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # path[a] is the next root
        self._write_out_(st.n_out[:, None] + self.index.path_slots[:Dmax], drafted)
        committed = torch.where(active, a, 0)
        st.chain_tokens.copy_(tree.tokens.gather(1, path.clamp(min=0)))  # old root + a - 1 drafts: no KV yet
        st.chain_len.copy_(committed)
        # Stale features: the a most recent cached target features ("latest"), or the last one repeated.
        if self.opts.feature_reuse == "latest":
            positions = ((st.target_len - a)[:, None] + self.index.path_slots[:Dmax]).clamp(min=0)
        else:
            positions = (st.target_len - 1)[:, None].expand(B, Dmax)
        h_draft = self.draft.extend(self._gather_positions(st.feats, positions), drafted, st.draft_len)
        h_root = self._gather_positions(h_draft, (a - 1)[:, None])[:, 0]
        root = tree.tokens.gather(1, path.gather(1, a[:, None]))[:, 0]
        st.skipped.add_(active.long())
        self._count_(st.skip_hist, a, active.long())
        st.n_out.add_(committed)
        st.draft_len.add_(committed)
        st.round.add_(1)
        _copy_tree_(st.tree, self.draft.build(root, h_root, st.draft_len, self.rng, st.round))

    def _select_path(self, tree: DraftTree) -> torch.Tensor:
        """A root-to-leaf path per sequence: uniform over leaves (VVS default), or the most confident."""
        leaf = tree.is_leaf
        if self.opts.select == "random":
            score = kernels.counter_uniform(self.rng.key, self.state.round, self.index.skip_stream, tree.n,
                                            self.index.node_lanes, fuse_when_compiled=True)[:, 0]
            score = score.to(torch.float64)
        else:  # confidence: highest cumulative draft log-prob along the path
            lp = tree.draft_logp if tree.draft_logp is not None else torch.zeros(leaf.shape, device=leaf.device)
            on_path = tree.paths >= 0
            B, N, W = tree.paths.shape
            score = (lp.gather(1, tree.paths.clamp(min=0).flatten(1)).view(B, N, W) * on_path).sum(2)
        return torch.where(leaf, score, torch.full_like(score, -float("inf"))).argmax(1)

    # --- the decoder protocol of runtime.loop ----------------------------------------------------------
    def round_functions(self) -> dict:
        rounds = {"verify": self.verify_round}
        if self.opts.skip_policy != "never":
            rounds.update(verify_after_skip=self.verify_after_skip, skip=self.skip_round)
        return rounds

    def round_buffers(self) -> list:
        return self.state.buffers()

    def status(self) -> torch.Tensor:
        return self.state.status

    def next_kind(self, last_kind, late) -> str:
        """Verify, unless the skip schedule says most sequences want to skip. After a skip always a
        verify round with the chains (post-verification). VVS-U: the host follows each sequence's own
        schedule exactly; VVS-D: from the late count of sequences wanting to skip (the device decides
        per sequence whether it takes part, so this choice changes no token, only who waits)."""
        policy = self.opts.skip_policy
        if policy == "never":
            return "verify"
        if last_kind == "skip":
            kind = "verify_after_skip"
        elif policy == "uniform":
            wants = [self._uniform_wants(r) for r in range(self.batch)]
            kind = "skip" if 2 * sum(wants) >= self.batch and any(wants) else "verify"
        else:
            live = sum(n < self.T for n in late[:-1]) if late is not None else 0
            wanting = late[-1] if late is not None else 0
            kind = "skip" if wanting and (2 * wanting >= live or self.verifies_since_skip >= 2) else "verify"
        if policy == "uniform":  # the sequences that take part advance their own schedule
            for r in range(self.batch):
                if self._uniform_wants(r) == (kind == "skip"):
                    self.own_rounds[r] += 1
                    self.own_skipped[r] = kind == "skip"
        self.verifies_since_skip = 0 if kind == "skip" else self.verifies_since_skip + 1
        return kind

    def _uniform_wants(self, r: int) -> bool:
        """VVS-U's choice for sequence r (``wants_skip``'s uniform rule, followed on the host)."""
        n, interval = self.own_rounds[r], self.opts.skip_interval
        return not self.own_skipped[r] and n >= sched.FIRST_SKIP_ROUND and interval > 1 and n % interval == 1

    def declare_rows(self, table) -> None:
        """Target and drafter caches, keys, settings, the state and the tree (drafter features are per
        model row, the rest per sequence), and the host's VVS-U schedule of each sequence."""
        self.target.declare_rows(table)
        self.params.declare_rows(table)
        table.add("draft_k", self.draft.kv.k, dim=1, model_rows=True)
        table.add("draft_v", self.draft.kv.v, dim=1, model_rows=True)
        table.add("rng_key", self.rng.key)
        st = self.state
        for name in SEQUENCE_STATE + ("out", "status"):
            table.add(name, getattr(st, name))
        table.add("feats", st.feats, model_rows=True)
        for name in TREE_BUFFERS:
            buf = getattr(st.tree, name)
            if buf is not None:
                table.add("tree_" + name, buf, model_rows=name == "draft_feats")
        table.add("own_rounds", self.own_rounds)
        table.add("own_skipped", self.own_skipped)

    def rows_written(self, rows: torch.Tensor) -> None:
        """Rows took other images: the status's last entry (sequences wanting to skip) follows them."""
        self._update_status(self.state)

    def start_run(self) -> None:
        """A new run on this (persistent) decoder: the VVS-D round choice starts afresh."""
        self.verifies_since_skip = 0

    def finish_results(self, out: dict) -> dict:
        out["tokens"] = out.pop("out")
        out["passes"] = out.pop("target_passes")
        out["rounds"] = out["passes"] + out["skipped"]
        return out

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        acc_hist = counters["accepted_hist"].sum(0)
        skip_hist = counters["skip_hist"].sum(0)
        verified = int(acc_hist.sum())
        depth_rate = {}
        if verified:
            longest = int(torch.nonzero(acc_hist).max())
            for d in range(1, longest + 2):
                depth_rate[str(d)] = float(acc_hist[d:].sum()) / verified
        lengths = torch.arange(acc_hist.shape[0], dtype=torch.float64)
        return {
            "target_forward_passes": verified,
            "verified_steps": verified,
            "skip_steps": int(skip_hist.sum()),
            "mean_accepted_length": float((acc_hist * lengths).sum() / verified + 1) if verified else 0.0,
            "acceptance_rate_by_depth": depth_rate,
            "tokens_committed_unverified": int((skip_hist * torch.arange(skip_hist.shape[0])).sum()),
            "staleness_histogram": {str(i): int(c) for i, c in enumerate(skip_hist.tolist()) if c},
            "post_verify_rollbacks": int(counters["rolled_back"].sum()),
        }


def post_verify_mask(tree_mask: torch.Tensor, chain_len: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width + N]^2 local masks: a causal valid chain (first ``chain_len[b]`` of ``width`` slots),
    padded chain slots that see only themselves, and the tree seeing the valid chain plus its own
    ancestor mask."""
    B, N, _ = tree_mask.shape
    dev = tree_mask.device
    j = torch.arange(width, device=dev)
    valid = j[None] < chain_len[:, None]  # [B, width]
    chain = ((j[None, :] <= j[:, None])[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=dev)
    top = torch.cat([chain, torch.zeros(B, width, N, dtype=torch.bool, device=dev)], 2)
    bottom = torch.cat([valid[:, None, :].expand(B, N, width), tree_mask], 2)
    return torch.cat([top, bottom], 1)
