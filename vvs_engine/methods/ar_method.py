"""Registration of plain AR decoding (the loop itself lives in ``ar.py``)."""
from . import register
from .ar import generate
from .common import DecodeBatch


@register("ar")
def run_ar(engine, batch: DecodeBatch, params, opts):
    session = engine.session(batch.cond, batch.key_mask, batch.size, params)
    use_graphs = engine.device.type == "cuda" and (batch.use_graphs is None or bool(batch.use_graphs))
    res = generate(session, params, batch.rng, use_graphs=use_graphs, compile=batch.compile)
    res.stats["target_forward_passes"] = (engine.tokens_per_image - 1) * batch.n_real
    return res


run_ar.batched = True
