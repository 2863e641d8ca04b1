"""The target model: KV-cached incremental decoding equals a full-sequence forward, attention against a
float64 reference, and LlamaGen's 2-D RoPE layout (zero rows for the condition positions)."""
import math

import pytest
import torch

from vvs_engine import Engine
from vvs_engine.runtime.masks import causal_local
from vvs_engine.models.gpt import GPT, GPTConfig, apply_rope, gpt_config, rope_table_2d
from vvs_engine.runtime.target import TargetSession


def tiny_config(**kw) -> GPTConfig:
    base = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=96, num_classes=10, block_size=16)
    base.update(kw)
    return GPTConfig(**base)


@pytest.fixture(scope="module")
def c2i():
    torch.manual_seed(0)
    return GPT(tiny_config()).eval()


@pytest.fixture(scope="module")
def t2i():
    torch.manual_seed(1)
    return GPT(tiny_config(model_type="t2i", cls_token_num=6, caption_dim=24)).eval()


# --- incremental decoding == full forward ----------------------------------------------------------
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_score_matches_greedy_generation(c2i, cfg_scale):
    """Greedy tokens are the argmax of the teacher-forced (CFG-combined) logits of the same tokens."""
    eng = Engine(c2i)
    out = eng.generate(class_labels=[1, 7, 7], temperature=0, cfg_scale=cfg_scale)
    logits = eng.score(class_labels=[1, 7, 7], tokens=out.tokens, cfg_scale=cfg_scale)
    assert logits.shape == (3, 16, 96)
    assert torch.equal(logits.argmax(-1), out.tokens)


def _incremental_logits(model, cond, tokens, chunk: int, key_mask=None):
    """Prefill, then feed ``tokens`` [B, T] through the static KV cache ``chunk`` at a time; returns
    the per-position logits [B, T, V] (position t predicts token t)."""
    B, T = tokens.shape
    s = TargetSession(model, cond, B, use_cfg=False, cond_key_mask=key_mask)
    h = s.prefill()  # features of the condition positions; the last one predicts image token 0
    out = [s.logits(h[:, -1] if h.dim() == 3 else h)[:, None]]
    pos = torch.full((1,), s.c, dtype=torch.long)
    for start in range(0, T - 1, chunk):
        q = min(chunk, T - 1 - start)
        positions = s.c + start + torch.arange(q)
        h = s.forward(tokens[:, start:start + q], positions, pos, causal_local(q, "cpu"))
        out.append(s.logits(h))
        pos += q
    return torch.cat(out, 1)


@pytest.mark.parametrize("chunk", [1, 3])
def test_kv_cached_decoding_equals_full_forward_c2i(c2i, chunk):
    torch.manual_seed(2)
    cond = torch.tensor([0, 4, c2i.null_class])
    tokens = torch.randint(0, 96, (3, 16))
    with torch.inference_mode():
        full = c2i(cond, tokens)
        inc = _incremental_logits(c2i, cond, tokens, chunk)
    assert full.shape == inc.shape == (3, 16, 96)
    torch.testing.assert_close(inc, full, atol=2e-5, rtol=1e-4)


