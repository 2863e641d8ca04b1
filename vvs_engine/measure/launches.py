"""Launches of a compiled round, read from the code Inductor generates for it.

On a GPU a compiled round replays as: every generated kernel (one per fused loop nest), every extern
GEMM call (``mm``/``addmm``/``bmm``...), every custom op (the engine's ``vvs::`` kernels, called as
extern kernels) and every other fallback that does work (an aten op Inductor does not generate code
for: ``cumsum``, ``sort``, ``topk``...; a ``copy_`` back into an input it could not update in place).
Each is at least one launch. Views (``reinterpret_tensor``), allocations (``empty_strided``) and
``del`` are not. The count is read from the generated wrapper's ``call`` function, so it is the same
on the CPU (C++ kernels) and on CUDA (Triton kernels) up to Inductor's device-specific choices.

    with recording() as codes:                       # every round compiled in the block
        engine.generate(..., compile=True)
    launches = {kind: count(c[0]) for kind, c in codes.items()}

    n = round_launches(fn, *args)                    # one round function, compiled on its own

**Two styles.** ``recording("cpu")`` keeps the C++ code the CPU compiles and runs. Its kernel
functions are not GPU launches: Inductor's C++ backend puts several loop nests (on a GPU, several
Triton kernels) into one function, and it never forms combo kernels. ``recording("gpu")`` makes
Inductor lower every round to **Triton** kernels, as it does for CUDA (``cpu_backend="triton"``,
combo kernels grouped as on CUDA), on this machine without a GPU: each round's compile stops once its
code is generated (nothing Triton runs) and the round runs eagerly. The GPU style is the launch count
of a CUDA-graph replay up to Inductor's device-specific choices (autotuned GEMM templates, split
reductions sized by the SM count); the engine's benchmarks report it. On the Zoo's 2-layer EAGLE-2
verify round the two styles read 104 (C++ functions) and 166 (Triton kernels) before the compile
options of :mod:`vvs_engine.runtime.compiled` (``force_pointwise_cat``, ``combo_kernels``), 114 Triton kernels after.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from unittest import mock

import torch

from ..runtime import compiled

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm"})
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_OP = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)")
_ATEN_CALL = re.compile(r"(?<![\w.])aten\.(\w+)(?:\.\w+)?\(")  # a fallback written as aten.index_put_(...)
_COPY = re.compile(r"\.copy_\(")
_ALLOC = re.compile(r"\bempty_strided_\w+\(\(([\d, ]*)\)")


@dataclass
class Launches:
    kernels: int = 0  # Inductor-generated kernels
    gemms: int = 0  # extern mm / addmm / bmm
    custom: int = 0  # custom-op calls (vvs::)
    other: int = 0  # other fallbacks and copies that do work
    names: tuple = ()  # every launch, in order (for reports)

    @property
    def total(self) -> int:
        return self.kernels + self.gemms + self.custom + self.other

    def __add__(self, o: "Launches") -> "Launches":
        return Launches(self.kernels + o.kernels, self.gemms + o.gemms, self.custom + o.custom,
                        self.other + o.other, self.names + o.names)

    def to_dict(self) -> dict:
        return {"total": self.total, "kernels": self.kernels, "gemms": self.gemms, "custom_ops": self.custom,
                "other": self.other}


def call_body(code: str) -> str:
    """The body of the generated ``call`` function (where the launches happen)."""
    start = code.find("def call(")
    if start < 0:
        raise ValueError("not Inductor output code: no call() function")
    end = code.find("\nrunner = Runner(", start)
    if end < 0:  # older layouts: call() is followed by the benchmark helpers
        end = code.find("\ndef benchmark_compiled_module", start)
    return code[start:end if end > 0 else len(code)]


def count(code: str) -> Launches:
    """Launches of one generated module (see the module docstring)."""
    kernels = set(_KERNEL_DEF.findall(code))
    body = call_body(code)
    n = Launches()
    names = []
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "del ", "assert_")):
            continue
        head = re.match(r"(?:\w+ = )?(\w+)(?:\.run)?\(", line)
        if head and head.group(1) in kernels:
            n.kernels += 1
            names.append(head.group(1))
            continue
        ext = _EXTERN.search(line)
        if ext:
            if ext.group(1) in GEMMS:
                n.gemms += 1
            else:
                n.other += 1
            names.append(f"extern_kernels.{ext.group(1)}")
            continue
        op = _OP.search(line)
        if op:
            if op.group(1) == "aten":
                n.other += 1
            else:
                n.custom += 1
            names.append(f"{op.group(1)}.{op.group(2)}")
            continue
        aten = _ATEN_CALL.search(line)
        if aten:
            n.other += 1
            names.append(f"aten.{aten.group(1)}")
            continue
        if _COPY.search(line):
            n.other += 1
            names.append("copy_")
    n.names = tuple(names)
    return n


def allocations(code: str) -> list:
    """Shapes of every buffer the generated ``call`` allocates (``empty_strided``), as tuples."""
    return [tuple(int(x) for x in m.split(",") if x.strip()) for m in _ALLOC.findall(call_body(code))]


class CodeCaptured(RuntimeError):
    """Raised after Inductor generated a round's code in ``recording("gpu")``: the round runs eagerly."""


