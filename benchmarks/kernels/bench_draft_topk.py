"""Fused draft sampling (CFG -> temperature -> top-k -> top-p -> top-k candidates by the exponential
race): Triton kernel (chunked from V >= 8192, and the one-program kernel for comparison) vs the torch reference (sort-based, as ``sampling.process_logits``), torch's
sort-based top-k/top-p + multinomial, and FlashInfer's sorting-free sampler where installed.

    python benchmarks/kernels/bench_draft_topk.py [--quick]

``--quick`` (the GPU suite's setting): one sampling setting, the vocabularies in order of importance
(16384 first), and the one-program comparison only at 16384, whose whole-row compile at larger
vocabularies alone can outlast a suite step.
"""
import torch

from common import EMU3_8B, MODELS, Results, device, flashinfer, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R


def torch_sort_sample(logits, cfg, temperature, top_k, top_p):
    """The usual torch pipeline: sort-based top-k/top-p then torch.multinomial (one token per row)."""
    p = R.draft_probs(logits, cfg, temperature, top_k, top_p)
    return torch.multinomial(p, 1)


def main():
    args = parse_args(__doc__)
    dev = device()
    tk, fi = triton_launchers(), flashinfer()
    res = Results("draft_topk")
    settings = [(4.0, 1.0, 1000, 0.95, 10)] if args.quick else [(4.0, 1.0, 1000, 0.95, 10), (4.0, 1.0, 0, 1.0, 10), (1.0, 1.0, 0, 0.9, 4)]
    # One row per distinct vocabulary (16384 one-program-sized rows now take the chunked path).
    models = sorted({m.vocab: m for m in (*MODELS, EMU3_8B)}.values(), key=lambda m: (m.vocab != 16384, m.vocab))
    for model in models:
        # CFG batch 2: the cond and uncond logits rows of one image (one row without CFG).
        B, V = model.cfg_batch // 2, model.vocab
        for cfg, temp, top_k, top_p, k in settings:
            rows = 2 * B if cfg != 1.0 else B
            logits = torch.randn(rows, V, device=dev) * 3
            noise = torch.empty(B, V, device=dev).exponential_()
            shape = f"rows{rows} V{V} cfg{cfg} topk{top_k} topp{top_p} k{k}"
            times = {
                "reference (sort)": median_ms(lambda: R.draft_topk(logits, cfg, temp, top_k, top_p, k, noise), args.quick),
                "torch sort+multinomial": median_ms(lambda: torch_sort_sample(logits, cfg, temp, top_k, top_p), args.quick),
            }
            if fi is not None:
                try:
                    guided = R.draft_probs(logits, cfg, 1.0, 0, 1.0).log()  # CFG outside, as FlashInfer has no CFG
                    times["flashinfer top_k_top_p"] = median_ms(lambda: fi.sampling.top_k_top_p_sampling_from_logits(
                        guided, top_k if top_k else V, top_p), args.quick)
                except Exception as err:
                    print(f"flashinfer skipped: {err}")
            if tk is not None:
                times["triton fused"] = median_ms(lambda: tk.draft_topk(logits, cfg, temp, top_k, top_p, k, noise), args.quick)
                if 8192 <= V <= (16384 if args.quick else 65536):  # the one-program kernel (whole row in registers) for comparison
                    times["triton one-program"] = median_ms(
                        lambda: tk.draft_topk(logits, cfg, temp, top_k, top_p, k, noise, chunk=0), args.quick)
                seed_offset = torch.tensor([0, 0], device=dev)
                times["triton fused, philox"] = median_ms(
                    lambda: tk.draft_topk(logits, cfg, temp, top_k, top_p, k, seed_offset=seed_offset), args.quick)
            base = times["torch sort+multinomial"]
            for name, t in times.items():
                res.add(model.name, shape, name, t, speedup_vs_torch_sort=round(base / t, 3))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
