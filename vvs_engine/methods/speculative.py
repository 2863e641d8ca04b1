"""The draft -> (skip | verify) loop shared by EAGLE, LANTERN(++), VVS and CASCADE.

One image at a time (batch 1, both CFG rows), gpt-fast style: static caches, device-side lengths.

    prefill target; root ~ p; drafter eats the condition features; tree = draft(root)
    loop:
      if schedule says skip:                          # VVS, no target forward
          commit a truncated random tree path unverified; its last token becomes the root;
          drafter eats stale cached target features; tree = draft(root)
      else:                                           # verify (with the pending chain, if any)
          one target forward over [pending chain | tree]; p = processed target distributions
          accept a path with the rule; next token from the residual; compact KV; cache features
          drafter eats the fresh features; tree = draft(next)

The only host read per round is the committed-token count (termination and VVS's "not in the first
5 tokens" rule), and on CUDA it is read one round late (``LateRead``) so the GPU never waits for the
host; a round that runs after the image is complete writes into slack slots and is discarded.
VVS-D's similarity decision and ``post_verify=reject`` each add one synchronous read per round.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..acceptance.verify import VerifyResult, default_lantern_k, make_rule, verify_tree
from ..kernels import gather_rows, scatter_rows_
from ..drafting.session import DraftSession, TreeSpec
from ..errors import VVSError
from ..runtime.profiling import nvtx_range
from ..sampling import guided_logits, process_logits, sample
from ..runtime.target import TargetSession
from ..drafting.tree import STATIC_TREES
from .common import MethodResult, progress
from .options import option
from . import schedule as sched


@dataclass
class SpecOptions:
    accept: Optional[str] = option(None, "acceptance rule: exact, lantern, lantern++, gsd or cascade")
    lantern_k: Optional[int] = option(None, "LANTERN: codebook neighbours k; default codebook size // 16")
    lantern_delta: float = option(0.2, "LANTERN: total-variation budget delta per step")
    lantern_lambda: float = option(2.0, "LANTERN++: cap lambda on the relaxed mass (<= lambda * p(x))")
    lantern_reference_residual: str = option("off", "LANTERN: off, or llamagen / lumina-mgpt to reproduce that "
                                                    "family's released residual and greedy test")
    tree: Optional[str] = option(None, "draft tree: dynamic (EAGLE-2), static (naive_extend_57) or chain")
    tree_total: int = option(59, "dynamic tree: nodes including the root")
    tree_depth: int = option(4, "dynamic tree: expansion steps (levels = depth + 1); chain length")
    tree_topk: int = option(10, "dynamic tree: children per expanded node")
    static_tree: str = "naive_extend_57"
    skip_policy: str = option("never", "VVS: never, uniform (skip every interval-th round) or dynamic "
                                       "(skip when the draft paths agree)")
    skip_interval: int = option(2, "VVS uniform: skip when step % interval == 1 (1 = never)")
    skip_threshold: float = option(0.65, "VVS dynamic: path-agreement threshold in [-1, 1]")
    select: str = option("random", "VVS: tree path a skipped round commits: random or confidence")
    post_verify: str = option("fill", "VVS: skipped chain at the next verification: fill (keep) or reject "
                                      "(roll back to the first rejected token)")
    feature_reuse: str = "latest"  # latest | repeat
    rule_options: dict = field(default_factory=dict)  # extra options for registered rules
    # GSD's grouped rule under any drafter-based method (--accept gsd); None = the rule's default
    gsd_group: Optional[int] = option(None, "GSD: group size G (tokens that may share a draft's acceptance)")
    gsd_prob_threshold: Optional[float] = option(None, "GSD: keep a group member j only if |p(j) - p(x)| < this")
    gsd_dist_threshold: Optional[float] = option(None, "GSD: ... and its squared distance to x on the unit "
                                                       "codebook < this")
    gsd_window_edge: Optional[str] = option(None, "GSD: shorten, or sjd (the released code's plain SJD ratio "
                                                  "when the window falls off the lowest ranks)")

    def validate(self):
        if self.tree not in (None, "dynamic", "static", "chain"):
            raise VVSError(f"tree must be dynamic, static or chain, got '{self.tree}'")
        for name in ("tree_total", "tree_depth", "tree_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise VVSError(f"{name.replace('_', '-')} must be an integer >= 1, got {v}")
        if self.tree_total < 2:
            raise VVSError("tree-total must be >= 2 (root + one draft)")
        if self.static_tree not in STATIC_TREES:
            raise VVSError(f"unknown static tree '{self.static_tree}'; known: {', '.join(STATIC_TREES)}")
        d = self.lantern_delta
        if not isinstance(d, (int, float)) or math.isnan(d) or not 0 <= d <= 1:
            raise VVSError(f"lantern-delta must be in [0, 1], got {d}")
        lam = self.lantern_lambda
        if not isinstance(lam, (int, float)) or math.isnan(lam) or lam < 1:
            raise VVSError(f"lantern-lambda must be >= 1, got {lam}")
        if self.lantern_k is not None and (isinstance(self.lantern_k, bool) or not isinstance(self.lantern_k, int)
                                           or self.lantern_k < 1):
            raise VVSError(f"lantern-k must be an integer >= 1, got {self.lantern_k}")
        from ..acceptance.verify import check_lantern_reference

        self.lantern_reference_residual = check_lantern_reference(self.lantern_reference_residual)
        if self.skip_policy not in ("never", "uniform", "dynamic"):
            raise VVSError(f"skip-policy must be uniform or dynamic, got '{self.skip_policy}'")
        i = self.skip_interval
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise VVSError(f"skip-interval must be an integer >= 1, got {i}")
        s = self.skip_threshold
        if not isinstance(s, (int, float)) or math.isnan(s) or not -1 <= s <= 1:
            raise VVSError(f"skip-threshold must be in [-1, 1], got {s}")
        if self.select not in ("random", "confidence"):
            raise VVSError(f"select must be random or confidence, got '{self.select}'")
        if self.post_verify not in ("fill", "reject"):
            raise VVSError(f"post-verify must be fill or reject, got '{self.post_verify}'")
        if self.feature_reuse not in ("latest", "repeat"):
            raise VVSError(f"feature-reuse must be latest or repeat, got '{self.feature_reuse}'")
        return self

    def check_engine(self, engine):
        if engine.drafter is None:
            raise VVSError("this method needs a drafter (--drafter PATH, or use the Zoo model)")

    def tree_spec(self) -> TreeSpec:
        return TreeSpec(self.tree or "dynamic", self.tree_total, self.tree_depth, self.tree_topk, self.static_tree)


def run(engine, cond, key_mask, n, params, gen, opts: SpecOptions, show_progress=False) -> MethodResult:
    gsd_keys = ("gsd_group", "gsd_prob_threshold", "gsd_dist_threshold", "gsd_window_edge")
    if opts.accept == "gsd":
        gsd = {k: getattr(opts, k) for k in gsd_keys if getattr(opts, k) is not None}
        opts.rule_options = {**gsd, **opts.rule_options}
    elif any(getattr(opts, k) is not None for k in gsd_keys):
        raise VVSError("--gsd-* options need --accept gsd (or --method gsd)")
    rule = make_rule(opts.accept or "exact", engine,
                     lantern_k=opts.lantern_k or default_lantern_k(_codebook(engine)),
                     lantern_delta=opts.lantern_delta, lantern_lambda=opts.lantern_lambda,
                     reference_residual=opts.lantern_reference_residual, **opts.rule_options)
    out, st = [], Stats()
    for i in progress(range(n), show_progress, "images"):
        idx = torch.tensor([i, i + n] if params.use_cfg else [i], device=cond.device)
        c_i = cond.index_select(0, idx)
        km = key_mask.index_select(0, idx) if key_mask is not None else None
        out.append(decode_one(engine, c_i, km, params, gen, opts, rule, st))
    return MethodResult(torch.stack(out), st.summary(n, engine.tokens_per_image))


def _codebook(engine):
    return engine.vq.config.codebook_size if engine.vq is not None else engine.config.vocab_size


class Stats:
    def __init__(self):
        self.verified = 0
        self.skipped = 0
        self.accepted = []  # device [1] tensors: accepted drafts per verified round
        self.skip_lengths = []  # device [1] tensors: tokens committed unverified per skip
        self.t = {"draft": 0.0, "verify": 0.0, "accept": 0.0}
        self.rolled_back = 0

    def summary(self, n, T):
        acc = torch.cat(self.accepted).cpu() if self.accepted else torch.zeros(0, dtype=torch.long)
        depth_rate = {}
        if acc.numel():
            for d in range(1, int(acc.max()) + 2):
                depth_rate[str(d)] = float((acc >= d).float().mean())
        # A skip that commits a tokens feeds the drafter features a positions older than fresh ones.
        skips = torch.cat(self.skip_lengths).cpu() if self.skip_lengths else torch.zeros(0, dtype=torch.long)
        hist = {str(int(v)): int(c) for v, c in zip(*torch.unique(skips, return_counts=True))}
        return {
            "target_forward_passes": self.verified,
            "verified_steps": self.verified,
            "skip_steps": self.skipped,
            "mean_accepted_length": float(acc.float().mean() + 1) if acc.numel() else 0.0,
            "acceptance_rate_by_depth": depth_rate,
            "tokens_committed_unverified": int(skips.sum()),
            "staleness_histogram": hist,
            "post_verify_rollbacks": self.rolled_back,
            "time_split_s": {k: round(v, 4) for k, v in self.t.items()},
        }


class LoopState:
    """Device-side state of one image's decode: caches, lengths, the current tree, a pending chain."""

    def __init__(self, engine, cond, key_mask, params, o: SpecOptions, gen):
        dev = engine.device
        spec = o.tree_spec()
        self.N = spec.max_nodes
        if spec.kind == "dynamic":
            self.Dmax = spec.depth + 1
        elif spec.kind == "chain":
            self.Dmax = spec.depth
        else:
            from ..drafting.tree import static_layout

            self.Dmax = static_layout(STATIC_TREES[spec.static_name](), "cpu")["max_depth"]
        self.Cmax = self.Dmax + 1  # a pending chain: old root + up to Dmax - 1 drafts (+ slack)
        extra = 2 * (self.N + self.Cmax) + 8
        if getattr(engine, "cuda_graphs", False):  # static buffers replayed as CUDA graphs
            from ..runtime.runner import get_runner

            r = get_runner(engine.gpt, cond, 1, params.use_cfg, key_mask, params, use_graphs=True,
                           extra_slots=extra, drafter=engine.drafter, tree_spec=spec,
                           target_q=(self.N, self.Cmax + self.N), extend_m=(self.Dmax, self.Dmax + 1))
            self.s = s = r.session
            self.ds = r.draft
        else:
            self.s = s = TargetSession(engine.gpt, cond, 1, params.use_cfg, key_mask, extra_slots=extra)
            self.ds = DraftSession(engine.drafter, s.rows, s.S, params, spec)
        self.c, self.T, self.dev = s.c, s.T, dev
        with nvtx_range("prefill"):
            H0 = s.prefill()  # [rows, c, D]
            root = sample(process_logits(guided_logits(s.logits(H0[:, -1]), params), params), gen)  # [1]
        self.out = torch.zeros(self.T + 2 * self.Cmax + self.N, dtype=torch.long, device=dev)
        self.out[:1] = root
        self.n_out = torch.ones(1, dtype=torch.long, device=dev)  # tokens in out (chain + root included)
        self.P_t = torch.full((1,), s.c, dtype=torch.long, device=dev)  # target KV length
        self.feats = torch.zeros(s.rows, s.S, H0.shape[-1], dtype=H0.dtype, device=dev)  # target features
        self.feats[:, : s.c] = H0
        with nvtx_range("draft"):
            dtok = torch.cat([torch.zeros(s.c - 1, dtype=torch.long, device=dev), root])
            hd = self.ds.extend(H0, dtok, torch.zeros(1, dtype=torch.long, device=dev))
            self.P_d = self.P_t.clone()  # drafter length (= P_t + pending chain length)
            self.tree = self.ds.build(root, hd[:, -1], self.P_d, gen)
        self.pending = None  # (chain tokens [Cmax], length [1]) awaiting post-verification

    def ar(self, k):
        return torch.arange(k, device=self.dev)


