"""generate-dataset in one process: condition files, identity under any sharding, resume after a crash,
an interrupted run leaves only complete shards, a changed job is refused, eval reads the folder.

Every test uses a tiny random model (16 tokens per image, fp32 as the CLI loads it) so many shards are
cheap; the shipped Zoo model's dataset runs are covered by the README commands (tests/test_newcomer.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dataset_utils import failing_factory, read_all, write_tiny_checkpoints
from vvs_engine import Engine, VVSError, dataset
from vvs_engine.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoints(str(tmp_path_factory.mktemp("tiny")))


def tiny_job(out, tiny, **kw):
    args = dict(class_labels=[3, 1, 4, 1, 5], per_condition=2, shard_size=3, batch_size=1, seed=7, model=tiny,
                threads=1, progress=False)
    args.update(kw)
    return dataset.generate(str(out), **args)


# --- conditions ---------------------------------------------------------------------------------
def test_label_ranges_and_file(tmp_path):
    assert dataset.parse_label_ranges("0-3,7, 9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert dataset.parse_label_ranges("5") == [5]
    for bad in ("3-1", "a", "1-", ""):
        with pytest.raises(VVSError):
            dataset.parse_label_ranges(bad)
    p = tmp_path / "labels.txt"
    p.write_text("0-2\n5, 7\n\n9\n")
    assert dataset.read_labels_file(str(p)) == [0, 1, 2, 5, 7, 9]


def test_prompt_files(tmp_path):
    coco = tmp_path / "coco.json"
    coco.write_text(json.dumps(["A cat on a mat. ", "Two dogs"]))
    assert dataset.read_prompt_file(str(coco)) == ([0, 1], ["A cat on a mat.", "Two dogs"])
    ann = tmp_path / "captions_val.json"
    ann.write_text(json.dumps({"annotations": [{"image_id": 9, "id": 41, "caption": "a red bus"},
                                               {"image_id": 9, "id": 17, "caption": "a bus\n"}]}))
    assert dataset.read_prompt_file(str(ann)) == ([41, 17], ["a red bus", "a bus"])
    tsv = tmp_path / "parti.tsv"
    tsv.write_text("Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\t\n"
                   "a \"quoted\" word\tArts\tBasic\tnote\n")
    assert dataset.read_prompt_file(str(tsv)) == ([0, 1], ["bond", 'a "quoted" word'])
    txt = tmp_path / "prompts.txt"
    txt.write_text("first\n\n second \n")
    assert dataset.read_prompt_file(str(txt)) == ([0, 2], ["first", "second"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"images": []}')
    for path, match in ((bad, "COCO"), (tmp_path / "none.txt", "cannot read")):
        with pytest.raises(VVSError, match=match):
            dataset.read_prompt_file(str(path))
    (tmp_path / "noheader.tsv").write_text("bond\tAbstract\n")
    with pytest.raises(VVSError, match="Prompt"):
        dataset.read_prompt_file(str(tmp_path / "noheader.tsv"))


def test_bad_input_is_one_line(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    base = ["generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--image-size", "8", "--quiet"]
    cases = [(["--prompts", str(prompts)], "class-conditional"),
             (["--class-labels", "0-10"], "out of range"),
             (["--class-labels", "0", "--prompts", str(prompts)], "exactly one"),
             (["--class-labels", "0", "--shard-size", "0"], "--shard-size"),
             (["--class-labels", "0", "--shard-size", "24", "--static-batches"], "multiple of the --batch-size 16"),
             (["--class-labels", "0", "--workers", "2"], "add --ray"),
             (["--class-labels", "0", "--max-prompt-tokens", "0"], "--max-prompt-tokens"),
             (["--class-labels", "0", "--method", "nope"], "unknown method"),
             (["--class-labels", "0", "--lantern-k", "3"], "takes no options")]
    for extra, match in cases:
        rc = main(base + extra + ["--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and match in err and "\n" not in err, (extra, err)
    assert not os.path.exists(tmp_path / "o" / "shard-00000.npz")


def test_merge_stats():
    from vvs_engine.stats import merge_stats

    a = {"method": "sjd", "n_images": 1, "tokens_generated": 256, "target_forward_passes": 128, "wall_time_s": 1.0,
         "mean_accepted_length": 2.0, "jacobi_window": 16, "accepted_drafts_histogram": [3, 1],
         "time_split_s": {"forward": 0.5}, "acceptance_rate_by_depth": {"1": 0.5}, "cuda_graphs": False}
    b = dict(a, n_images=3, tokens_generated=768, target_forward_passes=256, wall_time_s=2.5,
             mean_accepted_length=4.0, accepted_drafts_histogram=[1, 2, 5], time_split_s={"forward": 1.0},
             acceptance_rate_by_depth={"1": 0.9})
    m = merge_stats([a, b])
    assert m["n_images"] == 4 and m["tokens_generated"] == 1024 and m["target_forward_passes"] == 384
    assert m["tpf"] == 1024 / 384 and m["wall_time_s"] == 3.5 and m["jacobi_window"] == 16
    assert m["mean_accepted_length"] == 3.5  # image-weighted: (2 * 1 + 4 * 3) / 4
    assert m["accepted_drafts_histogram"] == [4, 3, 5] and m["time_split_s"] == {"forward": 1.5}
    assert abs(m["acceptance_rate_by_depth"]["1"] - 0.8) < 1e-12 and m["method"] == "sjd"


# --- identity -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_speculative(tmp_path_factory):
    return write_tiny_checkpoints(str(tmp_path_factory.mktemp("tiny_spec")), drafter=True)


@pytest.mark.parametrize("method", ["ar", "vvs"])
def test_tokens_do_not_depend_on_sharding(tiny_speculative, tmp_path, method):
    """fp32 (as loaded from files), sampled: the same job (batch size 2) as 2 shards of 2 and as 1 shard of 4
    writes the same tokens and forward counts, because its decode batches are images [0, 2) and [2, 3)
    in both (the batch size itself may change a near-tie in fp32: README, "What is reproducible")."""
    labels = [2, 9, 5]
    runs = {}
    for name, shard in (("two", 2), ("one", 4)):
        dataset.generate(str(tmp_path / name), class_labels=labels, method=method, seed=11, shard_size=shard,
                         batch_size=2, threads=1, progress=False, decode_images=False, model=tiny_speculative)
        runs[name] = read_all(tmp_path / name)
        assert len(runs[name]["shards"]) == (2 if shard == 2 else 1)
    assert np.array_equal(runs["one"]["tokens"], runs["two"]["tokens"])
    assert runs["one"]["index"].tolist() == [0, 1, 2] and runs["two"]["labels"].tolist() == labels
    with np.load(tmp_path / "one" / "shard-00000.npz") as z:
        passes = z["target_forward_passes"].tolist()
    with np.load(tmp_path / "two" / "shard-00000.npz") as a, np.load(tmp_path / "two" / "shard-00001.npz") as b:
        assert passes == a["target_forward_passes"].tolist() + b["target_forward_passes"].tolist()
    if method == "vvs":  # the drafter's tokens were accepted: fewer forwards than the 16 tokens
        assert max(passes) < 16, passes


class RecordingEngine:
    """An engine that records the image indices of every generate call (one call = one decode batch)."""

    calls = []

    def __init__(self, engine):
        self.engine = engine

    @property
    def device(self):
        return self.engine.device

    def generate(self, **kw):
        RecordingEngine.calls.append((list(kw["image_indices"]), kw["batch_size"]))
        return self.engine.generate(**kw)


def test_a_shard_is_one_queue_and_static_batches_are_global(tiny, tmp_path):
    """Continuous batching (the default): each shard is one decode-loop call of B images in flight, and
    the files do not depend on the number of workers. Static batches: batch j is images [j*B, (j+1)*B)
    of the job for every shard size (a multiple of B), and a shard size that would split a batch is
    refused before anything is written. Both give the same tokens (this model is fp64-exact enough)."""
    def factory(model):
        return RecordingEngine(dataset.load_engine(model))

    RecordingEngine.calls = []
    tiny_job(tmp_path / "queue", tiny, shard_size=4, batch_size=2, decode_images=False, engine_factory=factory)
    assert RecordingEngine.calls == [([0, 1, 2, 3], 2), ([4, 5, 6, 7], 2), ([8, 9], 2)]
    tokens = {"queue": read_all(tmp_path / "queue")["tokens"]}
    for shard in (2, 4, 6):
        RecordingEngine.calls = []
        tiny_job(tmp_path / f"s{shard}", tiny, shard_size=shard, batch_size=2, decode_images=False,
                 engine_factory=factory, static_batches=True)
        starts = [calls[0][0] for calls in RecordingEngine.calls]
        assert starts == list(range(0, 10, shard)), shard
        tokens[shard] = read_all(tmp_path / f"s{shard}")["tokens"]
    assert all(np.array_equal(tokens[2], t) for t in tokens.values())
    with pytest.raises(VVSError, match="multiple of the batch size 2"):
        tiny_job(tmp_path / "bad", tiny, shard_size=3, batch_size=2, static_batches=True)
    assert not os.path.exists(tmp_path / "bad" / "manifest.json")
    with pytest.raises(VVSError, match="different settings \\(batching\\)"):  # resume with the other batching
        tiny_job(tmp_path / "queue", tiny, shard_size=4, batch_size=2, decode_images=False, static_batches=True)


def test_identical_runs_write_identical_files(tiny, tmp_path):
    """Two runs of the same job: every shard and PNG equal byte for byte (no wall time, no zip date in
    a shard); the times are in each run's manifest entry, per shard."""
    for name in ("a", "b"):
        tiny_job(tmp_path / name, tiny, shard_size=4, batch_size=2)
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert a["shards"] == b["shards"] and a["pngs"] == b["pngs"]
    for name in a["shards"] + a["pngs"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    with np.load(tmp_path / "a" / "shard-00000.npz") as z:
        assert "wall_time_s" not in z.files and "wall_time_s" not in json.loads(str(z["stats"]))
    run = json.loads((tmp_path / "a" / "manifest.json").read_text())["runs"][0]
    assert [e["shard"] for e in run["shards"]] == [0, 1, 2]  # images [0, 4), [4, 8), [8, 10)
    assert all(e["wall_s"] >= e["decode_s"] > 0 for e in run["shards"])


def test_seed_and_index_change_the_image(tiny):
    eng = Engine.load(gpt_ckpt=tiny["gpt_ckpt"], image_size=8)
    a, b, c = (eng.generate(class_labels=[1], seed=s, image_indices=[i], decode_images=False).tokens
               for s, i in ((0, 0), (1, 0), (0, 1)))
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_greedy_dataset_equals_plain_ar(tiny, tmp_path):
    """Greedy AR is deterministic: the dataset holds exactly what one plain batched call produces."""
    tiny_job(tmp_path / "g", tiny, temperature=0.0, decode_images=False)
    got = read_all(tmp_path / "g")
    eng = Engine.load(gpt_ckpt=tiny["gpt_ckpt"], vq_ckpt=tiny["vq_ckpt"], image_size=8)
    labels = [c for c in [3, 1, 4, 1, 5] for _ in range(2)]
    ref = eng.generate(class_labels=labels, temperature=0.0, seed=7, decode_images=False)
    assert np.array_equal(got["tokens"], ref.tokens.numpy()) and got["labels"].tolist() == labels


# --- resume, interruption, manifest -------------------------------------------------------------
def test_resume_after_worker_crash(tiny, tmp_path):
    ref_dir, out = tmp_path / "ref", tmp_path / "out"
    tiny_job(ref_dir, tiny)
    ref = read_all(ref_dir)
    with pytest.raises(RuntimeError, match="simulated worker crash"):
        tiny_job(out, tiny, engine_factory=failing_factory(7))  # image 7 lies in shard 2 = images [6, 9)
    part = read_all(out)
    assert part["shards"] == ["shard-00000.npz", "shard-00001.npz"] and part["other"] == []
    assert part["pngs"] == [f"{i:06d}.png" for i in range(6)]
    summary = tiny_job(out, tiny)
    assert summary["shards_skipped"] == 2 and summary["images_this_run"] == 4 and summary["n_images"] == 10
    got = read_all(out)
    assert got["index"].tolist() == list(range(10))  # every image exactly once
    assert np.array_equal(got["tokens"], ref["tokens"]) and got["pngs"] == ref["pngs"]
    for name in got["pngs"]:
        assert (out / name).read_bytes() == (ref_dir / name).read_bytes()
    again = tiny_job(out, tiny)
    assert again["images_this_run"] == 0 and again["shards_skipped"] == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["runs"]) == 3 and manifest["identity"]["model_checksums"]["gpt"]
    # Per-image and merged stats: AR makes one forward pass per token after the prefill.
    with np.load(out / "shard-00001.npz") as z:
        assert z["target_forward_passes"].tolist() == [15, 15, 15] and "wall_time_s" not in z.files
        assert json.loads(str(z["stats"]))["n_images"] == 3
    totals = manifest["stats"]
    assert totals["n_images"] == 10 and totals["target_forward_passes"] == 150 and totals["tpf"] == 160 / 150


