"""Drafting with the EAGLE head: extend its KV with new (feature, token) pairs, then grow a tree.

Positions: the drafter's committed length ``P_d`` equals the number of target positions whose
feature has been fed (condition included). The pair ``(f_{P_d-1}, root)`` is the last committed one;
its output predicts the root's children. A depth-``d`` tree node runs at drafter position
``P_d + d - 1`` and its K/V sit in scratch slots after ``P_d``. All shapes are static.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.reference import additive_mask
from ..sampling import RowSampling, SamplingParams, guided_logits, process_logits
from .tree import DraftTree, static_layout, tree_structure


@dataclass
class TreeSpec:
    kind: str = "dynamic"  # dynamic | static | chain
    total: int = 59  # dynamic: nodes including the root
    depth: int = 4  # dynamic: expansion steps (levels = depth + 1); chain: its length
    topk: int = 10  # dynamic: children per expanded node and frontier width; static: ranks sampled
    static_name: str = "naive_extend_57"

    @property
    def max_nodes(self) -> int:
        if self.kind == "dynamic":
            return self.total
        if self.kind == "chain":
            return self.depth + 1
        from .tree import STATIC_TREES

        return len(STATIC_TREES[self.static_name]()) + 1


class DraftSession:
    """The drafter's KV cache and tree building for B sequences (rows ``[cond_0..B-1; uncond_0..B-1]``
    under CFG). Every length is a per-sequence device tensor [B]; every shape is static."""

    def __init__(self, drafter, rows: int, n_slots: int, params: RowSampling, spec: TreeSpec):
        self.drafter, self.rows, self.spec = drafter, rows, spec
        self.batch = rows // 2 if params.use_cfg else rows
        self.kv = drafter.new_cache(rows, n_slots)
        self.S = self.kv.n_slots
        self.device = drafter.fc.weight.device
        self.slot_ids = torch.arange(self.S, device=self.device)
        # Trees rank drafts by the guided, processed drafter distribution; greedy rows rank by the
        # untempered one (a one-hot would leave nothing to rank). ``params`` is the decoder's: with
        # per-row settings its rows change at admission, so the draft view is derived in each round.
        if isinstance(params, SamplingParams):
            params = RowSampling(params, None, self.batch, self.device)
        self.params = params
        self._uniform_dparams = params.draft_view() if params.uniform is not None else None
        # static trees sample their drafts in sampled rows (greedy rows take the top ranks)
        self.sample_drafts = spec.kind != "dynamic" and (params.scope.sampled if params.uniform is None
                                                         else params.uniform.temperature > 0)
        self.layout = None
        if spec.kind in ("static", "chain"):
            from .tree import STATIC_TREES, chain_choices

            choices = chain_choices(spec.depth) if spec.kind == "chain" else STATIC_TREES[spec.static_name]()
            self.layout = L = static_layout(choices, self.device)
            # One structure for every sequence: computed once, expanded per build (views).
            self.static_structure = tree_structure(L["parents"][None], L["max_depth"], max(L["max_rank"], 1))
            self.static_levels = self._static_levels()
        self._tables = self._dynamic_tables() if spec.kind == "dynamic" else None

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence [B, ...] -> per-row [rows, ...] (the unconditional half repeats the sequences)."""
        return torch.cat([x, x]) if self.rows != self.batch else x

    # --- committed pairs ------------------------------------------------------------------------
    def extend(self, feats: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Feed pairs ``(feats[:, j], tokens[:, j])`` at drafter positions ``start + j`` (causal), per
        sequence. feats [rows, M, D], tokens [B, M], start [B]. Returns the drafter outputs [rows, M, D].
        Pairs past the caller's valid count write scratch slots that later writes overwrite."""
        M = tokens.shape[1]
        pos = start[:, None] + self.slot_ids[:M]  # [B, M]
        vis = self.slot_ids[None, None, :] <= pos[:, :, None]  # prefix + causal block: [B, M, S]
        pos_rows = self.rows_of(pos)
        return self.drafter(feats, self.rows_of(tokens), pos_rows, self.kv, pos_rows, self.rows_of(vis)[:, None])

    def _topk_rows(self, h: torch.Tensor, k: int, position_rows: torch.Tensor):
        """drafter features [rows, F, D] at drafter position ``position_rows`` [rows] -> (log-probs
        [B, F, k], tokens [B, F, k]) of the k best drafts under the guided, processed drafter
        distribution: the fused draft-sampling kernel's job."""
        from .. import kernels

        F_ = h.shape[1]
        lg = self.drafter.logits(h, position_rows)
        dparams = self.dparams
        if dparams.uniform is not None:
            u = dparams.uniform
            tok, lp = kernels.draft_topk(lg.reshape(-1, lg.shape[-1]), u.cfg_scale if self.params.use_cfg else 1.0,
                                         u.temperature, u.top_k, u.top_p, k)
        else:  # per-row settings: the same distribution per row (torch; the fused kernel takes one setting)
            from ..kernels.reference import stable_topk

            p = process_logits(guided_logits(lg.float(), dparams), dparams)  # [B, F, V]
            tok = stable_topk(p.reshape(-1, p.shape[-1]), k)
            lp = p.reshape(-1, p.shape[-1]).gather(1, tok).log()
        lp = lp.to(h.dtype if h.dtype == torch.float64 else torch.float32)
        return lp.reshape(self.batch, F_, k), tok.reshape(self.batch, F_, k)

    @property
    def dparams(self) -> RowSampling:
        return self._uniform_dparams if self._uniform_dparams is not None else self.params.draft_view()

    def _q(self, h: torch.Tensor, position: torch.Tensor):
        """drafter features [rows, F, D] at drafter ``position`` [B] -> (processed guided distribution
        [B, F, V], guided logits [B, F, V])."""
        lg = guided_logits(self.drafter.logits(h, self.rows_of(position)), self.dparams)
        return process_logits(lg, self.dparams), lg

    def _run_nodes(self, feats, tokens, position, P_d, scratch_cols, anc):
        """Run tree nodes: feats [rows, F, D], tokens [B, F], all of sequence b at ``position[b]``; node
        f's K/V go to slot ``P_d[b] + scratch_cols[f]``; it sees the prefix and the scratch slots
        ``anc[b, f]`` marks (``anc`` [B, F, width], width from ``P_d``)."""
        B, F_ = tokens.shape
        width = anc.shape[2]
        slots = P_d[:, None] + scratch_cols[None, :]  # [B, F]
        vis = (self.slot_ids[None, None, :] < P_d[:, None, None]).expand(B, F_, self.S).clone()
        scratch = (P_d[:, None] + torch.arange(width, device=self.device))[:, None, :].expand(B, F_, width)
        vis.scatter_(2, scratch, anc)
        pos = position[:, None].expand(B, F_)
        return self.drafter(feats, self.rows_of(tokens), self.rows_of(pos), self.kv, self.rows_of(slots),
                            self.rows_of(vis)[:, None])

    # --- trees ------------------------------------------------------------------------------------
    def build(self, root: torch.Tensor, h_root: torch.Tensor, P_d: torch.Tensor, rng=None, step=None) -> DraftTree:
        """root [B] tokens; h_root [rows, D] the drafter outputs of the pairs (f_{P_d-1}, root); P_d [B].
        Sampled static trees draw from ``rng`` (a CounterRNG) at ``step`` [B]."""
        if self.spec.kind == "dynamic":
            return self._dynamic(root, h_root, P_d)
        return self._static(root, h_root, P_d, rng, step)

    def _dynamic_tables(self):
        """Constants of the dynamic build (per TreeSpec): made once, so a round spends no op on them."""
        K, depth, dev = self.spec.topk, self.spec.depth, self.device
        # Candidates: K children of the root, then K * K per expansion; a candidate's level (1-based).
        level = torch.cat([torch.ones(K, dtype=torch.long)] + [torch.full((K * K,), d + 2) for d in range(depth)])
        # Frontier table columns: [no parent (-1) | level-0 frontier | level-1 frontier | ...]; the
        # candidate with global id g has its parent in column parent_col[g].
        parent_col = torch.cat([torch.zeros(K, dtype=torch.long)] +
                               [1 + d * K + torch.arange(K * K) // K for d in range(depth)])
        # A frontier column holds the within-level index of the chosen candidate; adding the level's
        # first global id makes it a global id (column 0 keeps -1).
        frontier_offset = torch.cat([torch.zeros(1, dtype=torch.long), torch.zeros(K, dtype=torch.long)] +
                                    [torch.full((K,), K + (d - 1) * K * K) for d in range(1, depth)])
        tables = dict(
            # A child's cumulative log-prob never exceeds its parent's; the tiny per-level penalty makes
            # that strict, so the best (total-1) candidates always include every selected node's parent.
            penalty=(1e-6 * level).to(dev), parent_col=parent_col.to(dev), frontier_offset=frontier_offset.to(dev),
            frontier0=torch.arange(-1, K, device=dev).expand(self.batch, K + 1),
            scratch_cols=torch.arange(depth * K, device=dev),
            eye=torch.eye(K, dtype=torch.bool, device=dev).expand(self.rows, K, K),
            zero_logp=torch.zeros(self.batch, 1, device=dev))
        return tables

    def _dynamic(self, root, h_root, P_d) -> DraftTree:
        from .. import kernels

        K, depth, total = self.spec.topk, self.spec.depth, self.spec.total
        B, rows, D = self.batch, self.rows, h_root.shape[-1]
        t = self._tables
        # Per build, in CFG row space: drafter positions, the committed prefix every node sees, and
        # the scratch slots of the tree nodes (level d's frontier in columns [d * K, (d + 1) * K)).
        P_rows = self.rows_of(P_d)
        prefix_vis = self.slot_ids[None, :] < P_rows[:, None]  # [rows, S]
        scratch = P_rows[:, None] + t["scratch_cols"]  # [rows, depth * K]
        lp, tok = self._topk_rows(h_root[:, None], K, P_rows - 1)
        lp, tok = lp[:, 0], tok[:, 0]  # [B, K]
        cand_tok, cand_score, cand_lp, frontiers = [root[:, None], tok], [lp], [t["zero_logp"], lp], [t["frontier0"]]
        f_tok_rows, f_score = self.rows_of(tok), lp
        f_feat = h_root[:, None].expand(rows, K, D)
        # With a plain embedding table, each level's op writes the next drafter input directly.
        embedding, f_input = self.drafter.embedding_table(), None
        anc = t["eye"]  # [rows, K, width]: frontier f sees its ancestors' scratch slots and its own
        vis = prefix_vis[:, None, :].expand(rows, K, self.S).clone()
        vis.scatter_(2, scratch[:, None, :K].expand(rows, K, K), anc)
        mask = additive_mask(vis, h_root.dtype)  # additive, like the masks kernels.tree_level returns
        for d in range(depth):
            width = (d + 1) * K
            pos = (P_rows + d)[:, None]
            out = self.drafter(f_feat, f_tok_rows, pos.expand(rows, K), self.kv, scratch[:, d * K:width], mask[:, None],
                               fc_input=f_input)
            clp, ctok = self._topk_rows(out, K, pos[:, 0])  # [B, K, K]
            cand_tok.append(ctok.flatten(1))
            cand_lp.append(clp.flatten(1))
            if d == depth - 1:  # the last level's candidates are never expanded
                cand_score.append((f_score[:, :, None] + clp).flatten(1))
                break
            # Scores, the next frontier (top K), its tokens, parent features, ancestor columns and
            # attention mask: one op per level instead of a dozen small ones.
            cum, best, f_tok_rows, f_score, level_out, anc, mask = kernels.tree_level(f_score, clp, ctok, out, anc,
                                                                                     P_rows, self.S, embedding)
            if embedding is None:
                f_feat = level_out
            else:
                f_input = level_out
            cand_score.append(cum)
            frontiers.append(best)
        # Selection of the best total - 1 candidates, their parents, tokens and log-probs, and the tree
        # structure (ancestor mask, depths, paths, leaves, children): one op.
        tokens, parents, tree_mask, dep, paths, leaf, children, logp = kernels.tree_select(
            torch.cat(cand_score, 1), t["penalty"], torch.cat(frontiers, 1), t["frontier_offset"], t["parent_col"],
            torch.cat(cand_tok, 1), torch.cat(cand_lp, 1), total, depth + 1, K)
        return DraftTree(tokens, parents, tree_mask, dep, paths, leaf, children, draft_logp=logp)

    def _static_levels(self):
        """Per depth level of the static layout, the index pieces a build needs (made once): the
        level's node range (levels are contiguous: nodes are numbered by depth), its nodes' parents
        and ancestor masks over the scratch columns, and where each child's draft comes from (its
        parent's row in the level, its rank)."""
        L = self.layout
        parents, ranks, mask = L["parents"], L["ranks"], self.static_structure[0][0]
        levels = []
        for d in range(L["max_depth"]):
            lvl, kids = L["by_level"][d], L["by_level"][d + 1]
            levels.append(dict(nodes=slice(*L["level_ranges"][d]), kids=slice(*L["level_ranges"][d + 1]),
                               parents=parents[lvl], anc=mask[lvl][:, 1:], scratch=lvl - 1,
                               row=torch.searchsorted(lvl, parents[kids]), rank=ranks[kids]))
        return levels

    def _static(self, root, h_root, P_d, rng, step) -> DraftTree:
        L = self.layout
        B, dev = self.batch, self.device
        K = max(L["max_rank"], 1)
        N = L["n"]
        V = self.drafter.target.config.vocab_size
        parents = L["parents"]
        tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        tokens[:, 0] = root
        q_nodes = torch.zeros(B, N, V, device=dev)
        logit_nodes = torch.zeros(B, N, V, device=dev)  # guided drafter logits (CASCADE's LlamaGen breadth)
        feats = torch.zeros(self.rows, N, h_root.shape[-1], device=dev, dtype=h_root.dtype)
        feats[:, 0] = h_root
        mask, dep, paths, leaf, children = (t.expand(B, *t.shape[1:]) for t in self.static_structure)
        logp = torch.zeros(B, N, device=dev)
        race = None
        if self.sample_drafts:  # K draws without replacement: the exponential race, top-K
            from ..rng import Streams

            # Exp(1) per node and token; u = 1 gives 0, clamped so a zero-probability token never wins
            race = (-torch.log(rng.uniform(step, Streams.TREE, (N, V)))).clamp(min=1e-30)
            if self.params.uniform is None and self.params.scope.greedy:  # greedy rows: the top ranks
                race = torch.where(self.params.per_row(self.params.temperature == 0, race), 1.0, race)
        for d, level in enumerate(self.static_levels):
            lvl, kids = level["nodes"], level["kids"]  # nodes at depth d already have tokens; get their q
            if d == 0:
                q, lg = self._q(h_root[:, None], P_d - 1)
            else:
                anc = level["anc"]  # scratch column of node i is i - 1
                out = self._run_nodes(feats[:, level["parents"]], tokens[:, lvl], P_d + (d - 1), P_d, level["scratch"],
                                      anc.expand(B, *anc.shape))
                feats[:, lvl] = out
                q, lg = self._q(out, P_d + (d - 1))  # [B, F, V]
            q_nodes[:, lvl] = q
            logit_nodes[:, lvl] = lg.float()
            score = q / race[:, lvl] if race is not None else q
            draws = score.topk(K, dim=-1).indices  # [B, F, K]
            row = level["row"]  # child = (parent's row among this level, rank)
            tokens[:, kids] = draws[:, row, level["rank"]]
            logp[:, kids] = torch.log(q[:, row].gather(2, tokens[:, kids][:, :, None])[:, :, 0])
        return DraftTree(tokens, parents.expand(B, N), mask, dep, paths, leaf, children, q=q_nodes, draft_logp=logp,
                         draft_feats=feats, sampled=self.sample_drafts, draft_logits=logit_nodes)
