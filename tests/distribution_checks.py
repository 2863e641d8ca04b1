"""Distribution checks shared by the exactness tests (speculative, Jacobi, SCD, SJD-PAC, ZipAR): Pearson
chi-square statistics against exact probabilities, and the engine's 4-token toy whose full joint is
computed exactly (docs/jacobi.md)."""
from __future__ import annotations

import math

import torch

from spec_models import tiny_engine


def _chi2(samples, seqs, probs):
    V = int(seqs.max()) + 1
    idx = samples[:, 0] * V + samples[:, 1]
    counts = torch.bincount(idx, minlength=V * V).double()
    exp = probs * samples.shape[0]
    keep = exp >= 5  # merge tiny cells into one, as the test requires
    stat = (((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum()
    rest_c, rest_e = counts[~keep].sum(), exp[~keep].sum()
    dof = int(keep.sum()) - 1
    if rest_e > 0:
        stat = stat + (rest_c - rest_e) ** 2 / max(rest_e, 1e-9)
        dof += 1
    return float(stat), dof


def _chi2_crit(dof, alpha=1e-3):
    # Wilson–Hilferty approximation of the chi-square quantile (no scipy needed).
    z = 3.090232  # 1 - 1e-3 normal quantile
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def toy_engine():
    """V = 4 tokens, T = 4 tokens per image (256 sequences), peaked enough that drafts are often kept."""
    return tiny_engine(vocab=4, block=4, seed=1, peak=25.0, with_vq=False)


def exact_joint(eng, label=1, cfg=2.0):
    """Exact target probability of every full image [V^T] (index = sum token_t * V^t)."""
    V, T = eng.config.vocab_size, eng.tokens_per_image
    seqs = torch.cartesian_prod(*[torch.arange(V)] * T)
    lg = eng.score(class_labels=[label] * len(seqs), tokens=seqs, cfg_scale=cfg)
    logp = torch.log_softmax(lg.double(), -1).gather(2, seqs[:, :, None])[:, :, 0].sum(1)
    joint = torch.zeros(V ** T, dtype=torch.float64).index_add_(0, cell_index(seqs, V), logp.exp())
    return joint


def cell_index(tokens, V):
    return (tokens * (V ** torch.arange(tokens.shape[1]))).sum(1)


def chi2_joint(tokens, joint, V):
    """Pearson chi-square of full-image counts against ``joint`` (cells with expected count < 5 pooled)."""
    counts = torch.bincount(cell_index(tokens, V), minlength=len(joint)).double()
    exp = joint * tokens.shape[0]
    keep = exp >= 5
    stat = (((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum()
    rest_c, rest_e = counts[~keep].sum(), exp[~keep].sum()
    dof = int(keep.sum()) - 1
    if rest_e > 0:
        stat = stat + (rest_c - rest_e) ** 2 / rest_e
        dof += 1
    return float(stat), dof


def toy_sample(eng, n, method, **opts):
    return eng.generate(class_labels=[1] * n, temperature=1.0, cfg_scale=2.0, method=method, seed=5,
                        decode_images=False, batch_size=1000, **opts)


def two_sample_chi2(a, b, V):
    """Chi-square homogeneity statistic of two samples of one categorical variable (dof V' - 1 over the
    V' values seen)."""
    ca, cb = torch.bincount(a, minlength=V).double(), torch.bincount(b, minlength=V).double()
    seen = (ca + cb) > 0
    ca, cb = ca[seen], cb[seen]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    return float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum()), int(seen.sum()) - 1
