"""Drafter-based methods on the shared speculative loop. Each is the loop with different defaults:

* ``eagle``: EAGLE-2 dynamic tree, exact acceptance (lossless).
* ``lantern``: dynamic tree, LANTERN relaxed acceptance (δ, k).
* ``lantern++``: static EAGLE-1 tree (sampled drafts), LANTERN++ acceptance (λ, k).
Any rule works with any tree (``accept``, ``tree`` options).
"""
from __future__ import annotations

from dataclasses import dataclass

from .registry import register
from .speculative import SpecOptions, run


def _with_defaults(opts: SpecOptions, accept, tree):
    if opts.accept is None:
        opts.accept = accept
    if opts.tree is None:
        opts.tree = tree
    return opts


@dataclass
class EagleOptions(SpecOptions):
    pass


@register("eagle", EagleOptions)
def run_eagle(engine, batch, params, opts):
    return run(engine, batch, params, _with_defaults(opts, "exact", "dynamic"))


@register("lantern", EagleOptions)
def run_lantern(engine, batch, params, opts):
    return run(engine, batch, params, _with_defaults(opts, "lantern", "dynamic"))


@register("lantern++", EagleOptions)
def run_lantern_pp(engine, batch, params, opts):
    return run(engine, batch, params, _with_defaults(opts, "lantern++", "static"))
