"""Graph runner: the static-buffer path gives the same tokens as the plain loops.

On the CPU the runner runs its static-buffer code eagerly, which covers the buffer plumbing (inputs
copied into persistent buffers, outputs aliased until the next call, generator state handed in and
out, persistent sessions reused across images and calls). On a GPU the same tests replay CUDA graphs,
and the GPU-only tests check replay == eager and that steady-state rounds never sync with the host.
"""
from __future__ import annotations

import pytest
import torch

from spec_models import tiny_engine
from vvs_engine.methods import ar
from vvs_engine.rng import CounterRNG
from vvs_engine.runtime.runner import StaticCall, batch_bucket, get_runner, pad_conditions
from vvs_engine.sampling import SamplingParams

GPU = torch.cuda.is_available()
NO_GPU = "no CUDA device: CUDA-graph replay is exercised by benchmarks/gpu_suite.sh on a GPU machine"
DEVICES = ["cpu"] + (["cuda"] if GPU else [])


def _engine(device, **kw):
    e = tiny_engine(**kw)
    if device != "cpu":
        e.to(device, torch.float32)  # fp32 on the GPU too: identical tokens need no near-ties
    return e


@pytest.fixture(scope="module", params=DEVICES)
def eng(request):
    return _engine(request.param, vocab=64, block=36, peak=8.0)


def _keys(seed, n, device):
    return CounterRNG(seed, torch.arange(n, device=torch.device(device)))


def _ar_tokens(e, labels, params, seed, use_graphs):
    with torch.inference_mode():
        cond, km = e.condition_rows(labels, None, params.use_cfg)
        s = e.session(cond, km, len(labels), params)
        return ar.generate(s, params, _keys(seed, len(labels), e.device), use_graphs=use_graphs)


PARAMS = [SamplingParams(1.0, 0, 1.0, 4.0), SamplingParams(0.0, 0, 1.0, 1.0), SamplingParams(1.0, 8, 0.9, 2.0)]


@pytest.mark.parametrize("params", PARAMS, ids=["sample-cfg", "greedy-nocfg", "topk-topp"])
@pytest.mark.parametrize("labels", [[2], [0, 3, 4]], ids=["n1", "n3"])
def test_ar_static_path_equals_plain_loop(eng, params, labels):
    plain = _ar_tokens(eng, labels, params, 5, False).tokens
    graphed = _ar_tokens(eng, labels, params, 5, True)
    assert torch.equal(plain, graphed.tokens)
    assert graphed.stats["cuda_graphs"] == (eng.device.type == "cuda")
    # The runner is cached: a second call reuses its session (and graphs) and still agrees.
    again = _ar_tokens(eng, labels, params, 5, True).tokens
    assert torch.equal(plain, again)


def test_ar_cached_runner_follows_each_calls_random_keys(eng):
    """The cached runner's step reads the batch's counter-RNG keys from a static buffer: calls with
    different seeds through the same runner each equal the plain loop."""
    params = SamplingParams(1.0, 0, 1.0, 4.0)
    for seed in (9, 10, 9):
        assert torch.equal(_ar_tokens(eng, [1, 2], params, seed, True).tokens,
                           _ar_tokens(eng, [1, 2], params, seed, False).tokens)


def test_ar_padding_rows_do_not_change_real_rows(eng):
    """9 images, and the same 9 in a 12-image bucket (pads repeat image 8): the first 9 rows agree."""
    params = SamplingParams(1.0, 0, 1.0, 4.0)
    labels = [i % 5 for i in range(9)]
    assert batch_bucket(9) == 12
    graphed = _ar_tokens(eng, labels, params, 3, True).tokens
    with torch.inference_mode():
        cond, km = eng.condition_rows(labels, None, True)
        cond, km = pad_conditions(cond, km, 9, 12, True)
        s = eng.session(cond, km, 12, params)
        index = torch.tensor(list(range(9)) + [8] * 3, device=eng.device)
        plain = ar.generate(s, params, CounterRNG(3, index)).tokens
    assert graphed.shape == (9, eng.tokens_per_image)
    assert torch.equal(graphed, plain[:9])


