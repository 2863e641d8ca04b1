"""Checkpoint loading: official LlamaGen key names and containers (c2i, t2i, VQ), the project's
safetensors format, the pickle safety policy, and strict key/shape checking with named keys."""
import argparse
import os

import pytest
import torch
from safetensors.torch import save_file

from vvs_engine import VVSError
from vvs_engine.checkpoint import load_into, read_state_dict, save_safetensors
from vvs_engine.engine import load_gpt, load_vq
from vvs_engine.models.gpt import GPT, GPTConfig, gpt_config
from vvs_engine.models.vq import VQConfig, VQModel


def tiny(model_type="c2i", **kw) -> GPTConfig:
    base = dict(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=64, num_classes=10, block_size=16,
                model_type=model_type)
    if model_type == "t2i":
        base.update(cls_token_num=5, caption_dim=12)
    base.update(kw)
    return GPTConfig(**base)


def tiny_vq() -> VQConfig:
    return VQConfig(codebook_size=64, codebook_embed_dim=8, encoder_ch_mult=[1, 1], decoder_ch_mult=[1, 1],
                    z_channels=32, base_channels=32, num_res_blocks=1)


def official_gpt_keys(cfg: GPTConfig):
    """LlamaGen's state_dict keys for a config (reference: autoregressive/models/gpt.py)."""
    keys = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    if cfg.model_type == "c2i":
        keys.add("cls_embedding.embedding_table.weight")
    else:
        keys |= {"cls_embedding.cap_proj.fc1.weight", "cls_embedding.cap_proj.fc2.weight",
                 "cls_embedding.uncond_embedding"}
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        keys |= {p + "attention.wqkv.weight", p + "attention.wo.weight", p + "feed_forward.w1.weight",
                 p + "feed_forward.w2.weight", p + "feed_forward.w3.weight", p + "attention_norm.weight",
                 p + "ffn_norm.weight"}
    return keys


def randomized(model: torch.nn.Module) -> dict:
    """A state_dict with every entry random, so a round trip cannot pass by matching a fresh init."""
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in model.state_dict().items()}


def save_like_llamagen(sd, path, container="model"):
    args = argparse.Namespace(gpt_model="GPT-B", image_size=256, vocab_size=16384, cls_token_num=1)
    if container == "raw":
        torch.save(sd, path)
    else:
        torch.save({container: sd, "optimizer": {}, "steps": 1, "args": args}, path)


# --- official keys and shapes --------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_official_key_names_and_shapes(model_type):
    cfg = tiny(model_type)
    sd = GPT(cfg).state_dict()
    assert set(sd) == official_gpt_keys(cfg)
    D, C = cfg.dim, cfg.caption_dim
    assert sd["tok_embeddings.weight"].shape == (cfg.vocab_size, D)
    assert sd["layers.0.attention.wqkv.weight"].shape == (3 * D, D)
    assert sd["layers.0.feed_forward.w1.weight"].shape == (cfg.ffn_hidden, D)
    assert sd["layers.0.feed_forward.w2.weight"].shape == (D, cfg.ffn_hidden)
    assert sd["output.weight"].shape == (cfg.vocab_size, D)
    if model_type == "c2i":
        assert sd["cls_embedding.embedding_table.weight"].shape == (cfg.num_classes + 1, D)  # + null class
    else:
        assert sd["cls_embedding.cap_proj.fc1.weight"].shape == (D, C)
        assert sd["cls_embedding.cap_proj.fc2.weight"].shape == (D, D)
        assert sd["cls_embedding.uncond_embedding"].shape == (cfg.cls_token_num, C)


def test_vq_official_keys():
    keys = set(VQModel(tiny_vq()).state_dict())
    for k in ("quantize.embedding.weight", "quantize.codebook_used", "quant_conv.weight", "post_quant_conv.weight",
              "encoder.conv_in.weight", "encoder.conv_blocks.0.res.0.conv1.weight", "encoder.mid.1.q.weight",
              "encoder.conv_blocks.0.downsample.conv.weight", "decoder.conv_blocks.0.upsample.conv.weight",
              "decoder.conv_out.weight", "decoder.norm_out.weight"):
        assert k in keys, k


