"""Load a target family from a local Hugging Face folder (config.json, safetensors shards, tokenizer).

``config.json``'s ``model_type`` picks the family. Weights are read with safetensors only (single
``model.safetensors`` or the shards named by ``model.safetensors.index.json``); nothing is downloaded.
Every problem is a one-line :class:`~vvs_engine.errors.VVSError`.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Tuple

import torch

from ..checkpoint import load_into
from ..errors import VVSError
from .hf_decoder import DecoderConfig

SUPPORTED_FAMILIES = ("janus", "chameleon", "emu3")
CHAMELEON_PATCH_PX = 16  # pixels per VQ code
LUMINA_PATCH_PX = 32  # Lumina-mGPT's patch: 2x2 codes; its resolution tokens count these
CHAMELEON_DEFAULT_IMAGE_PX = 768  # Lumina-mGPT-7B-768
EMU3_PATCH_PX = 8
EMU3_DEFAULT_IMAGE_PX = 720  # Emu3-Gen: 90 x 90 tokens
DEFAULT_MAX_PROMPT_TOKENS = 128


def read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise VVSError(f"{what} not found: {path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise VVSError(f"unreadable {what} {path}: {str(e).splitlines()[0]}") from None


def read_folder_config(model_dir: str) -> dict:
    if not model_dir or not os.path.isdir(model_dir):
        raise VVSError(f"model folder not found: {model_dir}")
    return read_json(os.path.join(model_dir, "config.json"), "config.json")


def read_weights(model_dir: str, prefixes: Tuple[str, ...] | None = None) -> Dict[str, torch.Tensor]:
    """The tensors of the folder's safetensors (sharded or not), in their stored dtype; ``prefixes``:
    only the tensors whose names start with one of them."""
    from safetensors import SafetensorError, safe_open

    def load_file(path):
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if prefixes is None or k.startswith(prefixes)}

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise VVSError(f"shard index {index} has no weight_map")
        shards = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise VVSError(f"no safetensors weights in {model_dir} (expected model.safetensors or "
                       f"model.safetensors.index.json)")
    missing = [s for s in shards if not os.path.exists(os.path.join(model_dir, s))]
    if missing:
        raise VVSError(f"missing weight shard(s) in {model_dir}: {', '.join(missing[:3])}"
                       f"{' ...' if len(missing) > 3 else ''}")
    sd = {}
    for s in shards:
        try:
            sd.update(load_file(os.path.join(model_dir, s)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise VVSError(f"not a readable safetensors shard: {s} ({str(e).splitlines()[0]})") from None
    return sd


def llama_decoder_config(tc: dict, what: str) -> DecoderConfig:
    """transformers' Llama config fields -> :class:`DecoderConfig` (default RoPE only)."""
    try:
        dim, n_head = int(tc["hidden_size"]), int(tc["num_attention_heads"])
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise VVSError(f"{what}: RoPE type '{rope_type}' is not supported (default RoPE only)")
        base = rope.get("rope_theta", tc.get("rope_theta", 10000.0))
        return DecoderConfig(dim=dim, n_layer=int(tc["num_hidden_layers"]), n_head=n_head,
                             n_kv_head=int(tc.get("num_key_value_heads") or n_head),
                             head_dim=int(tc.get("head_dim") or dim // n_head),
                             ffn_hidden=int(tc["intermediate_size"]), norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
                             rope_base=float(base), attention_bias=bool(tc.get("attention_bias", False)),
                             mlp_bias=bool(tc.get("mlp_bias", False)))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, VVSError):
            raise
        raise VVSError(f"{what}: not a Llama config ({type(e).__name__}: {e})") from None


def load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers package raises its own exception types
        raise VVSError(f"unreadable tokenizer.json in {model_dir}: {str(e).splitlines()[0]}") from None


