"""Batched tree verification: every image of a batch gets what it would get alone, for every rule,
greedy and sampled; the exact rule matches a slow node-by-node walk."""
from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import pytest
import torch

from vvs_engine.acceptance.verify import ExactRule, LanternRule, neighbor_table, verify_tree
from vvs_engine.acceptance.cascade import CascadeRule
from vvs_engine.acceptance.gsd import GroupedRule
from vvs_engine.rng import sample_inverse_cdf
from vvs_engine.drafting.tree import tree_structure

V = 24


def random_trees(B, N, max_depth, seed, sampled=False, peak=3.0):
    """B random trees of N nodes (different shapes), with target distributions p, logits and hidden
    states that make drafts often but not always acceptable."""
    g = torch.Generator().manual_seed(seed)
    fields = {k: [] for k in ("tokens", "parents", "depth", "paths", "children", "mask")}
    for _ in range(B):
        parents = [-1]
        depth = [0]
        for i in range(1, N):
            cands = [j for j in range(i) if depth[j] < max_depth]
            j = cands[int(torch.randint(0, len(cands), (1,), generator=g))]
            parents.append(j)
            depth.append(depth[j] + 1)
        mask, dep, paths, _, children = (t[0] for t in tree_structure(torch.tensor(parents)[None], max_depth, N))
        fields["parents"].append(torch.tensor(parents))
        fields["depth"].append(dep)
        fields["paths"].append(paths)
        fields["children"].append(children)
        fields["mask"].append(mask)
        fields["tokens"].append(torch.randint(0, V, (N,), generator=g))
    tree = SimpleNamespace(**{k: torch.stack(v) for k, v in fields.items()}, q=None, sampled=sampled)
    logits = torch.randn(B, N, V, generator=g, dtype=torch.float64) * peak
    # make the drafted tokens likely under their parent's distribution, so paths go deep
    par = tree.parents.clamp(min=0)
    first = tree.children[:, :, 0]  # the first child of each node gets the largest boost (greedy paths)
    for b in range(B):
        for i in range(1, N):
            logits[b, par[b, i], tree.tokens[b, i]] += peak * (2 if first[b, par[b, i]] == i else 1)
    p = torch.softmax(logits, -1)
    if sampled:
        tree.q = torch.softmax(logits + torch.randn(B, N, V, generator=g, dtype=torch.float64), -1)
    hidden = torch.randn(B, N, 8, generator=g, dtype=torch.float64)
    u_accept = 1.0 - torch.rand(B, N, generator=g, dtype=torch.float64)
    u_sample = 1.0 - torch.rand(B, generator=g, dtype=torch.float64)
    return tree, p, logits, hidden, u_accept, u_sample


def one_image(tree, b):
    return SimpleNamespace(tokens=tree.tokens[b:b + 1], parents=tree.parents[b:b + 1], depth=tree.depth[b:b + 1],
                           paths=tree.paths[b:b + 1], children=tree.children[b:b + 1],
                           q=None if tree.q is None else tree.q[b:b + 1], sampled=tree.sampled)


def rules():
    g = torch.Generator().manual_seed(0)
    nb = neighbor_table(torch.randn(V, 4, generator=g), 5)
    return {
        "exact": lambda: ExactRule(),
        "lantern": lambda: LanternRule(nb, 0.2),
        "lantern++": lambda: LanternRule(nb, 2.0, ratio=True),
        "lantern-ref": lambda: LanternRule(nb, 0.2, reference="llamagen", k=4),
        "gsd": lambda: GroupedRule(group=4, prob_threshold=0.15, dist_threshold=math.inf),
        "cascade-hidden": lambda: CascadeRule(breadth_threshold=0.3, depth_threshold=0.2, gate="none",
                                              source="target-hidden"),
        "cascade-logits": lambda: CascadeRule(breadth_threshold=0.3, depth_threshold=0.2, gate="nucleus",
                                              source="target-logits"),
    }


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("rule_name", list(rules()))
def test_batch_equals_each_image_alone(rule_name, sampled, greedy):
    B, N = 5, 13
    tree, p, logits, hidden, u_accept, u_sample = random_trees(B, N, 4, seed=zlib.crc32(rule_name.encode()) % 1000, sampled=sampled)
    make = rules()[rule_name]
    res = verify_tree(tree, p, make(), u_accept, u_sample, greedy, logits=logits, hidden=hidden)
    assert res.path.shape == (B, 5) and res.n_accepted.shape == (B,) and res.next_token.shape == (B,)
    for b in range(B):
        one = verify_tree(one_image(tree, b), p[b:b + 1], make(), u_accept[b:b + 1], u_sample[b:b + 1], greedy,
                          logits=logits[b:b + 1], hidden=hidden[b:b + 1])
        assert torch.equal(res.path[b], one.path[0])
        assert res.n_accepted[b] == one.n_accepted[0] and res.last[b] == one.last[0]
        assert res.next_token[b] == one.next_token[0]
    assert (res.n_accepted > 0).any()  # the trees are not trivially rejected


def slow_exact_verify(tree, p, u_accept, u_sample, greedy, b):
    """Node by node, rank by rank (the EAGLE/SpecInfer recursive rejection walk) for image b."""
    node, path = 0, [0]
    while True:
        r = p[b, node].clone()
        q = None if not tree.sampled else tree.q[b, node].clone()
        nxt = None
        for child in tree.children[b, node].tolist():
            if child < 0:
                break
            x = int(tree.tokens[b, child])
            if greedy:
                ok = int(r.argmax()) == x
            else:
                qx = 1.0 if q is None else float(q[x] / q.sum())
                ok = float(u_accept[b, child]) * qx < float(r[x])
            if ok:
                nxt = child
                break
            res = r.clone()
            if q is None:
                res[x] = 0
            else:
                res = (r - q / q.sum()).clamp(min=0)
                q[x] = 0
            r = res / res.sum() if res.sum() > 1e-12 else r / r.sum()
        if nxt is None:
            token = int(r.argmax()) if greedy else int(sample_inverse_cdf(r[None], u_sample[b:b + 1])[0])
            return path, token
        node = nxt
        path.append(node)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_exact_rule_matches_slow_walk(sampled, greedy):
    B, N = 6, 17
    tree, p, logits, _, u_accept, u_sample = random_trees(B, N, 5, seed=3 + sampled, sampled=sampled)
    res = verify_tree(tree, p, ExactRule(), u_accept, u_sample, greedy)
    for b in range(B):
        path, token = slow_exact_verify(tree, p, u_accept, u_sample, greedy, b)
        got = [int(i) for i in res.path[b] if i >= 0]
        assert got == path
        assert int(res.n_accepted[b]) == len(path) - 1 and int(res.last[b]) == path[-1]
        assert int(res.next_token[b]) == token


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("rule_name", ["exact", "lantern", "lantern++"])
def test_fused_op_equals_the_rule_walk(rule_name, sampled, greedy):
    """Exact and LANTERN(++) go through kernels.tree_verify; it must decide exactly as the rule
    objects do in the generic walk."""
    from vvs_engine.acceptance.verify import verify_tree_torch

    B, N = 4, 15
    tree, p, logits, hidden, u_accept, u_sample = random_trees(B, N, 4, seed=11, sampled=sampled)
    rule = rules()[rule_name]()
    fused = verify_tree(tree, p, rule, u_accept, u_sample, greedy)
    walk = verify_tree_torch(tree, p, rule, u_accept, u_sample, greedy)
    for a, b in zip((fused.path, fused.n_accepted, fused.last, fused.next_token),
                    (walk.path, walk.n_accepted, walk.last, walk.next_token)):
        assert torch.equal(a, b)
