"""The `vvs-engine generate` contract end to end, every bad-input case of the Foundation issue, the
subcommand dispatch, and the CI script running the README's test command.

Models are tiny and random: a c2i GPT (dim 32, 2 layers, 4x4 tokens) and a VQ with downsampling 2, so
images are 8x8 px. They are saved as the project's safetensors + JSON config, which is how the engine
learns a config that is not one of the (large) published presets.
"""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spec_models import NUM_CLASSES, tiny_gpt_config, tiny_vq_config  # noqa: F401
from vvs_engine import Engine, VVSError
from vvs_engine.cli import main, method_options, build_parser
from vvs_engine.methods.options import method_flags
from vvs_engine.models.gpt import GPTConfig
from vvs_engine.models.vq import VQConfig, VQModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_SIZE = 8  # 4x4 tokens with the tiny tokenizer's downsampling of 2


def contract_argv(ckpts, out, **over):
    """The issue's contract command (tiny model: --image-size 8; --gpt-model is ignored when a config
    file sits next to the checkpoint)."""
    flags = {"--gpt-ckpt": ckpts["gpt"], "--gpt-model": "GPT-B", "--image-size": str(IMAGE_SIZE),
             "--class-labels": "3,1,3", "--cfg-scale": "4.0", "--temperature": "0", "--method": "ar",
             "--device": "cpu", "--vq-ckpt": ckpts["vq"], "--out": str(out), "--quiet": None}
    flags.update(over)
    argv = ["generate"]
    for k, v in flags.items():
        if v is False:
            continue
        argv += [k] if v is None else [k, v]
    return argv


