"""Out-of-range indices: the references raise; the Triton and CUDA kernels touch nothing out of range,
poison the affected rows and raise the device flag that ``bounds.raise_if_set`` turns into a VVSError.

The references are fed bad indices on the CPU only: on CUDA, torch's own indexing kernels meet them
with a device-side assert, which poisons the CUDA context for the rest of the process."""
import pytest
import torch

from vvs_engine.errors import VVSError
from vvs_engine.kernels import bounds
from vvs_engine.kernels import reference as R


def mass_inputs(gen, M=4, V=50, k=6):
    p = torch.softmax(torch.randn(M, V, generator=gen), -1)
    q = torch.softmax(torch.randn(M, V, generator=gen), -1)
    tokens = torch.randint(V, (M,), generator=gen)
    neighbors = torch.randint(V, (V, k), generator=gen)
    members = torch.randint(V, (M, 3), generator=gen)
    return p, q, tokens, neighbors, members


@pytest.mark.parametrize("bad", ["token", "neighbor"])
def test_lantern_mass_bad_index(triton_kernels, device, bad):
    p, _, tokens, neighbors, _ = (t.to(device) for t in mass_inputs(torch.Generator().manual_seed(0)))
    V = p.shape[1]
    if bad == "token":
        tokens[2] = V + 3
    else:
        neighbors[tokens[2], 1] = V
    with pytest.raises((IndexError, RuntimeError)):
        R.lantern_mass(p.cpu(), tokens.cpu(), neighbors.cpu(), 0.3, False)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    relaxed, m_star = triton_kernels.lantern_mass(p, tokens, neighbors, 0.3, False, error_flag=flag)
    assert flag.item() == 1
    assert relaxed[2].isnan() and m_star[2].item() == -1
    good = torch.tensor([0, 1, 3], device=device)
    want = R.lantern_mass(p[good], tokens[good], neighbors, 0.3, False)
    torch.testing.assert_close(relaxed[good], want[0])
    assert torch.equal(m_star[good], want[1])


def test_lantern_mass_good_indices_leave_the_flag_down(triton_kernels, device):
    p, _, tokens, neighbors, _ = (t.to(device) for t in mass_inputs(torch.Generator().manual_seed(1)))
    neighbors[:, -1] = -1  # padding is not an error
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    triton_kernels.lantern_mass(p, tokens, neighbors, 0.5, True, error_flag=flag)
    assert flag.item() == 0


def test_group_mass_bad_member(triton_kernels, device):
    p, q, _, _, members = (t.to(device) for t in mass_inputs(torch.Generator().manual_seed(2)))
    members[1, 2] = p.shape[1]
    members[3, 0] = -1  # padding
    with pytest.raises((IndexError, RuntimeError)):
        R.group_mass(p.cpu(), q.cpu(), members.cpu())
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    sum_p, sum_q = triton_kernels.group_mass(p, q, members, error_flag=flag)
    assert flag.item() == 1 and sum_p[1].isnan() and sum_q[1].isnan()
    good = torch.tensor([0, 2, 3], device=device)
    want_p, want_q = R.group_mass(p[good], q[good], members[good])
    torch.testing.assert_close(sum_p[good], want_p)
    torch.testing.assert_close(sum_q[good], want_q)


def test_dispatch_raises_flag_and_debug_mode(triton_kernels, device, monkeypatch):
    from vvs_engine import kernels as K

    monkeypatch.setenv("VVS_KERNELS", "triton")
    p, q, _, _, members = (t.to(device) for t in mass_inputs(torch.Generator().manual_seed(3)))
    members[0, 0] = 10**6
    bounds.error_flag(device).zero_()
    K.group_mass(p, q, members)  # no sync, no error yet
    with pytest.raises(VVSError, match="out-of-range index"):
        bounds.raise_if_set(device, "generation")
    bounds.raise_if_set(device)  # the check cleared the flag
    if device.type == "cuda":  # "cuda" and "cuda:0" name the same flag
        K.group_mass(p, q, members)
        with pytest.raises(VVSError, match="out-of-range index"):
            bounds.raise_if_set(torch.device("cuda", torch.cuda.current_device()))
    monkeypatch.setenv(bounds.DEBUG_ENV, "1")
    with pytest.raises(VVSError, match="triton group_mass"):
        K.group_mass(p, q, members)


@pytest.mark.parametrize("bad", ["src", "dst"])
def test_kv_compact_reference_raises(bad):
    k = torch.zeros(2, 1, 2, 10, 4)
    v = torch.zeros_like(k)
    src, dst = torch.tensor([3, 4]), torch.tensor([1, 2])
    (src if bad == "src" else dst)[1] = 10 if bad == "src" else -11
    with pytest.raises((IndexError, RuntimeError)):
        R.kv_compact(k, v, src, dst)


def test_row_ops_reference_raise():
    x = torch.zeros(2, 8, 4)
    with pytest.raises((IndexError, RuntimeError)):
        R.gather_rows(x, torch.tensor([0, 8]))
    with pytest.raises((IndexError, RuntimeError)):
        R.scatter_rows_(x, torch.tensor([9]), torch.ones(2, 1, 4))


def test_cuda_data_movement_bad_index_sets_flag():
    from vvs_engine.kernels.backends import cuda_module

    if not torch.cuda.is_available() or cuda_module() is None:
        reason = "no CUDA device" if not torch.cuda.is_available() else "vvs_engine._C is not built"
        print(f"SKIP: {reason}: CUDA bounds flag not checked")
        pytest.skip(reason)
    C = cuda_module()
    k = torch.randn(2, 1, 2, 16, 8, device="cuda")
    v = torch.randn_like(k)
    before_k, before_v = k.clone(), v.clone()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    C.kv_compact(k, v, torch.tensor([5, 99], device="cuda"), torch.tensor([1, 2], device="cuda"), flag)
    assert flag.item() == 1
    R.kv_compact(before_k, before_v, torch.tensor([5], device="cuda"), torch.tensor([1], device="cuda"))
    assert torch.equal(k, before_k) and torch.equal(v, before_v)  # the good pair moved, the bad one did not
    flag.zero_()
    x = torch.randn(2, 8, 4, device="cuda")
    out = C.gather_rows(x, torch.tensor([1, 8], device="cuda"), flag)
    assert flag.item() == 1 and torch.equal(out[:, 0], x[:, 1])
    flag.zero_()
    C.scatter_rows_(x, torch.tensor([-1], device="cuda"), torch.ones(2, 1, 4, device="cuda"), flag)
    assert flag.item() == 1
