"""``vvs-engine serve`` against the clients it meets: the official ``openai`` Python SDK, slow and
hostile clients, cross-origin pages. One real server process on 127.0.0.1 (the Zoo model, AR, 2 rows,
a queue of 2 images, an API key from ``$VVS_API_KEY``, 1-second header and body timeouts, at most 40
connections); the tests run in file order and share it.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need the [serve] extra (httpx)")
pytest.importorskip("fastapi", reason="the server tests need the [serve] extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the SDK tests need the [test] extra (openai)")

from serve_utils import ServerProcess, metric, png_pixels, wait_for  # noqa: E402

KEY = "test-key-5f1c"
ROWS, QUEUE, MAX_CONNECTIONS = 2, 2, 40
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(["--rows", str(ROWS), "--queue-size", str(QUEUE), "--header-timeout", "1", "--body-timeout",
                          "1", "--max-connections", str(MAX_CONNECTIONS), "--request-timeout", "120"],
                         env={"VVS_API_KEY": KEY})
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def idle(client) -> bool:
    return metric(client, "vvs:num_images_running") == 0 and metric(client, "vvs:num_images_waiting") == 0


# --- the official SDK ---------------------------------------------------------------------------------
def test_sdk_models_list_and_retrieve(sdk):
    listed = sdk.models.list()
    assert [m.id for m in listed.data] == ["zoo-gpt"]
    assert sdk.models.retrieve("zoo-gpt").id == "zoo-gpt"
    with pytest.raises(openai.NotFoundError) as err:
        sdk.models.retrieve("dall-e-3")
    assert err.value.code == "model_not_found"


def test_sdk_generate(sdk, client):
    """The SDK's basic call with OpenAI's own fields (ignored here, not refused) and the engine's
    class_label through extra_body; the answer parses into the SDK's types with usage filled in."""
    out = sdk.images.generate(model="zoo-gpt", prompt="a picture", n=2, size="auto", quality="high", style="vivid",
                              background="auto", moderation="low", output_compression=90,
                              extra_body={"class_label": 1, "seed": 3})
    assert len(out.data) == 2
    for item in out.data:
        assert png_pixels(item.b64_json).shape == (64, 64, 3)
        assert item.revised_prompt == "coffee"  # what ran: class 1 (the prompt was not used)
    assert out.size == "64x64" and out.output_format == "png"
    assert (out.usage.output_tokens, out.usage.input_tokens, out.usage.total_tokens) == (512, 2, 514)
    # the same request again gives the same pixels (seeded)
    again = client.post("/v1/images/generations", json={"class_label": 1, "n": 2, "seed": 3}).json()
    assert [d["b64_json"] for d in again["data"]] == [d.b64_json for d in out.data]


def test_sdk_stream(sdk):
    """OpenAI's stream as the SDK parses it: one image_generation.completed event per image, each with
    its image, created_at, size, output format and usage; the last event carries an image."""
    events = list(sdk.images.generate(model="zoo-gpt", prompt="3", n=2, stream=True, partial_images=0,
                                      extra_body={"seed": 4}))
    assert [e.type for e in events] == ["image_generation.completed"] * 2
    for event in events:
        assert png_pixels(event.b64_json).shape == (64, 64, 3)
        assert event.size == "64x64" and event.output_format == "png" and event.created_at > 0
        assert event.usage.output_tokens == 256 and event.usage.total_tokens == 257
    assert events[-1].model_extra["summary"]["seed"] == 4


def test_sdk_stream_with_partial_images(sdk):
    """``partial_images=2`` as the SDK sends it: two ImageGenPartialImageEvent per image (indices 0, 1)
    before its completed event."""
    events = list(sdk.images.generate(model="zoo-gpt", prompt="7", n=1, stream=True, partial_images=2,
                                      extra_body={"seed": 5}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(png_pixels(e.b64_json).shape == (64, 64, 3) for e in events)


def test_sdk_errors(sdk):
    """Errors arrive as the SDK's exception classes with the server's message and a named code."""
    with pytest.raises(openai.NotFoundError) as err:
        sdk.images.generate(model="dall-e-3", prompt="3")
    assert err.value.code == "model_not_found" and "dall-e-3" in err.value.message
    with pytest.raises(openai.UnprocessableEntityError) as err:
        sdk.images.generate(prompt="a dragon")  # not a class of this class-conditional model
    assert err.value.param == "class_label"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.images.generate(prompt="3", n=ROWS + QUEUE + 1)
    assert err.value.param == "n"
    with pytest.raises(openai.UnprocessableEntityError) as err:
        sdk.images.generate(prompt="3", extra_body={"cfg_scale": 1e308})  # no more 200 with a broken image
    assert err.value.param == "cfg_scale"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=sdk.base_url, api_key="wrong", max_retries=0).models.list()


# --- security -------------------------------------------------------------------------------------------
def test_api_key(server):
    """/v1/ needs the key (compared in constant time); /health, /ready, /metrics and the page do not."""
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for path in ("/health", "/ready", "/metrics", "/"):
            assert anonymous.get(path).status_code == 200, path
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}):
            r = anonymous.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"
        refused = metric(anonymous, "vvs:requests_rejected_total", reason="unauthorized")
        r = anonymous.post("/v1/images/generations", json={"class_label": 1})
        assert r.status_code == 401
        assert metric(anonymous, "vvs:requests_rejected_total", reason="unauthorized") == refused + 1
        assert anonymous.get("/v1/models", headers=AUTH).status_code == 200


