"""torch.compile for the decode rounds: every round function compiled whole by Inductor.

Why: on a GPU a round is launch-bound (hundreds of small kernels); Inductor fuses the elementwise and
indexing work between the GEMMs and halves the launches, and the CUDA graph of the round
(``runner.py``) then replays the compiled kernels with one call.

How (gpt-fast / nano-vllm style): a round function takes no arguments, reads and writes only device
buffers and never the host. :class:`CompiledRound` wraps it with ``torch.compile(fn, fullgraph=True,
dynamic=False)``: one graph per round kind and shape, no graph breaks. ``RoundGraphs`` (``runtime.runner``)
calls it in its warm-up runs (where Inductor compiles) and captures it afterwards; nothing here knows a
method. A failed compile warns once, restores the buffers it may have touched and runs eagerly (never
a crash; :attr:`CompiledRound.ok` lands in ``stats["compiled"]``). docs/compile.md has the rest: why
:func:`configure` raises Dynamo's recompile limit, the on-disk cache (``TORCHINDUCTOR_CACHE_DIR``), the
Inductor options (:data:`INDUCTOR_OPTIONS`: 166 -> 114 Triton launches on the Zoo's EAGLE-2 verify
round, ``measure/launches.py``; a round may add its own, ``maybe_compiled(..., options=...)``), and
``compile=None`` (on for CUDA, off for the CPU, where Inductor's C++ kernels are no faster than eager).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

# Inductor settings of every compiled round (see the module docstring); torch.compile(options=...).
INDUCTOR_OPTIONS = {"force_pointwise_cat": True, "combo_kernels": True}

# Dynamo's cache is per code object; size it for round kinds (AR step, verify, verify after a skip,
# skip, Jacobi iteration) x batch buckets x retire sizes (powers of two up to the largest bucket).
ROUND_KINDS = 5

FORCE_FAIL_ENV = "VVS_COMPILE_FAIL"  # tests: make compiling the named round kinds ("all") fail


def compile_default(device) -> bool:
    """Compiled rounds on by default on CUDA, off elsewhere."""
    return torch.device(device).type == "cuda"


def resolve(compile: Optional[bool], device) -> bool:
    return compile_default(device) if compile is None else bool(compile)


# Row counts a decoder is compiled for: the rows in flight (any batch size up to MAX_ROWS) and the powers
# of two the tail of a run shrinks to.
MAX_ROWS = 64


def recompile_limit() -> int:
    shapes = 2 * MAX_ROWS.bit_length()  # the rows in flight and every power of two below them, twice over
    return ROUND_KINDS * shapes * MAX_ROWS.bit_length()


_CONFIGURED = False


def configure() -> None:
    """Once per process: room in Dynamo's cache for every round kind x batch bucket x retire size."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    import torch._dynamo.config as dynamo_config

    limit = recompile_limit()
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * limit)
    _CONFIGURED = True


class CompileFailure(RuntimeError):
    pass


_LOG: list = []  # (round kind, seconds, compiled) of every first call in this process (benchmarks read it)


def compile_log() -> list:
    """[(round kind, first-call seconds, compiled)] of every compiled round's first call so far."""
    return list(_LOG)


_CODEGEN_ONLY = False  # launches.recording("gpu"): code is generated, never run; rounds run eagerly, silently


@contextlib.contextmanager
def codegen_only():
    """Inside: a compile that stops after code generation (``launches.recording("gpu")``) is not a
    failure to report: the round runs eagerly without a warning or a fallback log entry."""
    global _CODEGEN_ONLY
    previous, _CODEGEN_ONLY = _CODEGEN_ONLY, True
    try:
        yield
    finally:
        _CODEGEN_ONLY = previous


_CURRENT = None  # the round kind whose first (compiling) call is running: launches.recording() files code under it


def current_round():
    return _CURRENT


def _forced_failure(name: str) -> bool:
    value = os.environ.get(FORCE_FAIL_ENV, "")
    return value == "all" or name in value.split(",")


class CompiledRound:
    """``fn`` compiled with ``torch.compile(fullgraph=True, dynamic=False)``, eager if that fails.

    ``buffers``: the tensors ``fn`` writes besides caches it rewrites identically on a rerun; they
    are saved before the first (compiling) call and restored if it fails, so the eager rerun starts
    from the same state."""

    def __init__(self, name: str, fn: Callable, buffers: Sequence[torch.Tensor] = (),
                 options: Optional[dict] = None):
        configure()
        self.name, self.eager, self.buffers = name, fn, list(buffers)
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                      options={**INDUCTOR_OPTIONS, **(options or {})})
        self.ok: Optional[bool] = None  # None until the first call; then whether it runs compiled
        self.error: Optional[str] = None
        self.first_call_s = 0.0  # the first call: tracing + compiling (or a cache load) + one run

    def __call__(self, *args):
        if self.ok:
            return self.compiled(*args)
        if self.ok is False:
            return self.eager(*args)
        global _CURRENT
        saved = [b.clone() for b in self.buffers]
        t0 = time.perf_counter()
        _CURRENT = self.name
        try:
            if _forced_failure(self.name):
                raise CompileFailure(f"{FORCE_FAIL_ENV} names '{self.name}'")
            out = self.compiled(*args)
        except Exception as e:  # a graph break, an Inductor error, a stride check: run eagerly, say so once
            for b, s in zip(self.buffers, saved):
                b.copy_(s)
            self.ok, self.error = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if _CODEGEN_ONLY:
                return self.eager(*args)
            warnings.warn(f"torch.compile of round '{self.name}' failed; it runs eagerly ({self.error})",
                          stacklevel=2)
            _LOG.append((self.name, time.perf_counter() - t0, False))
            return self.eager(*args)
        finally:
            _CURRENT = None
        self.first_call_s = time.perf_counter() - t0
        self.ok = True
        _LOG.append((self.name, self.first_call_s, True))
        return out


def compile_count() -> int:
    """Graphs Dynamo has compiled so far in this process (0 before anything was compiled): the
    ``compiles`` a call reports are the difference across it (recompiles on a guard failure included)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def maybe_compiled(name: str, fn: Callable, enabled: bool, buffers: Sequence[torch.Tensor] = (),
                   options: Optional[dict] = None) -> Callable:
    """``fn`` as a :class:`CompiledRound` when ``enabled`` (``options``: Inductor options on top of
    :data:`INDUCTOR_OPTIONS`), else ``fn`` itself."""
    return CompiledRound(name, fn, buffers, options) if enabled else fn


def status(rounds: dict) -> dict:
    """{round kind: compiled or not} of a dict of round callables (``stats["compiled"]``); a kind that
    never ran counts as not compiled."""
    return {name: bool(getattr(fn, "ok", False)) for name, fn in rounds.items()}

