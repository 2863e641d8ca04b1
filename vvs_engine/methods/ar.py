"""Plain autoregressive decoding: the baseline every speed-up is measured against.

Static KV cache, both CFG rows in one batch, one target forward per token, and no host sync in the
loop: the position is a device tensor advanced in place and sampled tokens stay on the device.
With ``use_graphs`` the step runs through :class:`vvs_engine.runtime.runner.GraphRunner` (one CUDA graph per
token on CUDA; the same static-buffer code eagerly elsewhere) and gives the same tokens.
"""
from __future__ import annotations

import torch

from ..sampling import guided_logits, process_logits, sample
from ..runtime.masks import causal_local
from ..runtime.profiling import nvtx_range
from ..runtime.target import TargetSession
from .common import MethodResult, progress


def generate(session: TargetSession, params, gen: torch.Generator, opts=None, show_progress=False,
             use_graphs: bool = False) -> MethodResult:
    if use_graphs:
        return generate_graphed(session, params, gen)
    s = session
    with nvtx_range("prefill"):
        h = s.prefill()[:, -1]
        tok = sample(process_logits(guided_logits(s.logits(h), params), params), gen)  # [n]
    out = [tok]
    pos = torch.full((1,), s.c, dtype=torch.long, device=s.device)
    one = causal_local(1, s.device)
    with nvtx_range("decode"):
        for _ in progress(range(s.T - 1), show_progress, "ar"):
            h = s.forward(tok[:, None], pos, pos, one)[:, -1]
            tok = sample(process_logits(guided_logits(s.logits(h), params), params), gen)
            out.append(tok)
            pos += 1
    tokens = torch.stack(out, 1)
    n_fwd = (s.T - 1) * s.n
    return MethodResult(tokens=tokens, stats={"target_forward_passes": n_fwd})


def generate_graphed(session: TargetSession, params, gen: torch.Generator) -> MethodResult:
    """The same loop on a cached runner's persistent session; the images are padded to a batch bucket.
    ``session`` only supplies the setting (model, conditions, CFG); its own cache is not used."""
    from ..runtime.runner import batch_bucket, get_runner, pad_conditions

    s0, n = session, session.n
    key_mask = s0.key_valid[:, : s0.c] if s0.has_key_mask else None
    nb = batch_bucket(n)
    cond, key_mask = pad_conditions(s0.cond_rows, key_mask, n, nb, s0.use_cfg)
    runner = get_runner(s0.model, cond, nb, s0.use_cfg, key_mask, params, use_graphs=True)
    s = runner.session
    with nvtx_range("prefill"):
        h = s.prefill()[:, -1]
        first = sample(process_logits(guided_logits(s.logits(h), params), params), gen)  # [nb]
    with nvtx_range("decode"):
        tokens = runner.ar_decode(first, gen)[:n]
    return MethodResult(tokens=tokens, stats={"target_forward_passes": (s.T - 1) * n,
                                              "cuda_graphs": runner.use_graphs, "batch_bucket": nb})
