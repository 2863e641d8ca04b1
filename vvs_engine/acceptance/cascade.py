"""CASCADE's relaxed acceptance (arXiv 2605.07230, summarised in docs/methods.md §3; the reproduced
published variants: docs/reference_modes.md).

Two redundancies of the target across a draft tree relax the acceptance of a drafted token x:

* breadth ("semantic interchangeability"): S(x) = the other nodes of x's depth whose next-token
  predictions have cosine similarity > τ_b with x's. Their tokens would lead to the same
  continuation, so the target's (current, residual) probability of those tokens is credited to x.
  The predictions compared (``source``): ``drafter-logits``, the drafter's CFG-combined top-k logits
  with the masked entries set to 0 (the authors' LlamaGen code); ``drafter``, the drafter's processed
  distribution (softmax; the authors' Lumina-mGPT final code); both need a static tree (dynamic trees
  keep no per-node drafter outputs); ``target-logits``, the target's guided logits; ``target-hidden``,
  the target's last-layer hidden state (conditional CFG row). Target sources come free from
  verification.
* depth ("convergence"), ``depth_mode``: ``parent-child`` (the authors' LlamaGen code):
  s_d(x) = cos(state(parent), state(x)) of the target's guided logits (or hidden states) before and
  after consuming x; ``grandparent-parent`` (their Lumina-mGPT final code): s_d = cos(softmax(h(grand-
  parent)), softmax(h(parent))) with the softmax over the hidden dimensions, independent of x and
  absent at depth 1. If s_d > τ_d and the gate passes, s_d itself is credited. Gates: ``kl`` (LlamaGen
  code: KL(p || softmax of the unit-norm parent logits) < κ, i.e. the target is uncertain),
  ``entropy`` (H(p) > log V − κ, the same idea in closed form), ``nucleus`` (Lumina final: x lies in
  the target's top-0.8 nucleus; it gates the breadth term too), ``none``. ``gate_input``: ``parent``
  evaluates the gate on the unrelaxed target distribution at the parent (once per parent);
  ``residual`` (both authors' codes) on the sibling-updated residual r at the time x is tested.

Presets (``variant``): ``llamagen`` and ``lumina-final`` reproduce the authors' two published codes
(``VARIANTS``); ``engine`` is the project's default (``DEFAULTS``, the reasons next to it).

With A(x) = [gate and s_d > τ_d]·s_d(x) + Σ_{t ∈ tokens(S(x)) \\ {x}} r(t), x is accepted iff
``u·q(x) < r(x) + u·A(x)`` (the spec's ``u ≤ (p + u·A)/q``, strict like the exact rule so that A = 0
is the exact rule bit for bit), i.e. P(accept) = min(1, r(x)/(q(x) − A(x))), always when A ≥ q. On
rejection the residual is the unrelaxed EAGLE one, norm((r − q)⁺): the method is lossy by design.

Choices where the reconstruction leaves room (see the module's tests):
* S(x) credits the probability of the *set of tokens* of S(x), each token once and never x's own
  token (two same-depth nodes can carry the same token under different parents; crediting nodes
  would count such a token twice, and crediting x's own token would double p(x)).
* With ``gate_input parent`` (the default) gates look at the unrelaxed target distribution at the
  parent, so a parent is gated once per verification; the authors gate on the residual.
* S(x) at depth i is built from the nodes of depth i (the authors' Lumina code applies the sets of
  level i + 1 at level i, an indexing slip not reproduced), and nodes of every depth the drafter ran
  get sets (leaves above the deepest level included).
* Greedy decoding: the breadth credit is reported as ``moved`` so greedy accepts x when the target's
  argmax token is interchangeable with x; the depth term is not a probability mass and greedy's
  one-hot target is never "uncertain", so it does not act there.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .verify import AcceptanceRule
from ..errors import VVSError
from .registry import register_rule

SOURCES = ("drafter", "drafter-logits", "target-logits", "target-hidden")
DRAFTER_SOURCES = ("drafter", "drafter-logits")
DEPTH_SOURCES = ("logits", "hidden")
DEPTH_MODES = ("parent-child", "grandparent-parent")
GATES = ("kl", "entropy", "nucleus", "none")
GATE_INPUTS = ("parent", "residual")

# The engine default follows the LlamaGen variant's thresholds and depth term (τ_b 0.9, τ_d 0.625,
# parent-child logits) with three measured changes (figures in benchmarks/studies/spec_zoo/cascade_zoo.py): the breadth
# source is the target's hidden states (on the Zoo model they accepted more at less quality loss than
# drafter predictions, and the paper speaks of "the target model's hidden state"); the gate is the
# Lumina final nucleus gate (the LlamaGen KL gate with κ 4 raised the target NLL of the output by
# ~0.9 nats/token on the Zoo model; the nucleus gate kept it at the exact methods' level); the gate is
# evaluated once per parent on the unrelaxed target (not re-evaluated per sibling on the residual).
DEFAULTS = dict(breadth_threshold=0.9, depth_threshold=0.625, gate="nucleus", source="target-hidden", kappa=4.0,
                depth_source="logits", nucleus=0.8, depth_mode="parent-child", gate_input="parent")
# The authors' published codes (docs/reference_modes.md; "final cascade" commit), option by option.
VARIANTS = {
    "engine": DEFAULTS,
    "llamagen": dict(breadth_threshold=0.9, depth_threshold=0.625, gate="kl", source="drafter-logits", kappa=4.0,
                     depth_source="logits", nucleus=0.8, depth_mode="parent-child", gate_input="residual"),
    "lumina-final": dict(breadth_threshold=0.5, depth_threshold=0.9, gate="nucleus", source="drafter", kappa=4.0,
                         depth_source="hidden", nucleus=0.8, depth_mode="grandparent-parent", gate_input="residual"),
}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def variant_options(variant: str, flag=str) -> dict:
    """The rule options of a named preset (``engine``, ``llamagen``, ``lumina-final``)."""
    if variant not in VARIANTS:
        raise VVSError(f"{flag('variant')} must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return dict(VARIANTS[variant])


def check_options(breadth_threshold, depth_threshold, gate, source, kappa, depth_source, nucleus,
                  depth_mode="parent-child", gate_input="parent", flag=str):
    """One-line VVSErrors for bad CASCADE settings. ``flag(name)`` spells an option in the message."""
    for name, v in (("breadth_threshold", breadth_threshold), ("depth_threshold", depth_threshold)):
        if not _is_number(v) or v < -1:
            raise VVSError(f"{flag(name)} must be a number >= -1 (a cosine threshold; > 1 never fires), got {v!r}")
    if gate not in GATES:
        raise VVSError(f"{flag('gate')} must be one of {', '.join(GATES)}, got {gate!r}")
    if source not in SOURCES:
        raise VVSError(f"{flag('source')} must be one of {', '.join(SOURCES)}, got {source!r}")
    if depth_source not in DEPTH_SOURCES:
        raise VVSError(f"{flag('depth_source')} must be one of {', '.join(DEPTH_SOURCES)}, got {depth_source!r}")
    if not _is_number(kappa) or kappa < 0:
        raise VVSError(f"{flag('kappa')} must be a finite number >= 0 (nats), got {kappa!r}")
    if not _is_number(nucleus) or not 0 < nucleus <= 1:
        raise VVSError(f"{flag('nucleus')} must be in (0, 1], got {nucleus!r}")
    if depth_mode not in DEPTH_MODES:
        raise VVSError(f"{flag('depth_mode')} must be one of {', '.join(DEPTH_MODES)}, got {depth_mode!r}")
    if gate_input not in GATE_INPUTS:
        raise VVSError(f"{flag('gate_input')} must be one of {', '.join(GATE_INPUTS)}, got {gate_input!r}")


# --- the two redundancy signals (vectorised; the tests compare them with slow loops) ---------------
def similarity_sets(vectors: torch.Tensor, depth: torch.Tensor, has: torch.Tensor, threshold: float,
                    image: torch.Tensor | None = None):
    """S as an [N, N] bool matrix: S[i, j] iff j != i, depth[j] == depth[i], both nodes have a
    prediction (``has``) and cos(vectors[i], vectors[j]) > threshold. One N x N product per tree (the
    same-depth blocks of it are the spec's per-level B x B matrices). With ``image`` [N] (batched
    verification: several trees as one forest) only nodes of the same image are compared."""
    z = F.normalize(vectors.float(), dim=-1)
    cos = (z @ z.t()).clamp(-1.0, 1.0)
    N = vectors.shape[0]
    eye = torch.eye(N, dtype=torch.bool, device=vectors.device)
    same_level = (depth[:, None] == depth[None, :]) & ~eye & has[:, None] & has[None, :]
    if image is not None:
        same_level &= image[:, None] == image[None, :]
    return same_level & (cos > threshold)


def set_token_mask(S_rows: torch.Tensor, tokens: torch.Tensor, x: torch.Tensor, vocab: int) -> torch.Tensor:
    """S_rows [M, N] membership, tokens [N] node tokens, x [M] -> [M, V] bool: the tokens of the
    member nodes, each once, x's own token excluded."""
    M, N = S_rows.shape
    counts = torch.zeros(M, vocab, dtype=torch.float32, device=S_rows.device)
    counts.scatter_add_(1, tokens[None].expand(M, N), S_rows.float())
    mask = counts > 0
    return mask.scatter(1, x[:, None], False)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1.0, 1.0)


