"""CASCADE rows of the Zoo one-run table (merged into ``benchmarks/studies/spec_zoo/spec_zoo.py`` by the lead).

``run_cascade_rows(engine, labels, seed)`` runs CASCADE with each breadth source next to the
drafter-based baselines the paper compares against (EAGLE-1 static tree, EAGLE-2 dynamic tree,
LANTERN++) on the same labels and seed, and returns one dict per run: method, settings, TPF, mean
accepted length, wall time (and the tokens, for quality metrics). ``drafters`` adds the CASCADE and
EAGLE-1 rows again with other drafters (e.g. the redundancy-weighted one of ``vvs_engine.training.cascade``).

    python benchmarks/studies/spec_zoo/cascade_zoo.py --labels 0,1,2,3 --seed 0 [--drafter weighted=zoo_work/x.safetensors]

Full table (16 images, AR row, NLL and class accuracy), written by code to
``benchmarks/studies/spec_zoo/cascade_zoo.md`` with its command (about 95 s per label on one CPU thread):

    python benchmarks/studies/spec_zoo/cascade_zoo.py --labels 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 --ar --md benchmarks/studies/spec_zoo/cascade_zoo.md

NLL = mean target negative log-likelihood (CFG as sampled) of the generated tokens, nats/token: the
exact methods sit at AR's level, a lossy rule that accepts tokens the target finds unlikely raises it.
Class accuracy by the Zoo classifier (16 images: ±0.12, indicative only).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List, Optional, Sequence

# (row name, method, options): the exact baselines first, then the relaxed ones.
CONFIGS = [
    ("EAGLE-1", "eagle", dict(tree="static", accept="exact")),
    ("EAGLE-2", "eagle", dict()),
    ("LANTERN++", "lantern++", dict(lantern_lambda=2.0)),  # the default when the table was made (pinned)
    ("CASCADE (target-hidden)", "cascade", dict()),  # the method's defaults: nucleus gate
    ("CASCADE (target-logits)", "cascade", dict(cascade_source="target-logits")),
    ("CASCADE (drafter)", "cascade", dict(cascade_source="drafter")),
    ("CASCADE (target-hidden, kl gate)", "cascade", dict(cascade_gate="kl")),  # the authors' LlamaGen gate
]
# Rows repeated with every extra drafter: the drafter-training change only matters through these.
DRAFTER_CONFIGS = ("EAGLE-1", "CASCADE (target-hidden)", "CASCADE (drafter)")


def _row(name, method, opts, out, drafter_name, keep_tokens):
    st = out.stats
    row = dict(method=name, settings=dict(method=method, drafter=drafter_name, **opts), tpf=st["tpf"],
               mean_accepted_length=st.get("mean_accepted_length"), wall_time_s=st["wall_time_s"],
               target_forward_passes=st["target_forward_passes"], n_images=st["n_images"])
    if keep_tokens:
        row["tokens"] = out.tokens
    return row


def run_cascade_rows(engine, labels: Sequence[int], seed: int, temperature: float = 1.0, cfg_scale: float = 4.0,
                     top_k: int = 0, top_p: float = 1.0, drafters: Optional[Dict[str, str]] = None,
                     include_ar: bool = False, keep_tokens: bool = False, configs=None, log=print) -> List[dict]:
    """One row per configuration, all on ``labels`` with ``seed``. ``drafters``: {name: path} of extra
    drafters; their rows are named "<row> [name]". ``include_ar`` adds the AR row (wall-clock ratios)."""
    from vvs_engine.drafting.drafter import load_drafter

    sampling = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=top_k, top_p=top_p, seed=seed,
                    decode_images=False)
    rows = []

    def run(name, method, opts, drafter_name="default"):
        t0 = time.perf_counter()
        out = engine.generate(class_labels=list(labels), method=method, **sampling, **opts)
        rows.append(_row(name, method, opts, out, drafter_name, keep_tokens))
        if log:
            r = rows[-1]
            log(f"{name:34s} tpf {r['tpf']:.3f}  accepted {r['mean_accepted_length'] or 0:.3f}  "
                f"wall {r['wall_time_s']:.1f} s ({time.perf_counter() - t0:.1f} s)")

    if include_ar:
        run("AR", "ar", {})
    for name, method, opts in configs or CONFIGS:
        run(name, method, opts)
    default = engine.drafter
    try:
        for dname, path in (drafters or {}).items():
            engine.drafter = load_drafter(path, engine.gpt).to(device=engine.device, dtype=engine.dtype)
            for name, method, opts in configs or CONFIGS:
                if name in DRAFTER_CONFIGS:
                    run(f"{name} [{dname}]", method, opts, dname)
    finally:
        engine.drafter = default
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--labels", default="0,1,2,3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH", help="extra drafter rows")
    p.add_argument("--ar", action="store_true", help="include the AR row")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--md", default=None, help="write the markdown table (TPF, NLL, class accuracy) here")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    a = p.parse_args(argv)
    import sys

    import torch

    from vvs_engine.engine import Engine

    torch.set_num_threads(a.threads)
    eng = Engine.load()
    drafters = dict(d.split("=", 1) for d in a.drafter)
    labels = [int(x) for x in a.labels.split(",")]
    rows = run_cascade_rows(eng, labels, a.seed, cfg_scale=a.cfg_scale, drafters=drafters, include_ar=a.ar,
                            keep_tokens=a.md is not None)
    if a.md:
        add_quality(eng, rows, labels, a.cfg_scale)
        with open(a.md, "w") as f:
            f.write(markdown_table(rows, "python benchmarks/studies/spec_zoo/cascade_zoo.py " + " ".join(
                argv if argv is not None else sys.argv[1:]), a.threads))
    for r in rows:
        r.pop("tokens", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


def add_quality(engine, rows, labels, cfg_scale):
    """NLL (nats/token, CFG as sampled) of each row's tokens under the target, and class accuracy."""
    import torch

    from vvs_engine.evaluation.quality import class_accuracy

    for r in rows:
        logits = engine.score(class_labels=list(labels), tokens=r["tokens"], cfg_scale=cfg_scale)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, r["tokens"][..., None].to(logits.device))
        r["nll"] = float(-logp.mean())
        r["class_accuracy"] = class_accuracy(engine.decode_images(r["tokens"]), labels)


def markdown_table(rows, command, threads) -> str:
    lines = ["# CASCADE and its baselines on the Zoo model", "",
             f"{rows[0]['n_images']} images, CPU fp32, {threads} threads. Command: `{command}`", "",
             "| method | TPF | mean accepted | NLL (nats/token) | class acc |", "|---|---|---|---|---|"]
    for r in rows:
        acc = r.get("mean_accepted_length")
        lines.append(f"| {r['method']} | {r['tpf']:.2f} | {'–' if acc is None else f'{acc:.2f}'} | "
                     f"{r['nll']:.3f} | {r['class_accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
