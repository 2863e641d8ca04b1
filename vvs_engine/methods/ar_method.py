"""Registration of plain AR decoding (the loop itself lives in ``ar.py``)."""
from . import register
from .ar import generate
from .common import DecodeBatch


@register("ar")
def run_ar(engine, batch: DecodeBatch, params, opts):
    session = engine.session(batch.cond, batch.key_mask, batch.size, params)
    res = generate(session, params, batch.rng, use_graphs=getattr(engine, "cuda_graphs", False))
    res.stats["target_forward_passes"] = (engine.tokens_per_image - 1) * batch.n_real
    return res


run_ar.batched = True
