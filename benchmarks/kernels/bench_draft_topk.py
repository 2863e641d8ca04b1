"""Fused draft sampling (CFG -> temperature -> top-k -> top-p -> top-k candidates by the exponential
race): Triton kernel (chunked from V >= 8192, and the one-program kernel for comparison) vs the torch reference (sort-based, as ``sampling.process_logits``), torch's
sort-based top-k/top-p + multinomial, and FlashInfer's sorting-free sampler where installed.

    python benchmarks/kernels/bench_draft_topk.py [--quick]

``--quick`` (the GPU suite's setting): one sampling setting, the vocabularies in order of importance
(16384 first), the fused kernel right after torch's sort-based baseline, and no one-program
comparison (its whole-row compile alone can outlast a suite step).
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
            base = median_ms(lambda: torch_sort_sample(logits, cfg, temp, top_k, top_p), args.quick)

            def add(name, fn):  # each row is written as soon as it is measured (a step limit keeps it)
                t = base if fn is None else median_ms(fn, args.quick)
                res.add(model.name, shape, name, t, speedup_vs_torch_sort=round(base / t, 3))

            add("torch sort+multinomial", None)
            if tk is not None:
                add("triton fused", lambda: tk.draft_topk(logits, cfg, temp, top_k, top_p, k, noise))
            add("reference (sort)", lambda: R.draft_topk(logits, cfg, temp, top_k, top_p, k, noise))
            if fi is not None:
                try:
                    guided = R.draft_probs(logits, cfg, 1.0, 0, 1.0).log()  # CFG outside, as FlashInfer has no CFG
                    add("flashinfer top_k_top_p", lambda: fi.sampling.top_k_top_p_sampling_from_logits(
                        guided, top_k if top_k else V, top_p))
                except Exception as err:
                    print(f"flashinfer skipped: {err}")
            if tk is not None:
                seed_offset = torch.tensor([0, 0], device=dev)
                add("triton fused, philox",
                    lambda: tk.draft_topk(logits, cfg, temp, top_k, top_p, k, seed_offset=seed_offset))
                # The one-program kernel (whole row in registers) for comparison; its compile at large
                # vocabularies is slow, so --quick leaves it out.
                if not args.quick and 8192 <= V <= 65536:
                    add("triton one-program", lambda: tk.draft_topk(logits, cfg, temp, top_k, top_p, k, noise, chunk=0))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
