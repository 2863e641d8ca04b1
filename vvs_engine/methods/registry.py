"""The method registry: each method module registers its function and options class here.

A method registers ``make(engine, batch: DecodeBatch, params, opts) -> decoder``: a decoder of the one
decode loop (``runtime/loop.py`` documents the protocol) prefilled with the batch. :func:`get_method`
parses user options into the options class (``validate()``,
``check_engine(engine)``). Method modules are loaded by name (:data:`METHOD_MODULES`), as the
acceptance rules are, so the registry imports no method module.
"""
from __future__ import annotations

from dataclasses import asdict, fields, is_dataclass
from importlib import import_module

from ..errors import VVSError

_REGISTRY = {}


def register(name: str, options_cls=None):
    def deco(fn):
        _REGISTRY[name] = (fn, options_cls)
        return fn
    return deco


def method_names():
    _load_all()
    return sorted(_REGISTRY)


METHOD_MODULES = ("ar", "cascade", "eagle", "jacobi", "quant_draft", "row_drafts", "scd", "sjd_pac", "vvs", "zipar")


def _load_all():
    """Import the method modules for their registrations."""
    for name in METHOD_MODULES:
        import_module(f"{__package__}.{name}")


def parse_options(options_cls, opts: dict, method: str):
    opts = {k: v for k, v in opts.items() if v is not None}  # None = "not given": the default applies
    if options_cls is None:
        if opts:
            raise VVSError(f"method '{method}' takes no options, got {', '.join(sorted(opts))}")
        return None
    names = {f.name for f in fields(options_cls)}
    unknown = sorted(k for k in opts if k not in names)
    if unknown:
        raise VVSError(f"unknown option(s) for method '{method}': {', '.join(unknown)}")
    o = options_cls(**{k: v for k, v in opts.items() if v is not None})
    return o.validate() if hasattr(o, "validate") else o


def _registered(name: str):
    """(make, options class) of a registered method, or a one-line error naming the known ones."""
    _load_all()
    if name not in _REGISTRY:
        raise VVSError(f"unknown method '{name}'; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get_method_options(name: str, opts: dict):
    """Parse and validate a method's options without an engine (the CLI checks flags before loading)."""
    return parse_options(_registered(name)[1], dict(opts), name)


def get_method(name: str, engine, opts: dict):
    fn, ocls = _registered(name)
    o = parse_options(ocls, dict(opts), name)
    if hasattr(o, "check_engine"):
        o.check_engine(engine)
    return fn, o


def resolve_options(name: str, opts: dict) -> dict:
    """The method's effective options (defaults filled in) as a plain dict, without an engine."""
    o = get_method_options(name, opts)
    return asdict(o) if is_dataclass(o) else {}
