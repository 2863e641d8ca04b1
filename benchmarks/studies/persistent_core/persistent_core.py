"""The persistent engine against rebuilding per call: captures, compiles and host time outside the rounds.

Every ``generate`` call used to build its decoders and ``RoundGraphs`` anew (and again at every tail
shrink); the engine now keeps one core per (method, options, sampling scope) (``runtime.core``). This
runs the same calls on the Zoo model both ways, side by side in one process, and reports per call:

* ``graph_captures``: round kinds captured (on a GPU CUDA graphs, each after two warm-up rounds; on the
  CPU counted as the captures a GPU would make), and ``compiles`` (Dynamo graphs; 0 unless ``--compile``);
* the share of the call's wall time spent outside its rounds (set-up, admission, prefill, collection):
  ``1 - round_seconds / wall``;
* CPU wall time as a ratio kept / rebuilt (medians; the same machine load for both: interleaved).

    OMP_NUM_THREADS=1 python benchmarks/studies/persistent_core/persistent_core.py --calls 5 --methods ar,sjd --out benchmarks/studies/persistent_core/persistent_core
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5, help="calls per method and mode after the first")
    parser.add_argument("--methods", default="ar,sjd")
    parser.add_argument("--images", type=int, default=1, help="images per call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="compiled rounds (Inductor) in both modes")
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)

    from vvs_engine import Engine

    eng = Engine.load(threads=args.threads)
    rows = []
    for method in args.methods.split(","):
        kw = dict(class_labels=[i % 16 for i in range(args.images)], method=method, decode_images=False,
                  batch_size=args.images, compile=args.compile)
        eng.clear_cores()
        first = eng.generate(seed=0, **kw)  # the kept mode's first call builds its core
        per_mode = {"kept": [], "rebuilt": []}
        for call in range(args.calls):
            for mode in ("kept", "rebuilt"):  # interleaved: both see the same machine load
                if mode == "rebuilt":
                    saved = eng._cores
                    eng.clear_cores()  # what every call did before the persistent core
                t0 = time.perf_counter()
                out = eng.generate(seed=call + 1, **kw)
                wall = time.perf_counter() - t0
                if mode == "rebuilt":
                    eng._cores = saved
                per_mode[mode].append({"wall_s": wall, "round_s": out.stats["round_seconds"],
                                       "graph_captures": out.stats["graph_captures"], "compiles": out.stats["compiles"],
                                       "batch_rounds": out.stats["batch_rounds"]})
        row = {"method": method, "first_call": {"graph_captures": first.stats["graph_captures"],
                                                "compiles": first.stats["compiles"],
                                                "wall_s": first.stats["wall_time_s"]}}
        for mode, calls in per_mode.items():
            outside = [1 - c["round_s"] / c["wall_s"] for c in calls]
            row[mode] = {"median_wall_s": statistics.median(c["wall_s"] for c in calls),
                         "median_outside_share": statistics.median(outside),
                         "graph_captures_per_call": statistics.median(c["graph_captures"] for c in calls),
                         "compiles_per_call": statistics.median(c["compiles"] for c in calls), "calls": calls}
        row["wall_ratio_kept_over_rebuilt"] = row["kept"]["median_wall_s"] / row["rebuilt"]["median_wall_s"]
        rows.append(row)
        print(f"{method}: outside rounds kept {row['kept']['median_outside_share']:.3%} rebuilt "
              f"{row['rebuilt']['median_outside_share']:.3%}; captures/call kept "
              f"{row['kept']['graph_captures_per_call']} rebuilt {row['rebuilt']['graph_captures_per_call']}; "
              f"wall kept/rebuilt {row['wall_ratio_kept_over_rebuilt']:.3f}", flush=True)
    if args.out:
        command = f"OMP_NUM_THREADS={args.threads} python benchmarks/studies/persistent_core/persistent_core.py {' '.join(argv or sys.argv[1:])}"
        result = {"command": command, "date": time.strftime("%Y-%m-%d"), "rows": rows, "images": args.images,
                  "compile": args.compile}
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        lines = [f"<!-- written by benchmarks/studies/persistent_core/persistent_core.py -->", "# Persistent core vs rebuilt per call", "",
                 f"Command: `{command}` ({result['date']}); Zoo model, CPU, {args.images} image(s) per call, "
                 f"{args.calls} calls per mode after the first, interleaved; compile {args.compile}.", "",
                 "Captures on the CPU are the CUDA-graph captures a GPU would make (a round kind's first run in a "
                 "new `RoundGraphs`); outside share = 1 − time inside rounds / call wall time (set-up, admission "
                 "and prefill, collection). GPU capture times are not measured here.", "",
                 "| method | first call: captures / compiles | kept: captures / call | rebuilt: captures / call | "
                 "kept: outside rounds | rebuilt: outside rounds | wall kept / rebuilt |",
                 "|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['method']} | {row['first_call']['graph_captures']} / {row['first_call']['compiles']} | "
                         f"{row['kept']['graph_captures_per_call']:g} | {row['rebuilt']['graph_captures_per_call']:g} | "
                         f"{row['kept']['median_outside_share']:.2%} | {row['rebuilt']['median_outside_share']:.2%} | "
                         f"{row['wall_ratio_kept_over_rebuilt']:.3f} |")
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
