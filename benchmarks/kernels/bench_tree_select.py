"""The end of the dynamic draft tree build: the Triton kernel (one launch) vs the torch reference
(``reference.tree_select``, what the build ran before: penalised scores, top-k, sort, the parent
lookup by searchsorted, the token and log-prob gathers, and the tree structure's ancestor mask, depths,
paths, leaves and children table). EAGLE-2's default tree (K = 10, depth 4: 410 candidates, 59 nodes)
and a larger one (depth 6, 100 nodes), for B = 1, 4, 16 sequences. The op does not depend on the
model's width.

    python benchmarks/kernels/bench_tree_select.py [--quick]
"""
import torch

from common import Results, device, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R


def inputs(B, K, depth, dev):
    """Candidates as a build makes them: the root's K children, then per expansion the K best
    frontier nodes' K children each (cumulative log-probs), with the engine's constant tables."""
    level = torch.cat([torch.ones(K, dtype=torch.long)] + [torch.full((K * K,), d + 2) for d in range(depth)])
    parent_col = torch.cat([torch.zeros(K, dtype=torch.long)] + [1 + d * K + torch.arange(K * K) // K for d in range(depth)])
    frontier_offset = torch.cat([torch.zeros(K + 1, dtype=torch.long)] +
                                [torch.full((K,), K + (d - 1) * K * K) for d in range(1, depth)])
    lp = (-torch.rand(B, K) * 3).sort(1, descending=True).values
    scores, frontiers, f_score = [lp], [torch.arange(-1, K).expand(B, K + 1)], lp
    for d in range(depth):
        cum = (f_score[:, :, None] + (-torch.rand(B, K, K) * 5).sort(2, descending=True).values).flatten(1)
        scores.append(cum)
        if d < depth - 1:
            best = cum.topk(K, dim=1).indices
            frontiers.append(best)
            f_score = cum.gather(1, best)
    C = K + depth * K * K
    x = (torch.cat(scores, 1), 1e-6 * level, torch.cat(frontiers, 1), frontier_offset, parent_col,
         torch.randint(0, 16384, (B, 1 + C)), torch.cat([torch.zeros(B, 1), -torch.rand(B, C) * 5], 1))
    return tuple(t.to(dev) for t in x)


def main():
    args = parse_args(__doc__)
    dev = device()
    tk = triton_launchers()
    res = Results("tree_select")
    K = 10
    for depth, total in ([(4, 59)] if args.quick else [(4, 59), (6, 100)]):
        for B in ([1] if args.quick else [1, 4, 16]):
            x = inputs(B, K, depth, dev)
            shape = f"B{B} K{K} depth{depth} C{x[0].shape[1]} N{total}"
            res.add("EAGLE-2 tree", shape, "reference (torch ops)",
                    median_ms(lambda: R.tree_select(*x, total, depth + 1, K), args.quick))
            if tk is not None:
                res.add("EAGLE-2 tree", shape, "triton tree_select",
                        median_ms(lambda: tk.tree_select(*x, total, depth + 1, K), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
