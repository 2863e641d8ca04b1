"""Acceptance rules behind one interface, and the vectorised tree verification that runs them.

Verification walks a draft tree with the target's processed distributions ``p[i]`` (the target's
prediction *after* node i, i.e. for i's children). For every node at once and sibling by sibling
(a loop over at most ``max_children`` ranks, never over nodes), a rule decides whether child x is
accepted against the current residual ``r`` of its parent; on rejection the parent's residual is
updated. Then the accepted path is walked from the root (a loop over depth), and the next token is
drawn from the residual of the last accepted node (its children all failed) or from p itself (it is
a leaf): the EAGLE/SpecInfer recursive rejection scheme, lossless for the exact rule.

A rule implements ``accept(r, x, qx, u, ctx) -> (accepted [M] bool, moved [M, V] bool | None)`` and
optionally ``residual``. ``moved`` marks target mass a relaxed rule credited to x; the principled
residual removes it (under the relaxed target those tokens have probability 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import VVSError


@dataclass
class VerifyContext:
    """What a rule may look at, for the M (parent, child) pairs tested in one sibling rank."""

    tree: object  # DraftTree
    parent: torch.Tensor  # [M] node ids
    child: torch.Tensor  # [M] node ids (clamped; check ``valid``)
    valid: torch.Tensor  # [M] bool
    p: torch.Tensor  # [N, V] unrelaxed processed target distributions per node
    logits: Optional[torch.Tensor] = None  # [N, V] guided target logits per node
    hidden: Optional[torch.Tensor] = None  # [rows, N, D] target features per node
    engine: object = None


class AcceptanceRule:
    name = "exact"
    lossless = True

    def accept(self, r, x, qx, u, ctx):
        px = r.gather(1, x[:, None])[:, 0]
        return u * qx < px, None

    def residual(self, r, q, x, moved):
        """norm(max(0, r' - q)) with r' = r minus the credited mass; q = one-hot(x) for
        deterministic drafts. If nothing is left (r' <= q everywhere), keep r' (never NaN)."""
        if moved is not None:
            r = r.masked_fill(moved, 0.0)
        if q is None:
            res = r.scatter(1, x[:, None], 0.0)
        else:
            res = (r - q).clamp(min=0)
        s = res.sum(-1, keepdim=True)
        fallback = r / r.sum(-1, keepdim=True).clamp(min=1e-30)
        return torch.where(s > 1e-12, res / s.clamp(min=1e-30), fallback)


class ExactRule(AcceptanceRule):
    pass


def neighbor_table(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """[K, c] codebook vectors -> [K, k] nearest other codes by L2 distance (LANTERN's latent
    neighbourhoods; only the first k columns of the full sort are ever used)."""
    if k < 1 or k >= codebook.shape[0]:
        raise VVSError(f"lantern-k must be in [1, {codebook.shape[0] - 1}], got {k}")
    d = torch.cdist(codebook.float(), codebook.float())
    d.fill_diagonal_(float("inf"))
    return d.topk(k, dim=1, largest=False).indices


class LanternRule(AcceptanceRule):
    """LANTERN (TVD bound δ) or LANTERN++ (``ratio=True``: relaxed mass at most λ·p(x)).

    p̃(x) = p(x) + c_{m*} with c_m the mass of x's m nearest latent neighbours and m* the largest m
    whose c_m fits the bound. ``reference_residual`` reproduces the published code, which removes
    x's k+1 nearest codes from the residual on rejection instead of the m* actually credited."""

    lossless = False

    def __init__(self, neighbors: torch.Tensor, delta: float, ratio: bool = False, reference_residual=False):
        self.nb, self.delta, self.ratio, self.ref = neighbors, float(delta), ratio, reference_residual
        self.name = "lantern++" if ratio else "lantern"

    def credit(self, r, x):
        from . import kernels

        if hasattr(kernels, "lantern_mass"):
            relaxed, m_star = kernels.lantern_mass(r, x, self.nb, self.delta, self.ratio)
        else:
            relaxed, m_star = lantern_mass_reference(r, x, self.nb, self.delta, self.ratio)
        nbx = self.nb[x]  # [M, k]
        k = nbx.shape[1]
        n_moved = torch.full_like(m_star, k) if self.ref else m_star
        cols = torch.arange(k, device=r.device)[None] < n_moved[:, None]
        moved = torch.zeros_like(r, dtype=torch.bool).scatter_(1, nbx, cols)
        if self.ref:  # the published code drops k neighbours (+ x itself, handled by residual)
            moved = moved & (m_star[:, None] > 0)
        return relaxed, moved

    def accept(self, r, x, qx, u, ctx):
        relaxed, moved = self.credit(r, x)
        return u * qx < relaxed, moved


def lantern_mass_reference(p, tokens, neighbors, delta: float, ratio: bool):
    nb = neighbors[tokens]  # [M, k]
    c = p.gather(1, nb).cumsum(1)  # c_m for m = 1..k
    px = p.gather(1, tokens[:, None])[:, 0]
    bound = (delta - 1.0) * px if ratio else torch.full_like(px, delta)
    m_star = (c <= bound[:, None]).sum(1)
    gathered = torch.where(m_star > 0, c.gather(1, (m_star - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(px))
    return px + gathered, m_star


# --- tree verification ----------------------------------------------------------------------------
@dataclass
class VerifyResult:
    path: torch.Tensor  # [B, max_depth + 1] accepted node ids from the root, -1 padded
    n_accepted: torch.Tensor  # [B] accepted drafted tokens (root excluded)
    last: torch.Tensor  # [B] last node on the path
    next_token: torch.Tensor  # [B] bonus / resampled token


def verify_tree(tree, p: torch.Tensor, rule: AcceptanceRule, u_accept: torch.Tensor, u_sample: torch.Tensor,
                greedy: bool, logits=None, hidden=None, engine=None) -> VerifyResult:
    """B trees at once: p [B, N, V] processed target distributions after each node; u_accept [B, N]
    (the uniform testing node j against its parent), u_sample [B] (inverse-CDF uniform of the next
    token). Returns the accepted paths and next tokens (no host sync). Sequence by sequence here (a
    loop over B of the vectorised single-tree walk); the fused batched kernel replaces it."""
    B = p.shape[0]
    rows = hidden.shape[0] if hidden is not None else 0
    out = []
    for b in range(B):
        one = _tree_of(tree, b)
        h = None
        if hidden is not None:
            h = torch.stack([hidden[b], hidden[b + B]]) if rows == 2 * B else hidden[b:b + 1]
        out.append(_verify_one(one, p[b], rule, u_accept[b], u_sample[b:b + 1], greedy,
                               logits[b] if logits is not None else None, h, engine))
    return VerifyResult(*(torch.stack([getattr(r, f) for r in out]) for f in ("path", "n_accepted", "last",
                                                                               "next_token")))


def _tree_of(tree, b):
    """Sequence b's tree with unbatched fields (the single-tree layout the rules read)."""
    from .tree import DraftTree

    feats = None
    if tree.draft_feats is not None:
        rows = tree.draft_feats.shape[0]
        feats = (torch.stack([tree.draft_feats[b], tree.draft_feats[b + tree.batch]]) if rows == 2 * tree.batch
                 else tree.draft_feats[b:b + 1])
    pick = lambda t: None if t is None else t[b]
    return DraftTree(pick(tree.tokens), pick(tree.parents), pick(tree.mask), pick(tree.depth), pick(tree.paths),
                     pick(tree.is_leaf), pick(tree.children), pick(tree.q), pick(tree.draft_logp), feats, tree.sampled)


def _verify_one(tree, p, rule, u_accept, u_sample, greedy, logits, hidden, engine):
    """One tree with unbatched fields (tokens [N], children [N, C], ...): the sibling-rank walk."""
    from .rng import sample_inverse_cdf

    N, V = p.shape
    dev = p.device
    C = tree.children.shape[1]
    r = p.clone()
    q = None
    if tree.sampled and tree.q is not None:
        q = tree.q.clone()
    accepted_child = torch.full((N,), -1, dtype=torch.long, device=dev)
    parents = torch.arange(N, device=dev)
    for rank in range(C):
        child = tree.children[:, rank]
        valid = (child >= 0) & (accepted_child < 0)
        cc = child.clamp(min=0)
        x = tree.tokens[cc]
        if q is not None:
            qn = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
            qx = qn.gather(1, x[:, None])[:, 0]
        else:
            qn, qx = None, torch.ones(N, device=dev)
        ctx = VerifyContext(tree, parents, cc, valid, p, logits, hidden, engine)
        ok, moved = rule.accept(r, x, qx, u_accept[cc], ctx)
        if greedy:
            ok = _greedy_ok(rule, r, x, moved)
        acc = valid & ok
        accepted_child = torch.where(acc, child, accepted_child)
        rej = valid & ~acc
        r = torch.where(rej[:, None], rule.residual(r, qn, x, moved), r)
        if q is not None:
            q = torch.where(rej[:, None], q.scatter(1, x[:, None], 0.0), q)
    path, n_acc, last = _walk(accepted_child, tree.children, tree.paths.shape[-1] - 1)
    dist = r[last]  # [1, V]
    nxt = dist.argmax(-1) if greedy else sample_inverse_cdf(dist, u_sample)
    return VerifyResult(path, n_acc[0], last[0], nxt[0])


def _greedy_ok(rule, r, x, moved):
    """Greedy verification: accept x iff it is the argmax of the (relaxed) target distribution."""
    if moved is None:
        return r.argmax(-1) == x
    relaxed = r.masked_fill(moved, 0.0)
    relaxed = relaxed.scatter(1, x[:, None], r.gather(1, x[:, None]) + (r * moved).sum(-1, keepdim=True))
    return relaxed.argmax(-1) == x


def _walk(accepted_child: torch.Tensor, children: torch.Tensor, max_depth: int):
    """Follow accepted children from the root (the acceptance-walk kernel: first-child / next-sibling
    order, a loop over depth only, device ops, no host sync)."""
    from . import kernels

    N = children.shape[0]
    accepted = torch.zeros(N + 1, dtype=torch.bool, device=children.device)
    has = accepted_child >= 0
    accepted.scatter_(0, torch.where(has, accepted_child, torch.full_like(accepted_child, N)), has)
    first_child, next_sibling = kernels.sibling_links(children)
    return kernels.accept_walk(accepted[:N], first_child, next_sibling, max_depth)


def make_rule(name: str, engine=None, lantern_k: int = 1000, lantern_delta: float = 0.2,
              lantern_lambda: float = 2.0, reference_residual: bool = False, **kw) -> AcceptanceRule:
    if name == "exact":
        return ExactRule()
    if name in ("lantern", "lantern++"):
        k = min(lantern_k, engine.vq.config.codebook_size - 1 if engine and engine.vq is not None else lantern_k)
        nb = engine.codebook_neighbors(k)
        if name == "lantern":
            return LanternRule(nb, lantern_delta, ratio=False, reference_residual=reference_residual)
        return LanternRule(nb, lantern_lambda, ratio=True, reference_residual=reference_residual)
    from . import rules_registry

    return rules_registry.make(name, engine, **kw)
