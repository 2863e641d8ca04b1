"""Fused draft-head sampling: CFG combine -> temperature -> top-k -> top-p -> softmax -> top-k
candidates (greedy, or k draws without replacement by the exponential race) and their log-probs.

One program per output row holds the whole vocabulary row. The top-k and top-p thresholds are found
without sorting (the idea behind vLLM's pivot search and FlashInfer's sorting-free samplers): floats
are mapped to integers with the same order, and a fixed 32-step bisection over that integer range
counts (top-k) or sums the mass of (top-p) the tokens above the pivot. The result is the exact k-th
largest logit / the exact top-p cut, found in 2 x 32 passes over registers, and the fixed trip count
keeps the kernel free of data-dependent control flow (CUDA-graph friendly). The final ``k`` picks are
``k`` argmax passes (``k`` is small: the draft tree's branching factor).

Noise: an explicit ``noise`` [B, V] of Exp(1) samples (what the tests use, to match the reference),
or in-kernel Philox from ``seed_offset`` (a device int64 [2] tensor: seed, offset; the launcher
advances the offset on the device, so a captured CUDA graph draws fresh noise on every replay).

Reference: ``vvs_engine.kernels.reference.draft_topk`` (exactly ``vvs_engine.sampling.process_logits``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NOISE_NONE, NOISE_TENSOR, NOISE_PHILOX = 0, 1, 2


@triton.jit
def _order_key(x):
    """Map float32 to int32 with the same order (flip the magnitude bits of negatives). The keys stay
    int32 (half the registers of int64); the bisection bounds are int64 scalars, and every midpoint
    fits in int32, so comparisons cast the midpoint down."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _draft_topk_kernel(
    logits_ptr, noise_ptr, seed_offset_ptr, tokens_ptr, logp_ptr,
    n_vocab, n_out_rows, stride_lr, stride_nr, stride_tr, stride_pr,
    cfg_scale, temperature, top_k, top_p,
    K: tl.constexpr, USE_CFG: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
    NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_V)
    in_vocab = cols < n_vocab

    x = tl.load(logits_ptr + row * stride_lr + cols, mask=in_vocab, other=0.0).to(tl.float32)
    if USE_CFG:
        # Rows [cond_0..cond_{B-1}; uncond_0..]: same arithmetic as sampling.cfg_combine.
        uncond = tl.load(logits_ptr + (row + n_out_rows) * stride_lr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        x = uncond + cfg_scale * (x - uncond)
    x = x / temperature
    key = _order_key(x)
    keep = in_vocab

    if USE_TOP_K:
        # Largest pivot T with #{key >= T} >= top_k; that is exactly the k-th largest key.
        lo = tl.full((), -2147483648, tl.int64)  # invariant: count(key >= lo) >= top_k
        hi = tl.full((), 2147483648, tl.int64)  # invariant: count(key >= hi) < top_k
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            count = tl.sum(tl.where(keep & (key >= mid.to(tl.int32)), 1, 0), 0)
            ok = count >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        keep = keep & (key >= lo.to(tl.int32))

    if USE_TOP_P:
        x_max = tl.max(tl.where(keep, x, float("-inf")), 0)
        e = tl.where(keep, tl.exp(x - x_max), 0.0)
        prob = e / tl.sum(e, 0)
        # A token is removed when the mass strictly above it exceeds top_p. That mass only grows as the
        # key falls, so the kept set is {key >= T} for the smallest T with mass(key > T) <= top_p.
        lo = tl.full((), -2147483649, tl.int64)  # invariant: mass(key > lo) > top_p (the whole row)
        hi = tl.full((), 2147483647, tl.int64)  # invariant: mass(key > hi) <= top_p (nothing above)
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            mass = tl.sum(tl.where(key > mid.to(tl.int32), prob, 0.0), 0)
            ok = mass <= top_p
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        keep = keep & (key >= hi.to(tl.int32))

    x_max = tl.max(tl.where(keep, x, float("-inf")), 0)
    e = tl.where(keep, tl.exp(x - x_max), 0.0)
    p = e / tl.sum(e, 0)

    if NOISE == 1:
        noise = tl.load(noise_ptr + row * stride_nr + cols, mask=in_vocab, other=1.0).to(tl.float32)
        score = p / noise
    elif NOISE == 2:
        seed = tl.load(seed_offset_ptr)
        offset = tl.load(seed_offset_ptr + 1)
        u = tl.rand(seed, offset + row * n_vocab + cols)
        score = p / -tl.log(tl.maximum(u, 1.0e-30))  # Exp(1) = -log(U)
    else:
        score = p
    score = tl.where(in_vocab, score, -1.0)  # real scores are >= 0

    for i in tl.static_range(K):
        best = tl.max(score, 0)
        pick = tl.min(tl.where(score == best, cols, BLOCK_V), 0)  # ties: lower index first
        p_pick = tl.sum(tl.where(cols == pick, p, 0.0), 0)
        tl.store(tokens_ptr + row * stride_tr + i, pick.to(tl.int64))
        tl.store(logp_ptr + row * stride_pr + i, tl.log(p_pick))
        score = tl.where(cols == pick, -1.0, score)


def draft_topk(logits: torch.Tensor, cfg_scale: float, temperature: float, top_k: int, top_p: float,
               k: int, noise: torch.Tensor | None = None, *, seed_offset: torch.Tensor | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """logits [R, V] (R = 2B with CFG, rows [cond; uncond]) -> (tokens [B, k] int64, logp [B, k] fp32).
    ``noise`` [B, V] Exp(1) samples, or ``seed_offset`` int64 [2] (seed, offset) on the device for
    in-kernel Philox noise (the offset is advanced by B * V in place), or neither for greedy top-k.
    ``out``: optional preallocated (tokens, logp)."""
    if not temperature > 0:
        raise ValueError(f"draft sampling needs temperature > 0 (pass 1.0 for greedy runs), got {temperature}")
    use_cfg = cfg_scale != 1.0
    R, V = logits.shape
    B = R // 2 if use_cfg else R
    if k > V:
        raise ValueError(f"k={k} exceeds the vocabulary ({V})")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if out is None:
        out = (torch.empty((B, k), dtype=torch.int64, device=logits.device),
               torch.empty((B, k), dtype=torch.float32, device=logits.device))
    tokens, logp = out
    if noise is not None:
        mode = NOISE_TENSOR
        noise = noise if noise.stride(1) == 1 else noise.contiguous()
    elif seed_offset is not None:
        mode = NOISE_PHILOX
    else:
        mode = NOISE_NONE
    block_v = triton.next_power_of_2(V)
    _draft_topk_kernel[(B,)](
        logits, noise if noise is not None else logits, seed_offset if seed_offset is not None else tokens,
        tokens, logp,
        V, B, logits.stride(0), noise.stride(0) if noise is not None else 0, tokens.stride(0), logp.stride(0),
        float(cfg_scale), float(temperature), int(top_k), float(top_p),
        K=k, USE_CFG=use_cfg, USE_TOP_K=0 < top_k < V, USE_TOP_P=top_p < 1.0, NOISE=mode, BLOCK_V=block_v,
        # The whole row lives in registers: more warps for larger vocabularies (32 warps at 65536).
        num_warps=4 if block_v <= 2048 else (8 if block_v <= 8192 else (16 if block_v <= 16384 else 32)),
    )
    if mode == NOISE_PHILOX:
        seed_offset[1:].add_(B * V)  # on the device: the next call (or graph replay) draws new noise
    return tokens, logp
