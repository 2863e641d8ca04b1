"""ZipAR (several image rows at once) and ZipAR with SJD-verified row windows: the schedule and its
forward count, the attention mask against a reference rebuilt from the recorded K/V writes, raster
slots written once, the degenerate window (>= the row length) reproducing AR, every family, and the
exactness claims of ``--zipar-verify sjd`` (raster AR at s >= W; the partial-context target at s < W)."""
from __future__ import annotations

import pytest
import torch

from spec_models import tiny_engine
from distribution_checks import _chi2, _chi2_crit
from vvs_engine.acceptance.verify import ExactRule
from vvs_engine.engine import Engine
from vvs_engine.errors import VVSError
from vvs_engine.methods import get_method
from vvs_engine.methods.common import DecodeBatch
from vvs_engine.methods.zipar import RowGeometry, ZipARDecoder, fixed_window_forwards, row_geometry, rows_in_flight
from vvs_engine.models.hf_tiny import PROMPTS, make_chameleon_folder, make_emu3_folder, make_janus_folder
from vvs_engine.rng import CounterRNG
from vvs_engine.sampling import SamplingParams
from zipar_plan import PlanLane, fixed_window_plan

LABELS = [0, 3]


# --- the schedule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("eol", [None, 7])
def test_plan_forward_count_is_the_formula(eol):
    """(H - 1) * min(s, W) + W - 1 forwards, for every grid and window (rows: contiguous from the
    first unfinished one, asserted inside the plan), never more rows than ``rows_in_flight``, and
    every code decided exactly once."""
    for H in (1, 2, 3, 6):
        for W in (1, 2, 5, 8):
            for s in (1, 2, 3, 4, 8, 9):
                geo = RowGeometry(H, W, eol)
                plan = fixed_window_plan(geo, s)
                assert len(plan) == fixed_window_forwards(geo, s) == (H - 1) * min(s, W) + W - 1
                assert max([len(lanes) for lanes in plan] + [0]) <= rows_in_flight(geo, s)
                decided = sorted((l.row, l.decided_column) for lanes in plan for l in lanes if l.decided_column is not None)
                assert decided == [(r, col) for r in range(H) for col in range(W) if (r, col) != (0, 0)]


def test_plan_by_hand():
    """Two rows of three codes, window 1, no end-of-line token: row 1 starts with a stand-in at
    forward 1, row 0's last code is fed for its K/V alongside row 1's last decision."""
    plan = fixed_window_plan(RowGeometry(2, 3), 1)
    assert plan == [[PlanLane(0, 0, 1), PlanLane(1, -1, 0)],
                    [PlanLane(0, 1, 2), PlanLane(1, 0, 1)],
                    [PlanLane(0, 2, None), PlanLane(1, 1, 2)]]
    # window >= the row length: one row at a time, the next row starts from the real end of the row above
    assert [[tuple(l) for l in lanes] for lanes in fixed_window_plan(RowGeometry(2, 2), 5)] == \
        [[(0, 0, 1)], [(1, -1, 0)], [(1, 0, 1)]]
    # with an EOL: the next row starts by feeding the EOL while the row above feeds its last code
    assert [[tuple(l) for l in lanes] for lanes in fixed_window_plan(RowGeometry(2, 2, 9), 5)] == \
        [[(0, 0, 1)], [(0, 1, None), (1, -1, 0)], [(1, 0, 1)]]


# --- tiny LlamaGen target ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eng():
    return tiny_engine(vocab=64, block=36, peak=8.0)  # 6 x 6 codes, float64


@pytest.fixture(scope="module")
def ar_tokens(eng):
    return {t: eng.generate(class_labels=LABELS, temperature=t, cfg_scale=3.0, seed=4, decode_images=False).tokens
            for t in (0.0, 1.0)}


