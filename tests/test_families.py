"""Hugging Face target families against transformers (the oracle): logits, greedy CFG images, the
VQ decoder, loading errors, and every decoding method on each family."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from vvs_engine.models.hf_tiny import PROMPTS, make_chameleon_folder, make_emu3_folder, make_janus_folder
from vvs_engine.drafting.drafter import Drafter, DrafterConfig
from vvs_engine.engine import Engine
from vvs_engine.errors import VVSError

LOSSLESS = [("eagle", {}), ("eagle", {"tree": "static"}), ("lantern", {"lantern_delta": 0.0}),
            ("vvs", {"skip_interval": 1}), ("sjd", {}), ("gsd", {})]
ALL_METHODS = ["ar", "eagle", "lantern", "lantern++", "vvs", "sjd", "gsd", "cascade"]


@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("janus"))
    hf = make_janus_folder(path)
    return path, hf, Engine.load(model_dir=path, max_prompt_tokens=24)


def hf_janus_logits(hf, ids, codes):
    """transformers' Janus: prompt ids [1, L], codes [1, T] -> generation-head logits [T, V]."""
    x = torch.cat([hf.get_input_embeddings()(ids), hf.prepare_embeddings_for_image_generation(codes[:, :-1])], 1)
    h = hf.model.language_model(inputs_embeds=x).last_hidden_state
    return hf.model.generation_head(h[:, ids.shape[1] - 1:])[0]


