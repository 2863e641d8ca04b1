"""SJD-PAC's draft tree: a fixed *product tree* of candidates (``methods/sjd_pac.py`` fills and verifies
it; docs/jacobi.md "SJD-PAC", the released ``generate_tree_mask_and_retrieve``)."""
from __future__ import annotations

import torch


def tree_size(W: int, D: int) -> int:
    """Nodes of the complete W-ary tree of D levels (root included)."""
    return D if W == 1 else (W ** D - 1) // (W - 1)


class ProductTree:
    """The static layout of L nodes for width W, depth D (all index tables on ``device``):

    * ``M`` main-chain nodes 0..M-1 (node j: branch 0, depth j), then the side nodes in breadth-first
      order: every node at depth d - 1 < D - 1 of the W-ary part gets children of branches 0..W-1 at
      depth d (the main chain's own branch-0 child is the next main node);
    * ``depth``, ``branch`` [N]; ``cell`` [N] = branch * M + depth, the node's entry of the flattened
      candidate table; ``children`` [N, W] in branch order (-1: none); ``ancestor`` [N, N] ancestor-or-self;
    * ``zero_path`` [N, M]: from node n, the node at depth j reached by branch-0 children (the main
      chain's node j once a side subtree ends; ancestors for j < depth(n));
    * ``rows`` [R, D] (R = W^(D-1)): the nodes at depths 0..D-1 of every root-to-depth-(D-1) path, row
      r = sum of branch(depth l) * W^(l-1) (row 0 = the main chain): the released sampler's paths."""

    def __init__(self, L: int, W: int, D: int, device):
        M = L - (tree_size(W, D) - D)
        assert M >= D, (L, W, D)
        self.L, self.W, self.D, self.M = L, W, D, M
        branch, depth, parent = [0] * M, list(range(M)), [j - 1 for j in range(M)]
        level = [0]  # nodes of the W-ary part at the current depth
        for d in range(1, D):
            nxt = []
            for n in level:
                for b in range(W):
                    if b == 0 and n < M:  # a main node's branch-0 child is the next main node
                        nxt.append(d)
                        continue
                    branch.append(b)
                    depth.append(d)
                    parent.append(n)
                    nxt.append(len(branch) - 1)
            level = nxt
        N = len(branch)
        assert N == L, (N, L)
        children = [[-1] * W for _ in range(N)]
        for n in range(1, N):
            children[parent[n]][branch[n]] = n
        zero_path = [[0] * M for _ in range(N)]
        for n in range(N):
            anc, a = {}, n
            while a >= 0:
                anc[depth[a]] = a
                a = parent[a]
            cur = n
            for j in range(M):
                if j <= depth[n]:
                    zero_path[n][j] = anc[j]
                    continue
                cur = children[cur][0] if cur >= 0 and children[cur][0] >= 0 else -1
                zero_path[n][j] = cur if cur >= 0 else j  # main node j once the side subtree ends
        ancestor = torch.zeros(N, N, dtype=torch.bool)
        for n in range(N):
            a = n
            while a >= 0:
                ancestor[n, a] = True
                a = parent[a]
        R = W ** (D - 1)
        rows = []
        for r in range(R):
            digits, x, node, path = [], r, 0, [0]
            for _ in range(D - 1):
                digits.append(x % W)
                x //= W
            for b in digits:
                node = children[node][b]
                path.append(node)
            rows.append(path)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
        self.branch, self.depth, self.parent = t(branch), t(depth), t(parent)
        self.cell = self.branch * M + self.depth
        self.children, self.zero_path, self.rows = t(children), t(zero_path), t(rows)
        self.ancestor = ancestor.to(device)
        self.main = torch.arange(M, device=device)
