"""SJD-PAC: speculative Jacobi decoding with proactive drafting and adaptive continuation (Kang, Shu, Li,
Zhai, Chen, CVPR 2026, arXiv 2603.18599), in an exact variant and in the released (biased) one; the
full account, with the released sampler's departures, is docs/jacobi.md "SJD-PAC".

Each forward runs a fixed *product tree* of L nodes (``drafting.product_tree.ProductTree``): a main
chain of M nodes and, at depths 1..D-1, a complete W-ary tree below the root whose node of branch b at
depth d shows entry C[b, d] of a candidate table with one declared law Q[d] per depth (candidate 0 a
sample of Q[d], the others draws without replacement from it). One exact iteration: (1) the engine's
tree verifier (``acceptance.verify.verify_tree``) commits A tokens + a new root; (2) adaptive
continuation (SCD's maximal coupling) keeps or resamples the stale candidates, a sample of the stale
target P_d either way; (3) proactive drafting draws the alternatives from P_d without replacement
(Gumbel top-k), so the new table's law is exactly what the verifier assumes. ``--pac-variant released``
reproduces the published sampler (longest passing path, all-siblings residual, alternatives from the
residual).

KV: the nodes' K/V go to scratch slots and the accepted path moves to the row's slots. The iteration
has static shapes and no host read, and every random number comes from the counter RNG keyed by image
and the image's own iteration, so tokens do not depend on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels
from ..acceptance.verify import ExactRule, verify_tree
from ..drafting.product_tree import ProductTree, tree_size
from ..errors import VVSError
from ..rng import sample_inverse_cdf_one_pass
from ..sampling import value_at
from .registry import register
from .common import DecodeBatch, RowState
from .jacobi import JacobiDecoder, SJDOptions, gumbel, one_hot, random_step
from .options import check_int, option

PAC_VARIANTS = ("exact", "released")
PAC_STREAM = 17  # acceptance / residual / fresh uniforms of an iteration (counter RNG, step = iteration)
PAC_GUMBEL_STREAM = 18  # Gumbel noise of the alternative candidates (step = iteration)


@dataclass
class SJDPACOptions(SJDOptions):
    # L counts every tree node (the forward's query rows, as released); 32 leaves the chain 28 of them at
    # W = 2, D = 3 (22 at W = D = 3; 16 would leave 6: benchmarks/studies/scd_pac_zoo/scd_pac_zoo.md).
    # W = 2: the fastest width at AR parity on the Zoo (TPF 3.80 against 3.74 at W = 3 and 3.40 at W = 4, 512 images:
    # benchmarks/results/quality_speed.md). copy-left as SJD: on the Zoo it beats the released uniform
    # init (random), which is kept as the option with distinct initial candidates.
    jacobi_window: int = 32  # help: SJDOptions'
    pac_width: int = option(2, "SJD-PAC: candidates per tree depth W (proactive drafting)")
    pac_depth: int = option(3, "SJD-PAC: tree depth D counting the root (depths 1..D-1 get W candidates; "
                               "the jacobi-window L counts every tree node)")
    pac_variant: str = option("exact", "SJD-PAC: exact, or released (the published sampler: longest path, "
                                       "all-siblings residual on stale tree columns, alternatives from the "
                                       "residual; biased)")

    def validate(self):
        super().validate()
        check_int("pac-width", self.pac_width, 1, 64)
        check_int("pac-depth", self.pac_depth, 1, 64)
        if self.pac_variant not in PAC_VARIANTS:
            raise VVSError(f"pac-variant must be exact or released, got {self.pac_variant!r}")
        n = tree_size(self.pac_width, self.pac_depth)
        if n > self.jacobi_window:
            raise VVSError(f"pac-width {self.pac_width} and pac-depth {self.pac_depth} make a tree of {n} nodes; "
                           f"jacobi-window must be at least that (got {self.jacobi_window})")
        return self

    def jacobi_positions(self) -> int:
        """Image positions one forward covers: the main chain M (the side nodes repeat depths 1..D-1)."""
        return self.jacobi_window - (tree_size(self.pac_width, self.pac_depth) - self.pac_depth)

    def check_engine(self, engine):
        super().check_engine(engine)
        if self.pac_width > engine.config.vocab_size:
            raise VVSError(f"pac-width {self.pac_width} exceeds the vocabulary of {engine.config.vocab_size} tokens")


@dataclass
class PACState(RowState):
    """Device state of a batched SJD-PAC decode (static shapes, updated in place)."""

    cand: torch.Tensor  # [B, W, M] candidate table; cand[:, 0, 0] is the root (last committed token)
    cand_valid: torch.Tensor  # [B, W, M] bool: candidate exists (alternatives past Q's support do not)
    table_q: torch.Tensor  # [B, M, V] Q[d]: the law the depth-d candidates were drawn from (row 0 unused)
    fresh: torch.Tensor  # [B, M] bool: depth d holds fresh initialisations, not carried candidates
    tokens: torch.Tensor  # [B, T + 2L]
    n_committed: torch.Tensor  # [B]
    passes: torch.Tensor  # [B] (+ 1: the random-number step, ``jacobi.random_step``)
    accepted_hist: torch.Tensor  # [B, L]
    accepted_carried: torch.Tensor  # [B]
    accepted_alternatives: torch.Tensor  # [B] accepted tree nodes of branch >= 1


@dataclass
class _Forest:
    """The batched tree ``verify_tree`` reads: tokens [B, N], children [B, N, W], q [B, N, V]."""

    tokens: torch.Tensor
    children: torch.Tensor
    q: torch.Tensor
    max_depth: int
    sampled: bool = True


def top_few(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1)`` -> (indices, values) for a small k, as k rounds of max + arg-max, each
    masking the winner. Compiled, the rounds are reductions Inductor fuses into one kernel with their
    producer and consumers; ``topk`` is an aten fallback of its own (one more launch per Jacobi
    iteration). The same selection as ``topk`` for distinct values (Gumbel-perturbed logits: ties have
    probability zero); among equal values the lowest index wins, and a row of -inf gives -inf values
    (which callers treat as no candidate)."""
    if k > 4:  # k reductions in a row stop paying for themselves
        top = x.topk(k, dim=-1)
        return top.indices, top.values
    lanes = torch.arange(x.shape[-1], device=x.device)
    indices, values = [], []
    for round_ in range(k):
        best = x.amax(-1, keepdim=True)
        index = x.argmax(-1, keepdim=True)
        indices.append(index)
        values.append(best)
        if round_ + 1 < k:
            x = torch.where(lanes == index, float("-inf"), x)
    return torch.cat(indices, -1), torch.cat(values, -1)