def test_changed_job_is_refused(tiny, tmp_path, capsys):
    tiny_job(tmp_path / "o", tiny, class_labels=[1, 2], per_condition=1)
    for change, word in (({"seed": 8}, "seed"), ({"method": "sjd"}, "method"), ({"temperature": 0.5}, "sampling"),
                         ({"class_labels": [1, 3]}, "conditions_sha256"), ({"shard_size": 2}, "shard_size"),
                         ({"batch_size": 3}, "batch_size")):
        with pytest.raises(VVSError, match=word):
            tiny_job(tmp_path / "o", tiny, **{"class_labels": [1, 2], "per_condition": 1, **change})
    rc = main(["generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"], "--image-size", "8",
               "--class-labels", "1,2", "--shard-size", "3", "--batch-size", "1", "--seed", "9", "--quiet", "--out",
               str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "different settings (seed)" in err and "\n" not in err


def test_interrupted_run_leaves_only_complete_shards(tiny, tmp_path):
    """Ctrl-C (SIGINT) of the command mid-job: exit 130, only complete shards and their PNGs remain,
    and the same command finishes the job with the tokens of an uninterrupted run."""
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "vvs_engine", "generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt",
           tiny["vq_ckpt"], "--image-size", "8", "--device", "cpu", "--class-labels", "0-9", "--per-class", "12",
           "--shard-size", "4", "--batch-size", "2", "--seed", "3", "--threads", "1", "--quiet", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 240
    while not (out / "shard-00002.npz").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted"
    hint = err.strip().splitlines()[-2]  # what was kept and how to finish
    assert "shards are complete" in hint and "run the same command again" in hint, err
    part = read_all(out)
    n_done = len(part["shards"])
    assert 3 <= n_done < 30 and part["other"] == []
    assert part["shards"] == [f"shard-{k:05d}.npz" for k in range(n_done)]
    assert part["index"].tolist() == list(range(4 * n_done))
    assert part["pngs"] == [f"{i:06d}.png" for i in range(4 * n_done)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=400)
    assert done.returncode == 0, done.stderr
    got = read_all(out)
    assert got["index"].tolist() == list(range(120)) and len(got["pngs"]) == 120
    tiny_job(tmp_path / "ref", tiny, class_labels=list(range(10)), per_condition=12, shard_size=4, batch_size=2,
             seed=3, decode_images=False)
    assert np.array_equal(got["tokens"], read_all(tmp_path / "ref")["tokens"])


def test_prompt_shard_layout(tmp_path):
    """A text-conditional shard carries prompt ids and texts, labels -1, PNGs named by global index."""
    result = {"tokens": np.arange(6, dtype=np.int64).reshape(2, 3), "pngs": [b"png-5", b"png-6"],
              "stats": [{"n_images": 2, "tokens_generated": 6, "target_forward_passes": 4,
                         "per_image": {"target_forward_passes": [2, 2]}}]}
    dataset.write_shard(str(tmp_path), 2, range(5, 7), None, [41, 17], ["a red bus", "a bus"], result, 1000)
    with np.load(tmp_path / "shard-00002.npz") as z:
        assert z["index"].tolist() == [5, 6] and z["labels"].tolist() == [-1, -1]
        assert z["prompt_ids"].tolist() == [41, 17] and z["prompts"].tolist() == ["a red bus", "a bus"]
        assert z["target_forward_passes"].tolist() == [2, 2] and json.loads(str(z["stats"]))["tpf"] == 1.5
    assert (tmp_path / "000005.png").read_bytes() == b"png-5" and sorted(os.listdir(tmp_path)) == [
        "000005.png", "000006.png", "shard-00002.npz"]


def test_eval_reads_the_dataset_folder(tiny, tmp_path):
    """eval reads the complete shards and says which are missing or unreadable (the README's rule)."""
    from vvs_engine.evaluation.report import read_generate_dir

    tiny_job(tmp_path / "o", tiny)
    imgs, labels, tokens = read_generate_dir(str(tmp_path / "o"))
    assert imgs.shape == (10, 8, 8, 3) and labels.tolist() == [3, 3, 1, 1, 4, 4, 1, 1, 5, 5]
    assert np.array_equal(tokens, read_all(tmp_path / "o")["tokens"])
    os.remove(tmp_path / "o" / "shard-00001.npz")
    shard2 = tmp_path / "o" / "shard-00002.npz"
    shard2.write_bytes(shard2.read_bytes()[:200])  # truncated, as a full disk leaves it
    notes = []
    imgs, labels, tokens = read_generate_dir(str(tmp_path / "o"), notes)
    assert imgs.shape[0] == 4 and labels.tolist() == [3, 3, 1, 5]  # shards 0 and 3: images 0-2 and 9
    assert len(notes) == 1 and "2 of 4 shards" in notes[0] and "shard-00002.npz (unreadable)" in notes[0]
    assert "shard-00001.npz" in notes[0]


def test_truncated_shard_is_redone(tiny, tmp_path):
    """A re-run redoes an unreadable shard (and keeps the others) instead of crashing on it."""
    out = tmp_path / "o"
    tiny_job(out, tiny)
    ref = read_all(out)
    shard = out / "shard-00001.npz"
    shard.write_bytes(shard.read_bytes()[:300])
    s = tiny_job(out, tiny)
    assert s["shards_this_run"] == 1 and s["shards_skipped"] == 3
    assert np.array_equal(read_all(out)["tokens"], ref["tokens"])


def test_failed_first_run_does_not_lock_the_folder(tiny, tmp_path, capsys):
    """A run that fails before its first shard (a garbage checkpoint) leaves a manifest but no shard:
    the corrected command then runs instead of being refused as 'different settings'."""
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a checkpoint")
    out = str(tmp_path / "o")
    base = ["generate-dataset", "--image-size", "8", "--class-labels", "1,2", "--shard-size", "2", "--batch-size", "2",
            "--threads", "1", "--quiet", "--no-images", "--out", out]
    assert main(base + ["--gpt-ckpt", str(garbage)]) == 1
    assert os.listdir(out) == ["manifest.json"]
    capsys.readouterr()
    assert main(base + ["--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"]]) == 0
    assert read_all(out)["index"].tolist() == [0, 1]


