"""The acceptance-rule registry: every rule (exact, lantern, lantern++, gsd, cascade, ...) registers a
factory here, so every drafter-based method, VVS skipping included, can use it by name (``--accept NAME``)."""
from __future__ import annotations

import importlib

from ..errors import VVSError

_FACTORIES = {}
_RULE_MODULES = ("verify", "gsd", "cascade")  # the modules that register the shipped rules


def register_rule(name: str, factory) -> None:
    """factory(engine, **options) -> AcceptanceRule"""
    _FACTORIES[name] = factory


def _load() -> None:
    for mod in _RULE_MODULES:
        importlib.import_module(f"{__package__}.{mod}")


def rule_names():
    _load()
    return list(_FACTORIES)


def check_rule_name(name: str) -> None:
    """A one-line error for an unknown rule; callers check before any model loads."""
    _load()
    if name not in _FACTORIES:
        raise VVSError(f"unknown acceptance rule '{name}'; known: {', '.join(rule_names())}")


def make(name: str, engine, **kw):
    check_rule_name(name)
    return _FACTORIES[name](engine, **kw)
