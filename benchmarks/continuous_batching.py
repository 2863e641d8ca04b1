"""Continuous batching against static batches: rounds, row utilisation, forwards per image, CPU speed.

Two parts, one run:

1. **Measured** (``--images N --rows R``): every method (all are on the one loop, ``runtime.loop``) decodes the
   same N Zoo images with R rows in flight, static batches and continuous batching side by side in
   this process (1 thread): batch rounds, row-rounds, row utilisation (row-rounds that commit tokens for
   a real image / all row-rounds), target forwards per image (must be equal), whether the tokens are
   equal, and CPU images/s as a ratio (continuous / static, medians of ``--repeats``). The simulator of
   part 2 is run on the measured per-image forwards and must give the measured rounds exactly (not
   for VVS: its sequences sit out the rounds of the kind they do not want).
2. **512 images** (``--cache``): the loop's policy (admission one round late, tail shrinking) replayed
   on the per-image forwards of the committed 512-image quality cache
   (``benchmarks/results/quality_speed_tokens``) at 16 and 64 rows, for every setting whose rounds are
   its forwards (VVS rows are left out: their skip rounds are not in the cache), with a **modelled**
   GPU throughput at LlamaGen-XL shape: batch rounds x the modelled compiled round time of
   ``benchmarks/results/round_cost.json`` (a round costs about the same whatever the live rows: it
   reads the weights once). A model, not a measurement.

    OMP_NUM_THREADS=1 python benchmarks/continuous_batching.py --images 48 --rows 16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import QUALITY_CACHE, ROOT, provenance, write_tables  # noqa: E402  (sets the checkout's path first)

LOOP_METHODS = ("ar", "sjd", "gsd", "scd", "sjd-pac", "zipar", "eagle", "lantern", "lantern++", "cascade", "vvs")
# methods whose rounds per image are its target forwards (the simulator's input); VVS skips rounds
SIMULATED = set(LOOP_METHODS) - {"vvs"}
# quality cache file -> round_cost row (settings whose rounds are their target forwards)
CACHE_ROWS = {"AR": "AR", "EAGLE_2": "EAGLE-2", "LANTERN_d_0_2": "LANTERN d=0.2", "LANTERN___l_2": "LANTERN++",
              "CASCADE": "CASCADE", "SJD": "SJD", "GSD_G_8": "GSD", "SCD_L_16": "SCD", "SJD_PAC_W_3_D_3": "SJD-PAC"}


REPLAY_T = 1 << 30  # "tokens per image" of a replayed image: its status counts rounds until it is done


class ReplayDecoder:
    """A model-free decoder for the loop: image i needs ``passes[i]`` rounds, then its status says done.
    The real loop (``runtime.loop``: its scheduler, late reads, admission, tail shrinks into kept smaller
    decoders) drives it, so the replayed schedule is the loop's own, not a copy of it."""

    RESULTS = ("tokens", "done")
    inductor_options: dict = {}

    def __init__(self, need):
        import torch

        self.B = len(need)
        self.need = torch.tensor(need, dtype=torch.long)
        self.done = torch.zeros(self.B, dtype=torch.long)
        self.state = torch.zeros(self.B, dtype=torch.long)  # the status: rounds so far, REPLAY_T once done
        self.tokens = torch.zeros(self.B, 1, dtype=torch.long)
        self.params = type("Scope", (), {"use_cfg": False})()

    def round_functions(self):
        return {"round": self.round}

    def round(self):
        import torch

        self.done.add_((self.state < REPLAY_T).long())
        self.state.copy_(torch.where(self.done >= self.need, REPLAY_T, self.done))

    def round_buffers(self):
        return [self.done, self.state]

    def status(self):
        return self.state

    def next_kind(self, last_kind, late):
        return "round"

    def declare_rows(self, table):
        for name, value in (("need", self.need), ("done", self.done), ("state", self.state), ("tokens", self.tokens)):
            table.add(name, value)

    def finish_results(self, out):
        out["passes"] = out.pop("done")
        return out

    def summarize(self, counters, loop_stats):
        return {}