@pytest.mark.parametrize("verify", ["none", "sjd"])
def test_window_of_a_row_or_more_is_ar(eng, ar_tokens, verify):
    """s >= W: rows one after the other, each starting from the real end of the row above. Greedy
    tokens are AR's; plain ZipAR's sampled tokens are AR's too (same draw at each raster index)."""
    for s in (6, 9):
        for t in (0.0, 1.0):
            out = eng.generate(class_labels=LABELS, temperature=t, cfg_scale=3.0, seed=4, method="zipar",
                               zipar_window=s, zipar_verify=verify, decode_images=False)
            if t == 0.0 or verify == "none":
                assert torch.equal(out.tokens, ar_tokens[t]), (s, t)
            if verify == "none":
                assert out.stats["per_image"]["target_forward_passes"] == [35, 35]  # T - 1, as AR


@pytest.mark.parametrize("s", [1, 2, 4])
def test_forwards_per_image_follow_the_schedule(eng, ar_tokens, s):
    out = eng.generate(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=4, method="zipar", zipar_window=s,
                       decode_images=False)
    assert out.stats["per_image"]["target_forward_passes"] == [5 * s + 5] * 2  # (H - 1) s + W - 1
    assert out.tokens.shape == (2, 36) and 0 <= int(out.tokens.min()) and int(out.tokens.max()) < 64
    assert not torch.equal(out.tokens, ar_tokens[1.0])  # a partial context changes the samples
    assert out.stats["committing_rows"] == 2 * 35  # one code per row per forward (token 0: the prefill)
    # batch-invariant: each image alone gives the same tokens
    alone = eng.generate(class_labels=LABELS[1:], image_indices=[1], temperature=1.0, cfg_scale=3.0, seed=4,
                         method="zipar", zipar_window=s, decode_images=False)
    assert torch.equal(alone.tokens[0], out.tokens[1])


# --- the mask against a reference built from the recorded writes -------------------------------------
def record_forwards(monkeypatch, model):
    """Every round forward: tokens fed, RoPE positions, K/V slots and the mask, as the model saw them."""
    log = []
    embed, forward = model.embed_tokens, model.forward_hidden

    def embed_tokens(tokens):
        log.append({"tokens": tokens.clone()})
        return embed(tokens)

    def forward_hidden(x, positions, kv=None, slots=None, mask=None):
        if kv is not None and isinstance(mask, torch.Tensor) and positions.dim() == 2:
            log[-1].update(positions=positions.clone(), slots=slots.clone(), mask=mask[:, 0].clone())
        return forward(x, positions, kv, slots, mask)

    monkeypatch.setattr(model, "embed_tokens", embed_tokens)
    monkeypatch.setattr(model, "forward_hidden", forward_hidden)
    return log


