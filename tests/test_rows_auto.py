"""``auto`` rows (generate's --batch-size, serve's --rows): the most images in flight whose decode state fits the
device's free memory, from the memory table's model (``engine.decode_bytes``), with the refusals in one line."""
from __future__ import annotations

import numpy as np
import pytest

from dataset_utils import write_tiny_checkpoints
from vvs_engine import engine as engine_module
from vvs_engine.cli import build_parser, main, method_options
from vvs_engine.engine import AUTO_ROWS_CAP, AUTO_ROWS_SLACK, Engine, decode_bytes, rows_that_fit
from vvs_engine.errors import UsageError, VVSError
from vvs_engine.methods import get_method_options


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoints(str(tmp_path_factory.mktemp("tiny")))


def load(tiny):
    return Engine.load(gpt_ckpt=tiny["gpt_ckpt"], vq_ckpt=tiny["vq_ckpt"], image_size=8, threads=1)


def free_for(eng, rows, method="ar", extra=0):
    """Free bytes where exactly ``rows`` images' decode state (and the slack) fit, plus ``extra``."""
    return AUTO_ROWS_SLACK + decode_bytes(eng.shape, get_method_options(method, {}), rows, True, eng.dtype) + extra


def test_rows_that_fit_is_the_largest_power_of_two_that_fits(tiny):
    eng = load(tiny)
    ar, sjd = get_method_options("ar", {}), get_method_options("sjd", {})
    for rows in (1, 4, 32):
        free = free_for(eng, rows)
        assert rows_that_fit(eng.shape, ar, True, "cpu", eng.dtype, free=free) == rows
        # one byte less and the next power of two down is the answer
        if rows > 1:
            assert rows_that_fit(eng.shape, ar, True, "cpu", eng.dtype, free=free - 1) == rows // 2
    # a method whose rounds hold more queries per row needs more per image: fewer rows in the same memory
    free = free_for(eng, 32)
    assert rows_that_fit(eng.shape, sjd, True, "cpu", eng.dtype, free=free) < 32
    # no guidance rows (CFG 1): twice the images in the same memory
    assert rows_that_fit(eng.shape, ar, False, "cpu", eng.dtype, free=free) == 64
    # the cap (generate: its number of images) and the ceiling
    assert rows_that_fit(eng.shape, ar, True, "cpu", eng.dtype, free=free, cap=5) == 5
    assert rows_that_fit(eng.shape, ar, True, "cpu", eng.dtype, free=1 << 50) == AUTO_ROWS_CAP


def test_refusals_are_one_line(tiny, monkeypatch):
    eng = load(tiny)
    ar = get_method_options("ar", {})
    with pytest.raises(VVSError, match=r"^--rows auto: one image needs about .* GiB for its decode state but the CPU "
                                       r"has .* GiB free \(1 GiB kept as slack\)$"):
        rows_that_fit(eng.shape, ar, True, "cpu", eng.dtype, free=free_for(eng, 1) - 1)
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: None)  # a device that does not tell
    with pytest.raises(VVSError, match="^--rows auto needs the CPU's free memory, which cannot be read here: give a "
                                       "number$"):
        rows_that_fit(eng.shape, ar, True, "cpu", eng.dtype)


def test_generate_batch_size_auto(tiny, tmp_path, capsys, monkeypatch):
    flags = ["generate", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"], "--image-size", "8",
             "--device", "cpu", "--class-labels", "0-9", "--no-images", "--quiet", "--threads", "1",
             "--batch-size", "auto"]
    eng = load(tiny)
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: free_for(eng, 4))
    assert main(flags + ["--out", str(tmp_path / "a")]) == 0
    assert "--batch-size auto: 4 images in flight" in capsys.readouterr().err
    # the same tokens as a plain call at 4 rows (sampled, seed 0)

    got = np.load(tmp_path / "a" / "tokens.npz")["tokens"]
    ref = eng.generate(class_labels=list(range(10)), batch_size=4, decode_images=False).tokens.numpy()
    assert np.array_equal(got, ref)
    # not even one image: refused in one line, named as generate's flag
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: free_for(eng, 1) - 1)
    assert main(flags + ["--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --batch-size auto: one image needs about")
    assert build_parser().parse_args(flags[:1] + ["--batch-size", "7"]).batch_size == 7
    with pytest.raises(UsageError, match="--batch-size: expected an integer or 'auto', got 'many'"):
        build_parser().parse_args(flags[:1] + ["--batch-size", "many"])


def test_serve_rows_auto(tiny, monkeypatch):
    """The server resolves --rows auto once its model is loaded and serves with that many rows."""
    from vvs_engine.serving.server import build_server, check_args

    eng = load(tiny)
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: free_for(eng, 8, extra=1))
    args = build_parser().parse_args(["serve", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"],
                                      "--image-size", "8", "--device", "cpu", "--threads", "1", "--rows", "auto"])
    opts = method_options(args)
    check_args(args, opts, "cpu")
    worker, app, _ = build_server(args, opts, "cpu")
    try:
        assert args.rows == 8 and worker.rows == 8
    finally:
        worker.close()
    ray = build_parser().parse_args(["serve", "--rows", "auto", "--ray"])
    with pytest.raises(VVSError, match="--rows auto is for the one-process server: under --ray give a number"):
        check_args(ray, method_options(ray), "cpu")


def test_generate_dataset_batch_size_auto(tiny, tmp_path, capsys, monkeypatch):
    """Picked once per job before any worker loads (free memory less the checkpoint files), kept on resume."""
    import json
    import os

    from vvs_engine import dataset

    eng = load(tiny)
    files = os.path.getsize(tiny["gpt_ckpt"]) + os.path.getsize(tiny["vq_ckpt"])
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: files + free_for(eng, 4))
    flags = ["generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"], "--device", "cpu",
             "--class-labels", "0-9", "--shard-size", "5", "--no-images", "--quiet", "--threads", "1",
             "--batch-size", "auto", "--out", str(tmp_path / "d")]
    assert main(flags) == 0
    with open(tmp_path / "d" / "manifest.json") as f:
        assert json.load(f)["identity"]["batch_size"] == 4
    # a resumed job keeps its first figure whatever the memory now (the batch size is part of its identity)
    os.remove(tmp_path / "d" / "shard-00001.npz")
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: files + free_for(eng, 2))
    assert main(flags) == 0
    assert sorted(os.listdir(tmp_path / "d")) == ["manifest.json", "shard-00000.npz", "shard-00001.npz"]
    # a new folder at that memory picks 2; one process only
    assert dataset.auto_batch_size(str(tmp_path / "e"), {"gpt_ckpt": tiny["gpt_ckpt"], "vq_ckpt": tiny["vq_ckpt"]},
                                   None, "ar", {}, 4.0, 10) == 2
    capsys.readouterr()
    assert main(flags[:-2] + ["--out", str(tmp_path / "r"), "--ray"]) == 1
    assert capsys.readouterr().err.strip() == ("error: --batch-size auto is for one process: under Ray give a number "
                                               "(it is part of the dataset's identity, the same for every worker)")
