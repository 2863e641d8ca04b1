"""Decoding methods. Each is one small module composing the shared parts (target session, draft
tree, acceptance rule, caches, schedule) and registering itself in ``registry.py``; the loop,
graphs, compile, admission and retirement live once in ``runtime/`` (``runtime/loop.py``).
"""
from .registry import (get_method, get_method_options, method_names, parse_options, register,  # noqa: F401
                       resolve_options)
