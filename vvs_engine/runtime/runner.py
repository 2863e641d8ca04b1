"""CUDA-graph runner: static buffers, capture once, replay every round.

Why: at batch 1 a LlamaGen-XL step is ~0.3-0.5 ms of GPU work but hundreds of kernel launches; in
eager mode the host cannot launch them that fast, so speculative decoding loses its step reduction to
launch overhead. A captured graph launches a whole step with one call.

Design (nano-vllm / SGLang style):

* :class:`StaticCall` wraps a function whose inputs live in *static buffers*. A call copies the new
  inputs into those buffers and replays the graph; the outputs are static buffers too, valid until
  the same call runs again (they are allocated outside the graph pool; see ``_capture``). Capture
  happens lazily at the first call, with the real inputs, after two warm-up runs on a side stream
  (cuBLAS/Triton autotuning and allocator caching must not happen inside the capture). Warm-up changes nothing observable: the input buffers and the random-number
  generator are restored afterwards, and the functions captured here are idempotent in every other
  state they touch (KV writes go to slots the same call overwrites before reading).
* Off CUDA (or with ``use_graphs=False``) exactly the same static-buffer code runs eagerly, outputs
  are copied into the same static output buffers, so CPU tests cover the buffer plumbing and the
  aliasing rules.
* :class:`GraphRunner` owns *persistent* sessions (target KV cache, drafter KV cache): a captured
  graph is bound to the addresses of the caches it reads and writes, so the caches must outlive one
  image. Runners are cached per (model, batch bucket, CFG, condition-mask, sampling, tree) and reused
  across ``generate`` calls. All graphs of all runners share one memory pool (``graph_pool_handle``).
* Graphs: (1) the whole plain-AR step (forward, logits, CFG, processing, sampling, state advance);
  (2) :class:`RoundGraphs`: each round kind of the speculative loop (verify, verify after a skip,
  skip) captured whole, one graph per kind and batch bucket. Prefill stays eager.
* Random numbers: graph-safe Philox. The runner owns one generator registered with every graph; a
  call copies the caller's generator state in and back out (host-side seed/offset, no sync), so a
  replayed graph draws exactly the numbers eager code would draw from the caller's generator.
* Batch buckets: plain AR pads the images to the next bucket (rows ``[cond; pad; uncond; pad]``,
  pads repeat image 0), so a handful of graphs serve every batch size. Exact sizes up to 8, so the
  common batches are never padded and give the same tokens as the unpadded eager loop.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Callable, Optional, Sequence

import torch

from .compiled import maybe_compiled, status as compiled_status
from .masks import causal_local
from ..sampling import SamplingParams, guided_logits, process_logits
from .target import TargetSession

BATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
WARMUP_RUNS = 2


_POOL = None


def shared_pool():
    """The one CUDA-graph memory pool every captured graph allocates its intermediates from."""
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


def graphs_default(device) -> bool:
    """CUDA graphs on by default on CUDA, off elsewhere (there is nothing to capture on the CPU)."""
    return torch.device(device).type == "cuda"


def batch_bucket(n: int) -> int:
    return next((b for b in BATCH_BUCKETS if b >= n), n)


# --- pytree helpers for static outputs (tensors, tuples, dataclasses such as DraftTree) ------------
def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone_tree(v) for v in x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _clone_tree(getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x


def _copy_tree_(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_tree_(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_tree_(getattr(dst, f.name), getattr(src, f.name))


class StaticCall:
    """``fn(*static_inputs)`` captured as one CUDA graph (or run eagerly on the same buffers).

    ``inputs``: the static input buffers (owned by the caller or cloned from examples). ``gen``: the
    runner's generator when ``fn`` draws random numbers (it must use that one, never another)."""

    def __init__(self, name: str, fn: Callable, inputs: Sequence[torch.Tensor], use_graph: bool,
                 pool=None, gen: Optional[torch.Generator] = None, compile: bool = False):
        self.inputs = list(inputs)
        self.name, self.fn = name, maybe_compiled(name, fn, compile, self.inputs)
        self.use_graph, self.pool, self.gen = use_graph, pool, gen
        self.graph = None
        self.outputs = None
        self.replays = 0
        self.capture_error = None

    def __call__(self, *args, gen: Optional[torch.Generator] = None):
        for buf, a in zip(self.inputs, args):
            if a is not buf:
                buf.copy_(a)
        borrowed = gen is not None and self.gen is not None and gen is not self.gen
        if borrowed:  # draw from the caller's random stream (host-side state: no sync)
            self.gen.set_state(gen.get_state())
        if self.use_graph and self.graph is None:
            try:
                self._capture()
            except Exception as e:  # an op that cannot be captured: keep working, eagerly, and say so
                warnings.warn(f"CUDA-graph capture of '{self.name}' failed; it runs eagerly: {e}")
                self.use_graph, self.capture_error, self.outputs = False, f"{type(e).__name__}: {e}", None
        if self.use_graph:
            self.graph.replay()
            self.replays += 1
        else:
            out = self.fn(*self.inputs)
            if self.outputs is None:
                self.outputs = _clone_tree(out)
            else:
                _copy_tree_(self.outputs, out)
        if borrowed:
            gen.set_state(self.gen.get_state())
        return self.outputs

    def _capture(self) -> None:
        saved = [b.clone() for b in self.inputs]
        rng = self.gen.get_state() if self.gen is not None else None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):  # autotuning, workspace and allocator caching happen here
                    out = self.fn(*self.inputs)
                    for b, s in zip(self.inputs, saved):
                        b.copy_(s)
            torch.cuda.current_stream().wait_stream(side)
            # Static outputs live OUTSIDE the shared pool and the graph copies its results into them.
            # Then everything a graph allocates from the pool is dead when its replay ends, so graphs
            # sharing the pool can be replayed in any order (the tree built by one graph survives the
            # next verify graph's replay).
            self.outputs = _clone_tree(out)
            del out
            graph = torch.cuda.CUDAGraph()
            if self.gen is not None:
                graph.register_generator_state(self.gen)  # graph-safe Philox: seed/offset read at replay
            with torch.cuda.graph(graph, pool=self.pool):
                _copy_tree_(self.outputs, self.fn(*self.inputs))
            self.graph = graph
        finally:  # warm-up and capture leave no trace, whether capture worked or not
            for b, s in zip(self.inputs, saved):
                b.copy_(s)
            if rng is not None:
                self.gen.set_state(rng)


