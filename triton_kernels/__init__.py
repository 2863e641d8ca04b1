"""Triton kernels of ``vvs_engine`` (installed as ``vvs_engine.triton_kernels``).

One module per op, Liger-Kernel style: the ``@triton.jit`` kernel, then its Python launcher. Each
launcher matches the torch reference of the same name in ``vvs_engine.kernels.reference``, which the
tests and benchmarks compare against. Importing this package never needs Triton; the op modules do.
On the CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the
tests exercise them without a GPU.
"""
from __future__ import annotations

import importlib.util

AVAILABLE = importlib.util.find_spec("triton") is not None

__all__ = ["AVAILABLE", "tree_attention", "draft_topk", "lantern_mass", "group_mass"]


def __getattr__(name):
    # Lazy: ``import vvs_engine.triton_kernels`` stays cheap and works without Triton installed.
    if name == "tree_attention":
        from .tree_attention import tree_attention
        return tree_attention
    if name == "draft_topk":
        from .draft_topk import draft_topk
        return draft_topk
    if name in ("lantern_mass", "group_mass"):
        from . import relaxed_acceptance
        return getattr(relaxed_acceptance, name)
    raise AttributeError(name)
