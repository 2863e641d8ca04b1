"""Triton kernels of ``vvs_engine`` (installed as ``vvs_engine.triton_kernels``).

One module per op, Liger-Kernel style: the ``@triton.jit`` kernel, then its Python launcher. Each
launcher matches the torch reference of the same name in ``vvs_engine.kernels.reference``, which the
tests and benchmarks compare against. Importing this package never needs Triton; the op modules do.
On the CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the
tests exercise them without a GPU.
"""
from __future__ import annotations

import importlib.util
import types

try:
    AVAILABLE = importlib.util.find_spec("triton") is not None
except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None to block it
    AVAILABLE = False

__all__ = ["AVAILABLE", "tree_attention", "draft_topk", "lantern_mass", "group_mass", "tree_verify", "tree_level",
           "tree_select", "counter_uniform", "kv_move_rows", "invariant_linear", "invariant_attention"]


_LAUNCHERS = {
    "tree_attention": "tree_attention",
    "draft_topk": "draft_topk",
    "lantern_mass": "relaxed_acceptance",
    "group_mass": "relaxed_acceptance",
    "tree_verify": "tree_verify",
    "tree_level": "tree_level",
    "tree_select": "tree_select",
    "counter_uniform": "counter_uniform",
    "kv_move_rows": "kv_move_rows",
    "invariant_linear": "invariant_matmul",
    "invariant_attention": "invariant_attention",
}


def __getattr__(name):
    # Lazy: ``import vvs_engine.triton_kernels`` stays cheap and works without Triton installed.
    if name not in _LAUNCHERS:
        raise AttributeError(name)
    import importlib

    launcher = getattr(importlib.import_module(f"{__name__}.{_LAUNCHERS[name]}"), name)
    # Importing submodule ``tree_attention`` binds the module to that package attribute; rebind the
    # name to the launcher function so ``triton_kernels.tree_attention(...)`` calls the launcher.
    globals()[name] = launcher
    return launcher


def _unshadow(name: str) -> None:
    """A kernel module that imports a sibling's helpers (``from .tree_attention import ...``) binds the
    sibling module to the package attribute of that name, hiding its launcher: drop the binding, so the
    next ``triton_kernels.<name>`` goes through ``__getattr__`` and gets the launcher again."""
    if isinstance(globals().get(name), types.ModuleType):
        del globals()[name]
