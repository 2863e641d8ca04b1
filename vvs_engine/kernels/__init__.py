"""Kernel dispatch. Every op has a torch reference (also the CPU path); faster backends register
themselves in :mod:`vvs_engine.kernels.dispatch` (issue: Kernels)."""
from .reference import kv_compact  # noqa: F401
