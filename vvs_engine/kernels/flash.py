"""flash-attn for plain attention over the static cache: prefill (causal, no padded condition slots)
and AR decode (one query over ``[0, P]``) call ``flash_attn_with_kvcache`` when ``flash_attn``
imports on CUDA with fp16/bf16; tree verification keeps the Triton tree-attention kernel (flash-attn
has no arbitrary mask). ``VVS_FLASH_ATTN=0`` turns it off; ``VVS_KERNELS=reference`` also does.

The cache is ``[B, H, S, D]`` per layer; flash-attn reads it as ``[B, S, H, D]`` through a transposed
view (it takes the strides), and ``cache_seqlens`` is computed on the device (no host sync).
"""
from __future__ import annotations

import functools
import os

import torch

ENV = "VVS_FLASH_ATTN"


@functools.lru_cache(maxsize=None)
def kvcache_fn():
    """``flash_attn.flash_attn_with_kvcache``, or None when flash-attn does not import."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:  # ImportError, or a build that does not match this torch
        return None
    return flash_attn_with_kvcache


def device_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill and AR decode on these tensors go to flash-attn."""
    from .backends import forced_backend

    if os.environ.get(ENV, "1") == "0" or forced_backend() == "reference":
        return False
    return device_supported(device, dtype, head_dim) and kvcache_fn() is not None


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_keys: torch.Tensor,
           causal: bool) -> torch.Tensor:
    """q [B, H, Q, D] over cache slots ``[0, n_keys)`` of k/v [B, H, S, D] (``n_keys`` [1] int64 on the
    device); ``causal``: query i sees keys up to ``n_keys - Q + i``. -> [B, H, Q, D] (a transposed view
    of flash-attn's contiguous [B, Q, H, D]). Through the ``vvs::flash_attend`` custom op: flash-attn's
    own function is not one, and torch.compile would break the graph at it."""
    return flash_attend(q, k_cache, v_cache, n_keys, causal)


@torch.library.custom_op("vvs::flash_attend", mutates_args=())
def flash_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_keys: torch.Tensor,
                 causal: bool) -> torch.Tensor:
    B = q.shape[0]
    seqlens = n_keys.to(torch.int32).expand(B).contiguous()
    out = kvcache_fn()(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                       cache_seqlens=seqlens, causal=causal)
    return out.transpose(1, 2)  # no copy: the fake below promises these strides


@flash_attend.register_fake
def _(q, k_cache, v_cache, n_keys, causal):
    B, H, Q, D = q.shape
    return q.new_empty((B, Q, H, D)).transpose(1, 2)  # flash-attn's [B, Q, H, D], seen as [B, H, Q, D]


def describe(device, dtype, head_dim: int, padded_condition: bool) -> dict:
    """Attention backend per call kind, for ``stats["attention_backend"]``."""
    from .backends import choose

    device = torch.device(device)
    flash = usable(device, dtype, head_dim)
    tree = choose("tree_attention", device)
    return {"prefill": "flash_attn" if flash and not padded_condition else "sdpa",
            "ar_decode": "flash_attn" if flash and not padded_condition else f"tree_attention:{tree}",
            "tree_verify": f"tree_attention:{tree}"}