class LateRead:
    """Host view of a device counter. On CUDA it is read one round late (copy to pinned memory +
    event), so the host never stalls the GPU; on the CPU it is read at once."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.buf = torch.zeros(1, dtype=torch.long, pin_memory=self.cuda)
        self.event = None
        self.value = 0

    def push(self, t: torch.Tensor) -> int:
        if not self.cuda:
            self.value = int(t)
            return self.value
        if self.event is not None:
            self.event.synchronize()
            self.value = int(self.buf)
        self.buf.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        return self.value


def decode_one(engine, cond, key_mask, params, gen, o: SpecOptions, rule, st: Stats) -> torch.Tensor:
    t0 = time.perf_counter()
    L = LoopState(engine, cond, key_mask, params, o, gen)
    st.t["draft"] += time.perf_counter() - t0
    schedule = sched.make(o, engine)
    committed = LateRead(L.dev)
    step, last_skip = 0, False
    while committed.push(L.n_out) < L.T:  # one (late on CUDA) host read per round
        if schedule.skip(step, committed.value, last_skip, L.tree):
            with nvtx_range("skip"):
                skip_round(L, o, gen, st)
            last_skip = True
        else:
            verify_round(L, o, params, rule, gen, engine, st)
            last_skip = False
        step += 1
    if DEBUG_HOOK is not None:  # tests inspect the final caches
        DEBUG_HOOK(session=L.s, out=L.out, n_out=L.n_out, P_t=L.P_t, pending=L.pending, feats=L.feats)
    return L.out[: L.T]


DEBUG_HOOK = None


def skip_round(L: LoopState, o: SpecOptions, gen, st: Stats) -> None:
    """VVS: commit a truncated tree path without the target; draft the next tree from stale features."""
    t0 = time.perf_counter()
    tree, Dmax = L.tree, L.Dmax
    b = _select_path(tree, o.select, gen)
    leaf = tree.is_leaf
    mean_len = ((tree.depth + 1) * leaf).sum() // leaf.sum()  # floor of the mean path length, root incl.
    a = torch.minimum(tree.depth[b], mean_len - 1).clamp(min=1).reshape(1)  # dynamic truncation
    path = tree.paths[b]  # [Dmax + 1]
    drafted = tree.tokens[path[1:].clamp(min=0)]  # path[a] is the next root
    L.out.index_copy_(0, L.n_out + L.ar(Dmax), drafted)
    L.n_out = L.n_out + a
    L.pending = (tree.tokens[path.clamp(min=0)], a)  # old root + a - 1 drafts: no target KV yet
    # Stale features: the a most recent cached target features ("latest"), or the last one repeated.
    if o.feature_reuse == "latest":
        fidx = (L.P_t - a + L.ar(Dmax)).clamp(min=0)
    else:
        fidx = (L.P_t - 1).expand(Dmax)
    hd = L.ds.extend(gather_rows(L.feats, fidx), drafted, L.P_d)
    h_root = hd.index_select(1, a - 1)[:, 0]
    L.P_d = L.P_d + a
    L.tree = L.ds.build(tree.tokens[path[a]], h_root, L.P_d, gen)
    st.skipped += 1
    st.skip_lengths.append(a)
    st.t["draft"] += time.perf_counter() - t0


def _verify_one(tree, p, rule, gen, greedy, logits, hidden, engine):
    """The batched verify_tree on this single-image loop's tree (B = 1 views; uniforms from ``gen``)."""
    batched = dataclasses.replace(tree, tokens=tree.tokens[None], parents=tree.parents[None],
                                  depth=tree.depth[None], paths=tree.paths[None], children=tree.children[None],
                                  q=None if tree.q is None else tree.q[None],
                                  draft_logits=None if tree.draft_logits is None else tree.draft_logits[None])
    u_accept = 1.0 - torch.rand(1, tree.n, device=p.device, generator=gen)  # (0, 1]
    u_sample = 1.0 - torch.rand(1, device=p.device, generator=gen)
    res = verify_tree(batched, p[None], rule, u_accept, u_sample, greedy, logits=logits[None], hidden=hidden,
                      engine=engine)
    return VerifyResult(res.path[0], res.n_accepted, res.last, res.next_token)


