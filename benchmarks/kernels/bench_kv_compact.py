"""KV compaction after acceptance (every layer, K and V, overlapping ranges) and the stale-feature
row gather/scatter: CUDA kernels vs the torch reference, with achieved bandwidth against a plain
device-to-device copy of the same bytes.

    python benchmarks/kernels/bench_kv_compact.py [--quick]
"""
import torch

from common import MODELS, Results, copy_ms, cuda_launchers, device, half_dtype, median_ms, parse_args

from vvs_engine.kernels import reference as R


def main():
    args = parse_args(__doc__)
    dev, dtype = device(), half_dtype()
    C = cuda_launchers()
    res = Results("kv_compact")
    for model in MODELS:
        L = 2 if (args.quick or not dev.type == "cuda") else model.layers
        B, H, D = model.cfg_batch, model.heads, model.head_dim
        S = 1208
        k = torch.randn(L, B, H, S, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        for accepted in ([8] if args.quick else [4, 8, 16]):
            # Accepted path nodes sit at scattered tree slots after the prefix; they move to the front.
            P = 1144 - 64
            src = torch.arange(P + 1, P + 1 + 3 * accepted, 3, device=dev)
            dst = torch.arange(P, P + accepted, device=dev)
            moved = 2 * 2 * L * B * H * accepted * D * k.element_size()  # read + write, K and V
            shape = f"L{L} B{B} H{H} D{D} n{accepted}"
            gbps = lambda ms: round(moved / ms / 1e6, 2)  # noqa: E731
            t = median_ms(lambda: R.kv_compact(k, v, src, dst), args.quick)
            res.add(model.name, shape, "reference (index_select+index_copy)", t, GBps=gbps(t))
            if C is not None:
                t = median_ms(lambda: C.kv_compact(k, v, src, dst), args.quick)
                t_copy = copy_ms(moved // 2, dev, dtype, args.quick)
                res.add(model.name, shape, "cuda kv_compact", t, GBps=gbps(t), fraction_of_copy_bw=round(t_copy / t, 3))
        x = torch.randn(B, S, model.dim, device=dev, dtype=dtype)
        idx = torch.arange(100, 164, device=dev)
        src_rows = torch.randn(B, 64, model.dim, device=dev, dtype=dtype)
        shape = f"B{B} S{S} d{model.dim} n64"
        res.add(model.name, shape, "gather_rows reference", median_ms(lambda: R.gather_rows(x, idx), args.quick))
        res.add(model.name, shape, "scatter_rows_ reference", median_ms(lambda: R.scatter_rows_(x, idx, src_rows), args.quick))
        if C is not None:
            res.add(model.name, shape, "gather_rows cuda", median_ms(lambda: C.gather_rows(x, idx), args.quick))
            res.add(model.name, shape, "scatter_rows_ cuda", median_ms(lambda: C.scatter_rows_(x, idx, src_rows), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