def check_against_reference(log, tokens, c, T, L, image, exact_once, unread, condition=None, n_forwards=None):
    """Rebuild what each query may see from the writes alone: a raster slot is filled at a forward
    once its final write lies in an earlier forward, or it is the committed token a row's first lane
    feeds in this forward; a query sees the condition, the filled slots up to its row's first lane's
    position, its own slot and the raster slots of its row's earlier lanes (its Jacobi window).
    The device mask must be exactly that, and every slot's final write must hold the final token
    (``unread``: the image's last slots, which no query reads, as AR never feeds its last token;
    ``condition``: the visible condition slots, default all; ``n_forwards``: the image's forwards until
    it finished; the decode loop reads that one round late, so a finished image may run one more
    forward, whose writes nothing reads). Also: once a row that does not write a slot has read it
    (committed context), the slot is never written again."""
    condition = set(range(c)) if condition is None else condition
    log = [e for e in log if "mask" in e][:n_forwards]
    final_write, writes = {}, {}
    for k, e in enumerate(log):
        for q, s in enumerate(e["slots"][image].tolist()):
            if c <= s < c + T:
                writes[s] = writes.get(s, 0) + 1
                if s not in unread:
                    final_write[s] = (k, int(e["tokens"][image, q]))
    for s, (_, tok) in final_write.items():
        assert tok == int(tokens[s - c]), s  # the cache holds the committed token (never a stand-in)
    if exact_once:
        assert all(n == 1 for n in writes.values())
    read_as_context = {}  # slot -> first forward in which a row that does not write it read it
    for k, e in enumerate(log):
        slots, pos, mask = e["slots"][image].tolist(), e["positions"][image].tolist(), e["mask"][image]
        raster = lambda s: c <= s < c + T
        for s in slots:
            assert not (raster(s) and s in read_as_context and read_as_context[s] < k), (k, s)
        for q in range(len(slots)):
            first = q - q % L
            row_writes = set(slots[first: first + L])
            for s in torch.nonzero(mask[q]).flatten().tolist():
                if raster(s) and s not in row_writes:
                    read_as_context.setdefault(s, k)
        filled = {s for s, (j, _) in final_write.items() if j < k}
        filled |= {slots[q] for q in range(0, len(slots), L) if raster(slots[q])}
        for q in range(len(slots)):
            first = q - q % L
            # lane 0 sees the filled slots before its position and itself (in its own slot, or in a scratch
            # slot: a stand-in, or PJD's re-fed last draft, whose old K/V its row's later lanes see)
            ref = condition | {s for s in filled if s < pos[first] or (s == pos[first] and q > first)} | {slots[q]}
            ref |= {slots[i] for i in range(first, q) if raster(slots[i])}
            got = set(torch.nonzero(mask[q]).flatten().tolist())
            assert got == ref, (k, q, sorted(got ^ ref))
    return writes


@pytest.mark.parametrize("verify,s", [("none", 1), ("none", 2), ("sjd", 2), ("sjd", 1)])
def test_mask_matches_the_reference_and_slots_are_written_once(eng, monkeypatch, verify, s):
    L = 3 if verify == "sjd" else 1
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # the log's rows stay the images' rows
    log = record_forwards(monkeypatch, eng.gpt)
    out = eng.generate(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=4, method="zipar", zipar_window=s,
                       zipar_verify=verify, zipar_jacobi_window=L, decode_images=False)
    c, T = eng.config.cls_token_num, eng.tokens_per_image
    for image in range(2):
        writes = check_against_reference(log, out.tokens[image], c, T, L, image, exact_once=verify == "none",
                                         unread={c + T - 1},
                                         n_forwards=out.stats["per_image"]["target_forward_passes"][image])
        assert set(writes) - {c + T - 1} == set(range(c, c + T - 1))  # every slot read later is written
    rounds = [e for e in log if "mask" in e]
    assert all(torch.equal(e["mask"][:2], e["mask"][2:]) for e in rounds)  # both CFG rows see the same
    if verify == "none":  # the device serves the plan's rows and columns (positions: raster, start = predecessor)
        plan = fixed_window_plan(row_geometry(eng.gpt), s)
        # one forward per plan step, and one more: the loop reads the images' progress one round late
        assert len(rounds) == len(plan) + 1
        for e, lanes in zip(rounds, plan):  # the round serves R lanes; the plan's rows come first
            assert e["positions"][0].tolist()[: len(lanes)] == [c + l.row * 6 + l.fed_column for l in lanes]


@pytest.mark.parametrize("verify", ["none", "sjd"])
def test_mask_reference_on_a_family_with_end_of_line(emu3, monkeypatch, verify):
    eng, _ = emu3
    geo = row_geometry(eng.gpt)
    L = 3 if verify == "sjd" else 1
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")  # the log's rows stay the images' rows
    log = record_forwards(monkeypatch, eng.gpt)
    out = eng.generate(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, seed=2, method="zipar", zipar_window=1,
                       zipar_verify=verify, zipar_jacobi_window=L, decode_images=False)
    c, T = eng.config.cls_token_num, eng.tokens_per_image
    last_code = c + (geo.rows - 1) * geo.width + geo.codes - 1
    _, key_mask = eng.condition_rows(None, PROMPTS, True)
    assert not key_mask[0].all()  # the prompt's padded slots stay hidden
    for image in range(2):
        writes = check_against_reference(log, out.tokens[image], c, T, L, image, exact_once=verify == "none",
                                         unread={last_code, c + T - 1},
                                         condition=set(torch.nonzero(key_mask[image]).flatten().tolist()),
                                         n_forwards=out.stats["per_image"]["target_forward_passes"][image])
        assert set(writes) - {last_code} == set(range(c, last_code))  # the last code and EOL are never read


