"""Acceptance rules behind one interface, and the vectorised, batched tree verification that runs them.

Verification walks B draft trees with the target's processed distributions ``p[b, i]`` (the target's
prediction *after* node i, i.e. for i's children). The B trees are folded into one forest of B*N
nodes; for every node at once and sibling by sibling (a loop over at most ``max_children`` ranks,
never over nodes or images), a rule decides whether child x is accepted against the current residual
``r`` of its parent; on rejection the parent's residual is updated. Then the accepted path is walked
from each root (a loop over depth), and the next token is drawn by inverse CDF from the residual of
the last accepted node (its children all failed) or from p itself (it is a leaf): the EAGLE/SpecInfer
recursive rejection scheme, lossless for the exact rule. The uniforms come in as tensors (one per
node, one per image for the next token), so an image's result never depends on its batch.

A rule implements ``accept(r, x, qx, u, ctx) -> (accepted [M] bool, moved [M, V] bool | None)`` and
optionally ``residual``. ``moved`` marks target mass a relaxed rule credited to x; the principled
residual removes it (under the relaxed target those tokens have probability 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import VVSError
from .registry import make, register_rule


@dataclass
class VerifyContext:
    """What a rule may look at, for the M (parent, child) pairs tested in one sibling rank. Node ids
    index the (flattened) forest: ``tree`` is a :class:`FlatTree` under batched verification."""

    tree: object  # FlatTree (or a single-image DraftTree)
    parent: torch.Tensor  # [M] node ids
    child: torch.Tensor  # [M] node ids (clamped; check ``valid``)
    valid: torch.Tensor  # [M] bool
    p: torch.Tensor  # [N, V] unrelaxed processed target distributions per node
    logits: Optional[torch.Tensor] = None  # [N, V] guided target logits per node
    hidden: Optional[torch.Tensor] = None  # [rows, N, D] target features per node (row 0: conditional)
    engine: object = None


class AcceptanceRule:
    name = "exact"
    lossless = True
    greedy_updates_residual = True  # greedy: rejections update the residual the next token comes from

    def greedy_accept(self, r, x, ctx):
        """A rule's own greedy test ([M] bool), or None for the default (argmax of the relaxed r)."""
        return None

    def end_tree(self):
        """Called once a forest is verified: a rule that memoised per-tree terms drops them."""

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


