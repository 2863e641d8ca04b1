"""Batch-invariant linear layers and attention: a row's output bits do not depend on the other rows of
its GEMM or its attention call.

Why: an image's random draws are keyed by (seed, image index, step), so its tokens can depend on its
batch-mates only through floating-point rounding, and on the CPU that rounding comes from the GEMMs.
MKL picks its kernel by the row count M: measured here (torch 2.13, MKL 2024.2, AVX-512, 1 and 2
threads, fp32), a row's result is the same for every M >= 16 whatever its position, while M = 1,
M = 2..10 (K = 256) or 2..15 (K >= 512) each give other bits (``benchmarks/batch_invariance_cost.py
--probe``: benchmarks/results/batch_invariance_cost_zoo_cpu_gemm_probe.md). oneDNN's bf16 GEMM has no
such floor: for K >= 512 some rows' bits change with M up to a few hundred rows. So in batch-invariant
mode, on the CPU (``kernels.reference.invariant_linear``):

* fp32 / fp64: a GEMM with fewer than :data:`GEMM_ROW_FLOOR` rows is padded with zero rows up to it
  (the padded rows are dropped), so every row goes through the one kernel MKL uses for M >= 16;
* bf16 / fp16: the GEMM runs in fp32 (inputs and weight cast up exactly, output rounded once to the
  input dtype) with the same floor.

Attention (the torch reference's SDPA on the CPU), norms, softmax and the sampling reductions
reduce each row on its own with an order fixed by the row's length, not by the batch; the tests of
``tests/test_batch_invariance.py`` check the tokens end to end. On CUDA, cuBLAS and the attention
kernels also choose their tiling and splits by shape, so the mode takes the Triton kernels
``vvs::invariant_linear`` (one tile configuration, no split-K) and ``vvs::invariant_attention`` (a
fixed key split size, an in-order merge) instead (``triton_kernels/invariant_*.py``; tested in the
Triton interpreter only, docs/batching.md). The switch is a flag on each layer
(``set_batch_invariant``), so two engines in one process can differ, and compiled rounds see it as a
module attribute (a guard), not as an argument threaded through the loop.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..kernels.reference import GEMM_ROW_FLOOR, invariant_linear as _cpu_invariant_linear  # noqa: F401

_UPCAST = (torch.bfloat16, torch.float16)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every output row has the bits it would have in any GEMM:
    on the CPU as in a GEMM of at least :data:`GEMM_ROW_FLOOR` rows, on CUDA through the Triton matmul
    with one tiling (``kernels.invariant_linear``); on other devices plain ``F.linear``."""
    device = x.device.type
    if device not in ("cpu", "cuda"):
        return F.linear(x, weight, bias)
    if (x.dtype in _UPCAST or device == "cuda") and type(weight) not in (torch.Tensor, nn.Parameter) \
            and hasattr(weight, "dequantize"):
        weight = weight.dequantize()  # a quantized (torchao) weight has no .float() (nor strides): its values first
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    y = _cpu_invariant_linear(rows, weight, bias) if device == "cpu" else kernels.invariant_linear(rows, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class InvariantLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) that computes with :func:`invariant_linear`
    while its ``batch_invariant`` flag is set."""

    batch_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """``F.linear`` for a model that computes a projection itself (a weight it slices): batch-invariant
    while ``module.batch_invariant`` is set."""
    if getattr(module, "batch_invariant", False):
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def set_batch_invariant(on: bool, *modules: Optional[nn.Module]) -> None:
    """Turn batch-invariant arithmetic on or off in ``modules`` (None entries are skipped): every
    ``nn.Linear`` among their submodules becomes an :class:`InvariantLinear` (its class only: the same
    parameters, hooks and state dict) with the flag set to ``on``; a module that declares a
    ``batch_invariant`` attribute of its own (a model computing a projection through :func:`linear`)
    gets it too."""
    for root in modules:
        if root is None:
            continue
        for m in root.modules():
            if type(m) is nn.Linear:
                m.__class__ = InvariantLinear
            if isinstance(m, InvariantLinear) or hasattr(type(m), "batch_invariant"):
                m.batch_invariant = bool(on)


def is_batch_invariant(modules: Iterable[Optional[nn.Module]]) -> bool:
    """Whether every linear layer of ``modules`` computes batch-invariantly."""
    layers = [m for root in modules if root is not None for m in root.modules() if isinstance(m, nn.Linear)]
    return bool(layers) and all(getattr(m, "batch_invariant", False) for m in layers)
