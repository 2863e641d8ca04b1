"""Merging the stats of several ``Engine.generate`` calls into the stats of the whole set."""
from __future__ import annotations

import math
from typing import List

# Totals: summed over calls. Everything else numeric is averaged, weighted by the call's image count.
SUMMED = {"n_images", "tokens_generated", "target_forward_passes", "wall_time_s", "verified_steps", "skip_steps",
          "tokens_committed_unverified", "post_verify_rollbacks", "draft_forward_passes", "jacobi_rounds",
          "accepted_drafts_fresh", "accepted_drafts_carried",
          "batch_iterations", "batch_rounds", "round_seconds", "graph_captures", "compiles"}  # loop iterations of each call's batches: counts, never averaged
SUMMED_DICTS = {"staleness_histogram", "time_split_s", "accepted_drafts_histogram", "rounds_by_kind"}


def merge_stats(stats: List[dict]) -> dict:
    """Counters and times are summed, rates and means are image-weighted averages, tpf is recomputed."""
    if not stats:
        return {}
    out = dict(stats[0])
    weights = [s.get("n_images", 1) for s in stats]
    total_w = sum(weights) or 1
    for key, first in stats[0].items():
        vals = [s.get(key) for s in stats]
        if key in SUMMED and all(isinstance(v, (int, float)) for v in vals):
            out[key] = sum(vals)
        elif key in SUMMED_DICTS and all(isinstance(v, dict) for v in vals):
            merged = {}
            for v in vals:
                for k, x in v.items():
                    merged[k] = merged.get(k, 0) + x
            out[key] = merged
        elif key in SUMMED_DICTS and all(isinstance(v, list) for v in vals):
            size = max(len(v) for v in vals)
            out[key] = [sum(v[i] for v in vals if i < len(v)) for i in range(size)]
        elif isinstance(first, bool) or all(v == first for v in vals) or key in ("tpf", "seed", "tokens_per_image"):
            continue
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = sum(v * w for v, w in zip(vals, weights)) / total_w
        elif all(isinstance(v, dict) for v in vals) and all(
                isinstance(x, (int, float)) for v in vals for x in v.values()):
            keys = sorted({k for v in vals for k in v}, key=str)
            out[key] = {k: sum(v.get(k, 0) * w for v, w in zip(vals, weights)) / total_w for k in keys}
    if out.get("target_forward_passes"):
        out["tpf"] = out["tokens_generated"] / out["target_forward_passes"]
    return out


def plain(x):
    """Stats as plain JSON values: tensors and numpy values to numbers or lists, infinities to None."""
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple, dict, str)):
        x = x.tolist()
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)