# --- the contract ---------------------------------------------------------------------------------
def test_generate_contract(ckpts, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(contract_argv(ckpts, out)) == 0
    printed = capsys.readouterr().out
    assert "tpf" in printed and "target forward passes" in printed  # the stats table

    npz = np.load(out / "tokens.npz")
    tokens, labels = npz["tokens"], npz["labels"]
    assert tokens.dtype == np.int64 and tokens.shape == (3, 16)
    assert labels.tolist() == [3, 1, 3]
    assert tokens.min() >= 0 and tokens.max() < 64
    np.testing.assert_array_equal(tokens[0], tokens[2])  # greedy: a repeated label gives the same row


    stats = json.load(open(out / "stats.json"))
    for key in ("method", "n_images", "tokens_per_image", "target_forward_passes", "tokens_generated", "tpf",
                "wall_time_s"):
        assert key in stats, key
    assert stats["method"] == "ar" and stats["n_images"] == 3 and stats["tokens_per_image"] == 16
    assert stats["tokens_generated"] == 48
    assert stats["tpf"] == pytest.approx(stats["tokens_generated"] / stats["target_forward_passes"])

    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert pngs == ["000000.png", "000001.png", "000002.png", "grid.png"]
    from PIL import Image

    assert Image.open(out / pngs[0]).size == (IMAGE_SIZE, IMAGE_SIZE)
    # the contact sheet: the three images in one row, 2 px apart, in row order
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    assert grid.shape == (IMAGE_SIZE, 3 * IMAGE_SIZE + 2 * 2, 3)
    for i, name in enumerate(pngs[:3]):
        x0 = i * (IMAGE_SIZE + 2)
        assert np.array_equal(grid[:, x0:x0 + IMAGE_SIZE], np.asarray(Image.open(out / name).convert("RGB")))

    # The CLI and the Python API agree token for token.
    eng = Engine.load(gpt_ckpt=ckpts["gpt"], vq_ckpt=ckpts["vq"], device="cpu")
    api = eng.generate(class_labels=[3, 1, 3], temperature=0, cfg_scale=4.0, decode_images=False)
    np.testing.assert_array_equal(api.tokens.numpy(), tokens)


def test_generate_batch_size_flag(ckpts, tmp_path, capsys):
    """--batch-size reaches the engine (stats) and the tokens do not depend on it."""

    outs = {}
    for bs in ("1", "2"):
        out = tmp_path / f"out{bs}"
        assert main(contract_argv(ckpts, out, **{"--batch-size": bs, "--no-images": None})) == 0
        stats = json.load(open(out / "stats.json"))
        assert stats["batch_size"] == int(bs)
        assert set(stats["tpf_per_image"]) == {"min", "median", "max"}
        outs[bs] = np.load(out / "tokens.npz")["tokens"]
    assert "tpf per image" in capsys.readouterr().out
    np.testing.assert_array_equal(outs["1"], outs["2"])


def test_generate_subprocess_python_m(ckpts, tmp_path):
    """Once through a real process: `python -m vvs_engine` and the exit code."""
    out = tmp_path / "out"
    argv = contract_argv(ckpts, out, **{"--class-labels": "0", "--no-images": None})
    r = subprocess.run([sys.executable, "-m", "vvs_engine"] + argv, capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert np.load(out / "tokens.npz")["tokens"].shape == (1, 16)
    assert not [p for p in os.listdir(out) if p.endswith(".png")]

    bad = subprocess.run([sys.executable, "-m", "vvs_engine"] + contract_argv(ckpts, out, **{"--top-p": "2"}),
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1


def test_sampling_flags_and_seed(ckpts, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    common = {"--temperature": "1.0", "--top-k": "20", "--top-p": "0.9", "--class-labels": "1,2", "--no-images": None}
    assert main(contract_argv(ckpts, a, **common, **{"--seed": "5"})) == 0
    assert main(contract_argv(ckpts, b, **common, **{"--seed": "5"})) == 0
    assert main(contract_argv(ckpts, c, **common, **{"--seed": "6", "--dtype": "bf16"})) == 0
    ta, tb = np.load(a / "tokens.npz")["tokens"], np.load(b / "tokens.npz")["tokens"]
    np.testing.assert_array_equal(ta, tb)  # same seed, same tokens

    stats = json.load(open(c / "stats.json"))
    assert stats["dtype"] == "bfloat16" and stats["seed"] == 6
    assert stats["sampling"] == {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "cfg_scale": 4.0}


def test_method_flags_only_set_ones_are_passed():
    args = build_parser().parse_args(["generate", "--lantern-delta", "0.2", "--tree", "static", "--skip-interval", "3"])
    opts = method_options(args)
    assert {k for k, v in opts.items() if v is not None} == {"lantern_delta", "tree", "skip_interval"}
    assert opts["lantern_delta"] == 0.2 and opts["tree"] == "static" and opts["skip_interval"] == 3
    assert set(opts) == {fl.name for fl in method_flags()}
    assert "cascade_breadth_threshold" in opts and "gsd_prob_threshold" in opts


def test_profile_trace(ckpts, tmp_path):
    trace = tmp_path / "trace.json"
    argv = contract_argv(ckpts, tmp_path / "out", **{"--class-labels": "0", "--no-images": None,
                                                      "--profile": str(trace)})
    assert main(argv) == 0
    assert trace.exists() and trace.stat().st_size > 0


# --- bad input: one line, non-zero exit, no traceback -------------------------------------------------
def run_error(capsys, argv, expect_rc=1, match=None):
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert rc == expect_rc, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    if match:
        assert re.search(match, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def bad_files(ckpts):
    d = ckpts["dir"]
    files = {}
    files["empty"] = str(d / "empty.pt")
    open(files["empty"], "wb").close()
    files["text"] = str(d / "notes.pt")
    with open(files["text"], "w") as f:
        f.write("this is not a checkpoint\n")
    good = str(d / "official_tiny.pt")
    torch.save({"model": ckpts["sd"]}, good)
    raw = open(good, "rb").read()
    files["truncated"] = str(d / "truncated.pt")
    with open(files["truncated"], "wb") as f:
        f.write(raw[: len(raw) // 2])
    files["truncated_st"] = str(d / "truncated.safetensors")
    with open(files["truncated_st"], "wb") as f:
        f.write(open(ckpts["gpt"], "rb").read()[:200])
    files["no_tensors"] = str(d / "no_tensors.pt")
    torch.save({"model": {"a": 1}, "steps": 3}, files["no_tensors"])

    # Tiny-config variants (safetensors + the good JSON config next to them).
    cfg_json = open(ckpts["gpt"][: -len(".safetensors")] + ".json").read()

    def variant(name, sd):
        p = str(d / f"{name}.safetensors")
        save_file({k: v.contiguous() for k, v in sd.items()}, p)
        with open(p[: -len(".safetensors")] + ".json", "w") as f:
            f.write(cfg_json)
        return p

    sd = dict(ckpts["sd"])
    files["missing_key"] = variant("missing", {k: v for k, v in sd.items() if k != "layers.1.attention.wo.weight"})
    files["unexpected_key"] = variant("unexpected", {**sd, "layers.7.attention.wq.weight": torch.zeros(2, 2)})
    files["shape"] = variant("shape", {**sd, "norm.weight": torch.ones(33)})
    # Official container, GPT-B key names, but only the embedding (the loader builds GPT-B and names what is missing).
    files["gptb_partial"] = str(d / "gptb_partial.pt")
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(64, 768)}, "args": argparse.Namespace(gpt_model="GPT-B")},
               files["gptb_partial"])
    return files


@pytest.mark.parametrize("which, match", [
    ("empty", "empty"),
    ("text", "not a checkpoint"),
    ("truncated", "truncated"),
    ("truncated_st", "safetensors"),
    ("no_tensors", "no state_dict"),
    ("missing_key", r"missing keys layers\.1\.attention\.wo\.weight"),
    ("unexpected_key", r"unexpected keys layers\.7\.attention\.wq\.weight"),
    ("shape", r"shape mismatch: norm\.weight"),
])
def test_bad_checkpoint_files(ckpts, bad_files, tmp_path, capsys, which, match):
    run_error(capsys, contract_argv(ckpts, tmp_path, **{"--gpt-ckpt": bad_files[which]}), match=match)


def test_missing_checkpoint_file(ckpts, tmp_path, capsys):
    run_error(capsys, contract_argv(ckpts, tmp_path, **{"--gpt-ckpt": str(tmp_path / "nope.pt")}), match="not found")
    run_error(capsys, contract_argv(ckpts, tmp_path, **{"--vq-ckpt": str(tmp_path / "nope_vq.pt")}), match="not found")


def test_official_gptb_keys_missing_named(ckpts, bad_files, tmp_path, capsys):
    argv = contract_argv(ckpts, tmp_path, **{"--gpt-ckpt": bad_files["gptb_partial"], "--vq-ckpt": False,
                                             "--image-size": "256"})
    run_error(capsys, argv, match=r"missing keys cls_embedding\.embedding_table\.weight, layers\.0\.")


def test_official_checkpoint_needs_known_model_name(ckpts, bad_files, tmp_path, capsys):
    base = {"--gpt-ckpt": bad_files["gptb_partial"], "--vq-ckpt": False, "--image-size": "256"}
    run_error(capsys, contract_argv(ckpts, tmp_path, **base, **{"--gpt-model": "GPT-Q"}), match="unknown model 'GPT-Q'")
    run_error(capsys, contract_argv(ckpts, tmp_path, **base, **{"--gpt-model": False}), match="--gpt-model")


def test_unknown_vq_model(ckpts, tmp_path, capsys):
    vq_pt = str(tmp_path / "vq_official.pt")
    torch.save({"model": VQModel(tiny_vq_config()).state_dict()}, vq_pt)
    run_error(capsys, contract_argv(ckpts, tmp_path, **{"--vq-ckpt": vq_pt, "--vq-model": "VQ-99"}),
              match="unknown tokenizer 'VQ-99'")


@pytest.mark.parametrize("over, match", [
    ({"--class-labels": "3,10"}, r"class label 10 out of range \[0, 10\)"),
    ({"--class-labels": "-1"}, "out of range"),
    ({"--class-labels": "3,cat"}, "integers"),
    ({"--class-labels": "1.5"}, "integers"),
    ({"--class-labels": ""}, "integers"),
    ({"--image-size": "9"}, "multiple of the tokenizer's downsampling"),
    ({"--image-size": "16"}, "tokens but the model was trained for 16"),
    ({"--temperature": "-0.5"}, "temperature"),
    ({"--temperature": "nan"}, "temperature"),
    ({"--top-k": "-1"}, "top-k"),
    ({"--top-p": "0"}, "top-p"),
    ({"--top-p": "1.5"}, "top-p"),
    ({"--top-p": "nan"}, "top-p"),
    ({"--cfg-scale": "nan"}, "cfg-scale"),
    ({"--method": "warp-speed"}, "unknown method 'warp-speed'"),
    ({"--method": "ar", "--lantern-delta": "0.2"}, "--lantern-delta"),
    ({"--dtype": "fp8"}, "unknown dtype"),
    ({"--prompts": "/nonexistent/prompts.txt", "--class-labels": False}, "prompts"),
    ({"--prompts": "x.txt"}, "not both"),
    ({"--class-labels": False}, "--class-labels"),
    ({"--batch-size": "0"}, "batch-size"),
])
def test_bad_values(ckpts, tmp_path, capsys, over, match):
    run_error(capsys, contract_argv(ckpts, tmp_path / "out", **over), match=match)
    assert not (tmp_path / "out" / "tokens.npz").exists()


def test_prompts_for_class_model(ckpts, tmp_path, capsys):
    p = tmp_path / "prompts.txt"
    p.write_text("a red car\n")
    run_error(capsys, contract_argv(ckpts, tmp_path / "out", **{"--prompts": str(p), "--class-labels": False}),
              match="class-conditional")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda(ckpts, tmp_path, capsys):
    run_error(capsys, contract_argv(ckpts, tmp_path, **{"--device": "cuda"}), match="CUDA")


def test_argument_errors_exit_2(ckpts, tmp_path, capsys):
    run_error(capsys, contract_argv(ckpts, tmp_path, **{"--top-k": "1.5"}), expect_rc=2, match="--top-k")
    run_error(capsys, ["generate", "--no-such-flag"], expect_rc=2, match="unrecognized")
    run_error(capsys, [], expect_rc=2)
    run_error(capsys, ["frobnicate"], expect_rc=2, match="invalid choice")


def test_unwritable_output(ckpts, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run_error(capsys, contract_argv(ckpts, blocker / "out", **{"--class-labels": "0"}))


def test_api_engine_survives_errors(ckpts):
    eng = Engine.load(gpt_ckpt=ckpts["gpt"], vq_ckpt=ckpts["vq"], device="cpu")
    ref = eng.generate(class_labels=[2, 5], temperature=0, decode_images=False).tokens
    bad_calls = [
        dict(class_labels=[2, 99]), dict(class_labels=["x"]), dict(class_labels=[]),
        dict(class_labels=[1], temperature=float("nan")), dict(class_labels=[1], top_k=-2),
        dict(class_labels=[1], top_p=0.0), dict(class_labels=[1], method="nope"),
        dict(class_labels=[1], seed="s"), dict(prompts=["a cat"]),
    ]
    for kw in bad_calls:
        with pytest.raises(VVSError):
            eng.generate(**kw)
    with pytest.raises(VVSError):
        eng.score(class_labels=[1], tokens=torch.full((1, 4), 999))
    with pytest.raises(VVSError):
        eng.to("cuda:0") if not torch.cuda.is_available() else eng.to("cpu", "fp8")
    again = eng.generate(class_labels=[2, 5], temperature=0)
    assert torch.equal(again.tokens, ref)
    assert len(again.images) == 2


# --- other subcommands -----------------------------------------------------------------------------
def test_subcommand_dispatch(monkeypatch, tmp_path, capsys):
    import types

    calls = {}
    fake_bench = types.ModuleType("vvs_engine.evaluation.bench")
    fake_bench.main = lambda args: calls.setdefault("bench", args) and 0
    fake_drafter = types.ModuleType("vvs_engine.training.drafter")
    fake_drafter.cli_train = lambda args: calls.setdefault("drafter", args) and 0
    fake_eval = types.ModuleType("vvs_engine.evaluation.report")
    fake_eval.evaluate_dir = lambda d, o, inc: calls.setdefault("eval", (d, o, inc)) and {"class_accuracy": 1.0}
    monkeypatch.setitem(sys.modules, "vvs_engine.evaluation.bench", fake_bench)
    monkeypatch.setitem(sys.modules, "vvs_engine.training.drafter", fake_drafter)
    monkeypatch.setitem(sys.modules, "vvs_engine.evaluation.report", fake_eval)
    assert main(["bench", "--methods", "ar,vvs", "--steps", "3"]) == 0
    assert calls["bench"] == ["--methods", "ar,vvs", "--steps", "3"]
    assert main(["train-drafter", "--epochs", "1"]) == 0
    assert calls["drafter"] == ["--epochs", "1"]
    assert main(["eval", "--images", str(tmp_path), "--out", str(tmp_path / "m.json")]) == 0
    assert calls["eval"] == (str(tmp_path), None, True)  # the CLI writes the file itself, after printing
    assert "class_accuracy" in capsys.readouterr().out
    assert json.loads((tmp_path / "m.json").read_text()) == {"class_accuracy": 1.0}


def test_missing_optional_dependency_is_one_line(monkeypatch, capsys):
    import vvs_engine.cli as cli

    def import_module(name):
        raise ModuleNotFoundError("No module named 'skimage'", name="skimage")

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    run_error(capsys, ["bench"], match="needs the Python package 'skimage'")
    run_error(capsys, ["eval", "--images", "/nonexistent/dir"], match="not a folder")


# --- CI runs the README's test command verbatim ----------------------------------------------------
def readme_quick_start_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```[a-z]*\n(.*?)```", section, re.S).group(1)
    return [l for l in block.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_readme_quick_start_and_ci_script_agree():
    cmds = readme_quick_start_commands()
    assert len(cmds) == 2, cmds
    assert "vvs-engine generate" in cmds[0] and "pytest" in cmds[1]
    assert "torch==" in cmds[0] and "torch==" in cmds[1]
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    # The CI script either holds the command verbatim or extracts it from the README at run time.
    assert cmds[1] in ci or ("README.md" in ci and "Quick start" in ci)
    assert "set -euo pipefail" in ci


def test_ci_script_extracts_the_readme_command(tmp_path):
    """Run .ci/run in print-only mode: the command it would run is the README's second command."""
    r = subprocess.run(["bash", os.path.join(REPO, ".ci", "run"), "--print"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == readme_quick_start_commands()[1]


@pytest.mark.parametrize("exit_code, expect_rc, message", [(5, 1, "no tests"), (0, 0, None), (3, 3, None)])
def test_ci_script_exit_codes(tmp_path, exit_code, expect_rc, message):
    """.ci/run propagates the test command's exit code, except pytest's 5 (nothing collected): a failure."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text(open(os.path.join(REPO, ".ci", "run")).read())
    (tmp_path / "README.md").write_text(
        "# x\n\n## Quick start\n\n```bash\necho main job\n"
        f"python -c 'import sys; sys.exit({exit_code})'\n```\n\n## Next\n")
    r = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert r.returncode == expect_rc, r.stderr
    if message:
        assert message in r.stderr