# --- every family ------------------------------------------------------------------------------------
def fp64(eng):
    eng.gpt.to(torch.float64)
    eng.dtype = torch.float64
    return eng


@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("janus"))
    make_janus_folder(path)
    eng = fp64(Engine.load(model_dir=path, max_prompt_tokens=24))
    return eng, eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens


@pytest.fixture(scope="module")
def lumina(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chameleon"))
    make_chameleon_folder(path)
    eng = fp64(Engine.load(model_dir=path, max_prompt_tokens=32, image_size=64))
    return eng, eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens


@pytest.fixture(scope="module")
def emu3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("emu3"))
    make_emu3_folder(path)
    eng = fp64(Engine.load(model_dir=path, max_prompt_tokens=24, image_size=32))
    return eng, eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False).tokens


@pytest.mark.parametrize("family", ["janus", "lumina", "emu3"])
def test_every_family(request, family):
    """Janus: a square grid; Lumina-mGPT and Emu3: rows closed by the forced EOL, which ZipAR places
    (it never samples it) and which needs no forward of its own (H fewer than AR's T - 1)."""
    eng, ar = request.getfixturevalue(family)
    geo = row_geometry(eng.gpt)
    assert (geo.eol is None) == (family == "janus") and geo.rows == geo.codes == 4
    T = eng.tokens_per_image
    for verify in ("none", "sjd"):
        out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method="zipar", zipar_window=geo.codes,
                           zipar_verify=verify, decode_images=False)
        assert torch.equal(out.tokens, ar)
        if verify == "none":
            assert out.stats["per_image"]["target_forward_passes"] == \
                [T - 1 - (geo.rows if geo.eol is not None else 0)] * 2
    for verify in ("none", "sjd"):
        out = eng.generate(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, method="zipar", zipar_window=1, seed=3,
                           zipar_verify=verify, decode_images=False)
        rows = out.tokens.view(2, geo.rows, geo.width)
        if geo.eol is not None:
            assert (rows[:, :, -1] == geo.eol).all() and (rows[:, :, :-1] < geo.eol).all()
        assert int(out.tokens.max()) < eng.config.vocab_size
        if verify == "none":
            assert out.stats["per_image"]["target_forward_passes"] == [fixed_window_forwards(geo, 1)] * 2


# --- ZipAR + SJD: what is exact ------------------------------------------------------------------
def _pair_marginals(eng, label, cfg, n_first, V):
    """Exact target probability of every sequence of the first ``n_first`` tokens (raster AR)."""
    seqs = torch.cartesian_prod(*[torch.arange(V)] * n_first)
    lg = eng.score(class_labels=[label] * len(seqs), tokens=seqs, cfg_scale=cfg)
    probs = torch.log_softmax(lg.double(), -1).gather(2, seqs[:, :, None])[:, :, 0].sum(1).exp()

    def pair(a, b):
        marg = torch.zeros(V * V, dtype=probs.dtype).index_add_(0, seqs[:, a] * V + seqs[:, b], probs)
        return torch.cartesian_prod(torch.arange(V), torch.arange(V)), marg

    return pair


