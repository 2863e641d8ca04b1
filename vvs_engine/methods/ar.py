"""Plain autoregressive decoding: the baseline every speed-up is measured against.

Static KV cache, both CFG rows in one batch, one target forward per token, and no host sync in the
loop: the position is a device tensor advanced in place and sampled tokens stay on the device.
Token t of image b is drawn with the batch's counter RNG at step t, so an image's tokens do not depend
on the batch it is decoded in. With ``use_graphs`` the step runs through
:class:`vvs_engine.runtime.runner.GraphRunner` (one CUDA graph per token on CUDA; the same static-buffer code
eagerly elsewhere) and gives the same tokens.
"""
from __future__ import annotations

import torch

from ..runtime.masks import causal_local
from ..runtime.profiling import nvtx_range
from .. import kernels
from ..rng import CounterRNG, Streams
from ..sampling import guided_logits, process_logits
from ..runtime.target import TargetSession
from .common import MethodResult


def generate(session: TargetSession, params, rng: CounterRNG, use_graphs: bool = False,
             compile: bool = False) -> MethodResult:
    """Decode ``session.n`` images; ``rng`` holds one key per image (``session.n`` of them). With
    ``use_graphs`` or ``compile`` the step is the runner's round function (captured / compiled)."""
    if use_graphs or compile:
        return generate_graphed(session, params, rng, use_graphs, compile)
    s = session
    with nvtx_range("prefill"):
        h = s.prefill()[:, -1]
        tok = rng.sample(process_logits(guided_logits(s.logits(h), params), params), 0, Streams.SAMPLE)  # [n]
    out = [tok]
    pos = torch.full((1,), s.c, dtype=torch.long, device=s.device)
    one = causal_local(1, s.device)
    with nvtx_range("decode"):
        for _ in range(s.T - 1):
            h = s.forward(tok[:, None], pos, pos, one)[:, -1]
            # the token at position pos is image token pos - (c - 1): its index is the RNG step
            tok = kernels.counter_sample(rng, process_logits(guided_logits(s.logits(h), params), params),
                                         pos - (s.c - 1), Streams.SAMPLE)
            out.append(tok)
            pos += 1
    return _result(torch.stack(out, 1), s)


def generate_graphed(session: TargetSession, params, rng: CounterRNG, use_graphs: bool = True,
                     compile: bool = False) -> MethodResult:
    """The same loop on a cached runner's persistent session. ``session`` only supplies the setting
    (model, conditions, CFG); its own cache is not used."""
    from ..runtime.runner import get_runner

    s0 = session
    key_mask = s0.key_valid[:, : s0.c] if s0.has_key_mask else None
    runner = get_runner(s0.model, s0.cond_rows, s0.n, s0.use_cfg, key_mask, params, use_graphs=use_graphs,
                        compile=compile)
    s = runner.session
    with nvtx_range("prefill"):
        h = s.prefill()[:, -1]
        first = rng.sample(process_logits(guided_logits(s.logits(h), params), params), 0, Streams.SAMPLE)
    with nvtx_range("decode"):
        tokens = runner.ar_decode(first, rng)
    res = _result(tokens, s)
    res.stats["cuda_graphs"] = runner.use_graphs
    if compile:
        res.stats["compiled"] = {"ar_step": runner.compiled().get("ar_step", False)}
    return res


def _result(tokens, s) -> MethodResult:
    passes = torch.full((s.n,), s.T - 1, dtype=torch.long, device=tokens.device)
    return MethodResult(tokens=tokens, stats={"target_forward_passes": (s.T - 1) * s.n}, image_passes=passes)