def test_generate_and_dataset_folders_are_kept_apart(tiny, tmp_path, capsys):
    """generate into a dataset folder, or generate-dataset into a generate folder, is refused before
    anything is written: each would replace the other's PNGs (they share the names)."""
    tiny_job(tmp_path / "ds", tiny)
    before = {p: (tmp_path / "ds" / p).read_bytes() for p in os.listdir(tmp_path / "ds")}
    model = ["--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"], "--image-size", "8", "--quiet"]
    assert main(["generate", "--class-labels", "1", "--out", str(tmp_path / "ds")] + model) == 1
    err = capsys.readouterr().err.strip()
    assert "generate-dataset" in err and "\n" not in err
    assert {p: (tmp_path / "ds" / p).read_bytes() for p in os.listdir(tmp_path / "ds")} == before
    assert main(["generate", "--class-labels", "1,2", "--out", str(tmp_path / "g")] + model) == 0
    assert main(["generate-dataset", "--class-labels", "1", "--out", str(tmp_path / "g")] + model) == 1
    err = capsys.readouterr().err.strip()
    assert "output of `vvs-engine generate`" in err and "\n" not in err
    assert sorted(os.listdir(tmp_path / "g")) == ["000000.png", "000001.png", "grid.png", "stats.json", "tokens.npz"]


