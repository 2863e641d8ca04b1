"""Compiled vs eager decode rounds on the Zoo: the same tokens for every method, and compile times.

Every method (ZipAR included, whose rounds are not compiled) decodes the same 4 images (labels 0, 5, 9, 13, sampled, seed 3, batch 4, fp32, one
thread) with ``compile=False`` and ``compile=True`` (what ``vvs-engine generate --no-compile`` /
``--compile`` pass to ``Engine.generate``); the tokens must be equal. Each setting runs in two fresh
processes sharing one empty Inductor cache directory: the first compiles every round (cold), the
second finds them in Inductor's on-disk FX graph cache (what a second ``vvs-engine`` process does).
"Compile s" is the summed first-call time of the method's compiled rounds (tracing + compiling or
loading + one run). Rows are not retired here (``VVS_RETIRE_FINISHED=0``: tokens are the same either
way) so that each round kind compiles once per batch size.

    python benchmarks/studies/compile_check/compile_check.py            # writes compile_check.{md,json} beside it
    python benchmarks/studies/compile_check/compile_check.py --methods ar,sjd --out /tmp/cc
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
METHODS = ["ar", "eagle", "lantern", "lantern++", "vvs", "cascade", "sjd", "gsd", "scd", "sjd-pac", "zipar"]
OPTIONS = {"vvs": {"skip_policy": "uniform", "skip_interval": 2}}
LABELS, SEED, BATCH = [0, 5, 9, 13], 3, 4
COMMAND = "python benchmarks/studies/compile_check/compile_check.py"


def worker(methods, eager: bool, out_path: str) -> None:
    """One process: every method compiled (and eager when ``eager``) -> JSON at ``out_path``."""
    sys.path.insert(0, ROOT)
    from vvs_engine import Engine
    from vvs_engine.runtime.compiled import compile_log

    e = Engine.load(device="cpu", dtype="fp32", threads=1)
    rows = {}
    for m in methods:
        kw = dict(class_labels=LABELS, method=m, seed=SEED, batch_size=BATCH, decode_images=False, **OPTIONS.get(m, {}))
        row = {}
        if eager:
            t0 = time.perf_counter()
            row["eager_tokens"] = e.generate(compile=False, **kw).tokens.tolist()
            row["eager_s"] = time.perf_counter() - t0
        before = len(compile_log())
        t0 = time.perf_counter()
        out = e.generate(compile=True, **kw)
        row["compiled_s"] = time.perf_counter() - t0
        log = compile_log()[before:]
        row["tokens"] = out.tokens.tolist()
        row["compiled"] = out.stats.get("compiled", {})  # ZipAR has no compiled rounds
        row["compile_s"] = sum(s for _, s, _ in log)
        row["compiles"] = [[name, round(s, 2), ok] for name, s, ok in log]
        rows[m] = row
        print(m, "compiled" if all(row["compiled"].values()) else "FALLBACK", f"{row['compile_s']:.1f}s",
              flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f)


def render(cold: dict, warm: dict, args) -> str:
    lines = [f"<!-- written by: {COMMAND} {' '.join(sys.argv[1:])} -->", "",
             "# Compiled vs eager rounds on the Zoo (CPU, Inductor's C++ backend)", "",
             f"{len(LABELS)} images (labels {', '.join(map(str, LABELS))}), sampled (temperature 1, CFG 4), seed {SEED}, "
             f"batch {BATCH}, fp32, one thread; `Engine.generate(compile=True)` vs `compile=False` (the CLI's "
             "`--compile` / `--no-compile`). Cold: a fresh process and an empty Inductor cache; cached: a second "
             "process with the same cache directory (FX graph cache hits). Compile s: summed first-call time of the "
             "method's compiled rounds (Dynamo tracing + Inductor compile or cache load + one run), on a CPU shared "
             "with other jobs (noisy).", "",
             "| method | tokens equal (compiled == eager) | second process equal | rounds compiled | compile s (cold) "
             "| compile s (cached, 2nd process) | decode s eager | decode s compiled (cold) |",
             "|---|---|---|---|---|---|---|---|"]
    for m, c in cold.items():
        w = warm.get(m, {})
        equal = c["tokens"] == c["eager_tokens"]
        equal_w = w.get("tokens") == c["eager_tokens"] if w else None
        kinds = ", ".join(f"{k}{'' if ok else ' (eager fallback)'}" for k, ok in sorted(c["compiled"].items())) \
            or "none (its rounds are not compiled)"
        lines.append(f"| {m} | {'yes' if equal else 'NO'} | {'-' if equal_w is None else ('yes' if equal_w else 'NO')} | "
                     f"{kinds} | {c['compile_s']:.1f} | {w.get('compile_s', float('nan')):.1f} | {c['eager_s']:.1f} | "
                     f"{c['compiled_s']:.1f} |")
    all_equal = all(c["tokens"] == c["eager_tokens"] for c in cold.values())
    lines += ["", f"All methods give the same tokens compiled and eager: {'yes' if all_equal else 'NO'}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--worker", nargs=2, metavar=("EAGER", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    if args.worker:
        worker(methods, args.worker[0] == "1", args.worker[1])
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VVS_RETIRE_FINISHED": "0", "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory(prefix="vvs_inductor_") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        results = []
        for eager in (True, False):  # cold process (with the eager runs), then the cached one
            path = os.path.join(cache, f"run{int(eager)}.json")
            subprocess.run([sys.executable, __file__, "--methods", args.methods, "--worker", str(int(eager)), path],
                           env=env, check=True)
            with open(path) as f:
                results.append(json.load(f))
    cold, warm = results
    os.makedirs(args.out, exist_ok=True)
    text = render(cold, warm, args)
    with open(os.path.join(args.out, "compile_check.md"), "w") as f:
        f.write(text)
    summary = {m: {"tokens_equal": c["tokens"] == c["eager_tokens"], "second_process_equal": warm[m]["tokens"] == c["eager_tokens"],
                   "compiled": c["compiled"], "compile_s_cold": c["compile_s"], "compile_s_cached": warm[m]["compile_s"],
                   "compiles_cold": c["compiles"], "compiles_cached": warm[m]["compiles"]} for m, c in cold.items()}
    with open(os.path.join(args.out, "compile_check.json"), "w") as f:
        json.dump({"command": f"{COMMAND} {' '.join(sys.argv[1:])}".strip(), "methods": summary}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
