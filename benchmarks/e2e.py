"""End-to-end benchmark (methods x settings, latency per image, TPF, speed-up over our AR baseline,
trace replay on large random-weight models). A thin wrapper over ``vvs_engine.evaluation.bench`` (the same as
``vvs-engine bench``); see that module for the flags. Unlike ``vvs-engine bench`` (default
``./bench-results``), this script of the repository writes the repository's tables, ``benchmarks/results``,
unless ``--out`` says otherwise:

    python benchmarks/e2e.py --quick                                   # CPU smoke run, < 60 s
    python benchmarks/e2e.py --record benchmarks/results/trace_zoo.json  # Zoo model, records a trace
    python benchmarks/e2e.py --replay benchmarks/results/trace_zoo.json --replay-models GPT-XL,GPT-7B
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from vvs_engine.evaluation.bench import main  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", RESULTS]
    raise SystemExit(main(argv))
