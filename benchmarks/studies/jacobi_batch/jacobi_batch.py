"""Batched AR, SJD and GSD on the Zoo model: compute ops per round, TPF per image and images per
second at batch sizes 1 and 16, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/studies/jacobi_batch/jacobi_batch.py            # writes jacobi_batch.{md,json} beside it
    OMP_NUM_THREADS=1 python benchmarks/studies/jacobi_batch/jacobi_batch.py --tiny     # a tiny random model (smoke run)

Compute ops are the aten ops a ``TorchDispatchMode`` sees, excluding those whose every output shares
storage with an input (views, no-op ``to``): per AR step (``ARDecoder``'s ``ar_step`` round) and per
Jacobi iteration (``JacobiDecoder``'s ``jacobi`` round), each run through ``RoundGraphs`` eagerly on
the CPU in fp32, averaged over rounds 2-9 of the decode. TPF per image is image tokens / target
forwards while the image was unfinished (prefill excluded); images/s is the wall time of
``Engine.generate`` over all images, one warm-up image first; batched forwards are the decode loop's
rounds (``batch_rounds``); the share of images identical to their decode at the first batch size is
reported (fp32). The thread count is set explicitly (``--threads``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine import Engine  # noqa: E402
from vvs_engine.acceptance.verify import ExactRule  # noqa: E402
from vvs_engine.methods import get_method, jacobi  # noqa: E402
from vvs_engine.methods.common import DecodeBatch  # noqa: E402
from vvs_engine.rng import CounterRNG  # noqa: E402
from vvs_engine.runtime.runner import RoundGraphs  # noqa: E402
from vvs_engine.sampling import SamplingParams  # noqa: E402

RESULTS = HERE
METHODS = [("ar", {}), ("sjd", {}), ("gsd", {})]


class ComputeOps(TorchDispatchMode):
    """Counts dispatched aten ops that produce new storage."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or not all(t.untyped_storage().data_ptr() in inputs for t in outputs):
            self.count += 1
        return out


def ops_per_round(dec, kind: str) -> float:
    """Compute ops per round of a prefilled decoder, eager (``RoundGraphs`` without graphs), rounds 2-9."""
    graphs = RoundGraphs(dec.round_functions(), dec.round_buffers(), use_graphs=False,
                         options=dec.inductor_options)
    graphs(kind)  # round 1: may fill cached constants once
    counter = ComputeOps()
    with counter:
        for _ in range(8):
            graphs(kind)
    return counter.count / 8


def decode_batch(engine, labels, params) -> DecodeBatch:
    cond, key_mask = engine.condition_rows(labels, None, params.use_cfg)
    return DecodeBatch(cond, key_mask, CounterRNG(0, torch.arange(len(labels))), len(labels))


def ops_per_ar_step(engine, labels, params) -> float:
    run, opts = get_method("ar", engine, {})
    return ops_per_round(run(engine, decode_batch(engine, labels, params), params, opts), "ar_step")