def test_api_key_flag_wins_over_the_environment(monkeypatch):
    import argparse

    from vvs_engine.serving.server import api_key

    monkeypatch.setenv("VVS_API_KEY", "from-env")
    assert api_key(argparse.Namespace(api_key="from-flag")) == "from-flag"
    assert api_key(argparse.Namespace(api_key=None)) == "from-env"
    monkeypatch.delenv("VVS_API_KEY")
    assert api_key(argparse.Namespace(api_key=None)) is None


def test_cross_origin_simple_requests_and_bad_bodies(server, client):
    """What any web page can send without a preflight (a text/plain or form POST) is refused with 415
    before any work; a deeply nested body is a one-line 400 (it was a 500 with a RecursionError
    traceback); a Host that is not a loopback name is refused (DNS rebinding); every answer carries
    nosniff, and the page a Content-Security-Policy."""
    images = metric(client, "vvs:images_generated_total")
    rejected = metric(client, "vvs:requests_rejected_total", reason="bad_request")
    body = json.dumps({"class_label": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Origin": "http://evil.example", **AUTH}
        if content_type:
            headers["Content-Type"] = content_type
        r = client.post("/v1/images/generations", content=body, headers=headers)
        assert r.status_code == 415, (content_type, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
        assert "access-control-allow-origin" not in r.headers
    for nested in (b"[" * 60000, b'{"a":' * 12000):
        r = client.post("/v1/images/generations", content=nested, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text[:200]
    # JSON with parameters in its Content-Type is JSON
    ok = client.post("/v1/images/generations", content=b'{"class_label": 1, "n": 0}',
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 422
    r = client.get("/health", headers={"Host": "evil.example:8000"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    assert client.get("/health", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    for path in ("/health", "/v1/models", "/nothing"):
        assert client.get(path).headers["x-content-type-options"] == "nosniff", path
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'sha256-" in csp and "unsafe" not in csp
    assert metric(client, "vvs:images_generated_total") == images
    assert metric(client, "vvs:requests_rejected_total", reason="bad_request") == rejected + 7
    assert "Traceback" not in server.output() and "RecursionError" not in server.output()


def test_slow_clients_are_timed_out_and_capped(server, client):
    """Connections that never finish their headers are closed after --header-timeout, requests whose
    body never comes get a 408 after --body-timeout, and beyond --max-connections a new connection
    gets a 503 and is closed at once; none of it leaves a traceback in the log."""
    port = server.port
    opened = []
    try:
        for i in range(MAX_CONNECTIONS - 4):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            opened.append(s)
            if i % 2:
                s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never end
            else:
                s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                          + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        extra = []
        for _ in range(8):  # past the cap: answered and closed at once
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            extra.append(s)
        busy = 0
        for s in extra:
            data = s.recv(4096)
            busy += data.startswith(b"HTTP/1.1 503")
        assert busy >= 4
        started = time.monotonic()
        answers = []
        for s in opened:
            s.settimeout(10)
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            answers.append(data.split(b"\r\n")[0])
        assert time.monotonic() - started < 8  # all closed by the 1-second timeouts, not by the test
        assert answers.count(b"") == (MAX_CONNECTIONS - 4) // 2  # headers never ended: closed
        assert answers.count(b"HTTP/1.1 408 Request Timeout") == (MAX_CONNECTIONS - 4) // 2
    finally:
        for s in opened:
            s.close()
    # a client that leaves in the middle of its body: no traceback either
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{\"class")
        time.sleep(0.05)
        s.close()
    assert client.get("/health").status_code == 200
    assert wait_for(lambda: metric(client, "vvs:requests_rejected_total", reason="timeout") >= 18, 5)
    assert "Traceback" not in server.output() and "ClientDisconnect" not in server.output(), server.output()[-3000:]


def test_max_n_defaults_to_rows_plus_queue(client):
    assert client.get("/v1/models").json()["data"][0]["max_n"] == ROWS + QUEUE


def test_retry_after_is_near_the_drain_time(server, client):
    """A burst fills the rows and the queue; the next request's 429 says when to come back, within 2x
    of how long the accepted work then really takes to finish (it said 4-6x too long when it counted
    idle time)."""
    assert wait_for(lambda: idle(client), 120)
    results = {}

    def send(i):
        with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as own:
            results[i] = own.post("/v1/images/generations", json={"class_label": i, "seed": i})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(ROWS + QUEUE)]
    for t in threads:
        t.start()
    assert wait_for(lambda: metric(client, "vvs:num_images_running") + metric(client, "vvs:num_images_waiting")
                    == ROWS + QUEUE, 30)
    refused = client.post("/v1/images/generations", json={"class_label": 0})
    refused_at = time.monotonic()
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    retry_after = int(refused.headers["retry-after"])
    for t in threads:
        t.join(120)
    drain = time.monotonic() - refused_at
    assert all(r.status_code == 200 for r in results.values())
    print(f"Retry-After {retry_after} s, measured drain {drain:.1f} s")
    assert retry_after / 2 <= drain <= 2 * retry_after, (retry_after, drain)