# --- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
@pytest.mark.parametrize("container", ["model", "module", "state_dict", "raw", "safetensors"])
def test_gpt_round_trip(tmp_path, model_type, container):
    cfg = tiny(model_type)
    src = GPT(cfg)
    sd = randomized(src)
    src.load_state_dict(sd)
    if container == "safetensors":
        path = str(tmp_path / "gpt.safetensors")
        save_file(sd, path)
    else:
        path = str(tmp_path / "gpt.pt")
        save_like_llamagen(sd, path, container)
    dst = GPT(cfg)
    load_into(dst, read_state_dict(path), "GPT checkpoint")
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    if model_type == "t2i":  # the learned null caption is a buffer and must travel with the weights
        assert torch.equal(dst.cls_embedding.uncond_embedding, sd["cls_embedding.uncond_embedding"])
    cond = torch.tensor([1, 2]) if model_type == "c2i" else torch.randn(2, cfg.cls_token_num, cfg.caption_dim)
    toks = torch.randint(0, 64, (2, 16))
    with torch.inference_mode():
        torch.testing.assert_close(dst(cond, toks), src(cond, toks), atol=0, rtol=0)


def test_project_format_round_trip_through_engine_loader(tmp_path):
    for model_type in ("c2i", "t2i"):
        cfg = tiny(model_type)
        src = GPT(cfg)
        src.load_state_dict(randomized(src))
        path = str(tmp_path / f"{model_type}.safetensors")
        save_safetensors(src, path, cfg.to_dict(), kind="gpt")
        assert os.path.exists(str(tmp_path / f"{model_type}.json"))
        dst = load_gpt(path, None, None, None)
        assert dst.config == cfg
        for k, v in src.state_dict().items():
            assert torch.equal(dst.state_dict()[k], v), k


@pytest.mark.parametrize("with_usage", [True, False])
def test_vq_round_trip_official_container(tmp_path, with_usage):
    src = VQModel(tiny_vq())
    sd = randomized(src)
    if not with_usage:
        del sd["quantize.codebook_used"]  # older tokenizer files do not carry it
    path = str(tmp_path / "vq.pt")
    torch.save({"model": sd, "optimizer": {}, "discriminator": {}, "steps": 7,
                "args": argparse.Namespace(vq_model="VQ-16")}, path)
    dst = VQModel(tiny_vq())
    load_into(dst, read_state_dict(path), "VQ checkpoint", optional=("quantize.codebook_used",))
    for k, v in sd.items():
        assert torch.equal(dst.state_dict()[k], v), k
    # The project's format carries its config, so any VQ size loads by path alone.
    st = str(tmp_path / "vq.safetensors")
    save_safetensors(dst, st, dst.config.to_dict(), kind="vq")
    again = load_vq(st)
    assert again.config == dst.config
    codes = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(again.decode(codes), dst.decode(codes))


def test_official_gpt_b_through_engine_loader(tmp_path):
    """A GPT-B-shaped official c2i file: architecture from the preset, classes and vocab from the weights."""
    cfg = gpt_config("GPT-B", num_classes=1000, vocab_size=16384)
    src = GPT(cfg)
    path = str(tmp_path / "c2i_B_256.pt")
    save_like_llamagen(src.state_dict(), path)
    dst = load_gpt(path, "GPT-B", 256, None)
    assert dst.config.block_size == 256 and dst.config.num_classes == 1000 and dst.config.n_layer == 12
    assert torch.equal(dst.layers[11].feed_forward.w2.weight, src.layers[11].feed_forward.w2.weight)