def test_kv_cached_decoding_equals_full_forward_t2i_with_padding(t2i):
    """Left-padded captions: padded condition slots are hidden from every query (except themselves)."""
    torch.manual_seed(3)
    cap = torch.randn(2, 6, 24)
    mask = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    cap = cap * mask[..., None]
    tokens = torch.randint(0, 96, (2, 16))
    with torch.inference_mode():
        inc = _incremental_logits(t2i, cap, tokens, chunk=2, key_mask=mask)
        eng = Engine(t2i)
        # Engine.score builds the same padded-caption mask for a full-sequence forward.
        x = torch.cat([t2i.embed_condition(cap), t2i.embed_tokens(tokens[:, :-1])], 1)
        L = x.shape[1]
        vis = torch.ones(L, L, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
        vis[:, :, :6] &= mask[:, None, :]
        vis |= torch.eye(L, dtype=torch.bool)[None]
        full = t2i.logits(t2i.forward_hidden(x, torch.arange(L), mask=vis[:, None])[:, 5:])
    torch.testing.assert_close(inc, full, atol=2e-5, rtol=1e-4)
    assert eng.tokens_per_image == 16


# --- attention against a float64 reference ---------------------------------------------------------
def naive_attention_block(attn, x, rope, visible):
    """Float64 re-derivation of one LlamaGen attention layer: fused qkv, RoPE on adjacent pairs,
    softmax(q k^T / sqrt(d)) over visible keys, output projection."""
    B, T, D = x.shape
    H, hd = attn.n_head, attn.head_dim
    W = attn.wqkv.weight.double()
    qkv = x.double() @ W.t()
    q, k, v = qkv.split(D, -1)

    def rot(t):
        t = t.view(B, T, H, hd // 2, 2)
        c, s = rope.double()[None, :, None, :, 0], rope.double()[None, :, None, :, 1]
        return torch.stack([t[..., 0] * c - t[..., 1] * s, t[..., 1] * c + t[..., 0] * s], -1).view(B, T, H, hd)

    q, k = rot(q).transpose(1, 2), rot(k).transpose(1, 2)
    v = v.view(B, T, H, hd).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(~visible, float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(B, T, D) @ attn.wo.weight.double().t()


def test_attention_matches_float64_reference(c2i):
    torch.manual_seed(4)
    attn = c2i.layers[0].attention
    T = 9
    x = torch.randn(2, T, 64)
    rope = c2i.rope[:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.inference_mode():
        got = attn(x, rope)  # causal, no cache
        # Same layer through the static cache with an explicit mask (the decoding path).
        k_cache = torch.zeros(2, 4, 16, 16)
        v_cache = torch.zeros(2, 4, 16, 16)
        vis = torch.zeros(T, 16, dtype=torch.bool)
        vis[:, :T] = causal
        cached = attn(x, rope, (k_cache, v_cache), torch.arange(T), vis[None, None])
    ref = naive_attention_block(attn, x, rope, causal)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached.double(), ref, atol=1e-5, rtol=1e-5)


# --- 2-D RoPE --------------------------------------------------------------------------------------
def test_rope_table_layout():
    grid, hd, base, cls = 4, 16, 10000.0, 3
    table = rope_table_2d(grid, hd, base, cls)
    assert table.shape == (cls + grid * grid, hd // 2, 2)
    assert torch.count_nonzero(table[:cls]) == 0  # condition rows are all zero, not the identity
    quarter = hd // 4
    freqs = 1.0 / (base ** (torch.arange(0, hd // 2, 2, dtype=torch.float64) / (hd // 2)))
    for r in range(grid):
        for c in range(grid):
            row = table[cls + r * grid + c].double()  # row-major flattening of the grid
            angles = torch.cat([r * freqs, c * freqs])  # first half: row index; second half: column index
            assert freqs.numel() == quarter
            torch.testing.assert_close(row[:, 0], torch.cos(angles), atol=1e-6, rtol=0)
            torch.testing.assert_close(row[:, 1], torch.sin(angles), atol=1e-6, rtol=0)


def test_rope_grid_scale_interpolates_positions():
    """rope_grid_scale 0.5 on a 2g x 2g grid: cell (2r, 2c) gets the angles of cell (r, c) on the g x g
    grid at scale 1, and the odd cells fall between them; scale 1 is the default table."""
    grid, hd, base, cls = 4, 16, 10000.0, 1
    small = rope_table_2d(grid, hd, base, cls)
    big = rope_table_2d(2 * grid, hd, base, cls, grid_scale=0.5)
    for r in range(grid):
        for c in range(grid):
            torch.testing.assert_close(big[cls + 2 * r * 2 * grid + 2 * c], small[cls + r * grid + c])
    assert not torch.allclose(big[cls + 1], small[cls + 1])  # (0, 1) is half a step, not (0, 1)
    assert torch.equal(rope_table_2d(2 * grid, hd, base, cls, 1.0), rope_table_2d(2 * grid, hd, base, cls))
    cfg = GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=16, num_classes=2, block_size=64, rope_grid_scale=0.5)
    assert torch.equal(GPT(cfg).rope, big)  # the model builds its table from the config (head width 16)


def test_rope_zeroes_q_and_k_at_condition_positions(t2i):
    table = t2i.rope
    assert table.shape[0] == 6 + 16 and table.dtype == torch.float32
    x = torch.randn(1, table.shape[0], 4, 16)
    y = apply_rope(x, table)
    assert torch.count_nonzero(y[:, :6]) == 0
    # Image positions are rotations: norms are preserved.
    torch.testing.assert_close(y[:, 6:].norm(dim=-1), x[:, 6:].norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_rope_stays_fp32_when_the_model_is_cast(c2i):
    m = GPT(tiny_config()).to(torch.bfloat16)
    assert m.rope.dtype == torch.float32
    assert m.tok_embeddings.weight.dtype == torch.bfloat16


def test_rope_stays_on_the_model_device_through_a_dtype_cast():
    """``model.to(device)`` then ``.to(dtype)`` (as the benchmarks do on CUDA): the dtype-only cast must not
    move the table back to the CPU. The meta device stands in for CUDA."""
    m = GPT(tiny_config()).to("meta").to(torch.bfloat16)
    assert m.rope.device.type == "meta" and m.rope.dtype == torch.float32
    with torch.device("meta"):
        m = GPT(tiny_config())
    assert m.half().rope.device.type == "meta"
    assert GPT(tiny_config()).to("meta").rope.device.type == "meta"  # a device move still moves it


def test_published_presets():
    """Published LlamaGen sizes (layers, heads, dim, FFN hidden) and the t2i condition length."""
    expect = {"GPT-B": (12, 12, 768, 2048), "GPT-L": (24, 16, 1024, 2816), "GPT-XL": (36, 20, 1280, 3584),
              "GPT-XXL": (48, 24, 1536, 4096), "GPT-3B": (24, 32, 3200, 8704)}
    for name, (L, H, D, F_) in expect.items():
        cfg = gpt_config(name)
        assert (cfg.n_layer, cfg.n_head, cfg.dim, cfg.ffn_hidden) == (L, H, D, F_), name
    assert gpt_config("GPT-XL", model_type="t2i").cls_token_num == 120
    with torch.device("meta"):
        assert abs(GPT(gpt_config("GPT-B")).num_params() - 110.9e6) < 0.1e6


def test_apply_rope_is_the_pairwise_rotation():
    from vvs_engine.models.gpt import apply_rope

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen)
    angle = torch.randn(2, 5, 4, generator=gen)
    rope = torch.stack([angle.cos(), angle.sin()], -1)  # [B, T, hd/2, 2]
    pairs = x.reshape(2, 5, 3, 4, 2)
    c, s = angle.cos()[:, :, None], angle.sin()[:, :, None]
    want = torch.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 1] * c + pairs[..., 0] * s], -1).flatten(3)
    torch.testing.assert_close(apply_rope(x, rope), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(x, rope[0]), apply_rope(x, rope[:1].expand(2, 5, 4, 2)), rtol=0, atol=0)
    half = apply_rope(x.bfloat16(), rope)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=2e-2, atol=2e-2)