def _patch_combo_grouping(stack: contextlib.ExitStack) -> bool:
    """Inductor forms combo kernels only for GPU devices (its grouping skips ``cpu`` nodes); for the
    GPU-style count the CPU's Triton nodes are grouped as CUDA's would be. Returns False if this
    torch's grouping code is not the one patched (then no combo kernels are counted)."""
    import inspect
    import textwrap

    import torch._inductor.scheduler as scheduler

    node_cls = getattr(scheduler, "ForeachKernelSchedulerNode", None)
    fn = getattr(node_cls, "_default_group_nodes_for_combo_kernels", None)
    if fn is None:
        return False
    src = textwrap.dedent(inspect.getsource(fn))
    skip = 'device.type == "mps" or device.type == "cpu"'
    if skip not in src:
        return False
    namespace: dict = {}
    exec(compile(src.replace(skip, 'device.type == "mps"'), "<vvs-combo-grouping>", "exec"),
         scheduler.__dict__, namespace)
    stack.enter_context(mock.patch.object(node_cls, "group_algorithm_for_combo_kernels",
                                          staticmethod(namespace[fn.__name__])))
    return True


def _enter_gpu_style(stack: contextlib.ExitStack) -> None:
    """Inductor lowers CPU graphs to Triton (as for CUDA) without a GPU driver: the backend hash that
    Triton's code generation asks the (absent) driver for is a constant."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils

    stack.enter_context(inductor_config.patch({"cpu_backend": "triton", "fx_graph_cache": False}))
    stack.enter_context(mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "VVS-CODEGEN-ONLY"))
    stack.enter_context(mock.patch.object(triton_utils, "triton_backend", lambda: None))
    _patch_combo_grouping(stack)
    stack.enter_context(compiled.codegen_only())
    # The CPU compile's ATen reductions (compiled CPU tokens = eager ones) are not what a GPU runs.
    from .. import sampling

    stack.enter_context(mock.patch.object(sampling, "_eager_exact", lambda x: False))


@contextlib.contextmanager
def recording(style: str = "cpu"):
    """Collect the generated code of every round compiled inside the block: {round kind: [code, ...]}
    (one entry per compile: batch size, retire size). Resets Dynamo first, so every round compiles
    (or loads from Inductor's on-disk cache) here, not earlier in the process. ``style``: "cpu" (the
    C++ code that runs) or "gpu" (Triton code as for CUDA; the rounds then run eagerly): see the
    module docstring."""
    if style not in ("cpu", "gpu"):
        raise ValueError(f"style must be cpu or gpu, got {style!r}")
    codes: dict = {}

    def save(code: str) -> None:
        codes.setdefault(compiled.current_round() or "?", []).append(code)
        if style == "gpu":
            raise CodeCaptured("code generated; not compiled (launches.recording('gpu'))")

    from torch._inductor.graph import GraphLowering

    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        if style == "gpu":
            _enter_gpu_style(stack)
        stack.enter_context(mock.patch.object(GraphLowering, "save_output_code", save))
        yield codes
    torch._dynamo.reset()  # no compiled code of this block outlives it (the GPU style's cannot run)


def round_launches(fn, *args, name: str = "round", style: str = "cpu") -> Launches:
    """Compile ``fn`` as the engine compiles a round (``fullgraph=True, dynamic=False``, the engine's
    Inductor options), run it once on ``args`` (it runs for real: it updates whatever state it
    updates; eagerly in the "gpu" style) and count its launches."""
    with recording(style) as codes:
        r = compiled.CompiledRound(name, fn)
        r(*args)
    if style == "cpu" and not r.ok:
        raise RuntimeError(f"round '{name}' did not compile: {r.error}")
    if name not in codes:
        raise RuntimeError(f"round '{name}' generated no code: {r.error}")
    return sum((count(c) for c in codes[name]), Launches())
