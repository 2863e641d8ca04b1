"""End-to-end speed benchmark: ``vvs-engine bench`` and ``benchmarks/e2e.py``.

Two modes.

* **Measure** (default): methods x settings on one model (the Zoo model, or a random-weight model of
  a given shape). Per setting: batch-1 latency per image with CFG (median over repeats, after one
  untimed warm-up that also captures the CUDA graphs), tokens per target forward (TPF), mean accepted
  length, and the speed-up over our own AR baseline measured in the same run with the same graph
  setting. ``--record TRACE`` also stores each setting's acceptance statistics for replay.
* **Replay** (``--replay TRACE``): random-weight models of realistic size (LlamaGen-XL 775M, a
  7B Chameleon-class model) are driven with the accept/skip behaviour recorded on the Zoo model: a
  ``trace_replay`` acceptance rule runs the recorded rule for its cost but forces each verified
  round to accept the next length of a sequence with the recorded accepted-length histogram, and
  the skip schedule is the recorded one (VVS-D's data-dependent choice becomes VVS-U at the recorded
  skip ratio). So speed-up / TPF measures the system's efficiency at realistic acceptance without
  trained large models.

Writes ``e2e_<tag>.md``, ``.json`` and ``.png`` under ``--out`` (default ``./bench-results``, in the current
folder: the repository's tables in ``benchmarks/results`` change only when that folder is named).
``--quick``: tiny shapes, CPU-friendly, finishes in well under a minute.

``--batch-sizes 1,4,16`` (measure mode) adds a throughput table: per setting and batch size, one
untimed warm-up batch, then ``--images`` images (default: the largest batch size) generated in one
call -> images per second, TPF and the per-image TPF spread, side by side in one run
(``batch_<tag>.md``, with the command that wrote it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..acceptance.verify import default_lantern_k
from ..errors import VVSError

DEFAULT_OUT = "bench-results"  # relative to the current folder, never a checkout's committed tables

DEFAULT_SETTINGS = ["ar", "eagle", "lantern:lantern_delta=0.2", "vvs:skip_interval=2", "vvs:skip_policy=dynamic"]
QUICK_SETTINGS = ["ar", "eagle:tree_total=16,tree_depth=3,tree_topk=4",
                  "lantern:lantern_delta=0.2,tree_total=16,tree_depth=3,tree_topk=4",
                  "vvs:skip_interval=2,tree_total=16,tree_depth=3,tree_topk=4"]
# Random-weight shapes for replay: name -> (gpt preset or dims, vocab, tokens per image).
SHAPES = {
    "tiny": dict(dims=dict(dim=64, n_layer=2, n_head=4, multiple_of=32), vocab=256, tokens=64),
    "GPT-B": dict(preset="GPT-B", vocab=16384, tokens=256),
    "GPT-XL": dict(preset="GPT-XL", vocab=16384, tokens=576),  # LlamaGen-XL, 384 px
    "GPT-7B": dict(preset="GPT-7B", vocab=65536, tokens=1024),  # Chameleon-class, 512 px
}


# --- settings -------------------------------------------------------------------------------------
@dataclass
class Setting:
    method: str
    opts: Dict[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.method + ("(" + ",".join(f"{k}={v}" for k, v in self.opts.items()) + ")" if self.opts else "")


def parse_setting(text: str) -> Setting:
    """``method[:key=value,key=value]``; values are int, float or string."""
    method, _, rest = text.partition(":")
    opts = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise VVSError(f"bad setting '{text}': expected key=value, got '{item}'")
        opts[k.strip().replace("-", "_")] = _parse_value(v.strip())
    return Setting(method.strip(), opts)


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


# --- models ---------------------------------------------------------------------------------------
def random_engine(shape: str, device, dtype, seed: int = 0, peak: float = 30.0, tokens: Optional[int] = None):
    """A random-weight target + drafter of a named shape (no tokenizer). ``peak`` sharpens the output
    head so drafter trees grow deep chains, as trained drafters do (flat random distributions give
    shallow, wide trees whose accepted length could not reach the recorded one)."""
    from ..drafting.drafter import Drafter, DrafterConfig
    from ..engine import Engine
    from ..models.gpt import GPT, GPTConfig, gpt_config

    if shape not in SHAPES:
        raise VVSError(f"unknown shape '{shape}'; known: {', '.join(SHAPES)}")
    sp = SHAPES[shape]
    over = dict(vocab_size=sp["vocab"], block_size=tokens or sp["tokens"], num_classes=1000)
    cfg = gpt_config(sp["preset"], **over) if "preset" in sp else GPTConfig(**sp["dims"], **over)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: a 7B model is slow to initialise on a CPU
        gpt = GPT(cfg)
        drafter = Drafter(DrafterConfig(dim=cfg.dim, n_head=cfg.n_head)).attach(gpt)
        with torch.no_grad():
            gpt.output.weight.mul_(peak)
    eng = Engine(gpt, None, drafter, info={"model": f"random {shape}"})
    eng.to(device, dtype)
    return eng


def neighbor_stub(engine, k: int, seed: int = 0) -> None:
    """LANTERN needs latent neighbours; a random-weight model has no tokenizer, so install a random
    [V, k] neighbour table (same shape and cost as the real one)."""
    V = engine.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    engine._codebook_cache[k] = torch.randint(0, V, (V, k), generator=g).to(engine.device)


def load_model(name: str, device, dtype, quick: bool):
    """-> (engine, description). ``zoo`` falls back to a tiny random model while it is not shipped."""
    from ..engine import Engine

    if name == "zoo":
        try:
            return Engine.load(device=device, dtype=dtype), "zoo"
        except Exception as e:  # not trained yet, or not installed
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            eng = random_engine("tiny", device, dtype)
            neighbor_stub(eng, lantern_k(eng))
            return eng, f"random tiny (zoo model not available: {reason})"
    eng = random_engine(name, device, dtype, tokens=64 if quick and name == "tiny" else None)
    neighbor_stub(eng, lantern_k(eng))
    return eng, f"random {name}"


def lantern_k(engine) -> int:
    V = engine.vq.config.codebook_size if engine.vq is not None else engine.config.vocab_size
    return default_lantern_k(V)


# --- timing ---------------------------------------------------------------------------------------
def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


BENCH_PROMPTS = ("a red fox in the snow", "a bowl of fruit on a wooden table", "a lighthouse at dusk")


def condition(engine, i: int) -> dict:
    """``generate`` keyword for one benchmark image: class label ``i`` or a fixed prompt (text targets)."""
    if engine.config.model_type == "t2i":
        return {"prompts": [BENCH_PROMPTS[i % len(BENCH_PROMPTS)]]}
    return {"class_labels": [i]}


def _takes_lantern_k(method: str) -> bool:
    """Methods with a lantern_k option (the drafter-tree ones; not ar or the Jacobi methods)."""
    from ..methods import resolve_options

    return "lantern_k" in resolve_options(method, {})


def time_setting(engine, setting: Setting, args, label_of, extra_opts=None) -> dict:
    """Warm-up once, then ``args.repeats`` timed single-image generations -> medians and stats."""
    opts = dict(setting.opts)
    if _takes_lantern_k(setting.method) and "lantern_k" not in opts and engine.vq is None:
        opts["lantern_k"] = lantern_k(engine)
    opts.update(extra_opts or {})
    kw = dict(method=setting.method, temperature=args.temperature, cfg_scale=args.cfg_scale,
              decode_images=args.decode_images and engine.vq is not None, cuda_graphs=args.graphs,
              compile=getattr(args, "compile", None), **opts)
    engine.generate(**condition(engine, label_of(0)), seed=10_000, **kw)  # warm-up: graph capture, autotuning
    if args.torch_trace:  # one extra, untimed generation under torch.profiler (Chrome trace)
        from ..measure.profiling import torch_trace

        os.makedirs(args.torch_trace, exist_ok=True)
        name = "".join(c if c.isalnum() or c in "-_=." else "_" for c in setting.label)
        with torch_trace(os.path.join(args.torch_trace, f"{name}.json")):
            engine.generate(**condition(engine, label_of(0)), seed=10_001, **kw)
    lat, stats = [], []
    for r in range(args.repeats):
        _sync(engine.device)
        t0 = time.perf_counter()
        out = engine.generate(**condition(engine, label_of(r)), seed=r, **kw)
        _sync(engine.device)
        lat.append(time.perf_counter() - t0)
        stats.append(out.stats)
    s0 = stats[-1]
    tpf = statistics.median(s["tpf"] for s in stats)
    mal = statistics.median(s.get("mean_accepted_length", 1.0) or 1.0 for s in stats)
    row = {"setting": setting.label, "method": setting.method, "opts": opts,
           "latency_s": statistics.median(lat), "latency_all_s": lat,
           "ms_per_token": statistics.median(lat) * 1e3 / engine.tokens_per_image, "tpf": tpf, "mean_accepted_length": mal,
           "verified_steps": statistics.median(s.get("verified_steps", s["target_forward_passes"]) for s in stats),
           "skip_steps": statistics.median(s.get("skip_steps", 0) for s in stats),
           "cuda_graphs": s0.get("cuda_graphs", kw.get("cuda_graphs", False)),
           "acceptance_rate_by_depth": _mean_depth_rates(stats)}
    return row


def throughput_setting(engine, setting: Setting, batch_size: int, n_images: int, args, label_of) -> dict:
    """A one-image warm-up, one eager warm-up batch of ``batch_size`` images under the op counter
    (compute ops per committed token), then ``n_images`` images in batches of ``batch_size`` timed
    -> images/s and TPF."""
    from ..measure.opcount import OpCounter

    opts = dict(setting.opts)
    if _takes_lantern_k(setting.method) and "lantern_k" not in opts and engine.vq is None:
        opts["lantern_k"] = lantern_k(engine)
    kw = dict(method=setting.method, temperature=args.temperature, cfg_scale=args.cfg_scale, decode_images=False,
              batch_size=batch_size, cuda_graphs=args.graphs, compile=getattr(args, "compile", None),
              static_batches=getattr(args, "static_batches", False), **opts)
    eager = {**kw, "cuda_graphs": False, "compile": False}
    engine.generate(class_labels=[label_of(0)], seed=10_000, **{**eager, "batch_size": 1})  # one-off setup
    with OpCounter() as ops:  # the warm-up batch, eager: compute ops per committed token at this batch size
        counted = engine.generate(class_labels=[label_of(i) for i in range(batch_size)], seed=10_000, **eager)
    if engine.device.type == "cuda" and kw["cuda_graphs"] is not False:
        engine.generate(class_labels=[label_of(i) for i in range(batch_size)], seed=10_000, **kw)  # capture
    _sync(engine.device)
    t0 = time.perf_counter()
    out = engine.generate(class_labels=[label_of(i) for i in range(n_images)], seed=0, **kw)
    _sync(engine.device)
    wall = time.perf_counter() - t0
    spread = out.stats.get("tpf_per_image", {})
    return {"setting": setting.label, "method": setting.method, "batch_size": batch_size, "images": n_images,
            "wall_s": wall, "images_per_s": n_images / wall, "tpf": out.stats["tpf"],
            "tpf_per_image": spread, "skip_steps": out.stats.get("skip_steps", 0), "tokens": out.tokens,
            "ops_per_token": ops.compute / counted.stats["tokens_generated"], "ops_tpf": counted.stats["tpf"]}


def _setting_rows(setting: Setting, sizes, n_images: int, args, device, dtype, engine=None) -> List[dict]:
    """One setting at every batch size (in a worker process with ``--jobs``: its own model and threads)."""
    from tqdm import tqdm

    if engine is None:
        if args.threads:
            torch.set_num_threads(args.threads)
        engine, _ = load_model("tiny" if args.quick and args.model == "zoo" else args.model, device, dtype, args.quick)
    n_cls = engine.config.num_classes
    rows = []
    for b in sizes:
        r = throughput_setting(engine, setting, b, n_images, args, lambda i: (7 * i) % n_cls)
        tqdm.write(f"{r['setting']} B={b}: {r['images_per_s']:.3f} images/s, TPF {r['tpf']:.2f}, "
                   f"{r['ops_per_token']:.0f} compute ops per committed token")
        rows.append(r)
    return rows


def write_batch_report(rows: List[dict], meta: dict, out_dir: str, tag: str, command: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"batch_{tag}")
    first = {r["setting"]: r["tokens"] for r in rows if r["batch_size"] == 1}
    rows = [dict(r) for r in rows]
    for r in rows:  # the same seed and labels at every batch size: how many images came out the same
        if r["setting"] in first:
            r["identical_to_batch1"] = float((r["tokens"] == first[r["setting"]]).all(1).double().mean())
        r.pop("tokens")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "command": command}, f, indent=2, default=str)
    lines = [f"# Batched throughput ({tag})", "", f"Written by `{command}`.", ""]
    for k in ("device", "hardware", "dtype", "model", "batching", "cfg_scale", "temperature", "workers"):
        if k in meta:
            lines.append(f"- {k}: {meta[k]}")
    lines += ["", "Images/s and TPF: the timed images (seed 0). Compute ops per committed token: "
                  "`vvs_engine.measure.opcount.OpCounter` over the untimed warm-up batch of `batch` images "
                  "(seed 10000, eager, every kernel as the device runs it; on a GPU each op is at least one launch).",
              "", "| setting | batch | images | images/s | vs batch 1 | TPF | per-image TPF min / median / max "
                  "| images identical to batch 1 | compute ops per committed token |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    base_ips = {r["setting"]: r["images_per_s"] for r in rows if r["batch_size"] == 1}
    for r in rows:
        sp = r["tpf_per_image"]
        rel = f"{r['images_per_s'] / base_ips[r['setting']]:.2f}x" if r["setting"] in base_ips else "-"
        spread = " / ".join(f"{sp[k]:.2f}" for k in ("min", "median", "max")) if sp else "-"
        same = r.get("identical_to_batch1")
        lines.append(f"| {r['setting']} | {r['batch_size']} | {r['images']} | {r['images_per_s']:.3f} | {rel} | "
                     f"{r['tpf']:.2f} | {spread} | {'-' if same is None else f'{same:.0%}'} | "
                     f"{r['ops_per_token']:.1f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return [base + ".json", base + ".md"]


def _mean_depth_rates(stats: List[dict]) -> dict:
    keys = sorted({k for s in stats for k in s.get("acceptance_rate_by_depth", {})}, key=int)
    return {k: statistics.fmean(s.get("acceptance_rate_by_depth", {}).get(k, 0.0) for s in stats) for k in keys}


def add_speedups(rows: List[dict]) -> None:
    base = next((r for r in rows if r["method"] == "ar"), None)
    for r in rows:
        r["speedup_vs_ar"] = base["latency_s"] / r["latency_s"] if base else float("nan")
        r["speedup_over_tpf"] = r["speedup_vs_ar"] / r["tpf"] if r["tpf"] else float("nan")


# --- trace replay -------------------------------------------------------------------------------
def accepted_histogram(depth_rates: Dict[str, float]) -> List[float]:
    """P(accepted >= d) for d = 1.. -> P(accepted == d) for d = 0.."""
    ge = [1.0] + [depth_rates[k] for k in sorted(depth_rates, key=int)]
    ge.append(0.0)
    return [max(0.0, ge[d] - ge[d + 1]) for d in range(len(ge) - 1)]


def length_sequence(hist: List[float], n: int = 256, seed: int = 0) -> List[int]:
    """A deterministic shuffled sequence of n accepted lengths whose counts follow ``hist``
    (largest-remainder rounding)."""
    total = sum(hist) or 1.0
    exact = [h / total * n for h in hist]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(hist)), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    seq = [d for d, c in enumerate(counts) for _ in range(c)]
    random.Random(seed).shuffle(seq)
    return seq or [0]


class TraceReplayRule:
    """Accept exactly the next recorded length per verified round. The inner rule still runs (its
    cost is part of what we measure) and supplies the residual; only the decision is replaced:
    a child is accepted iff its depth is at most the round's length, so the walk descends the first
    children down to that depth. verify_tree calls ``accept`` once per sibling rank, so the round is
    ``calls // max_children``. Host-side counting only: no sync."""

    lossless = False

    def __init__(self, inner, lengths: List[int], device):
        self.inner, self.name = inner, "trace_replay"
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self.calls = 0

    def accept(self, r, x, qx, u, ctx):
        ok, moved = self.inner.accept(r, x, qx, u, ctx)
        if ctx is None:  # post_verify=reject chain check: keep the inner decision
            return ok, moved
        rnd = self.calls // ctx.tree.children.shape[1]
        self.calls += 1
        k = self.lengths[rnd % self.lengths.shape[0]]
        return ctx.tree.depth[ctx.child] <= k, moved

    def residual(self, r, q, x, moved):
        return self.inner.residual(r, q, x, moved)


