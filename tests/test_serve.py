"""``vvs-engine serve`` against a real server process on 127.0.0.1 with a real HTTP client: the shipped
Zoo model, AR, 4 rows, fp64 (where no batch composition can change an image's tokens, so a request's
images must equal ``Engine.generate``'s bit for bit whatever shares the batch with them).

One server for the module (starting one decodes a warm-up image). The tests run in file order and
share it; each waits until the server is idle before it starts.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need the [serve] extra (httpx)")
pytest.importorskip("fastapi", reason="the server tests need the [serve] extra (fastapi, uvicorn)")

from serve_utils import Chromium, ServerProcess, metric, png_pixels, wait_for  # noqa: E402

ROWS, QUEUE, MAX_N = 4, 5, 4
T = 256  # Zoo tokens per image


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(["--rows", str(ROWS), "--queue-size", str(QUEUE), "--max-n", str(MAX_N), "--dtype", "fp64",
                          "--request-timeout", "300"])
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    from vvs_engine import Engine

    return Engine.load(dtype="fp64", threads=1)


@pytest.fixture(scope="module")
def shared():
    return {}  # results one test leaves for a later one


def idle(client) -> bool:
    return metric(client, "vvs:num_images_running") == 0 and metric(client, "vvs:num_images_waiting") == 0


def post(client, body: dict):
    return client.post("/v1/images/generations", json=body)


def test_endpoints(server, client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    model = client.get("/v1/models").json()["data"][0]
    assert (model["id"], model["method"], model["size"], model["rows"], model["max_n"]) == \
        ("zoo-gpt", "ar", "64x64", ROWS, MAX_N)
    assert model["num_classes"] == 16 and model["class_names"][1] == "coffee"
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    assert "/v1/images/generations" in page.text and "<script" in page.text
    assert "src=\"http" not in page.text and "href=\"http" not in page.text  # no external assets
    text = client.get("/metrics").text
    for name in ("vvs:num_requests_running", "vvs:num_requests_waiting", "vvs:request_queue_time_seconds_bucket",
                 "vvs:e2e_request_latency_seconds_count", "vvs:time_to_first_token_seconds_sum",
                 "vvs:tokens_committed_total", "vvs:requests_rejected_total"):
        assert name in text, name
    # the warm-up image ran through the loop before the port was bound
    assert metric(client, "vvs:images_generated_total") == 1
    assert metric(client, "vvs:round_seconds_count", kind="ar_step") >= T


BAD = [  # (body, status, param or words in the message)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"class_label": 3, "colour": "red"}, 422, "unknown field 'colour'"),
    ({"n": 1}, 422, "class_label"),
    ({"class_label": 16}, 422, "out of range"),
    ({"class_label": [1, 2], "n": 3}, 422, "2 entries for n=3"),
    ({"class_label": 1, "n": 0}, 422, "n:"),
    ({"class_label": 1, "n": "2"}, 422, "n:"),
    ({"class_label": 1, "n": MAX_N + 1}, 400, f"n must be <= {MAX_N}"),
    ({"class_label": 1, "size": "128x128"}, 400, "size must be 64x64"),
    ({"class_label": 1, "response_format": "url"}, 400, "b64_json"),
    ({"class_label": 1, "temperature": -1}, 422, "temperature"),
    ({"class_label": 1, "top_p": 0}, 422, "top-p"),
    ({"class_label": 1, "cfg_scale": 4.0, "guidance_scale": 2.0}, 422, "alias"),
    ({"class_label": 1, "seed": -1}, 422, "seed"),
    ({"class_label": 1, "method": "sjd"}, 400, "runs method 'ar'"),
    ({"class_label": 1, "method_options": {"window": 4}}, 400, "no option 'window'"),
    ({"class_label": 1, "model": "dall-e-3"}, 404, "zoo-gpt"),
    ({"class_label": 1, "prompt": "chelsea"}, 400, "names class 2"),
    ({"class_label": 1, "cfg_scale": 1e308}, 422, "cfg_scale"),
    ({"class_label": 1, "temperature": 1e-9}, 422, "temperature"),
    ({"class_label": 1, "partial_images": 4}, 422, "partial_images"),
    ({"class_label": True}, 422, "class_label"),
    ({"class_label": 1, "top_k": 10 ** 30}, 422, "top_k"),
    ({"class_label": 1, "negative_prompt": "blurry"}, 400, "class-conditional"),
    ({"prompt": "a painting of a dragon"}, 422, "class-conditional"),
    ({"prompt": "x" * 3000}, 400, "prompt too long"),
    ({"class_label": 1, "timeout": 1000}, 422, "timeout"),
    ({"class_label": 1, "prompt": "p" * 70000}, 413, "too large"),
]


def test_bad_requests_are_one_line_errors(server, client):
    """Every bad request is refused before any work, as one line of JSON with the status it deserves."""
    images = metric(client, "vvs:images_generated_total")
    rejected = metric(client, "vvs:requests_rejected_total", reason="bad_request")
    too_large = metric(client, "vvs:requests_rejected_total", reason="too_large")
    for body, status, words in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = client.post("/v1/images/generations", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, (body if isinstance(body, bytes) else str(body)[:80], r.text)
        assert "\n" not in r.text.strip(), r.text
        error = r.json()["error"]
        assert words in error["message"] or words == error["param"], (error, words)
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert error["code"] is None or not error["code"].isdigit()  # a name, not the status again
        if error["param"] is not None:
            assert "." not in error["param"], error  # the field, not pydantic's union branch
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and "\n" not in r.text and r.json()["error"]["message"]
    assert metric(client, "vvs:images_generated_total") == images  # nothing was decoded
    assert metric(client, "vvs:requests_rejected_total", reason="bad_request") == rejected + len(BAD) - 1
    assert metric(client, "vvs:requests_rejected_total", reason="too_large") == too_large + 1


def test_concurrent_requests_equal_offline_generate(server, client, engine, shared):
    """Three requests with different seeds, labels, sizes and sampling settings share the batch; each
    returns what ``Engine.generate`` makes offline for its seed and settings (image j of a request =
    image index j)."""
    assert wait_for(lambda: idle(client), 60)
    before = {name: metric(client, name) for name in ("vvs:images_generated_total", "vvs:tokens_committed_total",
                                                       "vvs:target_forward_passes_total")}
    bodies = {"a": {"class_label": 3, "n": 2, "seed": 5, "return_tokens": True},
              "b": {"class_label": [7], "n": 1, "seed": 6, "temperature": 0.7, "top_k": 50, "return_tokens": True},
              "c": {"prompt": "coffee", "n": 1, "seed": 5, "size": "64x64", "response_format": "b64_json",
                    "guidance_scale": 2.0, "top_p": 0.9, "return_tokens": True}}
    results, running = {}, []

    def send(key):  # one client per thread
        with httpx.Client(base_url=server.url, timeout=300) as own:
            results[key] = post(own, bodies[key])

    threads = [threading.Thread(target=send, args=(k,)) for k in bodies]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server.url, timeout=30) as watcher:
        while any(t.is_alive() for t in threads):
            running.append(metric(watcher, "vvs:num_requests_running"))
            time.sleep(0.2)
    for t in threads:
        t.join()
    assert max(running) >= 2  # they decoded side by side
    for key, r in results.items():
        assert r.status_code == 200, r.text
    a, b, c = (results[k].json() for k in "abc")
    # offline, one call: a's two images, b's, c's (c's image 0 is image index 0 of seed 5 with its settings)
    offline = engine.generate(class_labels=[3, 3, 7, 1], seed=[5, 5, 6, 5], image_indices=[0, 1, 0, 0],
                              temperature=[1.0, 1.0, 0.7, 1.0], top_k=[0, 0, 50, 0], top_p=[1.0, 1.0, 1.0, 0.9],
                              cfg_scale=[4.0, 4.0, 4.0, 2.0], batch_size=4, decode_images=False)
    per_image = offline.stats["per_image"]["target_forward_passes"]
    expected = {"a": offline.tokens[:2], "b": offline.tokens[2:3], "c": offline.tokens[3:]}
    passes = {"a": per_image[:2], "b": per_image[2:3], "c": per_image[3:]}
    for key, body in zip("abc", (a, b, c)):
        assert body["seed"] == bodies[key]["seed"]
        assert len(body["data"]) == bodies[key]["n"]
        for j, item in enumerate(body["data"]):
            assert item["image_index"] == j
            assert png_pixels(item["b64_json"]).shape == (64, 64, 3)
            assert item["tokens"] == expected[key][j].tolist(), (key, j)
            # the server decodes each image alone; the tokenizer runs in fp32, where a batch of several
            # can round a pixel differently, so the offline PNG to compare with is decoded alone too
            alone = engine.decode_images(expected[key][j:j + 1])[0]
            assert np.array_equal(png_pixels(item["b64_json"]), np.asarray(alone.convert("RGB"))), (key, j)
        assert body["usage"]["images"] == bodies[key]["n"]
        assert body["usage"]["target_forward_passes"] == sum(passes[key])
        assert body["usage"]["tpf"] == pytest.approx(bodies[key]["n"] * T / sum(passes[key]))
    total_passes = sum(sum(p) for p in passes.values())
    assert metric(client, "vvs:images_generated_total") == before["vvs:images_generated_total"] + 4
    assert metric(client, "vvs:tokens_committed_total") == before["vvs:tokens_committed_total"] + 4 * T
    assert metric(client, "vvs:target_forward_passes_total") == before["vvs:target_forward_passes_total"] + total_passes
    shared["a"] = [item["b64_json"] for item in a["data"]]


def test_deadline_is_504_and_frees_rows(server, client):
    assert wait_for(lambda: idle(client), 60)
    deadlines = metric(client, "vvs:request_finished_total", finished_reason="deadline")
    started = time.monotonic()
    r = post(client, {"class_label": 2, "n": 2, "timeout": 0.5})
    assert r.status_code == 504 and "\n" not in r.text.strip()
    assert "deadline" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5
    assert wait_for(lambda: metric(client, "vvs:num_images_running") == 0, 5)  # rows freed at the next round
    assert metric(client, "vvs:request_finished_total", finished_reason="deadline") == deadlines + 1


def test_disconnect_queue_full_and_recovery(server, client, shared):
    """A stream fills every row; a second request waits; a third overflows the queue (429 with
    Retry-After). The stream's client goes away: its rows are freed at the next round, the waiting
    request is admitted and returns exactly the images it returned earlier; new requests are served."""
    assert wait_for(lambda: idle(client), 60)
    disconnected = metric(client, "vvs:request_finished_total", finished_reason="disconnected")
    with httpx.Client(base_url=server.url, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/images/generations",
                             json={"class_label": 4, "n": ROWS, "seed": 1, "stream": True, "progress": True}) as stream:
            assert stream.status_code == 200
            events, lines = [], stream.iter_lines()  # (kept: a closed line iterator closes the connection)
            while "image_generation.progress" not in events:
                line = next(lines)
                if line.startswith("event: "):
                    events.append(line[7:])
            assert events[0] == "image_generation.started"
            assert wait_for(lambda: metric(client, "vvs:num_images_running") == ROWS, 10)
            waiting = {}

            def wait_in_queue():  # its own client: an httpx client is not shared between threads here
                with httpx.Client(base_url=server.url, timeout=120) as own:
                    waiting["r"] = post(own, {"class_label": 3, "n": 2, "seed": 5})

            second = threading.Thread(target=wait_in_queue)
            second.start()
            assert wait_for(lambda: metric(client, "vvs:num_images_waiting") == 2, 10)
            full = post(client, {"class_label": 0, "n": ROWS})
            assert full.status_code == 429, full.text
            assert int(full.headers["retry-after"]) >= 1
            assert "\n" not in full.text.strip() and full.json()["error"]["code"] == "queue_full"
        # the stream is closed here: the client is gone
    assert wait_for(lambda: metric(client, "vvs:request_finished_total", finished_reason="disconnected")
                    == disconnected + 1, 10)
    assert wait_for(lambda: metric(client, "vvs:num_images_running") == 2, 10)  # only the waiting request's images
    recovered = post(client, {"class_label": 9, "n": 1})  # no seed: one is drawn and returned
    second.join(120)
    r = waiting["r"]
    assert r.status_code == 200, r.text
    assert [item["b64_json"] for item in r.json()["data"]] == shared["a"]  # the same request, the same PNGs
    assert recovered.status_code == 200, recovered.text
    body = recovered.json()
    assert isinstance(body["seed"], int) and len(body["data"]) == 1
    assert png_pixels(body["data"][0]["b64_json"]).shape == (64, 64, 3)
    assert metric(client, "vvs:requests_rejected_total", reason="queue_full") >= 1


def stream_events(server, body: dict) -> list:
    """(event name, data) of a whole stream."""
    events = []
    with httpx.Client(base_url=server.url, timeout=300) as own:
        with own.stream("POST", "/v1/images/generations", json=body) as stream:
            assert stream.status_code == 200
            name = None
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
    return events


def test_partial_images_stream_in_before_each_image(server, client):
    """``partial_images: 3``: three image_generation.partial_image events per image, in order and before
    its completed event, each a PNG that fills in top to bottom (fewer grey pixels each time); the
    tokens, forwards and rounds are those of the same request without partials."""
    grey = np.array([128, 128, 128])
    results = {}
    for partials in (3, 0):
        assert wait_for(lambda: idle(client), 60)
        rounds = metric(client, "vvs:round_seconds_count", kind="ar_step")
        body = {"class_label": 5, "n": 2, "seed": 8, "stream": True, "return_tokens": True}
        if partials:
            body["partial_images"] = partials
        events = stream_events(server, body)
        results[partials] = (events, metric(client, "vvs:round_seconds_count", kind="ar_step") - rounds)
    events, rounds_with = results[3]
    plain, rounds_without = results[0]
    assert rounds_with == rounds_without  # partials add no round
    completed = {d["image_index"]: d for name, d in events if name == "image_generation.completed"}
    assert {d["image_index"]: d["tokens"] for name, d in plain if name == "image_generation.completed"} == \
        {j: d["tokens"] for j, d in completed.items()}
    assert [name for name, _ in plain] == ["image_generation.completed"] * 2  # none unless asked for
    for j in range(2):
        mine = [(k, name, d) for k, (name, d) in enumerate(events) if d.get("image_index") == j]
        names = [name for _, name, _ in mine]
        assert names == ["image_generation.partial_image"] * 3 + ["image_generation.completed"], names
        assert [d["partial_image_index"] for _, _, d in mine[:3]] == [0, 1, 2]
        pixels = [png_pixels(d["b64_json"]) for _, _, d in mine]
        grey_share = [float(np.all(p == grey, axis=-1).mean()) for p in pixels[:3]]
        assert grey_share[0] > grey_share[1] > grey_share[2] > 0 == float(np.all(pixels[3] == grey, axis=-1).mean())
        assert np.all(pixels[0][-1] == grey) and not np.all(pixels[2][0] == grey)  # top to bottom
        assert all(p.shape == (64, 64, 3) for p in pixels)


def test_page_in_headless_browser(server, client, tmp_path):
    """The page in a real headless Chromium (DevTools protocol on a pipe): it loads, starts a generation
    (``#auto``), shows the progress stream, and the four images appear with TPF and latency."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("SKIP REASON: no Chromium here (apt-get install -y chromium)")
        pytest.skip("no Chromium installed (apt-get install -y chromium)")
    assert wait_for(lambda: idle(client), 60)
    images = metric(client, "vvs:images_generated_total")
    chrome = Chromium(browser, str(tmp_path / "profile"))
    try:
        chrome.open(f"{server.url}/#auto")
        seen_progress = False
        end = time.monotonic() + 120
        while time.monotonic() < end:
            labels = chrome.evaluate("Array.from(document.querySelectorAll('.cell span')).map(s => s.textContent)")
            seen_progress = seen_progress or any(" / 256 tokens" in text for text in labels or [])
            if chrome.evaluate("document.getElementById('status').dataset.done") == "1":
                break
            time.sleep(0.2)
        status = chrome.evaluate("document.getElementById('status').textContent")
        assert status.startswith("done: seed 0, 4 images, TPF "), status
        assert "latency" in status
        assert seen_progress  # the cells showed committed tokens while the images decoded
        assert chrome.evaluate("Array.from(document.querySelectorAll('img.partial')).length") == 0  # all replaced
        assert chrome.evaluate("Array.from(document.querySelectorAll('img.result'))"
                               ".filter(i => i.complete && i.naturalWidth === 64).length") == 4
        screenshot = os.environ.get("VVS_SERVE_SCREENSHOT")
        if screenshot:  # docs/serve_page.png is made this way (docs/serving.md)
            chrome.screenshot(screenshot)
    finally:
        chrome.close()
    assert metric(client, "vvs:images_generated_total") == images + 4
