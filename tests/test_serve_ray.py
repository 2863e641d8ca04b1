"""``vvs-engine serve --ray``: the server's app as a Ray Serve deployment on a local Ray cluster of 2 CPUs
(as the Ray dataset tests start one): 2 replicas of the Zoo model (AR, 2 rows, a queue of 2 images,
fp64, 1 CPU each), a real HTTP client through Ray's proxy.

Checked: both replicas run; concurrent requests all succeed and each returns exactly the tokens
``Engine.generate`` makes offline for its seed and settings (fp64: whatever shares a batch); overflow
beyond what the replicas hold is 429 with Retry-After (the app's one-line JSON, or Ray's), not a hang, and the
server serves again afterwards; Ray's own overflow (every replica at ``max_ongoing_requests``, Ray's
queue full) is 429 too, on a second deployment sized to reach it.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

try:
    import ray
    from ray import serve
except ImportError as e:  # only where ray[serve] is missing
    print(f"SKIP REASON: ray[serve] is not importable ({e}); pip install -e '.[ray,serve]'")
    pytest.skip(f"ray[serve] is not importable ({e}); pip install -e '.[ray,serve]'", allow_module_level=True)
httpx = pytest.importorskip("httpx", reason="the server tests need the [serve] extra (httpx)")
pytest.importorskip("fastapi", reason="the server tests need the [serve] extra (fastapi, uvicorn)")

from serve_utils import png_pixels  # noqa: E402
from vvs_engine.serving import ray_serve  # noqa: E402

ROWS, QUEUE, REPLICAS = 2, 2, 2
FLAGS = ["--method", "ar", "--rows", str(ROWS), "--queue-size", str(QUEUE), "--max-n", "4", "--dtype", "fp64",
         "--request-timeout", "300", "--threads", "1"]



def deploy_argv(argv):
    """``vvs-engine serve ARGV --ray`` without the waiting: the CLI's parsing, then the deployment."""
    from vvs_engine.cli import build_parser, method_options, pick_device

    args = build_parser().parse_args(["serve", *argv])
    if args.ray is None:
        args.ray = "auto"
    return ray_serve.deploy_checked(args, method_options(args), pick_device(args.device))

@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module: 2 CPUs (one per replica), no dashboard, a small object store.
    Workers import this checkout (PYTHONPATH), whatever else is installed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ray_serve.__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 ** 2, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def url(cluster):
    started = time.monotonic()
    address = deploy_argv([*FLAGS, "--num-replicas", str(REPLICAS), "--port", "0"])
    print(f"deployed {REPLICAS} replicas in {time.monotonic() - started:.1f} s")
    return address


@pytest.fixture(scope="module")
def engine():
    from vvs_engine import Engine

    return Engine.load(dtype="fp64", threads=1)