def test_sjd_rows_with_a_full_window_are_distributed_as_raster_ar():
    """s >= W: every row sees the whole raster prefix, so the SJD rule makes the tokens raster AR's.
    Chi-square of pair marginals (V = 4, 3 x 3 grid, 1000 images) within row 0 (carried Jacobi
    drafts), across the row boundary and at the start of row 1, against the exact AR law; accepting
    every draft (no verification) must fail."""
    eng = tiny_engine(vocab=4, block=9, seed=1, peak=25.0, with_vq=False)
    pair = _pair_marginals(eng, 1, 2.0, 5, 4)
    kw = dict(class_labels=[1] * 1000, temperature=1.0, cfg_scale=2.0, method="zipar", seed=5, zipar_window=3,
              zipar_verify="sjd", zipar_jacobi_window=3, decode_images=False, batch_size=250)
    out = eng.generate(**kw)
    assert out.stats["accepted_drafts"] > 500
    for a, b in ((1, 2), (2, 3), (3, 4)):
        cells, marg = pair(a, b)
        stat, dof = _chi2(out.tokens[:, [a, b]], cells, marg)
        assert stat < _chi2_crit(dof), ((a, b), stat, dof)
    original = ExactRule.accept
    try:
        ExactRule.accept = lambda self, r, x, qx, u, ctx: (torch.ones_like(x, dtype=torch.bool), None)
        bad = eng.generate(**dict(kw, class_labels=[1] * 500))
    finally:
        ExactRule.accept = original
    cells, marg = pair(1, 2)
    stat, dof = _chi2(torch.cat([bad.tokens] * 2)[:, [1, 2]], cells, marg)
    assert stat > _chi2_crit(dof), (stat, dof)


def committed_scores(eng, opts, n_images, seed, rule=None):
    """Drive a ZipAR + SJD decode forward by forward. For every committed token x, with p the target
    distribution of the lane that decided it (the target given that forward's partial context and
    the row's committed prefix): log p(x), and its mean and variance were x ~ p."""
    params = SamplingParams(temperature=1.0, cfg_scale=2.0)
    _, o = get_method("zipar", eng, opts)
    cond, key_mask = eng.condition_rows([i % 5 for i in range(n_images)], None, True)
    batch = DecodeBatch(cond, key_mask, CounterRNG(seed, torch.arange(n_images)), n_images)
    scores = []
    with torch.inference_mode():
        dec = ZipARDecoder.start(eng, batch, params, o, rule)
        st = dec.state
        seen = {}
        processed = dec.processed

        def keep(h):
            seen["p"] = processed(h)
            return seen["p"]

        dec.processed = keep
        while int(st.lo.min()) < dec.H:
            rows = st.lo[:, None] + torch.arange(dec.R)
            before = st.codes.gather(1, rows + 1).clone()
            dec.zipar_round(st, dec.R)
            after = st.codes.gather(1, rows + 1)
            p = seen["p"].view(n_images, dec.R, dec.L, -1).double()
            for b, j in torch.nonzero(after > before).tolist():
                for i in range(int(after[b, j] - before[b, j])):
                    x = int(st.tokens[b, int(rows[b, j]) * dec.Wp + int(before[b, j]) + i])
                    dist = p[b, j, i]
                    logp = dist.clamp(min=1e-300).log()
                    mean = float((dist * logp).sum())
                    scores.append((float(logp[x]), mean, float((dist * logp ** 2).sum()) - mean ** 2))
    return torch.tensor(scores, dtype=torch.float64)


def likelihood_z(scores):
    """Sum of log p(x) - E log p over the committed tokens, in standard deviations: each term has
    mean 0 given everything before it when x ~ p, so the sum is a martingale (approximately normal)."""
    return float((scores[:, 0] - scores[:, 1]).sum() / scores[:, 2].sum().sqrt())


