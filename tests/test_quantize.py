"""Quantized weights (torchao, weight-only, at load): every family loads quantized on tiny configs, int8
halves the bytes, a quantized model's tokens are deterministic, compiled rounds run, and what cannot run
is refused in one line."""
from __future__ import annotations

import json
import re

import numpy as np

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao")

from spec_models import tiny_engine  # noqa: E402
from vvs_engine.cli import main  # noqa: E402
from vvs_engine.drafting.drafter import Drafter, DrafterConfig  # noqa: E402
from vvs_engine.engine import Engine  # noqa: E402
from vvs_engine.errors import VVSError  # noqa: E402
from vvs_engine.models.hf_tiny import PROMPTS, make_chameleon_folder, make_emu3_folder, make_janus_folder  # noqa: E402
from vvs_engine.models.quantize import KEEP_FULL, is_quantized, linear_weight_bytes, weight_bytes  # noqa: E402


def quantized_linears(module: nn.Module):
    """(quantized, plain) names of module's nn.Linear layers."""
    q, plain = [], []
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            (q if is_quantized(m) else plain).append(name)
    return q, plain


def test_int8_weights_are_at_most_055_of_bf16_on_the_zoo():
    bf16 = Engine.load(dtype="bf16")
    int8 = Engine.load(dtype="bf16", quantize="int8")
    assert int8.quantization == "int8" and int8.dtype == torch.bfloat16
    assert not is_quantized(bf16.gpt) and is_quantized(int8.gpt) and is_quantized(int8.drafter)
    for full, quant in ((bf16.gpt, int8.gpt), (bf16.drafter, int8.drafter)):
        assert weight_bytes(quant) <= 0.55 * weight_bytes(full)
        lin_q, other_q = linear_weight_bytes(quant)
        lin_f, other_f = linear_weight_bytes(full)
        assert other_q == other_f  # embeddings and norms untouched
        assert 0.5 * lin_f < lin_q <= 0.52 * lin_f  # one byte a weight + a scale per row
    # the VQ decoder keeps its own dtype and is not quantized
    assert not is_quantized(int8.vq) and next(int8.vq.parameters()).dtype == torch.float32
    # quantization changes the logits a little, not a lot (a weight-only rounding, not a broken model)
    tokens = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    full32, q32 = Engine.load(), Engine.load(quantize="int8")
    a = full32.score(class_labels=[1, 2], tokens=tokens, cfg_scale=4.0)
    b = q32.score(class_labels=[1, 2], tokens=tokens, cfg_scale=4.0)
    diff = (a - b).abs().max().item()
    assert 1e-4 < diff < 0.05 * a.abs().max().item()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    out = {}
    for name, make, kw in (("janus", make_janus_folder, dict(max_prompt_tokens=24)),
                           ("lumina", make_chameleon_folder, dict(max_prompt_tokens=32, image_size=64)),
                           ("emu3", make_emu3_folder, dict(max_prompt_tokens=24, image_size=32))):
        path = str(tmp_path_factory.mktemp(name))
        make(path)
        out[name] = (path, kw)
    return out


@pytest.mark.parametrize("family", ["janus", "lumina", "emu3"])
def test_every_family_loads_quantized_and_decodes(families, family):
    path, kw = families[family]
    full = Engine.load(model_dir=path, **kw)
    eng = Engine.load(model_dir=path, quantize="int8", **kw)
    q, plain = quantized_linears(eng.gpt)
    assert len(q) >= 4
    kept = {attr for attrs in KEEP_FULL.values() for attr in attrs}
    assert all(name.split(".")[-1] in kept for name in plain), plain  # only the heads read as matrices
    assert not is_quantized(eng.vq)
    assert weight_bytes(eng.gpt) < weight_bytes(full.gpt)
    ids = torch.randint(0, eng.config.vocab_size, (len(PROMPTS), eng.tokens_per_image),
                        generator=torch.Generator().manual_seed(1))
    a, b = full.score(prompts=PROMPTS, tokens=ids), eng.score(prompts=PROMPTS, tokens=ids)
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()
    # a drafter quantized with the target; EAGLE greedy is lossless w.r.t. the quantized target
    c = eng.config
    fresh = Engine.load(model_dir=path, **kw)
    fresh.drafter = Drafter(DrafterConfig(dim=c.dim, n_head=c.n_head)).attach(fresh.gpt).eval()
    fresh.quantize_weights("int8")
    assert is_quantized(fresh.drafter)
    ar = fresh.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False)
    eagle = fresh.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method="eagle", decode_images=False,
                           tree_total=6, tree_depth=2, tree_topk=2)
    assert torch.equal(ar.tokens, eagle.tokens) and ar.stats["quantize"] == "int8"


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_tokens_are_deterministic(mode):
    labels = [0, 1, 2, 3]
    runs = []
    for _ in range(2):
        eng = tiny_engine(vocab=64, block=16, dtype=torch.float32, peak=3.0).quantize_weights(mode)
        runs.append([eng.generate(class_labels=labels, method=m, seed=5, decode_images=False).tokens
                     for m in ("ar", "eagle", "sjd")])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert len(set(runs[0][0].flatten().tolist())) > 8  # sampled, not degenerate


@pytest.mark.parametrize("method", ["ar", "sjd"])
def test_quantized_tokens_do_not_depend_on_batch_mates(method):
    """An image decoded alone or among others gets the same sampled tokens (fp32: as for an unquantized
    fp32 model, a near-tie could in principle flip where a matmul rounds differently; docs/batching.md)."""
    eng = tiny_engine(vocab=64, block=16, dtype=torch.float32, peak=3.0).quantize_weights("int8")
    labels = [0, 1, 2, 3, 4, 0]
    together = eng.generate(class_labels=labels, method=method, seed=5, decode_images=False, batch_size=6).tokens
    alone = torch.cat([eng.generate(class_labels=[lab], method=method, seed=5, image_indices=[i], decode_images=False,
                                    batch_size=1).tokens for i, lab in enumerate(labels)])
    assert torch.equal(together, alone)
    assert not torch.equal(together[0], together[5])  # same label, another image index: other tokens


