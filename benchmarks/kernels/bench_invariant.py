"""Batch-invariant kernels (deterministic mode on CUDA) against what they replace: the one-tiling
Triton matmul (``invariant_linear``) vs torch's ``F.linear`` (cuBLAS: picks its kernel and split-K by
shape, so not batch-invariant) and the reference (the CPU path: the GEMM padded to 16 rows); the
fixed-split attention (``invariant_attention``) vs the batch-sized-split ``tree_attention`` kernel,
SDPA with a prebuilt mask and the reference. The GEMMs are a round's ``x[M, K] @ W[N, K]^T`` with
M = rows x queries (AR at batch 1 with CFG: 2; a 60-node tree at 8 images: 960). On the CPU only the
torch rows run (Triton under the interpreter is not a timing).

    python benchmarks/kernels/bench_invariant.py [--quick]
"""
import torch
import torch.nn.functional as F

from common import LLAMAGEN_XL, MODELS, Results, device, half_dtype, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R


def gemm_shapes(model):
    """(name, K, N) of a decoder layer's GEMMs and the image head."""
    d = model.dim
    ffn = 4 * d * 2 // 3 // 256 * 256 + 256  # LlamaGen's SwiGLU width, rounded up to 256
    return [("qkv", d, 3 * d), ("wo", d, d), ("ffn_up", d, ffn), ("ffn_down", ffn, d), ("head", d, model.vocab)]


def main():
    args = parse_args(__doc__)
    dev, dtype = device(), half_dtype()
    tk = triton_launchers()
    res = Results("invariant")
    models = [LLAMAGEN_XL] if args.quick else MODELS
    for model in models:
        shapes = gemm_shapes(model)[:2] if args.quick else gemm_shapes(model)
        for name, K, N in shapes:
            for M in ([2, 128] if args.quick else [2, 16, 128, 960]):
                x = torch.randn(M, K, device=dev, dtype=dtype)
                w = torch.randn(N, K, device=dev, dtype=dtype) * 0.02
                shape = f"{name} M{M} K{K} N{N}"
                res.add(model.name, shape, "F.linear (not invariant)", median_ms(lambda: F.linear(x, w), args.quick))
                res.add(model.name, shape, "reference (padded)", median_ms(lambda: R.invariant_linear(x, w), args.quick))
                if tk is not None:
                    res.add(model.name, shape, "triton invariant_linear",
                            median_ms(lambda: tk.invariant_linear(x, w), args.quick))
        B, H, D = model.cfg_batch, model.heads, model.head_dim
        for Q in ([1, 60] if args.quick else [1, 60, 70]):
            for P in ([1144] if args.quick else [121, 1144, 4096]):
                for rows in ([1, 8] if args.quick else [1, 8, 32]):
                    S = (P + Q + 7) // 8 * 8
                    q = torch.randn(B * rows, H, Q, D, device=dev, dtype=dtype)
                    k = torch.randn(B * rows, H, S, D, device=dev, dtype=dtype)
                    v = torch.randn(B * rows, H, S, D, device=dev, dtype=dtype)
                    prefix = torch.full((B * rows,), P, device=dev)
                    local = torch.ones(Q, Q, dtype=torch.bool, device=dev).tril()
                    shape = f"attn rows{B * rows} H{H} D{D} Q{Q} P{P}"
                    res.add(model.name, shape, "reference (SDPA+mask)",
                            median_ms(lambda: R.tree_attention(q, k, v, prefix, local), args.quick))
                    dense = R.local_visibility(prefix, local, S).unsqueeze(1)
                    res.add(model.name, shape, "SDPA prebuilt mask",
                            median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), args.quick))
                    if tk is not None:
                        res.add(model.name, shape, "triton tree_attention (batch-sized splits)",
                                median_ms(lambda: tk.tree_attention(q, k, v, prefix, local), args.quick))
                        res.add(model.name, shape, "triton invariant_attention",
                                median_ms(lambda: tk.invariant_attention(q, k, v, prefix, local), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
