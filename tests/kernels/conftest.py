"""Kernel tests. Without a GPU the Triton kernels run under the Triton interpreter, which must be
switched on before any kernel module is imported (``@triton.jit`` reads it at decoration time)."""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # oracles.py


@pytest.fixture(scope="session")
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def triton_kernels():
    """The Triton launchers (``vvs_engine.triton_kernels``), or a skip with the reason."""
    from vvs_engine.kernels.backends import triton_module

    module = triton_module()
    if module is None:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    return module
