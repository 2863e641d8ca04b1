"""Load-time fused projections (models/fused.py): one GEMM for the target's w1/w3, the drafter's q/k/v
and gate/up, and the families' q/k/v and gate/up. An unfused state dict loads and gives the logits
of the unfused modules; state dicts and saved files keep the published layout; initialisation under a
seed is the unfused one; the Zoo's checkpoints load into the fused models with their outputs
unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from vvs_engine.checkpoint import load_into, read_state_dict, save_safetensors
from vvs_engine.drafting.drafter import DraftAttention, Drafter, DrafterConfig, DraftMLP, load_drafter
from vvs_engine.errors import VVSError
from vvs_engine.models.fused import FusedLinear, fused_layers
from vvs_engine.models.gpt import GPT, FeedForward, GPTConfig, apply_rope
from vvs_engine.models.hf_decoder import DecoderAttention, DecoderConfig, DecoderMLP, apply_rope_half


# --- the unfused modules as they were, for reference ----------------------------------------------
class UnfusedSwiGLU(nn.Module):
    def __init__(self, dim, hidden, names, bias=False):
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((dim, hidden), (dim, hidden), (hidden, dim))):
            setattr(self, n, nn.Linear(i, o, bias=bias))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class UnfusedDraftAttention(nn.Module):
    """The drafter's attention without a cache (causal), q/k/v as three GEMMs."""

    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head, self.hd = n_head, dim // n_head
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, rope, kv=None, slots=None, mask=None):
        assert kv is None and mask is None
        B, T, D = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_head, self.hd), rope).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_head, self.hd), rope).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _same_outputs(a, b, *inputs, exact=True):
    """``exact``: bit for bit (one GEMM over the stacked weights rounds as the separate GEMMs at the
    shapes checked so; at odd widths the BLAS may block the wider GEMM differently: the last bit may
    change, so those compare to fp32 rounding)."""
    with torch.no_grad():
        ya, yb = a(*inputs), b(*inputs)
    if exact:
        assert torch.equal(ya, yb), (ya - yb).abs().max()
    else:
        torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)


# --- module level --------------------------------------------------------------------------------
def test_target_feed_forward_loads_unfused_weights_and_matches():
    cfg = GPTConfig(dim=40, n_layer=1, n_head=4, multiple_of=24)  # odd sizes: hidden 120
    ref = UnfusedSwiGLU(40, cfg.ffn_hidden, ("w1", "w3", "w2"))
    _randomize(ref)
    ff = FeedForward(cfg)
    assert set(ff.state_dict()) == set(ref.state_dict()) == {"w1.weight", "w3.weight", "w2.weight"}
    ff.load_state_dict(ref.state_dict(), strict=True)
    assert isinstance(ff.w13, FusedLinear) and ff.w13.weight.shape == (2 * cfg.ffn_hidden, 40)
    for k, v in ref.state_dict().items():
        assert torch.equal(ff.state_dict()[k], v), k
    _same_outputs(ff.eval(), ref.eval(), torch.randn(3, 7, 40), exact=False)


def test_drafter_mlp_and_attention_match_unfused():
    ref_mlp = UnfusedSwiGLU(32, 88, ("gate_proj", "up_proj", "down_proj"))
    _randomize(ref_mlp, 1)
    mlp = DraftMLP(32, 88)
    mlp.load_state_dict(ref_mlp.state_dict(), strict=True)
    _same_outputs(mlp, ref_mlp, torch.randn(2, 5, 32), exact=False)

    cfg = DrafterConfig(dim=32, n_head=4)
    ref_att = UnfusedDraftAttention(32, 4)
    _randomize(ref_att, 2)
    att = DraftAttention(cfg)
    assert set(att.state_dict()) == set(ref_att.state_dict())
    att.load_state_dict(ref_att.state_dict(), strict=True)
    rope = torch.randn(5, 4, 2)
    _same_outputs(att, ref_att, torch.randn(2, 5, 32), rope, exact=False)