def test_sjd_commits_exact_samples_of_the_partial_context_target():
    """s < W (the lossy case): what is exact is each committed token given its forward's context.
    Over every committed token, the log-likelihood under the lane that decided it matches its
    expectation (|z| < 3.29, two-sided 1e-3); a sampler that accepts every draft (no verification)
    commits tokens of the wrong likelihood and fails (z = -10.6 here). Subtler bugs of the rule
    itself (carried q taken as one-hot, residual = p) stay within |z| < 2.5 at this size: the
    chi-square test of ``tests/test_jacobi.py`` covers the shared SJD rule against those."""
    eng = tiny_engine(vocab=16, block=16, seed=2, peak=6.0, with_vq=False)
    opts = dict(zipar_window=1, zipar_verify="sjd", zipar_jacobi_window=3)
    scores = committed_scores(eng, opts, 160, 7)
    assert len(scores) == 160 * 15
    assert abs(likelihood_z(scores)) < 3.29, likelihood_z(scores)

    class AcceptAll(ExactRule):
        def accept(self, r, x, qx, u, ctx):
            return torch.ones_like(x, dtype=torch.bool), None

    bad = committed_scores(eng, opts, 160, 7, AcceptAll())
    assert abs(likelihood_z(bad)) > 3.29, likelihood_z(bad)


# --- PJD: separate start and commit lags, drafts-only commits, random drafts, keep rule, row cap -----
PJD_RULE = dict(zipar_commit="drafts")


@pytest.mark.parametrize("opts", [{}, PJD_RULE, dict(PJD_RULE, zipar_init="copy-above")], ids=["E1", "rule", "copy"])
def test_pjd_with_a_start_lag_of_a_row_or_more_is_ar_greedy(eng, ar_tokens, opts):
    """Start lag >= W: one row at a time whatever the commit lag, so PJD is raster SJD (the top row is
    the only row: the released rule's drafts-only commits never apply); greedy tokens are AR's. With a
    smaller start lag the rows overlap (fewer forwards)."""
    for s in (6, 8):
        out = eng.generate(class_labels=LABELS, temperature=0.0, cfg_scale=3.0, seed=4, method="pjd", zipar_window=s,
                           decode_images=False, **opts)
        assert torch.equal(out.tokens, ar_tokens[0.0]), s
        assert out.stats["most_rows_per_forward"] == 1
    overlap = eng.generate(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=4, method="pjd", zipar_window=2,
                           zipar_commit_lag=1, zipar_jacobi_window=3, decode_images=False, **opts)
    assert overlap.stats["most_rows_per_forward"] >= 3


def test_pjd_rows_with_a_full_start_lag_are_distributed_as_raster_ar():
    """The raster chi-square test of ZipAR + SJD (pair marginals against the exact AR law, V = 4, 3 x 3
    grid) for PJD's released rule with random drafts and commit lag 1 at start lag 3 = W: raster SJD."""
    eng = tiny_engine(vocab=4, block=9, seed=1, peak=25.0, with_vq=False)
    pair = _pair_marginals(eng, 1, 2.0, 5, 4)
    out = eng.generate(class_labels=[1] * 1000, temperature=1.0, cfg_scale=2.0, method="pjd", seed=5, zipar_window=3,
                       zipar_commit_lag=1, zipar_jacobi_window=3, decode_images=False, batch_size=250, **PJD_RULE)
    assert out.stats["accepted_drafts"] > 300
    for a, b in ((1, 2), (2, 3), (3, 4)):
        cells, marg = pair(a, b)
        stat, dof = _chi2(out.tokens[:, [a, b]], cells, marg)
        assert stat < _chi2_crit(dof), ((a, b), stat, dof)


# options of the per-forward exactness test: rows overlap (start lag 2, commit lag 1 on a 4 x 4 grid)
PJD_OVERLAP = dict(zipar_window=2, zipar_commit_lag=1, zipar_verify="sjd", zipar_jacobi_window=3,
                   zipar_init="random")


@pytest.fixture(scope="module")
def six_by_six():
    """Rows of 6: a lower row's context changes between the forwards that draw and test a draft."""
    return tiny_engine(vocab=16, block=36, seed=2, peak=6.0, with_vq=False)