def test_ignored_cache_buffers_and_prefixes(tmp_path):
    cfg = tiny()
    src = GPT(cfg)
    sd = {("_orig_mod." + k): v for k, v in src.state_dict().items()}  # saved from a torch.compile'd model
    sd["layers.0.attention.kv_cache.k_cache"] = torch.zeros(1, 2, 24, 16)  # saved after setup_caches()
    sd["freqs_cis"] = torch.zeros(17, 8, 2)
    path = str(tmp_path / "gpt.pt")
    torch.save({"model": sd}, path)
    dst = GPT(cfg)
    load_into(dst, read_state_dict(path), "GPT checkpoint")
    assert torch.equal(dst.output.weight, src.output.weight)


# --- safety: never unpickle arbitrary code --------------------------------------------------------
class Payload:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class PlainObject:
    pass


def test_arbitrary_classes_are_refused(tmp_path):
    marker = str(tmp_path / "pwned")
    evil = str(tmp_path / "evil.pt")
    torch.save({"model": {"w": torch.zeros(2)}, "payload": Payload(marker)}, evil)
    with pytest.raises(VVSError, match="refused to unpickle .* as unsafe"):
        read_state_dict(evil)
    assert not os.path.exists(marker)

    odd = str(tmp_path / "odd.pt")
    torch.save({"model": {"w": torch.zeros(2)}, "extra": PlainObject()}, odd)
    with pytest.raises(VVSError, match="refused to unpickle .* as unsafe"):
        read_state_dict(odd)


# --- strict loading: named keys, shapes, unreadable files -----------------------------------------
def test_missing_unexpected_and_mismatched_keys_are_named():
    cfg = tiny()
    sd = GPT(cfg).state_dict()
    missing = {k: v for k, v in sd.items() if k != "layers.1.ffn_norm.weight"}
    with pytest.raises(VVSError, match=r"missing keys layers\.1\.ffn_norm\.weight"):
        load_into(GPT(cfg), missing, "GPT checkpoint x.pt")
    extra = dict(sd, **{"layers.9.attention.wqkv.weight": torch.zeros(3)})
    with pytest.raises(VVSError, match=r"unexpected keys layers\.9\.attention\.wqkv\.weight"):
        load_into(GPT(cfg), extra, "GPT checkpoint x.pt")
    bad = dict(sd, **{"tok_embeddings.weight": torch.zeros(65, 32)})
    with pytest.raises(VVSError, match=r"shape mismatch: tok_embeddings\.weight \(65, 32\) vs expected \(64, 32\)"):
        load_into(GPT(cfg), bad, "GPT checkpoint x.pt")


def test_t2i_file_into_c2i_model_names_keys():
    t2i_sd = GPT(tiny("t2i")).state_dict()
    with pytest.raises(VVSError, match=r"missing keys cls_embedding\.embedding_table\.weight"):
        load_into(GPT(tiny("c2i")), t2i_sd, "GPT checkpoint")


def test_unreadable_files(tmp_path):
    cases = {}
    cases["empty.pt"] = b""
    cases["text.pt"] = b"hello, I am not a checkpoint\n"
    cases["random.bin"] = os.urandom(4096)
    cases["bad.safetensors"] = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(VVSError) as e:
            read_state_dict(str(p))
        assert "\n" not in str(e.value)
    good = tmp_path / "good.pt"
    torch.save({"model": GPT(tiny()).state_dict()}, str(good))
    raw = good.read_bytes()
    for cut in (10, len(raw) // 3, len(raw) - 100):
        p = tmp_path / f"cut{cut}.pt"
        p.write_bytes(raw[:cut])
        with pytest.raises(VVSError):
            read_state_dict(str(p))
    with pytest.raises(VVSError, match="not found"):
        read_state_dict(str(tmp_path / "missing.pt"))
    with pytest.raises(VVSError, match="directory"):
        read_state_dict(str(tmp_path))
    torch.save([torch.zeros(1)], str(tmp_path / "list.pt"))
    with pytest.raises(VVSError, match="no state_dict"):
        read_state_dict(str(tmp_path / "list.pt"))
