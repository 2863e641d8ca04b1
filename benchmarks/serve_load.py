"""Load test of ``vvs-engine serve`` on loopback: static batches vs continuous batching in one run.

For each method two real server processes are started (``--static-batches`` and continuous; the modes
take turns at each rate, so a shared machine's load drifts over both alike), and an asyncio client sends requests with Poisson arrivals (exponential gaps) at a sweep of rates: a fixed
number of requests per rate, each of ``--images`` images (1 by default) with a random class and its own
seed, and a time bound per rate (requests still open then count as failed). The rates are fractions of
the continuous server's capacity, measured first with a burst (every request at once) so the sweep
lands below, near and above saturation on any machine.

Per rate: p50/p95/p99 end-to-end latency of the requests served, their queue time (arrival -> first
image admitted, from the response), images/s (images served / (last answer - first send)), rejected
(429), failed (any other answer, a time-out, or a response without exactly n valid PNGs of the
server's size). Every accepted request is checked: exactly n images, each a PNG of the model's size.

    OMP_NUM_THREADS=1 python benchmarks/serve_load.py            # AR, SJD-PAC, LANTERN; writes results
    python benchmarks/serve_load.py --methods ar --requests 8 --fractions 1.0 --out /tmp/x   # quick

``--output-split`` measures something else, in one process without HTTP: the engine thread's loop
with finished images decoded and encoded on the loop thread (the server before the output worker)
and on the output worker (now), taking turns. From the loop's ``round_done`` hook: the time from one
round's launch to the next (the loop thread's time per round, its own work between rounds included)
in iterations where images finished vs where none did, and the p95 of that gap over all rounds.

    OMP_NUM_THREADS=1 python benchmarks/serve_load.py --output-split   # writes results/serve_output_split.md

CPU figures are ratios between the two modes on this machine, not GPU expectations.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import ROOT, write_tables  # noqa: E402  (sets the checkout's path first)
SETTINGS = {  # method -> the serve flags of its setting
    "ar": ["--method", "ar"],
    "sjd-pac": ["--method", "sjd-pac"],
    "lantern": ["--method", "lantern", "--tree", "chain", "--tree-depth", "4"],
}


class Server:
    def __init__(self, flags):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "vvs_engine", "serve", *flags, "--port", "0"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url, self.lines = None, []
        found = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                match = re.search(r"listening on (http://[\d.]+:\d+)", line)
                if match:
                    self.url = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        found.wait(1800)  # (a warm-up at nice 19 on a busy shared machine took over 10 minutes)
        if self.url is None:
            raise SystemExit("the server did not start:\n" + "".join(self.lines[-20:]))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(300)


def valid_images(body: dict, n: int, size: tuple) -> bool:
    from PIL import Image

    data = body.get("data") or []
    if len(data) != n:
        return False
    for item in data:
        try:
            image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
            image.load()
        except Exception:
            return False
        if image.format != "PNG" or image.size != size:
            return False
    return True


async def one(client, index: int, n: int, classes: int, size: tuple, rng: random.Random) -> dict:
    body = {"class_label": rng.randrange(classes), "n": n, "seed": 1000 + index}
    sent = time.monotonic()
    try:
        r = await client.post("/v1/images/generations", json=body)
    except Exception as e:  # connection error or client time-out
        return {"status": "error", "error": type(e).__name__, "sent": sent, "done": time.monotonic()}
    done = time.monotonic()
    out = {"status": r.status_code, "sent": sent, "done": done, "latency": done - sent}
    if r.status_code == 200:
        payload = r.json()
        out["valid"] = valid_images(payload, n, size)
        out["queue"] = payload["timings"]["queue_s"]
        out["images"] = n
        out["forwards"] = payload["usage"]["target_forward_passes"]
    return out


async def load(url: str, rate: float, count: int, n: int, classes: int, size: tuple, bound_s: float, seed: int):
    """``count`` requests with exponential gaps of mean 1/rate (rate = inf: all at once)."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=count + 4, max_keepalive_connections=count + 4)
    async with httpx.AsyncClient(base_url=url, timeout=bound_s, limits=limits) as client:
        start = time.monotonic()
        tasks = []
        for i in range(count):
            if rate != float("inf") and i:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.ensure_future(one(client, i, n, classes, size, random.Random(seed * 1000 + i))))
        left = max(1.0, bound_s - (time.monotonic() - start))
        done, pending = await asyncio.wait(tasks, timeout=left)
        for task in pending:
            task.cancel()
        results = [t.result() for t in done] + [{"status": "timeout"} for _ in pending]
    return results, start


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results, start) -> dict:
    served = [r for r in results if r.get("status") == 200 and r.get("valid")]
    invalid = [r for r in results if r.get("status") == 200 and not r.get("valid")]
    rejected = [r for r in results if r.get("status") == 429]
    failed = len(results) - len(served) - len(rejected)
    failures: dict = {}  # what the failed ones were: a status, a client error, or "timeout" (the rate's bound)
    for r in results:
        if r.get("status") not in (200, 429):
            kind = r.get("error") or str(r.get("status"))
            failures[kind] = failures.get(kind, 0) + 1
    latency = [r["latency"] for r in served]
    queue = [r["queue"] for r in served if r.get("queue") is not None]
    images = sum(r["images"] for r in served)
    span = (max(r["done"] for r in served) - start) if served else None
    return {"requests": len(results), "served": len(served), "rejected": len(rejected), "failed": failed,
            "failures": failures,
            "invalid": len(invalid), "images": images, "images_per_s": images / span if span else 0.0,
            "p50_s": percentile(latency, 0.5), "p95_s": percentile(latency, 0.95), "p99_s": percentile(latency, 0.99),
            "queue_p50_s": percentile(queue, 0.5), "queue_p95_s": percentile(queue, 0.95),
            "forwards_per_image": sum(r["forwards"] for r in served) / images if images else None}


