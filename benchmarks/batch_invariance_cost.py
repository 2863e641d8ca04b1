"""What batch-invariant decoding costs on the CPU: wall time with ``deterministic=True`` over without,
per method, dtype and batch size, on the Zoo model, in one run (the two modes interleaved).

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/batch_invariance_cost.py      # writes benchmarks/results/batch_invariance_cost_zoo_cpu.{md,json}
    OMP_NUM_THREADS=1 python benchmarks/batch_invariance_cost.py --methods ar,sjd --dtypes fp32 --settings 1:1
    OMP_NUM_THREADS=1 python benchmarks/batch_invariance_cost.py --probe        # the GEMM row-count probe: ..._gemm_probe.{md,json}
    python benchmarks/batch_invariance_cost.py --device cuda --dtypes bf16 --out DIR/batch_invariance_cost_gpu   # gpu_suite.sh

On CUDA the mode runs the Triton kernels (``vvs::invariant_linear``, ``vvs::invariant_attention``) and
the ratio is of wall times (CUDA-synchronised: the process's CPU time says nothing about the GPU).

Each setting (``batch:images``) decodes the same images (labels 0..n-1, seed 0, temperature 1, CFG 4,
to pixels) with the mode off and on, alternately ``--repeats`` times, and keeps the least CPU time of
each (``time.process_time``, one thread: on a shared machine the wall time mostly measures the other
jobs, the process's CPU time much less so); the ratio is on / off. Wall times are kept beside.
``--probe`` measures instead, for each GEMM shape of the Zoo, up to which row count M a row's bits
change with M (MKL's kernel classes: why the mode pads to 16 rows). Whether the tokens agree is
``benchmarks/batch_identity.py --deterministic``'s and the tests' business.
Where the cost comes from: a GEMM of fewer than 16 rows is padded to 16 (AR at batch 1 runs 2-row
GEMMs: up to 8x the GEMM work) and bf16 GEMMs run in fp32; the tokenizer decodes one image at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine import Engine  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
METHODS = ["ar", "sjd", "gsd", "scd", "sjd-pac", "eagle", "lantern", "lantern++", "cascade", "vvs", "zipar", "pjd"]
ZOO_GEMMS = [(256, 768), (256, 256), (256, 1408), (704, 256), (256, 1024), (512, 256)]  # target + drafter


def probe(threads: int) -> list:
    """For each Zoo GEMM shape and dtype: groups of row counts M whose row 0 has the same bits, and
    the smallest M from which every row (any position) equals a 1000-row GEMM's."""
    torch.set_num_threads(threads)
    ms = list(range(1, 21)) + [24, 32, 48, 64, 100, 128, 200, 256, 300, 512, 1000]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ZOO_GEMMS:
            g = torch.Generator().manual_seed(0)
            w, x = (torch.randn(n, k, generator=g) * 0.05).to(dtype), torch.randn(1100, k, generator=g).to(dtype)
            ref = torch.nn.functional.linear(x, w)
            failing = [m for m in ms for s in (0, 3)
                       if not torch.equal(torch.nn.functional.linear(x[s:s + m].clone(), w), ref[s:s + m])]
            floor = max(failing) + 1 if failing else 1
            out.append({"dtype": str(dtype).replace("torch.", ""), "K": k, "N": n, "threads": threads,
                        "rows_differ_below": floor, "max_differing_M": max(failing) if failing else None})
    return out


def run_setting(engine, method, n_images, batch_size, repeats, sync=lambda: None):
    """-> ({mode: least CPU seconds}, {mode: least wall seconds}), the modes alternating."""
    labels = [i % 16 for i in range(n_images)]
    kw = dict(class_labels=labels, method=method, seed=0, temperature=1.0, decode_images=True)
    cpu = {False: float("inf"), True: float("inf")}
    wall = dict(cpu)
    for _ in range(repeats):
        for det in (False, True):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.generate(batch_size=batch_size, deterministic=det, **kw)
            sync()
            cpu[det] = min(cpu[det], time.process_time() - c0)
            wall[det] = min(wall[det], time.perf_counter() - t0)
    return cpu, wall