def test_pjd_e1_commits_exact_samples_of_the_partial_context_target(six_by_six):
    """E1 (every row by the SJD rule) with PJD's lags and random drafts passes the per-forward exactness
    test of ZipAR + SJD: each committed token is a sample of the target given its forward's context
    (on that test's 4 x 4 target, and on the 6 x 6 one of the negative control below)."""
    small = tiny_engine(vocab=16, block=16, seed=2, peak=6.0, with_vq=False)
    scores = committed_scores(small, PJD_OVERLAP, 160, 7)
    assert len(scores) == 160 * 15
    assert abs(likelihood_z(scores)) < 3.29, likelihood_z(scores)
    scores = committed_scores(six_by_six, PJD_OVERLAP, 320, 7)
    assert len(scores) == 320 * 35
    assert abs(likelihood_z(scores)) < 3.29, likelihood_z(scores)  # 0.27 here


def test_pjd_rule_fails_the_per_forward_exactness_test(six_by_six):
    """Negative control (pjd.md §1.8): below the top row the released rule commits a carried draft d
    (drawn from q, an earlier forward's p) with probability min(1, p(d)/q(d)) and nothing otherwise, so
    what it commits leans towards q, the older and smaller context: tokens less likely under the
    committing forward's p than p's own draws. Here z = -5.3 over 11200 committed tokens (-0.031 nats
    per token; -6.3 and -0.037 with the keep rule), where E1 on the same images gives 0.27."""
    scores = committed_scores(six_by_six, dict(PJD_OVERLAP, **PJD_RULE), 320, 7)
    assert len(scores) == 320 * 35
    assert likelihood_z(scores) < -3.29, likelihood_z(scores)


@pytest.mark.parametrize("opts", [dict(PJD_OVERLAP, **PJD_RULE, zipar_keep=0.5), PJD_OVERLAP], ids=["rule", "E1"])
def test_pjd_mask_matches_the_reference_and_read_slots_are_never_rewritten(eng, monkeypatch, opts):
    """The ZipAR mask reference holds for PJD: lower rows that commit drafts only re-feed their last
    accepted draft, which writes a scratch slot (the committed K/V are never rewritten once read), and
    every slot read later holds its committed token."""
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")
    log = record_forwards(monkeypatch, eng.gpt)
    labels = [0, 1, 2, 3, 4, 0]
    out = eng.generate(class_labels=labels, temperature=1.0, cfg_scale=3.0, seed=4, method="pjd",
                       decode_images=False, **opts)
    assert out.stats["most_rows_per_forward"] >= 3
    c, T = eng.config.cls_token_num, eng.tokens_per_image
    for image in range(len(labels)):
        writes = check_against_reference(log, out.tokens[image], c, T, 3, image, exact_once=False,
                                         unread={c + T - 1},
                                         n_forwards=out.stats["per_image"]["target_forward_passes"][image])
        assert set(writes) - {c + T - 1} == set(range(c, c + T - 1))


def test_pjd_rule_on_a_family_with_end_of_line(emu3, monkeypatch):
    """Emu3 (rows closed by the forced EOL): the released rule re-feeds an EOL when a started row
    committed nothing; the reference still holds and the EOLs are placed, never sampled."""
    eng, _ = emu3
    geo = row_geometry(eng.gpt)
    monkeypatch.setenv("VVS_RETIRE_FINISHED", "0")
    log = record_forwards(monkeypatch, eng.gpt)
    out = eng.generate(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, seed=2, method="pjd", zipar_window=1,
                       zipar_commit_lag=1, zipar_jacobi_window=3, decode_images=False, **PJD_RULE)
    c, T = eng.config.cls_token_num, eng.tokens_per_image
    last_code = c + (geo.rows - 1) * geo.width + geo.codes - 1
    _, key_mask = eng.condition_rows(None, PROMPTS, True)
    rows = out.tokens.view(2, geo.rows, geo.width)
    assert (rows[:, :, -1] == geo.eol).all() and (rows[:, :, :-1] < geo.eol).all()
    for image in range(2):
        check_against_reference(log, out.tokens[image], c, T, 3, image, exact_once=False,
                                unread={last_code, c + T - 1},
                                condition=set(torch.nonzero(key_mask[image]).flatten().tolist()),
                                n_forwards=out.stats["per_image"]["target_forward_passes"][image])