def model_info(url: str) -> tuple:
    import httpx

    model = httpx.get(url + "/v1/models").json()["data"][0]
    w, h = (int(x) for x in model["size"].split("x"))
    return model["num_classes"], (w, h)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,sjd-pac,lantern", help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--queue-size", type=int, default=None, help="the servers' --queue-size (default theirs)")
    p.add_argument("--requests", type=int, default=20, help="requests per rate")
    p.add_argument("--images", type=int, default=1, help="images per request")
    p.add_argument("--fractions", default="0.5,0.9,1.3", help="rates as fractions of the measured capacity")
    p.add_argument("--bound", type=float, default=None, help="time bound per rate in seconds (default: 3 x the "
                                                             "requests' images at capacity + 60)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_load_zoo_cpu"),
                   help="results path without extension (.md and .json are written)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="a line written under the table's description")
    p.add_argument("--server-flags", default="", help="more serve flags for every server, e.g. '--device cuda'")
    p.add_argument("--output-split", action="store_true",
                   help="measure the loop thread with image output on it vs on the output worker (no HTTP)")
    p.add_argument("--repeats", type=int, default=2, help="--output-split: runs of each mode, taking turns")
    args = p.parse_args(argv)
    import shlex

    command = "python benchmarks/serve_load.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.output_split:
        return output_split(args, command)
    fractions = [float(x) for x in args.fractions.split(",")]
    rows = {}
    for method in args.methods.split(","):
        flags = SETTINGS[method] + ["--rows", str(args.rows), "--threads", "1"] + args.server_flags.split()
        if args.queue_size is not None:
            flags += ["--queue-size", str(args.queue_size)]
        # both servers up at once (an idle one waits without spinning), the modes interleaved per rate,
        # so a shared machine's load drifts over both alike
        servers = {mode: Server(flags + (["--static-batches"] if mode == "static" else []))
                   for mode in ("continuous", "static")}
        try:
            classes, size = model_info(servers["continuous"].url)
            burst = max(2 * args.rows // args.images, 2)  # the capacity: the sweep's unit
            results, start = asyncio.run(load(servers["continuous"].url, float("inf"), burst, args.images, classes,
                                              size, 1800, args.seed + 99))
            capacity = summarize(results, start)["images_per_s"] / args.images  # requests/s
            print(f"{method}: capacity {capacity * args.images:.3f} images/s (burst of {burst})", flush=True)
            bound = args.bound or 3 * args.requests / capacity + 60
            for fraction in fractions:
                for mode in ("continuous", "static"):
                    rate = fraction * capacity
                    results, start = asyncio.run(load(servers[mode].url, rate, args.requests, args.images, classes,
                                                      size, bound, args.seed + int(fraction * 1000)))
                    row = summarize(results, start)
                    row.update(method=method, mode=mode, fraction=fraction, rate=rate)
                    rows.setdefault(method, []).append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for mode, server in servers.items():
                code = server.stop()
                if code != 0:
                    print(f"warning: the {method} {mode} server exited {code}", file=sys.stderr)
    write(args, command, rows)
    return 0


def _split_run(engine, rows: int, images: int, output_thread: bool, seed: int) -> list:
    """One burst of ``images`` one-image requests through an engine thread; the loop's round trace."""
    from vvs_engine.sampling import SamplingParams
    from vvs_engine.serving.worker import EngineWorker, Request

    worker = EngineWorker(engine, "ar", {}, rows, SamplingParams(), max_waiting_images=images,
                          output_thread=output_thread)
    worker.start()
    done = threading.Semaphore(0)
    worker.queue.trace = []
    rng = random.Random(seed)
    for i in range(images):
        worker.queue.submit(Request(1, [rng.randrange(engine.config.num_classes)], None, seed + i, SamplingParams(),
                                    lambda event: done.release() if event[0] in ("image", "error") else None))
    for _ in range(images):
        done.acquire()
    trace = worker.queue.trace
    worker.close()
    return trace


def _split_figures(traces: list) -> dict:
    """Per round (launch to next launch): the loop thread's CPU seconds and the wall seconds, split by
    whether images finished in between."""
    cpu = {True: [], False: []}
    wall = {True: [], False: []}
    gaps = []
    for trace in traces:
        for previous, current in zip(trace, trace[1:]):
            finishing = bool(current[3])
            cpu[finishing].append(current[4] - previous[4])
            wall[finishing].append(current[0] - previous[0])
            gaps.append(current[0] - previous[0])
    ms = lambda values, q=0.5: 1000 * percentile(values, q)  # noqa: E731
    return {"rounds": len(gaps), "finishing_rounds": len(cpu[True]),
            "finishing_cpu_ms": ms(cpu[True]), "quiet_cpu_ms": ms(cpu[False]),
            "finishing_wall_ms": ms(wall[True]), "quiet_wall_ms": ms(wall[False]),
            "p95_gap_ms": ms(gaps, 0.95), "max_gap_ms": 1000 * max(gaps)}


def output_split(args, command: str) -> int:
    from vvs_engine import Engine

    engine = Engine.load(threads=1)
    modes = {"on the loop thread (before)": False, "output worker (after)": True}
    traces = {mode: [] for mode in modes}
    images = 3 * args.rows
    for repeat in range(args.repeats):
        for mode, output_thread in modes.items():  # taking turns: a shared machine's load drifts over both
            traces[mode].append(_split_run(engine, args.rows, images, output_thread, args.seed + 1000 * repeat))
            print(f"{mode}: run {repeat + 1} done", flush=True)
    figures = {mode: _split_figures(t) for mode, t in traces.items()}
    out = args.out if args.out != os.path.join(HERE, "results", "serve_load_zoo_cpu") else \
        os.path.join(HERE, "results", "serve_output_split")
    lines = [f"<!-- written by: {command} -->", "# The server's loop thread: image output on it vs on the output worker",
             "", f"Command: `OMP_NUM_THREADS=1 {command}` ({time.strftime('%Y-%m-%d')}).", "",
             f"The shipped Zoo model (64 px, 256 tokens an image), AR, fp32 on this CPU, {args.rows} rows, 1 torch "
             f"thread; one engine thread as `vvs-engine serve` runs it, without HTTP; each run a burst of {images} "
             f"one-image requests, {args.repeats} runs per mode taking turns. A round = from its launch to the next "
             "round's launch (admission and collection included), from the loop's `round_done` hook. *finishing*: "
             "rounds after which images finished (their VQ decode and PNG encode ran on the loop thread before the "
             "output worker); *quiet*: the others. **CPU ms** = the loop thread's own CPU time "
             "(`time.thread_time`): what it spent, whatever else ran on the machine; **wall ms** and the gaps "
             "between launches also count the time the thread waited for a core (this machine is shared: wall "
             "figures are noisy). Medians per round; p95 and max gap over all rounds.", "",
             "| image output | rounds | finishing rounds | finishing CPU ms | quiet CPU ms | finishing wall ms | "
             "quiet wall ms | p95 gap ms | max gap ms |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, f_ in figures.items():
        lines.append(f"| {mode} | {f_['rounds']} | {f_['finishing_rounds']} | {f_['finishing_cpu_ms']:.1f} | "
                     f"{f_['quiet_cpu_ms']:.1f} | {f_['finishing_wall_ms']:.1f} | {f_['quiet_wall_ms']:.1f} | "
                     f"{f_['p95_gap_ms']:.1f} | {f_['max_gap_ms']:.1f} |")
    before, after = figures["on the loop thread (before)"], figures["output worker (after)"]
    lines += ["", f"On the loop thread's CPU a round after which images finished cost "
                  f"{before['finishing_cpu_ms'] / before['quiet_cpu_ms']:.2f}x a quiet round with the output on the "
                  f"loop thread and {after['finishing_cpu_ms'] / after['quiet_cpu_ms']:.2f}x with the output worker "
                  "(what remains is the collection and the next images' admission and prefill).", ""]
    write_tables(out, "\n".join(lines), {"command": command, "figures": figures})
    print("\n".join(lines))
    return 0


def _f(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def write(args, command: str, rows: dict) -> None:
    lines = [f"<!-- written by: {command} -->", "# `vvs-engine serve` under load: static batches vs continuous batching",
             "", f"Command: `OMP_NUM_THREADS=1 {command}` ({time.strftime('%Y-%m-%d')}).", "",
             f"The shipped Zoo model (64 px, 256 tokens an image), fp32, {args.rows} rows, 1 torch thread per server, "
             f"loopback, server flags `{args.server_flags or '(none)'}` (no `--device`: this CPU). {args.requests} requests per rate, {args.images} image(s) each, random class, "
             "own seed; Poisson arrivals at a fraction of the capacity measured on the continuous server with a "
             "burst. Latency = send to answer; queue = arrival to first image admitted (from the answer); "
             "images/s = images served / (last answer - first send). Every accepted request was checked for "
             "exactly n PNGs of the model's size (`invalid`). CPU figures: ratios between the two modes on this "
             "machine, not GPU figures.", ""]
    if args.note:
        lines += [args.note, ""]
    for method, items in rows.items():
        lines += [f"## {method}", "", "| rate (x capacity) | req/s | mode | images/s | p50 s | p95 s | p99 s | "
                  "queue p50 s | queue p95 s | served | rejected | failed | invalid | forwards/image |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for fraction in sorted({r["fraction"] for r in items}):
            for r in [x for x in items if x["fraction"] == fraction]:
                lines.append(f"| {fraction:g} | {r['rate']:.3f} | {r['mode']} | {r['images_per_s']:.3f} | "
                             f"{_f(r['p50_s'])} | {_f(r['p95_s'])} | {_f(r['p99_s'])} | {_f(r['queue_p50_s'])} | "
                             f"{_f(r['queue_p95_s'])} | {r['served']} | {r['rejected']} | {r['failed']} | "
                             f"{r['invalid']} | {_f(r['forwards_per_image'], 1)} |")
        by = {(r["fraction"], r["mode"]): r for r in items}
        ratios = []
        for fraction in sorted({r["fraction"] for r in items}):
            s, c = by.get((fraction, "static")), by.get((fraction, "continuous"))
            if s and c and s["images_per_s"]:
                ratios.append(f"{fraction:g}x: images/s continuous / static = "
                              f"{c['images_per_s'] / s['images_per_s']:.2f}, p95 {_f(c['p95_s'])} s vs "
                              f"{_f(s['p95_s'])} s")
        failures = [f"{r['fraction']:g}x {r['mode']}: " + ", ".join(f"{n} {kind}" for kind, n in r["failures"].items())
                    for r in items if r.get("failures")]
        lines += ["", "; ".join(ratios) + "."]
        lines += ["", "Failed requests: " + "; ".join(failures) + " (timeout: still open at the rate's time bound)."] \
            if failures else []
        lines += [""]
    write_tables(args.out, "\n".join(lines), {"command": command, "rows": rows})
    print(f"wrote {args.out}.md and .json")


if __name__ == "__main__":
    sys.exit(main())
