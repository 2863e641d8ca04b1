"""The CUDA-graph AR step (the ``ARDecoder``'s ``ar_step`` round through ``RoundGraphs``: one graph
replay per token) on a random-weight target of a named shape; default LlamaGen-XL (GPT-XL, 576
tokens), bf16, CFG batch 2.

    python benchmarks/ar_graph_step.py --out benchmarks/results/ar_graph_step_xl_bf16.json
    python benchmarks/ar_graph_step.py --shape tiny --device cpu --dtype fp32 --repeats 1   # CPU smoke run

One decoder (one image, its two CFG rows) and one ``RoundGraphs`` serve every repeat: each repeat
admits a fresh image into the decoder's row (prefill, untimed; the buffers are written in place, so the
captured graph stays valid, as in the decode loop) and then times the image's remaining T - 1 rounds,
divided by the steps; the median over repeats is reported with the target (0.5 ms at XL shape on an
H200; HBM floor about 0.32 ms). The first image captures the graph: untimed. Only the replays are
timed, not the decode loop's per-round status read (``runtime.loop.LateRead``). ``--compile``: the
step compiled by Inductor first (off by default). On the CPU ``RoundGraphs`` runs the same step
eagerly on the same buffers. Writes JSON and a Markdown table that carries its command and date.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import provenance, write_report  # noqa: E402  (sets the checkout's path first)

from vvs_engine.engine import resolve_device, resolve_dtype  # noqa: E402
from vvs_engine.evaluation.bench import SHAPES, random_engine  # noqa: E402
from vvs_engine.kernels.flash import describe  # noqa: E402
from vvs_engine.methods import get_method  # noqa: E402
from vvs_engine.methods.common import DecodeBatch  # noqa: E402
from vvs_engine.rng import CounterRNG  # noqa: E402
from vvs_engine.runtime.core import DecodeCore  # noqa: E402
from vvs_engine.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="GPT-XL", help=f"random-weight shape: {', '.join(SHAPES)} (default GPT-XL)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per image (default: the shape's)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--repeats", type=int, default=5, help="timed images (default 5; median reported)")
    p.add_argument("--threads", type=int, default=4, help="CPU threads for torch (default 4)")
    p.add_argument("--compile", action="store_true", help="compile the step with Inductor first (default off)")
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes next to it (.md)")
    return p.parse_args(argv)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    device, dtype = resolve_device(a.device), resolve_dtype(a.dtype)
    eng = random_engine(a.shape, device, dtype, tokens=a.tokens)
    params = SamplingParams(1.0, 0, 1.0, 4.0)  # sampling with CFG: batch 2 = one image's two rows
    per_step = []
    use_graphs = device.type == "cuda"
    with torch.inference_mode():
        cond, key_mask = eng.condition_rows([1], None, True)
        image = torch.zeros(1, dtype=torch.long, device=device)  # image index 0 (the RNG key)
        run, opts = get_method("ar", eng, {})
        core = DecodeCore(lambda batch: run(eng, batch, params, opts), compile=a.compile, use_graphs=use_graphs)
        slot, _ = core.slot(1, lambda: DecodeBatch(cond, key_mask, CounterRNG(0, image), 1))
        dec, graphs = slot.decoder, slot.graphs
        T = dec.T
        for rep in range(a.repeats + 1):  # the first image captures the graph: untimed
            if rep > 0:  # a fresh image in the same row: prefill (eager), written in place
                core.admit(slot, [0], DecodeBatch(cond, key_mask, CounterRNG(rep, image), 1))
            sync(device)
            t0 = time.perf_counter()
            for _ in range(T - 1):  # token 0 comes from the prefill
                graphs("ar_step")
            sync(device)
            if rep > 0:
                per_step.append((time.perf_counter() - t0) * 1e3 / (T - 1))
        assert int(dec.state.count.min()) == T, "the image did not finish in T - 1 steps"
        tokens = core.collect(slot, [0], T)["tokens"]
    stats = {"ar_step": {"graph": "ar_step" in graphs.graphs, "replays": graphs.replays["ar_step"],
                         "compiled": graphs.compiled().get("ar_step", False)}}
    res = {"benchmark": "ar_graph_step", "model": f"random {a.shape} ({eng.gpt.num_params() / 1e6:.1f}M params)",
           "dtype": a.dtype, "rows": 2, "tokens": T, "ms_per_step_median": statistics.median(per_step),
           "ms_per_step_all": per_step, "target_ms": 0.5, "hbm_floor_ms_h200": 0.32,
           "attention": describe(device, dtype, eng.gpt.config.head_dim, False), "graphs": stats,
           "tokens_shape": list(tokens.shape), **provenance(__file__, argv, device)}
    graphed = any(c["graph"] for c in res["graphs"].values())
    write_report(a.out, res, f"AR step (ARDecoder ar_step through RoundGraphs, {res['device']})",
                 ["model", "dtype", "rows", "tokens", "graph", "ms/step (median)", "all repeats", "target"],
                 [[res["model"], a.dtype, 2, T, graphed, f"{res['ms_per_step_median']:.4f}",
                   ", ".join(f"{t:.4f}" for t in per_step), 0.5]], [f"attention backends: {res['attention']}"])


if __name__ == "__main__":
    main()
