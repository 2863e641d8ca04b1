"""Kernel launches per CUDA-graph replay of every compiled round kind, counted by the profiler on a
GPU, beside the counts read on the CPU from Inductor's Triton code (``benchmarks/results/op_count.json``,
the GPU-style count of ``vvs_engine.measure.launches``).

    python benchmarks/gpu_launches.py --out benchmarks/results/gpu_launches.md         # on a GPU
    python benchmarks/gpu_launches.py --device cpu --out /tmp/gl.md --methods ar       # CPU smoke run

Per method on the Zoo model (one image, batch 1, compiled rounds in CUDA graphs, the engine's
defaults): a warm-up image compiles every round kind, then one more image runs, and each of its round
calls that replays a graph (``RoundGraphs.__call__``, the one path of every method's rounds; the call
that captures is not profiled) runs under ``torch.profiler`` and its GPU kernels are counted (CUPTI
reports the kernels inside a graph launch one by one; memcpy/memset activities are listed apart). On
the CPU nothing is a GPU launch: the smoke run counts the CPU ops of the same round calls (eager
there) so that the script's plumbing is tested.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, provenance, write_report  # noqa: E402  (sets the checkout's path first)

METHODS = [("AR", "ar", {}), ("EAGLE-2", "eagle", {}), ("LANTERN d=0.2", "lantern", {"lantern_delta": 0.2}),
           ("LANTERN++", "lantern++", {}), ("VVS-U i=2", "vvs", {"skip_policy": "uniform", "skip_interval": 2}),
           ("CASCADE", "cascade", {}), ("SJD", "sjd", {}), ("GSD", "gsd", {}), ("SCD", "scd", {}),
           ("SJD-PAC", "sjd-pac", {})]


def kernel_events(prof, cuda: bool):
    """(kernels, copies) of a profile: GPU kernel activities (memcpy/memset apart), or CPU ops."""
    kernels = copies = 0
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                copies += 1
            else:
                kernels += 1
        elif e.name.startswith(("aten::", "vvs::")) and e.cpu_parent is None:
            kernels += 1
    return kernels, copies


def count_method(engine, method, opts, cuda):
    """{round kind: [(kernels, copies) per replay]} for one image after a warm-up image."""
    from torch.profiler import ProfilerActivity, profile

    from vvs_engine.runtime import runner

    kw = dict(class_labels=[1], method=method, decode_images=False, batch_size=1, **opts)
    engine.generate(seed=100, **kw)  # compiles (Inductor) every round kind; each image captures its own graphs
    per_kind: dict = {}
    RG = runner.RoundGraphs.__call__
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def counted(g, name):
        if g.use_graphs and name not in g.graphs:  # a first call that warms up and captures: not a replay
            return RG(g, name)
        with profile(activities=activities) as prof:
            out = RG(g, name)
            if cuda:
                torch.cuda.synchronize()
        per_kind.setdefault(name, []).append(kernel_events(prof, cuda))
        return out

    # every round of every method (AR's ar_step, the Jacobi methods' jacobi, the speculative rounds)
    # runs through RoundGraphs: a graph replay on CUDA, the round function itself on the CPU
    runner.RoundGraphs.__call__ = counted
    try:
        engine.generate(seed=0, **kw)
    finally:
        runner.RoundGraphs.__call__ = RG
    return per_kind


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default="", help="comma-separated method names (default: all)")
    ap.add_argument("--max-replays", type=int, default=8, help="replays profiled per round kind (default 8)")
    ap.add_argument("--out", required=True, help="Markdown path; JSON goes next to it")
    args = ap.parse_args(argv)
    from vvs_engine import Engine

    cuda = args.device == "cuda"
    engine = Engine.load(device=args.device, threads=4)
    wanted = [m for m in args.methods.split(",") if m]
    cpu_counts = {}
    path = os.path.join(ROOT, "benchmarks", "results", "op_count.json")
    if os.path.exists(path):
        for name, row in json.load(open(path))["results"].get("1", {}).items():
            cpu_counts[name] = {k: v["total"] for k, v in row.get("compiled_launches_by_kind", {}).items()}
    rows = []
    for name, method, opts in METHODS:
        if wanted and method not in wanted:
            continue
        # Profiling every replay of an image is slow: only the first max_replays of each kind are kept.
        per_kind = count_method(engine, method, opts, cuda)
        for kind, counts in sorted(per_kind.items()):
            counts = counts[: args.max_replays]
            kernels = [k for k, _ in counts]
            rows.append(dict(method=name, kind=kind, replays=len(counts), kernels_median=statistics.median(kernels),
                             kernels_min=min(kernels), kernels_max=max(kernels),
                             copies_median=statistics.median(c for _, c in counts),
                             cpu_gpu_style=cpu_counts.get(name, {}).get(kind)))
        print(name, {r["kind"]: r["kernels_median"] for r in rows if r["method"] == name}, flush=True)
    res = dict(benchmark="gpu_launches", rows=rows, **provenance(__file__, argv, "cuda" if cuda else "cpu"))
    if not cuda:
        res["device"] = "cpu (smoke run: CPU ops, not GPU launches)"
    write_report(args.out, res, f"Kernel launches per compiled-round replay ({res['device']}, Zoo, batch 1)",
                 ["method", "round kind", "replays", "GPU kernels (median, min-max)", "memcpy/memset",
                  "CPU count, GPU style (op_count.json)"],
                 [[r["method"], r["kind"], r["replays"],
                   f"{r['kernels_median']:.0f} ({r['kernels_min']}-{r['kernels_max']})", f"{r['copies_median']:.0f}",
                   "-" if r["cpu_gpu_style"] is None else r["cpu_gpu_style"]] for r in rows])


if __name__ == "__main__":
    main()