def test_janus_logits_match_transformers(janus):
    path, hf, eng = janus
    codes = torch.randint(0, eng.config.vocab_size, (len(PROMPTS), eng.tokens_per_image),
                          generator=torch.Generator().manual_seed(0))
    ours = eng.score(prompts=PROMPTS, tokens=codes)  # left-padded prompts of different lengths
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf_janus_logits(hf, torch.tensor([eng.gpt.prompt_ids(p)]), codes[i:i + 1])
        assert ref.abs().max() > 1.0  # not a vacuous comparison
        torch.testing.assert_close(ours[i], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg_scale", [1.5, 5.0])
def test_janus_greedy_cfg_equals_transformers_generate(janus, cfg_scale):
    path, hf, eng = janus
    for p in PROMPTS:
        ours = eng.generate(prompts=[p], temperature=0, cfg_scale=cfg_scale, decode_images=False).tokens
        ids = torch.tensor([eng.gpt.prompt_ids(p)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_mode="image", do_sample=False,
                          guidance_scale=cfg_scale)
        assert len(set(ref[0].tolist())) > 3  # a non-degenerate image
        assert torch.equal(ours, ref)


def test_janus_unconditional_row_is_janus_style(janus):
    _, _, eng = janus
    cfg = eng.config
    ids, mask = eng.gpt.condition_rows(PROMPTS, True, "cpu")
    cond, unc = ids.chunk(2)
    assert torch.equal(mask[:2], mask[2:]) and not mask[0].all()
    kept = (cond == cfg.bos_token_id) | (cond == cfg.boi_token_id)
    assert torch.equal(unc[kept], cond[kept])
    assert (unc[~kept] == cfg.pad_token_id).all()
    assert cond[:, -1].eq(cfg.boi_token_id).all()


def test_janus_vq_decoder_matches_transformers(janus):
    _, hf, eng = janus
    codes = torch.randint(0, eng.config.vocab_size, (2, eng.tokens_per_image), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.decode_image_tokens(codes).permute(0, 3, 1, 2)
    torch.testing.assert_close(eng.vq.decode(codes), ref, atol=1e-4, rtol=0)
    out = eng.generate(prompts=PROMPTS[:1], temperature=0, cfg_scale=2.0)
    assert out.images[0].size == (8, 8)


@pytest.fixture(scope="module")
def janus64(janus):
    """The Janus engine in float64 with a random drafter (greedy ties cannot flip)."""
    path, _, _ = janus
    eng = Engine.load(model_dir=path, max_prompt_tokens=24)
    c = eng.config
    eng.drafter = Drafter(DrafterConfig(dim=c.dim, n_head=c.n_head)).attach(eng.gpt).eval()
    eng.gpt.to(torch.float64)
    eng.drafter.to(torch.float64)
    eng.dtype = torch.float64
    ar = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens
    return eng, ar


@pytest.mark.parametrize("method,opts", LOSSLESS)
def test_janus_lossless_methods_greedy_equal_ar(janus64, method, opts):
    eng, ar = janus64
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    assert torch.equal(out.tokens, ar)
    assert out.stats["tpf"] >= 1.0


@pytest.mark.parametrize("method", ALL_METHODS)
def test_janus_every_method_samples(janus64, method):
    eng, _ = janus64
    out = eng.generate(prompts=PROMPTS, temperature=1.0, top_k=20, cfg_scale=3.0, method=method, seed=3,
                       decode_images=False)
    assert out.tokens.shape == (2, eng.tokens_per_image)
    assert 0 <= int(out.tokens.min()) and int(out.tokens.max()) < eng.config.vocab_size
    assert out.stats["target_forward_passes"] > 0 and out.stats["tpf"] > 0


# --- Lumina-mGPT (Chameleon) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lumina(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chameleon"))
    hf = make_chameleon_folder(path)
    return path, hf, Engine.load(model_dir=path, max_prompt_tokens=32, image_size=64)


def with_row_ends(eng, tokens):
    """Put the EOL index at the end of every row of method tokens [n, h*(w+1)]."""
    c = eng.config
    tokens.view(tokens.shape[0], c.grid_h, c.grid_w + 1)[:, :, -1] = c.n_codes
    return tokens


def assert_lumina_layout(eng, tokens):
    c = eng.config
    rows = tokens.view(tokens.shape[0], c.grid_h, c.grid_w + 1)
    assert (rows[:, :, -1] == c.n_codes).all()  # EOL closes every row
    assert (rows[:, :, :-1] < c.n_codes).all()  # and appears nowhere else


# Lumina-mGPT's condition, written out by hand from its released rules (lumina_mgpt/data/item_processor.py
# FlexARItemProcessor, data/convertsation.py Conversation, inference_solver.py's guidance processor), not
# from the engine: the human turn is BOS + the tokens of "Generate an image of {W}x{H} according to the
# following prompt:\n{prompt}" + the turn separator <reserved08706> (id 8710: <reservedN> is id N + 4);
# the image then starts with <racm3:break> (8197) and the resolution tokens <reserved{8800 + n}> = 8804 + n,
# n = pixels / 32 (its 32-px patches of 2 x 2 codes), height then width. Unconditional (CFG) row: from
# <racm3:break> on. The tiny tokenizer's ids: <s> 0, <unk> 100, then LUMINA_WORDS from 101 ("64x64" is
# 105; "512x512" and "768x768" are not words of it: <unk>).
LUMINA_INSTRUCTION = {64: [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111],
                      512: [101, 102, 103, 104, 100, 106, 107, 108, 109, 110, 111],
                      768: [101, 102, 103, 104, 100, 106, 107, 108, 109, 110, 111]}
LUMINA_PROMPTS = {"a red cat": [112, 113, 114],
                  "a photo of the small blue dog on the grass": [112, 115, 104, 108, 116, 117, 118, 119, 108, 120]}
LUMINA_CONDITIONS = {  # (pixels, prompt) -> the conditional row, the unconditional row
    (512, "a red cat"): ([0, 101, 102, 103, 104, 100, 106, 107, 108, 109, 110, 111, 112, 113, 114, 8710, 8197, 8820, 8820],
                         [8197, 8820, 8820]),
    (768, "a red cat"): ([0, 101, 102, 103, 104, 100, 106, 107, 108, 109, 110, 111, 112, 113, 114, 8710, 8197, 8828, 8828],
                         [8197, 8828, 8828]),
    (64, "a photo of the small blue dog on the grass"):
        ([0, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 115, 104, 108, 116, 117, 118, 119, 108, 120,
          8710, 8197, 8806, 8806], [8197, 8806, 8806]),
}


@pytest.mark.parametrize("pixels", [64, 512, 768])
def test_lumina_condition_ids_are_lumina_mgpts(lumina, pixels):
    """The condition rows (conditional, then the CFG rows) equal Lumina-mGPT's ids written out by hand."""
    from vvs_engine.models.hf_loader import load_hf_folder

    path, _, _ = lumina
    target, _, _ = load_hf_folder(path, 32, pixels)
    for prompt, words in LUMINA_PROMPTS.items():
        cond = [0] + LUMINA_INSTRUCTION[pixels] + words + [8710, 8197, 8804 + pixels // 32, 8804 + pixels // 32]
        uncond = [8197, 8804 + pixels // 32, 8804 + pixels // 32]
        if (pixels, prompt) in LUMINA_CONDITIONS:
            assert (cond, uncond) == LUMINA_CONDITIONS[pixels, prompt]  # the pieces agree with the literal rows
        ids, mask = target.condition_rows([prompt, prompt], True, "cpu")
        for row, want in zip(range(4), [cond, cond, uncond, uncond]):
            assert ids[row][mask[row]].tolist() == want, (pixels, prompt, row)
            assert mask[row].tolist() == [False] * (32 - len(want)) + [True] * len(want)  # left-padded
    # 48 codes a side at 768 px: the layout the resolution tokens describe (2 codes per 32-px patch)
    assert target.config.grid_h == 2 * pixels // 32 and target.config.block_size == (pixels // 16) * (pixels // 16 + 1)


def test_lumina_image_size_must_be_a_multiple_of_32(lumina):
    from vvs_engine.models.hf_loader import load_hf_folder

    path, _, _ = lumina
    for bad, hint in ((80, "64 or 96"), (520, "512 or 544"), (16, "32 or 64")):
        with pytest.raises(VVSError, match=f"multiples of 32 px .*{hint}"):
            load_hf_folder(path, 32, bad)


def test_lumina_logits_match_transformers(lumina):
    path, hf, eng = lumina
    m, T = eng.gpt, eng.tokens_per_image
    tokens = with_row_ends(eng, torch.randint(0, eng.config.n_codes, (2, T), generator=torch.Generator().manual_seed(0)))
    ours = eng.score(prompts=PROMPTS, tokens=tokens)
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([m.prompt_ids(p) + m.vocab_ids[tokens[i, :-1]].tolist()])
        with torch.no_grad():
            ref = hf.lm_head(hf.model(input_ids=ids).last_hidden_state)[0, -T:][:, m.vocab_ids]
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(ours[i], ref, atol=1e-4, rtol=0)


def hf_lumina_greedy(hf, m, prompt, cfg_scale):
    """Greedy CFG decoding with transformers' Chameleon forward (no cache) and Lumina-mGPT's layout
    rules written out: codes only, EOL forced after each row, unconditional row = the image prefix."""
    c = m.config
    cond, uncond, out = m.prompt_ids(prompt), m.image_prefix(), []
    with torch.no_grad():
        for t in range(c.block_size):
            if t % (c.grid_w + 1) == c.grid_w:
                tok = c.n_codes
            else:
                lc, lu = (hf.lm_head(hf.model(input_ids=torch.tensor([s])).last_hidden_state[0, -1])[m.vocab_ids[:-1]]
                          for s in (cond, uncond))
                tok = int((lu + cfg_scale * (lc - lu)).argmax())
            out.append(tok)
            cond, uncond = cond + [int(m.vocab_ids[tok])], uncond + [int(m.vocab_ids[tok])]
    return torch.tensor([out])


def test_lumina_greedy_cfg_equals_transformers_with_layout_rules(lumina):
    _, hf, eng = lumina
    for p in PROMPTS:  # CFG 4: at 3 the random tiny model's greedy image of the long prompt is nearly constant
        ours = eng.generate(prompts=[p], temperature=0, cfg_scale=4.0).tokens
        ref = hf_lumina_greedy(hf, eng.gpt, p, 4.0)
        assert len(set(ref[0].tolist())) > 3
        assert torch.equal(ours, ref)
        assert_lumina_layout(eng, ours)
    assert eng.gpt.codes_of(ours).shape == (1, eng.config.grid_h * eng.config.grid_w)


def hf_chameleon_decode(hf, folder, codes):
    """The reference decoder: transformers' ``ChameleonVQVAE`` codebook and ``post_quant_conv``, then
    transformers' ``JanusVQVAEDecoder`` (the same taming decoder; transformers' Chameleon has none)
    holding the folder's ``vqgan.ckpt`` decoder weights."""
    from vvs_engine.models.hf_tiny import janus_decoder_like

    vqm = hf.model.vqmodel
    n = len(vqm.config.channel_multiplier)
    ref = janus_decoder_like(vqm.config)
    sd = torch.load(os.path.join(folder, "vqgan.ckpt"), weights_only=True)["state_dict"]
    own = {}
    for k, v in sd.items():
        if k.startswith("decoder.up."):
            level, rest = k[len("decoder.up."):].split(".", 1)
            own[f"up.{n - 1 - int(level)}.{rest}"] = v
        elif k.startswith("decoder."):
            own[k[len("decoder."):]] = v
    missing = ref.load_state_dict(own, strict=False).missing_keys
    lowest_attn = vqm.config.resolution // 2 ** (n - 1) in vqm.config.attn_resolutions
    assert all(".attn." in k for k in missing) and (not missing) == lowest_attn
    with torch.no_grad():
        for k in missing:  # no attention there in this config: the Janus block becomes the identity
            if k.endswith("proj_out.weight") or k.endswith("proj_out.bias"):
                ref.get_parameter(k).zero_()
        return ref(vqm.post_quant_conv(vqm.quantize.embedding(codes).permute(0, 3, 1, 2)))


def random_row_tokens(eng, n, seed):
    c = eng.config
    return with_row_ends(eng, torch.randint(0, c.n_codes, (n, eng.tokens_per_image),
                                            generator=torch.Generator().manual_seed(seed)))


def test_lumina_vq_decoder_matches_transformers_and_generate_returns_images(lumina):
    path, hf, eng = lumina
    c = eng.config
    tokens = random_row_tokens(eng, 2, 1)
    ref = hf_chameleon_decode(hf, path, eng.gpt.codes_of(tokens).view(2, c.grid_h, c.grid_w))
    assert ref.std() > 0.1
    torch.testing.assert_close(eng.vq.decode(tokens), ref, atol=1e-4, rtol=0)
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0)
    side = c.grid_h * eng.vq.downsample
    assert [im.size for im in out.images] == [(side, side)] * 2
    assert len({im.tobytes() for im in out.images}) == 2


def test_lumina_vq_decoder_without_attention_and_from_safetensors(tmp_path):
    """A VQGAN config without up-block attention (empty ``attn_resolutions``); the decoder may also come
    as vqgan.safetensors; without any decoder weights the engine outputs tokens only."""
    path = str(tmp_path / "noattn")
    hf = make_chameleon_folder(path, vqgan="vqgan.safetensors", attn_resolutions=())
    eng = Engine.load(model_dir=path, max_prompt_tokens=32, image_size=64)
    from safetensors.torch import load_file

    torch.save({"state_dict": load_file(os.path.join(path, "vqgan.safetensors"))}, os.path.join(path, "vqgan.ckpt"))
    c = eng.config
    tokens = random_row_tokens(eng, 2, 2)
    ref = hf_chameleon_decode(hf, path, eng.gpt.codes_of(tokens).view(2, c.grid_h, c.grid_w))
    torch.testing.assert_close(eng.vq.decode(tokens), ref, atol=1e-4, rtol=0)
    for f in ("vqgan.safetensors", "vqgan.ckpt"):
        os.remove(os.path.join(path, f))
    bare = Engine.load(model_dir=path, max_prompt_tokens=32, image_size=64)
    assert not bare.vq.can_decode
    assert bare.generate(prompts=PROMPTS[:1], temperature=0).images == []
    torch.testing.assert_close(bare.codebook_vectors(), eng.codebook_vectors())


def test_lumina_vqgan_file_of_another_model_is_refused(lumina, tmp_path):
    path, _, _ = lumina
    bad = tmp_path / "other"
    shutil.copytree(path, bad)
    sd = torch.load(bad / "vqgan.ckpt", weights_only=True)
    sd["state_dict"]["quantize.embedding.weight"] = sd["state_dict"]["quantize.embedding.weight"] + 1.0
    torch.save(sd, bad / "vqgan.ckpt")
    with pytest.raises(VVSError, match="differs from the folder's"):
        Engine.load(model_dir=str(bad), max_prompt_tokens=32, image_size=64)
    (bad / "vqgan.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(VVSError, match="unreadable vqgan.ckpt"):
        Engine.load(model_dir=str(bad), max_prompt_tokens=32, image_size=64)


@pytest.fixture(scope="module")
def lumina64(lumina):
    path, _, _ = lumina
    eng = Engine.load(model_dir=path, max_prompt_tokens=32, image_size=64)
    c = eng.config
    eng.drafter = Drafter(DrafterConfig(dim=c.dim, n_head=c.n_head)).attach(eng.gpt).eval()
    eng.gpt.to(torch.float64)
    eng.drafter.to(torch.float64)
    eng.dtype = torch.float64
    ar = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens
    return eng, ar


@pytest.mark.parametrize("method,opts", LOSSLESS)
def test_lumina_lossless_methods_greedy_equal_ar(lumina64, method, opts):
    eng, ar = lumina64
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    assert torch.equal(out.tokens, ar)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_lumina_every_method_samples_within_layout(lumina64, method):
    eng, _ = lumina64
    out = eng.generate(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, method=method, seed=3, decode_images=False)
    assert out.tokens.shape == (2, eng.tokens_per_image)
    assert_lumina_layout(eng, out.tokens)
    assert out.stats["target_forward_passes"] > 0


# --- Emu3 ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emu3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("emu3"))
    hf = make_emu3_folder(path)
    return path, hf, Engine.load(model_dir=path, max_prompt_tokens=24, image_size=32)


def test_emu3_logits_match_transformers(emu3):
    _, hf, eng = emu3
    m, T = eng.gpt, eng.tokens_per_image
    tokens = with_row_ends(eng, torch.randint(0, eng.config.n_codes, (2, T), generator=torch.Generator().manual_seed(0)))
    ours = eng.score(prompts=PROMPTS, tokens=tokens)
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([m.prompt_ids(p) + m.vocab_ids[tokens[i, :-1]].tolist()])
        with torch.no_grad():
            ref = hf.lm_head(hf.model.text_model(input_ids=ids).last_hidden_state)[0, -T:][:, m.vocab_ids]
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(ours[i], ref, atol=1e-4, rtol=0)


def test_emu3_greedy_cfg_equals_transformers_generate_with_layout_constraints(emu3):
    """transformers' Emu3 generate with the layout as ``prefix_allowed_tokens_fn`` (visual tokens,
    EOL after every row) and our unconditional row as its negative prompt."""
    _, hf, eng = emu3
    m, c = eng.gpt, eng.config
    visual = m.vocab_ids[:-1].tolist()

    def allowed(batch_id, input_ids):
        start = torch.nonzero(input_ids == c.image_wrapper_token_id, as_tuple=True)[0][0]
        return [c.eol_token_id] if (input_ids.shape[0] - start) % (c.grid_w + 1) == 0 else visual

    index_of = {int(v): i for i, v in enumerate(m.vocab_ids)}
    for p in PROMPTS:
        ours = eng.generate(prompts=[p], temperature=0, cfg_scale=3.0).tokens
        ids, neg = torch.tensor([m.prompt_ids(p)]), torch.tensor([m.uncond_ids()])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), prefix_allowed_tokens_fn=allowed,
                          negative_prompt_ids=neg, negative_prompt_attention_mask=torch.ones_like(neg),
                          guidance_scale=3.0, do_sample=False, max_new_tokens=c.block_size)
        ref = torch.tensor([[index_of[int(t)] for t in ref[0, ids.shape[1]:]]])
        assert len(set(ref[0].tolist())) > 3
        assert torch.equal(ours, ref)
        assert_lumina_layout(eng, ours)


def test_emu3_vq_decoder_matches_transformers_and_generate_returns_images(emu3):
    _, hf, eng = emu3
    c = eng.config
    tokens = random_row_tokens(eng, 2, 1)
    with torch.no_grad():
        ref = hf.model.vqmodel.decode(eng.gpt.codes_of(tokens).view(2, c.grid_h, c.grid_w))
    assert ref.std() > 0.1
    torch.testing.assert_close(eng.vq.decode(tokens), ref, atol=1e-4, rtol=0)
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0)
    side = c.grid_h * eng.vq.downsample
    assert [im.size for im in out.images] == [(side, side)] * 2


def test_emu3_decoded_pixels_follow_the_folders_normalisation(emu3, tmp_path):
    """With preprocessor_config.json's mean/std the decoded values are un-normalised (pixel = x*std+mean)
    before the engine's [-1, 1] -> uint8 mapping; without it, mean = std = 0.5 (identity)."""
    path, hf, eng = emu3
    folder = tmp_path / "clip_norm"
    shutil.copytree(path, folder)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std}))
    other = Engine.load(model_dir=str(folder), max_prompt_tokens=24, image_size=32)
    tokens = random_row_tokens(eng, 2, 3)
    x = eng.vq.decode(tokens)
    want = 2 * (x * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]) - 1
    torch.testing.assert_close(other.vq.decode(tokens), want)