def _trace_rule_factory(engine, inner="exact", lengths=(0,), k=1000, delta=0.2, lam=2.0):
    # The loop passes its own lantern_* arguments to make_rule, so the inner rule's are renamed here.
    from ..acceptance.verify import make_rule

    inner_rule = make_rule(inner, engine, lantern_k=k, lantern_delta=delta, lantern_lambda=lam)
    return TraceReplayRule(inner_rule, list(lengths), engine.device)


def register_trace_rule() -> None:
    from ..acceptance import registry as rules_registry

    rules_registry.register_rule("trace_replay", _trace_rule_factory)


def replay_setting(row: dict, model_engine) -> Setting:
    """A recorded row -> the setting that replays it on another model."""
    opts = {k: v for k, v in row["opts"].items() if k != "lantern_k"}
    if row["method"] == "ar":
        return Setting("ar", {})
    inner = opts.pop("accept", None) or {"eagle": "exact", "lantern++": "lantern++"}.get(row["method"], "lantern")
    if opts.get("skip_policy") == "dynamic":  # data-dependent on the recorded model: use its skip ratio
        v, s = row["verified_steps"], row["skip_steps"]
        opts["skip_policy"] = "uniform"
        opts["skip_interval"] = max(2, round((v + s) / s)) if s else 1
    rule_kw = {new: opts.pop(old) for old, new in (("lantern_delta", "delta"), ("lantern_lambda", "lam"))
               if old in opts}
    rule_kw["k"] = lantern_k(model_engine)
    lengths = length_sequence(accepted_histogram(row["acceptance_rate_by_depth"]))
    opts.update(accept="trace_replay", rule_options=dict(inner=inner, lengths=lengths, **rule_kw))
    return Setting(row["method"], opts)


