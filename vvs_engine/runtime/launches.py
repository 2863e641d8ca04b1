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
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from unittest import mock

import torch

from . import compiled

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm"})
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_OP = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)")
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
        if _COPY.search(line):
            n.other += 1
            names.append("copy_")
    n.names = tuple(names)
    return n


def allocations(code: str) -> list:
    """Shapes of every buffer the generated ``call`` allocates (``empty_strided``), as tuples."""
    return [tuple(int(x) for x in m.split(",") if x.strip()) for m in _ALLOC.findall(call_body(code))]


@contextlib.contextmanager
def recording():
    """Collect the generated code of every round compiled inside the block: {round kind: [code, ...]}
    (one entry per compile: batch size, retire size). Resets Dynamo first, so every round compiles
    (or loads from Inductor's on-disk cache) here, not earlier in the process."""
    codes: dict = {}

    def save(code: str) -> None:
        codes.setdefault(compiled.current_round() or "?", []).append(code)

    from torch._inductor.graph import GraphLowering

    torch._dynamo.reset()
    with mock.patch.object(GraphLowering, "save_output_code", save):
        yield codes


def round_launches(fn, *args, name: str = "round") -> Launches:
    """Compile ``fn`` as the engine compiles a round (``fullgraph=True, dynamic=False``), run it once
    on ``args`` (it runs for real: it updates whatever state it updates) and count its launches."""
    with recording() as codes:
        r = compiled.CompiledRound(name, fn)
        r(*args)
    if not r.ok:
        raise RuntimeError(f"round '{name}' did not compile: {r.error}")
    return sum((count(c) for c in codes.get(name, [])), Launches())
