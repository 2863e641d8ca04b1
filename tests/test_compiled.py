"""Compiled decode rounds (torch.compile, Inductor's C++ backend on the CPU): the same tokens as eager
for every method, the eager fallback, no cache-sized temporaries, and the custom ops' fakes.

Compiling is slow on a loaded CPU, so every compile here is of a tiny model (1 layer, a 16-token
image, fp64 so that no greedy tie can flip), Inductor's C++ kernels are not vectorised (a fraction of
the code generation time; what is tested is the graph, not the vector ISA), and each compiled round
is shared: one module fixture decodes every method once eager and once compiled (greedy and sampled),
recording Inductor's code, and the tests read from it."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from spec_models import tiny_engine
from vvs_engine.kernels import flash, reference
from vvs_engine.models import gpt as gpt_module
from vvs_engine.measure import launches
from vvs_engine.runtime.compiled import FORCE_FAIL_ENV

METHODS = {  # method -> options: small trees, a skip schedule that skips on a 4-token image
    "ar": {},
    "eagle": dict(tree_total=6, tree_depth=2, tree_topk=2),
    "lantern": dict(tree_total=6, tree_depth=2, tree_topk=2),
    "vvs": dict(tree_total=6, tree_depth=2, tree_topk=2, skip_policy="uniform", skip_interval=2),
    "cascade": dict(tree_total=6, tree_depth=2, tree_topk=2),
    "sjd": dict(jacobi_window=3),
    "gsd": dict(jacobi_window=3),
    "scd": dict(jacobi_window=3, coupling="gumbel"),  # the Gumbel noise's own counter-RNG draw
    "sjd-pac": dict(jacobi_window=14, pac_width=3),  # W = D = 3: a main chain of 4
    "zipar": dict(zipar_window=2),
    # every PJD rule in one compile: lags 2 / 1, random drafts, drafts-only commits, the keep rule, a row cap
    "pjd": dict(zipar_window=2, zipar_commit_lag=1, zipar_jacobi_window=3, zipar_commit="drafts", zipar_keep=0.5,
                zipar_max_rows=2),
}
# Which decodes CI compiles (each a cold Inductor compile per round kind, ~5-50 s each here): every round
# kind once, sampled where the method samples drafts or acceptance uniforms, greedy for AR too and for
# the rules whose greedy path differs (CASCADE, GSD). "mixed" is a batch of images with their own seeds
# and settings (greedy next to sampled, top-k, top-p, cfg 1), one admitted mid-run: it compiles the
# sampled round (the greedy-only round is a graph of its own) and checks per-row settings on the way.
# VVS_TEST_COMPILED_ALL=1 runs every method every way.
RUNS = {"ar": ("greedy", "mixed"), "eagle": ("mixed",), "lantern": ("greedy",), "vvs": ("sampled",),
        "cascade": ("greedy",), "sjd": ("sampled",), "gsd": ("greedy",), "scd": ("sampled",),
        "sjd-pac": ("sampled",), "zipar": ("sampled",), "pjd": ("sampled",)}
if os.environ.get("VVS_TEST_COMPILED_ALL") == "1":
    RUNS = {method: ("greedy", "sampled", "mixed") for method in METHODS}
# the round kinds each method must have run compiled
KINDS = {"ar": {"ar_step"}, "vvs": {"verify", "skip", "verify_after_skip"}, "sjd": {"jacobi"}, "gsd": {"jacobi"},
         "scd": {"jacobi"}, "sjd-pac": {"jacobi"}, "zipar": {"zipar"}, "pjd": {"zipar"}}


def _engine():
    return tiny_engine(vocab=32, block=16, dtype=torch.float64, dim=32, n_layer=1, peak=3.0)


def _fast_inductor():
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp.vec_isa_ok": False})


def _generate(e, method, mode, compile):
    if mode == "mixed":
        kw = dict(class_labels=[0, 3, 1], seed=[3, 4, 5], temperature=[1.0, 0.0, 0.7], top_k=[0, 0, 5],
                  top_p=[1.0, 1.0, 0.9], cfg_scale=[3.0, 3.0, 1.0])
    else:
        kw = dict(class_labels=[0, 3], seed=3, temperature=0.0 if mode == "greedy" else 1.0)
    return e.generate(method=method, batch_size=2, decode_images=False, compile=compile, **kw, **METHODS[method])


GRAPHS = {}  # (method, mode) -> graphs Dynamo compiled for that decode (filled by the fixture)


@pytest.fixture(scope="module")
def runs():
    """{(method, mode): (eager output, compiled output)} and the recorded code per round kind."""
    torch.manual_seed(0)
    e = _engine()
    out = {}
    prev = os.environ.get("VVS_RETIRE_FINISHED")
    os.environ["VVS_RETIRE_FINISHED"] = "0"  # no retire sizes: one compile per round kind and setting
    from torch._dynamo.utils import counters

    try:
        with _fast_inductor(), launches.recording() as codes:
            for method in METHODS:
                for mode in RUNS[method]:
                    eager = _generate(e, method, mode, False)
                    before = counters["stats"]["unique_graphs"]
                    out[method, mode] = (eager, _generate(e, method, mode, True))
                    GRAPHS[method, mode] = counters["stats"]["unique_graphs"] - before
    finally:
        if prev is None:
            os.environ.pop("VVS_RETIRE_FINISHED")
        else:
            os.environ["VVS_RETIRE_FINISHED"] = prev
    return e, out, codes


@pytest.mark.parametrize("method", list(METHODS))
def test_compiled_tokens_equal_eager(runs, method):
    _, out, _ = runs
    for mode in RUNS[method]:
        eager, comp = out[method, mode]
        assert torch.equal(eager.tokens, comp.tokens), (method, mode)
        if mode == "mixed":  # one image waited for a free row: admission wrote its settings mid-run
            assert comp.stats["admissions"] >= 1
        assert "compiled" not in eager.stats or eager.stats["compiled"] == {}
        compiled = comp.stats["compiled"]
        assert compiled and all(compiled.values()), compiled
        assert KINDS.get(method, {"verify"}) <= set(compiled), compiled


def test_each_round_kind_compiles_once(runs):
    """One graph per round kind a decode ran, none recompiled on a later round: a round that fills a
    Python dict or memo while traced (as ZipAR's row offsets and CASCADE's per-tree terms once did) fails
    a guard on its next call and is compiled again (a cold compile in the middle of a decode)."""
    _, out, _ = runs
    for (method, mode), graphs in GRAPHS.items():
        kinds = out[method, mode][1].stats["compiled"]
        assert graphs == len(kinds), (method, mode, graphs, sorted(kinds))


def test_sampled_differs_from_greedy(runs):
    """Negative control: the sampled runs really sample (else greedy == sampled would test nothing)."""
    _, out, _ = runs
    both = [(m, mode) for m in METHODS for mode in RUNS[m] if mode != "greedy" and "greedy" in RUNS[m]]
    assert both and any(not torch.equal(out[m, "greedy"][1].tokens[:2], out[m, mode][1].tokens[:2]) for m, mode in both)


def test_compiled_ar_step_has_no_cache_sized_temporaries(runs, monkeypatch):
    """KV writes as index_put_ on the base cache: Inductor updates the cache in place. The old write
    through a layer view (negative control) makes it allocate cache-sized copies."""
    e, _, codes = runs
    cfg = e.gpt.config
    rows, slots = 2 * 2, (cfg.cls_token_num + cfg.block_size + 7) // 8 * 8  # batch 2 with CFG
    layer_numel = rows * cfg.n_head * slots * cfg.head_dim

    def big(code):
        return [s for s in launches.allocations(code) if torch.Size(s).numel() >= layer_numel]

    ar_codes = codes["ar_step"]
    assert ar_codes and all(big(c) == [] for c in ar_codes)

    def write_through_view(layer, slots, k, v):  # the write before this change: through the layer view
        cache = layer.cache
        B, H, T, _ = k.shape
        index = (torch.arange(B).view(B, 1, 1), torch.arange(H).view(1, H, 1), slots.view(-1, 1, T))
        cache.k[layer.index].index_put_(index, k)
        cache.v[layer.index].index_put_(index, v)

    monkeypatch.setattr(gpt_module, "write_kv", write_through_view)
    e.clear_cores()  # the engine keeps its compiled AR core: a new one traces the patched write
    with _fast_inductor(), launches.recording() as old:
        _generate(e, "ar", "greedy", True)
    e.clear_cores()  # later tests get a core compiled over the real write
    assert old["ar_step"] and big(old["ar_step"][0]), "the negative control should allocate cache copies"


def test_launch_count_reads_kernels_gemms_and_ops(runs):
    e, _, codes = runs
    n = launches.count(codes["ar_step"][0])
    # one layer: qkv, wo, w13 (gate/up fused), w2 and the head are GEMMs; one tree_attention; counter_uniform
    assert n.gemms == 5 and n.names.count("vvs.tree_attention") == e.gpt.config.n_layer
    assert n.kernels > 0 and n.total == n.kernels + n.gemms + n.custom + n.other


def _norm_mm_softmax(x, w):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.softmax(h @ w, -1), torch.cat([x[:, :3], x[:, 5:9]], 1) * 2


def test_gpu_style_count_reads_triton_kernels():
    """recording("gpu"): Inductor lowers to Triton as for CUDA (no GPU needed), the function runs
    eagerly (same results), no warning; the norm and the softmax are one Triton kernel each around the
    GEMM, the cat is fused into its consumer (force_pointwise_cat). The C++ style runs compiled."""
    from vvs_engine.runtime.compiled import CompiledRound

    x, w = torch.randn(4, 16, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with launches.recording("gpu") as codes:
            r = CompiledRound("probe", _norm_mm_softmax)
            out = r(x, w)
    assert not [w for w in caught if "torch.compile of round" in str(w.message)]
    assert r.ok is False  # code generated only: the round ran eagerly
    for got, want in zip(out, _norm_mm_softmax(x, w)):
        assert torch.equal(got, want)
    code = codes["probe"][0]
    assert "@triton.jit" in code and "cpp_fused" not in code
    n = launches.count(code)
    assert (n.gemms, n.custom, n.other) == (1, 0, 0) and 2 <= n.kernels <= 3, n
    with _fast_inductor(), launches.recording("cpu") as cpu_codes:
        r = CompiledRound("probe", _norm_mm_softmax)
        out = r(x, w)
    assert r.ok and "cpp_fused" in cpu_codes["probe"][0]
    assert torch.allclose(out[0], _norm_mm_softmax(x, w)[0])


def test_compile_failure_falls_back_to_eager(runs, monkeypatch):
    e, out, _ = runs
    monkeypatch.setenv(FORCE_FAIL_ENV, "verify")
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # as the fixture ran: one decoder shape, one warning
    e.clear_cores()  # the kept eagle core already runs compiled: a new one meets the forced failure
    with _fast_inductor(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _generate(e, "eagle", "mixed", True)
    e.clear_cores()  # later tests get a core that compiled
    assert torch.equal(res.tokens, out["eagle", "mixed"][0].tokens)
    assert res.stats["compiled"]["verify"] is False
    msgs = [str(w.message) for w in caught if "torch.compile of round 'verify' failed" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0]


# --- custom ops: fakes against the real layouts ------------------------------------------------------

def _engine_q_layout(B=2, T=3, H=4, hd=8):
    """q as the engine makes it: a transposed slice of the fused q/k/v projection (not contiguous)."""
    qkv = torch.randn(B, T, 3 * H, hd)
    q = qkv[:, :, :H].transpose(1, 2)
    assert not q.is_contiguous()
    return q


def test_tree_attention_opcheck_on_engine_layout():
    q = _engine_q_layout()
    B, H, T, hd = q.shape
    S = 16
    k, v = torch.randn(B, H, S, hd), torch.randn(B, H, S, hd)
    prefix = torch.tensor([5, 7])
    local = torch.ones(B, T, T, dtype=torch.bool).tril()
    out = torch.ops.vvs.tree_attention(q, k, v, prefix, local, None)
    # [B, Q, H, D] memory: the output projection's reshape is a view (no transpose-copy kernel)
    assert out.transpose(1, 2).is_contiguous()
    assert torch.equal(out, reference.tree_attention(q, k, v, prefix, local))
    torch.library.opcheck(torch.ops.vvs.tree_attention, (q, k, v, prefix, local, None))
    # any input layout (the op is flexible_layout: Inductor passes expanded and strided views as they are)
    P2, local2 = torch.tensor([6]).expand(B), torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    out2 = torch.ops.vvs.tree_attention(q.contiguous(), k, v, P2, local2, None)
    assert torch.equal(out2, reference.tree_attention(q, k, v, torch.tensor([6, 6]), local2.contiguous()))
    torch.library.opcheck(torch.ops.vvs.tree_attention, (q, k, v, P2, local2, None))


def _flash_emulation(q, k_cache, v_cache, cache_seqlens, causal):
    """flash_attn_with_kvcache's contract on [B, S, H, D] tensors, computed with SDPA (flash-attn is
    not installed here): returns a fresh contiguous [B, Q, H, D]."""
    B, Q, H, D = q.shape
    S = k_cache.shape[1]
    keys = torch.arange(S)
    n = cache_seqlens.long()[:, None, None]
    vis = keys[None, None, :] < n if not causal else keys[None, None, :] <= n - Q + torch.arange(Q)[None, :, None]
    y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                                         v_cache.transpose(1, 2), attn_mask=vis[:, None])
    return y.transpose(1, 2).contiguous()


def test_flash_op_fake_matches_real_layout(monkeypatch):
    monkeypatch.setattr(flash, "kvcache_fn", lambda: _flash_emulation)
    q = _engine_q_layout(T=1)
    B, H, _, hd = q.shape
    k, v = torch.randn(B, H, 16, hd), torch.randn(B, H, 16, hd)
    n_keys = torch.tensor([9])
    real = flash.attend(q, k, v, n_keys, causal=False)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.vvs.flash_attend(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v),
                                          mode.from_tensor(n_keys), False)
    assert fake.shape == real.shape and fake.stride() == real.stride()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :9], v[:, :, :9])
    assert torch.allclose(real, ref, atol=1e-6)
    torch.library.opcheck(torch.ops.vvs.flash_attend, (q, k, v, n_keys, False))


def test_cli_compile_flags():
    from vvs_engine.cli import build_parser

    p = build_parser()
    for cmd in ("generate", "generate-dataset"):
        extra = ["--out", "x"] if cmd == "generate-dataset" else []
        assert p.parse_args([cmd, *extra]).compile is None
        assert p.parse_args([cmd, "--compile", *extra]).compile is True
        assert p.parse_args([cmd, "--no-compile", *extra]).compile is False


# --- GPU only: compiled rounds inside CUDA graphs ------------------------------------------------------
GPU = torch.cuda.is_available()
NO_GPU = "no CUDA device: compiled rounds replayed inside CUDA graphs need a GPU"
gpu = pytest.mark.skipif(not GPU, reason=NO_GPU)
if not GPU:
    print(f"\n[test_compiled] GPU tests skipped: {NO_GPU}")


def _gpu_engine():
    torch.manual_seed(0)
    return tiny_engine(vocab=64, block=16, dtype=torch.float32, dim=32, n_layer=2, peak=3.0).to("cuda", "fp32")


@gpu
@pytest.mark.parametrize("method", ["ar", "eagle", "vvs", "sjd"])
def test_gpu_graph_replay_equals_the_compiled_round(method):
    """A compiled round captured in a CUDA graph and replayed gives the tokens of the same compiled round
    run without graphs (GPU kernels differ from eager in the last bits: compiled is the reference)."""
    e = _gpu_engine()
    kw = dict(class_labels=[0, 3], method=method, seed=3, batch_size=2, decode_images=False, compile=True,
              **METHODS[method])
    replayed = e.generate(cuda_graphs=True, **kw)
    direct = e.generate(cuda_graphs=False, **kw)
    assert replayed.stats["cuda_graphs"] and all(replayed.stats["compiled"].values()), replayed.stats
    assert torch.equal(replayed.tokens, direct.tokens)


@gpu
def test_gpu_compiled_graph_replays_never_sync():
    """Steady state: replays of the compiled AR step inside its graph make no host sync."""
    from vvs_engine.methods import get_method
    from vvs_engine.methods.common import DecodeBatch
    from vvs_engine.rng import CounterRNG
    from vvs_engine.runtime.loop import LateRead
    from vvs_engine.runtime.runner import RoundGraphs
    from vvs_engine.sampling import SamplingParams

    e = _gpu_engine()
    params = SamplingParams(1.0, 0, 1.0, 4.0)
    with torch.inference_mode():
        cond, km = e.condition_rows([1], None, True)
        run, opts = get_method("ar", e, {})
        dec = run(e, DecodeBatch(cond, km, CounterRNG(0, torch.zeros(1, dtype=torch.long, device="cuda")), 1),
                  params, opts)
        graphs = RoundGraphs(dec.round_functions(), dec.round_buffers(), use_graphs=True, compile=True)
        graphs("ar_step")  # compile and capture
        late = LateRead(dec.status())
        late.push()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(e.tokens_per_image - 2):
                late.read()
                graphs("ar_step")
                late.push()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert graphs.compiled() == {"ar_step": True} and int(dec.state.count.min()) == e.tokens_per_image


@pytest.mark.parametrize("vectorized", [True, False])
def test_cpu_compiled_norm_and_softmax_are_atens(vectorized, tmp_path, monkeypatch):
    """Inside a CPU compile, RMSNorm's mean and the sampling softmax are ATen's kernels: bit-equal to
    eager (what keeps compiled CPU tokens equal to eager ones in fp32). Negative control: Inductor's
    own C++ reductions (vectorized or scalar) sum in another order and differ in the last bit.

    Compiled fresh, in a private cache and without the FX graph cache: a cached graph's C++ written for
    another machine's vector ISA does not build on one whose ISA check fails (seen on a CI machine)."""
    from unittest import mock

    import torch._inductor.config as inductor_config

    from vvs_engine import sampling
    from vvs_engine.models.gpt import RMSNorm
    from vvs_engine.runtime.compiled import INDUCTOR_OPTIONS

    torch.manual_seed(0)
    norm = RMSNorm(256).eval()
    x = torch.randn(64, 1, 256) * 3
    logits = torch.randn(16, 1024) * 4

    def fn(x, logits):
        return norm(x), sampling.softmax_last(logits)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fresh = inductor_config.patch({"fx_graph_cache": False, "cpp.vec_isa_ok": None if vectorized else False})
    with torch.no_grad(), fresh:
        want = fn(x, logits)
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, options=dict(INDUCTOR_OPTIONS))(x, logits)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        with mock.patch.object(sampling, "_eager_exact", lambda t: False):
            torch._dynamo.reset()
            fused = torch.compile(fn, fullgraph=True, options=dict(INDUCTOR_OPTIONS))(x, logits)
        torch._dynamo.reset()
    assert not torch.equal(fused[0], want[0]) and torch.allclose(fused[0], want[0], rtol=1e-6)