def synthetic_trace() -> dict:
    """A stand-in trace while no trained model is available: per-depth acceptance rates chosen to
    give mean accepted lengths of about 2.4 (exact rule) and 3.2 (LANTERN-relaxed), the range
    reported for LlamaGen-class models. Labelled synthetic in every report that uses it."""
    exact = {"1": 0.7, "2": 0.4, "3": 0.2, "4": 0.1}
    relaxed = {"1": 0.85, "2": 0.65, "3": 0.4, "4": 0.2, "5": 0.1}
    rows = [{"setting": "ar", "method": "ar", "opts": {}, "tpf": 1.0, "acceptance_rate_by_depth": {}},
            {"setting": "eagle", "method": "eagle", "opts": {}, "tpf": 2.4, "acceptance_rate_by_depth": exact},
            {"setting": "lantern(lantern_delta=0.2)", "method": "lantern", "opts": {"lantern_delta": 0.2},
             "tpf": 3.25, "acceptance_rate_by_depth": relaxed},
            {"setting": "vvs(skip_interval=2)", "method": "vvs", "opts": {"skip_interval": 2},
             "tpf": float("nan"), "acceptance_rate_by_depth": relaxed}]
    return {"meta": {"model": "synthetic acceptance profile (no trained model)"}, "blocks": [{"rows": rows}]}