class GraphRunner:
    """Persistent sessions and their captured calls for one setting (see the module docstring)."""

    def __init__(self, model, cond, n_images: int, use_cfg: bool, key_mask, extra_slots: int,
                 params: SamplingParams, use_graphs: bool, compile: bool = False):
        self.session = TargetSession(model, cond, n_images, use_cfg, key_mask, extra_slots)
        self.device, self.params = self.session.device, params
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.compile = bool(compile)
        self.pool = shared_pool() if self.use_graphs else None
        self.gen = torch.Generator(device=self.device)
        self.calls = {}

    # --- per image / per batch ----------------------------------------------------------------------
    def reset(self, cond, key_mask=None) -> TargetSession:
        """Point the persistent session at new conditions. Nothing else needs clearing: every KV slot
        is written before a query can see it (visibility is bounded by the device-side lengths)."""
        s = self.session
        s.cond_rows = cond
        if s.has_key_mask:
            s.key_valid[:, : s.c].copy_(key_mask.to(s.device, torch.bool))
        return s

    def _call(self, name, fn, inputs, gen=None, clone_inputs=True) -> StaticCall:
        if name not in self.calls:
            bufs = [x.clone() for x in inputs] if clone_inputs else list(inputs)
            self.calls[name] = StaticCall(name, fn, bufs, self.use_graphs, self.pool, gen, self.compile)
        return self.calls[name]

    # --- (1) plain AR: one call per token, the state advances inside the graph ----------------------
    def ar_decode(self, first: torch.Tensor, rng) -> torch.Tensor:
        """first [n] (the token sampled after prefill) -> tokens [n, T]. ``rng``: the batch's
        :class:`~vvs_engine.rng.CounterRNG`; its keys are copied into the step's static key buffer."""
        from .. import kernels
        from ..rng import CounterRNG, Streams

        s, params = self.session, self.params
        if "ar_step" not in self.calls:
            n = first.shape[0]
            self.ar_rng = CounterRNG(0, torch.zeros(n, dtype=torch.long, device=self.device))
            # Fill the RNG's stream- and lane-offset caches now: filling them inside a compiled step changes
            # what Dynamo guards on (the second step would compile again), and lane offsets made inside a
            # traced step overflow Inductor's index arithmetic.
            self.ar_rng.stream_offsets([Streams.SAMPLE])
            self.ar_rng.lane_offsets(1)
            state = (torch.zeros(n, dtype=torch.long, device=self.device),  # last token
                     torch.zeros(1, dtype=torch.long, device=self.device),  # its position
                     torch.zeros(n, s.T, dtype=torch.long, device=self.device))  # tokens so far
            one = causal_local(1, self.device)
            images = torch.arange(n, device=self.device)

            def ar_step(tok, pos, out):
                h = s.forward(tok[:, None], pos, pos, one)[:, -1]
                p = process_logits(guided_logits(s.logits(h), params), params)
                step = pos - (s.c - 1)  # the image token index: the random-number step and the out column
                nxt = kernels.counter_sample(self.ar_rng, p, step, Streams.SAMPLE)
                out.index_put_((images, step.expand(n)), nxt)  # index_put_: in place under torch.compile
                tok.copy_(nxt)
                pos.add_(1)
                return tok

            self._call("ar_step", ar_step, state, clone_inputs=False)
        step = self.calls["ar_step"]
        tok, pos, out = step.inputs
        tok.copy_(first)
        pos.fill_(s.c)
        out[:, 0] = first
        self.ar_rng.key.copy_(rng.key)
        for _ in range(s.T - 1):
            step()
        return out.clone()

    def stats(self) -> dict:
        return {name: {"graph": c.graph is not None, "replays": c.replays, "capture_error": c.capture_error}
                for name, c in self.calls.items()}

    def compiled(self) -> dict:
        """{call name: runs compiled} (``stats["compiled"]``); empty when compiling is off."""
        return compiled_status({n: c.fn for n, c in self.calls.items()}) if self.compile else {}


