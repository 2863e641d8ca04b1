"""Counter-based random numbers: every draw is a pure function of (seed, image index, step, stream, lane).

A decode that draws its randomness from a ``torch.Generator`` couples the images of a batch: image 3's
uniforms depend on how many numbers images 0-2 consumed first. Here a draw is a hash of its coordinates
instead, so an image's random numbers never depend on the batch size, the bucket padding or which other
images share the batch (the property dataset sharding and batched decoding rely on).

    key[b]      = mix64(seed, image_index[b])            once per generation, [B]
    u[b, lane]  = mix64(mix64(key[b] + step[b]·S + stream·T) + lane·G)   top 24 bits -> (0, 1]

``mix64`` is the SplitMix64 finaliser (Steele, Lea, Flood 2014) evaluated with wrapping int64 torch ops,
so the CPU and CUDA produce the same bits; the constants are the published SplitMix64 ones. A stream
names the purpose of a draw (acceptance uniforms, residual samples, tree sampling, ...), so two
purposes at the same step never share numbers. Uniforms have 24 bits of resolution (exact in float32).
"""
from __future__ import annotations

import math

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_STEP = 0xD1B54A32D192ED03  # odd multipliers that spread step and stream over the 64-bit key space
_STREAM = 0xAEF17502108EF2D9


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MIX1, MIX2, STEP, STREAM = map(_signed, (_GOLDEN, _MIX1, _MIX2, _STEP, _STREAM))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    z = z ^ _shr(z, 30)
    z = z * MIX1
    z = z ^ _shr(z, 27)
    z = z * MIX2
    return z ^ _shr(z, 31)


def lane_offsets(n: int, device) -> torch.Tensor:
    """What lanes ``0..n-1`` of a draw add to its base hash: ``(lane + 1) * GOLDEN`` (wrapping)."""
    return torch.arange(1, n + 1, dtype=torch.long, device=device) * GOLDEN


def bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """Top 24 bits of a hash -> float32 in (0, 1] (never 0, so inverse-CDF sampling never picks a
    zero-probability token)."""
    return (_shr(h, 40) + 1).to(torch.float32) * (1.0 / (1 << 24))


class Streams:
    """Purposes of draws; a method may use any small distinct integers, these are the shared ones."""

    SAMPLE = 0  # the committed token of an AR step / residual sample of a verify round
    ACCEPT = 1  # acceptance uniforms of a verify round
    TREE = 2  # draft-tree sampling
    SKIP = 3  # VVS skip-path selection
    JACOBI_INIT = 4  # fresh Jacobi window drafts
    JACOBI_UPDATE = 5  # Jacobi window refills
    CHAIN = 6  # VVS post-verification of a skipped chain