def simulate(passes, rows: int, static: bool) -> dict:
    """The loop's schedule (``runtime.loop.run``, its scheduler and late reads) for images needing
    ``passes[i]`` rounds each, replayed with :class:`ReplayDecoder` -> rounds, row-rounds
    (tests/test_loop.py checks both against real decodes)."""
    from vvs_engine.runtime import loop

    out = loop.run(ReplayDecoder, lambda images, pad: [passes[i] for i in images] + [passes[images[0]]] * (pad - len(images)),
                   len(passes), rows, REPLAY_T, static=static, retire=True)
    return {"rounds": out.stats["batch_rounds"], "row_rounds": out.stats["row_rounds"],
            "utilisation": sum(passes) / out.stats["row_rounds"] if out.stats["row_rounds"] else 1.0}


def measure(engine, method: str, n: int, rows: int, repeats: int) -> dict:
    import torch

    labels = [i % 16 for i in range(n)]
    kw = dict(class_labels=labels, method=method, seed=0, batch_size=rows, decode_images=False)
    out, walls = {}, {"static": [], "continuous": []}
    for _ in range(repeats):
        for mode in ("static", "continuous"):  # interleaved: both see the same machine load
            t0 = time.perf_counter()
            out[mode] = engine.generate(static_batches=mode == "static", **kw)
            walls[mode].append(time.perf_counter() - t0)
    row = {"method": method}
    passes = out["static"].stats["per_image"]["target_forward_passes"]
    for mode in ("static", "continuous"):
        s = out[mode].stats
        sim = simulate(passes, rows, mode == "static") if method in SIMULATED else {"rounds": None, "row_rounds": None}
        row[mode] = {"rounds": s["batch_rounds"], "row_rounds": s["row_rounds"], "utilisation": s["row_utilisation"],
                     "images_per_s": n / statistics.median(walls[mode]), "simulated_rounds": sim["rounds"],
                     "simulated_row_rounds": sim["row_rounds"], "rounds_by_kind": s["rounds_by_kind"]}
    row["forwards_per_image_equal"] = out["static"].stats["per_image"] == out["continuous"].stats["per_image"]
    row["images_with_equal_tokens"] = int((out["static"].tokens == out["continuous"].tokens).all(1).sum())
    row["forwards_per_image"] = sum(passes) / n
    row["per_image_forwards"] = passes  # what simulate() replays
    row["speed_ratio"] = row["continuous"]["images_per_s"] / row["static"]["images_per_s"]
    return row


def from_cache(rows_list) -> list:
    import numpy as np

    cost = json.load(open(os.path.join(ROOT, "benchmarks/results/round_cost.json")))["compiled_model"]["LlamaGen-XL"]
    out = []
    for name, cost_row in CACHE_ROWS.items():
        path = os.path.join(QUALITY_CACHE, name + ".npz")
        if not os.path.exists(path) or cost_row not in cost["rows"]:
            continue
        passes = [int(x) for x in np.load(path)["forwards"]]
        kinds = cost["rows"][cost_row]["kinds"]
        per_image = cost["rows"][cost_row].get("rounds_per_image") or {k: 1.0 for k in kinds}
        round_ms = sum(kinds[k]["ms"] * per_image[k] for k in kinds) / sum(per_image[k] for k in kinds)
        entry = {"setting": cost_row, "images": len(passes), "round_ms": round_ms}
        for rows in rows_list:
            for mode in ("static", "continuous"):
                sim = simulate(passes, rows, mode == "static")
                sim["modelled_images_per_s"] = len(passes) / (sim["rounds"] * round_ms / 1000)
                entry[f"{mode}_{rows}"] = sim
        out.append(entry)
    return out