# --- the runner cache -----------------------------------------------------------------------------
_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {setting: GraphRunner}


def get_runner(model, cond, n_images: int, use_cfg: bool, key_mask, params: SamplingParams,
               use_graphs: bool, extra_slots: int = 0, compile: bool = False) -> GraphRunner:
    """The cached runner for this setting, reset to ``cond``/``key_mask`` (whose shapes fix the setting)."""
    p = next(model.parameters())
    key = (n_images, use_cfg, tuple(cond.shape), cond.dtype, key_mask is not None, extra_slots,
           dataclasses.astuple(params), use_graphs, compile, p.device, p.dtype)
    per_model = _RUNNERS.setdefault(model, {})
    if key not in per_model:
        per_model[key] = GraphRunner(model, cond, n_images, use_cfg, key_mask, extra_slots, params, use_graphs,
                                     compile)
    r = per_model[key]
    r.reset(cond, key_mask)
    return r


def clear_runners(model=None) -> None:
    """Drop cached runners (and their graphs and caches): all of them, or one model's."""
    if model is None:
        _RUNNERS.clear()
    else:
        _RUNNERS.pop(model, None)


def pad_conditions(cond, key_mask, n: int, n_bucket: int, use_cfg: bool):
    """Rows ``[cond_0..n-1; uncond_0..n-1]`` -> the same layout for ``n_bucket`` images; pads repeat
    image 0 (their tokens are dropped)."""
    if n_bucket == n:
        return cond, key_mask

    def pad(x):
        halves = x.chunk(2, 0) if use_cfg else (x,)
        return torch.cat([torch.cat([h, h[:1].expand(n_bucket - n, *h.shape[1:])]) for h in halves])

    return pad(cond), (pad(key_mask) if key_mask is not None else None)


class RoundGraphs:
    """Round functions that update device state in place, each compiled by Inductor (``compile``,
    see ``runtime.compiled``) and/or captured whole as one CUDA graph (``use_graphs``), or run eagerly
    on the same buffers. The choice is made here, once, explicitly; a method only names its rounds.

    ``rounds``: name -> a function of no arguments (it reads and writes only device buffers and never
    the host). ``buffers``: every tensor the rounds write; capture runs one warm-up round on a side
    stream (compiling, autotuning, allocator caching) and then restores them, so capturing changes
    nothing."""

    def __init__(self, rounds: dict, buffers: Sequence[torch.Tensor], use_graphs: bool, compile: bool = False):
        self.buffers = list(buffers)
        self.rounds = {name: maybe_compiled(name, fn, compile, self.buffers) for name, fn in rounds.items()}
        self.use_graphs, self.compile = bool(use_graphs), bool(compile)
        self.graphs = {}
        self.replays = {name: 0 for name in rounds}

    def __call__(self, name: str) -> None:
        if not self.use_graphs:
            self.rounds[name]()
        else:
            if name not in self.graphs:
                self.graphs[name] = self._capture(self.rounds[name])
            self.graphs[name].replay()
        self.replays[name] += 1

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
