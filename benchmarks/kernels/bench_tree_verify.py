"""Fused tree verification: the Triton kernel (one program per tree) vs the torch walk it replaces
(``reference.tree_verify``, the engine's CPU path), exact rule and LANTERN, batches of 1-16 trees.
No installable library implements the relaxed rules; SGLang's sgl-kernel tree sampling (exact rule,
CUDA only) takes its scheduler's own index layout and is not wired in as a baseline.

    python benchmarks/kernels/bench_tree_verify.py [--quick]
"""
import torch

from common import MODELS, Results, device, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R
from vvs_engine.drafting.tree import children_table


def bushy_batch(B, N, branching, V, dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1] + [(i - 1) // branching for i in range(1, N)])
    children = children_table(parents, branching)[None].repeat(B, 1, 1)
    depth = R.tree_meta(parents, N)[1]
    tokens = torch.randint(0, V, (B, N), generator=gen)
    logits = 3 * torch.randn(B, N, V, generator=gen)
    first_tok = tokens.gather(1, children[:, :, 0].clamp(min=0))
    logits.scatter_add_(2, first_tok[:, :, None], torch.full((B, N, 1), 6.0))  # deep accepted paths
    p = torch.softmax(logits, -1)
    u_accept, u_sample = 1.0 - torch.rand(B, N, generator=gen), 1.0 - torch.rand(B, generator=gen)
    to = lambda t: t.to(dev)
    return to(tokens), to(children), to(p), to(u_accept), to(u_sample), int(depth.max())


def main():
    args = parse_args(__doc__)
    dev = device()
    tk = triton_launchers()
    res = Results("tree_verify")
    for model in MODELS:
        V = model.image_vocab
        nb = torch.randint(0, V, (V, 1000), device=dev)
        for B in ([1] if args.quick else [1, 4, 16]):
            tokens, children, p, ua, us, D = bushy_batch(B, 59, 4, V, dev)
            shape = f"B{B} N59 V{V}"
            for rule, neighbors, delta in (("exact", None, 0.0), ("lantern", nb, 0.2)):
                call = lambda impl: impl(tokens, children, p, None, ua, us, neighbors, delta, False, False, False, D)
                res.add(model.name, shape, f"{rule} reference", median_ms(lambda: call(R.tree_verify), args.quick))
                if tk is not None:
                    res.add(model.name, shape, f"{rule} triton", median_ms(lambda: call(tk.tree_verify), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
