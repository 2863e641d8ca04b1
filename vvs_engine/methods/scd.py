"""SCD, coupled speculative Jacobi decoding (So, Kook, Jang, Park, ICML 2026, arXiv 2510.24211; v1 "MC-SJD").

SJD's loop (:mod:`vvs_engine.methods.jacobi`) with one change: the drafts that were not verified in an
iteration are re-drawn with a *coupling* to the drafts they replace instead of independently, so a
converged tail stays the same and becomes acceptable.

* ``--coupling maximal`` (default): every draft is tested (no break at the first rejection); past the
  commit point a passing draft is kept and a failing one is replaced by a sample of
  norm(max(0, p - q)). By the speculative-sampling lemma the result is a sample of the current target p,
  which is what it declares as its q in the next iteration (the Cosmos code's choice; the Lumina-mGPT /
  Janus-Pro code declares the old q for kept drafts, which is biased: ``coupling_declares_old_q``
  reproduces it for the negative control of the exactness tests).
* ``--coupling gumbel``: drafts are argmax(log p + G[t]) with Gumbel noise G keyed by the counter RNG on
  (seed, image, absolute token index t): a position keeps its noise until it is committed, and the
  noise has entered no decision before, so a draft is an exact sample of its declared q (the previous
  target). The released code's shifting uniform table does the same bookkeeping by hand.

``--method gsd --coupling maximal|gumbel`` composes either coupling with GSD's grouped acceptance
(lossy like GSD: "kept" means the group test passed, replacements come from GSD's residual).
"""
from __future__ import annotations

from ..acceptance.verify import ExactRule
from .registry import register
from .common import DecodeBatch
from .jacobi import JacobiDecoder, SCDOptions


@register("scd", SCDOptions)
def run_scd(engine, batch: DecodeBatch, params, opts: SCDOptions) -> JacobiDecoder:
    return JacobiDecoder.start(engine, batch, params, opts, ExactRule())
