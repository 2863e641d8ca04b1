"""Slow, loop-based oracles for the torch references (the references are vectorised; these follow the
definitions literally) and small random-input builders shared by the kernel tests."""
from __future__ import annotations

import math

import torch

from vvs_engine.sampling import SamplingParams, cfg_combine, process_logits

POISON_F = float("nan")
POISON_I = -(2**62)


def random_tree(n: int, max_depth: int, gen: torch.Generator):
    """Parents of a random tree with n nodes and depth <= max_depth (node 0 = root, parents[i] < i)."""
    parents = [-1]
    depth = [0]
    for i in range(1, n):
        candidates = [j for j in range(i) if depth[j] < max_depth]
        j = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
        parents.append(j)
        depth.append(depth[j] + 1)
    return torch.tensor(parents, dtype=torch.long)


def sibling_lists(parents: torch.Tensor, gen: torch.Generator):
    """first_child / next_sibling arrays with the children of each node in a random order."""
    n = parents.shape[0]
    first_child = [-1] * n
    next_sibling = [-1] * n
    for node in range(n):
        kids = [i for i in range(n) if int(parents[i]) == node]
        kids = [kids[int(j)] for j in torch.randperm(len(kids), generator=gen)]
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
        if kids:
            first_child[node] = kids[0]
    return torch.tensor(first_child), torch.tensor(next_sibling)


def tree_meta_oracle(parents: torch.Tensor, max_depth: int):
    n = parents.shape[0]
    par = parents.tolist()
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    paths = torch.full((n, max_depth + 1), -1, dtype=torch.long)
    for i in range(n):
        chain = [i]
        while par[chain[-1]] >= 0:
            chain.append(par[chain[-1]])
        for j in chain:
            mask[i, j] = True
        depth[i] = len(chain) - 1
        for pos, node in enumerate(reversed(chain)):
            paths[i, pos] = node
    is_leaf = torch.tensor([all(p != i for p in par) for i in range(n)])
    return mask, depth, paths, is_leaf


def accept_walk_oracle(accepted, first_child, next_sibling, max_depth: int):
    acc, fc, ns = accepted.tolist(), first_child.tolist(), next_sibling.tolist()
    path = [0]
    node = 0
    while len(path) <= max_depth:
        child = fc[node]
        while child >= 0 and not acc[child]:
            child = ns[child]
        if child < 0:
            break
        path.append(child)
        node = child
    n_acc = len(path) - 1
    return torch.tensor(path + [-1] * (max_depth + 1 - len(path))), torch.tensor([n_acc]), torch.tensor([node])


def lantern_mass_oracle(p, tokens, neighbors, delta: float, ratio: bool):
    """Walks the neighbours one by one, keeping the last prefix whose mass fits the bound. In float32
    scalars, as the op computes (p is float32 there, the bound a float32 product, the prefix sums a
    float32 running sum): a float64 walk with a tolerance disagrees on near-ties (an absolute
    tolerance of 1e-7 swallowed bounds of 1e-8 when p[x] was tiny)."""
    relaxed, m_star = [], []
    for row in range(p.shape[0]):
        x = int(tokens[row])
        px = p[row, x].float()
        bound = (delta - 1.0) * px if ratio else torch.tensor(delta, dtype=torch.float32)
        c, best, m = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32), 0
        for j, nb in enumerate(neighbors[x].tolist()):
            if nb >= 0:
                c = c + p[row, nb].float()
            if bool(c <= bound):
                best, m = c, j + 1
        relaxed.append(float(px + best))
        m_star.append(m)
    return torch.tensor(relaxed), torch.tensor(m_star)


def group_mass_oracle(p, q, members):
    sp, sq = [], []
    for row in range(members.shape[0]):
        toks = [t for t in members[row].tolist() if t >= 0]
        sp.append(sum(float(p[row, t]) for t in toks))
        sq.append(sum(float(q[row, t]) for t in toks))
    return torch.tensor(sp), torch.tensor(sq)


def kv_compact_oracle(k, v, src, dst):
    k2, v2 = k.clone(), v.clone()
    for j_src, j_dst in zip(src.tolist(), dst.tolist()):
        k2[:, :, :, j_dst] = k[:, :, :, j_src]
        v2[:, :, :, j_dst] = v[:, :, :, j_src]
    return k2, v2


def tree_attention_oracle(q, k, v, prefix_len, local, key_valid=None):
    """Per (row, head, query): softmax over exactly the visible slots, in float64."""
    B, H, Q, D = q.shape
    P = int(prefix_len.reshape(-1)[0])
    out = torch.zeros(B, H, Q, D, dtype=torch.float64)
    for b in range(B):
        slots_prefix = [s for s in range(P) if key_valid is None or bool(key_valid[b if key_valid.shape[0] > 1 else 0, s])]
        for i in range(Q):
            slots = slots_prefix + [P + j for j in range(Q) if bool(local[i, j])]
            idx = torch.tensor(slots)
            for h in range(H):
                kk = k[b, h, idx].double()
                w = torch.softmax(kk @ q[b, h, i].double() / math.sqrt(D), 0)
                out[b, h, i] = w @ v[b, h, idx].double()
    return out


def draft_topk_oracle(logits, cfg_scale, temperature, top_k, top_p, k, noise=None):
    x = logits.float()
    if cfg_scale != 1.0:
        x = cfg_combine(x, cfg_scale)
    p = process_logits(x, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, cfg_scale=1.0))
    tokens, logp = [], []
    for row in range(p.shape[0]):
        score = p[row] if noise is None else p[row] / noise[row]
        order = sorted(range(p.shape[1]), key=lambda t: (-float(score[t]), t))[:k]
        tokens.append(order)
        logp.append([math.log(float(p[row, t])) if float(p[row, t]) > 0 else -math.inf for t in order])
    return torch.tensor(tokens), torch.tensor(logp)
