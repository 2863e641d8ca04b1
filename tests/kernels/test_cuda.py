"""CUDA kernels: nvcc compilation of every csrc/*.cu (CI, no GPU needed) and, on a GPU with the
extension built, each CUDA kernel against its torch reference."""
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vvs_engine.kernels import reference as R
from vvs_engine.kernels.backends import cuda_module

import oracles as O

ROOT = Path(__file__).resolve().parents[2]


def skip(reason: str):
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def test_every_cu_file_compiles_for_sm80_and_sm90a(tmp_path):
    if shutil.which("nvcc") is None:
        skip("nvcc is not on PATH; CUDA compile check not run")
    res = subprocess.run(["bash", str(ROOT / ".ci" / "compile_cuda.sh"), str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    for cu in (ROOT / "csrc").glob("*.cu"):
        assert (tmp_path / f"{cu.stem}.o").stat().st_size > 0, cu.name


@pytest.fixture(scope="module")
def C():
    if not torch.cuda.is_available():
        skip("no CUDA device: CUDA kernels not run")
    module = cuda_module()
    if module is None:
        skip("vvs_engine._C is not built (pip install --no-build-isolation . on a CUDA machine)")
    return module


@pytest.mark.parametrize("n,max_depth", [(1, 1), (7, 3), (64, 6), (300, 12)])
def test_cuda_tree_meta(C, n, max_depth):
    parents = O.random_tree(n, max_depth, torch.Generator().manual_seed(n))
    got = C.tree_meta(parents.cuda(), max_depth)
    for g, w in zip(got, R.tree_meta(parents, max_depth)):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("n,max_depth,p_acc", [(1, 2, 1.0), (9, 3, 0.5), (64, 6, 0.7), (64, 10, 1.0)])
def test_cuda_accept_walk(C, n, max_depth, p_acc):
    gen = torch.Generator().manual_seed(n)
    parents = O.random_tree(n, max_depth, gen)
    fc, ns = O.sibling_lists(parents, gen)
    accepted = torch.rand(n, generator=gen) < p_acc
    got = C.accept_walk(accepted.cuda(), fc.cuda(), ns.cuda(), max_depth)
    for g, w in zip(got, R.accept_walk(accepted, fc, ns, max_depth)):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 7])  # 16-byte units, and the 2/4-byte fallback
@pytest.mark.parametrize("src,dst", [([2, 3], [1, 2]), ([5, 6, 7, 8], [4, 5, 6, 7]), ([1, 2], [2, 3]), ([4, 0], [0, 4])])
def test_cuda_kv_compact_overlap(C, dtype, D, src, dst):
    k = torch.randn(3, 2, 4, 16, D, device="cuda").to(dtype)
    v = torch.randn(3, 2, 4, 16, D, device="cuda").to(dtype)
    src, dst = torch.tensor(src, device="cuda"), torch.tensor(dst, device="cuda")
    want_k, want_v = k.clone(), v.clone()
    R.kv_compact(want_k, want_v, src, dst)
    C.kv_compact(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_cuda_kv_compact_large_moves_split_columns(C):
    # 600 moves x 256 B rows exceed one block's staging buffer: the launcher splits columns.
    k = torch.randn(2, 1, 2, 1300, 64, device="cuda")
    v = torch.randn(2, 1, 2, 1300, 64, device="cuda")
    src = torch.arange(100, 700, device="cuda")
    dst = src - 50
    want_k, want_v = k.clone(), v.clone()
    R.kv_compact(want_k, want_v, src, dst)
    C.kv_compact(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_gather_scatter_rows(C, dtype):
    x = torch.randn(2, 40, 1280, device="cuda").to(dtype)
    idx = torch.tensor([5, 39, 0, 17], device="cuda")
    assert torch.equal(C.gather_rows(x, idx), R.gather_rows(x, idx))
    src = torch.randn(2, 4, 1280, device="cuda").to(dtype)
    y, want = x.clone(), x.clone()
    C.scatter_rows_(y, idx, src)
    R.scatter_rows_(want, idx, src)
    assert torch.equal(y, want)


def test_cuda_ops_capture_in_a_cuda_graph(C):
    parents = O.random_tree(64, 6, torch.Generator().manual_seed(0)).cuda()
    k = torch.randn(2, 2, 4, 32, 64, device="cuda")
    v = torch.randn_like(k)
    src = torch.tensor([10, 11, 12], device="cuda")
    dst = torch.tensor([9, 10, 11], device="cuda")
    want_k, want_v = k.clone(), v.clone()
    R.kv_compact(want_k, want_v, src, dst)
    assert not torch.equal(k, want_k)  # the move changes the cache, so the check below can fail
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta = C.tree_meta(parents, 6)
        C.kv_compact(k, v, src, dst)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(meta[1].cpu(), R.tree_meta(parents.cpu(), 6)[1])
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # replay ran the captured kv_compact


def test_default_dispatch_on_cuda_prefers_compiled_kernels(C, monkeypatch):
    from vvs_engine.kernels import backends

    monkeypatch.delenv(backends.ENV, raising=False)
    chosen = backends.describe("cuda")
    for op in backends.CUDA_OPS:
        assert chosen[op] == "cuda", op
    if backends.triton_module() is not None:
        for op in backends.TRITON_OPS:
            assert chosen[op] == "triton", op
