"""The suite's caches live in one temporary folder, removed when the run ends: the Zoo's reference
features ($VVS_CACHE, else ~/.cache/vvs_engine), TorchInductor's compiled kernels and Triton's (else
/tmp/torchinductor_$USER and ~/.triton, kept after the run), matplotlib's font cache (the Zoo photos,
bench plots) and Hugging Face's (transformers, for the other families). Set before any test imports
torch's compiler, and inherited by the command-line runs the tests start. Left in the checkout, as
for any Python project: __pycache__ and pytest's own .pytest_cache (both ignored by git)."""
import os
import shutil
import tempfile

import pytest
import torch

CACHE_VARIABLES = ("VVS_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR", "HF_HOME")
_suite_cache = None


def pytest_configure(config):
    global _suite_cache
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest -n N: N worker processes share the cores; one torch thread each (the tests' models
        # are tiny: launch-bound, so processes in parallel beat threads in one)
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    _suite_cache = tempfile.mkdtemp(prefix="vvs-test-cache-")
    for name in CACHE_VARIABLES:
        os.environ[name] = os.path.join(_suite_cache, name.lower())


# Which file runs beside which: pytest-xdist's loadfile hands files out by test count (its default
# reorder). Measured on the idle 2-core machine (2026-12-04): that order 528 s; longest files first 574 s,
# and 544 s with the Ray and server files kept away from the compile fixture and Inductor's compile pool
# off. Whatever waits beside the compile fixture runs slower, and the Ray clusters burn CPU while they
# wait, so the default's mix (the fixture starting beside many short tests) is kept.


def pytest_unconfigure(config):
    if _suite_cache is not None:
        shutil.rmtree(_suite_cache, ignore_errors=True)


# --- fixtures shared by several test files -----------------------------------------------------------


@pytest.fixture(scope="module")
def eng():
    """A tiny random target + drafter + VQ (fp64); a test file may define its own ``eng``."""
    from spec_models import tiny_engine

    return tiny_engine(vocab=64, block=36, peak=8.0)


@pytest.fixture(scope="module")
def greedy_ar(eng):
    from spec_models import LABELS

    return eng.generate(class_labels=LABELS, temperature=0, cfg_scale=3.0, decode_images=False).tokens


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny project checkpoints on disk (target and VQ): the CLI and reference-mode tests load them."""
    from spec_models import tiny_gpt_config, tiny_vq_config
    from vvs_engine.checkpoint import save_safetensors
    from vvs_engine.models.gpt import GPT
    from vvs_engine.models.vq import VQModel

    d = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    gpt_cfg = tiny_gpt_config()
    gpt = GPT(gpt_cfg)
    gpt_path = str(d / "gpt.safetensors")
    save_safetensors(gpt, gpt_path, gpt_cfg.to_dict(), kind="gpt")
    vq_cfg = tiny_vq_config()
    vq = VQModel(vq_cfg)
    vq_path = str(d / "vq.safetensors")
    save_safetensors(vq, vq_path, vq_cfg.to_dict(), kind="vq")
    return {"dir": d, "gpt": gpt_path, "vq": vq_path, "gpt_model": gpt, "sd": gpt.state_dict()}