def test_dataset_api_arguments(tiny, tmp_path):
    """class_labels as a range string, a numpy array or a list give the same job; workers without Ray
    and a mixed-type list are one-line errors."""
    jobs = {}
    for name, labels in (("str", "3-4"), ("array", np.array([3, 4])), ("list", [3, 4])):
        tiny_job(tmp_path / name, tiny, class_labels=labels, per_condition=1, decode_images=False)
        jobs[name] = read_all(tmp_path / name)
        assert jobs[name]["labels"].tolist() == [3, 4]
    assert np.array_equal(jobs["str"]["tokens"], jobs["array"]["tokens"])
    for kw, match in (({"workers": 2}, "Ray"), ({"class_labels": [1, 2.5]}, "integers"),
                      ({"class_labels": [1], "prompts": ["a"]}, "not both")):
        with pytest.raises(VVSError, match=match):
            tiny_job(tmp_path / "bad", tiny, **kw)


def test_model_dir_is_honoured(tmp_path, capsys):
    """generate-dataset --model-dir generates with that folder's model (not the Zoo) and records it; a
    missing folder is a one-line error."""
    from vvs_engine.models.hf_tiny import make_emu3_folder

    rc = main(["generate-dataset", "--model-dir", str(tmp_path / "nope"), "--prompts", __file__, "--quiet",
               "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "model folder not found" in err and "\n" not in err
    folder = str(tmp_path / "emu3")
    make_emu3_folder(folder)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\na blue dog\n")
    out = tmp_path / "o"
    assert main(["generate-dataset", "--model-dir", folder, "--image-size", "32", "--max-prompt-tokens", "24",
                 "--prompts", str(prompts), "--shard-size", "2", "--batch-size", "2", "--device", "cpu",
                 "--threads", "1", "--quiet", "--no-images", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["model_dir"] == folder and manifest["identity"]["image_size"] == 32
    assert any(k.startswith("model_dir/") for k in manifest["identity"]["model_checksums"])
    eng = Engine.load(model_dir=folder, image_size=32, max_prompt_tokens=24, threads=1)
    ref = eng.generate(prompts=["a red cat", "a blue dog"], seed=0, batch_size=2, decode_images=False)
    assert np.array_equal(read_all(out)["tokens"], ref.tokens.numpy())


def test_ray_missing_is_a_one_line_hint(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    rc = main(["generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--image-size", "8", "--class-labels", "0",
               "--ray", "--quiet", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "pip install" in err and "[ray]" in err and "\n" not in err