def test_emu3_folder_without_decoder_gives_tokens_and_bad_decoder_is_refused(emu3, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, eng = emu3
    sd = load_file(os.path.join(path, "model.safetensors"))
    for name, edit in (("bare", lambda d: {k: v for k, v in d.items() if ".decoder." not in f".{k}"}),
                        ("bad", lambda d: {k: (v[:, :-1].contiguous() if k.endswith("decoder.conv_out.weight") else v)
                                           for k, v in d.items()})):
        folder = tmp_path / name
        shutil.copytree(path, folder)
        save_file(edit(sd), str(folder / "model.safetensors"))
        if name == "bare":
            bare = Engine.load(model_dir=str(folder), max_prompt_tokens=24, image_size=32)
            assert not bare.vq.can_decode and bare.generate(prompts=PROMPTS[:1], temperature=0).images == []
            torch.testing.assert_close(bare.codebook_vectors(), eng.codebook_vectors())
        else:
            with pytest.raises(VVSError, match="VQ decoder.*shape mismatch.*conv_out"):
                Engine.load(model_dir=str(folder), max_prompt_tokens=24, image_size=32)


@pytest.fixture(scope="module")
def emu3_64(emu3):
    path, _, _ = emu3
    eng = Engine.load(model_dir=path, max_prompt_tokens=24, image_size=32)
    c = eng.config
    eng.drafter = Drafter(DrafterConfig(dim=c.dim, n_head=c.n_head)).attach(eng.gpt).eval()
    eng.gpt.to(torch.float64)
    eng.drafter.to(torch.float64)
    eng.dtype = torch.float64
    ar = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens
    return eng, ar


@pytest.mark.parametrize("method,opts", LOSSLESS)
def test_emu3_lossless_methods_greedy_equal_ar(emu3_64, method, opts):
    eng, ar = emu3_64
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method=method, decode_images=False, **opts)
    assert torch.equal(out.tokens, ar)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_emu3_every_method_samples_within_layout(emu3_64, method):
    eng, _ = emu3_64
    out = eng.generate(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, method=method, seed=3, decode_images=False)
    assert out.tokens.shape == (2, eng.tokens_per_image)
    assert_lumina_layout(eng, out.tokens)
    assert out.stats["target_forward_passes"] > 0


