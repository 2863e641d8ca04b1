"""Round functions compiled and captured: the one CUDA-graph path of every decode round.

Why: at batch 1 a LlamaGen-XL step is ~0.3-0.5 ms of GPU work but hundreds of kernel launches; in
eager mode the host cannot launch them that fast, so speculative decoding loses its step reduction to
launch overhead. A captured graph launches a whole round with one call.

Design (nano-vllm / SGLang style): a round function takes no arguments and reads and writes only
persistent device buffers (static shapes, no host read). :class:`RoundGraphs` compiles each round kind
with Inductor (``runtime.compiled``, when ``compile``) and captures it whole as one CUDA graph (when
``use_graphs``), or runs it eagerly on the same buffers. Capture happens lazily at a kind's first
call, after warm-up runs on a side stream (compiling, cuBLAS/Triton autotuning and allocator caching
must not happen inside the capture); the buffers the rounds write are restored afterwards, so
capturing changes nothing observable. Every graph allocates its intermediates from one shared pool
(``shared_pool``): a graph's intermediates are dead when its replay ends, so graphs sharing the pool
can be replayed in any order. A persistent core (``runtime.core``) makes one :class:`RoundGraphs` per
decoder it keeps and reuses both for every later call; admitting images and moving rows between decoders
write into the same buffers, so the graphs stay valid.

Random numbers are counter-based (``rng.CounterRNG``: a hash of seed, image, step, stream and lane),
read from device buffers inside the round, so a replayed graph draws exactly what eager code draws.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .compiled import maybe_compiled, status as compiled_status

WARMUP_RUNS = 2

_POOL = None
_CAPTURES = 0  # round kinds captured (CUDA) or first prepared (elsewhere: what a GPU would capture)


def capture_count() -> int:
    """Round-kind captures so far in this process: on CUDA the CUDA graphs captured; on other devices
    the captures a GPU would have made (a round kind's first run in a new ``RoundGraphs``), so a test on
    the CPU sees what a persistent engine saves."""
    return _CAPTURES


def _count_capture() -> None:
    global _CAPTURES
    _CAPTURES += 1


def shared_pool():
    """The one CUDA-graph memory pool every captured graph allocates its intermediates from."""
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


class RoundGraphs:
    """Round functions that update device state in place, each compiled by Inductor (``compile``,
    see ``runtime.compiled``) and/or captured whole as one CUDA graph (``use_graphs``), or run eagerly
    on the same buffers. The choice is made here, once, explicitly; a method only names its rounds.

    ``rounds``: name -> a function of no arguments (it reads and writes only device buffers and never
    the host). ``buffers``: every tensor the rounds write; capture runs one warm-up round on a side
    stream (compiling, autotuning, allocator caching) and then restores them, so capturing changes
    nothing."""

    def __init__(self, rounds: dict, buffers: Sequence[torch.Tensor], use_graphs: bool, compile: bool = False,
                 options: Optional[dict] = None):
        self.buffers = list(buffers)
        self.rounds = {name: maybe_compiled(name, fn, compile, self.buffers, options) for name, fn in rounds.items()}
        # Graphs exist on CUDA only; elsewhere the same round functions run eagerly (never a CUDA call).
        self.use_graphs = bool(use_graphs) and any(b.device.type == "cuda" for b in self.buffers)
        self.compile = bool(compile)
        self.graphs = {}
        self.prepared = set()  # kinds captured (or, off CUDA, run once)
        self.replays = {name: 0 for name in rounds}

    def __call__(self, name: str) -> None:
        if name not in self.prepared:
            self.prepared.add(name)
            _count_capture()
        if not self.use_graphs:
            self.rounds[name]()
        else:
            if name not in self.graphs:
                self.graphs[name] = self._capture(self.rounds[name])
            self.graphs[name].replay()
        self.replays[name] += 1

    def warm(self) -> None:
        """Compile and capture every round kind now, leaving the buffers as they were (a server does
        this before it accepts requests, so none waits for a compile or a capture)."""
        for name, fn in self.rounds.items():
            if name not in self.prepared:
                self.prepared.add(name)
                _count_capture()
            if self.use_graphs:
                if name not in self.graphs:
                    self.graphs[name] = self._capture(fn)
            elif self.compile:
                saved = [b.clone() for b in self.buffers]
                fn()
                for b, s in zip(self.buffers, saved):
                    b.copy_(s)

    def compiled(self) -> dict:
        """{round kind: runs compiled} for the kinds that ran (``stats["compiled"]``)."""
        return compiled_status({n: f for n, f in self.rounds.items() if self.replays[n]}) if self.compile else {}

    def _capture(self, fn) -> "torch.cuda.CUDAGraph":
        saved = [b.clone() for b in self.buffers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):  # compiling, autotuning, workspaces, allocator caching: not in the capture
                fn()
                for b, s in zip(self.buffers, saved):
                    b.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared_pool()):
            fn()
        for b, s in zip(self.buffers, saved):  # capture records without running; restore all the same
            b.copy_(s)
        return graph
