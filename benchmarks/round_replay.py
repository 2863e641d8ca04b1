"""Whole-round replay time per method: each round kind (verify, skip, verify after a skip) of a real
decode, timed one replay at a time on a random-weight target of a named shape (default LlamaGen-XL,
bf16, CFG batch 2, one image).

    python benchmarks/round_replay.py --out benchmarks/results/round_replay_xl_bf16.md
    python benchmarks/round_replay.py --shape tiny --device cpu --dtype fp32 --out /tmp/rr.md   # CPU smoke run

The decode loop's round calls (``RoundGraphs.__call__``) are wrapped with CUDA events (a timer on the
CPU); capture calls are not timed. A warm-up image captures every graph first, then one timed image
per method. Every method's rounds go through ``RoundGraphs``, plain AR's too: its ``ar_step`` round
(one graph replay per token) is timed the same way for scale, on every device. Writes a Markdown
table that carries its command and date, and JSON next to it.
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
from vvs_engine.evaluation.bench import SHAPES, lantern_k, neighbor_stub, random_engine  # noqa: E402
from vvs_engine.runtime import runner as runner_mod  # noqa: E402

SETTINGS = [("eagle", {}), ("lantern", {"lantern_delta": 0.2}), ("lantern++", {}), ("cascade", {}),
            ("vvs", {"skip_interval": 2})]


class RoundTimer:
    """Times every non-capturing call of ``RoundGraphs`` (every method's rounds, the AR step's too) while on."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.on = False
        self.records = []  # (kind, start, end): events on CUDA, perf_counter floats on the CPU

    def wrap(self, fn, kind_of, captured):
        timer = self

        def timed(obj, *args, **kwargs):
            if not timer.on or not captured(obj, *args):
                return fn(obj, *args, **kwargs)
            if timer.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(obj, *args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                out = fn(obj, *args, **kwargs)
                end = time.perf_counter()
            timer.records.append((kind_of(obj, *args), start, end))
            return out

        return timed

    def take(self) -> dict:
        """kind -> list of ms; clears the records."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for kind, start, end in self.records:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            out.setdefault(kind, []).append(ms)
        self.records = []
        return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="GPT-XL", help=f"random-weight shape: {', '.join(SHAPES)} (default GPT-XL)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per image (default 256)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--threads", type=int, default=4, help="CPU threads for torch (default 4)")
    p.add_argument("--out", required=True, help="Markdown path; JSON goes next to it")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    device, dtype = resolve_device(a.device), resolve_dtype(a.dtype)
    use_graphs = device.type == "cuda"
    eng = random_engine(a.shape, device, dtype, tokens=a.tokens)
    neighbor_stub(eng, lantern_k(eng))
    timer = RoundTimer(device)
    RG = runner_mod.RoundGraphs
    # A call is timed when it replays (graphs) or runs eagerly on the CPU; a capturing call is not.
    RG.__call__ = timer.wrap(RG.__call__, lambda g, name: name,
                             lambda g, name: not g.use_graphs or name in g.graphs)
    rows = []
    for method, opts in [("ar", {})] + SETTINGS:
        kw = dict(class_labels=[1], temperature=1.0, cfg_scale=4.0, method=method, decode_images=False,
                  cuda_graphs=use_graphs, **opts)
        if method != "ar":
            kw["lantern_k"] = lantern_k(eng)
        eng.generate(seed=100, **kw)  # warm-up: every graph of this setting is captured here
        timer.take()
        timer.on = True
        t0 = time.perf_counter()
        out = eng.generate(seed=0, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        timer.on = False
        label = method + ("(" + ",".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")
        for kind, ms in sorted(timer.take().items()):
            rows.append({"setting": label, "kind": kind, "calls": len(ms), "median_ms": statistics.median(ms),
                         "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))], "total_ms": sum(ms),
                         "image_ms": wall * 1e3, "tpf": out.stats.get("tpf", 1.0)})
    res = {"benchmark": "round_replay", "model": f"random {a.shape} ({eng.gpt.num_params() / 1e6:.1f}M params)",
           "tokens": eng.tokens_per_image, "dtype": a.dtype, "graphs": use_graphs, "rows": rows,
           **provenance(__file__, argv, device)}
    write_report(a.out, res, f"Whole-round replay time per method ({res['device']}, {res['model']}, {a.dtype}, "
                 f"{res['tokens']} tokens, CUDA graphs {use_graphs})",
                 ["setting", "round kind", "calls", "median ms", "p90 ms", "sum ms", "image ms", "TPF"],
                 [[r["setting"], r["kind"], r["calls"], f"{r['median_ms']:.4f}", f"{r['p90_ms']:.4f}",
                   f"{r['total_ms']:.1f}", f"{r['image_ms']:.1f}", f"{r['tpf']:.2f}"] for r in rows],
                 ["image ms: wall time of the timed image (prefill included); sum ms: the timed calls' total."])


if __name__ == "__main__":
    main()
