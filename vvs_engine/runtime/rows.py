"""Per-row state, declared once: what admission, tail compaction and collection copy.

A decoder keeps every image's state in buffers with a leading row dimension (or the row dimension
elsewhere: the KV cache is ``[layers, rows, ...]``). Instead of each method writing its own admit /
keep / collect over its own list of buffers (a buffer missed in one copy is a silent wrong image), a
decoder declares its buffers once in a :class:`RowTable`, and the three operations are written here:

* **admission**: rows of a running decoder take the images of a freshly prefilled one
  (``table.copy_rows(rows, newcomers.rows_table, range(n))``);
* **compaction**: the live rows of a decoder move into a smaller decoder of the same method (the
  persistent core's smaller bucket) with the same call;
* **collection**: a finished row's results are gathered by name (:meth:`RowTable.gather`).

All writes are ``index_copy_`` into the existing tensors, so round functions compiled and CUDA graphs
captured over a decoder's buffers stay valid. A buffer holds either image rows (``[n, ...]``) or model
rows (``[rows, ...]``: under classifier-free guidance an image has a conditional row ``r`` and an
unconditional row ``r + n``); host-side per-row lists (a schedule the host follows) are declared too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence, Union

import torch

Buffer = Union[torch.Tensor, list]


@dataclass
class RowBuffer:
    value: Buffer
    dim: int = 0  # the row dimension
    model_rows: bool = False  # rows are model rows (CFG: [cond rows; uncond rows]) rather than images


class RowTable:
    """Named per-row buffers of one decoder with ``images`` rows (``use_cfg``: model rows are doubled)."""

    def __init__(self, images: int, use_cfg: bool, device):
        self.images, self.use_cfg, self.device = images, bool(use_cfg), torch.device(device)
        self.buffers: Dict[str, RowBuffer] = {}

    def add(self, name: str, value: Buffer, dim: int = 0, model_rows: bool = False) -> "RowTable":
        if name in self.buffers:
            raise ValueError(f"row buffer '{name}' declared twice")
        expected = self.images * (2 if model_rows and self.use_cfg else 1)
        size = len(value) if isinstance(value, list) else value.shape[dim]
        # a status buffer may carry flags after its rows: [rows + k]
        if size < expected:
            raise ValueError(f"row buffer '{name}' has {size} rows along dim {dim}, expected {expected}")
        self.buffers[name] = RowBuffer(value, dim, model_rows)
        return self

    def _index(self, rows: torch.Tensor, model_rows: bool) -> torch.Tensor:
        return torch.cat([rows, rows + self.images]) if model_rows and self.use_cfg else rows

    def copy_rows(self, rows: Sequence[int], source: "RowTable", source_rows: Sequence[int]) -> None:
        """Rows ``rows`` of this table take rows ``source_rows`` of ``source`` (a table of the same
        buffers, any row count): every buffer, in place."""
        if set(source.buffers) != set(self.buffers):
            raise ValueError(f"row tables differ: {sorted(set(source.buffers) ^ set(self.buffers))}")
        if len(rows) != len(source_rows):
            raise ValueError(f"{len(rows)} rows take {len(source_rows)} source rows")
        dst = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        src = torch.as_tensor(list(source_rows), dtype=torch.long, device=source.device)
        for name, mine in self.buffers.items():
            theirs = source.buffers[name]
            if isinstance(mine.value, list):
                for d, s in zip(rows, source_rows):
                    mine.value[d] = theirs.value[s]
                continue
            taken = theirs.value.index_select(theirs.dim, source._index(src, theirs.model_rows))
            mine.value.index_copy_(mine.dim, self._index(dst, mine.model_rows), taken.to(mine.value.device))

    def gather(self, names: Sequence[str], rows: torch.Tensor) -> dict:
        """{name: the rows' values [n, ...]} (image rows; a model-row buffer gives its conditional rows)."""
        return {name: self.buffers[name].value.index_select(self.buffers[name].dim, rows) for name in names}
