"""Tiny random Hugging Face folders of the target families, built with transformers' own config and
model classes and written with ``save_pretrained`` (plus a tiny word-level tokenizer). Used by the
tests and by ``benchmarks/studies/families/families.py``; transformers is needed only here, never to decode."""
from __future__ import annotations

import os

import torch

JANUS_WORDS = ["<|", "User", "|>:", "Assistant", "a", "red", "cat", "blue", "dog", "on", "the", "grass",
               "photo", "of", "small", "house"]
JANUS_SPECIAL = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3, "<begin_of_image>": 4}
PROMPTS = ["a red cat", "a photo of the small blue dog on the grass"]


def word_tokenizer(words, special: dict):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = dict(special)
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special))
    return tok


def make_janus_folder(path: str, seed: int = 0, grid: int = 4, n_codes: int = 40, scale_head: float = 4.0):
    """A Janus folder (GQA Llama of 2 layers, dim 32; 4x4 image grid; a 40-code VQ). The generation
    head is scaled up so greedy CFG decisions have margins well above fp32 noise."""
    from transformers import (GenerationConfig, JanusConfig, JanusForConditionalGeneration, JanusVisionConfig,
                              JanusVQVAEConfig, LlamaConfig)

    torch.manual_seed(seed)
    tc = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, bos_token_id=1,
                     eos_token_id=2, pad_token_id=3)
    vc = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16 * grid,
                           patch_size=16, projection_dim=32, num_image_tokens=grid * grid)
    qc = JanusVQVAEConfig(embed_dim=4, num_embeddings=n_codes, base_channels=32, channel_multiplier=[1, 2],
                          num_res_blocks=1, latent_channels=32, projection_dim=32, image_token_embed_dim=32)
    model = JanusForConditionalGeneration(JanusConfig(text_config=tc, vision_config=vc, vq_config=qc,
                                                      image_token_id=5)).eval()
    with torch.no_grad():  # transformers' init (std 0.02) gives near-constant greedy images: widen it
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.9 / p.shape[1] ** 0.5)
        model.model.generation_head.vision_head.weight.mul_(scale_head)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                               generation_kwargs={"boi_token_id": 4})
    model.save_pretrained(path)
    word_tokenizer(JANUS_WORDS, JANUS_SPECIAL).save(os.path.join(path, "tokenizer.json"))
    return model


LUMINA_WORDS = ["Generate", "an", "image", "of", "64x64", "according", "to", "the", "following", "prompt", ":",
                "a", "red", "cat", "photo", "small", "blue", "dog", "on", "grass"]


def image_code_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def make_chameleon_folder(path: str, seed: int = 0, n_codes: int = 40, vocab: int = 8832,
                          vqgan: str | None = "vqgan.ckpt", attn_resolutions=(16,)):
    """A Lumina-mGPT-style Chameleon folder: qk-norm GQA decoder (2 layers, dim 32), 40 image codes at
    vocabulary ids 4..43, and Lumina's layout ids (BOI 8197, EOL 8803, resolution 8804 + n) in range.
    ``vqgan``: the file the VQGAN decoder is written to beside the shards (transformers' Chameleon has
    no decoder; None: none), see :func:`chameleon_vqgan_state`."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration, ChameleonVQVAEConfig

    torch.manual_seed(seed)
    vocab_map = {"<s>": 0, "<pad>": 1, "</s>": 2, "<image>": 3}
    vocab_map.update({image_code_name(i): 4 + i for i in range(n_codes)})
    qc = ChameleonVQVAEConfig(embed_dim=4, num_embeddings=n_codes, base_channels=32, channel_multiplier=[1, 2],
                              latent_channels=32, resolution=32, num_res_blocks=1,
                              attn_resolutions=list(attn_resolutions))
    cfg = ChameleonConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                          pad_token_id=1, eos_token_id=2, vq_config=qc.to_dict(), vocabulary_map=vocab_map)
    model = ChameleonForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # widen transformers' init so greedy images are not constant
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.9 / p.shape[1] ** 0.5)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    if vqgan is not None:
        sd = chameleon_vqgan_state(model.model.vqmodel, seed)
        if vqgan.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(sd, os.path.join(path, vqgan))
        else:  # Lumina-mGPT's release layout: a torch checkpoint with a "state_dict"
            torch.save({"state_dict": sd}, os.path.join(path, vqgan))
    special = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 100}
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = dict(special)
    for i, w in enumerate(LUMINA_WORDS):
        words[w] = 101 + i
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    return model


def janus_decoder_like(vq_config):
    """transformers' ``JanusVQVAEDecoder`` (a taming decoder with attention at its lowest resolution)
    shaped like a Chameleon ``vq_config``: the reference the Chameleon decoder is checked against."""
    from transformers import JanusVQVAEConfig
    from transformers.models.janus.modeling_janus import JanusVQVAEDecoder

    qc = JanusVQVAEConfig(embed_dim=vq_config.embed_dim, num_embeddings=vq_config.num_embeddings,
                          base_channels=vq_config.base_channels,
                          channel_multiplier=list(vq_config.channel_multiplier),
                          num_res_blocks=vq_config.num_res_blocks, latent_channels=vq_config.latent_channels)
    return JanusVQVAEDecoder(qc).eval()


def janus_to_taming_names(sd: dict, n_levels: int, keep_attn: bool) -> dict:
    """``JanusVQVAEDecoder`` names (``up[0]`` = lowest resolution) -> taming's (``up[level]``); the
    lowest level's attention is dropped when the Chameleon config has none there."""
    out = {}
    for k, v in sd.items():
        if k.startswith("up."):
            i, rest = k[3:].split(".", 1)
            if rest.startswith("attn.") and not keep_attn:
                continue
            k = f"up.{n_levels - 1 - int(i)}.{rest}"
        out["decoder." + k] = v
    return out


