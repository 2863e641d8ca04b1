"""The persistent engine (``runtime.core``): decoders and their compiled, captured rounds are built once
and reused by every later ``generate`` call; partial images come off the loop's thread and add no round.

Captures are counted on the CPU too (``runner.capture_count``: a round kind's first run in a new
``RoundGraphs`` is the capture a GPU would make), so what the core saves is visible here.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from spec_models import tiny_engine

ROWS = 4
# the settings a caller mixes across calls: one sampling scope each (one setting, greedy, mixed per image)
SETTINGS = [dict(temperature=1.0, cfg_scale=3.0), dict(temperature=0.0, cfg_scale=3.0),
            dict(temperature=[1.0, 0.0, 0.7, 1.0], top_k=[0, 0, 8, 0], cfg_scale=3.0)]


def _call(eng, method, n, setting, seed, **kw):
    setting = {k: (v[:n] if isinstance(v, list) else v) for k, v in setting.items()}
    return eng.generate(class_labels=[i % 5 for i in range(n)], method=method, seed=seed, batch_size=ROWS,
                        decode_images=False, **setting, **kw)


@pytest.fixture(scope="module")
def small():
    return tiny_engine(vocab=64, block=16, peak=8.0)


@pytest.mark.parametrize("method,opts", [("ar", {}), ("sjd", {"jacobi_window": 4}),
                                         ("eagle", dict(tree_total=6, tree_depth=2, tree_topk=2))])
def test_warm_engine_makes_no_new_captures_or_compiles(small, method, opts):
    """After a warm-up call per (setting, image count) — a core per sampling scope, a decoder per row
    count — 100 calls of 1..ROWS images with the settings mixed cause no capture and no compile; the
    tokens equal a cold engine's."""
    small.clear_cores()
    for setting in SETTINGS:
        for n in range(1, ROWS + 1):
            _call(small, method, n, setting, 0, **opts)
    rng = random.Random(0)
    calls = 100 if method == "ar" else 30
    captures = compiles = 0
    last = None
    for i in range(calls):
        n, setting = rng.randint(1, ROWS), rng.choice(SETTINGS)
        out = _call(small, method, n, setting, i, **opts)
        captures += out.stats["graph_captures"]
        compiles += out.stats["compiles"]
        last = (n, setting, i, out.tokens)
    assert (captures, compiles) == (0, 0)
    n, setting, seed, tokens = last
    small.clear_cores()  # negative control: a cold engine captures again, and decodes the same tokens
    cold = _call(small, method, n, setting, seed, **opts)
    assert cold.stats["graph_captures"] > 0
    assert torch.equal(cold.tokens, tokens)


def test_kept_decoders_hold_no_trace_of_earlier_calls(small):
    """A call on a kept core (rows full of the last call's images, finished or not) equals the same call
    on a fresh engine, for every method family of the loop; one core per method, options and scope."""
    small.clear_cores()
    kw = dict(class_labels=[1, 2, 3], seed=5, temperature=1.0, top_k=10, cfg_scale=3.0, batch_size=2,
              decode_images=False)
    for method, opts in (("sjd-pac", dict(jacobi_window=8, pac_width=2, pac_depth=2)), ("zipar", {"zipar_window": 2}),
                         ("vvs", dict(tree_total=6, tree_depth=2, tree_topk=2, skip_policy="uniform", skip_interval=2))):
        small.generate(method=method, **dict(kw, class_labels=[4, 0, 4, 1, 0], seed=9), **opts)  # same scope
        warm = small.generate(method=method, **kw, **opts)
        assert warm.stats["graph_captures"] == 0, method
        small.clear_cores()
        cold = small.generate(method=method, **kw, **opts)
        assert torch.equal(warm.tokens, cold.tokens), method
        assert warm.stats["per_image"] == cold.stats["per_image"], method
    assert len(small._cores) == 1


def test_each_batch_invariant_mode_keeps_its_own_decoders(small):
    """A captured graph replays the kernels of the mode it was captured in (on CUDA the invariant matmul
    and attention), so a call in the other mode must not reuse a decoder of this one: it captures its
    own, and switching back captures nothing."""
    small.clear_cores()
    kw = dict(class_labels=[1, 2], seed=3, temperature=1.0, cfg_scale=3.0, batch_size=2, decode_images=False)
    small.generate(method="ar", **kw)
    assert small.generate(method="ar", **kw).stats["graph_captures"] == 0
    other = small.generate(method="ar", deterministic=True, **kw)
    assert other.stats["graph_captures"] > 0  # negative of the line above: a new mode, new graphs
    assert small.generate(method="ar", **kw).stats["graph_captures"] == 0
    assert small.generate(method="ar", deterministic=True, **kw).stats["graph_captures"] == 0
    assert len(small._cores) == 2


@pytest.mark.parametrize("method,opts", [("ar", {}), ("zipar", {"zipar_window": 2})])
def test_partial_images_come_from_the_output_thread_and_add_no_round(small, method, opts):
    got = []
    kw = dict(class_labels=[0, 1, 2], seed=3, method=method, batch_size=2, **opts)
    plain = small.generate(**kw)
    with_partials = small.generate(on_partial=lambda p: got.append((threading.current_thread().name, p)),
                                   partial_images=3, **kw)
    assert torch.equal(plain.tokens, with_partials.tokens)
    assert with_partials.stats["batch_rounds"] == plain.stats["batch_rounds"]
    assert all(name != threading.current_thread().name for name, _ in got)
    by_image = {}
    for _, p in got:
        by_image.setdefault(p.image_index, []).append(p)
    assert sorted(by_image) == [0, 1, 2]
    T = small.tokens_per_image
    for i, parts in by_image.items():
        assert [p.partial_index for p in parts] == list(range(len(parts))) and 1 <= len(parts) <= 3
        committed = [int(p.committed.sum()) for p in parts]
        assert committed == sorted(committed) and 0 < committed[0] and committed[-1] < T
        for p in parts:  # what a partial calls final is final
            assert torch.equal(p.tokens[p.committed], with_partials.tokens[i][p.committed])
            assert p.image.size == with_partials.images[i].size
        if method == "ar":
            assert torch.equal(parts[-1].committed, torch.arange(T) < committed[-1])  # a raster prefix


def test_partial_arguments_are_checked(small):
    from vvs_engine.errors import VVSError

    with pytest.raises(VVSError, match="partial_images must be 0 to 3"):
        small.generate(class_labels=[0], partial_images=4, on_partial=print)
    with pytest.raises(VVSError, match="need on_partial"):
        small.generate(class_labels=[0], partial_images=1)
    with pytest.raises(VVSError, match="not both"):
        small.generate(class_labels=[0], partial_images=1, partial_every=1, on_partial=print)
    assert small.generate(class_labels=[0], decode_images=False).tokens.shape == (1, small.tokens_per_image)
