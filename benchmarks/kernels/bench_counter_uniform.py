"""Counter-based uniforms of a verify round (acceptance lanes for every tree node + the residual
sample): the Triton kernel (one launch) vs the torch reference it replaces (``reference.counter_uniform``,
about thirty integer ops), with ``torch.rand`` (Philox, one launch, but not keyed by image and step:
not batch-invariant) as the library baseline for the cost of drawing the same number of uniforms.

    python benchmarks/kernels/bench_counter_uniform.py [--quick]
"""
import torch

from common import Results, device, median_ms, parse_args, triton_launchers

from vvs_engine.kernels import reference as R
from vvs_engine.rng import CounterRNG, Streams


def main():
    args = parse_args(__doc__)
    dev = device()
    tk = triton_launchers()
    res = Results("counter_uniform")
    for B in ([1, 16] if args.quick else [1, 4, 16, 64]):
        for lanes in ([59] if args.quick else [59, 1024]):
            rng = CounterRNG(0, torch.arange(B, device=dev))
            step = torch.arange(B, device=dev)
            streams = rng.stream_offsets([Streams.ACCEPT, Streams.SAMPLE])
            shape = f"B{B} streams2 lanes{lanes}"
            res.add("any", shape, "reference (torch int64 ops)",
                    median_ms(lambda: R.counter_uniform(rng.key, step, streams, lanes), args.quick))
            res.add("any", shape, "torch.rand (Philox, not keyed)",
                    median_ms(lambda: torch.rand(B, 2, lanes, device=dev), args.quick))
            if tk is not None:
                res.add("any", shape, "triton counter_uniform",
                        median_ms(lambda: tk.counter_uniform(rng.key, step, streams, lanes), args.quick))
    print("wrote", res.save(args.out, plot=not args.no_plot))


if __name__ == "__main__":
    main()