# --- loading errors -----------------------------------------------------------------------------
def test_missing_folder_and_config(tmp_path):
    with pytest.raises(VVSError, match="model folder not found"):
        Engine.load(model_dir=str(tmp_path / "nope"))
    with pytest.raises(VVSError, match="config.json not found"):
        Engine.load(model_dir=str(tmp_path))


def test_wrong_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(VVSError, match="'bert' is not a supported"):
        Engine.load(model_dir=str(tmp_path))


def test_missing_shard_and_misshaped_tensor(janus, tmp_path):
    path, _, _ = janus
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(sd)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(os.path.join(path, f), shard_dir / f)
    half = len(names) // 2
    save_file({k: sd[k] for k in names[:half]}, str(shard_dir / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in names[half:]}, str(shard_dir / "model-00002-of-00002.safetensors"))
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(names)}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    eng = Engine.load(model_dir=str(shard_dir), max_prompt_tokens=24, dtype="bf16")  # sharded loads
    assert eng.dtype == torch.bfloat16
    os.remove(shard_dir / "model-00002-of-00002.safetensors")
    with pytest.raises(VVSError, match="missing weight shard"):
        Engine.load(model_dir=str(shard_dir))
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    key = "model.generation_head.vision_head.weight"
    sd[key] = sd[key][:, :-1].contiguous()
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(VVSError, match="shape mismatch.*vision_head"):
        Engine.load(model_dir=str(bad))


