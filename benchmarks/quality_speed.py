"""Quality versus speed of every decoding setting on the Zoo model, with intervals that can tell
settings apart.

One run, one checkpoint set: every setting generates the same labels (``--images-per-class`` per
class, default 40 -> 640 images) with the same random streams: image i draws from (``--seed``, i) in
every setting, whatever the batch it is decoded in, so AR and a method are paired image by image. Per setting: class accuracy, FD in the
classifier's feature space, Inception FID, precision/recall (Inception features, k = 3), TPF (tokens
per target forward) and compute ops per token (one image, counted with :class:`vvs_engine.evaluation.op_count.
OpCounter`). Every quality figure and TPF gets a 95 % percentile-bootstrap interval over images, and
the difference to AR an interval from the same resampled image indices (paired by seed).

Parity: a setting keeps AR quality when none of class accuracy, classifier FD and FID (when computed)
is detectably worse: each paired difference's 95 % interval reaches 0 or the better side. The table
names the fastest setting (highest TPF) at parity.

Generated tokens are cached per setting (``<out>_tokens/<setting>.npz``, keyed by checkpoints,
sampling, options, labels, seed and batch size): an interrupted run resumes where it stopped.

    python benchmarks/quality_speed.py                                   # the full evaluation (hours on CPU)
    python benchmarks/quality_speed.py --images-per-class 2 --settings AR,EAGLE-2 --no-inception
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, method, options): the issue's settings, AR first.
SETTINGS = [
    ("AR", "ar", {}),
    ("EAGLE-1", "eagle", {"tree": "static"}),
    ("EAGLE-2", "eagle", {}),
    ("LANTERN d=0.1", "lantern", {"lantern_delta": 0.1}),
    ("LANTERN d=0.2", "lantern", {"lantern_delta": 0.2}),
    ("LANTERN d=0.3", "lantern", {"lantern_delta": 0.3}),
    ("LANTERN++", "lantern++", {}),
] + [
    (f"VVS-U i={i} {pv}", "vvs",
     {"skip_policy": "uniform", "skip_interval": i, "post_verify": pv, "lantern_delta": 0.2})
    for i in (2, 3, 4) for pv in ("fill", "reject")
] + [
    (f"VVS-D s={s} fill", "vvs", {"skip_policy": "dynamic", "skip_threshold": s, "lantern_delta": 0.2})
    for s in (0.65, 0.3)
] + [
    ("SJD", "sjd", {}),
    ("GSD G=3", "gsd", {"gsd_group": 3}),
    ("GSD G=8", "gsd", {"gsd_group": 8}),
    ("GSD G=14", "gsd", {"gsd_group": 14}),
    ("CASCADE drafter", "cascade", {"cascade_source": "drafter"}),
    ("CASCADE target-hidden", "cascade", {"cascade_source": "target-hidden"}),
    ("CASCADE llamagen", "cascade", {"cascade_variant": "llamagen"}),
    ("CASCADE lumina-final", "cascade", {"cascade_variant": "lumina-final"}),
    # compositions no published system has
    ("VVS-U i=2 + GSD", "vvs", {"skip_policy": "uniform", "skip_interval": 2, "accept": "gsd"}),
    ("VVS-U i=2 + CASCADE", "vvs", {"skip_policy": "uniform", "skip_interval": 2, "accept": "cascade",
                                    "tree": "static"}),
]
SETTING_BY_NAME = {s[0]: s for s in SETTINGS}


# --- statistics (pure numpy; the test checks them on synthetic data) --------------------------------
def bootstrap_indices(n: int, reps: int, seed: int) -> np.ndarray:
    """[reps, n] image indices drawn with replacement (one fixed draw shared by every setting)."""
    return np.random.default_rng(seed).integers(0, n, size=(reps, n))


def interval(samples) -> tuple:
    """95 % percentile interval of bootstrap samples."""
    lo, hi = np.percentile(np.asarray(samples, dtype=np.float64), [2.5, 97.5])
    return float(lo), float(hi)


def estimate(stat, idx: np.ndarray, ar=None) -> tuple:
    """stat(indices) -> float. Returns ({value on all images, its interval over the bootstrap draws
    ``idx``, and with ``ar`` = AR's (value, draws) on the same indices the paired difference and its
    interval}, the draws)."""
    value = float(stat(np.arange(idx.shape[1])))
    boot = np.array([stat(i) for i in idx])
    out = {"value": value, "ci": interval(boot)}
    if ar is not None:
        out["diff"] = value - ar[0]
        out["diff_ci"] = interval(boot - ar[1])
    return out, boot


PARITY_METRICS = {"class_accuracy": +1, "fd_classifier": -1, "fid_inception": -1}  # +1: higher is better


def at_parity(row: dict) -> bool:
    """Not detectably worse than AR: for every quality metric the paired difference's 95 % interval
    reaches the no-difference point or the better side. (Differences, not the setting's own interval
    against AR's: an FD interval from resamples that repeat images is shifted upwards, and the shift
    cancels in a paired difference.)"""
    for k, sign in PARITY_METRICS.items():
        m = row.get(k)
        if m is None or "diff_ci" not in m:
            continue
        lo, hi = m["diff_ci"]
        if (hi if sign > 0 else -lo) < 0:
            return False
    return True


def parity_verdicts(rows: list) -> str | None:
    """Marks every row ``parity`` True/False; returns the name of the fastest (highest TPF) non-AR row
    at parity, or None."""
    best = None
    for r in rows:
        r["parity"] = r["method"] == "ar" or at_parity(r)
        if r["parity"] and r["method"] != "ar" and (best is None or r["tpf"]["value"] > best["tpf"]["value"]):
            best = r
    return best["name"] if best else None


# --- generation, cached per setting -----------------------------------------------------------------
def checkpoint_digest(engine_paths: dict) -> str:
    h = hashlib.sha1()
    for k in sorted(engine_paths):
        p = engine_paths[k]
        h.update(k.encode())
        if p and os.path.exists(p):
            with open(p, "rb") as f:
                h.update(hashlib.sha1(f.read()).digest())
    return h.hexdigest()[:16]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def generate_setting(eng, method, opts, labels, seed, sampling, batch_size=16, cache=None, key="", show=True):
    """-> {"tokens": [n, T] int64, "forwards": [n] target forwards per image}; loaded from ``cache``
    (an .npz path) when it holds the same ``key``."""
    if cache and os.path.exists(cache):
        with np.load(cache) as z:
            if str(z["key"]) == key:
                return {"tokens": z["tokens"].astype(np.int64), "forwards": z["forwards"].astype(np.float64)}
    from tqdm import tqdm

    toks, fwd = [], []
    chunks = [list(range(i, min(i + batch_size, len(labels)))) for i in range(0, len(labels), batch_size)]
    for ch in tqdm(chunks, desc=f"{method} {opts}", disable=not show, leave=False, dynamic_ncols=True):
        # image i's random numbers come from (seed, i): batch-invariant, paired across settings
        out = eng.generate(class_labels=[labels[i] for i in ch], method=method, seed=seed,
                           image_indices=ch, batch_size=batch_size, decode_images=False, **sampling, **opts)
        toks.append(out.tokens.numpy())
        fwd += list(out.stats["per_image"]["target_forward_passes"])
    res = {"tokens": np.concatenate(toks).astype(np.int64), "forwards": np.asarray(fwd, dtype=np.float64)}
    if cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        np.savez_compressed(cache, tokens=res["tokens"].astype(np.int16), forwards=res["forwards"], key=key)
    return res


def ops_per_token(eng, method, opts, label, seed, sampling) -> float:
    from vvs_engine.evaluation.op_count import OpCounter

    with OpCounter() as c:
        eng.generate(class_labels=[label], method=method, seed=seed, decode_images=False, **sampling, **opts)
    return c.total / eng.tokens_per_image


# --- metrics ----------------------------------------------------------------------------------------
def image_features(eng, tokens, labels, inception: bool) -> dict:
    """Per-image quantities every metric is computed from (so bootstrap draws need no new images)."""
    from vvs_engine.evaluation.quality import as_float_images, classifier_features, get_inception, load_classifier

    images = eng.decode_images(torch.as_tensor(tokens))
    x = as_float_images(images)
    if x.shape[-1] != 64 or x.shape[-2] != 64:  # the classifier and the reference crops are 64 x 64
        x = torch.nn.functional.interpolate(x, size=(64, 64), mode="bilinear", align_corners=False, antialias=True)
    net = load_classifier()
    with torch.no_grad():
        pred = net(x).argmax(-1).numpy()
    out = {"correct": (pred == np.asarray(labels)).astype(np.float64), "cls": classifier_features(x, net)}
    if inception:
        out["inc"] = get_inception()(x)
    return out


def setting_metrics(feats, forwards, tokens_per_image, ref, idx, inception_reps=None, ar=None, pr_k=3) -> tuple:
    """Every metric with its interval -> (metrics, draws). With ``ar`` (AR's draws from an earlier
    call on the same ``idx``) each metric also gets the paired difference to AR."""
    from vvs_engine.evaluation.quality import feature_stats, frechet_distance, precision_recall

    def fd(f, r):
        mu_r, s_r = feature_stats(r)
        return lambda i: frechet_distance(*feature_stats(f[i]), mu_r, s_r)

    def pr(i):
        return precision_recall(ref["inc"], feats["inc"][i], pr_k)

    stats = {"class_accuracy": lambda i: feats["correct"][i].mean(),
             "fd_classifier": fd(feats["cls"], ref["cls"]),
             "tpf": lambda i: len(i) * tokens_per_image / forwards[i].sum()}
    if "inc" in feats and "inc" in ref:
        stats["fid_inception"] = fd(feats["inc"], ref["inc"])
        stats["precision"] = lambda i: pr(i)["precision"]
        stats["recall"] = lambda i: pr(i)["recall"]
    out, draws = {}, {}
    for name, stat in stats.items():
        reps = idx[:inception_reps] if name in ("fid_inception", "precision", "recall") and inception_reps else idx
        a = ar.get(name) if ar is not None else None
        out[name], boot = estimate(stat, reps, a)
        draws[name] = (out[name]["value"], boot)
    return out, draws


# --- report -----------------------------------------------------------------------------------------
def _ci(m, nd):
    if m is None:
        return "–"
    return f"{m['value']:.{nd}f} [{m['ci'][0]:.{nd}f}, {m['ci'][1]:.{nd}f}]"


def _diff(m, nd):
    if m is None or "diff" not in m:
        return "–"
    return f"{m['diff']:+.{nd}f} [{m['diff_ci'][0]:+.{nd}f}, {m['diff_ci'][1]:+.{nd}f}]"


def to_markdown(meta: dict, rows: list, fastest) -> str:
    lines = ["# Quality versus speed on the Zoo model", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['n_images']} images per setting ({meta['labels']}), image i seeded with {meta['seed']} + i "
             f"(paired with AR by seed), sampling {meta['sampling']}, checkpoints {meta['checkpoints']}, "
             f"torch {meta['torch']}, {meta['threads']} threads, device {meta['device']}. Intervals: 95 % "
             f"percentile bootstrap over images ({meta['bootstrap']} draws; {meta['inception_bootstrap']} for the "
             f"Inception metrics); Δ = setting − AR on the same draws. Parity: no Δ interval (class accuracy, "
             f"classifier FD, FID) lies wholly on the worse side. FD intervals come from resamples that "
             f"repeat images and sit above the full-set value; the shift largely cancels in Δ. "
             f"Ops/token: aten compute ops of one image (views excluded) per token.", "",
             f"**Fastest setting at parity: {fastest or 'none'}**", "",
             "| setting | TPF | ops/token | class acc | Δ acc vs AR | FD (classifier) | Δ FD | FID | precision | recall "
             "| parity |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} |||||||||| ")
            continue
        ops = f"{r['ops_per_token']:.0f}" if r.get("ops_per_token") is not None else "–"
        lines.append(f"| {r['name']} | {_ci(r['tpf'], 2)} | {ops} | {_ci(r['class_accuracy'], 3)} | "
                     f"{_diff(r['class_accuracy'], 3)} | {_ci(r['fd_classifier'], 2)} | {_diff(r['fd_classifier'], 2)} | "
                     f"{_ci(r.get('fid_inception'), 1)} | {_ci(r.get('precision'), 2)} | {_ci(r.get('recall'), 2)} | "
                     f"{'yes' if r['parity'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list, path: str, fastest=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    ar = next(r for r in ok if r["method"] == "ar")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in ((axes[0], "class_accuracy", "class accuracy ↑"),
                           (axes[1], "fd_classifier", "FD (classifier features) ↓")):
        ax.axhspan(*ar[key]["ci"], color="grey", alpha=0.2, label="AR 95 % interval")
        for r in ok:
            m, t = r[key], r["tpf"]
            # a bootstrap FD interval can lie above the full-set value (resamples repeat images): clip at 0
            ax.errorbar(t["value"], m["value"], yerr=[[max(0.0, m["value"] - m["ci"][0])],
                                                      [max(0.0, m["ci"][1] - m["value"])]],
                        xerr=[[max(0.0, t["value"] - t["ci"][0])], [max(0.0, t["ci"][1] - t["value"])]],
                        fmt="o" if r["parity"] else "x",
                        ms=5, capsize=2, color="C2" if r["parity"] else "C3")
            ax.annotate(r["name"] + (" ★" if r["name"] == fastest else ""), (t["value"], m["value"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("TPF (tokens per target forward) →")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("Quality vs TPF (95 % bootstrap intervals; green o = AR parity, red x = not)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the run ----------------------------------------------------------------------------------------
def evaluate(eng, settings, labels, seed, sampling, inception=True, reps=1000, inception_reps=100, batch_size=16,
             cache_dir=None, ckpt_key="", ops=True, show=True) -> tuple:
    """Generate (or load) every setting, compute the metrics -> (rows, fastest setting at parity)."""
    from vvs_engine.evaluation.quality import reference_features
    from vvs_engine.errors import VVSError

    ref = {"cls": reference_features("classifier")}
    if inception:
        ref["inc"] = reference_features("inception")
    idx = bootstrap_indices(len(labels), reps, seed)
    rows, ar = [], None
    for name, method, opts in settings:
        if show:
            print(f"[quality_speed] {name}", flush=True)
        key = json.dumps([ckpt_key, method, opts, sampling, labels, seed, batch_size, "counter-rng"], sort_keys=True)
        cache = os.path.join(cache_dir, _slug(name) + ".npz") if cache_dir else None
        try:
            gen = generate_setting(eng, method, opts, labels, seed, sampling, batch_size, cache, key, show)
            opt = ops_per_token(eng, method, opts, labels[0], seed, sampling) if ops else None
        except VVSError as e:
            rows.append({"name": name, "method": method, "options": opts, "error": str(e)})
            continue
        feats = image_features(eng, gen["tokens"], labels, inception)
        row = {"name": name, "method": method, "options": opts, "ops_per_token": opt}
        metrics, draws = setting_metrics(feats, gen["forwards"], eng.tokens_per_image, ref, idx, inception_reps, ar)
        row.update(metrics)
        if method == "ar":
            ar = draws
        rows.append(row)
    fastest = parity_verdicts([r for r in rows if "error" not in r])
    return rows, fastest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images-per-class", type=int, default=40,
                    help="images per class (default 40: 640 on the Zoo, class accuracy near 0.5 to +-3.9 points)")
    ap.add_argument("--settings", default=None, help="comma list of setting names (default: all; AR is always run "
                                                     "first). Known: " + ", ".join(SETTING_BY_NAME))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quality_speed"),
                    help="output prefix: .md, .json, _tokens/ (default benchmarks/results/quality_speed)")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "quality_speed.png"), help="Pareto plot path")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--batch-size", type=int, default=16, help="images decoded together (default 16; tokens do not "
                    "depend on it except for VVS-D)")
    ap.add_argument("--seed", type=int, default=0, help="image i draws from (seed, i); also seeds the bootstrap (default 0)")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap draws (default 1000)")
    ap.add_argument("--inception-bootstrap", type=int, default=100, help="draws for FID/precision/recall "
                                                                         "(each needs a 2048-d matrix root; default 100)")
    ap.add_argument("--no-inception", action="store_true", help="skip FID and precision/recall")
    ap.add_argument("--no-ops", action="store_true", help="skip the ops-per-token count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ckpt-dir", default=None, help="load zoo-{gpt,vq,drafter} from this folder")
    a = ap.parse_args(argv)
    from vvs_engine import Engine
    from vvs_engine.errors import VVSError

    try:
        torch.set_num_threads(a.threads)
        if a.images_per_class < 1 or a.batch_size < 1 or a.bootstrap < 1 or a.inception_bootstrap < 1:
            raise VVSError("--images-per-class, --batch-size and the bootstrap counts must be >= 1")
        settings = list(SETTINGS)
        if a.settings:
            names = [s.strip() for s in a.settings.split(",") if s.strip()]
            bad = [n for n in names if n not in SETTING_BY_NAME]
            if bad:
                raise VVSError(f"unknown setting(s) {', '.join(bad)}; known: {', '.join(SETTING_BY_NAME)}")
            settings = [SETTINGS[0]] + [SETTING_BY_NAME[n] for n in names if n != "AR"]
        from vvs_engine.zoo import model_path

        names = ("zoo-gpt", "zoo-vq", "zoo-drafter", "zoo-classifier")
        paths = {n: (os.path.join(a.ckpt_dir, n + ".safetensors") if a.ckpt_dir and n != "zoo-classifier"
                     else model_path(n)) for n in names}
        eng = Engine.load(gpt_ckpt=paths["zoo-gpt"], vq_ckpt=paths["zoo-vq"], drafter=paths["zoo-drafter"],
                          device=a.device)
        ckpt = checkpoint_digest(paths)
        from vvs_engine import zoo

        sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 4.0}
        if hasattr(zoo, "sampling_defaults"):
            sampling.update({k: v for k, v in zoo.sampling_defaults().items() if k in sampling})
        ncls = eng.config.num_classes
        labels = [c for c in range(ncls) for _ in range(a.images_per_class)]
        t0 = time.time()
        rows, fastest = evaluate(eng, settings, labels, a.seed, sampling, not a.no_inception, a.bootstrap,
                                 a.inception_bootstrap, a.batch_size, a.out + "_tokens", ckpt, not a.no_ops)
    except VVSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"command": "python benchmarks/quality_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "n_images": len(labels), "labels": f"{a.images_per_class} per class x {ncls} classes", "seed": a.seed,
            "sampling": sampling, "checkpoints": ckpt, "torch": torch.__version__, "threads": a.threads,
            "device": a.device, "bootstrap": a.bootstrap, "inception_bootstrap": a.inception_bootstrap,
            "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "fastest_at_parity": fastest}, f, indent=1)
    md = to_markdown(meta, rows, fastest)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    print(md)
    if a.plot:
        plot(rows, a.plot, fastest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
