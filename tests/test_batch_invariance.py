"""Batch-invariant decoding (``deterministic=True``): same seed, same image, in fp32 and bf16.

An image's tokens must not depend on how many rows are in flight, on its row, on its batch-mates or on
when it was admitted, in fp32 and bf16 on the CPU, where GEMM rounding depends on the row count
(``models.invariant``). Checked end to end for every method on the loop, greedy and sampled images with
different settings in one batch, at 1, 2, 3, 4, 8 and 16 rows, against each image decoded alone; the
linear layer's rows against the GEMM's row count and position; the tokenizer's decode of an image
against what else it decodes with; and negative controls: with the mode off, the plain GEMM and the
same decodes differ on this machine's BLAS (so these tests can fail). The model is made sensitive to
rounding (a logit offset common to every token), so that a batch-dependent GEMM shows in the tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spec_models import tiny_engine
from test_loop import IDS, LOOP_METHODS, TREE
from vvs_engine.models.invariant import GEMM_ROW_FLOOR, InvariantLinear, invariant_linear, set_batch_invariant

ROWS = (2, 3, 4, 8, 16)
DRAFTER_METHODS = {"eagle", "lantern", "lantern++", "cascade", "vvs"}  # ~10x a Jacobi method's time here
# test_loop's methods; LANTERN++ and CASCADE on the small dynamic tree too (their rules, a tenth of the work)
METHODS = [(m, dict(TREE, tree="dynamic") if m in ("lantern++", "cascade") else o) for m, o in LOOP_METHODS]
N_IMAGES = 16
LABELS = [i % 5 for i in range(N_IMAGES)]
# Greedy and sampled images with their own settings side by side (a server's requests).
MIXED = dict(temperature=[1.0, 0.0, 0.8, 1.0] * 4, top_k=[0, 0, 10, 0] * 4, top_p=[1.0, 1.0, 1.0, 0.8] * 4,
             cfg_scale=[3.0, 3.0, 1.5, 3.0] * 4, seed=list(range(7, 7 + N_IMAGES)))


def mkl_gemm_depends_on_rows() -> bool:
    """Whether this BLAS rounds a row of a (256 -> 768) fp32 GEMM differently at 1 row than at 32."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 256, generator=g), torch.randn(768, 256, generator=g)
    return not torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1])


# A logit offset common to every token (added to each row of the output head): the distributions are
# the same, but each logit is ~OFFSET in size, so its rounding, and how a GEMM's row count changes it,
# is that many times larger. A batch-dependent GEMM then flips tokens in most images (the negative
# control below), where the plain small model would flip one token in thousands.
OFFSET = {torch.float32: 1e4, torch.bfloat16: 30.0}


def sensitive_engine(dtype):
    """A small random model whose GEMMs are 256 and 704 wide (MKL's kernel choice by row count
    applies) with the common logit offset; batch-invariant decoding off."""
    eng = tiny_engine(vocab=64, block=16, peak=4.0, dtype=dtype, dim=256, n_layer=1)
    g = torch.Generator().manual_seed(5)
    direction = F.normalize(torch.randn(256, generator=g), dim=0)
    with torch.no_grad():
        eng.gpt.output.weight += (OFFSET[dtype] * direction).to(dtype)
    return eng


