"""Count the compute ops a piece of code dispatches: the launch budget of a decode round.

On a GPU every dispatched op is at least one kernel launch (a few microseconds), so the number of ops
per round bounds what a round costs however small its tensors are. :class:`OpCounter` is a
``TorchDispatchMode`` that sees every aten (and ``vvs::``) op below autograd and counts the *compute*
ops: it skips an op when every tensor it returns shares storage with one of its inputs and the op
mutates nothing (views, reshapes, no-op ``to``/``contiguous``), and bare allocations (``empty``). In-place ops (``index_copy_``,
``copy_``) return an input but do work, so they count. Ops that read a device value on the host
(``.item()``, ``.tolist()``, ``int(t)``, ``nonzero``...) are also tallied as host syncs.

    with OpCounter() as ops:
        step()
    print(ops.compute, ops.syncs, ops.by_name.most_common(5))
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten ops whose result the host reads (a device -> host synchronisation on CUDA)
# allocations without a kernel: not a launch
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
                        "_unique2", "repeat_interleave_count"})


def _storages(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


class OpCounter(TorchDispatchMode):
    """Counts compute ops (``compute``, ``by_name``) and host reads (``syncs``) inside its ``with``."""

    def __init__(self):
        super().__init__()
        self.compute = 0
        self.syncs = 0
        self.by_name: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.syncs += 1
        if name not in ALLOCATIONS and self._is_compute(func, args, kwargs, out):
            self.compute += 1
            self.by_name[str(func.overloadpacket)] += 1
        return out

    @staticmethod
    def _is_compute(func, args, kwargs, out) -> bool:
        if func._schema.is_mutable:
            return True
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:
            return True  # e.g. _local_scalar_dense: work plus a host read
        ins = _storages(tree_flatten((args, kwargs))[0])
        nonempty = [t for t in outs if t.numel()]
        return not nonempty or not all(t.untyped_storage().data_ptr() in ins for t in nonempty)

