"""EAGLE drafter: LANTERN's released format loads; training reduces the loss; CFG rows are used."""
from __future__ import annotations

import json

import pytest
import torch

from spec_models import tiny_engine
from vvs_engine.drafting.drafter import Drafter, DrafterConfig, load_drafter
from vvs_engine.training.drafter import train_drafter
from vvs_engine.errors import VVSError


def _lantern_state_dict(dim, n_layer, hidden, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02
    sd = {"embed_tokens.weight": r(vocab, dim), "fc.weight": r(dim, 2 * dim), "fc.bias": r(dim)}
    for i in range(n_layer):
        p = f"layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = r(dim, dim)
        sd[p + "mlp.gate_proj.weight"] = r(hidden, dim)
        sd[p + "mlp.up_proj.weight"] = r(hidden, dim)
        sd[p + "mlp.down_proj.weight"] = r(dim, hidden)
        if i:
            sd[p + "input_layernorm.weight"] = torch.ones(dim)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(dim)
    return sd


@pytest.mark.parametrize("n_layer", [1, 2])
def test_loads_lantern_format(tmp_path, n_layer):
    eng = tiny_engine(vocab=64, block=16, dtype=torch.float32)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
           "num_hidden_layers": n_layer, "intermediate_size": 96, "rms_norm_eps": 1e-6, "vocab_size": 64,
           "hidden_act": "silu", "input_type": "c2i"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = _lantern_state_dict(32, n_layer, 96, 64)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    d = load_drafter(str(tmp_path), eng.gpt)
    assert torch.equal(d.fc.weight, sd["fc.weight"])
    assert torch.equal(d.layers[0].mlp.down_proj.weight, sd["layers.0.mlp.down_proj.weight"])
    assert not hasattr(d.layers[0], "input_layernorm")  # EAGLE's first layer has no input norm
    eng.drafter = d
    out = eng.generate(class_labels=[1], method="eagle", temperature=0, cfg_scale=2.0, decode_images=False)
    assert out.tokens.shape == (1, 16)


def test_lantern_format_errors(tmp_path):
    eng = tiny_engine(vocab=64, block=16, dtype=torch.float32)
    torch.save(_lantern_state_dict(32, 1, 96, 64), tmp_path / "pytorch_model.bin")
    with pytest.raises(VVSError, match="no config"):
        load_drafter(str(tmp_path), eng.gpt)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 48, "num_attention_heads": 4,
                                                      "num_hidden_layers": 1, "intermediate_size": 96}))
    with pytest.raises(VVSError):
        load_drafter(str(tmp_path), eng.gpt)  # width does not match the target


def test_training_reduces_loss():
    eng = tiny_engine(vocab=32, block=16, dtype=torch.float32, peak=4.0)
    g = torch.Generator().manual_seed(0)
    # Structured data the target can't know but the drafter can learn: repeated tokens.
    base = torch.randint(0, 32, (64, 4), generator=g)
    tokens = base.repeat_interleave(4, dim=1)
    labels = torch.randint(0, 5, (64,), generator=g)
    logs = []
    d = train_drafter(eng.gpt, tokens, labels, steps=60, batch_size=8, lr=3e-3, seed=0, log=logs.append,
                      progress=False)
    losses = [float(line.split("loss ")[1].split()[0]) for line in logs if " loss " in line]
    assert len(losses) == 10  # one line per tenth of the run (the time-estimate line has no loss)
    first, last = losses[0], losses[-1]
    assert last < first
    assert isinstance(d, Drafter) and d.target is eng.gpt


def test_batched_tree_structure_matches_the_per_tree_reference():
    # The batched structure (parent-link hops) against kernels.reference.tree_meta, tree by tree,
    # on random trees: wide, deep, and deeper than max_depth (truncated ancestor sets).
    from vvs_engine.drafting.tree import tree_structure
    from vvs_engine.kernels.reference import tree_meta

    gen = torch.Generator().manual_seed(5)
    for B, N, max_depth, max_children in [(3, 17, 4, 3), (2, 59, 5, 10), (1, 1, 2, 2), (2, 12, 2, 4)]:
        parents = torch.full((B, N), -1, dtype=torch.long)
        for i in range(1, N):
            parents[:, i] = torch.randint(max(0, i - 4), i, (B,), generator=gen)
        mask, depth, paths, leaf, children = tree_structure(parents, max_depth, max_children)
        for b in range(B):
            want = tree_meta(parents[b], max_depth)
            for got, ref in zip((mask[b], depth[b], paths[b], leaf[b]), want):
                assert torch.equal(got, ref)
            for p in range(N):
                kids = [i for i in range(N) if parents[b, i] == p][:max_children]
                assert children[b, p].tolist() == kids + [-1] * (max_children - len(kids))


def test_static_layout_levels_are_contiguous_ranges():
    from vvs_engine.drafting.tree import STATIC_TREES, static_layout

    for make in STATIC_TREES.values():
        layout = static_layout(make(), "cpu")
        assert [list(range(a, b)) for a, b in layout["level_ranges"]] == [lvl.tolist() for lvl in layout["by_level"]]
