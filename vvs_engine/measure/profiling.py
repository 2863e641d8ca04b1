"""NVTX ranges for nsys and an optional torch.profiler trace.

``with nvtx_range("verify"):`` marks a phase on the GPU timeline (prefill, draft, verify, accept, skip,
vq_decode). Off CUDA, or when ``VVS_NVTX=0``, it costs one attribute check.
"""
from __future__ import annotations

import contextlib
import os

import torch

_ENABLED = os.environ.get("VVS_NVTX", "1") != "0"


@contextlib.contextmanager
def nvtx_range(name: str):
    if _ENABLED and torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


@contextlib.contextmanager
def torch_trace(path: str | None):
    """Write a Chrome trace of everything inside to ``path`` (no-op when path is None)."""
    if not path:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
        yield
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.export_chrome_trace(path)