def default_lantern_k(codebook_size: int) -> int:
    """LANTERN's neighbourhood size when none is given: 1/16 of the codebook (the paper used 1000 of
    16384), at least 1."""
    return max(1, codebook_size // 16)


def neighbor_table(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """[K, c] codebook vectors -> [K, k] nearest other codes by L2 distance (LANTERN's latent
    neighbourhoods; only the first k columns of the full sort are ever used)."""
    if k < 1 or k >= codebook.shape[0]:
        raise VVSError(f"lantern-k must be in [1, {codebook.shape[0] - 1}], got {k}")
    d = torch.cdist(codebook.float(), codebook.float())
    d.fill_diagonal_(float("inf"))
    return d.topk(k, dim=1, largest=False).indices


LANTERN_REFERENCES = ("off", "llamagen", "lumina-mgpt")


def check_lantern_reference(value) -> str:
    """``lantern-reference-residual``: off (the principled residual) or the published code family to
    reproduce. Returns the canonical value; a one-line VVSError otherwise."""
    if value is None or value is False:
        return "off"
    if value not in LANTERN_REFERENCES:
        raise VVSError(f"lantern-reference-residual must be one of {', '.join(LANTERN_REFERENCES)} "
                       f"(the published code family to reproduce), got {value!r}")
    return value


class LanternRule(AcceptanceRule):
    """LANTERN (TVD bound δ) or LANTERN++ (``ratio=True``: relaxed mass at most λ·p(x)).

    p̃(x) = p(x) + c_{m*} with c_m the mass of x's m nearest latent neighbours and m* the largest m
    whose c_m fits the bound. The default residual removes x and the m* credited neighbours (the
    relaxed target gives them probability 0), then subtracts q.

    ``reference`` = ``llamagen`` | ``lumina-mgpt`` reproduces the authors' released code instead
    (``evaluate_posterior`` / ``evaluate_posterior_v1`` of each family; docs/reference_modes.md):
    on rejection, when some neighbour prefix was credited (m* > 0), the k + 1 nearest neighbours
    (their table excludes x itself) are removed: from the target for dynamic trees (both families)
    and for static trees in the Lumina-mGPT file, from the *draft* q for static trees in the LlamaGen
    file (the neighbours keep their target mass). An empty residual becomes uniform over the whole
    vocabulary. Greedy: x is accepted iff it is the argmax of softmax(target logits) with p(x)
    raised to p(x) + c_{m*} and every other entry unchanged; rejections leave the target as it is.
    ``neighbors`` needs k + 1 columns in reference mode (k = ``k`` or its column count)."""

    lossless = False

    def __init__(self, neighbors: torch.Tensor, delta: float, ratio: bool = False, reference: str = "off",
                 k: Optional[int] = None):
        self.delta, self.ratio = float(delta), ratio
        self.reference = check_lantern_reference(reference)
        self.ref = self.reference != "off"
        self.k = int(k) if k is not None else neighbors.shape[1]
        self.nb_all = neighbors  # [K, >= k] (k + 1 columns used on reference rejections)
        self.nb = neighbors[:, :self.k].contiguous()
        self.name = "lantern++" if ratio else "lantern"
        self.greedy_updates_residual = not self.ref

    def credit(self, r, x):
        from .. import kernels

        relaxed, m_star = kernels.lantern_mass(r, x, self.nb, self.delta, self.ratio)
        if self.ref:  # the released code's rejection set: k + 1 neighbours, only when m* > 0
            nbx = self.nb_all[x, :self.k + 1]
            cols = (m_star[:, None] > 0).expand(-1, nbx.shape[1])
        else:
            nbx = self.nb[x]  # [M, k]
            cols = torch.arange(nbx.shape[1], device=r.device)[None] < m_star[:, None]
        moved = torch.zeros_like(r, dtype=torch.bool).scatter_(1, nbx, cols)
        return relaxed, moved

    def accept(self, r, x, qx, u, ctx):
        relaxed, moved = self.credit(r, x)
        return u * qx < relaxed, moved

    def greedy_accept(self, r, x, ctx):
        """The released greedy test: argmax of softmax(logits) with p(x) := p(x) + c_{m*}."""
        if not self.ref:
            return None
        g = r
        if ctx is not None and getattr(ctx, "logits", None) is not None:
            g = torch.softmax(ctx.logits[ctx.parent].float(), -1)
        from ..kernels.reference import lantern_mass

        relaxed, _ = lantern_mass(g, x, self.nb, self.delta, self.ratio)
        return g.scatter(1, x[:, None], relaxed[:, None].to(g.dtype)).argmax(-1) == x

    def residual(self, r, q, x, moved):
        if not self.ref:
            return super().residual(r, q, x, moved)
        if moved is None:  # a caller without a credit (VVS's post-verification rollback)
            moved = torch.zeros_like(r, dtype=torch.bool)
        if q is None:  # deterministic drafts (dynamic trees): zero x and the neighbours in the target
            res = r.scatter(1, x[:, None], 0.0).masked_fill(moved, 0.0)
        elif self.reference == "llamagen":  # static tree, LlamaGen file: the neighbours leave q
            res = (r - q.masked_fill(moved, 0.0)).clamp(min=0)
        else:  # static tree, Lumina-mGPT file: the neighbours leave the target
            res = (r.masked_fill(moved, 0.0) - q).clamp(min=0)
        s = res.sum(-1, keepdim=True)
        uniform = torch.full_like(res, 1.0 / res.shape[-1])
        return torch.where(s > 0, res / s.clamp(min=1e-30), uniform)


# --- tree verification ----------------------------------------------------------------------------
@dataclass
class VerifyResult:
    path: torch.Tensor  # [B, max_depth + 1] accepted node ids from the root, -1 padded
    n_accepted: torch.Tensor  # [B] accepted drafted tokens (root excluded)
    last: torch.Tensor  # [B] last node on the path
    next_token: torch.Tensor  # [B] bonus / resampled token


@dataclass
class FlatTree:
    """B draft trees of N nodes seen as one forest of B*N nodes (node b*N + i is node i of image b),
    so a rule runs once over every image's (parent, child) pairs. ``image`` says whose node it is:
    per-tree work that compares nodes (CASCADE's same-level sets) must stay within one image."""

    tokens: torch.Tensor  # [B*N]
    parents: Optional[torch.Tensor]  # [B*N] flat ids, -1 for roots
    depth: Optional[torch.Tensor]  # [B*N]
    children: torch.Tensor  # [B*N, C] flat ids, -1 padded
    image: torch.Tensor  # [B*N] image of each node
    max_depth: int
    q: Optional[torch.Tensor] = None  # [B*N, V]
    sampled: bool = False
    draft_logits: Optional[torch.Tensor] = None  # [B*N, V] drafter logits per node (static trees)


def flatten_trees(tree) -> FlatTree:
    """A batched tree (tokens/parents/depth [B, N], children [B, N, C], paths [B, N, Dmax + 1] or an
    int ``max_depth``, q [B, N, V] or None) -> the :class:`FlatTree` forest."""
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    offset = torch.arange(B, device=dev)[:, None] * N  # [B, 1]
    shift = lambda ids: torch.where(ids >= 0, ids + offset.view(B, *([1] * (ids.dim() - 1))), ids)
    q = getattr(tree, "q", None)
    draft_logits = getattr(tree, "draft_logits", None)
    parents, depth = getattr(tree, "parents", None), getattr(tree, "depth", None)
    return FlatTree(
        tokens=tree.tokens.reshape(-1), parents=None if parents is None else shift(parents).reshape(-1),
        depth=None if depth is None else depth.reshape(-1), children=shift(tree.children).reshape(B * N, -1),
        image=torch.arange(B, device=dev).repeat_interleave(N), max_depth=_max_depth(tree),
        q=None if q is None else q.reshape(B * N, -1), sampled=bool(getattr(tree, "sampled", False)),
        draft_logits=None if draft_logits is None else draft_logits.reshape(B * N, -1))


def verify_tree(tree, p: torch.Tensor, rule: AcceptanceRule, u_accept: torch.Tensor, u_sample: torch.Tensor,
                greedy: bool, logits=None, hidden=None, engine=None) -> VerifyResult:
    """Verify B draft trees at once (no host sync).

    tree: batched fields (tokens [B, N], parents, depth, children [B, N, C], paths [B, N, Dmax + 1],
    q [B, N, V] or None, sampled); p [B, N, V] the processed target distribution after each node;
    u_accept [B, N] the uniform that tests node j against its parent (each node is tested at most
    once); u_sample [B] in (0, 1], the inverse-CDF uniform of the next token; logits [B, N, V] and
    hidden [B, N, D] (the conditional rows' target features) for rules that look at them.

    The exact rule and LANTERN(++) run as one fused op (``kernels.tree_verify``: a Triton program
    per tree on the GPU, :func:`verify_tree_torch` on the CPU); other rules (GSD, CASCADE, wrappers)
    run the vectorised torch walk, which calls the rule once per sibling rank.
    """
    fused = _fused_rule_args(rule)
    if fused is None:
        return verify_tree_torch(tree, p, rule, u_accept, u_sample, greedy, logits, hidden, engine)
    from .. import kernels

    q = tree.q if (getattr(tree, "sampled", False) and getattr(tree, "q", None) is not None) else None
    out = kernels.tree_verify(tree.tokens, tree.children, p, q, u_accept, u_sample, *fused, greedy, _max_depth(tree))
    return VerifyResult(*out)


def _fused_rule_args(rule):
    """(neighbors, delta, ratio, reference_residual) for a rule the fused op implements, else None."""
    if type(rule) in (AcceptanceRule, ExactRule):
        return None, 0.0, False, False
    if type(rule) is LanternRule and not rule.ref:
        return rule.nb, rule.delta, rule.ratio, False
    return None  # the published-code reproduction modes run on the rule objects (verify_tree_torch)


def _max_depth(tree) -> int:
    paths = getattr(tree, "paths", None)
    return paths.shape[-1] - 1 if paths is not None else int(tree.max_depth)


def verify_tree_torch(tree, p: torch.Tensor, rule: AcceptanceRule, u_accept: torch.Tensor, u_sample: torch.Tensor,
                      greedy: bool, logits=None, hidden=None, engine=None) -> VerifyResult:
    """The vectorised walk for any rule (arguments as :func:`verify_tree`): the B trees as one forest,
    a loop over sibling ranks, then a loop over depth."""
    B, N, V = p.shape
    flat = flatten_trees(tree)
    M, C = flat.children.shape
    r = p.reshape(M, V).clone()
    p_flat = p.reshape(M, V)
    q = flat.q.clone() if (flat.sampled and flat.q is not None) else None
    u_node = u_accept.reshape(M)
    logits_flat = None if logits is None else logits.reshape(M, -1)
    hidden_flat = None if hidden is None else hidden.reshape(1, M, -1)
    accepted_child = torch.full((M,), -1, dtype=torch.long, device=p.device)
    parents = torch.arange(M, device=p.device)
    ones = torch.ones(M, dtype=r.dtype, device=p.device)
    for rank in range(C):
        child = flat.children[:, rank]
        valid = (child >= 0) & (accepted_child < 0)
        child_ids = child.clamp(min=0)
        x = flat.tokens[child_ids]
        if q is not None:
            q_norm = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
            qx = q_norm.gather(1, x[:, None])[:, 0]
        else:
            q_norm, qx = None, ones
        ctx = VerifyContext(flat, parents, child_ids, valid, p_flat, logits_flat, hidden_flat, engine)
        ok, moved = rule.accept(r, x, qx, u_node[child_ids], ctx)
        if greedy:
            own = rule.greedy_accept(r, x, ctx)
            ok = _greedy_ok(rule, r, x, moved) if own is None else own
        acc = valid & ok
        accepted_child = torch.where(acc, child, accepted_child)
        rej = valid & ~acc
        if not greedy or rule.greedy_updates_residual:
            r = torch.where(rej[:, None], rule.residual(r, q_norm, x, moved), r)
        if q is not None:
            q = torch.where(rej[:, None], q.scatter(1, x[:, None], 0.0), q)
    end_tree = getattr(rule, "end_tree", None)  # rules outside this class hierarchy (bench's replay) may lack it
    if end_tree is not None:
        end_tree()
    from ..kernels.reference import walk_accepted

    path, n_accepted, last = walk_accepted(accepted_child.view(B, N), flat.max_depth)
    dist = r.view(B, N, V).gather(1, last[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    if greedy:
        next_token = dist.argmax(-1)
    else:
        from ..rng import sample_inverse_cdf

        next_token = sample_inverse_cdf(dist, u_sample.reshape(B))
    return VerifyResult(path, n_accepted, last, next_token)


def _greedy_ok(rule, r, x, moved):
    """Greedy verification: accept x iff it is the argmax of the (relaxed) target distribution."""
    if moved is None:
        return r.argmax(-1) == x
    relaxed = r.masked_fill(moved, 0.0)
    relaxed = relaxed.scatter(1, x[:, None], r.gather(1, x[:, None]) + (r * moved).sum(-1, keepdim=True))
    return relaxed.argmax(-1) == x


LANTERN_RULES = ("lantern", "lantern++")


def make_lantern_rule(engine, name: str = "lantern", lantern_k: Optional[int] = None, lantern_delta: float = 0.2,
                      lantern_lambda: float = 2.0, reference_residual="off") -> LanternRule:
    reference = check_lantern_reference(reference_residual)
    V = engine.vq.config.codebook_size if engine.vq is not None else engine.config.vocab_size
    k = lantern_k or default_lantern_k(V)
    n_cols = k
    if engine.vq is not None:
        k = min(k, V - 1)  # a codebook of V codes has V - 1 neighbours
        n_cols = min(k + 1, V - 1) if reference != "off" else k  # reference rejections remove k + 1
    elif reference != "off":
        n_cols = k + 1
    nb = engine.codebook_neighbors(n_cols)
    bound = lantern_delta if name == "lantern" else lantern_lambda
    return LanternRule(nb, bound, ratio=name == "lantern++", reference=reference, k=k)


register_rule("exact", lambda engine, **options: ExactRule())  # exact takes no options
register_rule("lantern", lambda engine, **kw: make_lantern_rule(engine, "lantern", **kw))
register_rule("lantern++", lambda engine, **kw: make_lantern_rule(engine, "lantern++", **kw))


def make_rule(name: str, engine=None, lantern_k: Optional[int] = None, lantern_delta: float = 0.2,
              lantern_lambda: float = 2.0, reference_residual="off", **kw) -> AcceptanceRule:
    """The rule ``name`` from the registry; the LANTERN options go to the LANTERN rules only."""
    if name in LANTERN_RULES:
        kw = dict(lantern_k=lantern_k, lantern_delta=lantern_delta, lantern_lambda=lantern_lambda,
                  reference_residual=reference_residual)
    return make(name, engine, **kw)
