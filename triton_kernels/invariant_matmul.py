"""Batch-invariant matmul: ``y = x @ W^T (+ bias)`` whose every output row has the same bits whatever
the row count M and the row's position.

Why: cuBLAS (like MKL on the CPU) picks its kernel, tile shape and split-K by the GEMM's shape, so the
rounding of one row's dot products changes with M (the batch's rows x queries), and a sampled token
near a tie flips with its batch-mates. Here one tile configuration serves every shape (no autotuning,
no heuristic by M) and there is no split-K: the program of an output tile walks the whole reduction
dimension K in BLOCK_K steps in order, accumulating in fp32, and the tile's rows are independent of
one another in the tensor-core dot. So a row's result depends on its own inputs and K only (the
"Defeating Nondeterminism in LLM Inference" recipe for matmuls). bf16 / fp16 inputs use the native
half-precision dot with fp32 accumulation and one rounding of the output; fp32 inputs the IEEE dot
(not TF32: the plain layer's precision).

Reference (and the CPU path): ``vvs_engine.kernels.reference.invariant_linear``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The one tile configuration (not autotuned: a choice by shape would bring back the dependence on M).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The whole of K in one program, in order: no split-K, so no cross-program reduction.
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_t = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk,
                      mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            x = x.to(tl.float32)
            w_t = w_t.to(tl.float32)
        acc = tl.dot(x, w_t, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any strides), weight [N, K], bias [N] or None -> [M, N] in x's dtype (written into
    ``out`` if given). Every row of the result is bit-identical for any M and row position."""
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    # The Triton interpreter computes bf16 tl.dot wrongly (see tree_attention.py): widen the tiles there.
    upcast = x.dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") == "1"
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N, K,
        *x.stride(), *weight.stride(), *out.stride(),
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
