"""Registration of plain AR decoding (the loop itself lives in ``ar.py``)."""
from . import register
from .ar import generate


@register("ar")
def run_ar(engine, cond, key_mask, n, params, gen, opts, progress):
    return generate(engine.session(cond, key_mask, n, params), params, gen, opts, progress,
                    use_graphs=getattr(engine, "cuda_graphs", False))