def test_prompt_too_long(janus):
    _, _, eng = janus
    with pytest.raises(VVSError, match="limit is 24"):
        eng.generate(prompts=["a " * 40], temperature=0, decode_images=False)


# --- command line and drafter training ------------------------------------------------------------
def test_cli_generate_and_train_drafter_with_model_dir(janus, tmp_path, capsys):
    import numpy as np

    from vvs_engine.cli import main

    path, _, eng = janus
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    assert main(["generate", "--model-dir", path, "--max-prompt-tokens", "24", "--prompts", str(prompts),
                 "--temperature", "0", "--cfg-scale", "3", "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    tokens = np.load(out / "tokens.npz")["tokens"]
    api = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens
    np.testing.assert_array_equal(tokens, api.numpy())
    assert sorted(p.name for p in out.glob("*.png")) == ["000000.png", "000001.png", "grid.png"]

    drafter = tmp_path / "janus-drafter.safetensors"
    assert main(["train-drafter", "--model-dir", path, "--max-prompt-tokens", "24", "--prompts", str(prompts),
                 "--samples-per-prompt", "3", "--steps", "30", "--batch-size", "4", "--lr", "3e-3",
                 "--out", str(drafter)]) == 0
    trained = Engine.load(model_dir=path, max_prompt_tokens=24, drafter=str(drafter))
    ar = trained.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False)
    sp = trained.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method="eagle", decode_images=False)
    assert torch.equal(sp.tokens, ar.tokens)
    capsys.readouterr()
    assert main(["generate", "--model-dir", str(tmp_path / "missing"), "--prompts", str(prompts),
                 "--device", "cpu", "--out", str(out)]) == 1
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and "model folder not found" in err[0]


