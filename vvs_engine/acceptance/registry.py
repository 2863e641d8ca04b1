"""Acceptance rules added by later methods (GSD's grouped rule, CASCADE) register a factory here so
every drafter-based method, VVS skipping included, can use them by name (``--accept NAME``)."""
from __future__ import annotations

from ..errors import VVSError

_FACTORIES = {}


def register_rule(name: str, factory) -> None:
    """factory(engine, **options) -> AcceptanceRule"""
    _FACTORIES[name] = factory


def rule_names():
    _load()
    return ["exact", "lantern", "lantern++"] + sorted(_FACTORIES)


def _load():
    import importlib

    for mod in ("vvs_engine.acceptance.gsd", "vvs_engine.acceptance.cascade"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def make(name: str, engine, **kw):
    _load()
    if name not in _FACTORIES:
        raise VVSError(f"unknown acceptance rule '{name}'; known: {', '.join(rule_names())}")
    return _FACTORIES[name](engine, **kw)
