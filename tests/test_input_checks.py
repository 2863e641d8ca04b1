"""What a new user hits with bad input (issue 35): every case ends in one `error:` line and a non-zero
exit (no traceback), before any model loads or any memory is spent, or in the documented behaviour."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from dataset_utils import write_tiny_checkpoints
from vvs_engine import Engine, VVSError, dataset
from vvs_engine.cli import main
from vvs_engine.zoo import default_paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the input must be refused before."""
    import vvs_engine.engine as engine_mod

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(engine_mod.Engine, "load", classmethod(no_load))
    monkeypatch.setattr(dataset, "load_engine", no_load)


def one_line_error(capsys, argv, code=1) -> str:
    got = main(argv)
    err = capsys.readouterr().err.strip()
    assert got == code and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


# --- 1. nothing can exhaust the machine ---------------------------------------------------------------
def test_huge_label_ranges_refused_without_expanding_them(tmp_path, capsys, no_model_loads):
    """0-999999999999 would be a list of 10^12 ints (a MemoryError or a machine-wide OOM): it is
    counted, not expanded. The address-space cap makes an expanding implementation fail loudly."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    for command in ("generate", "generate-dataset"):
        err = one_line_error(capsys, [command, "--class-labels", "0-999999999999", "--out", str(tmp_path / "o"),
                                      "--threads", "1", "--quiet"])
        assert f"a job holds at most {dataset.MAX_IMAGES} images" in err and "0-999999999999" in err
    with pytest.raises(VVSError, match="at most"):
        dataset.parse_label_ranges(",".join(["0-999999"] * 11))  # 11 million in all, each range small
    assert len(dataset.parse_label_ranges("0-999999")) == 10 ** 6
    assert (soft, hard) == resource.getrlimit(resource.RLIMIT_AS)


def test_huge_per_class_refused_before_planning(tmp_path, capsys, no_model_loads):
    out = tmp_path / "d"
    t = time.perf_counter()
    err = one_line_error(capsys, ["generate-dataset", "--class-labels", "0-1", "--per-class", "1000000000000",
                                  "--out", str(out), "--quiet"])
    assert time.perf_counter() - t < 30
    assert "2 conditions x --per-class 1000000000000 = 2000000000000 images" in err
    assert f"at most {dataset.MAX_IMAGES} images" in err
    assert not out.exists()  # refused before the folder (or its manifest) was made
    with pytest.raises(VVSError, match="per-class"):  # the Python API refuses it the same way
        dataset.generate(str(out), class_labels=[0, 1], per_condition=10 ** 12, progress=False)


# --- 7. consistent errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "generate-dataset"])
@pytest.mark.parametrize("flag,value,message", [
    ("--top-p", "2", "error: --top-p must be in (0, 1]"),
    ("--top-k", "-1", "error: --top-k must be an integer >= 0"),
    ("--temperature", "-1", "error: --temperature must be a finite number"),
    ("--cfg-scale", "-1", "error: --cfg-scale must be a finite number"),
    ("--seed", str(2 ** 64), "error: --seed must fit in 64 bits"),
])
def test_option_names_are_flags_in_every_message(tmp_path, capsys, no_model_loads, command, flag, value, message):
    err = one_line_error(capsys, [command, "--class-labels", "0-3", "--out", str(tmp_path / "o"), "--quiet", flag,
                                  value])
    assert err.startswith(message), err


def test_dataset_flags_named_as_flags(tmp_path, capsys, no_model_loads):
    base = ["generate-dataset", "--class-labels", "0-3", "--out", str(tmp_path / "d"), "--quiet"]
    err = one_line_error(capsys, base + ["--per-class", "0"])
    assert err == "error: --per-class must be an integer >= 1, got 0"
    err = one_line_error(capsys, base + ["--max-retries", "-1"])
    assert err == "error: --max-retries must be an integer >= 0, got -1"


def test_batch_memory_hint_names_the_flag(tmp_path, capsys, no_model_loads):
    err = one_line_error(capsys, ["generate", "--class-labels", ",".join(["0"] * 100000), "--batch-size", "100000",
                                  "--out", str(tmp_path / "o"), "--quiet", "--threads", "1"])
    assert "a batch of 100000 images needs about" in err
    assert re.search(r"use --batch-size <= \d+|even one image does not fit", err), err


@pytest.mark.parametrize("shard,suggested", [(8, "e.g. --shard-size 16"), (20, "e.g. --shard-size 16 or 32"),
                                              (40, "e.g. --shard-size 32 or 48")])
def test_shard_size_suggestion_names_each_size_once(tmp_path, capsys, no_model_loads, shard, suggested):
    err = one_line_error(capsys, ["generate-dataset", "--class-labels", "0-3", "--out", str(tmp_path / "d"),
                                  "--quiet", "--static-batches", "--shard-size", str(shard)])
    assert err.startswith(f"error: --shard-size {shard} must be a multiple of the --batch-size 16"), err
    assert err.endswith(suggested), err


@pytest.mark.parametrize("command", ["generate", "generate-dataset"])
def test_empty_out_refused(tmp_path, monkeypatch, capsys, no_model_loads, command):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, [command, "--class-labels", "1", "--out", "", "--quiet"])
    assert err.startswith("error: --out is empty"), err
    assert os.listdir(tmp_path) == []


def test_class_label_ranges_read_alike_by_both_commands(tmp_path, monkeypatch, capsys):
    """generate takes generate-dataset's syntax ("0-3", "0,3,7-9") and refuses the same spellings."""
    from vvs_engine.cli import parse_class_labels

    for text in ("0-3", "0,3,7-9", "5", " 2 - 4 ,1"):
        assert parse_class_labels(text) == dataset.parse_label_ranges(text)
    for bad in ("3-1", "a", "1-", ""):
        with pytest.raises(VVSError) as via_generate:
            parse_class_labels(bad)
        with pytest.raises(VVSError) as via_dataset:
            dataset.parse_label_ranges(bad)
        assert str(via_generate.value) == str(via_dataset.value)
    seen = {}

    def fake_generate(self, **kw):
        seen["labels"] = kw["class_labels"]
        raise VVSError("stop here")

    monkeypatch.setattr(Engine, "generate", fake_generate)
    one_line_error(capsys, ["generate", "--class-labels", "0-3", "--out", str(tmp_path / "o"), "--quiet",
                            "--threads", "1"])
    assert seen["labels"] == [0, 1, 2, 3]