def test_trained_drafter_beats_random_on_acceptance(janus, tmp_path):
    """Teacher-forced training on prompt conditions learns the target: more tokens per forward."""
    from vvs_engine.training.drafter import PromptConditions, train_drafter

    path, _, _ = janus
    eng = Engine.load(model_dir=path, max_prompt_tokens=24)
    prompts = [p for p in PROMPTS for _ in range(4)]
    tokens = eng.generate(prompts=prompts, seed=0, cfg_scale=3.0, decode_images=False).tokens.clone()
    ids, mask = eng.gpt.condition_rows(prompts, True, "cpu")
    n = len(prompts)
    cond = PromptConditions(cond=ids[:n], uncond=ids[n:], key_mask=mask[:n])
    kw = dict(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, method="eagle", seed=5, decode_images=False)
    c = eng.config
    eng.drafter = Drafter(DrafterConfig(dim=c.dim, n_head=c.n_head)).attach(eng.gpt).eval()
    random_tpf = eng.generate(**kw).stats["tpf"]
    eng.drafter = train_drafter(eng.gpt, tokens, cond, steps=80, batch_size=8, lr=3e-3, log=None, progress=False)
    assert eng.generate(**kw).stats["tpf"] > random_tpf


def test_bench_model_dir(emu3, tmp_path):
    from vvs_engine.evaluation import bench

    path, _, _ = emu3
    assert bench.main(["--model-dir", path, "--image-size", "32", "--settings", "ar;sjd", "--repeats", "1",
                       "--out", str(tmp_path),
                       "--no-plot", "--threads", "1", "--device", "cpu", "--tag", "fam"]) == 0
    rep = json.loads((tmp_path / "e2e_fam.json").read_text())
    rows = rep["blocks"][0]["rows"]
    assert [r["method"] for r in rows] == ["ar", "sjd"] and rows[1]["tpf"] >= 1.0
    assert rep["meta"]["model"].startswith("emu3")


