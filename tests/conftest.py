"""The suite's caches live in one temporary folder, removed when the run ends: the Zoo's reference
features ($VVS_CACHE, else ~/.cache/vvs_engine), TorchInductor's compiled kernels and Triton's (else
/tmp/torchinductor_$USER and ~/.triton, kept after the run), matplotlib's font cache (the Zoo photos,
bench plots) and Hugging Face's (transformers, for the other families). Set before any test imports
torch's compiler, and inherited by the command-line runs the tests start. Left in the checkout, as
for any Python project: __pycache__ and pytest's own .pytest_cache (both ignored by git)."""
import os
import shutil
import tempfile

CACHE_VARIABLES = ("VVS_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR", "HF_HOME")
_suite_cache = None


def pytest_configure(config):
    global _suite_cache
    _suite_cache = tempfile.mkdtemp(prefix="vvs-test-cache-")
    for name in CACHE_VARIABLES:
        os.environ[name] = os.path.join(_suite_cache, name.lower())


def pytest_unconfigure(config):
    if _suite_cache is not None:
        shutil.rmtree(_suite_cache, ignore_errors=True)