@dataclass(frozen=True)
class PACIndex:
    """SJD-PAC's constants on top of the Jacobi decoder's: the variant, the tree's attention block over
    the scratch slots, the random-number streams and the depth index."""

    variant: str
    n_alt_depths: int  # depths with alternative candidates (1..D-1; none at W = 1)
    tree_block: torch.Tensor  # [N, S] node n sees the scratch slots of its ancestors
    pac_stream: torch.Tensor
    alt_stream: torch.Tensor
    depth_lanes: torch.Tensor  # [M]

    @classmethod
    def of(cls, tree: "ProductTree", variant: str, scratch: int, session, rng) -> "PACIndex":
        rel = session.slot_ids[None, :] - scratch  # [1, S]
        in_scratch = (rel >= 0) & (rel < tree.L)
        return cls(variant, tree.D - 1 if tree.W > 1 else 0, in_scratch & tree.ancestor[:, rel.clamp(0, tree.L - 1)[0]],
                   rng.stream_offsets([PAC_STREAM]), rng.stream_offsets([PAC_GUMBEL_STREAM]),
                   torch.arange(tree.M, device=session.device))


class PACDecoder(JacobiDecoder):
    """SJD-PAC on the Jacobi decoder's session, KV layout and counters; :meth:`jacobi_iteration` is the
    round function (static shapes, no host read)."""

    RESULTS = JacobiDecoder.RESULTS + ("accepted_alternatives",)

    def __init__(self, engine, batch: DecodeBatch, params, opts: SJDPACOptions, rule):
        super().__init__(engine, batch, params, opts, rule)
        self.tree = ProductTree(self.L, opts.pac_width, opts.pac_depth, self.session.device)
        self.pac = PACIndex.of(self.tree, opts.pac_variant, self.layout.scratch, self.session, self.rng)

    # --- random numbers -------------------------------------------------------------------------
    def uniforms(self, step):
        """(u_node [B, N], u_next [B], u_ac [B, M], u_res [B, M], u_fresh [B, M]) of one iteration."""
        N, M = self.L, self.tree.M
        u = kernels.counter_uniform(self.rng.key, step, self.pac.pac_stream, N + 1 + 3 * M, fuse_when_compiled=True)[:, 0]
        return u[:, :N], u[:, N], u[:, N + 1: N + 1 + M], u[:, N + 1 + M: N + 1 + 2 * M], u[:, N + 1 + 2 * M:]

    def alt_noise(self, step):
        """Gumbel noise [B, D - 1, V] for the candidates of depths 1..D-1."""
        B, n, V = self.B, self.pac.n_alt_depths, self.V
        u = kernels.counter_uniform(self.rng.key, step, self.pac.alt_stream, max(n, 1) * V, fuse_when_compiled=True)[:, 0]
        return gumbel(u[:, : n * V].view(B, n, V))

    def sample(self, dist, u):
        return self.params.pick(lambda: dist.argmax(-1), lambda: sample_inverse_cdf_one_pass(dist, u))

    # --- the candidate table ------------------------------------------------------------------------
    def new_table(self, chain, n_kept, stale_p, alts, alts_valid, noise, u_fresh, tokens, n_new):
        """The next table from candidate 0 of the kept depths (``chain`` [B, M], depths < n_kept[b]: the
        root and the carried candidates, each a sample of ``stale_p`` [B, M, V]) and their alternatives
        (``alts`` [B, W - 1, D - 1], ``alts_valid``); depths >= n_kept are fresh. Returns (cand, valid,
        Q, fresh)."""
        B, W, M, V, nd = self.B, self.tree.W, self.tree.M, self.V, self.pac.n_alt_depths
        lanes = self.pac.depth_lanes
        left = stale_p.gather(1, (n_kept - 1)[:, None, None].expand(B, 1, V))[:, 0]
        chain, fresh = self.fill_fresh(chain, n_kept, left, tokens, n_new, u_fresh)
        random_init = self.layout.policy == "random"
        if random_init:
            fresh_q = torch.full((B, M, V), 1.0 / V, device=self.session.device)  # uniform tokens, declared uniform
        else:
            fresh_q = one_hot(chain, V)  # deterministic guesses, declared one-hot
        table_q = torch.where(fresh[..., None], fresh_q, stale_p)
        table_q = torch.where((lanes == 0)[None, :, None], 0.0, table_q)
        cand = chain[:, None, :].expand(B, W, M)
        valid = (torch.arange(W, device=self.session.device) == 0)[None, :, None].expand(B, W, M)
        if nd:
            fresh_alt = fresh[:, 1: 1 + nd]  # [B, nd]
            if random_init:  # W distinct uniform tokens: the top W of pure noise
                uni = noise.topk(W, dim=-1).indices.permute(0, 2, 1)  # [B, W, nd]
                head = torch.where(fresh_alt, uni[:, 0], chain[:, 1: 1 + nd])
                alts = torch.where(fresh_alt[:, None], uni[:, 1:], alts)
                alts_valid = alts_valid | fresh_alt[:, None]
                chain = torch.cat([chain[:, :1], head, chain[:, 1 + nd:]], 1)
                cand = chain[:, None, :].expand(B, W, M)
            else:
                alts_valid = alts_valid & ~fresh_alt[:, None]
            # cell (w, d) for w >= 1 and depth d in 1..nd holds alternative w - 1 of depth d if it
            # exists; every other cell repeats candidate 0 and is no candidate. Indexed rather than
            # padded and concatenated: compiled, the table is then written straight into the state
            # (a concatenation of the [B, nd, W - 1] top-k outputs is laid out in their order and copied)
            w, d = torch.arange(W, device=self.session.device)[:, None], lanes[None, :]
            is_alt = (w >= 1) & (d >= 1) & (d <= nd)  # [W, M]
            at = ((w - 1).clamp(min=0), (d - 1).clamp(0, nd - 1))
            alt_ok = is_alt & alts_valid[:, at[0], at[1]]  # [B, W, M]
            cand = torch.where(alt_ok, alts[:, at[0], at[1]], chain[:, None, :])
            valid = (w == 0) | alt_ok
        return cand.contiguous(), valid.contiguous(), table_q, fresh

    def alternatives(self, P, c0, noise):
        """Exact PD: W - 1 draws without replacement from P [B, nd, V] with c0 [B, nd] removed
        (Gumbel top-k) -> (tokens [B, W - 1, nd], valid: drawn from positive mass)."""
        logits = P.clamp(min=0).log() + noise
        logits = logits.masked_fill(one_hot(c0, self.V) > 0, float("-inf"))
        if torch.compiler.is_compiling():  # fused by Inductor; eagerly topk is one op (top_few: 8 more)
            indices, values = top_few(logits, self.tree.W - 1)
        else:
            top = logits.topk(self.tree.W - 1, dim=-1)
            indices, values = top.indices, top.values
        return indices.permute(0, 2, 1), (values > float("-inf")).permute(0, 2, 1)

    # --- prefill (eager) ----------------------------------------------------------------------------
    def prefill(self) -> PACState:
        B, L, V, T, W, M, dev = self.B, self.L, self.V, self.T, self.tree.W, self.tree.M, self.session.device
        p0 = self.processed(self.session.prefill()[:, -1])
        first = self.rng.sample(p0, 0, 0)  # rng.Streams.SAMPLE at step 0, as SJD
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        tokens = zeros(B, T + 2 * L)
        tokens.index_put_((self.batch_rows(), torch.zeros_like(first)), first)
        n = torch.ones(B, dtype=torch.long, device=dev)
        step = torch.zeros_like(first)
        _, _, _, _, u_fresh = self.uniforms(step)
        chain = torch.where(self.pac.depth_lanes == 0, first[:, None], 0)
        nd = self.pac.n_alt_depths
        cand, valid, table_q, fresh = self.new_table(
            chain, n, p0[:, None, :].expand(B, M, V), zeros(B, W - 1, nd), torch.zeros(B, W - 1, nd, dtype=torch.bool,
                                                                                       device=dev),
            self.alt_noise(step), u_fresh, tokens, n)
        return PACState(cand=cand, cand_valid=valid, table_q=table_q.contiguous(), fresh=fresh, tokens=tokens,
                        n_committed=n, passes=zeros(B), accepted_hist=zeros(B, L),
                        accepted_carried=zeros(B), accepted_alternatives=zeros(B))

    # --- one iteration ------------------------------------------------------------------------------
    def jacobi_iteration(self, st: PACState) -> None:
        B, L, V, T, W, M = self.B, self.L, self.V, self.T, self.tree.W, self.tree.M
        s, tr, params = self.session, self.tree, self.params
        rows_b = self.batch_rows()
        active = st.n_committed < T
        prefix = s.rows_of(self.c + st.n_committed - 1)
        positions = (prefix[:, None] + tr.depth).clamp(max=self.layout.last_position)  # [rows, N]
        visible = s.slot_ids < prefix[:, None]
        if s.has_key_mask:
            visible = visible & s.key_valid
        mask = visible[:, None, :] | self.pac.tree_block
        node_tokens = st.cand.reshape(B, W * M)[:, tr.cell]  # [B, N]
        node_valid = st.cand_valid.reshape(B, W * M)[:, tr.cell]
        h = s.forward_at(node_tokens, positions, self.index.scratch_slots, mask)
        p = self.processed(h)  # [B, N, V]: p[n] = the target after node n

        step = random_step(st)
        u_node, u_next, u_ac, u_res, u_fresh = self.uniforms(step)
        noise = self.alt_noise(step) if self.pac.n_alt_depths else None
        child_depth = (tr.depth + 1).clamp(max=M - 1)
        node_q = st.table_q.gather(1, child_depth[None, :, None].expand(B, L, V))  # [B, N, V] law of n's children
        kids = tr.children[None].expand(B, L, W)
        kid_ok = node_valid.gather(1, kids.clamp(min=0).reshape(B, -1)).view(B, L, W)
        children = torch.where((kids >= 0) & kid_ok, kids, -1)
        if self.pac.variant == "exact":
            path, A, last, root = self.verify_exact(node_tokens, children, p, node_q, u_node, u_next)
            parent = tr.zero_path[last]  # [B, M]: the node whose output predicts depth j + 1
        else:
            path, A, root, parent, first_pass, res_all = self.verify_released(node_tokens, children, p, node_q,
                                                                              u_node, u_next)

        # --- commit the path and the new root; its K/V move to the row's slots ----------------------
        lanes = self.pac.depth_lanes
        path_tokens = node_tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, M - 1]
        values = torch.where(lanes == A[:, None], root[:, None], torch.cat([path_tokens, path_tokens[:, :1]], 1))
        st.tokens.index_put_((rows_b[:, None], st.n_committed[:, None] + lanes), values)
        src = self.layout.scratch + path.clamp(min=0)  # [B, M]
        s.kv.move(s.rows_of(src), prefix[:, None] + lanes)
        on_path = (lanes[1:] <= A[:, None])  # depths 1..A
        carried = (on_path & ~st.fresh[:, 1:]).sum(1)
        alternatives = (on_path & (tr.branch[path[:, 1:].clamp(min=0)] > 0)).sum(1)
        st.accepted_carried.add_(carried * active)
        st.accepted_alternatives.add_(alternatives * active)
        n_new = self.count_iteration(st, A, active)

        # --- adaptive continuation on the stale columns col = A + d ---------------------------------
        col = A[:, None] + lanes  # [B, M]
        col_c = col.clamp(max=M - 1)
        parent_d = parent.gather(1, col_c)  # [B, M]
        P = p.gather(1, parent_d[..., None].expand(B, M, V))  # [B, M, V] stale targets
        old_depth = (col + 1).clamp(max=M - 1)
        x = st.cand[:, 0].gather(1, old_depth)  # old candidate 0 one depth below
        q_old = st.table_q.gather(1, old_depth[..., None].expand(B, M, V))
        if self.pac.variant == "exact":
            ok = params.pick(lambda: P.argmax(-1) == x,
                             lambda: u_ac * q_old.gather(2, x[..., None])[..., 0] < value_at(P, x))
            res = self.rule.residual(P.reshape(-1, V), q_old.reshape(-1, V), x.reshape(-1), None).view(B, M, V)
            has_old = col < M - 1
            c0 = torch.where(has_old, torch.where(ok, x, self.sample(res, u_res)), self.sample(P, u_res))
            n_kept = M - A  # depths 0..M-1-A carry a stale target (column M - 1: a fresh sample of it)
        else:
            has_child = tr.children[parent_d, 0] >= 0
            ok = has_child & first_pass.gather(1, tr.children[parent_d, 0].clamp(min=0))
            res = res_all.gather(1, parent_d[..., None].expand(B, M, V))
            c0 = torch.where(ok, x, self.sample(res, u_res))
            n_kept = (M - 1 - A).clamp(min=1)  # the last column's output is not gathered (uniform refill)
        chain = torch.where(lanes == 0, root[:, None], c0)

        # --- proactive drafting: alternatives at new depths 1..D-1 -----------------------------------
        nd = self.pac.n_alt_depths
        if nd:
            d_alt = slice(1, 1 + nd)
            if self.pac.variant == "exact":
                alts, alts_valid = self.alternatives(P[:, d_alt], c0[:, d_alt], noise)
            else:  # W draws from the residual; a kept candidate 0 shifts them to ranks 1..W-1
                top = (res[:, d_alt].clamp(min=0).log() + noise).topk(W, dim=-1)
                draws, drawn = top.indices.permute(0, 2, 1), (top.values > float("-inf")).permute(0, 2, 1)
                kept = ok[:, d_alt][:, None]  # [B, 1, nd]
                head = torch.where(kept[:, 0], x[:, d_alt], draws[:, 0])
                chain = torch.cat([chain[:, :1], head, chain[:, 1 + nd:]], 1)
                alts = torch.where(kept, draws[:, : W - 1], draws[:, 1:])
                alts_valid = torch.where(kept, drawn[:, : W - 1], drawn[:, 1:])
        else:
            alts = torch.zeros(B, 0, 0, dtype=torch.long, device=self.session.device)
            alts_valid = torch.zeros(B, 0, 0, dtype=torch.bool, device=self.session.device)
        cand, valid, table_q, fresh = self.new_table(chain, n_kept, P, alts, alts_valid, noise, u_fresh,
                                                     st.tokens, n_new)
        st.cand.copy_(cand)
        st.cand_valid.copy_(valid)
        st.table_q.copy_(table_q)
        st.fresh.copy_(fresh)
        st.n_committed.copy_(n_new)

    def verify_exact(self, node_tokens, children, p, node_q, u_node, u_next):
        """First-accepted-sibling verification (the engine's tree verifier) -> (path [B, M], A [B],
        last [B], root [B])."""
        forest = _Forest(node_tokens, children, node_q, self.tree.M - 1)
        out = self.params.pick(lambda: verify_tree(forest, p, self.rule, u_node, u_next, True),
                               lambda: verify_tree(forest, p, self.rule, u_node, u_next, False))
        return out.path, out.n_accepted, out.last, out.next_token

    def verify_released(self, node_tokens, children, p, node_q, u_node, u_next):
        """The released sampler's verification: every sibling tested against the residual chain of its
        parent as if the earlier siblings had failed; the longest passing row wins (ties: the first).
        -> (path [B, M], A [B], root [B], column parents [B, M], pass [B, N], all-siblings residual
        [B, N, V])."""
        B, N, V = p.shape
        tr = self.tree
        W, M, D = tr.W, tr.M, tr.D
        r = p.clone()
        q = node_q.clone()
        passed = torch.zeros(B, N, dtype=torch.bool, device=self.session.device)
        for rank in range(W):
            child = children[:, :, rank]  # [B, N]
            has = child >= 0
            cid = child.clamp(min=0)
            x = node_tokens.gather(1, cid)
            qn = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
            ok = self.params.pick(
                lambda: r.argmax(-1) == x,
                lambda: u_node.gather(1, cid) * qn.gather(2, x[..., None])[..., 0] < r.gather(2, x[..., None])[..., 0])
            # node n is its parent's child of rank branch(n): its test is this rank's test at its parent
            at_node = (has & ok).gather(1, tr.parent.clamp(min=0)[None].expand(B, N))
            passed = torch.where((tr.branch == rank) & (tr.parent >= 0), at_node, passed)
            res = self.rule.residual(r.reshape(-1, V), qn.reshape(-1, V), x.reshape(-1), None).view(B, N, V)
            r = torch.where(has[..., None], res, r)  # residual after this sibling, whatever its test said
            q = torch.where(has[..., None], q.masked_fill(one_hot(x, V) > 0, 0.0), q)
        # row lengths: the main chain over depths 1..M-1, side rows over depths 1..D-1 (no depth D)
        main_pass = passed[:, tr.main[1:]].long().cumprod(1).sum(1)  # [B]
        side_pass = passed[:, tr.rows[:, 1:]].long().cumprod(2).sum(2)  # [B, R]
        lengths = torch.cat([main_pass[:, None], side_pass[:, 1:]], 1)
        best = lengths.argmax(1)  # first maximal row
        A = lengths.gather(1, best[:, None])[:, 0]
        row_nodes = tr.rows[best]  # [B, D]
        parent = torch.cat([row_nodes, tr.main[D:].expand(B, M - D)], 1)  # released: chosen row, then main chain
        path = torch.where(self.pac.depth_lanes <= A[:, None], parent, -1)
        last = parent.gather(1, A[:, None])[:, 0]
        dist = r.gather(1, last[:, None, None].expand(B, 1, V))[:, 0]
        # A fully accepted chain takes its bonus token from p (the release draws it uniformly, since its
        # last output is never gathered: rare at M = 54, frequent on small images, and it can break a
        # family's layout, so that part is not reproduced)
        root = self.sample(dist, u_next)
        return path, A, root, parent, passed, r

    def summarize(self, counters: dict, loop_stats: dict) -> dict:
        return {**super().summarize(counters, loop_stats),
                "accepted_alternatives": int(counters["accepted_alternatives"].sum()), "pac_width": self.tree.W,
                "pac_depth": self.tree.D, "pac_main_chain": self.tree.M, "pac_variant": self.pac.variant}


@register("sjd-pac", SJDPACOptions)
def run_sjd_pac(engine, batch: DecodeBatch, params, opts: SJDPACOptions) -> PACDecoder:
    return PACDecoder.start(engine, batch, params, opts, ExactRule())
