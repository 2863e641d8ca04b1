"""SJD and GSD rows for the one-run speed table (merged into ``benchmarks/studies/spec_zoo/spec_zoo.py``).

    python benchmarks/studies/spec_zoo/jacobi_zoo.py                 # the Zoo model (Engine.load()), labels 0..7
    python benchmarks/studies/spec_zoo/jacobi_zoo.py --tiny          # a tiny random model, when the Zoo is not installed

:func:`run_jacobi_rows` decodes the same labels with the same seed under every setting of
:data:`SETTINGS` and returns one row each: method, settings, TPF (image tokens per target forward,
prefill excluded), mean accepted length (tokens committed per forward), forward passes, wall time and,
with ``include_ar``, the wall-time ratio against plain AR on the same labels, also decoded one image
at a time. The standalone run
prints a table and writes ``jacobi_zoo.json`` beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/spec_zoo: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run from a checkout

from vvs_engine import Engine  # noqa: E402

RESULTS = HERE

# (method, options): SJD with every draft initialisation, GSD at several group sizes (the released
# code's 14, the paper's 25 and 50, and small ones), GSD without the distance filter, and the
# static-cluster ablation.
SETTINGS = [
    ("sjd", {"jacobi_init": "copy-left"}),
    ("sjd", {"jacobi_init": "random"}),
    ("sjd", {"jacobi_init": "argmax-left"}),
    ("sjd", {"jacobi_init": "copy-above"}),
    ("gsd", {"gsd_group": 3}),
    ("gsd", {"gsd_group": 8}),
    ("gsd", {"gsd_group": 14}),
    ("gsd", {"gsd_group": 25}),
    ("gsd", {"gsd_group": 50}),
    ("gsd", {"gsd_group": 14, "gsd_dist_threshold": math.inf}),
    ("gsd", {"gsd_group": 14, "gsd_static_clusters": True}),
]


def settings_label(opts: dict) -> str:
    return " ".join(f"{k.replace('_', '-')}={v}" for k, v in opts.items()) or "defaults"


def run_jacobi_rows(engine, labels, seed, settings=None, include_ar=False, return_tokens=False, warmup=False,
                    **sampling) -> list:
    """One row per (method, options) of ``settings`` (default :data:`SETTINGS`). ``sampling``:
    temperature, top_k, top_p, cfg_scale (the engine's defaults otherwise). ``return_tokens`` adds the
    generated tokens [n, T] (for quality metrics) to each row; ``warmup`` first decodes one image
    untimed per setting (allocator and kernel caches on a GPU)."""
    labels = list(labels)
    rows = []
    ar_wall = None
    runs = ([("ar", {})] if include_ar else []) + list(settings or SETTINGS)
    for method, opts in runs:
        if warmup:
            engine.generate(class_labels=labels[:1], method=method, seed=seed, decode_images=False, **sampling, **opts)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if method == "ar":
            # image by image, like the Jacobi and drafter loops (batch 1, both CFG rows): a batched
            # AR baseline would compare different batch sizes
            outs = [engine.generate(class_labels=[lab], method="ar", seed=seed + i, decode_images=False, **sampling)
                    for i, lab in enumerate(labels)]
            tokens = torch.cat([o.tokens for o in outs])
            fwd = sum(o.stats["target_forward_passes"] for o in outs)
            st = {"tpf": tokens.numel() / fwd, "target_forward_passes": fwd}
        else:
            out = engine.generate(class_labels=labels, method=method, seed=seed, decode_images=False, batch_size=1,
                                  **sampling, **opts)  # batch 1, like the AR rows
            tokens, st = out.tokens, out.stats
        wall = time.perf_counter() - t0
        row = {
            "method": method,
            "settings": settings_label(opts),
            "tpf": st["tpf"],
            "mean_accepted_length": st.get("mean_accepted_length", 1.0),
            "target_forward_passes": st["target_forward_passes"],
            "wall_s": wall,
            "n_images": len(labels),
        }
        if method == "ar":
            ar_wall = wall
        if ar_wall is not None:
            row["wall_ratio_vs_ar"] = ar_wall / wall
        if return_tokens:
            row["tokens"] = tokens
        rows.append(row)
    return rows


def _tiny_engine():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from spec_models import tiny_engine

    return tiny_engine(vocab=64, block=64, peak=8.0, dtype=torch.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random model instead of the Zoo")
    p.add_argument("--zoo-dir", default=None, help="load the Zoo checkpoints from this folder (default: installed)")
    p.add_argument("--labels", default="0,1,2,3,4,5,6,7", help="class labels, one image each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--out", default=None, help="JSON file (default jacobi_zoo[_tiny].json beside this script)")
    p.add_argument("--only", default=None, help="comma-separated indices into SETTINGS (default all)")
    p.add_argument("--warmup", action="store_true", help="one untimed image per setting first")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if a.tiny:
        eng = _tiny_engine()
    elif a.zoo_dir:
        from vvs_engine import zoo

        paths = zoo.default_paths(a.zoo_dir)
        eng = Engine.load(gpt_ckpt=paths["gpt"], vq_ckpt=paths["vq"], drafter=paths.get("drafter"), device=a.device)
    else:
        eng = Engine.load(device=a.device)
    labels = [int(x) for x in a.labels.split(",")]
    if a.tiny:
        labels = [x % eng.config.num_classes for x in labels]
    settings = [SETTINGS[int(i)] for i in a.only.split(",")] if a.only else None
    rows = run_jacobi_rows(eng, labels, a.seed, settings=settings, include_ar=True, warmup=a.warmup, temperature=a.temperature, top_k=a.top_k,
                           cfg_scale=a.cfg_scale)
    print(f"{'method':6} {'settings':48} {'TPF':>6} {'acc.len':>7} {'fwd':>6} {'wall s':>7} {'vs AR':>6}")
    for r in rows:
        print(f"{r['method']:6} {r['settings']:48} {r['tpf']:6.2f} {r['mean_accepted_length']:7.2f} "
              f"{r['target_forward_passes']:6d} {r['wall_s']:7.2f} {r.get('wall_ratio_vs_ar', float('nan')):6.2f}")
    path = a.out or os.path.join(RESULTS, "jacobi_zoo_tiny.json" if a.tiny else "jacobi_zoo.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta = {"model": "tiny-random" if a.tiny else "zoo", "zoo_dir": a.zoo_dir, "labels": labels, "seed": a.seed,
            "sampling": {"temperature": a.temperature, "top_k": a.top_k, "cfg_scale": a.cfg_scale},
            "device": str(eng.device), "torch": torch.__version__, "platform": platform.platform()}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