@pytest.fixture(scope="module")
def engines():
    """fp32 and bf16 sensitive engines with batch-invariant decoding on."""
    return {dtype: sensitive_engine(dtype).set_deterministic(True) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(256, 768), (704, 256), (64, 100)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_rows_linear_output_does_not_depend_on_the_gemm(dtype, shape):
    """Every row of invariant_linear equals that row in a 64-row GEMM, whatever the row count (below,
    at and above the floor) and the row's position; the layer computes it only while its flag is set."""
    k, n = shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(80, k, generator=g).to(dtype)
    w, b = (torch.randn(n, k, generator=g) * 0.05).to(dtype), torch.randn(n, generator=g).to(dtype)
    whole = invariant_linear(x[:64], w, b)
    for m in (1, 2, 3, 5, GEMM_ROW_FLOOR - 1, GEMM_ROW_FLOOR, 17, 40):
        for start in (0, 3, 64 - m):
            part = invariant_linear(x[start:start + m].clone(), w, b)
            assert part.dtype == dtype and torch.equal(part, whole[start:start + m]), (m, start)
    # the same numbers up to rounding as the plain layer; batched [B, T, K] inputs keep their shape
    assert torch.allclose(whole.float(), F.linear(x[:64], w, b).float(), rtol=0.02, atol=0.02)
    assert torch.equal(invariant_linear(x[:6].view(2, 3, k), w, b), whole[:6].view(2, 3, n))
    layer = torch.nn.Linear(k, n).to(dtype)
    set_batch_invariant(True, layer)
    assert isinstance(layer, InvariantLinear) and layer.batch_invariant
    assert torch.equal(layer(x[:1]), layer(x[:64])[:1])
    set_batch_invariant(False, layer)
    assert torch.equal(layer(x[:3]), F.linear(x[:3], layer.weight, layer.bias))


def test_negative_control_the_plain_gemm_depends_on_rows():
    """Without the mode, this machine's fp32 GEMM gives row 0 other bits at 1 row than at 32 (what the
    mode removes); skipped on a BLAS that has no such dependence."""
    if not mkl_gemm_depends_on_rows():
        pytest.skip("this BLAS rounds a row the same at every row count: nothing to control")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 704, generator=g), torch.randn(256, 704, generator=g)
    assert not torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1])
    assert torch.equal(invariant_linear(x[:1], w), invariant_linear(x, w)[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,opts", METHODS, ids=IDS)
def test_tokens_do_not_depend_on_rows_or_batch_mates(engines, dtype, method, opts):
    """Greedy and sampled images with their own settings: 8 decoded alone (1 row: each image by itself),
    then at 2, 3, 4 and 8 rows (most admitted mid-run beside images with other settings) and, with 8
    more images, at 16 rows: identical tokens. To keep the file's time down, bf16 and the drafter
    methods run 3 and 16 rows only, the drafter methods with 4 images alone. fp32: image 1 (greedy)
    and image 0 (sampled) also decoded alone with uniform settings (a call whose rounds run one
    setting)."""
    eng = engines[dtype]
    kw = dict(method=method, decode_images=False, **opts)
    slow = method in DRAFTER_METHODS
    n = 4 if slow else N_IMAGES // 2

    def mixed(k):
        return {name: values[:k] for name, values in MIXED.items()}

    alone = eng.generate(class_labels=LABELS[:n], batch_size=1, **mixed(n), **kw)
    for rows in ROWS if dtype == torch.float32 and not slow else (3, 16):
        k = N_IMAGES if rows == 16 else max(n, rows)
        out = eng.generate(class_labels=LABELS[:k], batch_size=rows, **mixed(k), **kw)
        assert out.stats["admissions"] >= (1 if rows < k else 0)
        assert torch.equal(out.tokens[:n], alone.tokens), f"{rows} rows: images " \
            f"{(out.tokens[:n] != alone.tokens).any(1).nonzero().flatten().tolist()} differ"
    if dtype == torch.float32:
        for i in (0, 1):
            one = eng.generate(class_labels=[LABELS[i]], image_indices=[i], batch_size=1,
                               **{name: values[i] for name, values in MIXED.items()}, **kw)
            assert torch.equal(one.tokens[0], alone.tokens[i])


VVS_SKIPS = [dict(TREE, skip_policy="uniform", skip_interval=2),
             dict(TREE, skip_policy="dynamic", skip_threshold=0.0, post_verify="reject")]


@pytest.mark.parametrize("opts", VVS_SKIPS, ids=["uniform-fill", "dynamic-reject"])
def test_vvs_verify_rounds_do_not_depend_on_the_batch_mates_skips(engines, opts):
    """VVS, fp32: 8 greedy and sampled images alone and at 2 and 3 rows, identical. A sequence
    without a pending chain verifies in a plain verify round or, when batch-mates skipped, in the round
    after a skip; in the mode both have the chain's layout (an empty chain), so its tree takes the same
    queries and K/V slots. Negative control (uniform skips): the GEMMs still invariant but the plain
    verify round's layout (``engine.deterministic`` False, the flag the rounds read), images change."""
    eng = engines[torch.float32]
    kw = dict(class_labels=LABELS[:8], method="vvs", decode_images=False, **opts,
              **{name: values[:8] for name, values in MIXED.items()})

    def differing(rows):
        alone = eng.generate(batch_size=1, **kw)
        return {r: (eng.generate(batch_size=r, **kw).tokens != alone.tokens).any(1).nonzero().flatten().tolist()
                for r in rows}

    assert differing((2, 3)) == {2: [], 3: []}
    if opts["skip_policy"] != "uniform":  # one negative control is enough (the uniform schedule's)
        return
    eng.deterministic = False  # the layers stay batch-invariant
    try:
        assert differing((2,))[2]
    finally:
        eng.deterministic = True


@pytest.mark.skipif(not mkl_gemm_depends_on_rows(), reason="this BLAS rounds a row the same at every row count")
@pytest.mark.parametrize("method", ["ar", "sjd"])
def test_negative_control_without_the_mode_images_change_with_their_batch(method):
    """The same engine and images with the mode off: decoded alone and 16 at a time, images differ
    (so the test above can fail); with it on, none."""
    eng = sensitive_engine(torch.float32)
    kw = dict(class_labels=LABELS, method=method, decode_images=False, **MIXED)
    alone, together = eng.generate(batch_size=1, **kw), eng.generate(batch_size=16, **kw)
    assert (alone.tokens != together.tokens).any(1).sum() >= 2
    alone = eng.generate(batch_size=1, deterministic=True, **kw)
    assert torch.equal(eng.generate(batch_size=16, deterministic=True, **kw).tokens, alone.tokens)


def test_compiled_rounds_do_not_depend_on_rows(engines, monkeypatch):
    """Compiled AR rounds (``compile=True``, Inductor's C++ backend on the CPU), fp32, in the mode:
    4 greedy and sampled images with their own settings at 1 row and at 3 rows (one admitted mid-run),
    identical tokens. (Compiled against eager may round differently in fused elementwise code:
    compiled runs are compared with compiled runs.)"""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # no shrinking: one compiled decoder per row count
    eng = engines[torch.float32]
    kw = dict(class_labels=LABELS[:4], method="ar", decode_images=False, compile=True,
              **{name: values[:4] for name, values in MIXED.items()})
    with inductor_config.patch({"cpp.vec_isa_ok": False}):  # scalar C++: a faster compile, the same question
        alone = eng.generate(batch_size=1, **kw)
        together = eng.generate(batch_size=3, **kw)
    assert alone.stats["compiled"] and all(alone.stats["compiled"].values()), alone.stats["compiled"]
    assert together.stats["admissions"] >= 1
    assert torch.equal(together.tokens, alone.tokens), \
        f"images {(together.tokens != alone.tokens).any(1).nonzero().flatten().tolist()} differ"


def test_the_switch_is_per_engine_and_per_call(engines):
    """``generate(deterministic=False)`` turns the mode off for that call only; ``set_deterministic``
    sets every linear layer of the target and the drafter."""
    eng = engines[torch.float32]
    layers = [m for root in (eng.gpt, eng.drafter) for m in root.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m, InvariantLinear) and m.batch_invariant for m in layers)
    seen = []
    orig = eng.gpt.output.forward

    def spy(x):
        seen.append(eng.gpt.output.batch_invariant)
        return orig(x)

    eng.gpt.output.forward = spy
    try:
        eng.generate(class_labels=[0], method="ar", decode_images=False, deterministic=False)
        assert seen and not any(seen)
        assert eng.deterministic and eng.gpt.output.batch_invariant  # restored
        seen.clear()
        eng.generate(class_labels=[0], method="ar", decode_images=False)
        assert seen and all(seen)
    finally:
        del eng.gpt.output.forward


def test_an_images_pixels_do_not_depend_on_what_it_is_decoded_with(engines):
    """The tokenizer decodes one image at a time in deterministic mode: image 0's pixels are the same
    decoded alone (a server's request) or with three others (generate's last images)."""
    eng = engines[torch.float32]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (4, eng.tokens_per_image), generator=g)
    together = eng.decode_images(tokens)
    alone = eng.decode_images(tokens[:1])
    assert np.array_equal(np.asarray(alone[0]), np.asarray(together[0]))
    assert not np.array_equal(np.asarray(together[1]), np.asarray(together[0]))  # different images


