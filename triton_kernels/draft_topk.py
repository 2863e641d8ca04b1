"""Fused draft-head sampling: CFG combine -> temperature -> top-k -> top-p -> softmax -> top-k
candidates (greedy, or k draws without replacement by the exponential race) and their log-probs.

Rows below ``CHUNKED_FROM`` (8192) tokens: one program per output row holds the whole vocabulary row.
Larger vocabularies (Janus-Pro 16384, Lumina-mGPT 65536, Emu3 184622) go through four small launches
over ``CHUNK``-token slices, so no program holds a whole row: (1) per chunk, sort the order keys and
prefix-sum ``exp(x - chunk max)``; (2) per row, find the top-k and top-p thresholds by an 8-round
radix-16 search whose counts and masses are binary searches into the sorted chunks (no data-dependent
trip count); (3) per chunk, the ``k`` best candidates under the final distribution; (4) per row, merge
the chunk candidates. Same thresholds, probabilities and tie order as the one-program kernel.

In the one-program kernel the top-k and top-p thresholds are found
without sorting (the idea behind vLLM's pivot search and FlashInfer's sorting-free samplers): floats
are mapped to integers with the same order, and a fixed 32-step bisection over that integer range
counts (top-k) or sums the mass of (top-p) the tokens above the pivot. The result is the exact k-th
largest logit / the exact top-p cut, found in 2 x 32 passes over registers, and the fixed trip count
keeps the kernel free of data-dependent control flow (CUDA-graph friendly). The final ``k`` picks are
``k`` argmax passes (``k`` is small: the draft tree's branching factor).

Noise: an explicit ``noise`` [B, V] of Exp(1) samples (what the tests use, to match the reference),
or in-kernel Philox from ``seed_offset`` (a device int64 [2] tensor: seed, offset; the launcher
advances the offset on the device, so a captured CUDA graph draws fresh noise on every replay).

Reference: ``vvs_engine.kernels.reference.draft_topk`` (exactly ``vvs_engine.sampling.process_logits``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NOISE_NONE, NOISE_TENSOR, NOISE_PHILOX = 0, 1, 2
CHUNKED_FROM = 8192  # vocabularies at least this large use the chunked kernels
CHUNK = 4096  # tokens per chunk program (sorted in registers)
# Threshold search: 2^4 pivots per round, 8 rounds (256 pivots x 4 rounds compiles to a register-hungry
# [chunks, 256] kernel that takes minutes to build).
RADIX_BITS = 4
INT32_MIN = -2147483648


@triton.jit
def _order_key(x):
    """Map float32 to int32 with the same order (flip the magnitude bits of negatives). The keys stay
    int32 (half the registers of int64); the bisection bounds are int64 scalars, and every midpoint
    fits in int32, so comparisons cast the midpoint down."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _draft_topk_kernel(
    logits_ptr, noise_ptr, seed_offset_ptr, tokens_ptr, logp_ptr,
    n_vocab, n_out_rows, stride_lr, stride_nr, stride_tr, stride_pr,
    cfg_scale, temperature, top_k, top_p,
    K: tl.constexpr, USE_CFG: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
    NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_V)
    in_vocab = cols < n_vocab

    x = tl.load(logits_ptr + row * stride_lr + cols, mask=in_vocab, other=0.0).to(tl.float32)
    if USE_CFG:
        # Rows [cond_0..cond_{B-1}; uncond_0..]: same arithmetic as sampling.cfg_combine.
        uncond = tl.load(logits_ptr + (row + n_out_rows) * stride_lr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        x = uncond + cfg_scale * (x - uncond)
    x = x / temperature
    key = _order_key(x)
    keep = in_vocab

    if USE_TOP_K:
        # Largest pivot T with #{key >= T} >= top_k; that is exactly the k-th largest key.
        lo = tl.full((), -2147483648, tl.int64)  # invariant: count(key >= lo) >= top_k
        hi = tl.full((), 2147483648, tl.int64)  # invariant: count(key >= hi) < top_k
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            count = tl.sum(tl.where(keep & (key >= mid.to(tl.int32)), 1, 0), 0)
            ok = count >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        keep = keep & (key >= lo.to(tl.int32))

    if USE_TOP_P:
        x_max = tl.max(tl.where(keep, x, float("-inf")), 0)
        e = tl.where(keep, tl.exp(x - x_max), 0.0)
        prob = e / tl.sum(e, 0)
        # A token is removed when the mass strictly above it exceeds top_p. That mass only grows as the
        # key falls, so the kept set is {key >= T} for the smallest T with mass(key > T) <= top_p.
        lo = tl.full((), -2147483649, tl.int64)  # invariant: mass(key > lo) > top_p (the whole row)
        hi = tl.full((), 2147483647, tl.int64)  # invariant: mass(key > hi) <= top_p (nothing above)
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            mass = tl.sum(tl.where(key > mid.to(tl.int32), prob, 0.0), 0)
            ok = mass <= top_p
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        keep = keep & (key >= hi.to(tl.int32))

    x_max = tl.max(tl.where(keep, x, float("-inf")), 0)
    e = tl.where(keep, tl.exp(x - x_max), 0.0)
    p = e / tl.sum(e, 0)

    if NOISE == 1:
        noise = tl.load(noise_ptr + row * stride_nr + cols, mask=in_vocab, other=1.0).to(tl.float32)
        score = p / noise
    elif NOISE == 2:
        seed = tl.load(seed_offset_ptr)
        offset = tl.load(seed_offset_ptr + 1)
        u = tl.rand(seed, offset + row * n_vocab + cols)
        score = p / -tl.log(tl.maximum(u, 1.0e-30))  # Exp(1) = -log(U)
    else:
        score = p
    score = tl.where(in_vocab, score, -1.0)  # real scores are >= 0

    for i in tl.static_range(K):
        best = tl.max(score, 0)
        pick = tl.min(tl.where(score == best, cols, BLOCK_V), 0)  # ties: lower index first
        p_pick = tl.sum(tl.where(cols == pick, p, 0.0), 0)
        tl.store(tokens_ptr + row * stride_tr + i, pick.to(tl.int64))
        tl.store(logp_ptr + row * stride_pr + i, tl.log(p_pick))
        score = tl.where(cols == pick, -1.0, score)


@triton.jit
def _key_to_float(key):
    """Inverse of ``_order_key``."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_processed(logits_ptr, row, cols, in_vocab, n_out_rows, stride_lr, cfg_scale, temperature,
                    USE_CFG: tl.constexpr):
    """CFG-combined, temperature-scaled fp32 logits of ``cols`` (the one-program kernel's arithmetic)."""
    x = tl.load(logits_ptr + row * stride_lr + cols, mask=in_vocab, other=0.0).to(tl.float32)
    if USE_CFG:
        uncond = tl.load(logits_ptr + (row + n_out_rows) * stride_lr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        x = uncond + cfg_scale * (x - uncond)
    return x / temperature


@triton.jit
def _sort_descending(x, N: tl.constexpr, LOG_N: tl.constexpr):
    """Bitonic sort of x [N] (N = 2^LOG_N), largest first. Each compare-exchange splits x into its
    (a, b) partner pairs with reshape/permute/split, so every step is whole-tensor min/max (fast on
    a GPU and under the interpreter, where ``tl.sort``'s xor-reduction runs in Python)."""
    for s in tl.static_range(1, LOG_N + 1):  # merge bitonic blocks of 2^s
        for jj in tl.static_range(s):  # partners 2^(s - 1 - jj) apart
            y = tl.permute(tl.reshape(x, [N >> (s - jj), 2, 1 << (s - 1 - jj)]), (0, 2, 1))
            a, b = tl.split(y)
            outer = tl.arange(0, N >> (s - jj))[:, None]
            desc = ((outer >> jj) & 1) == 0  # even blocks of 2^s descending, odd ones ascending
            hi = tl.maximum(a, b)
            lo = tl.minimum(a, b)
            x = tl.reshape(tl.permute(tl.join(tl.where(desc, hi, lo), tl.where(desc, lo, hi)), (0, 2, 1)), [N])
    return x


@triton.jit
def _chunk_sort_kernel(
    logits_ptr, keys_ptr, cum_ptr, cmax_ptr, n_vocab, n_out_rows, n_chunks, stride_lr, cfg_scale, temperature,
    USE_CFG: tl.constexpr, CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr,
):
    """Per (row, chunk): order keys sorted descending (padding = INT32_MIN, last), the inclusive prefix
    sum of exp(x - chunk max) in that order, and the chunk max."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, CHUNK)
    cols = chunk * CHUNK + offs
    in_vocab = cols < n_vocab
    x = _load_processed(logits_ptr, row, cols, in_vocab, n_out_rows, stride_lr, cfg_scale, temperature, USE_CFG)
    key = tl.where(in_vocab, _order_key(x), -2147483648)
    m = tl.max(tl.where(in_vocab, x, float("-inf")), 0)
    key = _sort_descending(key, CHUNK, LOG_CHUNK)
    n_valid = tl.minimum(n_vocab - chunk * CHUNK, CHUNK)
    e = tl.where(offs < n_valid, tl.exp(_key_to_float(key) - m), 0.0)
    base = (row * n_chunks + chunk) * CHUNK
    tl.store(keys_ptr + base + offs, key)
    tl.store(cum_ptr + base + offs, tl.cumsum(e, 0))
    tl.store(cmax_ptr + row * n_chunks + chunk, m)


@triton.jit
def _count_ge(keys_ptr, chunk_base, t, CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr):
    """Per chunk lane: #{key >= t} in its descending-sorted keys (branch-free binary search). ``t`` is
    int64 and may exceed the int32 range (then the count is 0)."""
    t32 = tl.minimum(t, 2147483647).to(tl.int32)
    pos = tl.zeros(t.shape, tl.int64)
    for i in tl.static_range(LOG_CHUNK):  # steps CHUNK/2, CHUNK/4, ..., 1
        probe = tl.load(keys_ptr + chunk_base + pos + ((CHUNK >> (i + 1)) - 1))
        pos = tl.where(probe >= t32, pos + (CHUNK >> (i + 1)), pos)
    probe = tl.load(keys_ptr + chunk_base + pos)
    pos = tl.where(probe >= t32, pos + 1, pos)
    return tl.where(t > 2147483647, 0, pos)


@triton.jit
def _mass_ge(keys_ptr, cum_ptr, chunk_base, scale, t, CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr):
    """Per chunk lane: sum of exp(x - global max) over keys >= t."""
    n = _count_ge(keys_ptr, chunk_base, t, CHUNK, LOG_CHUNK)
    cum = tl.load(cum_ptr + chunk_base + tl.maximum(n - 1, 0))
    return tl.where(n > 0, cum, 0.0) * scale


@triton.jit
def _thresholds_kernel(
    keys_ptr, cum_ptr, cmax_ptr, thr_ptr, mz_ptr, n_chunks, top_k, top_p,
    USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per row: the kept set {key >= T} (T = max of the top-k and top-p cuts), the row max M and the
    kept mass Z = sum exp(x - M). Each threshold is the largest pivot with a monotone predicate true,
    found RADIX_BITS bits at a time: 2^RADIX_BITS pivots x all chunks per round, 32 / RADIX_BITS rounds."""
    row = tl.program_id(0)
    cj = tl.arange(0, BLOCK_C)
    c_ok = cj < n_chunks
    m_c = tl.load(cmax_ptr + row * n_chunks + cj, mask=c_ok, other=float("-inf"))
    M = tl.max(m_c, 0)
    scale = tl.where(c_ok, tl.exp(m_c - M), 0.0)[:, None]  # [BLOCK_C, 1]
    # Padded chunk lanes search chunk 0 (always valid) and are zeroed by scale / c_ok.
    chunk_base = ((row * n_chunks + tl.where(c_ok, cj, 0)) * CHUNK).to(tl.int64)[:, None]
    j = tl.arange(0, 1 << RADIX_BITS).to(tl.int64)[None, :]
    lowest = tl.full((), -2147483648, tl.int64)

    t_k = lowest
    if USE_TOP_K:
        base = tl.full((), 0, tl.int64)  # unsigned key space; invariant: count(key >= base - 2^31) >= top_k
        for r in tl.static_range(32 // RADIX_BITS):
            pivots = base + (j << (32 - RADIX_BITS * (r + 1))) + lowest
            n = tl.sum(tl.where(c_ok[:, None], _count_ge(keys_ptr, chunk_base, pivots, CHUNK, LOG_CHUNK), 0), 0)
            base = base + ((tl.sum((n >= top_k).to(tl.int64), 0) - 1) << (32 - RADIX_BITS * (r + 1)))
        t_k = base + lowest  # the top_k-th largest key
    z_k = tl.sum(_mass_ge(keys_ptr, cum_ptr, chunk_base, scale, t_k + 0 * chunk_base, CHUNK, LOG_CHUNK), 0)
    z_k = tl.max(z_k, 0)

    t_p = lowest
    if USE_TOP_P:
        # A token goes when the kept mass strictly above it exceeds top_p: keep key >= lo + 1 for the
        # largest lo with mass(key > lo) > top_p (true at the bottom: the whole mass is 1).
        base = tl.full((), 0, tl.int64)
        for r in tl.static_range(32 // RADIX_BITS):
            pivots = base + (j << (32 - RADIX_BITS * (r + 1))) + lowest
            above = tl.maximum(pivots + 1, t_k)
            mass = tl.sum(_mass_ge(keys_ptr, cum_ptr, chunk_base, scale, above, CHUNK, LOG_CHUNK), 0) / z_k
            base = base + ((tl.sum((mass > top_p).to(tl.int64), 0) - 1) << (32 - RADIX_BITS * (r + 1)))
        t_p = base + lowest + 1

    t = tl.maximum(t_k, t_p)
    z = tl.max(tl.sum(_mass_ge(keys_ptr, cum_ptr, chunk_base, scale, t + 0 * chunk_base, CHUNK, LOG_CHUNK), 0), 0)
    tl.store(thr_ptr + row, t)
    tl.store(mz_ptr + row * 2, M)
    tl.store(mz_ptr + row * 2 + 1, z)


@triton.jit
def _chunk_candidates_kernel(
    logits_ptr, noise_ptr, seed_offset_ptr, thr_ptr, mz_ptr, cand_score_ptr, cand_tok_ptr, cand_p_ptr,
    n_vocab, n_out_rows, n_chunks, stride_lr, stride_nr, cfg_scale, temperature,
    K: tl.constexpr, USE_CFG: tl.constexpr, NOISE: tl.constexpr, CHUNK: tl.constexpr,
):
    """Per (row, chunk): the chunk's ``K`` best tokens by score (p, or p / Exp(1) noise), ties to the
    lower index, with their p."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < n_vocab
    x = _load_processed(logits_ptr, row, cols, in_vocab, n_out_rows, stride_lr, cfg_scale, temperature, USE_CFG)
    keep = in_vocab & (_order_key(x).to(tl.int64) >= tl.load(thr_ptr + row))
    p = tl.where(keep, tl.exp(x - tl.load(mz_ptr + row * 2)), 0.0) / tl.load(mz_ptr + row * 2 + 1)
    if NOISE == 1:
        noise = tl.load(noise_ptr + row * stride_nr + cols, mask=in_vocab, other=1.0).to(tl.float32)
        score = p / noise
    elif NOISE == 2:
        u = tl.rand(tl.load(seed_offset_ptr), tl.load(seed_offset_ptr + 1) + row * n_vocab + cols)
        score = p / -tl.log(tl.maximum(u, 1.0e-30))
    else:
        score = p
    score = tl.where(in_vocab, score, -1.0)
    out = (row * n_chunks + chunk) * K
    for i in tl.static_range(K):
        best = tl.max(score, 0)
        pick = tl.min(tl.where(score == best, cols, 2147483647), 0)
        tl.store(cand_score_ptr + out + i, best)
        tl.store(cand_tok_ptr + out + i, pick)
        tl.store(cand_p_ptr + out + i, tl.sum(tl.where(cols == pick, p, 0.0), 0))
        score = tl.where(cols == pick, -2.0, score)


@triton.jit
def _merge_candidates_kernel(
    cand_score_ptr, cand_tok_ptr, cand_p_ptr, tokens_ptr, logp_ptr, n_cand, stride_tr, stride_pr,
    K: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cand
    score = tl.load(cand_score_ptr + row * n_cand + offs, mask=ok, other=-3.0)
    tok = tl.load(cand_tok_ptr + row * n_cand + offs, mask=ok, other=2147483647)
    p = tl.load(cand_p_ptr + row * n_cand + offs, mask=ok, other=0.0)
    for i in tl.static_range(K):
        best = tl.max(score, 0)
        pick = tl.min(tl.where(score == best, tok, 2147483647), 0)
        tl.store(tokens_ptr + row * stride_tr + i, pick.to(tl.int64))
        tl.store(logp_ptr + row * stride_pr + i, tl.log(tl.sum(tl.where(tok == pick, p, 0.0), 0)))
        score = tl.where(tok == pick, -3.0, score)


def _draft_topk_chunked(logits, noise, seed_offset, tokens, logp, B, V, cfg_scale, temperature, top_k, top_p, k,
                        use_cfg, mode, chunk):
    dev = logits.device
    n_chunks = triton.cdiv(V, chunk)
    keys = torch.empty((B, n_chunks * chunk), dtype=torch.int32, device=dev)
    cum = torch.empty((B, n_chunks * chunk), dtype=torch.float32, device=dev)
    cmax = torch.empty((B, n_chunks), dtype=torch.float32, device=dev)
    thr = torch.empty((B,), dtype=torch.int64, device=dev)
    mz = torch.empty((B, 2), dtype=torch.float32, device=dev)
    cand_score = torch.empty((B, n_chunks * k), dtype=torch.float32, device=dev)
    cand_tok = torch.empty((B, n_chunks * k), dtype=torch.int32, device=dev)
    cand_p = torch.empty((B, n_chunks * k), dtype=torch.float32, device=dev)
    warps = 8 if chunk >= 4096 else 4
    _chunk_sort_kernel[(B, n_chunks)](
        logits, keys, cum, cmax, V, B, n_chunks, logits.stride(0), float(cfg_scale), float(temperature),
        USE_CFG=use_cfg, CHUNK=chunk, LOG_CHUNK=chunk.bit_length() - 1, num_warps=warps)
    _thresholds_kernel[(B,)](
        keys, cum, cmax, thr, mz, n_chunks, int(top_k), float(top_p),
        USE_TOP_K=0 < top_k < V, USE_TOP_P=top_p < 1.0, CHUNK=chunk, LOG_CHUNK=chunk.bit_length() - 1,
        BLOCK_C=max(2, triton.next_power_of_2(n_chunks)), RADIX_BITS=RADIX_BITS, num_warps=4)
    _chunk_candidates_kernel[(B, n_chunks)](
        logits, noise if noise is not None else logits, seed_offset if seed_offset is not None else thr,
        thr, mz, cand_score, cand_tok, cand_p,
        V, B, n_chunks, logits.stride(0), noise.stride(0) if noise is not None else 0,
        float(cfg_scale), float(temperature), K=k, USE_CFG=use_cfg, NOISE=mode, CHUNK=chunk, num_warps=warps)
    _merge_candidates_kernel[(B,)](
        cand_score, cand_tok, cand_p, tokens, logp, n_chunks * k, tokens.stride(0), logp.stride(0),
        K=k, BLOCK=max(2, triton.next_power_of_2(n_chunks * k)), num_warps=4)


def draft_topk(logits: torch.Tensor, cfg_scale: float, temperature: float, top_k: int, top_p: float,
               k: int, noise: torch.Tensor | None = None, *, seed_offset: torch.Tensor | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None, chunk: int | None = None):
    """logits [R, V] (R = 2B with CFG, rows [cond; uncond]) -> (tokens [B, k] int64, logp [B, k] fp32).
    ``noise`` [B, V] Exp(1) samples, or ``seed_offset`` int64 [2] (seed, offset) on the device for
    in-kernel Philox noise (the offset is advanced by B * V in place), or neither for greedy top-k.
    ``out``: optional preallocated (tokens, logp). ``chunk``: None = chunked kernels from V >= 8192;
    a power of 2 = chunked kernels with that chunk size (tests use it on small vocabularies); 0 = the
    one-program kernel at any V (benchmarks compare the two)."""
    if not temperature > 0:
        raise ValueError(f"draft sampling needs temperature > 0 (pass 1.0 for greedy runs), got {temperature}")
    use_cfg = cfg_scale != 1.0
    R, V = logits.shape
    B = R // 2 if use_cfg else R
    if k > V:
        raise ValueError(f"k={k} exceeds the vocabulary ({V})")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if out is None:
        out = (torch.empty((B, k), dtype=torch.int64, device=logits.device),
               torch.empty((B, k), dtype=torch.float32, device=logits.device))
    tokens, logp = out
    if noise is not None:
        mode = NOISE_TENSOR
        noise = noise if noise.stride(1) == 1 else noise.contiguous()
    elif seed_offset is not None:
        mode = NOISE_PHILOX
    else:
        mode = NOISE_NONE
    if chunk or (chunk is None and V >= CHUNKED_FROM):
        _draft_topk_chunked(logits, noise, seed_offset, tokens, logp, B, V, cfg_scale, temperature, top_k, top_p, k,
                            use_cfg, mode, chunk or CHUNK)
        if mode == NOISE_PHILOX:
            seed_offset[1:].add_(B * V)
        return tokens, logp
    block_v = triton.next_power_of_2(V)
    _draft_topk_kernel[(B,)](
        logits, noise if noise is not None else logits, seed_offset if seed_offset is not None else tokens,
        tokens, logp,
        V, B, logits.stride(0), noise.stride(0) if noise is not None else 0, tokens.stride(0), logp.stride(0),
        float(cfg_scale), float(temperature), int(top_k), float(top_p),
        K=k, USE_CFG=use_cfg, USE_TOP_K=0 < top_k < V, USE_TOP_P=top_p < 1.0, NOISE=mode, BLOCK_V=block_v,
        # The whole row lives in registers: more warps for larger vocabularies (32 warps at 65536).
        num_warps=4 if block_v <= 2048 else (8 if block_v <= 8192 else (16 if block_v <= 16384 else 32)),
    )
    if mode == NOISE_PHILOX:
        seed_offset[1:].add_(B * V)  # on the device: the next call (or graph replay) draws new noise
    return tokens, logp