@pytest.mark.parametrize("bias", [False, True])
def test_family_decoder_projections_match_unfused(bias):
    """Grouped-query q/k/v (k and v narrower than q), with and without biases, Chameleon's qk-norm."""
    cfg = DecoderConfig(dim=48, n_layer=1, n_head=4, n_kv_head=2, head_dim=12, ffn_hidden=72,
                        attention_bias=bias, mlp_bias=bias, qk_norm=True)
    att = DecoderAttention(cfg)
    parts = dict(q_proj=48, k_proj=24, v_proj=24)
    sd = {f"{n}.{p}": torch.randn((o, 48) if p == "weight" else (o,))
          for n, o in parts.items() for p in (("weight", "bias") if bias else ("weight",))}
    sd.update({k: v for k, v in att.state_dict().items() if k.startswith(("o_proj", "q_norm", "k_norm"))})
    assert set(att.state_dict()) == set(sd)
    att.load_state_dict(sd, strict=True)
    x, rope = torch.randn(2, 6, 48), torch.randn(6, 6, 2)
    with torch.no_grad():
        y = att(x, rope)
        # the unfused computation from the same weights
        lin = {n: F.linear(x, sd[f"{n}.weight"], sd.get(f"{n}.bias")) for n in parts}
        q = att.q_norm(lin["q_proj"].view(2, 6, 4, 12))
        k = att.k_norm(lin["k_proj"].view(2, 6, 2, 12))
        q, k = apply_rope_half(q, rope).transpose(1, 2), apply_rope_half(k, rope).transpose(1, 2)
        v = lin["v_proj"].view(2, 6, 2, 12).transpose(1, 2)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        ref = att.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 48))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)

    ref_mlp = UnfusedSwiGLU(48, 72, ("gate_proj", "up_proj", "down_proj"), bias=bias)
    _randomize(ref_mlp, 3)
    mlp = DecoderMLP(cfg)
    mlp.load_state_dict(ref_mlp.state_dict(), strict=True)
    _same_outputs(mlp, ref_mlp, torch.randn(2, 6, 48), exact=False)


def test_initialisation_is_the_unfused_one():
    """Seeded models keep their weights: nn.Linear's init and LlamaGen's normal init, part by part."""
    torch.manual_seed(5)
    fused = DraftMLP(32, 88)
    torch.manual_seed(5)
    ref = UnfusedSwiGLU(32, 88, ("gate_proj", "up_proj", "down_proj"))
    for k, v in ref.state_dict().items():
        assert torch.equal(fused.state_dict()[k], v), k
    torch.manual_seed(6)
    fl = FusedLinear(10, [("a", 7), ("b", 5)], bias=True)
    torch.manual_seed(6)
    a, b = nn.Linear(10, 7), nn.Linear(10, 5)
    assert torch.equal(fl.weight, torch.cat([a.weight, b.weight])) and torch.equal(fl.bias, torch.cat([a.bias, b.bias]))
    torch.manual_seed(7)
    fl.init_normal_(0.02)
    torch.manual_seed(7)
    w = [torch.empty(7, 10).normal_(std=0.02), torch.empty(5, 10).normal_(std=0.02)]
    assert torch.equal(fl.weight, torch.cat(w)) and not fl.bias.any()


# --- checkpoints ---------------------------------------------------------------------------------
def _tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(dim=32, n_layer=2, n_head=4, vocab_size=64, num_classes=5, block_size=16,
                         multiple_of=32)).eval()


def test_gpt_round_trip_keeps_the_llamagen_layout(tmp_path):
    src = _tiny_gpt(0)
    sd = src.state_dict()
    assert "layers.1.feed_forward.w1.weight" in sd and "layers.1.feed_forward.w3.weight" in sd
    assert not any("w13" in k for k in sd)
    path = str(tmp_path / "gpt.safetensors")
    save_safetensors(src, path, src.config.to_dict(), kind="gpt")  # parts are views: saved as their own tensors
    assert set(load_file(path)) == set(sd)
    dst = _tiny_gpt(1)
    load_into(dst, read_state_dict(path), "GPT checkpoint")
    for k, v in sd.items():
        assert torch.equal(dst.state_dict()[k], v), k
    cond, tokens = torch.tensor([1, 3]), torch.randint(0, 64, (2, 16))
    _same_outputs(lambda c, t: dst(c, t), lambda c, t: src(c, t), cond, tokens)