def load_hf_folder(model_dir: str, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                   image_size: int | None = None) -> Tuple[torch.nn.Module, torch.nn.Module, dict]:
    """-> (target, image decoder, info) in fp32 on the CPU; the engine moves them afterwards.
    ``image_size`` (pixels; Lumina-mGPT default 768, Emu3 default 720): the square image to generate."""
    cfg = read_folder_config(model_dir)
    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise VVSError(f"{model_dir}: model_type '{family}' is not a supported image-generation family "
                       f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 2:
        raise VVSError(f"max_prompt_tokens must be an integer >= 2, got {max_prompt_tokens!r}")
    check_image_size(family, cfg, image_size)  # before the (large) weights are read
    sd = read_weights(model_dir)
    if family == "janus":
        target, vq = build_janus(model_dir, cfg, sd, max_prompt_tokens)
    elif family == "emu3":
        target, vq = build_emu3(model_dir, cfg, sd, max_prompt_tokens, image_size or EMU3_DEFAULT_IMAGE_PX)
    else:
        target, vq = build_chameleon(model_dir, cfg, sd, max_prompt_tokens, image_size or CHAMELEON_DEFAULT_IMAGE_PX)
    return target.eval(), vq.eval(), {"model": family, "model_dir": model_dir}


def valid_sizes_text(size: int, step: int) -> str:
    below = max(step, size // step * step)
    return f"{below} or {below + step}" if below != size else str(size)


def check_image_size(family: str, cfg: dict, image_size) -> None:
    """The image sizes a family can make: Janus-Pro its one native size; Lumina-mGPT multiples of its
    32-px patch (2x2 codes, the unit of its resolution tokens); Emu3 multiples of 8 px (one code)."""
    if image_size is None:
        return
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
        raise VVSError(f"image size must be a positive integer (pixels), got {image_size!r}")
    if family == "janus":
        native = int((cfg.get("vision_config") or {}).get("image_size", 384))
        if image_size != native:
            raise VVSError(f"Janus-Pro makes {native} px images only; image size {image_size} is not possible "
                           f"(leave it out)")
    elif family == "chameleon" and image_size % LUMINA_PATCH_PX:
        raise VVSError(f"Lumina-mGPT image sizes are multiples of {LUMINA_PATCH_PX} px (its resolution tokens count "
                       f"{LUMINA_PATCH_PX}-px patches of 2x2 codes): {image_size} is not; e.g. "
                       f"{valid_sizes_text(image_size, LUMINA_PATCH_PX)} (512, 768 and 1024 are the released models)")
    elif family == "emu3" and image_size % EMU3_PATCH_PX:
        raise VVSError(f"Emu3 image sizes are multiples of {EMU3_PATCH_PX} px (one code): {image_size} is not; e.g. "
                       f"{valid_sizes_text(image_size, EMU3_PATCH_PX)}")


def build_janus(model_dir: str, cfg: dict, sd: dict, max_prompt_tokens: int):
    from .hf_vq import TamingVQConfig, TamingVQDecoder
    from .janus import FamilyConfig, JanusTarget, state_dict_from_hf, vq_state_dict_from_hf

    what = f"Janus folder {model_dir}"
    tc, qc, vc = cfg.get("text_config") or {}, cfg.get("vq_config") or {}, cfg.get("vision_config") or {}
    dcfg = llama_decoder_config(tc, what)
    gen = {}
    gpath = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gpath):
        gen = read_json(gpath, "generation_config.json")
    tok = load_tokenizer(model_dir)

    def special(name, gen_value, token):
        v = gen_value
        if v is None and tok is not None:
            v = tok.token_to_id(token)
        if v is None:
            raise VVSError(f"{what}: cannot find the {name} token id (generation_config.json or tokenizer.json)")
        return int(v)

    bos = special("BOS", gen.get("bos_token_id", tc.get("bos_token_id")), "<｜begin▁of▁sentence｜>")
    boi = special("begin-of-image", (gen.get("generation_kwargs") or {}).get("boi_token_id"), "<begin_of_image>")
    pad = special("pad", gen.get("pad_token_id", tc.get("pad_token_id")), "<｜▁pad▁｜>")
    try:
        n_codes, code_dim = int(qc.get("num_embeddings", 16384)), int(qc.get("embed_dim", 8))
        grid = int(vc.get("image_size", 384)) // int(vc.get("patch_size", 16))
        n_img = int(vc.get("num_image_tokens", 576))
        proj, aligner_layers = int(qc.get("projection_dim", 2048)), int(qc.get("num_hidden_layers", 2))
        vq_cfg = TamingVQConfig(codebook_size=n_codes, codebook_embed_dim=code_dim,
                                latent_channels=int(qc.get("latent_channels", 256)),
                                base_channels=int(qc.get("base_channels", 128)),
                                channel_multiplier=[int(m) for m in qc.get("channel_multiplier", [1, 1, 2, 2, 4])],
                                num_res_blocks=int(qc.get("num_res_blocks", 2)), grid=grid,
                                out_channels=int(qc.get("out_channels", 3)))
    except (TypeError, ValueError) as e:
        raise VVSError(f"{what}: bad vq/vision config ({e})") from None
    if grid * grid != n_img:
        raise VVSError(f"{what}: {n_img} image tokens is not the {grid}x{grid} grid of the VQ decoder")

    fcfg = FamilyConfig(family="janus", dim=dcfg.dim, n_layer=dcfg.n_layer, n_head=dcfg.n_head,
                        n_kv_head=dcfg.n_kv_head, head_dim=dcfg.head_dim, vocab_size=n_codes,
                        cls_token_num=max_prompt_tokens, block_size=n_img,
                        text_vocab_size=int(tc.get("vocab_size", 0)), bos_token_id=bos, boi_token_id=boi,
                        pad_token_id=pad)
    target = JanusTarget(fcfg, dcfg, code_dim, proj, aligner_layers)
    load_into(target, state_dict_from_hf(sd), what)
    target.tokenizer = tok
    vq = TamingVQDecoder(vq_cfg)
    load_into(vq, vq_state_dict_from_hf(sd), f"{what} (VQ decoder)")
    return target, vq


def build_chameleon(model_dir: str, cfg: dict, sd: dict, max_prompt_tokens: int, image_size: int):
    """Lumina-mGPT on Chameleon weights: qk-norm decoder, codes restricted from the text head."""
    from .chameleon import (LUMINA_SEPARATOR, LUMINA_SEPARATOR_NAME, ChameleonCodebook, ChameleonFamilyConfig,
                            ChameleonTarget, code_ids_from_vocabulary_map, state_dict_from_hf)

    what = f"Chameleon folder {model_dir}"
    if cfg.get("swin_norm"):
        raise VVSError(f"{what}: swin_norm models (Chameleon-30B) are not supported")
    dcfg = llama_decoder_config(cfg, what)
    if dcfg.head_dim * dcfg.n_head != dcfg.dim:
        raise VVSError(f"{what}: hidden_size must be num_attention_heads * head_dim")
    dcfg.qk_norm = True
    check_image_size("chameleon", cfg, image_size)
    vocab_map = cfg.get("vocabulary_map") or {}
    code_ids = code_ids_from_vocabulary_map(vocab_map, what)
    vocab = int(cfg.get("vocab_size", 0))
    grid = image_size // CHAMELEON_PATCH_PX
    tokenizer = load_tokenizer(model_dir)
    # The turn separator by name (Lumina-mGPT writes it as text), else Chameleon's fixed id for it.
    separator = vocab_map.get(LUMINA_SEPARATOR_NAME)
    if separator is None and tokenizer is not None:
        separator = tokenizer.token_to_id(LUMINA_SEPARATOR_NAME)
    fcfg = ChameleonFamilyConfig(family="chameleon", dim=dcfg.dim, n_layer=dcfg.n_layer, n_head=dcfg.n_head,
                                 n_kv_head=dcfg.n_kv_head, head_dim=dcfg.head_dim, vocab_size=len(code_ids) + 1,
                                 cls_token_num=max_prompt_tokens, block_size=grid * (grid + 1),
                                 text_vocab_size=vocab, grid_h=grid, grid_w=grid, patch_px=CHAMELEON_PATCH_PX,
                                 bos_token_id=int(cfg.get("bos_token_id") or 0),
                                 pad_token_id=int(cfg.get("pad_token_id") or 1),
                                 separator_token_id=int(LUMINA_SEPARATOR if separator is None else separator))
    top = max(fcfg.boi_token_id, fcfg.eol_token_id, fcfg.separator_token_id, int(code_ids.max()),
              *ChameleonTarget.resolution_ids(fcfg))
    if top >= vocab:
        raise VVSError(f"{what}: vocabulary of {vocab} lacks Lumina-mGPT's layout tokens (id {top})")
    target = ChameleonTarget(fcfg, dcfg, code_ids)
    load_into(target, state_dict_from_hf(sd), what)
    target.tokenizer = tokenizer
    emb = sd.get("model.vqmodel.quantize.embedding.weight")
    if emb is None or emb.shape[0] != len(code_ids):
        raise VVSError(f"{what}: missing or mis-shaped model.vqmodel.quantize.embedding.weight")
    vq = build_chameleon_vq(model_dir, cfg.get("vq_config") or {}, sd, len(code_ids), grid, what)
    if vq is None:  # no decoder weights anywhere: tokens only
        vq = ChameleonCodebook(emb.shape[0], emb.shape[1], grid)
        vq.quantize.embedding.weight.data.copy_(emb.float())
    return target, vq


VQGAN_FILES = ("vqgan.safetensors", "vqgan.ckpt")


def read_vqgan_file(model_dir: str, what: str):
    """Chameleon's VQGAN decoder weights kept beside the folder's shards (Lumina-mGPT ships them as
    ``ckpts/chameleon/tokenizer/vqgan.ckpt``; transformers' conversion drops the decoder) -> taming
    names (``decoder.*``, ``post_quant_conv.*``, ``quantize.embedding.weight``), or None."""
    for name in VQGAN_FILES:
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                sd = load_file(path)
            else:
                sd = torch.load(path, map_location="cpu", weights_only=True)
                sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
        except Exception as e:  # safetensors and torch.load raise several types for a bad file
            raise VVSError(f"{what}: unreadable {name} ({str(e).splitlines()[0][:160]}); "
                           f"a checkpoint that needs pickled objects must be converted to safetensors") from None
        if not isinstance(sd, dict):
            raise VVSError(f"{what}: {name} holds no state dict")
        return {k[len("model.vqmodel."):] if k.startswith("model.vqmodel.") else k: v for k, v in sd.items()}
    return None


def build_chameleon_vq(model_dir: str, qc: dict, sd: dict, n_codes: int, grid: int, what: str):
    """Lumina-mGPT's image decoder from the folder's ``vq_config``; decoder weights from the folder's
    shards (``model.vqmodel.decoder.*``) or a ``vqgan.safetensors`` / ``vqgan.ckpt`` beside them.
    Returns None when neither holds decoder weights."""
    from .hf_vq import ChameleonVQConfig, ChameleonVQDecoder

    prefix = "model.vqmodel."
    dec = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix + "decoder.")}
    extra = None
    if not dec:
        extra = read_vqgan_file(model_dir, what)
        if extra is None:
            return None
        dec = {k: v for k, v in extra.items() if k.startswith("decoder.")}
        if not dec:
            raise VVSError(f"{what}: the VQGAN file holds no decoder.* weights")
    try:
        vcfg = ChameleonVQConfig(codebook_size=n_codes + 1, codebook_embed_dim=int(qc.get("embed_dim", 256)),
                                 latent_channels=int(qc.get("latent_channels", 256)),
                                 base_channels=int(qc.get("base_channels", 128)),
                                 channel_multiplier=[int(m) for m in qc.get("channel_multiplier", [1, 1, 2, 2, 4])],
                                 num_res_blocks=int(qc.get("num_res_blocks", 2)),
                                 attn_resolutions=[int(r) for r in qc.get("attn_resolutions") or []],
                                 resolution=int(qc.get("resolution", 512)), grid_h=grid, grid_w=grid)
    except (TypeError, ValueError) as e:
        raise VVSError(f"{what}: bad vq_config ({e})") from None
    vq = ChameleonVQDecoder(vcfg)
    state = dict(dec)
    for k in ("quantize.embedding.weight", "post_quant_conv.weight", "post_quant_conv.bias"):
        if prefix + k not in sd:
            raise VVSError(f"{what}: missing {prefix + k}")
        state[k] = sd[prefix + k]
        if extra is not None and k in extra and (extra[k].shape != state[k].shape
                                                 or not torch.allclose(extra[k].float(), state[k].float())):
            raise VVSError(f"{what}: the VQGAN file's {k} differs from the folder's: not this model's decoder")
    load_into(vq, state, f"{what} (VQ decoder)")
    return vq


