"""Kernel dispatch. Every op has a torch reference (also the CPU path) in ``reference.py``; faster
backends (Triton, CUDA) are chosen by availability, overridable with ``VVS_KERNELS``."""
from .reference import kv_compact, local_visibility, tree_attention  # noqa: F401