# --- 2. configs are validated, with the key and the file named ---------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoints(str(tmp_path_factory.mktemp("tiny")))


def edited_copy(tmp_path, weights: str, edit) -> str:
    """A copy of a project checkpoint whose JSON config is ``edit(meta)`` (returns the new JSON value)."""
    from vvs_engine.checkpoint import config_path

    copy = str(tmp_path / os.path.basename(weights))
    shutil.copy(weights, copy)
    with open(config_path(weights)) as f:
        meta = json.load(f)
    with open(config_path(copy), "w") as f:
        json.dump(edit(meta), f)
    return copy


def with_config(**changes):
    def edit(meta):
        meta["config"].update(changes)
        meta["config"] = {k: v for k, v in meta["config"].items() if v is not DROP}
        return meta
    return edit


DROP = object()
GPT_CONFIG_CASES = [
    (lambda m: {k: v for k, v in m.items() if k != "config"}, r'"config" is missing'),
    (lambda m: [m], r"must be a JSON object with \"kind\" and \"config\", got a list"),
    (lambda m: {k: v for k, v in m.items() if k != "kind"}, r'"kind" is missing \(expected "gpt"'),
    (lambda m: dict(m, kind="vq"), r'is a VQ tokenizer checkpoint \("kind": "vq" in .*gpt.json\), not a target model'),
    (with_config(n_layer="six"), r'"n_layer" must be an integer >= 1, got "six"'),
    (with_config(n_layer=DROP), r'"n_layer" is missing'),
    (with_config(n_layer=3), r'"n_layer" is 3 but the weights hold 2 layers'),
    (with_config(n_layer=0), r'"n_layer" must be an integer >= 1, got 0'),
    (with_config(vocab_size=128), r'"vocab_size" and "dim" give tok_embeddings.weight the shape \(128, 32\), but the '
                                  r'weights have \(64, 32\)'),
    (with_config(num_classes=1000), r'"num_classes".*\(1001, 32\), but the weights have \(11, 32\)'),
    (with_config(model_type="x2i"), r'"model_type" must be "c2i" or "t2i", got "x2i"'),
    (with_config(block_size=15), r'"block_size" 15 must be a perfect square'),
    (with_config(norm_eps=None), r'"norm_eps" must be a number >= 0, got null'),
    (with_config(multiple_of=64), r'"multiple_of" and "ffn_dim_multiplier" give layers.0.feed_forward.w1.weight'),
]


