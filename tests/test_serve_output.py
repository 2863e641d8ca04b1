"""The output worker (``runtime/output.py``) and the server's use of it: the loop thread hands over a
finished image's tokens and returns; the VQ decode, the PNG and the delivery run on the worker
thread, in order, and a failure reaches the request instead of being lost."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from vvs_engine.runtime.output import OutputWorker
from vvs_engine.sampling import SamplingParams
from vvs_engine.serving.metrics import ServerMetrics
from vvs_engine.serving.worker import Request, RequestQueue


def test_jobs_run_in_order_on_one_thread():
    worker = OutputWorker("test-output")
    ran, threads = [], set()
    for i in range(50):
        worker.submit(lambda i=i: (ran.append(i), threads.add(threading.current_thread().name)))
    assert worker.close(10)
    assert ran == list(range(50)) and threads == {"test-output"}
    with pytest.raises(RuntimeError):
        worker.submit(lambda: None)


def test_a_failing_job_reaches_its_handler_and_the_worker_goes_on():
    worker = OutputWorker()
    caught, ran = [], []

    def boom():
        raise ValueError("bad tokens")

    worker.submit(boom, on_error=caught.append)
    worker.submit(boom)  # no handler: kept, not lost
    worker.submit(lambda: ran.append(True))
    assert worker.close(10)
    assert [str(e) for e in caught] == ["bad tokens"] and [str(e) for e in worker.errors] == ["bad tokens"]
    assert ran == [True] and worker.done == 3


def test_context_is_entered_on_the_worker_thread():
    seen = []
    worker = OutputWorker(context=torch.inference_mode)
    worker.submit(lambda: seen.append(torch.is_inference_mode_enabled()))
    worker.close(10)
    assert seen == [True]
    assert not torch.is_inference_mode_enabled()  # the caller's thread is untouched


class _SlowVQ:
    """A tokenizer stand-in whose decode blocks until released, recording the thread it ran on."""

    can_decode = True

    def __init__(self):
        self.release = threading.Event()
        self.threads = []
        self.fail = False


def _queue(output):
    vq = _SlowVQ()

    def decode_images(tokens):
        vq.threads.append(threading.current_thread().name)
        assert vq.release.wait(10)
        if vq.fail:
            raise RuntimeError("the tokenizer ran out of memory")
        from PIL import Image

        return [Image.new("RGB", (8, 8), (int(tokens[0, 0]), 0, 0))]

    engine = types.SimpleNamespace(tokens_per_image=4, vq=vq, decode_images=decode_images)
    queue = RequestQueue(engine, 8, ServerMetrics("m", "ar"), 2, output)
    queue.accepting = True
    return queue, vq


def _result(first_token: int) -> dict:
    return {"tokens": torch.tensor([first_token, 1, 2, 3]), "passes": torch.tensor(4.0)}


def test_finished_hands_over_and_returns_before_the_decode():
    """On the loop thread ``finished`` returns while the decode is still blocked on the worker; the
    images then arrive from the worker thread, in the order they finished."""
    output = OutputWorker("vvs-output")
    queue, vq = _queue(output)
    events = []
    request = Request(2, [0, 0], None, 0, SamplingParams(), events.append)
    queue.submit(request)
    jobs = queue.take(2)
    queue.finished(jobs[1], _result(7))  # would block here if the decode ran on this thread
    queue.finished(jobs[0], _result(9))
    assert events == [] and request.images_done == 0
    vq.release.set()
    assert output.close(10)
    assert [(e[0], e[1]) for e in events] == [("image", 1), ("image", 0)]
    assert vq.threads == ["vvs-output", "vvs-output"]
    assert events[0][4] == [7, 1, 2, 3] and events[0][5] == (8, 8)
    assert request.finished and request.id not in queue.active


def test_without_the_worker_the_decode_runs_on_the_calling_thread():
    """The old path (kept for the benchmark's before/after): the negative control of the test above."""
    queue, vq = _queue(None)
    events = []
    request = Request(1, [0], None, 0, SamplingParams(), events.append)
    queue.submit(request)
    vq.release.set()
    queue.finished(queue.take(1)[0], _result(5))
    assert vq.threads == [threading.current_thread().name] and events[0][0] == "image"


def test_a_decode_failure_is_the_requests_error():
    output = OutputWorker()
    queue, vq = _queue(output)
    vq.fail = True
    events = []
    request = Request(1, [0], None, 0, SamplingParams(), events.append)
    queue.submit(request)
    queue.finished(queue.take(1)[0], _result(5))
    vq.release.set()
    assert output.close(10)
    assert events == [("error", 500, "decoding the image failed: the tokenizer ran out of memory")]
    assert request.finished and request.id not in queue.active and not output.errors


def test_partials_are_decoded_on_the_worker_before_the_image():
    output = OutputWorker("vvs-output")
    queue, vq = _queue(output)
    decoded_on = []

    def partial_image(tokens, committed):
        decoded_on.append(threading.current_thread().name)
        from PIL import Image

        return Image.new("RGB", (8, 8), (int(committed.sum()), 0, 0))

    queue.engine.partial_image = partial_image
    events = []
    request = Request(1, [0], None, 0, SamplingParams(), events.append, partial_images=2)
    queue.submit(request)
    job = queue.take(1)[0]
    assert queue.partial_images(job) == 2
    queue.partial(job, 0, torch.tensor([3, 1, 2, 3]), torch.tensor([True, False, False, False]))
    queue.partial(job, 1, torch.tensor([3, 1, 2, 3]), torch.tensor([True, True, False, False]))
    queue.finished(job, _result(3))
    vq.release.set()
    assert output.close(10)
    assert [e[:3] for e in events] == [("partial", 0, 0), ("partial", 0, 1), ("image", 0, events[2][2])]
    assert decoded_on == ["vvs-output", "vvs-output"]