def write(measured, cached, args, run):
    lines = [f"<!-- written by: {run['command']} -->", "# Continuous batching vs static batches", "",
             f"Command: `OMP_NUM_THREADS=1 {run['command']}` ({run['date'][:10]}).", ""]
    if measured:
        lines += [f"## Measured on the Zoo: {args.images} images, {args.rows} rows in flight, CPU, 1 thread", "",
                  "Rounds and row-rounds as run; utilisation = row-rounds committing tokens for a real image / all "
                  "row-rounds; images/s on this CPU as a ratio (median of "
                  f"{args.repeats}, interleaved). `sim` = the schedule replayed by `simulate()` on the measured "
                  "per-image forwards (it must equal the run; VVS has none: its sequences sit out rounds of the kind "
                  "they do not want). Tokens: identical in fp64 (tests/test_loop.py); in fp32 a different batch "
                  "composition can flip a near-tie (docs/batching.md), hence the count of equal images.", "",
                  "| method | rounds static -> continuous (sim) | utilisation static -> continuous | forwards / image "
                  f"| forwards per image equal | images with equal tokens (of {args.images}, fp32) "
                  "| CPU images/s continuous / static |",
                  "|---|---|---|---|---|---|---|"]
        for r in measured:
            s, c = r["static"], r["continuous"]
            sim = f" ({s['simulated_rounds']} -> {c['simulated_rounds']})" if s["simulated_rounds"] else ""
            lines.append(f"| {r['method']} | {s['rounds']} -> {c['rounds']}{sim} | {s['utilisation']:.3f} -> "
                         f"{c['utilisation']:.3f} | {r['forwards_per_image']:.1f} | {r['forwards_per_image_equal']} | "
                         f"{r['images_with_equal_tokens']} | {r['speed_ratio']:.2f} |")
        lines.append("")
    if cached:
        lines += ["## 512 Zoo images (the committed quality cache), the loop's schedule replayed", "",
                  "Per-image forwards from `benchmarks/results/quality_speed_tokens/*.npz`; rounds and utilisation "
                  "from `simulate()` (validated against the measured runs above). Modelled GPU images/s at "
                  "LlamaGen-XL shape = images / (rounds x the modelled compiled round time of "
                  "`benchmarks/results/round_cost.json`, batch-1 figure): a MODEL (a round is taken to cost the "
                  "same at any batch; no GPU measurement). VVS settings are left out (their skip rounds are "
                  "not in the cache) and so is ZipAR (no round-cost row).", ""]
        for rows in args.cache_rows:
            lines += [f"### {rows} rows", "",
                      "| setting | rounds static -> continuous | x fewer | utilisation static -> continuous "
                      "| modelled XL images/s static -> continuous |", "|---|---|---|---|---|"]
            for e in cached:
                s, c = e[f"static_{rows}"], e[f"continuous_{rows}"]
                lines.append(f"| {e['setting']} | {s['rounds']} -> {c['rounds']} | {s['rounds'] / c['rounds']:.2f} | "
                             f"{s['utilisation']:.3f} -> {c['utilisation']:.3f} | {s['modelled_images_per_s']:.1f} -> "
                             f"{c['modelled_images_per_s']:.1f} |")
            lines.append("")
    write_tables(os.path.join(args.out, "continuous_batching"), "\n".join(lines),
                 {"command": run["command"], "measured": measured, "cache": cached})


def main(argv=None, engine=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", default=",".join(LOOP_METHODS))
    p.add_argument("--cache-rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--no-measure", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    measured = []
    if not args.no_measure:
        if engine is None:
            from vvs_engine import Engine

            engine = Engine.load()
        for method in args.methods.split(","):
            row = measure(engine, method, args.images, args.rows, args.repeats)
            print(json.dumps(row), flush=True)
            measured.append(row)
    cached = from_cache(args.cache_rows) if args.cache_rows else []
    write(measured, cached, args, provenance(__file__, argv))
    return measured, cached


if __name__ == "__main__":
    main()