def test_mis_shaped_part_is_a_one_line_error():
    sd = _tiny_gpt(0).state_dict()
    sd["layers.0.feed_forward.w3.weight"] = torch.zeros(3, 32)
    with pytest.raises(VVSError, match=r"shape mismatch: layers\.0\.feed_forward\.w3\.weight \(3, 32\)"):
        load_into(_tiny_gpt(1), sd, "GPT checkpoint")
    del sd["layers.0.feed_forward.w3.weight"]
    with pytest.raises(VVSError, match=r"missing keys layers\.0\.feed_forward\.w3\.weight"):
        load_into(_tiny_gpt(1), sd, "GPT checkpoint")


def test_drafter_save_and_load_round_trip(tmp_path):
    g = _tiny_gpt(0)
    torch.manual_seed(2)
    d = Drafter(DrafterConfig(dim=32, n_head=4, n_layer=2)).attach(g).eval()
    path = str(tmp_path / "drafter.safetensors")
    save_safetensors(d, path, d.config.to_dict(), kind="drafter")
    keys = set(load_file(path))
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight"} <= keys
    assert not any("qkv_proj" in k or "gate_up" in k for k in keys)
    back = load_drafter(path, g)
    x, tok = torch.randn(2, 5, 32), torch.randint(0, 64, (2, 5))
    _same_outputs(lambda f, t: back(f, t, torch.arange(5)), lambda f, t: d(f, t, torch.arange(5)), x, tok)


def test_zoo_outputs_equal_the_unfused_modules():
    """The shipped Zoo target and drafter: fused outputs equal those of the unfused modules loaded from
    the same files (teacher-forced logits of the target, drafter features)."""
    from vvs_engine.zoo import default_paths
    from vvs_engine.engine import load_gpt

    paths = default_paths()
    gpt = load_gpt(paths["gpt"], None, None, None)
    assert len(fused_layers(gpt)) == gpt.config.n_layer
    ref = copy.deepcopy(gpt)
    for layer in ref.layers:
        ff = UnfusedSwiGLU(gpt.config.dim, gpt.config.ffn_hidden, ("w1", "w3", "w2"))
        ff.load_state_dict(layer.feed_forward.state_dict(), strict=True)
        layer.feed_forward = ff
    file_sd = read_state_dict(paths["gpt"])
    assert set(gpt.state_dict()) == set(file_sd)
    cond, tokens = torch.tensor([0, 5, 16]), torch.randint(0, gpt.config.vocab_size, (3, 40))
    _same_outputs(lambda c, t: gpt(c, t), lambda c, t: ref(c, t), cond, tokens)

    d = load_drafter(paths["drafter"], gpt)
    assert set(d.state_dict()) == set(read_state_dict(paths["drafter"])) - {"embed_tokens.weight"}
    ref_d = copy.deepcopy(d).attach(gpt)
    for layer in ref_d.layers:
        mlp = UnfusedSwiGLU(d.config.dim, layer.mlp.down_proj.in_features, ("gate_proj", "up_proj", "down_proj"))
        mlp.load_state_dict(layer.mlp.state_dict(), strict=True)
        layer.mlp = mlp
        att = UnfusedDraftAttention(d.config.dim, d.config.n_head)
        att.load_state_dict(layer.self_attn.state_dict(), strict=True)
        layer.self_attn = att
    feats = torch.randn(3, 9, d.config.dim)
    toks = torch.randint(0, gpt.config.vocab_size, (3, 9))
    pos = torch.arange(9)
    with torch.no_grad():
        assert torch.equal(d(feats, toks, pos), ref_d(feats, toks, pos))
