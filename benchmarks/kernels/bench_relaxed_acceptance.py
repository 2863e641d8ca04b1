"""Relaxed acceptance for a whole tree level: LANTERN neighbour mass and GSD group mass, Triton vs
the torch reference.

    python benchmarks/kernels/bench_relaxed_acceptance.py [--quick]
"""
import torch

from common import MODELS, Results, device, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R


def main():
    args = parse_args(__doc__)
    dev = device()
    tk = triton_launchers()
    res = Results("relaxed_acceptance")
    for model in MODELS:
        V = model.image_vocab
        for M, k in ([(64, 1000)] if args.quick else [(64, 100), (64, 1000), (128, 1000)]):
            p = torch.softmax(torch.randn(M, V, device=dev), -1)
            tokens = torch.randint(0, V, (M,), device=dev)
            neighbors = torch.randint(0, V, (V, k), device=dev)
            shape = f"M{M} V{V} k{k}"
            res.add(model.name, shape, "lantern reference", median_ms(lambda: R.lantern_mass(p, tokens, neighbors, 0.2, False), args.quick))
            if tk is not None:
                res.add(model.name, shape, "lantern triton", median_ms(lambda: tk.lantern_mass(p, tokens, neighbors, 0.2, False), args.quick))
        M, G = 64, 8
        p = torch.softmax(torch.randn(M, V, device=dev), -1)
        q = torch.softmax(torch.randn(M, V, device=dev), -1)
        members = torch.randint(-1, V, (M, G), device=dev)
        shape = f"M{M} V{V} G{G}"
        res.add(model.name, shape, "group reference", median_ms(lambda: R.group_mass(p, q, members), args.quick))
        if tk is not None:
            res.add(model.name, shape, "group triton", median_ms(lambda: tk.group_mass(p, q, members), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
