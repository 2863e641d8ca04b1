"""The text path: a tiny random T5 encoder and a locally built tokenizer stand in for flan-t5;
LlamaGen's left-padding convention; a tiny t2i GPT generating from prompts through the Engine and CLI."""
import numpy as np
import pytest
import torch

from vvs_engine import Engine, VVSError
from vvs_engine.checkpoint import save_safetensors
from vvs_engine.models.gpt import GPT, GPTConfig
from vvs_engine.models.t5 import CaptionEncoder, left_pad

CAPTION_DIM = 16
N_TOKENS = 12  # caption tokens of the tiny model (LlamaGen: 120)
WORDS = "a photo of the cat dog red blue car on street small big sitting green tree under".split()


def build_tiny_t5(path, d_model=CAPTION_DIM):
    """A T5EncoderModel with tiny sizes and a WordLevel tokenizer (pad 0, eos 1, unk 2, T5-style
    `</s>` appended), saved like a downloaded flan-t5 folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))
    cfg = T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    T5EncoderModel(cfg).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return build_tiny_t5(tmp_path_factory.mktemp("flan_t5_tiny"))


@pytest.fixture(scope="module")
def encoder(t5_dir):
    return CaptionEncoder(t5_dir, N_TOKENS)


def test_left_pad_by_hand():
    emb = torch.arange(1, 6, dtype=torch.float32)[None, :, None].repeat(2, 1, 2)  # features 1..5
    mask = torch.tensor([[True, True, False, False, False], [True, True, True, True, True]])
    out, m = left_pad(emb, mask)
    assert m.tolist() == [[False, False, False, True, True], [True] * 5]
    assert out[0, :, 0].tolist() == [0, 0, 0, 1, 2]  # valid tokens rolled to the end, padding zeroed
    assert out[1, :, 0].tolist() == [1, 2, 3, 4, 5]


def test_encode_shapes_and_left_padding(encoder):
    prompts = ["a red car", "a photo of the big green tree under the blue street"]
    emb, mask = encoder.encode(prompts)
    assert emb.shape == (2, N_TOKENS, CAPTION_DIM) and emb.dtype == torch.float32
    assert mask.shape == (2, N_TOKENS) and mask.dtype == torch.bool
    n_valid = mask.sum(1).tolist()
    assert n_valid == [4, 12]  # 3 words + </s>; the long prompt is truncated to the caption length
    assert not mask[0, :8].any() and mask[0, 8:].all()  # left padding
    assert torch.count_nonzero(emb[0, :8]) == 0
    assert torch.count_nonzero(emb[0, 8:]) > 0


def test_valid_features_equal_the_unpadded_encoding(encoder):
    emb, mask = encoder.encode(["the small dog sitting on a car"])
    ids = encoder.tokenizer(["the small dog sitting on a car"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = encoder.model(input_ids=ids).last_hidden_state
    n = ids.shape[1]
    torch.testing.assert_close(emb[0, -n:], plain[0], atol=1e-5, rtol=1e-5)


def test_default_caption_length_is_120(t5_dir):
    emb, mask = CaptionEncoder(t5_dir).encode(["a cat"])
    assert emb.shape == (1, 120, CAPTION_DIM) and mask.sum() == 3


def test_bad_inputs(t5_dir, tmp_path, encoder):
    with pytest.raises(VVSError, match="not a directory"):
        CaptionEncoder(str(tmp_path / "nope"))
    with pytest.raises(VVSError, match="cannot load"):
        CaptionEncoder(str(tmp_path))
    with pytest.raises(VVSError):
        encoder.encode([])


# --- a tiny t2i model end to end -------------------------------------------------------------------
@pytest.fixture(scope="module")
def t2i_ckpt(tmp_path_factory):
    torch.manual_seed(5)
    cfg = GPTConfig(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=64, block_size=16, model_type="t2i",
                    cls_token_num=N_TOKENS, caption_dim=CAPTION_DIM)
    path = str(tmp_path_factory.mktemp("t2i") / "t2i.safetensors")
    save_safetensors(GPT(cfg), path, cfg.to_dict(), kind="gpt")
    return path


def test_t2i_generation_through_engine(t2i_ckpt, t5_dir):
    eng = Engine.load(gpt_ckpt=t2i_ckpt, t5_path=t5_dir, device="cpu")
    assert eng.caption_encoder is not None and eng.caption_encoder.n_tokens == N_TOKENS
    prompts = ["a red car", "a photo of a big dog sitting under the green tree"]
    out = eng.generate(prompts=prompts, temperature=0, cfg_scale=4.0)
    assert out.tokens.shape == (2, 16) and out.prompts == prompts
    # Padded caption positions are masked: a prompt's image does not depend on its batch neighbours.
    alone = eng.generate(prompts=prompts[:1], temperature=0, cfg_scale=4.0).tokens
    assert torch.equal(alone[0], out.tokens[0])
    # Teacher-forced scoring agrees with greedy decoding under CFG.
    logits = eng.score(prompts=prompts, tokens=out.tokens, cfg_scale=4.0)
    assert torch.equal(logits.argmax(-1), out.tokens)
    with pytest.raises(VVSError, match="prompts, not class labels"):
        eng.generate(class_labels=[1])
    assert eng.generate(prompts=prompts[1:], temperature=0).tokens.shape == (1, 16)  # still usable


def test_t2i_cli(t2i_ckpt, t5_dir, tmp_path, capsys):
    from vvs_engine.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red car\n\na blue tree\n")
    out = tmp_path / "out"
    rc = main(["generate", "--gpt-ckpt", t2i_ckpt, "--t5-path", t5_dir, "--prompts", str(prompts),
               "--temperature", "0", "--device", "cpu", "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    npz = np.load(out / "tokens.npz")
    assert npz["tokens"].shape == (2, 16) and npz["prompts"].tolist() == ["a red car", "a blue tree"]
    # Without a T5 directory a text-conditional model cannot run: one-line error.
    rc = main(["generate", "--gpt-ckpt", t2i_ckpt, "--prompts", str(prompts), "--device", "cpu",
               "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and "T5" in err


def test_caption_width_mismatch_is_an_error(t2i_ckpt, tmp_path, capsys):
    from vvs_engine.cli import main

    wide = build_tiny_t5(tmp_path / "wide_t5", d_model=24)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    rc = main(["generate", "--gpt-ckpt", t2i_ckpt, "--t5-path", wide, "--prompts", str(prompts), "--device", "cpu",
               "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and "channels" in err


def test_captions_are_cleaned_by_default(encoder, t2i_ckpt, t5_dir, tmp_path, capsys):
    """The tokenizer is case-sensitive (as flan-t5's is): "A Red CAR" only maps to the same features as
    "a red car" after LlamaGen's cleaning, which is on by default and off with clean=False."""
    raw, clean = "A Red CAR!  <b>https://example.com</b>", "a red car!"
    e_raw, m_raw = encoder.encode([raw])
    e_clean, m_clean = encoder.encode([clean])
    assert torch.equal(e_raw, e_clean) and torch.equal(m_raw, m_clean)
    e_off, _ = encoder.encode([raw], clean=False)
    assert not torch.equal(e_off, e_clean)

    eng = Engine.load(gpt_ckpt=t2i_ckpt, t5_path=t5_dir, device="cpu")
    a = eng.generate(prompts=["A RED Car"], temperature=0).tokens
    b = eng.generate(prompts=["a red car"], temperature=0).tokens
    c = eng.generate(prompts=["A RED Car"], temperature=0, clean_captions=False).tokens
    assert torch.equal(a, b)
    e_upper, _ = encoder.encode(["A RED Car"], clean=False)
    assert not torch.equal(e_upper, encoder.encode(["a red car"])[0])  # the uncleaned features differ
    assert c.shape == a.shape

    from vvs_engine.cli import main

    p = tmp_path / "p.txt"
    p.write_text("A RED Car\n")
    for flag, expect in (([], a), (["--no-clean-captions"], c)):
        out = tmp_path / ("o" + str(len(flag)))
        assert main(["generate", "--gpt-ckpt", t2i_ckpt, "--t5-path", t5_dir, "--prompts", str(p), "--temperature",
                     "0", "--device", "cpu", "--out", str(out), "--quiet", "--threads", "1"] + flag) == 0
        assert np.array_equal(np.load(out / "tokens.npz")["tokens"], expect.numpy())