def send_all(url: str, bodies: list, timeout_s: float = 240.0) -> list:
    """Post every body at once (a client per thread); the answers in order. A request that has no
    answer within the timeout fails the test (a hang)."""
    results = [None] * len(bodies)

    def send(i):
        with httpx.Client(base_url=url, timeout=timeout_s) as own:
            results[i] = own.post("/v1/images/generations", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert all(r is not None for r in results), "a request got no answer (hung)"
    return results


def running_replicas() -> int:
    status = serve.status().applications[ray_serve.APP_NAME].deployments[ray_serve.DEPLOYMENT_NAME]
    return status.replica_states.get("RUNNING", 0)


def test_replicas_serve_the_offline_images(url, engine):
    """Four concurrent requests (different seeds, labels, sampling) over 2 replicas all succeed, each
    with exactly the offline tokens; then a request of 2 images (image j = image index j)."""
    assert running_replicas() == REPLICAS
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/ready").json() == {"status": "ready"}
        model = client.get("/v1/models").json()["data"][0]
        assert (model["id"], model["method"], model["rows"], model["size"]) == ("zoo-gpt", "ar", ROWS, "64x64")
        bad = client.post("/v1/images/generations", json={"class_label": 99})
        assert bad.status_code == 422 and bad.json()["error"]["param"]  # the app's own errors, unchanged
    bodies = [{"class_label": 3, "seed": 5, "return_tokens": True},
              {"class_label": 7, "seed": 6, "temperature": 0.7, "top_k": 50, "return_tokens": True},
              {"prompt": "coffee", "seed": 5, "guidance_scale": 2.0, "top_p": 0.9, "return_tokens": True},
              {"class_label": 12, "seed": 9, "return_tokens": True}]
    started = time.monotonic()
    results = send_all(url, bodies)
    print(f"4 concurrent requests in {time.monotonic() - started:.1f} s")
    for r in results:
        assert r.status_code == 200, r.text
    offline = engine.generate(class_labels=[3, 7, 1, 12], seed=[5, 6, 5, 9], image_indices=[0, 0, 0, 0],
                              temperature=[1.0, 0.7, 1.0, 1.0], top_k=[0, 50, 0, 0], top_p=[1.0, 1.0, 0.9, 1.0],
                              cfg_scale=[4.0, 4.0, 2.0, 4.0], batch_size=4, decode_images=False)
    for i, r in enumerate(results):
        item = r.json()["data"][0]
        assert item["tokens"] == offline.tokens[i].tolist(), i
        assert png_pixels(item["b64_json"]).shape == (64, 64, 3)
    with httpx.Client(base_url=url, timeout=120) as client:
        two = client.post("/v1/images/generations", json={"class_label": 4, "n": 2, "seed": 11,
                                                           "return_tokens": True})
    assert two.status_code == 200, two.text
    pair = engine.generate(class_labels=[4, 4], seed=11, batch_size=2, decode_images=False)
    assert [item["tokens"] for item in two.json()["data"]] == pair.tokens.tolist()


def test_overflow_is_429_not_a_hang_then_recovers(url):
    """Each replica holds 2 images in rows and 2 waiting: of 8 concurrent requests of 2 images, at most
    2 per replica are accepted while the first decodes, the rest are answered 429 with Retry-After at
    once (the app's bounded queue, or Ray's if its proxy counts too many still unrouted); afterwards the
    server serves again."""
    started = time.monotonic()
    results = send_all(url, [{"class_label": k, "n": 2, "seed": k} for k in range(8)])
    statuses = sorted(r.status_code for r in results)
    print(f"8 requests of 2 images: statuses {statuses} in {time.monotonic() - started:.1f} s")
    assert set(statuses) <= {200, 429}, [r.text for r in results if r.status_code not in (200, 429)]
    assert statuses.count(429) >= 8 - 2 * REPLICAS
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            if r.headers["content-type"].startswith("application/json"):  # the replica's queue
                assert r.json()["error"]["code"] == "queue_full" and "\n" not in r.text.strip()
            else:  # Ray's proxy (its queue of requests not yet given a replica)
                print(f"Ray's 429: {r.text[:120]!r}")
                assert int(r.headers["retry-after"]) == ray_serve.RAY_RETRY_AFTER_S
        else:
            assert len(r.json()["data"]) == 2
    with httpx.Client(base_url=url, timeout=120) as client:
        again = client.post("/v1/images/generations", json={"class_label": 2, "n": 2})
        assert again.status_code == 200, again.text


def test_metrics_see_every_replica_then_drain_is_503_json(url):
    """/metrics through Ray's proxy shows both replicas' series (labelled by replica) whichever replica
    answers, and the per-replica counters never go down between scrapes; after the driver's drain
    (what SIGTERM does), /ready and new requests get the app's 503 JSON, /health still answers."""
    from vvs_engine.serving.metrics import parse_text

    time.sleep(2 * ray_serve.REPORT_INTERVAL_S)  # every replica has reported its latest counters
    seen = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(6):
            text = client.get("/metrics").text
            assert text.count("# TYPE vvs:images_generated_total counter") == 1  # one family, both replicas
            images = {key.split('replica="')[1].split('"')[0]: value for key, value in parse_text(text).items()
                      if key.startswith("vvs:images_generated_total{")}
            assert len(images) == REPLICAS, images
            seen.append(images)
        for before, after in zip(seen, seen[1:]):
            assert all(after[r] >= before[r] for r in before)
        assert sum(seen[-1].values()) >= REPLICAS + 4 + 2  # the warm-ups and the images served above
        ray.get(ray_serve.board().drain.remote())
        time.sleep(2 * ray_serve.REPORT_INTERVAL_S)
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
        refused = client.post("/v1/images/generations", json={"class_label": 1})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert client.get("/health").json() == {"status": "ok"}
        assert ray.get(ray_serve.board().all_idle.remote())


def test_ray_queue_overflow_is_429(url, cluster):
    """Ray's own overflow, on a second deployment (the first is deleted) of one replica that Ray hands
    1 request at a time and queues 1 more for: a third concurrent request is refused by Ray with 429
    and a Retry-After, the two others are served."""
    serve.shutdown()  # (a new proxy then binds the new deployment's port)
    small = deploy_argv([*FLAGS, "--num-replicas", "1", "--max-ongoing-requests", "1",
                                   "--max-queued-requests", "1", "--port", "0"])
    statuses = {}

    def send(i):
        with httpx.Client(base_url=small, timeout=120) as own:
            statuses[i] = own.post("/v1/images/generations", json={"class_label": i, "seed": i})

    first = threading.Thread(target=send, args=(0,))
    first.start()
    time.sleep(1.0)  # the first is on the replica
    second = threading.Thread(target=send, args=(1,))
    second.start()
    time.sleep(1.0)  # the second waits in Ray's queue
    with httpx.Client(base_url=small, timeout=30) as client:
        refused = client.post("/v1/images/generations", json={"class_label": 2})
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) == ray_serve.RAY_RETRY_AFTER_S
    for t in (first, second):
        t.join(120)
    assert statuses[0].status_code == 200 and statuses[1].status_code == 200
