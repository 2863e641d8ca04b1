"""One expansion level of the dynamic draft tree: the Triton kernel (one launch) vs the torch
reference (``reference.tree_level``, the dozen small ops the level used to launch: cumulative scores,
top-K, gathers, CFG row copies, ancestor columns, the drafter's attention mask). EAGLE-2's tree
(K = C = 10) at each model's width, CFG rows, the drafter cache of an image plus the tree's scratch.

    python benchmarks/kernels/bench_tree_level.py [--quick]
"""
import torch

from common import MODELS, Results, device, half_dtype, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R


def inputs(B, K, D, W, S, dev, dtype):
    rows = 2 * B
    score = torch.randn(B, K, device=dev)
    clp = -torch.rand(B, K, K, device=dev) * 5
    ctok = torch.randint(0, 16384, (B, K, K), device=dev)
    feats = torch.randn(rows, K, D, device=dev, dtype=dtype)
    anc = torch.rand(rows, K, W, device=dev) < 0.5
    plen = torch.full((rows,), S - 4 * K - 1, dtype=torch.long, device=dev)
    return score, clp, ctok, feats, anc, plen


def main():
    args = parse_args(__doc__)
    dev, dtype = device(), half_dtype()
    tk = triton_launchers()
    res = Results("tree_level")
    K = 10
    for m in (MODELS[:1] if args.quick else MODELS):
        for B in ([1] if args.quick else [1, 4, 16]):
            for W in ([K] if args.quick else [K, 3 * K]):
                S = 600 + 4 * K  # a 576-token image + condition, then the tree's scratch slots
                x = inputs(B, K, m.dim, W, S, dev, dtype)
                shape = f"B{B} K{K} C{K} D{m.dim} W{W} S{S}"
                res.add(m.name, shape, "reference (torch ops)", median_ms(lambda: R.tree_level(*x, S), args.quick))
                if tk is not None:
                    res.add(m.name, shape, "triton tree_level", median_ms(lambda: tk.tree_level(*x, S), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