def test_ar_t2i_caption_masks_through_the_cached_runner():
    """Text conditions with padded captions: the cached runner's session takes each call's key mask."""
    from vvs_engine.models.gpt import GPT, GPTConfig
    from vvs_engine.runtime.target import TargetSession

    torch.manual_seed(0)
    g = GPT(GPTConfig(dim=32, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, model_type="t2i",
                      cls_token_num=6, caption_dim=12)).double().eval()
    params = SamplingParams(1.0, 0, 1.0, 3.0)
    emb = torch.randn(3, 6, 12, dtype=torch.float64)
    cond = torch.cat([emb, g.cls_embedding.uncond_embedding.double()[None].expand_as(emb)])
    results = []
    for row, cut in ((0, 4), (1, 2)):
        mask = torch.ones(3, 6, dtype=torch.bool)
        mask[row, cut:] = False
        km = torch.cat([mask, mask])
        with torch.inference_mode():
            plain = ar.generate(TargetSession(g, cond, 3, True, km), params, _keys(1, 3, "cpu")).tokens
            graphed = ar.generate(TargetSession(g, cond, 3, True, km), params, _keys(1, 3, "cpu"),
                                  use_graphs=True).tokens
        assert torch.equal(plain, graphed)
        results.append(plain)
    assert not torch.equal(results[0], results[1])  # the mask mattered, and the runner followed it


def test_pad_conditions_layout():
    cond = torch.tensor([10, 11, 99, 99])  # two images with CFG: [cond; uncond]
    padded, _ = pad_conditions(cond, None, 2, 4, True)
    assert padded.tolist() == [10, 11, 10, 10, 99, 99, 99, 99]


def test_static_call_aliases_outputs_and_restores_generator():
    """Outputs are static buffers overwritten by the next call; a borrowed generator advances exactly
    as if the function had drawn from it directly."""
    gen = torch.Generator().manual_seed(0)
    own = torch.Generator()
    call = StaticCall("noise", lambda x: x + torch.rand(3, generator=own), [torch.zeros(3)], use_graph=False, gen=own)
    ref = torch.Generator().manual_seed(0)
    a = call(torch.ones(3), gen=gen)
    a_val = a.clone()
    expect_a = 1 + torch.rand(3, generator=ref)
    b = call(torch.full((3,), 2.0), gen=gen)
    expect_b = 2 + torch.rand(3, generator=ref)
    assert a is b  # one static output buffer
    assert torch.equal(a_val, expect_a) and torch.equal(b, expect_b)
    assert torch.equal(gen.get_state(), ref.get_state())


# --- GPU only -------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not GPU, reason=NO_GPU)


def _print_skip_reason():
    if not GPU:
        print(f"\n[test_runner] GPU tests skipped: {NO_GPU}")


_print_skip_reason()


@gpu
def test_gpu_ar_steady_state_never_syncs():
    e = _engine("cuda", vocab=64, block=36, peak=8.0)
    params = SamplingParams(1.0, 0, 1.0, 4.0)
    _ar_tokens(e, [1], params, 0, True)  # capture (capture itself synchronises)
    with torch.inference_mode():
        # Setup outside the check: building the condition rows copies from host memory (a sync).
        cond, km = e.condition_rows([1], None, True)
        r = get_runner(e.gpt, cond, 1, True, km, params, use_graphs=True)
        keys = _keys(0, 1, "cuda")
        r.session.prefill()
        first = torch.zeros(1, dtype=torch.long, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = r.ar_decode(first, keys)  # T - 1 replays, no host sync allowed
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert tokens.shape == (1, e.tokens_per_image)


@pytest.mark.skipif(GPU, reason="needs a machine where capture fails (no CUDA)")
def test_failed_capture_falls_back_to_eager_and_leaves_no_trace():
    """On the CPU a capture cannot even start: the call must warn, run eagerly with the same result,
    and leave its inputs and the generator as they were before the attempt."""
    own = torch.Generator().manual_seed(1)
    state = torch.zeros(2)

    def bump(x):
        x.add_(1)  # in-place state, like the AR step
        return x + torch.rand(2, generator=own)

    call = StaticCall("bump", bump, [state], use_graph=True, gen=own)
    ref_gen = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match="capture of 'bump' failed"):
        out = call()
    assert call.capture_error is not None and call.graph is None and not call.use_graph
    assert torch.equal(state, torch.ones(2))  # exactly one eager run took effect
    assert torch.equal(out, torch.ones(2) + torch.rand(2, generator=ref_gen))