def kl_to_normalised_logits(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(l / |l|)) per row: the authors' uncertainty gate. softmax of a unit-norm logit
    vector is nearly uniform, so this is about log V - H(p): small when the target is uncertain."""
    lhat = F.normalize(logits.float(), dim=-1)
    log_ref = lhat - torch.logsumexp(lhat, -1, keepdim=True)
    p = p.float()
    return (torch.xlogy(p, p) - p * log_ref).sum(-1)


def entropy(p: torch.Tensor) -> torch.Tensor:
    p = p.float()
    return -torch.xlogy(p, p).sum(-1)


def nucleus_floor(p: torch.Tensor, mass: float) -> torch.Tensor:
    """Per row, the probability of the token at which the descending cumulative mass first reaches
    ``mass``: tokens with p >= it form the target's top-``mass`` nucleus."""
    srt = p.float().sort(-1, descending=True).values
    first = (srt.cumsum(-1) < mass - 1e-7).sum(-1, keepdim=True).clamp(max=p.shape[-1] - 1)
    return srt.gather(-1, first)[..., 0]


class CascadeRule(AcceptanceRule):
    """CASCADE acceptance (see the module doc). Per-tree work (the similarity sets and the depth
    score of every node) is done once per verification, at the first sibling rank; a residual gate
    is evaluated per tested child."""

    name = "cascade"
    lossless = False

    def __init__(self, breadth_threshold=0.9, depth_threshold=0.625, gate="nucleus", source="target-hidden", kappa=4.0,
                 depth_source="logits", nucleus=0.8, depth_mode="parent-child", gate_input="parent"):
        check_options(breadth_threshold, depth_threshold, gate, source, kappa, depth_source, nucleus, depth_mode,
                      gate_input, flag=lambda n: "cascade-" + n.replace("_", "-"))
        self.tau_b, self.tau_d = float(breadth_threshold), float(depth_threshold)
        self.gate, self.source, self.kappa = gate, source, float(kappa)
        self.depth_source, self.nucleus = depth_source, float(nucleus)
        self.depth_mode, self.gate_input = depth_mode, gate_input
        # A cosine (clamped to [-1, 1]) can never exceed a threshold >= 1: such a term is off.
        self.breadth_on, self.depth_on = self.tau_b < 1.0, self.tau_d < 1.0
        self._key = None  # (tree, p, logits, hidden) of the cached per-tree terms
        self._terms = None
        self.counters = None  # set to {} to count, on the device, how often each term acts (benchmarks)

    # --- per-tree terms ---------------------------------------------------------------------------
    def _breadth_vectors(self, ctx):
        """-> (vectors [N, F], has [N]) the per-node next-token predictions compared across a level."""
        tree = ctx.tree
        if self.source in DRAFTER_SOURCES:
            if tree.q is None:
                raise VVSError("cascade-source drafter needs a static tree (dynamic trees keep no per-node "
                               "drafter distributions); use --tree static or a target source")
            # Nodes the drafter never ran (the deepest level) have a zero row and no prediction.
            has = tree.q.sum(-1) > 0
            if self.source == "drafter":
                return tree.q, has
            lg = _need(getattr(tree, "draft_logits", None), "cascade-source drafter-logits needs the drafter's "
                                                             "per-node logits (a static draft tree)")
            return torch.where(tree.q > 0, lg.float(), torch.zeros_like(tree.q)), has
        if self.source == "target-logits":
            v = _need(ctx.logits, "cascade-source target-logits needs the target's per-node logits")
        else:
            v = _need(ctx.hidden, "cascade-source target-hidden needs the target's per-node hidden states")[0]
        return v, torch.ones(v.shape[0], dtype=torch.bool, device=v.device)

    def _gate_rows(self, dist, x, logits_rows) -> torch.Tensor:
        """[M] bool: the gate for drafts x [M] tested against distributions dist [M, V] (kl / entropy:
        the target is uncertain there; nucleus: x lies in its top mass)."""
        if self.gate == "kl":
            logits_rows = _need(logits_rows, "cascade-gate kl needs the target's per-node logits")
            return kl_to_normalised_logits(dist, logits_rows) < self.kappa
        if self.gate == "entropy":
            return entropy(dist) > math.log(dist.shape[-1]) - self.kappa
        if self.gate == "nucleus":
            return dist.gather(1, x[:, None])[:, 0] >= nucleus_floor(dist, self.nucleus)
        return torch.ones_like(x, dtype=torch.bool)

    def _parent_gate(self, ctx) -> torch.Tensor:
        """[N] bool: the gate of every node x on the unrelaxed target distribution at its parent."""
        tree, p = ctx.tree, ctx.p
        par = tree.parents.clamp(min=0)
        logits = ctx.logits[par] if ctx.logits is not None else None
        return self._gate_rows(p[par], tree.tokens, logits)

    def _depth_score(self, ctx) -> torch.Tensor:
        """[N] s_d(x) where the convergence threshold passes at node x, else 0 (gate not applied)."""
        tree = ctx.tree
        par = tree.parents.clamp(min=0)
        if self.depth_source == "logits":
            state = _need(ctx.logits, "cascade depth relaxation needs the target's per-node logits")
        else:
            state = _need(ctx.hidden, "cascade-depth-source hidden needs the target's per-node hidden states")[0]
        if self.depth_mode == "parent-child":
            s_d = cosine(state[par], state)
            has = tree.parents >= 0
        else:  # grandparent vs parent, softmax over the state's dimensions; needs depth >= 2
            sm = torch.softmax(state.float(), -1)
            s_d = cosine(sm[par[par]], sm[par])
            has = tree.depth >= 2
        fire = (s_d > self.tau_d) & has
        return torch.where(fire, s_d, torch.zeros_like(s_d))

    def _tree_terms(self, ctx):
        # verify_tree calls the rule once per sibling rank with the same tree and target outputs; the
        # per-tree terms are computed at the first call. The key is object identity: every round makes
        # a new p (and logits), even where a graph runner hands back one static tree object.
        key = (ctx.tree, ctx.p, ctx.logits, ctx.hidden)
        if self._key is not None and all(a is b for a, b in zip(self._key, key)):
            return self._terms
        tree = ctx.tree
        N = tree.tokens.shape[0]
        S = None
        if self.breadth_on:
            vec, has = self._breadth_vectors(ctx)
            S = similarity_sets(vec, tree.depth, has, self.tau_b, getattr(tree, "image", None))
        depth_score = self._depth_score(ctx) if self.depth_on else torch.zeros(N, device=ctx.p.device)
        gate = None
        if self.gate_input == "parent" and (self.depth_on or (self.breadth_on and self.gate == "nucleus")):
            gate = self._parent_gate(ctx)
        self._key, self._terms = key, (S, depth_score, gate)
        return self._terms

    def end_tree(self):
        # Dropped after each forest, so a compiled round starts from the state it was traced with (a
        # memo kept across rounds is a guard that fails on the next call: one recompile per round kind).
        self._key = self._terms = None

    # --- the rule ---------------------------------------------------------------------------------
    def credit(self, r, x, ctx):
        """-> (A [M] relaxation credit, moved [M, V] bool breadth tokens) for the children ctx.child."""
        M, V = r.shape
        S, depth_score, gate = self._tree_terms(ctx)
        if gate is not None:
            g = gate[ctx.child]
        elif self.gate == "none" or self.gate_input == "parent":  # parent gate unused: no term needs it
            g = torch.ones_like(x, dtype=torch.bool)
        else:  # residual gate: the distribution x is tested against, after earlier siblings' rejections
            logits = ctx.logits[ctx.parent] if ctx.logits is not None else None
            g = self._gate_rows(r, x, logits)
        d = depth_score[ctx.child].to(r.dtype)
        A = torch.where(g, d, torch.zeros_like(d))
        moved = None
        if S is not None:
            moved = set_token_mask(S[ctx.child], ctx.tree.tokens, x, V)
            if self.gate == "nucleus":  # the final variant gates the breadth term too
                moved = moved & g[:, None]
            A = A + (r * moved).sum(-1)
        return A, moved

    def accept(self, r, x, qx, u, ctx):
        px = r.gather(1, x[:, None])[:, 0]
        if ctx is None:  # a chain check without a tree (VVS post-verification): nothing to relax against
            return u * qx < px, None
        A, moved = self.credit(r, x, ctx)
        ok = u * qx < px + u * A
        if self.counters is not None:
            self._count(ctx, ok, u * qx < px, A, ctx.child)
        return ok, moved

    def _count(self, ctx, ok, ok_exact, A, child):
        """Device-side tallies over tested (parent, child) pairs: tested, accepted, accepted only thanks
        to the relaxation, pairs with a non-empty S(x), pairs whose depth term fired."""
        S, depth_score, _ = self._terms
        v = ctx.valid
        tallies = dict(tested=v, accepted=v & ok, relaxed_only=v & ok & ~ok_exact,
                       depth_fired=v & (depth_score[child] != 0))
        if S is not None:
            tallies["breadth_set"] = v & S[child].any(-1)
        for k, t in tallies.items():
            self.counters[k] = self.counters.get(k, 0) + t.sum()

    def residual(self, r, q, x, moved):
        # The unrelaxed EAGLE residual: credited tokens keep their mass (the spec's reconstruction).
        return super().residual(r, q, x, None)


def acceptance_probability(p_x: float, q_x: float, A: float) -> float:
    """Closed form of ``u·q < p + u·A`` for u ~ U(0, 1): min(1, p / (q − A)), 1 when A >= q."""
    if A >= q_x:
        return 1.0
    return min(1.0, p_x / (q_x - A))


def _need(t, msg):
    if t is None:
        raise VVSError(msg)
    return t


def make_cascade_rule(engine=None, variant: str = "engine", **kw) -> CascadeRule:
    """Options of the named preset, overridden by the options given."""
    unknown = sorted(set(kw) - set(DEFAULTS))
    if unknown:
        raise VVSError(f"unknown cascade rule option(s): {', '.join(unknown)}")
    return CascadeRule(**{**variant_options(variant, flag=lambda n: "cascade-" + n), **kw})


register_rule("cascade", make_cascade_rule)
