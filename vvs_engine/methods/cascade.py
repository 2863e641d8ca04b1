"""CASCADE (arXiv 2605.07230): the shared speculative loop with CASCADE's relaxed acceptance
(:mod:`vvs_engine.acceptance.cascade`) on an EAGLE-1 static tree.

Defaults are the reconstruction's LlamaGen values (docs/methods.md §3): static tree
``naive_extend_57`` (57 nodes, depth 5), τ_b 0.9, τ_d 0.625 on the target's logits at parent and
child, κ 4.0 — with two choices made from measurements on the Zoo model (benchmarks/cascade_zoo.py):
the breadth similarity uses the target's hidden states (``cascade_source target-hidden``; the
authors' LlamaGen code used the drafter's predictions, ``drafter``), and the gate is the authors'
final nucleus gate (``cascade_gate nucleus``; their LlamaGen KL gate, ``kl`` with κ 4, accepted more
but cost ~0.9 nats/token of target likelihood on the Zoo model).
Every SpecOptions option applies too
(``skip_policy`` for VVS skipping, ``tree dynamic`` with a target source, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..acceptance.cascade import check_options
from . import register
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
                                                  "target-logits or drafter")
    cascade_kappa: float = option(4.0, "CASCADE: kappa (nats) of the kl and entropy gates")
    cascade_depth_source: str = option("logits", "CASCADE: state compared by the depth term: logits or hidden")
    cascade_nucleus: float = option(0.8, "CASCADE: probability mass of the nucleus gate")

    def rule_kwargs(self) -> dict:
        return dict(breadth_threshold=self.cascade_breadth_threshold, depth_threshold=self.cascade_depth_threshold,
                    gate=self.cascade_gate, source=self.cascade_source, kappa=self.cascade_kappa,
                    depth_source=self.cascade_depth_source, nucleus=self.cascade_nucleus)

    def validate(self):
        check_options(**self.rule_kwargs(), flag=lambda n: "cascade-" + n.replace("_", "-"))
        if self.tree == "dynamic" and self.cascade_source == "drafter" and self.accept in (None, "cascade"):
            from ..errors import VVSError

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