# --- reporting ------------------------------------------------------------------------------------
def hardware() -> dict:
    h = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        h["gpu"] = torch.cuda.get_device_name(0)
    h["cpu"] = platform.processor() or platform.machine()
    h["cpu_threads"] = torch.get_num_threads()
    return h


def write_report(result: dict, out_dir: str, tag: str, plot: bool = True) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"e2e_{tag}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    lines = [f"# End-to-end benchmark ({tag})", ""]
    m = result["meta"]
    for k in ("command", "date", "mode", "device", "hardware", "dtype", "cuda_graphs", "cfg_scale", "temperature", "repeats",
              "vq_decode_included", "note"):
        if k in m:
            lines.append(f"- {k}: {m[k]}")
    for block in result["blocks"]:
        lines += ["", f"## {block['model']} ({block['tokens_per_image']} tokens per image)", "",
                  "| setting | latency/image (ms) | TPF | mean accepted | speed-up vs AR | speed-up / TPF | graphs |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in block["rows"]:
            lines.append(f"| {r['setting']} | {r['latency_s'] * 1e3:.1f} | {r['tpf']:.2f} | "
                         f"{r['mean_accepted_length']:.2f} | {r['speedup_vs_ar']:.2f}x | {r['speedup_over_tpf']:.2f} | "
                         f"{r['cuda_graphs']} |")
        if block.get("recorded_tpf"):
            lines += ["", "Recorded TPF (source model) per setting: " +
                      ", ".join(f"{k}: {v:.2f}" for k, v in block["recorded_tpf"].items())]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    files = [base + ".json", base + ".md"]
    if plot:
        try:
            files.append(_plot(result, base + ".png"))
        except ImportError:
            pass
    return files


def _plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = result["blocks"]
    fig, axes = plt.subplots(len(blocks), 2, figsize=(15, 0.45 * max(len(b["rows"]) for b in blocks) * len(blocks)
                                                     + 2.5 * len(blocks)), squeeze=False)
    for (ax_lat, ax_eff), b in zip(axes, blocks):
        names = [r["setting"] for r in b["rows"]]
        ax_lat.barh(range(len(names)), [r["latency_s"] * 1e3 for r in b["rows"]])
        ax_lat.set_yticks(range(len(names)), names, fontsize=10)
        ax_lat.invert_yaxis()  # the table's order, top to bottom
        ax_lat.set_xlabel("latency per image (ms)", fontsize=11)
        ax_lat.set_title(b["model"], fontsize=11)
        tpf = [r["tpf"] for r in b["rows"]]
        sp = [r["speedup_vs_ar"] for r in b["rows"]]
        ax_eff.scatter(tpf, sp, s=50)
        for i, (x, y) in enumerate(zip(tpf, sp), 1):  # numbers keyed to the bar chart's rows (names overlap)
            ax_eff.annotate(str(i), (x, y), fontsize=10, xytext=(4, 3), textcoords="offset points")
        ax_lat.set_yticks(range(len(names)), [f"{i}  {n}" for i, n in enumerate(names, 1)], fontsize=10)
        hi = max(tpf + sp + [1.0]) * 1.1
        ax_eff.plot([0, hi], [0, hi], "k--", lw=0.8, label="speed-up = TPF")
        ax_eff.plot([0, hi], [0, 0.8 * hi], "g:", lw=0.8, label="0.8 x TPF (target)")
        ax_eff.set_xlabel("TPF (tokens per target forward)", fontsize=11)
        ax_eff.set_ylabel("wall-clock speed-up vs AR", fontsize=11)
        ax_eff.tick_params(labelsize=10)
        ax_lat.tick_params(axis="x", labelsize=10)
        ax_eff.legend(fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- entry point ----------------------------------------------------------------------------------
def parse_args(argv):
    from ..errors import OneLineParser  # a bad flag is one line (exit 2), not argparse's whole usage

    p = OneLineParser(prog="vvs-engine bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="zoo", help="zoo (default; the shipped Zoo model) or a random-weight "
                                                 f"shape: {', '.join(SHAPES)}")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="measure a local Hugging Face folder of another family (Janus-Pro, Lumina-mGPT, Emu3) "
                        "instead of --model")
    p.add_argument("--drafter", default=None, metavar="PATH", help="drafter for --model-dir (speculative settings)")
    p.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="with --model-dir: image side in pixels (Lumina-mGPT default 768, Emu3 default 720)")
    p.add_argument("--settings", default=None, help="semicolon-separated method[:k=v,...] list "
                                                    f"(default: {';'.join(DEFAULT_SETTINGS)}); ar is always added")
    p.add_argument("--repeats", type=int, default=3, help="timed images per setting (default 3; median reported)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-graphs", dest="graphs", action="store_false", default=None,
                   help="eager loops (default: the engine's default, CUDA graphs on CUDA)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compiled decode rounds (default: the engine's default, on for CUDA)")
    p.add_argument("--decode-images", action="store_true", help="include VQ decoding in the latency")
    p.add_argument("--record", default=None, metavar="TRACE", help="write acceptance traces for --replay here")
    p.add_argument("--replay", default=None, metavar="TRACE", help="replay a recorded trace on random models ('synthetic': a built-in "
                                                                   "acceptance profile, for use before a trained model exists)")
    p.add_argument("--replay-models", default="GPT-XL,GPT-7B", help="shapes for --replay (default GPT-XL,GPT-7B; "
                                                                     "NAME:TOKENS overrides the token count)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and settings, 2 repeats (CPU smoke run)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder for the tables (default ./{DEFAULT_OUT}, in the current folder)")
    p.add_argument("--tag", default=None, help="file name tag (default: mode and device)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--torch-trace", default=None, metavar="DIR",
                   help="also write one torch.profiler Chrome trace per setting here (untimed run)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                   help="measure mode: images/s and TPF at these batch sizes (a batch table) instead of latency")
    p.add_argument("--static-batches", action="store_true",
                   help="--batch-sizes: decode static batches of B images to the end instead of keeping B images "
                        "in flight (continuous batching, the default); for comparison")
    p.add_argument("--jobs", type=int, default=1,
                   help="--batch-sizes: settings measured in this many worker processes side by side (default 1)")
    p.add_argument("--images", type=int, default=None,
                   help="images per setting for --batch-sizes (default: the largest batch size)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        raise VVSError("--repeats must be >= 1")
    if not a.out:
        raise VVSError("--out is empty: name the output folder")
    return a


def main(argv=None) -> int:
    from ..engine import resolve_device, resolve_dtype

    args = parse_args(list(argv) if argv is not None else None)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device("cuda" if args.device == "auto" and torch.cuda.is_available()
                            else ("cpu" if args.device == "auto" else args.device))
    dtype = resolve_dtype(args.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    if args.quick:
        args.repeats = min(args.repeats, 2)
    register_trace_rule()
    settings = [parse_setting(s) for s in (args.settings.split(";") if args.settings else
                                           (QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS)) if s.strip()]
    if not any(s.method == "ar" for s in settings):
        settings.insert(0, Setting("ar"))
    meta = {"device": str(device), "hardware": hardware(), "dtype": str(dtype).replace("torch.", ""),
            "cuda_graphs": "engine default (on for CUDA)" if args.graphs is None else args.graphs,
            "cfg_scale": args.cfg_scale, "temperature": args.temperature, "repeats": args.repeats,
            "vq_decode_included": bool(args.decode_images),
            "command": "vvs-engine bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    blocks = []
    if args.replay:
        meta["mode"] = "replay"
        if args.temperature == 0:
            raise VVSError("--replay needs sampling (temperature > 0): greedy verification ignores the rule")
        if args.replay == "synthetic":
            trace = synthetic_trace()
        else:
            with open(args.replay) as f:
                trace = json.load(f)
        meta["note"] = (f"random-weight models driven by the accept/skip statistics recorded on "
                        f"{trace['meta'].get('model', '?')}; VQ decoding not included (no tokenizer)")
        meta["vq_decode_included"] = False
        shapes = ["tiny"] if args.quick else [m.strip() for m in args.replay_models.split(",") if m.strip()]
        recorded = trace["blocks"][0]["rows"]
        if args.settings:  # replay only these of the recorded settings (ar is always kept)
            wanted = {s.label for s in settings}
            recorded = [row for row in recorded if row["setting"] in wanted]
        tag = args.tag or f"{meta['mode']}_{device.type}" + ("_quick" if args.quick else "")
        for spec in shapes:
            name, _, tok = spec.partition(":")
            eng = random_engine(name, device, dtype, tokens=int(tok) if tok else (64 if args.quick else None))
            neighbor_stub(eng, lantern_k(eng))
            rows = []
            rec = recorded
            for row in rec:
                st = replay_setting(row, eng)
                r = time_setting(eng, st, args, lambda i: i % eng.config.num_classes)
                r["setting"] = row["setting"]
                rows.append(r)
            add_speedups(rows)
            blocks.append({"model": f"random {name} (replay)", "tokens_per_image": eng.tokens_per_image,
                           "rows": rows, "recorded_tpf": {row["setting"]: row["tpf"] for row in rec
                                                          if not math.isnan(row["tpf"])}})
            _release(eng)
            write_report({"meta": meta, "blocks": blocks}, args.out, tag, plot=False)  # kept if a later model runs out of time
    elif args.batch_sizes:
        meta["mode"] = "batch"
        meta["batching"] = "static" if args.static_batches else "continuous"
        eng, desc = load_model("tiny" if args.quick and args.model == "zoo" else args.model, device, dtype, args.quick)
        meta["model"] = desc
        sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
        if not sizes or sizes[0] < 1:
            raise VVSError("--batch-sizes must list integers >= 1")
        n_images = args.images or sizes[-1]
        runnable = [s for s in settings if not (eng.vq is None and s.opts.get("skip_policy") == "dynamic")]
        rows = []
        from tqdm import tqdm

        tag = args.tag or f"{'quick_' if args.quick else ''}{device.type}"
        command = "vvs-engine bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        if args.jobs > 1:  # one worker process per setting, each with --threads threads
            meta["workers"] = f"{args.jobs} processes side by side, one setting each at a time"
            import concurrent.futures as cf
            import multiprocessing as mp

            order = {(s.label, b): i for i, (s, b) in enumerate((s, b) for s in runnable for b in sizes)}
            with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
                futures = [pool.submit(_setting_rows, s, sizes, n_images, args, device, dtype) for s in runnable]
                for fut in tqdm(cf.as_completed(futures), total=len(futures), desc="batch table (settings)"):
                    rows = sorted(rows + fut.result(), key=lambda r: order[(r["setting"], r["batch_size"])])
                    files = write_batch_report(rows, meta, args.out, tag, command)
        else:
            for s in tqdm(runnable, desc="batch table (settings)", leave=False):
                rows += _setting_rows(s, sizes, n_images, args, device, dtype, eng)
                files = write_batch_report(rows, meta, args.out, tag, command)  # rewritten after every setting
        with open(files[1]) as f:
            print(f.read())
        print("wrote " + ", ".join(files))
        return 0
    else:
        meta["mode"] = "measure"
        if args.model_dir:
            from ..engine import Engine

            eng = Engine.load(model_dir=args.model_dir, drafter=args.drafter, device=device, dtype=dtype,
                              image_size=args.image_size)
            desc = f"{eng.info.get('model')} ({args.model_dir})"
        else:
            eng, desc = load_model("tiny" if args.quick and args.model == "zoo" else args.model, device, dtype,
                                   args.quick)
        meta["model"] = desc
        n_cls = eng.config.num_classes or len(BENCH_PROMPTS)
        runnable = [s for s in settings if not (eng.vq is None and s.opts.get("skip_policy") == "dynamic")]
        if len(runnable) < len(settings):  # VVS-D's similarity needs codebook vectors (a tokenizer)
            meta["note"] = "VVS-D settings skipped: this model has no tokenizer (codebook vectors)"
        rows = [time_setting(eng, s, args, lambda i: (7 * i) % n_cls) for s in runnable]
        add_speedups(rows)
        blocks.append({"model": desc, "tokens_per_image": eng.tokens_per_image, "rows": rows})
        if args.record:
            os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
            with open(args.record, "w") as f:
                json.dump({"meta": meta, "blocks": blocks}, f, indent=2, default=str)
        _release(eng)
    result = {"meta": meta, "blocks": blocks}
    tag = args.tag or f"{meta['mode']}_{device.type}" + ("_quick" if args.quick else "")
    files = write_report(result, args.out, tag, plot=not args.no_plot)
    with open(files[1]) as f:
        print(f.read())
    print("wrote " + ", ".join(files))
    return 0


def _release(engine) -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