def build_emu3(model_dir: str, cfg: dict, sd: dict, max_prompt_tokens: int, image_size: int):
    """Emu3-Gen: Llama decoder, visual tokens restricted from the text head, Emu3's layout tokens."""
    from .chameleon import ChameleonCodebook, ChameleonFamilyConfig, Emu3Target, emu3_code_ids, state_dict_from_hf
    from .hf_vq import Emu3VQConfig, Emu3VQDecoder

    what = f"Emu3 folder {model_dir}"
    tc = cfg.get("text_config") or {}
    dcfg = llama_decoder_config(tc, what)
    check_image_size("emu3", cfg, image_size)
    vmap = cfg.get("vocabulary_map") or {}
    code_ids = emu3_code_ids(vmap, what)
    special = {}
    for key, name in (("boi", "<|image start|>"), ("wrapper", "<|image token|>"), ("eol", "<|extra_200|>")):
        if name not in vmap:
            raise VVSError(f"{what}: vocabulary_map lacks {name}")
        special[key] = int(vmap[name])
    grid = image_size // EMU3_PATCH_PX
    fcfg = ChameleonFamilyConfig(family="emu3", dim=dcfg.dim, n_layer=dcfg.n_layer, n_head=dcfg.n_head,
                                 n_kv_head=dcfg.n_kv_head, head_dim=dcfg.head_dim, vocab_size=len(code_ids) + 1,
                                 cls_token_num=max_prompt_tokens, block_size=grid * (grid + 1),
                                 text_vocab_size=int(tc.get("vocab_size", 0)), grid_h=grid, grid_w=grid,
                                 patch_px=EMU3_PATCH_PX, bos_token_id=int(tc.get("bos_token_id") or 0),
                                 pad_token_id=int(tc.get("pad_token_id") or 0), boi_token_id=special["boi"],
                                 eol_token_id=special["eol"], image_wrapper_token_id=special["wrapper"],
                                 separator_token_id=-1)
    target = Emu3Target(fcfg, dcfg, code_ids)
    # transformers writes Emu3 in the original layout (text_model.model.*); accept its own names too.
    original = any(k.startswith("text_model.") for k in sd)
    prefixes = ("text_model.model.", "text_model.lm_head.") if original else ("model.text_model.", "lm_head.")
    load_into(target, state_dict_from_hf(sd, *prefixes), what)
    target.tokenizer = load_tokenizer(model_dir)
    vq_prefix = "vqmodel." if any(k.startswith("vqmodel.") for k in sd) else "model.vqmodel."
    emb = sd.get(vq_prefix + "quantize.embedding.weight")
    if emb is None or emb.shape[0] != len(code_ids):
        raise VVSError(f"{what}: missing or mis-shaped {vq_prefix}quantize.embedding.weight")
    vq_sd = {k[len(vq_prefix):]: v for k, v in sd.items()
             if k.startswith(tuple(vq_prefix + p for p in ("quantize.", "post_quant_conv.", "decoder.")))}
    if not any(k.startswith("decoder.") for k in vq_sd):  # a folder without the decoder: tokens only
        book = ChameleonCodebook(emb.shape[0], emb.shape[1], grid)
        book.quantize.embedding.weight.data.copy_(emb.float())
        return target, book
    qc = cfg.get("vq_config") or {}
    pre = os.path.join(model_dir, "preprocessor_config.json")
    pp = read_json(pre, "preprocessor_config.json") if os.path.exists(pre) else {}
    try:
        norm = {k: [float(x) for x in ([v] * 3 if isinstance(v, (int, float)) else v)]
                for k, v in (("pixel_mean", pp.get("image_mean", 0.5)), ("pixel_std", pp.get("image_std", 0.5)))}
        vcfg = Emu3VQConfig(codebook_size=len(code_ids) + 1, embed_dim=int(qc.get("embed_dim", 4)),
                            latent_channels=int(qc.get("latent_channels", 4)),
                            base_channels=int(qc.get("base_channels", 256)),
                            channel_multiplier=[int(m) for m in qc.get("channel_multiplier", [1, 2, 2, 4])],
                            num_res_blocks=int(qc.get("num_res_blocks", 2)),
                            attn_resolutions=[int(r) for r in qc.get("attn_resolutions", [3])],
                            hidden_size=int(qc.get("hidden_size", 1024)),
                            num_attention_heads=int(qc.get("num_attention_heads", 1)),
                            temporal_downsample_factor=int(qc.get("temporal_downsample_factor", 4)),
                            grid_h=grid, grid_w=grid, out_channels=int(qc.get("out_channels", 3)), **norm)
    except (TypeError, ValueError) as e:
        raise VVSError(f"{what}: bad vq_config ({e})") from None
    if vcfg.embed_dim != vcfg.latent_channels:
        raise VVSError(f"{what}: vq_config embed_dim must equal latent_channels (the decoder's temporal "
                       f"stage runs latents and code vectors together)")
    vq = Emu3VQDecoder(vcfg)
    load_into(vq, vq_sd, f"{what} (VQ decoder)")
    return target, vq
