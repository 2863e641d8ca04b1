"""Drafting with the EAGLE head: extend its KV with new (feature, token) pairs, then grow a tree.

Positions: the drafter's committed length ``P_d`` equals the number of target positions whose
feature has been fed (condition included). The pair ``(f_{P_d-1}, root)`` is the last committed one;
its output predicts the root's children. A depth-``d`` tree node runs at drafter position
``P_d + d - 1`` and its K/V sit in scratch slots after ``P_d``. All shapes are static.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import local_visibility
from ..sampling import SamplingParams, guided_logits, process_logits
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
    def __init__(self, drafter, rows: int, n_slots: int, params: SamplingParams, spec: TreeSpec):
        self.drafter, self.rows, self.spec = drafter, rows, spec
        self.kv = drafter.new_cache(rows, n_slots)
        self.S = self.kv.n_slots
        self.device = drafter.fc.weight.device
        self.slot_ids = torch.arange(self.S, device=self.device)
        # Trees rank drafts by the guided, processed drafter distribution; greedy runs rank by the
        # untempered one (a one-hot would leave nothing to rank).
        self.params = params
        self.dparams = SamplingParams(params.temperature if params.temperature > 0 else 1.0,
                                      params.top_k, params.top_p, params.cfg_scale)
        self.sample_drafts = spec.kind != "dynamic" and params.temperature > 0
        self.layout = None
        if spec.kind in ("static", "chain"):
            from .tree import STATIC_TREES, chain_choices

            choices = chain_choices(spec.depth) if spec.kind == "chain" else STATIC_TREES[spec.static_name]()
            self.layout = static_layout(choices, self.device)

    # --- committed pairs ------------------------------------------------------------------------
    def extend(self, feats: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Feed pairs ``(feats[:, j], tokens[j])`` at drafter positions ``start + j`` (causal).
        feats [rows, M, D], tokens [M]. Returns the drafter outputs [rows, M, D]. Pairs past the
        caller's valid count write scratch slots that later writes overwrite."""
        M = tokens.shape[0]
        pos = start + torch.arange(M, device=self.device)
        local = torch.ones(M, M, dtype=torch.bool, device=self.device).tril()
        vis = local_visibility(start, local, self.S)
        return self.drafter(feats, tokens[None].expand(self.rows, M), pos, self.kv, pos, vis.unsqueeze(1))

    def _topk(self, h: torch.Tensor, k: int, position: torch.Tensor):
        """drafter features [rows, F, D] at drafter ``position`` [1] -> (log-probs [F, k], tokens [F, k])
        of the k best drafts under the guided, processed drafter distribution: the fused
        draft-sampling kernel's job."""
        from .. import kernels

        lg = self.drafter.logits(h, position)
        tok, lp = kernels.draft_topk(lg.reshape(-1, lg.shape[-1]), self.dparams.cfg_scale if self.params.use_cfg
                                     else 1.0, self.dparams.temperature, self.dparams.top_k, self.dparams.top_p, k)
        return lp.to(h.dtype if h.dtype == torch.float64 else torch.float32), tok

    def _q(self, h: torch.Tensor, position: torch.Tensor):
        """drafter features [rows, F, D] at drafter ``position`` [1] -> (processed guided distribution
        [F, V], guided logits [F, V])."""
        lg = guided_logits(self.drafter.logits(h, position), self.dparams)[0]
        return process_logits(lg, self.dparams), lg

    def _run_nodes(self, feats, tokens, position, P_d, scratch_cols, anc):
        """Run tree nodes: feats [rows, F, D], tokens [F], all at ``position``; node f's K/V go to
        slot ``P_d + scratch_cols[f]``; it sees the prefix and the scratch slots ``anc[f]`` marks."""
        F_ = tokens.shape[0]
        slots = P_d + scratch_cols
        vis = (self.slot_ids[None, :] < P_d).expand(F_, self.S).clone()
        width = anc.shape[1]
        vis.scatter_(1, (P_d + torch.arange(width, device=self.device))[None].expand(F_, width), anc)
        pos = position.expand(F_)
        return self.drafter(feats, tokens[None].expand(self.rows, F_), pos, self.kv, slots, vis[None, None])

    # --- trees ------------------------------------------------------------------------------------
    def build(self, root: torch.Tensor, h_root: torch.Tensor, P_d: torch.Tensor, gen) -> DraftTree:
        """root [1] token; h_root [rows, D] the drafter output of the pair (f_{P_d-1}, root)."""
        if self.spec.kind == "dynamic":
            return self._dynamic(root, h_root, P_d)
        return self._static(root, h_root, P_d, gen)

    def _dynamic(self, root, h_root, P_d) -> DraftTree:
        K, depth, total = self.spec.topk, self.spec.depth, self.spec.total
        dev = self.device
        lp, tok = self._topk(h_root[:, None], K, P_d - 1)
        lp, tok = lp[0], tok[0]
        cand_tok, cand_score, cand_parent = [tok], [lp], [torch.full((K,), -1, device=dev, dtype=torch.long)]
        cand_lp = [lp]
        f_tok, f_score, f_gid = tok, lp, torch.arange(K, device=dev)
        f_feat = h_root[:, None].expand(self.rows, K, h_root.shape[-1])
        anc = torch.zeros(K, 0, dtype=torch.bool, device=dev)
        eye = torch.eye(K, dtype=torch.bool, device=dev)
        offset = K
        for d in range(depth):
            anc = torch.cat([anc, eye], 1)  # frontier f sees its ancestors' slots and its own
            cols = d * K + torch.arange(K, device=dev)
            out = self._run_nodes(f_feat, f_tok, P_d + d, P_d, cols, anc)
            clp, ctok = self._topk(out, K, P_d + d)  # [K, K]
            cum = f_score[:, None] + clp
            cand_tok.append(ctok.flatten())
            cand_score.append(cum.flatten())
            cand_lp.append(clp.flatten())
            cand_parent.append(f_gid.repeat_interleave(K))
            best = cum.flatten().topk(K).indices
            par = best // K
            f_tok, f_score = ctok.flatten()[best], cum.flatten()[best]
            f_gid = offset + best
            f_feat, anc = out[:, par], anc[par]
            offset += K * K
        tokens_all = torch.cat(cand_tok)
        parent_all = torch.cat(cand_parent)
        level = torch.cat([torch.full((K,), 1, device=dev)] + [torch.full((K * K,), d + 2, device=dev)
                                                                for d in range(depth)])
        # A child's cumulative log-prob never exceeds its parent's; the tiny per-level penalty makes
        # that strict, so the best (total-1) candidates always include every selected node's parent.
        score = torch.cat(cand_score) - 1e-6 * level
        score = torch.nan_to_num(score, neginf=-1e30)
        sel = score.topk(min(total - 1, score.shape[0])).indices.sort().values
        par_gid = parent_all[sel]
        parents = torch.where(par_gid < 0, torch.zeros_like(par_gid),
                              torch.searchsorted(sel, par_gid.clamp(min=0)) + 1)
        parents = torch.cat([torch.full((1,), -1, device=dev, dtype=torch.long), parents])
        tokens = torch.cat([root.reshape(1), tokens_all[sel]])
        mask, dep, paths, leaf, children = tree_structure(parents, depth + 1, K)
        logp = torch.cat([torch.zeros(1, device=dev), torch.cat(cand_lp)[sel]])
        return DraftTree(tokens, parents, mask, dep, paths, leaf, children, draft_logp=logp)

    def _static(self, root, h_root, P_d, gen) -> DraftTree:
        L = self.layout
        dev = self.device
        K = max(L["max_rank"], 1)
        N = L["n"]
        V = self.drafter.target.config.vocab_size
        parents, ranks = L["parents"], L["ranks"]
        tokens = torch.zeros(N, dtype=torch.long, device=dev)
        tokens[0] = root.reshape(())
        q_nodes = torch.zeros(N, V, device=dev)
        logit_nodes = torch.zeros(N, V, device=dev)  # guided drafter logits (CASCADE's LlamaGen breadth)
        feats = torch.zeros(self.rows, N, h_root.shape[-1], device=dev, dtype=h_root.dtype)
        feats[:, 0] = h_root
        mask_full, dep, paths, leaf, children = tree_structure(parents, L["max_depth"], K)
        logp = torch.zeros(N, device=dev)
        for d in range(L["max_depth"]):
            lvl = L["by_level"][d]  # nodes at depth d: already have tokens; get their q
            if d == 0:
                q, lg = self._q(h_root[:, None], P_d - 1)
            else:
                cols = lvl - 1
                anc = mask_full[lvl][:, 1:]  # scratch column of node i is i - 1
                out = self._run_nodes(feats[:, parents[lvl]], tokens[lvl], P_d + d - 1, P_d, cols, anc)
                feats[:, lvl] = out
                q, lg = self._q(out, P_d + d - 1)
            q_nodes[lvl] = q
            logit_nodes[lvl] = lg.float()
            if self.sample_drafts:  # K draws without replacement: the exponential race, top-K
                e = torch.empty_like(q).exponential_(generator=gen)
                draws = (q / e).topk(K, dim=-1).indices
            else:
                draws = q.topk(K, dim=-1).indices
            kids = L["by_level"][d + 1]
            # child = (parent's row among this level, rank)
            row = torch.searchsorted(lvl, parents[kids])
            tokens[kids] = draws[row, ranks[kids]]
            logp[kids] = torch.log(q[row].gather(1, tokens[kids][:, None])[:, 0])
        return DraftTree(tokens, parents, mask_full, dep, paths, leaf, children, q=q_nodes, draft_logp=logp,
                         draft_feats=feats, sampled=self.sample_drafts, draft_logits=logit_nodes)