@pytest.mark.parametrize("family", ["janus", "lumina"])
def test_pjd_every_family(request, family):
    """PJD on a square grid without EOL (Janus: a row starts from a stand-in) and with EOL (Lumina-mGPT):
    greedy with a full start lag is AR; overlapping rows place the line ends."""
    eng, ar = request.getfixturevalue(family)
    geo = row_geometry(eng.gpt)
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0, method="pjd", zipar_window=geo.codes,
                       decode_images=False, **PJD_RULE)
    assert torch.equal(out.tokens, ar)
    out = eng.generate(prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, method="pjd", zipar_window=1, seed=3,
                       zipar_commit_lag=1, zipar_jacobi_window=3, decode_images=False, **PJD_RULE)
    assert out.stats["most_rows_per_forward"] >= 2
    rows = out.tokens.view(2, geo.rows, geo.width)
    if geo.eol is not None:
        assert (rows[:, :, -1] == geo.eol).all() and (rows[:, :, :-1] < geo.eol).all()
    assert int(out.tokens.max()) < eng.config.vocab_size


def test_pjd_rows_per_forward_cap(eng, monkeypatch):
    """--zipar-max-rows: every forward serves (and feeds) at most that many rows; rows beyond wait (the
    waits are counted), which costs forwards. Without the cap the same decode runs more rows at once."""
    opts = dict(zipar_window=2, zipar_commit_lag=1, zipar_jacobi_window=3, **PJD_RULE)
    free = eng.generate(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=4, method="pjd",
                        decode_images=False, **opts)
    assert free.stats["most_rows_per_forward"] >= 3 and free.stats["cap_waits"] == 0
    log = record_forwards(monkeypatch, eng.gpt)
    capped = eng.generate(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=4, method="pjd",
                          decode_images=False, zipar_max_rows=2, **opts)
    assert capped.stats["zipar_rows"] == 2 and capped.stats["most_rows_per_forward"] == 2
    assert capped.stats["cap_waits"] > 0
    rounds = [e for e in log if "mask" in e]
    assert rounds and all(e["tokens"].shape[1] == 2 * 3 for e in rounds)  # 2 rows x 3 lanes per image
    # plain ZipAR s = 1 (a fixed schedule): the waits cost forwards, (H - 1) s + W - 1 = 10 without the cap
    plain = eng.generate(class_labels=LABELS, temperature=1.0, cfg_scale=3.0, seed=4, method="zipar", zipar_window=1,
                         zipar_max_rows=2, decode_images=False)
    assert plain.stats["most_rows_per_forward"] == 2 and plain.stats["cap_waits"] > 0
    assert min(plain.stats["per_image"]["target_forward_passes"]) > fixed_window_forwards(row_geometry(eng.gpt), 1)


# --- options ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,match", [
    ({"zipar_window": 0}, "zipar-window"), ({"zipar_window": 2.5}, "zipar-window"),
    ({"zipar_verify": "gsd"}, "zipar-verify"), ({"zipar_jacobi_window": 0}, "zipar-jacobi-window"),
    ({"zipar_commit_lag": 5}, "zipar-commit-lag"), ({"zipar_commit": "bonus"}, "zipar-commit"),
    ({"zipar_init": "left"}, "zipar-init"), ({"zipar_keep": 1.0}, "zipar-keep"),
    ({"zipar_max_rows": -1}, "zipar-max-rows"), ({"zipar_commit": "drafts"}, "needs drafts"),
])
def test_bad_options_are_one_line_errors(eng, opts, match):
    with pytest.raises(VVSError, match=match):
        eng.generate(class_labels=LABELS, method="zipar", decode_images=False, **opts)


def test_grid_must_be_rows():
    eng = tiny_engine(vocab=16, block=16, with_vq=False)
    eng.gpt.config.block_size = 15  # neither a square nor a family row layout
    try:
        with pytest.raises(VVSError, match="square token grid"):
            get_method("zipar", eng, {})
    finally:
        eng.gpt.config.block_size = 16