def verify_round(L: LoopState, o: SpecOptions, params, rule, gen, engine, st: Stats) -> None:
    """One target forward over [pending chain | tree]; accept a path; compact; redraft."""
    t0 = time.perf_counter()
    s, tree, Dmax, Cmax = L.s, L.tree, L.Dmax, L.Cmax
    with nvtx_range("verify"):
        if L.pending is not None:  # post-verification: the skipped chain rides along, causal
            chain, a = L.pending
            toks = torch.cat([chain, tree.tokens])
            pos = torch.cat([L.P_t + L.ar(Cmax), L.P_t + a + tree.depth])
            local, off = _post_verify_mask(tree.mask, a, Cmax), Cmax
        else:
            a = torch.zeros(1, dtype=torch.long, device=L.dev)
            toks, pos, local, off = tree.tokens, L.P_t + tree.depth, tree.mask, 0
        pos = pos.clamp(max=L.c + L.T - 1)  # overrun past the last image token is discarded anyway
        H = s.forward(toks[None], pos, L.P_t, local)  # [rows, Q, D]
        logits = guided_logits(s.logits(H), params)[0]  # [Q, V]
        p = process_logits(logits[off:], params)
    st.t["verify"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    with nvtx_range("accept"):
        if L.pending is not None and o.post_verify == "reject":
            k, drafted = _check_chain(logits[:off], params, rule, chain, a, tree, gen)
            if k is not None:  # a skipped token was rejected: roll back to it
                _rollback(L, H, logits, params, gen, drafted, a, k, rule)
                L.pending = None
                st.verified += 1
                st.rolled_back += 1
                st.accepted.append(torch.zeros(1, dtype=torch.long, device=L.dev))
                st.t["accept"] += time.perf_counter() - t0
                return
        res = _verify_one(tree, p, rule, gen, params.greedy, logits[off:], H[:1, off:], engine)
        path, n_acc = res.path, res.n_accepted
        node = off + path.clamp(min=0)
        dst = L.P_t + a + L.ar(Dmax + 1)
        s.kv.move(L.P_t + node, dst)  # accepted path -> contiguous slots after the chain
        if L.pending is not None:  # the skipped chain's fresh features replace nothing: they are new
            scatter_rows_(L.feats, (L.P_t + L.ar(Cmax)).clamp(max=s.S - 1), H[:, :Cmax])
        scatter_rows_(L.feats, dst.clamp(max=s.S - 1), gather_rows(H, node))
        L.out.index_copy_(0, L.n_out + L.ar(Dmax), tree.tokens[path[1:].clamp(min=0)])
        L.out.index_copy_(0, L.n_out + n_acc, res.next_token)
        L.n_out = L.n_out + n_acc + 1
        L.P_t = L.P_t + a + n_acc + 1
    st.t["accept"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    with nvtx_range("draft"):
        # Drafter pairs (fresh f at each accepted node, the token after it); the last is the new root.
        nxt = torch.cat([tree.tokens[path[1:].clamp(min=0)], res.next_token]).index_copy(0, n_acc, res.next_token)
        hd = L.ds.extend(H[:, node], nxt, L.P_d)
        L.P_d = L.P_d + n_acc + 1
        L.tree = L.ds.build(res.next_token, hd.index_select(1, n_acc)[:, 0], L.P_d, gen)
    st.t["draft"] += time.perf_counter() - t0
    st.verified += 1
    st.accepted.append(n_acc)
    L.pending = None


def _select_path(tree, how, gen):
    """A root-to-leaf path: uniform over leaves (VVS default), or the most confident one."""
    leaf = tree.is_leaf
    if how == "random":
        score = torch.rand(leaf.shape, device=leaf.device, generator=gen)
    else:  # confidence: highest cumulative draft log-prob along the path
        lp = tree.draft_logp if tree.draft_logp is not None else torch.zeros(leaf.shape, device=leaf.device)
        score = torch.where(tree.paths >= 0, lp[tree.paths.clamp(min=0)], torch.zeros_like(lp[tree.paths.clamp(min=0)])).sum(1)
    return torch.where(leaf, score, torch.full_like(score, -float("inf"))).argmax()


def _post_verify_mask(tree_mask, a, Cmax):
    """[Cmax + N]^2 local mask: a causal valid chain (first a of Cmax slots), padded chain slots that
    see only themselves, and the tree seeing the valid chain plus its own ancestor mask."""
    N = tree_mask.shape[0]
    dev = tree_mask.device
    j = torch.arange(Cmax, device=dev)
    valid = j < a
    chain = (j[None, :] <= j[:, None]) & valid[None, :]
    chain = chain | torch.eye(Cmax, dtype=torch.bool, device=dev)
    top = torch.cat([chain, torch.zeros(Cmax, N, dtype=torch.bool, device=dev)], 1)
    bottom = torch.cat([valid[None, :].expand(N, Cmax), tree_mask], 1)
    return torch.cat([top, bottom], 0)


def _check_chain(chain_logits, params, rule, chain, a, tree, gen):
    """post_verify=reject: test the skipped tokens (chain[1:a] and the new root = tree root) with the
    rule against the chain's own logits. Returns the first rejected chain index, or None."""
    A = int(a)
    drafted = torch.cat([chain[1:A], tree.tokens[:1]])  # the a tokens committed unverified
    p = process_logits(chain_logits[:A], params)
    u = torch.rand(A, device=p.device, generator=gen)
    ok, _ = rule.accept(p, drafted, torch.ones(A, device=p.device), u, None)
    if params.greedy:
        ok = p.argmax(-1) == drafted
    bad = (~ok).nonzero()
    return (None, drafted) if bad.numel() == 0 else (int(bad[0, 0]), drafted)


def _rollback(L: LoopState, H, logits, params, gen, drafted, a, k, rule) -> None:
    """drafted[k] (predicted at chain position k) was rejected: keep chain[:k+1] (their KV is valid),
    resample that token from the residual, and redraft from there."""
    A = int(a)
    p = process_logits(logits[k:k + 1], params)
    r = rule.residual(p, None, drafted[k:k + 1], None)
    tok = r.argmax(-1) if params.greedy else sample(r, gen)
    keep = k + 1  # chain entries 0..k stay committed
    start = L.n_out - A + k  # out index of drafted[k]; later skipped tokens are dropped
    L.out.index_copy_(0, start, tok)
    L.n_out = start + 1
    scatter_rows_(L.feats, L.P_t + L.ar(keep), H[:, :keep])
    L.P_t = L.P_t + keep
    hd = L.ds.extend(H[:, k:k + 1], tok, L.P_t - 1)  # pair (fresh f at chain position k, tok)
    L.P_d = L.P_t.clone()
    L.tree = L.ds.build(tok, hd[:, 0], L.P_d, gen)