def test_launch_count_sees_every_call_form():
    """Generated wrappers call Triton kernels (.run), extern GEMMs, torch.ops custom ops and aten
    fallbacks written as ``aten.op(...)`` / ``aten.op.overload(...)``; comments are not launches."""
    code = '\n'.join([
        "k0 = async_compile.triton('k0', '''...''')", "def call(self, args):", "    k0.run(a, b)",
        "    aten.index_put_(arg1, [x], y, True)", "    buf2 = aten.sort.stable(buf1)",
        "    extern_kernels.mm(a, b, out=c)", "    buf3 = torch.ops.aten.topk.default(buf1, 3)",
        "    buf4 = torch.ops.vvs.tree_select.default(buf1)", "    # aten.foo(x) in a comment",
        "runner = Runner(partitions=[])"])
    n = launches.count(code)
    assert (n.kernels, n.gemms, n.custom, n.other) == (1, 1, 1, 3), n


def test_per_image_settings_compile_to_the_eager_tokens(runs):
    """Images with their own seeds and settings (greedy next to sampled, top-k, top-p, cfg 1) in one
    compiled batch, one admitted mid-run: the rounds read each row's settings from the persistent
    buffers admission writes, and give eager's tokens (AR, and EAGLE-2 with its per-row draft ranking
    and both verification paths). The decodes are the fixture's "mixed" runs."""
    _, out, _ = runs
    for method in ("ar", "eagle"):
        eager, compiled = out[method, "mixed"]
        assert compiled.stats["admissions"] >= 1
        assert compiled.stats["compiled"] and all(compiled.stats["compiled"].values()), compiled.stats["compiled"]
        assert torch.equal(eager.tokens, compiled.tokens), method


def test_a_warm_engine_compiles_and_captures_nothing_more(runs, monkeypatch):
    """The engine keeps each decode core (runtime.core): once a setting has run compiled, calling again
    compiles no graph and captures no round kind, and decodes the same tokens. (The first call here may
    trace again: other tests in this file reset Dynamo or clear the engine's cores.)"""
    e, out, _ = runs
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # as the fixture ran: the row counts it built
    with _fast_inductor():
        for method, mode in (("ar", "greedy"), ("eagle", "mixed")):
            _generate(e, method, mode, True)
            again = _generate(e, method, mode, True)
            assert (again.stats["compiles"], again.stats["graph_captures"]) == (0, 0), (method, mode)
            assert torch.equal(again.tokens, out[method, mode][1].tokens), (method, mode)
