"""Count the compute ops a piece of code dispatches (ops per token in benchmarks/quality_speed.py).

An op counts unless all its outputs share storage with an input and it mutates nothing (views,
reshapes, ``detach``: no work). In-place ops (``add_``, ``copy_``, ``index_copy_``) count.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree):
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.total`` and ``c.by_op`` (aten op name -> count)."""

    def __init__(self):
        super().__init__()
        self.by_op = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        aliasing = bool(outs) and _storages(outs) <= _storages((args, kwargs))
        if not aliasing or func._schema.is_mutable:
            self.by_op[func.__name__] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())
