"""Per-row KV move (an accepted tree path of each row moved after its own prefix, every layer, K and
V, overlapping slots): the Triton kernel (one launch) vs the torch reference (a gather and a scatter
per buffer) and vs a plain device copy of the same bytes (the bandwidth bound).

    python benchmarks/kernels/bench_kv_move_rows.py [--quick]
"""
import torch

from common import MODELS, Results, copy_ms, device, half_dtype, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R


def main():
    args = parse_args(__doc__)
    dev, dtype = device(), half_dtype()
    tk = triton_launchers()
    res = Results("kv_move_rows")
    for model in (MODELS[:1] if args.quick else MODELS):
        L = 2 if (args.quick or dev.type != "cuda") else model.layers
        H, D, S = model.heads, model.head_dim, 1208
        for B in ([1] if args.quick else [1, 4, 16]):
            rows = model.cfg_batch * B
            k = torch.randn(L, rows, H, S, D, device=dev, dtype=dtype)
            v = torch.randn_like(k)
            for accepted in ([6] if args.quick else [4, 6, 16]):
                # row r's accepted path: tree nodes at every third scratch slot after its prefix P_r
                P = 1000 + 7 * torch.arange(rows, device=dev)[:, None]
                src = P + 3 * torch.arange(accepted, device=dev)[None, :]
                dst = P + torch.arange(accepted, device=dev)[None, :]
                moved = 2 * 2 * L * rows * H * accepted * D * k.element_size()  # read + write, K and V
                shape = f"L{L} R{rows} H{H} D{D} n{accepted}"
                gbps = lambda ms: round(moved / ms / 1e6, 2)  # noqa: E731
                t = median_ms(lambda: R.kv_move_rows(k, v, src, dst), args.quick)
                res.add(model.name, shape, "reference (gather + index_put_)", t, GBps=gbps(t))
                if tk is not None:
                    t = median_ms(lambda: tk.kv_move_rows(k, v, src, dst), args.quick)
                    t_copy = copy_ms(moved // 2, dev, dtype, args.quick)
                    res.add(model.name, shape, "triton kv_move_rows", t, GBps=gbps(t),
                            fraction_of_copy_bw=round(t_copy / t, 3))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