@pytest.mark.parametrize("edit,match", GPT_CONFIG_CASES)
def test_gpt_config_checked_with_field_and_file_named(tmp_path, capsys, tiny, edit, match):
    gpt = edited_copy(tmp_path, tiny["gpt_ckpt"], edit)
    with pytest.raises(VVSError, match=match) as e:
        Engine.load(gpt_ckpt=gpt, vq_ckpt=tiny["vq_ckpt"])
    assert "gpt.json" in str(e.value) and "\n" not in str(e.value)
    for image_size in ([], ["--image-size", "8"]):  # with the config peeked before loading, and without
        err = one_line_error(capsys, ["generate", "--gpt-ckpt", gpt, "--vq-ckpt", tiny["vq_ckpt"], "--class-labels",
                                      "1", "--out", str(tmp_path / "o"), "--quiet", "--threads", "1"] + image_size)
        assert re.search(match, err), err


def test_gpt_config_checked_before_a_dataset_job(tmp_path, capsys, tiny, no_model_loads):
    gpt = edited_copy(tmp_path, tiny["gpt_ckpt"], with_config(n_layer="six"))
    err = one_line_error(capsys, ["generate-dataset", "--gpt-ckpt", gpt, "--vq-ckpt", tiny["vq_ckpt"],
                                  "--class-labels", "1", "--out", str(tmp_path / "d"), "--quiet"])
    assert '"n_layer" must be an integer >= 1, got "six"' in err


@pytest.mark.parametrize("edit,match", [
    (with_config(codebook_size=128), r'"codebook_size" and "codebook_embed_dim" give quantize.embedding.weight'),
    (with_config(encoder_ch_mult=[1, 1, 2]), r'"encoder_ch_mult" has 3 levels but the weights hold 2'),
    (with_config(encoder_ch_mult=[]), r'"encoder_ch_mult" must be a non-empty list of integers'),
    (with_config(codebook_l2_norm="yes"), r'"codebook_l2_norm" must be true or false, got "yes"'),
    (with_config(z_channels=DROP), r'"z_channels" is missing'),
    (lambda m: dict(m, kind="gpt"), r"is a target model checkpoint .* not a VQ tokenizer"),
])
def test_vq_config_checked(tmp_path, tiny, edit, match):
    vq = edited_copy(tmp_path, tiny["vq_ckpt"], edit)
    with pytest.raises(VVSError, match=match) as e:
        Engine.load(gpt_ckpt=tiny["gpt_ckpt"], vq_ckpt=vq)
    assert "vq.json" in str(e.value)


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    from vvs_engine.checkpoint import save_safetensors
    from vvs_engine.drafting.drafter import Drafter, DrafterConfig

    cfg = DrafterConfig(dim=32, n_head=2)
    path = str(tmp_path_factory.mktemp("drafter") / "drafter.safetensors")
    save_safetensors(Drafter(cfg), path, cfg.to_dict(), kind="drafter")
    return path


@pytest.mark.parametrize("edit,match", [
    (with_config(n_head="two"), r'"n_head" must be an integer >= 1, got "two"'),
    (with_config(n_layer=2), r'"n_layer" is 2 but the weights hold 1 layers'),
    (with_config(dim=DROP), r'"dim" is missing'),
    (with_config(ffn_hidden=7), r'"ffn_hidden" .* give layers.0.mlp.gate_proj.weight the shape \(7, 32\)'),
])
def test_drafter_config_checked(tmp_path, tiny, tiny_drafter, edit, match):
    drafter = edited_copy(tmp_path, tiny_drafter, edit)
    with pytest.raises(VVSError, match=match) as e:
        Engine.load(gpt_ckpt=tiny["gpt_ckpt"], drafter=drafter)
    assert "drafter.json" in str(e.value)


