"""Dispatch (cuda -> triton -> reference, VVS_KERNELS) and the vvs:: custom ops (schemas, fake
implementations, tracing)."""
import os
import subprocess
import sys

import pytest
import torch

import vvs_engine.kernels as K
from vvs_engine.errors import VVSError
from vvs_engine.kernels import backends
from vvs_engine.kernels import reference as R
from vvs_engine.drafting.tree import children_table

import oracles as O


def small_inputs():
    gen = torch.Generator().manual_seed(0)
    B, H, Q, S, D, V = 2, 2, 5, 21, 16, 37
    parents = O.random_tree(7, 3, gen)
    fc, ns = O.sibling_lists(parents, gen)
    return {
        "tree_attention": (torch.randn(B, H, Q, D, generator=gen), torch.randn(B, H, S, D, generator=gen),
                           torch.randn(B, H, S, D, generator=gen), torch.tensor([9]),
                           torch.ones(Q, Q, dtype=torch.bool).tril(), torch.rand(B, S, generator=gen) < 0.8),
        "draft_topk": (torch.randn(2 * B, V, generator=gen), 3.0, 0.8, 10, 0.9, 4, torch.empty(B, V).exponential_(generator=gen)),
        "lantern_mass": (torch.softmax(torch.randn(6, V, generator=gen), -1), torch.randint(0, V, (6,), generator=gen),
                         torch.randint(0, V, (V, 5), generator=gen), 0.1, False),
        "group_mass": (torch.rand(6, V, generator=gen), torch.rand(6, V, generator=gen), torch.randint(-1, V, (6, 3), generator=gen)),
        "tree_meta": (parents, 3),
        "accept_walk": (torch.rand(7, generator=gen) < 0.6, fc, ns, 3),
        "tree_verify": (torch.randint(0, V, (B, 7), generator=gen), children_table(parents, 3)[None].repeat(B, 1, 1),
                        torch.softmax(torch.randn(B, 7, V, generator=gen), -1),
                        torch.softmax(torch.randn(B, 7, V, generator=gen), -1), 1.0 - torch.rand(B, 7, generator=gen),
                        1.0 - torch.rand(B, generator=gen), torch.randint(0, V, (V, 4), generator=gen), 0.2, False,
                        False, False, 3),
        "tree_level": (torch.randn(B, 3, generator=gen), -torch.rand(B, 3, 4, generator=gen),
                       torch.randint(0, V, (B, 3, 4), generator=gen), torch.randn(2 * B, 3, D, generator=gen),
                       torch.rand(2 * B, 3, 6, generator=gen) < 0.5, torch.tensor([4, 9, 4, 9]), S),
        # a dynamic tree of K = 2, depth 2: 10 candidates (levels of 2, 4, 4), frontier table [-1 | 0, 1 | 2 best]
        "tree_select": (torch.randn(B, 10, generator=gen).to(torch.float64),
                        1e-6 * torch.tensor([1, 1, 2, 2, 2, 2, 3, 3, 3, 3]),
                        torch.tensor([[-1, 0, 1, 2, 0], [-1, 0, 1, 3, 1]]), torch.tensor([0, 0, 0, 2, 2]),
                        torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4]), torch.randint(0, V, (B, 11), generator=gen),
                        -torch.rand(B, 11, generator=gen).to(torch.float64), 6, 3, 2),
        "counter_uniform": (torch.randint(-2**62, 2**62, (B,), generator=gen), torch.tensor([5, -1]),
                            torch.randint(-2**62, 2**62, (3,), generator=gen), 37),
        "kv_compact": (torch.randn(2, B, H, S, D, generator=gen), torch.randn(2, B, H, S, D, generator=gen),
                       torch.tensor([4, 5, 6]), torch.tensor([3, 4, 5])),
        "kv_move_rows": (torch.randn(2, B, H, S, D, generator=gen), torch.randn(2, B, H, S, D, generator=gen),
                         torch.tensor([[4, 5, 8], [10, 12, 13]]), torch.tensor([[4, 5, 6], [10, 11, 12]])),
        "gather_rows": (torch.randn(B, S, D, generator=gen), torch.tensor([3, 0, 7])),
        "invariant_linear": (torch.randn(7, D, generator=gen), torch.randn(V, D, generator=gen),
                             torch.randn(V, generator=gen)),
        "invariant_attention": (torch.randn(B, H, Q, D, generator=gen), torch.randn(B, H, S, D, generator=gen),
                                torch.randn(B, H, S, D, generator=gen), torch.tensor([9, 13]),
                                torch.rand(B, Q, Q, generator=gen) < 0.5, torch.rand(B, S, generator=gen) < 0.8),
        "scatter_rows_": (torch.randn(B, S, D, generator=gen), torch.tensor([3, 0, 7]), torch.randn(B, 3, D, generator=gen)),
    }


def clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def test_cpu_default_is_the_reference(monkeypatch):
    monkeypatch.delenv(backends.ENV, raising=False)
    assert set(backends.describe("cpu").values()) == {"reference"}


def test_forced_backend_errors_are_one_line(monkeypatch):
    monkeypatch.setenv(backends.ENV, "bogus")
    with pytest.raises(VVSError, match="not one of"):
        backends.choose("tree_meta", torch.device("cpu"))
    monkeypatch.setenv(backends.ENV, "cuda")
    if backends.cuda_module() is None or not torch.cuda.is_available():
        with pytest.raises(VVSError) as err:
            K.tree_meta(torch.tensor([-1, 0]), 1)
        assert "\n" not in str(err.value)
    monkeypatch.setenv(backends.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(VVSError, match="TRITON_INTERPRET"):
        K.group_mass(*small_inputs()["group_mass"])


IMPLEMENTS = {"reference": backends.CUDA_OPS | backends.TRITON_OPS, "triton": backends.TRITON_OPS,
              "cuda": backends.CUDA_OPS}


@pytest.mark.parametrize("op", sorted(backends.CUDA_OPS | backends.TRITON_OPS))
@pytest.mark.parametrize("backend", ["reference", "triton", "cuda"])
def test_public_ops_match_reference_through_custom_ops(monkeypatch, op, backend):
    """Forced backend through the vvs:: custom op == the torch reference called directly. With the
    reference backend this checks the custom-op plumbing (argument order, in-place ops, outputs)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if op not in IMPLEMENTS[backend]:
        pytest.skip(f"{backend} has no {op} kernel (forcing it falls through to the next backend)")
    if backend == "cuda" and (dev.type != "cuda" or backends.cuda_module() is None):
        pytest.skip("the CUDA extension needs a GPU and a CUDA build")
    if backend == "triton":
        if backends.triton_module() is None:
            pytest.skip("triton is not installed")
        if dev.type == "cpu":
            # conftest switched the interpreter on before any kernel was compiled; on a GPU the
            # kernels are compiled for the device, so the inputs move there instead.
            monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(backends.ENV, backend)
    assert backends.choose(op, dev) == backend  # a silent fall-back would compare the reference with itself
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in small_inputs()[op])
    want_args = clone(args)
    got = getattr(K, op)(*args)
    want = getattr(R, op)(*want_args)
    if got is None:  # in-place ops: compare the mutated inputs
        got, want = args, want_args
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        if isinstance(g, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", sorted(backends.CUDA_OPS | backends.TRITON_OPS))
def test_custom_op_schema_and_fake(monkeypatch, op):
    monkeypatch.setenv(backends.ENV, "reference")
    args = small_inputs()[op]
    torch.library.opcheck(getattr(torch.ops.vvs, op).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_ops_trace_under_torch_compile(monkeypatch):
    monkeypatch.setenv(backends.ENV, "reference")
    args = small_inputs()

    def step(q, k, v, P, local, parents, logits):
        out = K.tree_attention(q, k, v, P, local)
        mask, depth, paths, leaf = K.tree_meta(parents, 3)
        tokens, logp = K.draft_topk(logits, 3.0, 1.0, 0, 1.0, 4)
        return out.sum() + depth.sum() + tokens.sum() + logp.exp().sum()

    a = args["tree_attention"]
    inputs = (*a[:5], args["tree_meta"][0], args["draft_topk"][0])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), step(*inputs))


def test_forced_backend_without_the_op_falls_through(monkeypatch):
    monkeypatch.setenv(backends.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backends.triton_module() is None:
        pytest.skip("triton is not installed")
    cpu = torch.device("cpu")
    assert backends.choose("group_mass", cpu) == "triton"
    assert {backends.choose(op, cpu) for op in backends.CUDA_OPS} == {"reference"}


def test_triton_kernels_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.path.insert(0, '.');"
            "import triton_kernels as t; assert t.AVAILABLE is False; print('ok')")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