def ops_per_jacobi_iteration(engine, method, labels, params) -> float:
    opts = jacobi.GSDOptions() if method == "gsd" else jacobi.SJDOptions()
    rule = opts.rule(engine) if method == "gsd" else ExactRule()
    dec = jacobi.JacobiDecoder.start(engine, decode_batch(engine, labels, params), params, opts, rule)
    return ops_per_round(dec, "jacobi")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random model instead of the Zoo")
    p.add_argument("--images", type=int, default=16, help="images per run (labels cycle through the classes)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output stem (default jacobi_batch[_tiny] beside this script)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.tiny:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from spec_models import tiny_engine

        eng = tiny_engine(vocab=64, block=64, peak=8.0, dtype=torch.float32)
    else:
        eng = Engine.load()
    params = SamplingParams()  # the engine's defaults: temperature 1, CFG 4
    labels = [i % eng.config.num_classes for i in range(a.images)]
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]

    with torch.inference_mode():
        ar_ops = ops_per_ar_step(eng, labels[:1], params)
        ops = {"ar": ar_ops}
        for method in ("sjd", "gsd"):
            ops[method] = ops_per_jacobi_iteration(eng, method, labels[:1], params)
        big = [i % eng.config.num_classes for i in range(max(batch_sizes))]
        ops_big = {"ar": ops_per_ar_step(eng, big, params)}
        for method in ("sjd", "gsd"):
            ops_big[method] = ops_per_jacobi_iteration(eng, method, big, params)

    rows = []
    for method, opts in METHODS:
        for bs in batch_sizes:
            eng.generate(class_labels=labels[:1], method=method, seed=a.seed, batch_size=1, decode_images=False, **opts)
            t0 = time.perf_counter()
            out = eng.generate(class_labels=labels, method=method, seed=a.seed, batch_size=bs, decode_images=False,
                               **opts)
            wall = time.perf_counter() - t0
            st = out.stats
            tpf = st["tpf_per_image"]
            rows.append({"method": method, "batch_size": bs, "images_per_s": len(labels) / wall, "wall_s": wall,
                         "tpf": st["tpf"], "tpf_min": tpf["min"], "tpf_median": tpf["median"], "tpf_max": tpf["max"],
                         "batched_forwards": st.get("batch_iterations", st.get("batch_rounds")),
                         "ops_per_round_b1": ops[method], f"ops_per_round_b{len(big)}": ops_big[method],
                         "tokens": out.tokens.tolist()})
            print(f"{method:4} B={bs:<3} {rows[-1]['images_per_s']:7.3f} img/s  TPF {st['tpf']:.3f}", flush=True)

    # fp32: matmul rounding may depend on the batch shape, and one flipped draw changes the rest of an
    # image; report the share of images identical to their batch-1 decode (fp64 is exact: tests).
    for r in rows:
        first = next(x for x in rows if x["method"] == r["method"])
        r["identical_to_first_batch_size"] = sum(a == b for a, b in zip(r["tokens"], first["tokens"])) / len(labels)
    for r in rows:
        del r["tokens"]

    stem = a.out or os.path.join(RESULTS, "jacobi_batch_tiny" if a.tiny else "jacobi_batch")
    cmd = f"OMP_NUM_THREADS={a.threads} python benchmarks/studies/jacobi_batch/jacobi_batch.py" + (" --tiny" if a.tiny else "") + \
        (f" --images {a.images}" if a.images != 16 else "") + \
        (f" --batch-sizes {a.batch_sizes}" if a.batch_sizes != "1,16" else "")
    meta = {"command": cmd, "model": "tiny-random" if a.tiny else "zoo", "images": len(labels), "seed": a.seed,
            "threads": a.threads, "sampling": params.to_dict(), "torch": torch.__version__,
            "platform": platform.platform(), "load_average": os.getloadavg()}
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    ratio = {m: ops[m] / ar_ops for m in ops}
    lines = [
        f"<!-- written by `{cmd}`; do not edit -->",
        f"# Batched AR / SJD / GSD on the {'tiny random model' if a.tiny else 'Zoo model'} (CPU, fp32, "
        f"{a.threads} thread{'s' if a.threads > 1 else ''})",
        "",
        f"{len(labels)} images (labels cycling over the classes), seed {a.seed}, temperature 1, CFG 4; "
        f"load average at the end {meta['load_average'][0]:.1f} (shared machine: wall-clock figures are noisy).",
        "",
        "Compute ops per round (AR step / Jacobi iteration), eager:",
        "",
        f"| method | ops per round, B=1 | vs AR step | ops per round, B={len(big)} | vs AR step |",
        "|---|---|---|---|---|",
    ]
    for m in ("ar", "sjd", "gsd"):
        lines.append(f"| {m} | {ops[m]:.0f} | {ratio[m]:.3f} | {ops_big[m]:.0f} | {ops_big[m] / ops_big['ar']:.3f} |")
    lines += ["", "Throughput and TPF per image (image tokens / forwards while unfinished):", "",
              "| method | batch | images/s | TPF | TPF per image min / median / max | batched forwards | "
              f"images identical to B={batch_sizes[0]} |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['images_per_s']:.3f} | {r['tpf']:.3f} | "
                     f"{r['tpf_min']:.2f} / {r['tpf_median']:.2f} / {r['tpf_max']:.2f} | {r['batched_forwards']} | "
                     f"{r['identical_to_first_batch_size']:.0%} |")
    speedup = {m: statistics.mean(r["images_per_s"] for r in rows if r["method"] == m and r["batch_size"] == batch_sizes[-1])
               / statistics.mean(r["images_per_s"] for r in rows if r["method"] == m and r["batch_size"] == batch_sizes[0])
               for m, _ in METHODS}
    lines += ["", "images/s at B=%d over B=%d: " % (batch_sizes[-1], batch_sizes[0]) +
              ", ".join(f"{m} {s:.2f}x" for m, s in speedup.items()),
              "", "fp32 on the CPU: matmul rounding can depend on the batch shape, so an image may differ "
              "between batch sizes (the last column); in fp64 tokens are identical (tests/test_jacobi_batch.py)."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