def test_lantern_drafter_config_checked(tmp_path, tiny, tiny_drafter):
    """LANTERN's folder format (pytorch_model.bin + Hugging Face config.json): its field names are named."""
    from safetensors.torch import load_file

    folder = tmp_path / "lantern"
    folder.mkdir()
    torch.save(load_file(tiny_drafter), folder / "pytorch_model.bin")
    llama = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6}
    (folder / "config.json").write_text(json.dumps(llama))
    weights = str(folder / "pytorch_model.bin")
    assert Engine.load(gpt_ckpt=tiny["gpt_ckpt"], drafter=weights).drafter is not None  # the control
    for change, match in (({"hidden_size": None}, r'"hidden_size" must be an integer >= 1, got null'),
                          ({"num_attention_heads": "2"}, r'"num_attention_heads" must be an integer'),
                          ({"num_hidden_layers": 3}, r'"n_layer" is 3 but the weights hold 1 layers')):
        (folder / "config.json").write_text(json.dumps(dict(llama, **change)))
        with pytest.raises(VVSError, match=match) as e:
            Engine.load(gpt_ckpt=tiny["gpt_ckpt"], drafter=weights)
        assert "config.json" in str(e.value)


def test_checkpoint_of_another_kind_says_which(tmp_path, capsys, no_model_loads):
    """--drafter zoo-vq.safetensors said "no config next to it"; now the file's kind is named (before loading)."""
    vq = default_paths()["vq"]
    err = one_line_error(capsys, ["generate", "--method", "eagle", "--drafter", vq, "--class-labels", "1", "--out",
                                  str(tmp_path / "o"), "--quiet", "--threads", "1"])
    assert "zoo-vq.safetensors is a VQ tokenizer checkpoint" in err and "not a drafter" in err, err
    err = one_line_error(capsys, ["generate", "--gpt-ckpt", vq, "--class-labels", "1", "--out", str(tmp_path / "o"),
                                  "--quiet", "--threads", "1"])
    assert "zoo-vq.safetensors is a VQ tokenizer checkpoint" in err and "not a target model" in err, err


def test_unknown_presets_refused(tmp_path, capsys, no_model_loads):
    import vvs_engine.engine as engine_mod

    with pytest.raises(VVSError, match=r"unknown tokenizer 'VQ-99' \(vq_model\); known: VQ-16, VQ-8"):
        engine_mod.check_load_args(vq_model="VQ-99")
    err = one_line_error(capsys, ["generate", "--vq-model", "VQ-99", "--class-labels", "1", "--out",
                                  str(tmp_path / "o"), "--quiet"])
    assert err == "error: unknown tokenizer 'VQ-99' (--vq-model); known: VQ-16, VQ-8"


def test_engine_load_refuses_an_unknown_vq_preset():
    with pytest.raises(VVSError, match=r"unknown tokenizer 'VQ-99' \(vq_model\)"):
        Engine.load(vq_model="VQ-99")


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this should never run",))


def test_unsafe_pickles_refused_as_unsafe(tmp_path):
    import pickle

    from vvs_engine.checkpoint import read_state_dict

    in_torch_file = tmp_path / "torch.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "extra": RunsCode()}, in_torch_file)
    plain_pickle = tmp_path / "plain.pt"
    with open(plain_pickle, "wb") as f:
        pickle.dump({"model": RunsCode()}, f)
    truncated = tmp_path / "cut.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    for path in (in_torch_file, plain_pickle):
        with pytest.raises(VVSError, match="refused to unpickle .* as unsafe") as e:
            read_state_dict(str(path))
        assert "truncated" not in str(e.value)
    with pytest.raises(VVSError, match="posix.system|nt.system"):
        read_state_dict(str(in_torch_file))
    with pytest.raises(VVSError, match="truncated"):  # a damaged file still says so
        read_state_dict(str(truncated))


