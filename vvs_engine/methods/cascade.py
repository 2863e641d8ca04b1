"""CASCADE (arXiv 2605.07230): the shared speculative loop with CASCADE's relaxed acceptance
(:mod:`vvs_engine.acceptance.cascade`) on an EAGLE-1 static tree (``naive_extend_57``).

``cascade_variant`` picks a preset: ``engine`` (default), ``llamagen`` or ``lumina-final`` (the
authors' two published codes; docs/reference_modes.md). A ``cascade_*`` option given with a value
other than the engine default overrides the preset's value. The engine default keeps the LlamaGen
thresholds and depth term (τ_b 0.9, τ_d 0.625 on the target's logits at parent and child) and takes,
from measurements on the Zoo model (benchmarks/studies/spec_zoo/cascade_zoo.py), the target's hidden states as the
breadth source and the Lumina final nucleus gate evaluated once per parent (see
``acceptance.cascade.DEFAULTS``; the method: docs/methods.md §3). Every SpecOptions option applies
too (``skip_policy`` for VVS skipping,
``tree dynamic`` with a target source, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..acceptance.cascade import DEFAULTS, DRAFTER_SOURCES, check_options, variant_options
from ..errors import VVSError
from .registry import register
from .options import option
from .speculative import SpecOptions, run


@dataclass
class CascadeOptions(SpecOptions):
    cascade_breadth_threshold: float = option(0.9, "CASCADE: breadth threshold tau_b (cosine of next-token "
                                                   "predictions within a level)")
    cascade_depth_threshold: float = option(0.625, "CASCADE: depth threshold tau_d (cosine of the target's "
                                                   "state at parent and child)")
    cascade_gate: str = option("nucleus", "CASCADE: gate of the relaxation: nucleus, kl, entropy or none")
    cascade_source: str = option("target-hidden", "CASCADE: breadth predictions from target-hidden, "
                                                  "target-logits, drafter (softmax) or drafter-logits")
    cascade_kappa: float = option(4.0, "CASCADE: kappa (nats) of the kl and entropy gates")
    cascade_depth_source: str = option("logits", "CASCADE: state compared by the depth term: logits or hidden")
    cascade_nucleus: float = option(0.8, "CASCADE: probability mass of the nucleus gate")
    cascade_depth_mode: str = option("parent-child", "CASCADE: depth term: parent-child, or grandparent-parent "
                                                     "(the Lumina final code)")
    cascade_gate_input: str = option("parent", "CASCADE: gate on the parent's unrelaxed p (once) or on the "
                                               "residual (per sibling, as published)")
    cascade_variant: str = option("engine", "CASCADE: preset engine, llamagen or lumina-final (the published "
                                            "codes); options set away from their default override it")

    def rule_kwargs(self) -> dict:
        """The rule options: the preset's values, replaced by every option set away from the default."""
        given = dict(breadth_threshold=self.cascade_breadth_threshold, depth_threshold=self.cascade_depth_threshold,
                     gate=self.cascade_gate, source=self.cascade_source, kappa=self.cascade_kappa,
                     depth_source=self.cascade_depth_source, nucleus=self.cascade_nucleus,
                     depth_mode=self.cascade_depth_mode, gate_input=self.cascade_gate_input)
        preset = variant_options(self.cascade_variant, flag=lambda n: "cascade-" + n)
        return {k: (v if v != DEFAULTS[k] else preset[k]) for k, v in given.items()}

    def validate(self):
        check_options(**self.rule_kwargs(), flag=lambda n: "cascade-" + n.replace("_", "-"))
        source = self.rule_kwargs()["source"]
        if self.tree == "dynamic" and source in DRAFTER_SOURCES and self.accept in (None, "cascade"):
            raise VVSError("cascade-source drafter needs a static tree (dynamic trees keep no per-node drafter "
                           "distributions); use --cascade-source target-logits or target-hidden")
        return super().validate()


@register("cascade", CascadeOptions)
def run_cascade(engine, batch, params, opts: CascadeOptions):
    accept = opts.accept or "cascade"
    rule_options = dict(opts.rule_options)
    if accept == "cascade":  # other rules do not take CASCADE's options
        rule_options = {**opts.rule_kwargs(), **rule_options}
    opts = dataclasses.replace(opts, accept=accept, tree=opts.tree or "static", rule_options=rule_options)
    return run(engine, batch, params, opts)
