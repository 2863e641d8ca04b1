"""The server's request queue on its own (no process, no HTTP): what ``--queue-size`` bounds."""
from __future__ import annotations

import types

import pytest

from vvs_engine.sampling import SamplingParams
from vvs_engine.serving.metrics import ServerMetrics
from vvs_engine.serving.worker import QueueFull, Request, RequestQueue


def _request(n: int) -> Request:
    return Request(n, [0] * n, None, 0, SamplingParams(), lambda event: None)


def test_queue_size_counts_images_beyond_the_free_rows():
    """Rows free now take waiting images at the next round, so a burst into an idle server of rows +
    queue-size images is accepted and one image more is refused; once the rows are taken the bound
    is the queue size alone."""
    rows, queue_size = 2, 2
    queue = RequestQueue(types.SimpleNamespace(tokens_per_image=16), queue_size, ServerMetrics("m", "ar"), rows)
    queue.accepting = True
    for _ in range(rows + queue_size):  # four single-image requests at once into an idle server
        queue.submit(_request(1))
    with pytest.raises(QueueFull):
        queue.submit(_request(1))
    assert len(queue.take(rows)) == rows  # the loop admits two: no row is free any more
    with pytest.raises(QueueFull):
        queue.submit(_request(1))  # two images wait, the queue holds two
    without_rows = RequestQueue(types.SimpleNamespace(tokens_per_image=16), queue_size, ServerMetrics("m", "ar"), 0)
    without_rows.accepting = True
    without_rows.submit(_request(2))
    with pytest.raises(QueueFull):
        without_rows.submit(_request(1))