def table(result: dict) -> str:
    lines = ["| method | dtype | batch | images | CPU s off | CPU s on | on / off | wall s off | wall s on |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['dtype']} | {r['batch_size']} | {r['images']} | {r['cpu_off']:.1f} | "
                     f"{r['cpu_on']:.1f} | **{r['ratio']:.2f}** | {r['wall_off']:.1f} | {r['wall_on']:.1f} |")
    return "\n".join(lines)


def write(result: dict, stem: str) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        where = "on CUDA (" + result["gpu"] + ")" if result.get("gpu") else "on the CPU"
        f.write(f"# Batch-invariant decoding: cost {where} (Zoo model)\n\n")
        f.write(f"Written by `{result['command']}` on {result['date']} ({result['machine']}, torch "
                f"{result['torch']}, {result['threads']} thread, nice 19, machine shared with other jobs: "
                "least of the interleaved repeats).\n\n")
        f.write("Each row: `images` Zoo images (labels 0.., seed 0, temperature 1, CFG 4, decoded to pixels) at "
                "`batch` rows. `on / off`: " + ("wall time (CUDA-synchronised)" if result.get("gpu") else "CPU time")
                + " with `deterministic=True` over without (least of the repeats).\n\n")
        f.write(table(result) + "\n")


def write_probe(result: dict, stem: str) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    probe_lines = [f"| {p['dtype']} | {p['K']} x {p['N']} | {p['threads']} | {p['max_differing_M'] or 'none'} |"
                   for p in result["probe"]]
    with open(stem + ".md", "w") as f:
        f.write("# GEMM rounding against the row count (CPU)\n\n")
        f.write(f"Written by `{result['command']}` on {result['date']} ({result['machine']}, torch "
                f"{result['torch']}).\n")
        f.write("\nThe plain GEMM's row-count dependence (row counts M = 1..20, 24, 32, 48, 64, 100, 128, 200, 256, "
                "300, 512, 1000 at row offsets 0 and 3, each against a 1100-row GEMM): the largest M at which some "
                "row's bits "
                "differ. fp32: every M above it agrees (the mode pads to 16 rows); bf16 (oneDNN): for K >= 512 "
                "some rows differ up to a few hundred rows (the mode computes bf16 GEMMs in fp32).\n\n"
                "| dtype | K x N | threads | largest differing M |\n|---|---|---:|---:|\n")
        f.write("\n".join(probe_lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--settings", default="1:1,8:8", help="batch:images pairs (default 1:1,8:8)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--probe", action="store_true", help="only print MKL's GEMM row-count classes")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA the ratio is of wall times)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "batch_invariance_cost_zoo_cpu"))
    args = ap.parse_args(argv)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    prefix = "" if args.device.startswith("cuda") else "OMP_NUM_THREADS=1 nice -n 19 "
    result = {"command": prefix + "python benchmarks/batch_invariance_cost.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "torch": torch.__version__, "threads": threads, "rows": []}
    if args.probe:
        result["probe"] = probe(1) + probe(2)
        for p in result["probe"]:
            print(p)
        write_probe(result, args.out + "_gemm_probe")
        return 0
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")]
    for dtype in args.dtypes.split(","):
        eng = Engine.load(dtype=dtype, threads=threads, device=args.device)
        on_gpu = args.device.startswith("cuda")
        if on_gpu:
            result["gpu"] = torch.cuda.get_device_name()
        for method in args.methods.split(","):
            for b, n in settings:
                cpu, wall = run_setting(eng, method, n, b, args.repeats, torch.cuda.synchronize if on_gpu else lambda: None)
                timed = wall if on_gpu else cpu
                row = {"method": method, "dtype": dtype, "batch_size": b, "images": n, "cpu_off": cpu[False],
                       "cpu_on": cpu[True], "ratio": timed[True] / timed[False], "wall_off": wall[False],
                       "wall_on": wall[True]}
                result["rows"].append(row)
                print(row, flush=True)
                write(result, args.out)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