@pytest.mark.parametrize("family", ["lumina", "emu3"])
def test_train_drafter_on_family_images_then_eagle(family, request, tmp_path):
    """``train-drafter --model-dir --images --prompts`` on the family's own decoded images: a few
    steps, a saved drafter that loads, and ``generate --method eagle`` with it equals greedy AR."""
    import numpy as np
    from PIL import Image

    from vvs_engine.cli import main
    from vvs_engine.training.family_images import encode_images, list_images

    path, hf, eng = request.getfixturevalue(family)
    size, c_len = ("64", "32") if family == "lumina" else ("32", "24")
    common = ["--model-dir", path, "--max-prompt-tokens", c_len, "--image-size", size]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    images = tmp_path / "images"
    assert main(["generate", *common, "--prompts", str(prompts), "--temperature", "1", "--seed", "1",
                 "--device", "cpu", "--out", str(images), "--quiet"]) == 0
    rows = encode_images(eng, path, list_images(str(images)))
    assert rows.shape == (2, eng.tokens_per_image)
    assert_lumina_layout(eng, rows)
    px = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1)
                      for p in list_images(str(images))]).float() / 127.5 - 1.0
    with torch.no_grad():  # the same codes as transformers' own encoder on the same pixels
        if family == "emu3":
            ref = torch.stack(hf.model.vqmodel.encode(px, torch.tensor([[px.shape[2], px.shape[3]]] * 2)).image_tokens)
        else:
            ref = hf.model.vqmodel.encode(px).image_tokens
    assert torch.equal(eng.gpt.codes_of(rows).view(2, -1), ref.reshape(2, -1))

    drafter = tmp_path / "drafter.safetensors"
    assert main(["train-drafter", *common, "--prompts", str(prompts), "--images", str(images), "--steps", "6",
                 "--batch-size", "2", "--out", str(drafter)]) == 0
    assert drafter.exists() and drafter.with_suffix(".json").exists()
    out = tmp_path / "eagle"
    assert main(["generate", *common, "--drafter", str(drafter), "--method", "eagle", "--prompts", str(prompts),
                 "--temperature", "0", "--cfg-scale", "3", "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    eagle = np.load(out / "tokens.npz")["tokens"]
    ar = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens
    np.testing.assert_array_equal(eagle, ar.numpy())
    assert json.loads((out / "stats.json").read_text())["method"] == "eagle"
    assert sorted(p.name for p in out.glob("*.png")) == ["000000.png", "000001.png", "grid.png"]


def test_train_drafter_images_need_one_prompt_each(lumina, tmp_path, capsys):
    from vvs_engine.cli import main

    path, _, _ = lumina
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n")
    images = tmp_path / "images"
    images.mkdir()
    assert main(["train-drafter", "--model-dir", path, "--image-size", "64", "--prompts", str(prompts),
                 "--images", str(images), "--out", str(tmp_path / "d.safetensors")]) == 1
    assert "no images" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["janus", "lumina", "emu3"])
def test_lantern_and_gsd_neighbourhoods_come_from_the_family_codebook(family, request):
    """LANTERN's neighbour table and GSD's unit codebook are built from the folder's own VQ embeddings
    (Janus: l2-normalised, as its quantizer uses them); the end-of-line token neighbours no code."""
    from safetensors.torch import load_file

    from vvs_engine.acceptance.gsd import DEFAULT_DIST_THRESHOLD, unit_codebook

    path, _, eng = request.getfixturevalue(family)
    sd = load_file(os.path.join(path, "model.safetensors"))
    emb = next(v for k, v in sd.items() if k.endswith("vqmodel.quantize.embedding.weight")).float()
    if family == "janus":
        emb = torch.nn.functional.normalize(emb, dim=-1)
    n, k = emb.shape[0], 5
    vectors = eng.codebook_vectors()
    torch.testing.assert_close(vectors[:n], emb, atol=1e-6, rtol=0)
    nb = eng.codebook_neighbors(k)
    d = torch.cdist(emb, emb)
    d.fill_diagonal_(float("inf"))
    ref = d.argsort(1)[:, :k]
    assert torch.equal(nb[:n], ref)  # each code's k nearest other codes, nearest first
    if family != "janus":  # the EOL row (index n) is in the methods' vocabulary but near no code
        assert eng.config.vocab_size == n + 1 and vectors.shape[0] == n + 1
        assert not (nb[:n] == n).any()
        cb = unit_codebook(eng, eng.config.vocab_size)  # GSD: EOL has no code, never within a distance
        torch.testing.assert_close(cb[:n], torch.nn.functional.normalize(emb, dim=-1))
        assert cb[n].isnan().all() and not (torch.cdist(cb[n:], cb[:n]) < DEFAULT_DIST_THRESHOLD).any()


def test_janus_images_encode_to_transformers_codes(janus, tmp_path):
    import numpy as np
    from PIL import Image

    from vvs_engine.training.family_images import encode_images, list_images

    path, hf, eng = janus
    for i, im in enumerate(eng.generate(prompts=PROMPTS, seed=2, cfg_scale=3.0).images):
        im.save(tmp_path / f"{i:02d}.png")
    rows = encode_images(eng, path, list_images(str(tmp_path)))
    px = torch.stack([torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1)
                      for p in list_images(str(tmp_path))]).float() / 127.5 - 1.0
    with torch.no_grad():
        ref = hf.model.vqmodel.encode(px).image_tokens.reshape(2, -1)
    assert rows.shape == (2, eng.tokens_per_image) and torch.equal(rows, ref)