class CounterRNG:
    """Random numbers for B images keyed by ``(seed, image_index[b])``.

    ``uniform(step, stream, shape)`` -> float32 ``[B, *shape]`` in (0, 1]; ``step`` is an int or an
    int64 device tensor ``[B]`` (e.g. each image's own round counter), so the loop needs no host read.
    """

    def __init__(self, seed, image_index: torch.Tensor):
        """``seed``: one int for every image, or one per image (images of different requests)."""
        image_index = torch.as_tensor(image_index, dtype=torch.long)
        self.device = image_index.device
        if isinstance(seed, (list, tuple)):
            seed_t = torch.tensor([_signed(int(x) % (1 << 64)) for x in seed], dtype=torch.long, device=self.device)
        else:
            seed_t = torch.tensor(_signed(int(seed) % (1 << 64)), dtype=torch.long, device=self.device)
        self.key = mix64(mix64(seed_t + GOLDEN) ^ (image_index * GOLDEN + MIX2))  # [B]
        self._lanes = {}
        self._stream_offsets = {}

    def rows(self, index: torch.Tensor) -> "CounterRNG":
        """The generator of rows ``index`` of this batch (same keys, so the same draws)."""
        sub = object.__new__(CounterRNG)
        sub.device, sub.key, sub._lanes = self.device, self.key.index_select(0, index), self._lanes
        sub._stream_offsets = self._stream_offsets
        return sub

    @property
    def batch(self) -> int:
        return self.key.shape[0]

    def lane_offsets(self, n: int) -> torch.Tensor:
        """``lane_offsets(n)`` as a cached device constant. Round functions that torch.compile traces
        take it from here, made eagerly before the first round: computed inside a traced round,
        ``arange * GOLDEN`` becomes an Inductor index expression whose 64-bit constants overflow."""
        lanes = self._lanes.get(n)
        if lanes is None:  # constant per shape: not recomputed every round
            lanes = self._lanes[n] = lane_offsets(n, self.device)
        return lanes

    def stream_offsets(self, streams) -> torch.Tensor:
        """[len(streams)] int64: what each stream adds to a step's key (``kernels.counter_uniform``'s input)."""
        key = tuple(int(stream) for stream in streams)
        offsets = self._stream_offsets.get(key)
        if offsets is None:  # constant per stream list: not rebuilt every round
            offsets = self._stream_offsets[key] = torch.tensor([_signed(k * _STREAM % (1 << 64)) for k in key],
                                                               dtype=torch.long, device=self.device)
        return offsets

    def uniform(self, step, stream: int, shape=()) -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = 1
        for s in shape:
            n *= s
        step = torch.as_tensor(step, dtype=torch.long, device=self.device)
        base = mix64(self.key + step * STEP + _signed(int(stream) * _STREAM % (1 << 64)))  # [B]
        h = mix64(base[:, None] + self.lane_offsets(n)[None, :])  # [B, n]
        return bits_to_uniform(h).reshape(self.batch, *shape)

    def uniforms(self, step, draws) -> list:
        """Several ``uniform(step, stream, shape)`` draws for ``draws`` = [(stream, shape), ...] in one
        pass (the same bits as separate calls, with a fraction of the ops: one hash per round)."""
        shapes = [(s,) if isinstance(s, int) else tuple(s) for _, s in draws]
        sizes = [math.prod(s) for s in shapes]
        offsets = self.stream_offsets(stream for stream, _ in draws)
        step = torch.as_tensor(step, dtype=torch.long, device=self.device)
        base = mix64((self.key + step * STEP)[:, None] + offsets[None, :])  # [B, streams]
        u = bits_to_uniform(mix64(base[:, :, None] + self.lane_offsets(max(sizes))[None, None, :]))
        return [u[:, i, :n].reshape(self.batch, *shape) for i, (n, shape) in enumerate(zip(sizes, shapes))]

    def sample(self, probs: torch.Tensor, step, stream: int) -> torch.Tensor:
        """One categorical draw per row of ``probs`` ``[B, ..., V]`` -> int64 ``[B, ...]``."""
        u = self.uniform(step, stream, probs.shape[1:-1])
        return sample_inverse_cdf(probs, u)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Categorical draw by inverse CDF: the first index whose cumulative mass reaches ``u`` times the
    row total (``u`` in (0, 1], one per row; rows need not be normalised)."""
    cdf = probs.float().cumsum(-1)
    target = u[..., None] * cdf[..., -1:]
    return (cdf < target).sum(-1).clamp(max=probs.shape[-1] - 1)


def sample_inverse_cdf_one_pass(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw of :func:`sample_inverse_cdf`, bit for bit, for non-negative ``probs``: the row total is
    read as the cdf's maximum instead of its last entry (the same number: a cumulative sum of
    non-negative terms never decreases). Compiled, a maximum is a reduction Inductor keeps in the kernel
    that computes the cdf (and the distribution itself), so a draw costs no launch of its own; reading
    the last entry needs the cdf in memory and a second kernel for the count. Used by the Jacobi
    rounds, whose every draw sits in one pass over the vocabulary."""
    cdf = probs.float().cumsum(-1)
    target = u[..., None] * cdf.amax(-1, keepdim=True)
    return (cdf < target).sum(-1).clamp(max=probs.shape[-1] - 1)
