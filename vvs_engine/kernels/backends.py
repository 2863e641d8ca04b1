"""Which kernel backend runs an op: ``cuda`` (``vvs_engine._C``), ``triton`` or ``reference`` (torch).

Default order by availability: cuda -> triton -> reference, per op (an op a backend does not implement
falls through to the next one). ``VVS_KERNELS=reference|triton|cuda`` forces a backend; forcing one that
cannot run raises a one-line ``VVSError``. Triton runs on CUDA tensors, or on CPU tensors under the
Triton interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels without a GPU).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from ..errors import VVSError

BACKENDS = ("cuda", "triton", "reference")
ENV = "VVS_KERNELS"

# What each compiled backend implements; everything else falls through to the next backend.
CUDA_OPS = frozenset({"tree_meta", "kv_compact", "gather_rows", "scatter_rows_", "accept_walk"})
TRITON_OPS = frozenset({"tree_attention", "draft_topk", "lantern_mass", "group_mass", "tree_verify",
                        "counter_uniform", "tree_level", "tree_select", "kv_move_rows", "invariant_linear",
                        "invariant_attention"})


def forced_backend() -> str | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    if value not in BACKENDS:
        raise VVSError(f"{ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


@functools.lru_cache(maxsize=None)
def cuda_module():
    """``vvs_engine._C`` (built by setup.py/CMake where CUDA torch exists), or None."""
    try:
        return importlib.import_module("vvs_engine._C")
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def triton_module():
    """``vvs_engine.triton_kernels``: ``triton_kernels/`` of the source checkout this ``vvs_engine`` was
    imported from, else the installed package; None when Triton is not installed. The checkout comes
    first because an editable install of another checkout (a git worktree's main tree) maps the name
    to that checkout's kernels, which can lack this one's ops."""
    try:
        if importlib.util.find_spec("triton") is None:
            return None
    except (ImportError, ValueError):
        return None
    name = "vvs_engine.triton_kernels"
    checkout = Path(__file__).resolve().parents[2]
    init = checkout / "triton_kernels" / "__init__.py"
    # setup.py marks a source checkout (an installed vvs_engine's parent is site-packages, where a
    # ``triton_kernels`` would be Triton's own package)
    if not (init.exists() and (checkout / "setup.py").exists()):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            return None
    loaded = sys.modules.get(name)
    if loaded is not None and Path(loaded.__file__).resolve() == init:
        return loaded
    # Drop another checkout's package and launcher modules (imported under the same names) before
    # loading this one's.
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def triton_runs_on(device: torch.device, forced: str | None = None) -> bool:
    # CPU tensors go to the interpreter only when Triton is forced: an exported TRITON_INTERPRET must
    # not send the engine's CPU hot path through a numpy simulation.
    return device.type == "cuda" or (forced == "triton" and os.environ.get("TRITON_INTERPRET") == "1")


def choose(op: str, device: torch.device) -> str:
    """The backend that runs ``op`` on tensors of ``device``."""
    forced = forced_backend()
    if forced == "reference":
        return "reference"
    if forced == "cuda":
        if cuda_module() is None:
            raise VVSError(f"{ENV}=cuda but the CUDA extension vvs_engine._C is not built (pip install --no-build-isolation . on a CUDA machine)")
        if device.type != "cuda":
            raise VVSError(f"{ENV}=cuda but {op} got {device.type} tensors")
    if forced == "triton":
        if triton_module() is None:
            raise VVSError(f"{ENV}=triton but triton does not import")
        if not triton_runs_on(device, forced):
            raise VVSError(f"{ENV}=triton but {op} got {device.type} tensors (set TRITON_INTERPRET=1 to run Triton on the CPU)")
    start = BACKENDS.index(forced) if forced else 0
    for backend in BACKENDS[start:]:
        if backend == "cuda" and op in CUDA_OPS and device.type == "cuda" and cuda_module() is not None:
            return "cuda"
        if backend == "triton" and op in TRITON_OPS and triton_runs_on(device, forced) and triton_module() is not None:
            return "triton"
    return "reference"


def describe(device="cuda") -> dict:
    """Op -> backend for ``device`` (for logs and ``vvs-engine`` diagnostics)."""
    device = torch.device(device)
    return {op: choose(op, device) for op in sorted(CUDA_OPS | TRITON_OPS)}
