"""One GEMM for several linear layers that read the same input (q/k/v, gate/up).

A decode round at batch 1 is launch-bound on a GPU: each ``nn.Linear`` is one GEMM launch, and the
gate/up pair or the q/k/v triple of a layer read the same activations. :class:`FusedLinear` holds
their weights stacked along the output dimension, so one GEMM computes all of them and the caller
splits the result (a view, no copy).

Checkpoints keep their published layout: :func:`fuse_linears` registers state-dict hooks on the
parent module, so ``parent.state_dict()`` still names ``<part>.weight`` / ``<part>.bias`` (views of
the fused tensor, no copy) and ``load_state_dict`` accepts those names (the parts are concatenated
once, at load time). Official LlamaGen checkpoints, the Zoo's files and Hugging Face shards therefore
load unchanged, and saving writes the original layout.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .invariant import InvariantLinear


class FusedLinear(InvariantLinear):
    """``nn.Linear(in_features, sum(sizes))`` whose output rows are the named parts in order (an
    :class:`~.invariant.InvariantLinear`: batch-invariant while its flag is set).

    Initialisation reproduces separate ``nn.Linear`` parts created in the same order (weight then
    bias of each part), so a model built under a seed has the weights it had before fusing.
    """

    def __init__(self, in_features: int, parts: Sequence[Tuple[str, int]], bias: bool = False,
                 device=None, dtype=None):
        self.part_names: List[str] = [n for n, _ in parts]
        self.part_sizes: List[int] = [int(s) for _, s in parts]
        super().__init__(in_features, sum(self.part_sizes), bias=bias, device=device, dtype=dtype)

    def part_slices(self) -> List[Tuple[str, int, int]]:
        out, start = [], 0
        for name, size in zip(self.part_names, self.part_sizes):
            out.append((name, start, size))
            start += size
        return out

    def reset_parameters(self) -> None:
        # nn.Linear's own rule applied part by part: a part's fan-in is in_features either way, and a
        # contiguous row slice draws the same random numbers a separate tensor would.
        if not hasattr(self, "part_names"):  # nn.Linear.__init__ calls this before our fields exist
            return
        with torch.no_grad():
            for _, start, size in self.part_slices():
                nn.init.kaiming_uniform_(self.weight[start:start + size], a=math.sqrt(5))
                if self.bias is not None:
                    bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                    nn.init.uniform_(self.bias[start:start + size], -bound, bound)

    def init_normal_(self, std: float) -> None:
        """LlamaGen's init (normal weights, zero bias), part by part in the unfused order."""
        with torch.no_grad():
            for _, start, size in self.part_slices():
                nn.init.normal_(self.weight[start:start + size], std=std)
                if self.bias is not None:
                    nn.init.zeros_(self.bias[start:start + size])

    def split(self, y: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The parts of an output ``y = self(x)`` (views along the last dimension)."""
        return y.split(self.part_sizes, dim=-1)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{n}={s}" for n, s in zip(self.part_names, self.part_sizes))
        return f"in_features={self.in_features}, parts=({parts}), bias={self.bias is not None}"


def fuse_linears(parent: nn.Module, name: str, in_features: int, parts: Sequence[Tuple[str, int]],
                 bias: bool = False) -> FusedLinear:
    """Give ``parent`` a :class:`FusedLinear` attribute ``name`` standing for the linear layers
    ``parts`` ((attribute name, out_features), in output order), while its state dict keeps the parts'
    names: ``<prefix><part>.weight`` (and ``.bias``)."""
    fused = FusedLinear(in_features, parts, bias=bias)
    setattr(parent, name, fused)
    params = ("weight", "bias") if bias else ("weight",)

    def to_parts(module, state_dict, prefix, local_metadata):
        for p in params:
            key = f"{prefix}{name}.{p}"
            if key not in state_dict:
                continue
            whole = state_dict.pop(key)
            for part, start, size in getattr(module, name).part_slices():
                state_dict[f"{prefix}{part}.{p}"] = whole[start:start + size]

    def from_parts(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        layer = getattr(module, name)  # (not the closure's: a deep copy of the parent keeps these hooks)
        for p in params:
            keys = [f"{prefix}{part}.{p}" for part in layer.part_names]
            if not all(k in state_dict for k in keys):
                continue  # left as they are: the strict check names what is missing or unexpected
            pieces = [state_dict[k] for k in keys]
            bad = [f"{k} {tuple(t.shape)}" for k, t, size in zip(keys, pieces, layer.part_sizes)
                   if t.shape[0] != size or (p == "weight" and tuple(t.shape[1:]) != (in_features,))]
            if bad:
                error_msgs.append(f"size mismatch for {', '.join(bad)}: expected parts of "
                                  f"{tuple(layer.part_sizes)} rows x {in_features}")
                continue
            for k in keys:
                del state_dict[k]
            state_dict[f"{prefix}{name}.{p}"] = torch.cat(pieces, dim=0)

    parent.register_state_dict_post_hook(to_parts)
    parent.register_load_state_dict_pre_hook(from_parts)
    return fused


def fused_layers(model: nn.Module) -> Dict[str, FusedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedLinear)}

