"""flash-attn dispatch: prefill and AR decode go to ``flash_attn_with_kvcache`` when it is usable,
tree verification keeps tree attention, and the choice is reported in ``stats["attention_backend"]``.
On the CPU availability is faked with a stand-in that follows flash-attn's documented semantics
(NHD tensors, ``cache_seqlens``, bottom-right causal); on a GPU with flash-attn the real one is
compared with the Triton path."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vvs_engine.kernels import flash
from vvs_engine.kernels import reference as R

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_models import tiny_engine  # noqa: E402


class FakeFlash:
    """flash_attn_with_kvcache's contract on the CPU, recording each call's (Q, causal)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens, causal):
        B, Q, H, D = q.shape
        self.calls.append((Q, causal))
        n = cache_seqlens.long()
        S = k_cache.shape[1]
        key = torch.arange(S)
        last = n[:, None] - Q + torch.arange(Q)[None, :]  # [B, Q]: last key each query sees
        vis = (key[None, None, :] < n[:, None, None]) & ((key[None, None, :] <= last[:, :, None]) | (not causal))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                             attn_mask=vis[:, None])
        return out.transpose(1, 2)


@pytest.fixture
def fake_flash(monkeypatch):
    fake = FakeFlash()
    monkeypatch.setattr(flash, "kvcache_fn", lambda: fake)
    monkeypatch.setattr(flash, "device_supported", lambda device, dtype, head_dim: True)
    return fake


def test_ar_uses_flash_attn_reports_it_and_matches_the_tree_attention_path(fake_flash, monkeypatch):
    eng = tiny_engine(with_vq=False)
    got = eng.generate(class_labels=[1, 3], method="ar", top_k=1, seed=0, decode_images=False)
    n_layer = eng.gpt.config.n_layer
    T = eng.tokens_per_image
    # Prefill (the 1-slot condition, causal) and every decode step (one query) in every layer.
    assert fake_flash.calls.count((1, True)) == n_layer
    # every decode round (T - 1 tokens, plus the round the loop runs before its one-round-late read shows
    # the images finished) in every layer
    assert got.stats["batch_rounds"] == T
    assert fake_flash.calls.count((1, False)) == got.stats["batch_rounds"] * n_layer
    assert got.stats["attention_backend"] == {"prefill": "flash_attn", "ar_decode": "flash_attn",
                                              "tree_verify": "tree_attention:reference"}
    monkeypatch.setenv(flash.ENV, "0")
    fake_flash.calls.clear()
    want = eng.generate(class_labels=[1, 3], method="ar", top_k=1, seed=0, decode_images=False)
    assert fake_flash.calls == []
    assert want.stats["attention_backend"]["ar_decode"] == "tree_attention:reference"
    assert torch.equal(got.tokens, want.tokens)


def test_tree_verification_keeps_tree_attention(fake_flash):
    eng = tiny_engine(with_vq=False)
    out = eng.generate(class_labels=[2], method="eagle", top_k=1, seed=0, decode_images=False)
    # EAGLE verifies trees (Q > 1, not causal): never flash-attn there; its prefill may be.
    assert all(q == 1 for q, causal in fake_flash.calls if not causal)
    assert out.stats["attention_backend"]["tree_verify"].startswith("tree_attention")


def test_padded_condition_keeps_sdpa():
    d = flash.describe("cpu", torch.float32, 64, padded_condition=True)
    assert d["prefill"] == "sdpa" and d["ar_decode"].startswith("tree_attention")
    assert not flash.usable(torch.device("cpu"), torch.bfloat16, 64)  # flash-attn never runs on the CPU


@pytest.mark.parametrize("Q,causal", [(1, False), (7, True)])
def test_flash_attn_equals_triton_on_gpu(Q, causal):
    if not torch.cuda.is_available() or flash.kvcache_fn() is None:
        reason = "no CUDA device" if not torch.cuda.is_available() else "flash_attn does not import"
        print(f"SKIP: {reason}: flash-attn vs Triton not compared")
        pytest.skip(reason)
    from vvs_engine.kernels.backends import triton_module

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, S, D, P = 2, 20, 1032, 64, 1000
    q = torch.randn(B, Q, H, D, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, H, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    prefix = torch.tensor([P], device="cuda")
    local = torch.ones(Q, Q, dtype=torch.bool, device="cuda").tril()
    got = flash.attend(q, k, v, prefix + Q, causal=causal)
    want = triton_module().tree_attention(q, k, v, prefix, local)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), R.tree_attention(q.float(), k.float(), v.float(), prefix, local),
                               rtol=2e-2, atol=2e-2)
