"""Counter-based uniforms: the engine's ``CounterRNG`` draws for several streams in one launch.

Every draw is a pure function of (image key, step, stream, lane): two SplitMix64 finalisers and the
top 24 bits as a float in (0, 1] (see ``vvs_engine.rng``). The torch version is about thirty small
integer ops per call (each shift, mask, xor and multiply is a launch); here one program per
(image, stream, block of lanes) does them in registers on unsigned 64-bit integers, whose
multiplication wraps and whose right shift is logical, so the bits equal the torch version's.

Reference: ``vvs_engine.kernels.reference.counter_uniform``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix64(z):
    """SplitMix64 finaliser on uint64 (wrapping multiply, logical shifts)."""
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _counter_uniform_kernel(key_ptr, step_ptr, stream_ptr, out_ptr, n_streams, n_lanes, stride_step,
                            BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.program_id(1)
    key = tl.load(key_ptr + b).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + b * stride_step).to(tl.uint64, bitcast=True)
    stream = tl.load(stream_ptr + s).to(tl.uint64, bitcast=True)
    base = _mix64(key + step * 0xD1B54A32D192ED03 + stream)  # rng.STEP
    lanes = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    h = _mix64(base + (lanes + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)  # lane offsets: (lane + 1) * GOLDEN
    u = ((h >> 40) + 1).to(tl.float32) * (1.0 / 16777216.0)
    tl.store(out_ptr + (b * n_streams + s) * n_lanes + lanes, u, mask=lanes < n_lanes)


def counter_uniform(key: torch.Tensor, step: torch.Tensor, stream_offsets: torch.Tensor, n_lanes: int,
                    *, out: torch.Tensor | None = None) -> torch.Tensor:
    """key [B] int64, step [B] (or [1]: every image) int64, stream_offsets [S] int64 -> uniforms
    [B, S, n_lanes] float32 (written into ``out`` if given)."""
    B, S = key.shape[0], stream_offsets.shape[0]
    if out is None:
        out = torch.empty((B, S, n_lanes), dtype=torch.float32, device=key.device)
    block = min(1024, max(16, triton.next_power_of_2(n_lanes)))
    _counter_uniform_kernel[(B, S, triton.cdiv(n_lanes, block))](
        key, step, stream_offsets, out, S, n_lanes, step.stride(0) if step.numel() > 1 else 0, BLOCK=block)
    return out
