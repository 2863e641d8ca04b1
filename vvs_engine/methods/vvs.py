"""VVS: speculative decoding that skips verification on some rounds (arXiv 2511.13587).

The shared loop with a skip schedule: on a skipped round one truncated, uniformly chosen tree path is
committed unverified and the next tree is drafted from stale cached target features; the next
verified round post-verifies the chain in the same target forward. LANTERN's rule by default, like
the paper; any registered rule composes (``accept``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import VVSError
from .registry import register
from .speculative import SpecOptions, run, with_defaults


@dataclass
class VVSOptions(SpecOptions):
    skip_policy: str = "uniform"

    def validate(self):
        if self.skip_policy == "never":
            raise VVSError("skip-policy must be uniform or dynamic for vvs (use --method lantern for none)")
        return super().validate()


@register("vvs", VVSOptions)
def run_vvs(engine, batch, params, opts):
    return run(engine, batch, params, with_defaults(opts, "lantern", "dynamic"))
