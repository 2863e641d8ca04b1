"""Static KV cache shared by every decoding method.

One preallocated buffer per K and V: ``[n_layer, batch, heads, slots, head_dim]``. Slots are positions
in the committed sequence, followed by scratch slots where tree nodes or Jacobi drafts are written
before they are accepted. Nothing is ever reallocated during decoding: writes go to device-side slot
indices and attention masks hide slots that are not in a query's context, so the shapes are static
(CUDA-graph friendly) and no host sync is needed.

Every write is one ``index_put_`` on the whole ``[L, ...]`` buffer, with the layer as a tensor index
(:func:`~vvs_engine.models.gpt.write_kv`). Why: torch.compile functionalises a write through a view (``k[i]``, a layer) or a
``scatter_`` into a persistent buffer as an out-of-place copy of the whole buffer plus a copy back;
Inductor turns ``index_put_`` on the base tensor back into an in-place write (no cache-sized
temporaries). Reading a layer through a view (:meth:`LayerKV.__iter__`) costs nothing.
"""
from __future__ import annotations

import torch

from ..models.gpt import LayerKV, write_kv  # noqa: F401  (the cache's write; models sit below runtime)


class StaticKVCache:
    def __init__(self, n_layer: int, batch: int, n_head: int, n_slots: int, head_dim: int,
                 dtype: torch.dtype, device):
        # Round up like LlamaGen (multiple of 8) so kernels see aligned lengths.
        n_slots = (n_slots + 7) // 8 * 8
        shape = (n_layer, batch, n_head, n_slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        # Index vectors of write_kv, made once. Retiring rows only shrinks the batch: row_ids[:B].
        self.layer_ids = torch.arange(n_layer, device=device)
        self.row_ids = torch.arange(batch, device=device)
        self.head_ids = torch.arange(n_head, device=device)

    @classmethod
    def for_model(cls, model, batch: int, n_slots: int, dtype=None, device=None):
        cfg = model.config
        p = next(model.parameters())
        heads = getattr(cfg, "n_kv_head", cfg.n_head)  # grouped-query attention caches K/V heads only
        return cls(cfg.n_layer, batch, heads, n_slots, cfg.head_dim, dtype or p.dtype, device or p.device)

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self, i)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots ``src`` to slots ``dst`` in every layer and batch row (the compaction
        after acceptance). ``src``/``dst``: [n] device int64, the same for every row, or [batch, n] (one
        list per row). Gathering first makes it correct when the source and destination ranges overlap."""
        from ..kernels import kv_compact  # dispatch: reference / triton / cuda

        kv_compact(self.k, self.v, src, dst)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