def test_the_server_returns_generates_images_in_fp32():
    """The issue's case: ``vvs-engine serve --method sjd-pac`` (fp32, batch-invariant by default) returns
    for class 3, n 2, seed 11 the tokens and PNGs that ``generate --deterministic`` makes offline for
    the same request (before the mode: 1 of the 2 images)."""
    pytest.importorskip("fastapi", reason="the server test needs the [serve] extra (fastapi, uvicorn)")
    import httpx
    from serve_utils import ServerProcess, png_pixels

    from vvs_engine import Engine

    proc = ServerProcess(["--method", "sjd-pac", "--rows", "4", "--dtype", "fp32", "--request-timeout", "300"])
    try:
        with httpx.Client(base_url=proc.url, timeout=300) as client:
            r = client.post("/v1/images/generations", json={"class_label": 3, "n": 2, "seed": 11, "return_tokens": True})
        assert r.status_code == 200, r.text
        served = r.json()["data"]
    finally:
        proc.kill()
    offline = Engine.load(dtype="fp32", threads=1, deterministic=True).generate(
        class_labels=[3, 3], method="sjd-pac", seed=11)
    for j, item in enumerate(served):
        assert item["tokens"] == offline.tokens[j].tolist(), j
        assert np.array_equal(png_pixels(item["b64_json"]), np.asarray(offline.images[j].convert("RGB"))), j


def test_the_flags():
    """``generate --deterministic`` (default off) and ``serve --no-deterministic`` (default on: the
    server passes ``deterministic=True`` unless the flag says False)."""
    from vvs_engine.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "--class-labels", "1", "--deterministic"]).deterministic is True
    assert parser.parse_args(["generate", "--class-labels", "1"]).deterministic is None
    assert parser.parse_args(["serve"]).deterministic is None
    assert parser.parse_args(["serve", "--no-deterministic"]).deterministic is False
