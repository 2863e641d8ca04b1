"""Tree metadata from parents and the acceptance walk: CUDA kernels vs the vectorised torch references.

    python benchmarks/kernels/bench_tree_ops.py [--quick]
"""
import torch

from common import Results, cuda_launchers, device, median_ms, parse_args

from vvs_engine.kernels import reference as R


def bushy_tree(n: int, branching: int, dev):
    parents = torch.tensor([-1] + [(i - 1) // branching for i in range(1, n)], device=dev)
    depth = R.tree_meta(parents.cpu(), n)[1]
    return parents, int(depth.max())


def sibling_lists(parents):
    n = parents.shape[0]
    first_child = torch.full((n,), -1, dtype=torch.long)
    next_sibling = torch.full((n,), -1, dtype=torch.long)
    par = parents.tolist()
    for i in range(n - 1, 0, -1):  # children in index order
        next_sibling[i] = first_child[par[i]]
        first_child[par[i]] = i
    return first_child.to(parents.device), next_sibling.to(parents.device)


def main():
    args = parse_args(__doc__)
    dev = device()
    C = cuda_launchers()
    res = Results("tree_ops")
    for n, branching in ([(64, 4)] if args.quick else [(59, 4), (64, 4), (64, 2), (64, 10)]):
        parents, max_depth = bushy_tree(n, branching, dev)
        fc, ns = sibling_lists(parents)
        accepted = torch.rand(n, device=dev) < 0.7
        shape = f"N{n} branching{branching} depth{max_depth}"
        res.add("tree", shape, "tree_meta reference", median_ms(lambda: R.tree_meta(parents, max_depth), args.quick))
        res.add("tree", shape, "accept_walk reference", median_ms(lambda: R.accept_walk(accepted, fc, ns, max_depth), args.quick))
        if C is not None:
            res.add("tree", shape, "tree_meta cuda", median_ms(lambda: C.tree_meta(parents, max_depth), args.quick))
            res.add("tree", shape, "accept_walk cuda", median_ms(lambda: C.accept_walk(accepted, fc, ns, max_depth), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
