"""The GPU check of ``vvs-engine serve`` (one short call on a CUDA machine; CUDA graphs on, no compile).

A server with 8 rows on ``cuda``: three concurrent requests with different seeds and settings against
one offline ``Engine.generate`` with the same per-image settings (fp32 on a GPU: equal tokens expected
unless another batch composition flips a near-tie, so the count is reported, not asserted), a stream
dropped mid-run (its rows free within a second), SIGTERM (exit 0). Prints and writes a JSON summary.

    python benchmarks/gpu_serve_check.py --out $OUT/gpu_serve_check.json
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from serve_load import Server  # noqa: E402


def metric(client, name):
    from vvs_engine.serving.metrics import parse_text, sample

    return sample(parse_text(client.get("/metrics").text), name)


def main() -> int:
    import httpx

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_serve_check.json")
    p.add_argument("--method", default="ar")
    args = p.parse_args()
    summary = {"method": args.method}
    started = time.monotonic()
    server = Server(["--device", "cuda", "--no-compile", "--rows", "8", "--method", args.method])
    summary["start_s"] = time.monotonic() - started
    bodies = [{"class_label": 3, "n": 2, "seed": 5, "return_tokens": True},
              {"class_label": 7, "n": 1, "seed": 6, "temperature": 0.7, "top_k": 50, "return_tokens": True},
              {"class_label": 1, "n": 1, "seed": 5, "cfg_scale": 2.0, "top_p": 0.9, "return_tokens": True}]
    results = {}

    def send(i):
        with httpx.Client(base_url=server.url, timeout=300) as own:
            results[i] = own.post("/v1/images/generations", json=bodies[i])

    try:
        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        summary["three_requests_s"] = time.monotonic() - t0
        summary["status"] = [results[i].status_code for i in range(3)]
        from vvs_engine import Engine

        offline = Engine.load(device="cuda").generate(
            class_labels=[3, 3, 7, 1], seed=[5, 5, 6, 5], image_indices=[0, 1, 0, 0],
            temperature=[1.0, 1.0, 0.7, 1.0], top_k=[0, 0, 50, 0], top_p=[1.0, 1.0, 1.0, 0.9],
            cfg_scale=[4.0, 4.0, 4.0, 2.0], batch_size=8, method=args.method, decode_images=False)
        served = [item["tokens"] for i in range(3) for item in results[i].json()["data"]]
        summary["images_equal_to_offline"] = sum(a == b.tolist() for a, b in zip(served, offline.tokens))
        summary["images"] = len(served)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/images/generations",
                               json={"class_label": 4, "n": 8, "stream": True, "progress": True}) as stream:
                lines = stream.iter_lines()
                while "progress" not in next(lines):
                    pass
                summary["running_during_stream"] = metric(client, "vvs:num_images_running")
            t0 = time.monotonic()
            while metric(client, "vvs:num_images_running") != 0 and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            summary["rows_freed_after_disconnect_s"] = time.monotonic() - t0
            summary["round_seconds_count"] = metric(client, "vvs:round_seconds_count")
            text = client.get("/metrics").text
            summary["round_seconds_sum"] = [ln for ln in text.splitlines() if ln.startswith("vvs:round_seconds_sum")]
    finally:
        summary["exit_code"] = server.stop()
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