def chameleon_vqgan_state(vqmodel, seed: int = 0) -> dict:
    """A random VQGAN checkpoint for a tiny Chameleon folder, in taming names: decoder weights drawn by
    transformers' ``JanusVQVAEDecoder`` (same architecture), codebook and ``post_quant_conv`` of the
    folder's own ``ChameleonVQVAE``."""
    c = vqmodel.config
    torch.manual_seed(seed + 1)
    dec = janus_decoder_like(c)
    with torch.no_grad():  # transformers' init leaves decoder outputs near constant: widen it
        for p in dec.parameters():
            if p.dim() == 4:
                p.normal_(0.0, 1.0 / (p.shape[1] * p.shape[2] * p.shape[3]) ** 0.5)
    lowest = c.resolution // 2 ** (len(c.channel_multiplier) - 1)
    sd = janus_to_taming_names(dec.state_dict(), len(c.channel_multiplier), lowest in (c.attn_resolutions or []))
    sd.update({k: v for k, v in vqmodel.state_dict().items()
               if k.startswith(("quantize.", "post_quant_conv."))})
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


EMU3_WORDS = ["a", "red", "cat", "photo", "of", "the", "small", "blue", "dog", "on", "grass", "4", "*"]
EMU3_SPECIAL = {"<|endoftext|>": 0, "<|extra_203|>": 1, "<|extra_204|>": 2, "<|extra_200|>": 60,
                "<|image start|>": 61, "<|image token|>": 62, "<unk>": 63}


def make_emu3_folder(path: str, seed: int = 0, n_codes: int = 40):
    """An Emu3 folder: GQA Llama (2 layers, dim 32), 40 visual tokens at ids 10..49 inside a
    128-token vocabulary, Emu3's layout tokens (image start, image token, EOL ``<|extra_200|>``)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig, Emu3VQVAEConfig

    torch.manual_seed(seed)
    vocab_map = dict(EMU3_SPECIAL)
    vocab_map.update({"<|visual token %06d|>" % i: 10 + i for i in range(n_codes)})
    words = dict(EMU3_SPECIAL)
    for i, w in enumerate(EMU3_WORDS):
        words[w] = 70 + i
    vocab_map.update(words)
    qc = Emu3VQVAEConfig(codebook_size=n_codes, embed_dim=4, latent_channels=4, base_channels=32,
                         channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[1], hidden_size=64,
                         num_attention_heads=2)
    tc = Emu3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    model = Emu3ForConditionalGeneration(Emu3Config(vq_config=qc.to_dict(), text_config=tc.to_dict(),
                                                    vocabulary_map=vocab_map)).eval()
    with torch.no_grad():  # widen transformers' init so greedy images are not constant
        for p in model.model.text_model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.9 / p.shape[1] ** 0.5)
        model.lm_head.weight.normal_(0.0, 4.0 * 0.9 / model.lm_head.weight.shape[1] ** 0.5)
    model.save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([k for k in EMU3_SPECIAL if k != "<unk>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    return model