def test_eval_names_the_png_names_it_reads(tmp_path, capsys):
    from PIL import Image

    for name in ("cat.png", "dog.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    err = one_line_error(capsys, ["eval", "--images", str(tmp_path), "--no-inception", "--threads", "1"])
    assert "holds 2 PNGs (e.g. cat.png) but none named as eval reads them: 000000.png, 000001.png" in err


# --- 3. checks before work; generate-dataset's interruptions -------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "generate-dataset"])
def test_unknown_acceptance_rule_refused_before_loading(tmp_path, capsys, no_model_loads, command):
    err = one_line_error(capsys, [command, "--method", "eagle", "--accept", "bogus", "--class-labels", "1", "--out",
                                  str(tmp_path / "o"), "--quiet", "--threads", "1"])
    assert err.startswith("error: unknown acceptance rule 'bogus'; known: exact"), err


@pytest.mark.parametrize("command", ["generate", "generate-dataset"])
def test_prompts_for_a_class_model_refused_before_loading(tmp_path, capsys, no_model_loads, command):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    err = one_line_error(capsys, [command, "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--quiet",
                                  "--threads", "1"])
    assert err == "error: this model is class-conditional: pass class labels, not a prompts file"
    err = one_line_error(capsys, [command, "--class-labels", "0-16", "--out", str(tmp_path / "o"), "--quiet",
                                  "--threads", "1"])
    assert err == "error: class label 16 out of range [0, 16)"  # the Zoo's 16 classes, from its config


def test_ctrl_c_while_starting_is_one_line():
    """SIGINT while the command imports torch: `error: interrupted`, exit 130, no traceback. A library
    import (python -c "import vvs_engine") is left alone: there Ctrl-C stays a KeyboardInterrupt."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    library = "import vvs_engine, time; print('imported', flush=True); time.sleep(60)"
    for argv, as_command in (([sys.executable, "-m", "vvs_engine", "zoo", "list"], True),
                             ([sys.executable, "-c", library], False)):
        # SIGINT as a fresh shell would give it: an ignored signal is inherited across exec, and Python
        # installs no KeyboardInterrupt handler for a SIGINT it starts with ignored (some earlier test of a
        # whole-suite run can leave it ignored in this process)
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        if as_command:
            time.sleep(0.4)  # Python is up; importing torch takes seconds
        else:  # after the import (on a loaded machine a signal during interpreter start-up may be lost)
            assert proc.stdout.readline() == "imported\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if as_command:
            assert proc.returncode == 130 and err == "error: interrupted\n", err
        else:
            assert "KeyboardInterrupt" in err and proc.returncode != 0


def dataset_command(tiny, out):
    return [sys.executable, "-m", "vvs_engine", "generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt",
            tiny["vq_ckpt"], "--image-size", "8", "--device", "cpu", "--class-labels", "0-9", "--per-class", "12",
            "--shard-size", "4", "--batch-size", "2", "--seed", "3", "--threads", "1", "--quiet", "--out", str(out)]


def start_and_wait_for_shard(cmd, out, shard: int):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 240
    while not (out / f"shard-{shard:05d}.npz").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    return proc


def last_run(out) -> dict:
    with open(out / "manifest.json") as f:
        return json.load(f)["runs"][-1]


def test_sigterm_ends_a_dataset_run_like_ctrl_c(tiny, tmp_path):
    out = tmp_path / "d"
    proc = start_and_wait_for_shard(dataset_command(tiny, out), out, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 143 and lines[-1] == "error: terminated", err
    assert "shards are complete" in lines[-2] and "run the same command again" in lines[-2], err
    assert "Traceback" not in err
    run = last_run(out)
    complete = sorted(n for n in os.listdir(out) if n.startswith("shard-"))
    assert "interrupted" in run and run["images"] == 4 * len(complete)
    assert [e["shard"] for e in run["shards"]] == list(range(len(complete)))
    assert all(e["wall_s"] > 0 and e["decode_s"] > 0 for e in run["shards"])
    assert f"{len(complete)} of 30 shards are complete" in lines[-2]


def test_live_run_locks_its_folder_and_a_killed_one_leaves_no_stale_lock(tiny, tmp_path, capsys):
    """A second run into a folder that a live run writes is refused; kill -9 of the live run frees the folder
    at once (a kernel lock, no lock file); the per-shard times it recorded survive the kill."""
    out = tmp_path / "d"
    cmd = dataset_command(tiny, out)
    proc = start_and_wait_for_shard(cmd, out, 2)
    try:
        err = one_line_error(capsys, cmd[3:])
        assert "is being written by another generate-dataset run" in err, err
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    run = last_run(out)  # written after every shard, not only at the end
    assert len(run["shards"]) >= 3 and all(e["wall_s"] > 0 for e in run["shards"])
    assert not any(n.endswith(".lock") for n in os.listdir(out))
    assert main(cmd[3:]) == 0  # not refused: the killed run holds nothing
    assert len([n for n in os.listdir(out) if n.startswith("shard-")]) == 30


def test_interrupt_summary_does_not_count_a_truncated_shard(tiny, tmp_path):
    from vvs_engine.dataset_cli import resume_hint

    out = tmp_path / "d"
    dataset.generate(str(out), class_labels=[1, 2, 3], per_condition=2, shard_size=2, batch_size=1, model=tiny,
                     threads=1, progress=False, decode_images=False)
    assert "3 of 3 shards are complete" in resume_hint(str(out))
    shard = out / "shard-00001.npz"
    shard.write_bytes(shard.read_bytes()[:100])  # a damaged file: the re-run redoes it
    assert "2 of 3 shards are complete" in resume_hint(str(out))


# --- 4. no stray files ---------------------------------------------------------------------------------------
def test_bench_writes_where_out_says_and_by_default_in_the_current_folder(tmp_path, monkeypatch):
    from vvs_engine.evaluation import bench

    monkeypatch.chdir(tmp_path)
    assert bench.parse_args([]).out == "bench-results"  # relative: the current folder, not a checkout
    assert bench.parse_args(["--out", str(tmp_path / "mine")]).out == str(tmp_path / "mine")
    written = {}

    def fake_write_report(result, out_dir, tag, plot=True):
        written["out"] = out_dir
        os.makedirs(out_dir, exist_ok=True)
        paths = [os.path.join(out_dir, f"e2e_{tag}.{ext}") for ext in ("json", "md")]
        for path in paths:
            open(path, "w").write("{}")
        return paths

    monkeypatch.setattr(bench, "write_report", fake_write_report)
    monkeypatch.setattr(bench, "time_setting", lambda eng, s, args, label: {"setting": s.label})
    monkeypatch.setattr(bench, "add_speedups", lambda rows: None)
    before = sorted(os.listdir(os.path.join(REPO, "benchmarks", "results")))
    assert main(["bench", "--quick", "--settings", "ar", "--no-plot", "--device", "cpu"]) == 0
    assert written["out"] == "bench-results" and os.path.isdir(tmp_path / "bench-results")
    assert sorted(os.listdir(os.path.join(REPO, "benchmarks", "results"))) == before


def test_eval_writes_beside_the_images_by_default(tmp_path, monkeypatch, capsys):
    from vvs_engine.cli import build_parser

    images = tmp_path / "run"
    images.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    import vvs_engine.evaluation.report as report

    monkeypatch.setattr(report, "evaluate_dir", lambda d, o, inception: {"class_accuracy": 1.0})
    assert main(["eval", "--images", str(images), "--threads", "1"]) == 0
    assert json.loads((images / "metrics.json").read_text()) == {"class_accuracy": 1.0}
    assert os.listdir(elsewhere) == []
    eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
    assert "beside the images" in eval_parser.format_help()
    capsys.readouterr()
    err = one_line_error(capsys, ["eval", "--images", str(images), "--out", ""])
    assert err.startswith("error: --out is empty")


def test_suite_caches_are_in_a_temporary_folder():
    """tests/conftest.py points every cache the code and torch's compiler write at one temporary folder."""
    # the variables tests/conftest.py sets (a conftest is not importable by name: tests/kernels has one too)
    for name in ("VVS_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR", "HF_HOME"):
        assert os.path.commonpath([os.environ[name], tempfile.gettempdir()]) == tempfile.gettempdir(), name
    from vvs_engine.evaluation.quality import _cache_dir

    assert _cache_dir().startswith(tempfile.gettempdir())
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir().startswith(tempfile.gettempdir())
