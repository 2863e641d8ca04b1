"""``vvs-engine serve`` faults and lifecycle, on real server processes: SIGTERM under load (with a
drafter method: LANTERN on a chain draft, 2 rows, fp64) and ``kill -9`` then restart (AR)."""
from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need the [serve] extra (httpx)")
pytest.importorskip("fastapi", reason="the server tests need the [serve] extra (fastapi, uvicorn)")

from serve_utils import ServerProcess, metric, png_pixels, wait_for  # noqa: E402

LANTERN = {"tree": "chain", "tree_depth": 4}


def test_sigterm_under_load_drains(tmp_path):
    """Three requests on two rows (one waits); SIGTERM: /ready and new requests answer 503 at once,
    the accepted three finish (none lost, each image the offline one), and the process exits 0."""
    server = ServerProcess(["--method", "lantern", "--tree", "chain", "--tree-depth", "4", "--rows", "2",
                            "--dtype", "fp64", "--shutdown-timeout", "120"])
    try:
        bodies = [{"class_label": label, "n": 1, "seed": seed, "return_tokens": True, "method": "lantern",
                   "method_options": {"tree": "chain", "tree_depth": 4}}
                  for label, seed in ((3, 1), (5, 2), (7, 3))]
        results = {}

        def send(i):
            with httpx.Client(base_url=server.url, timeout=300) as own:
                results[i] = own.post("/v1/images/generations", json=bodies[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for t in threads:
                t.start()
            assert wait_for(lambda: metric(client, "vvs:num_images_running") == 2
                            and metric(client, "vvs:num_images_waiting") == 1, 30)
            code = {}
            waiter = threading.Thread(target=lambda: code.__setitem__("rc", server.proc.wait(300)))
            server.proc.send_signal(__import__("signal").SIGTERM)
            waiter.start()
            assert wait_for(lambda: client.get("/ready").status_code == 503, 10)
            refused = client.post("/v1/images/generations", json={"class_label": 0})
            assert refused.status_code == 503 and "\n" not in refused.text.strip()
            assert "shutting down" in refused.json()["error"]["message"]
        for t in threads:
            t.join(300)
        waiter.join(300)
        assert code.get("rc") == 0, server.output()[-2000:]
        assert "stopped (drained)" in server.output()
        assert sorted(results) == [0, 1, 2]
        for i, r in results.items():
            assert r.status_code == 200, r.text
        from vvs_engine import Engine

        offline = Engine.load(dtype="fp64", threads=1).generate(
            class_labels=[3, 5, 7], seed=[1, 2, 3], image_indices=[0, 0, 0], method="lantern", batch_size=2,
            decode_images=False, **LANTERN)
        for i in range(3):
            item = results[i].json()["data"][0]
            assert item["tokens"] == offline.tokens[i].tolist(), i
            assert item["target_forward_passes"] == offline.stats["per_image"]["target_forward_passes"][i]
            assert item["target_forward_passes"] < 256  # the drafter's tokens were accepted
    finally:
        server.kill()


def test_second_sigterm_exits_at_once():
    """SIGTERM starts the drain of a long request; a second SIGTERM aborts it and the process exits at
    once (143), not after the request's rounds."""
    import signal

    server = ServerProcess(["--rows", "2", "--shutdown-timeout", "120"])
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/images/generations",
                               json={"class_label": 2, "n": 4, "stream": True, "progress": True}) as stream:
                lines = stream.iter_lines()
                while "progress" not in next(lines):
                    pass
                server.proc.send_signal(signal.SIGTERM)
                assert wait_for(lambda: client.get("/ready").status_code == 503, 10)
                assert server.proc.poll() is None  # draining: the accepted request may finish
                started = __import__("time").monotonic()
                server.proc.send_signal(signal.SIGTERM)
                assert server.proc.wait(10) == 143
                assert __import__("time").monotonic() - started < 3
        assert "stopped at once by a second signal" in server.output()
    finally:
        server.kill()


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupt_during_warm_up_exits_cleanly(sig, code):
    """A signal while the engine thread decodes the warm-up image (EAGLE) ends the process with the
    interrupt's exit status and one error line: no abort (it was SIGABRT after 'terminate called
    without an active exception')."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "vvs_engine", "serve", "--method", "eagle", "--port", "0",
                             "--threads", "1"], env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "warming up" in line:
                break
        __import__("time").sleep(0.5)  # inside the warm-up image's rounds
        proc.send_signal(getattr(signal, sig))
        rest, _ = proc.communicate(timeout=30)
        out = "".join(lines) + rest
        assert proc.returncode == code, out
        assert "terminate called" not in out and "Traceback" not in out, out
        assert out.strip().splitlines()[-1] == ("error: interrupted" if code == 130 else "error: terminated")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_kill9_then_restart_serves_again():
    """A server killed mid-request (kill -9): its client gets an error, not a hang; a new server on
    the same port serves again."""
    first = ServerProcess(["--rows", "2"])
    port = first.port
    try:
        with httpx.Client(base_url=first.url, timeout=60) as client:
            with client.stream("POST", "/v1/images/generations",
                               json={"class_label": 2, "n": 2, "stream": True, "progress": True}) as stream:
                lines = stream.iter_lines()
                while "progress" not in next(lines):
                    pass
                first.proc.kill()
                with pytest.raises(httpx.HTTPError):
                    for _ in lines:
                        pass
        assert first.proc.wait(30) == -9
    finally:
        first.kill()
    second = ServerProcess(["--rows", "2"], port=port)
    try:
        assert second.port == port
        with httpx.Client(base_url=second.url, timeout=120) as client:
            assert client.get("/ready").status_code == 200
            r = client.post("/v1/images/generations", json={"class_label": 2, "n": 1, "seed": 4})
            assert r.status_code == 200, r.text
            assert png_pixels(r.json()["data"][0]["b64_json"]).shape == (64, 64, 3)
            assert metric(client, "vvs:images_generated_total") == 2  # the warm-up image and this one
    finally:
        second.kill()


@pytest.mark.parametrize("flags, words", [
    (["--rows", "0"], "--rows must be an integer >= 1"),
    (["--method", "lantern", "--lantern-delta", "2"], "--lantern-delta must be"),
    (["--num-replicas", "2"], "--num-replicas is a Ray Serve setting: add --ray"),
    (["--ray", "--max-ongoing-requests", "0"], "--max-ongoing-requests must be an integer >= 1"),
    (["--rows", "2", "--queue-size", "2", "--max-n", "5"], "--max-n 5 is more than --rows + --queue-size = 4"),
    (["--cfg-scale", "1e308"], "--cfg-scale must be <= 100"),
    (["--header-timeout", "0"], "--header-timeout must be a finite number of seconds > 0"),
    (["--max-connections", "0"], "--max-connections must be an integer >= 1"),
])
def test_bad_flags_are_one_line_errors(flags, words):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vvs_engine", "serve", *flags], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: ") and words in done.stderr


def test_port_in_use_is_a_one_line_error_before_loading():
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "vvs_engine", "serve", "--port", str(port)], capture_output=True,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
