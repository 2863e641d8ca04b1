"""Ray overhead of ``generate-dataset``: the same Zoo job in one process and on a local Ray cluster
(1 and 2 workers), side by side in one run, with a check that all three wrote the same tokens.

Start-up = starting the workers until their engines are loaded (process: engine load; Ray: cluster
start + worker processes + engine load in each). Per shard: wall time from hand-out to the shard's
files being written, and the part of it outside the engine's decode loop (VQ decoding and PNG
encoding in both; for Ray also the task hand-off and the transfer of tokens and PNG bytes). Ray's
per-shard overhead = its outside-decode time minus the process's, which is robust to CPU load that
changes the decode time itself.

    python benchmarks/studies/dataset_ray/dataset_ray.py --images 8 --shard-size 2 --method ar
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np


def run_job(out_dir: str, args, **kw) -> dict:
    from vvs_engine import dataset

    t0 = time.perf_counter()
    s = dataset.generate(out_dir, class_labels=list(range(args.images)), method=args.method, seed=args.seed,
                         shard_size=args.shard_size, batch_size=args.batch_size, threads=args.threads,
                         progress=False, **kw)
    s["call_s"] = time.perf_counter() - t0
    files = sorted(f for f in os.listdir(out_dir) if f.startswith("shard-"))
    s["tokens"] = np.concatenate([np.load(os.path.join(out_dir, f))["tokens"] for f in files])
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=8, help="images (labels 0..N-1 of the Zoo model; default 8)")
    p.add_argument("--shard-size", type=int, default=2, help="images per shard (default 2)")
    p.add_argument("--batch-size", type=int, default=2, help="images per engine call (default 2)")
    p.add_argument("--method", default="ar", help="decoding method (default ar)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker and in the process (default 1)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "dataset_ray_overhead.md"))
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    import ray

    tmp = tempfile.mkdtemp(prefix="vvs-dataset-bench-")
    rows = []
    try:
        rows.append(("1 process", run_job(os.path.join(tmp, "local"), args)))
        for w in (1, 2):
            # A fresh local cluster per row, so each row's start-up includes starting Ray.
            rows.append((f"Ray, {w} worker{'s' if w > 1 else ''}", run_job(os.path.join(tmp, f"ray{w}"), args,
                                                                             ray="local", workers=w)))
            assert not ray.is_initialized()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = all(np.array_equal(s["tokens"], rows[0][1]["tokens"]) for _, s in rows)
    n_shards = (args.images + args.shard_size - 1) // args.shard_size
    base = rows[0][1]
    lines = [
        "# generate-dataset: Ray overhead next to one process (Zoo model, CPU)", "",
        f"{args.images} images (labels 0..{args.images - 1}), method {args.method}, seed {args.seed}, "
        f"{n_shards} shards of {args.shard_size}, batch {args.batch_size}, {args.threads} torch thread(s) per "
        f"worker; torch {torch.__version__}, ray {ray.__version__}, {os.cpu_count()} CPU cores (shared with other "
        f"jobs: absolute times vary run to run, the rows of one run are comparable).", "",
        "Command: `python benchmarks/studies/dataset_ray/" + os.path.basename(__file__) + " " + " ".join(sys.argv[1:] if argv is None
                                                                                   else argv) + "`", "",
        "| run | start-up (s) | per shard (s) | of which outside decode (s) | Ray overhead per shard (s) "
        "| job wall (s) | images/s |",
        "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        over = s["mean_shard_outside_decode_s"] - base["mean_shard_outside_decode_s"]
        lines.append(f"| {name} | {s['startup_s']:.2f} | {s['mean_shard_s']:.2f} | "
                     f"{s['mean_shard_outside_decode_s']:.2f} | {'–' if s is base else f'{over:+.2f}'} | "
                     f"{s['call_s']:.2f} | {args.images / s['call_s']:.3f} |")
    lines += ["", f"Tokens identical in all three runs: **{'yes' if same else 'NO'}**.", "",
              "Per-shard wall times follow the machine's load (2 shared cores, and 2 workers share them), so"
              " compare the outside-decode column: Ray's extra per-shard cost is the task hand-off and returning"
              " tokens and PNG bytes through the object store."]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
