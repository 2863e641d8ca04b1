"""Plain autoregressive decoding: the baseline every speed-up is measured against.

Static KV cache, both CFG rows in one batch, one target forward per token, and no host sync in the
loop: the position is a device tensor advanced in place and sampled tokens stay on the device.
"""
from __future__ import annotations

import torch

from ..sampling import guided_logits, process_logits, sample
from ..masks import causal_local
from ..target import TargetSession
from .common import MethodResult, progress


def generate(session: TargetSession, params, gen: torch.Generator, opts=None, show_progress=False) -> MethodResult:
    s = session
    h = s.prefill()[:, -1]
    tok = sample(process_logits(guided_logits(s.logits(h), params), params), gen)  # [n]
    out = [tok]
    pos = torch.full((1,), s.c, dtype=torch.long, device=s.device)
    one = causal_local(1, s.device)
    for _ in progress(range(s.T - 1), show_progress, "ar"):
        h = s.forward(tok[:, None], pos, pos, one)[:, -1]
        tok = sample(process_logits(guided_logits(s.logits(h), params), params), gen)
        out.append(tok)
        pos += 1
    tokens = torch.stack(out, 1)
    n_fwd = (s.T - 1) * s.n
    return MethodResult(tokens=tokens, stats={"target_forward_passes": n_fwd})