def test_compiled_quantized_round_equals_eager(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # one compile: no retire-size variants (as test_compiled)
    eng = tiny_engine(vocab=32, block=16, dtype=torch.float32, dim=32, n_layer=1, peak=3.0).quantize_weights("int8")
    kw = dict(class_labels=[0, 1], temperature=0, decode_images=False, batch_size=2)
    eager = eng.generate(**kw)
    with inductor_config.patch({"cpp.vec_isa_ok": False}):  # scalar C++: a fraction of the compile time
        compiled = eng.generate(**kw, compile=True)
    assert compiled.stats["compiled"] == {"ar_step": True}
    assert torch.equal(eager.tokens, compiled.tokens)


def test_refusals():
    with pytest.raises(VVSError, match="int4 needs a CUDA GPU"):
        Engine.load(quantize="int4")
    with pytest.raises(VVSError, match="not fp64"):
        Engine.load(quantize="int8", dtype="fp64")
    with pytest.raises(VVSError, match="unknown quantize 'int3'"):
        Engine.load(quantize="int3")
    eng = tiny_engine(dtype=torch.float32).quantize_weights("int8")
    with pytest.raises(VVSError, match="already quantized"):
        eng.quantize_weights("fp8")
    with pytest.raises(VVSError, match="load again"):
        eng.to("cpu", "bf16")
    eng.to("cpu", "fp32")  # the same dtype is fine
    # the negative control: an unquantized engine changes dtype freely
    tiny_engine(dtype=torch.float32).to("cpu", "bf16")


def test_missing_torchao_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails
    with pytest.raises(VVSError, match=re.escape("pip install 'vvs-engine[quantize]'")):
        Engine.load(quantize="int8")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refusals_are_one_line(command, capsys, tmp_path):
    rest = ["--device", "cpu"] + (["--class-labels", "0", "--out", str(tmp_path / "o")] if command == "generate" else [])
    assert main([command, "--quantize", "int4"] + rest) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --quantize int4 needs a CUDA GPU (torchao's packed int4 kernels are CUDA-only; on the "
                   "CPU use int8 or fp8)"]
    assert main([command, "--quantize", "int2"] + rest) == 1
    assert capsys.readouterr().err.strip() == "error: unknown --quantize 'int2'; use none, int8, fp8, int4"


def test_generate_dataset_quantize(tmp_path, capsys):
    """generate-dataset --quantize int8 decodes with int8 weights (the tokens of Engine.load(quantize="int8")),
    records it in the dataset's identity, and a re-run without it is refused (a changed job)."""
    from dataset_utils import read_all, write_tiny_checkpoints

    tiny = write_tiny_checkpoints(str(tmp_path / "m"))
    flags = ["generate-dataset", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"], "--image-size", "8",
             "--device", "cpu", "--class-labels", "0-9", "--temperature", "0", "--no-images", "--quiet", "--threads", "1"]
    assert main(flags + ["--out", str(tmp_path / "q"), "--quantize", "int8"]) == 0
    got = read_all(tmp_path / "q")
    with open(tmp_path / "q" / "manifest.json") as f:
        assert json.load(f)["identity"]["quantize"] == "int8"
    kw = dict(class_labels=list(range(10)), temperature=0, decode_images=False)
    load = dict(gpt_ckpt=tiny["gpt_ckpt"], vq_ckpt=tiny["vq_ckpt"], image_size=8, threads=1)
    int8 = Engine.load(quantize="int8", **load).generate(**kw).tokens.numpy()
    full = Engine.load(**load).generate(**kw).tokens.numpy()
    assert np.array_equal(got["tokens"], int8)
    assert not np.array_equal(int8, full)  # the control: greedy int8 picks other tokens than fp32 in some images
    capsys.readouterr()
    assert main(flags + ["--out", str(tmp_path / "q")]) == 1  # the same folder without --quantize: another job
    assert "quantize" in capsys.readouterr().err
    assert main(flags + ["--out", str(tmp_path / "i4"), "--quantize", "int4"]) == 1  # refused before any shard
    assert capsys.readouterr().err.startswith("error: --quantize int4 needs a CUDA GPU")
    assert not (tmp_path / "i4" / "manifest.json").exists()


def test_serve_quantize_loads_the_server_quantized(tmp_path):
    """serve --quantize int8: the server's engine (the one its warm-up image ran on) holds int8 weights."""
    from dataset_utils import write_tiny_checkpoints
    from vvs_engine.cli import build_parser, method_options
    from vvs_engine.serving.server import build_server, check_args

    tiny = write_tiny_checkpoints(str(tmp_path / "m"))
    for mode in ("int8", "none"):  # "none": the control, a plain server
        args = build_parser().parse_args(["serve", "--gpt-ckpt", tiny["gpt_ckpt"], "--vq-ckpt", tiny["vq_ckpt"],
                                          "--image-size", "8", "--device", "cpu", "--threads", "1", "--rows", "2",
                                          "--quantize", mode])
        opts = method_options(args)
        check_args(args, opts, "cpu")
        worker, _, _ = build_server(args, opts, "cpu")
        try:
            assert worker.engine.quantization == mode and is_quantized(worker.engine.gpt) == (mode != "none")
        finally:
            worker.close()
