"""Tree attention: Triton kernel vs the torch reference (SDPA with a dense mask built per call), SDPA
with a prebuilt mask, FlashInfer's custom-mask prefill where installed, and flash-attn's
``flash_attn_with_kvcache`` for AR decode (Q = 1) where installed. Q = 1 rows are the AR step's
attention (one-query split-KV kernel); Q = 60 / 70 are verification trees.

    python benchmarks/kernels/bench_tree_attention.py [--quick]
"""
import torch
import torch.nn.functional as F

from common import MODELS, PREFIXES, TREE_SIZES, Results, device, flashinfer, half_dtype, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import flash

from vvs_engine.kernels import reference as R


def tree_local_mask(Q: int, dev) -> torch.Tensor:
    """A bushy tree's ancestor mask (node i's parent is (i - 1) // 4), the shape EAGLE-2 trees have."""
    parents = torch.tensor([-1] + [(i - 1) // 4 for i in range(1, Q)], device=dev)
    return R.tree_meta(parents, Q)[0]


def main():
    args = parse_args(__doc__)
    dev, dtype = device(), half_dtype()
    tk, fi = triton_launchers(), flashinfer()
    res = Results("tree_attention")
    for model in MODELS:
        trees = TREE_SIZES[:2] if args.quick else TREE_SIZES
        prefixes = PREFIXES[2:3] if args.quick else PREFIXES
        for Q in trees:
            for P in prefixes:
                B, H, D = model.cfg_batch, model.heads, model.head_dim
                S = (P + Q + 7) // 8 * 8
                q = torch.randn(B, H, Q, D, device=dev, dtype=dtype)
                k = torch.randn(B, H, S, D, device=dev, dtype=dtype)
                v = torch.randn(B, H, S, D, device=dev, dtype=dtype)
                prefix_len = torch.tensor([P], device=dev)
                local = tree_local_mask(Q, dev)
                shape = f"B{B} H{H} D{D} Q{Q} P{P}"
                times = {}
                times["reference (SDPA+mask build)"] = median_ms(lambda: R.tree_attention(q, k, v, prefix_len, local), args.quick)
                dense = R.local_visibility(prefix_len, local, S).unsqueeze(1)
                times["SDPA prebuilt mask"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), args.quick)
                if fi is not None:
                    try:
                        # NHD layout, one call per CFG row, mask over [prefix | tree] only up to P + Q.
                        qs = [q[b].transpose(0, 1).contiguous() for b in range(B)]
                        ks = [k[b, :, : P + Q].transpose(0, 1).contiguous() for b in range(B)]
                        vs = [v[b, :, : P + Q].transpose(0, 1).contiguous() for b in range(B)]
                        mask = dense[0, 0, :, : P + Q].contiguous()
                        times["flashinfer custom mask"] = median_ms(lambda: [fi.single_prefill_with_kv_cache(
                            qs[b], ks[b], vs[b], custom_mask=mask) for b in range(B)], args.quick)
                    except Exception as err:  # API differences between FlashInfer versions
                        print(f"flashinfer skipped: {err}")
                if Q == 1 and flash.kvcache_fn() is not None and dev.type == "cuda":
                    times["flash_attn kvcache"] = median_ms(lambda: flash.attend(q, k, v, prefix_len + 1, causal=False), args.quick)
                if tk is not None:
                    times["triton"] = median_ms(lambda: tk.tree_attention(q, k, v, prefix_len, local), args.quick)
                best_baseline = min(t for name, t in times.items() if name != "triton")
                for name, t in times.items():
                    extra = {"speedup_vs_best_baseline": round(best_baseline / t, 3)} if name == "triton" else {}
                    res.add(model.name, shape, name, t, **extra)
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
