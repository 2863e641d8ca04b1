"""The shared harness of the maintained benchmark tools: settings, token caches, statistics, reports.

``quality_speed.py`` and ``pjd_zoo.py`` (and the studies that share their cache) use it, so one setting
has one cache key, one set of statistics and one report format wherever it is measured.

* **Settings and context**: the Zoo's checkpoints, their digest and the shared sampling
  (:func:`zoo_context`), the labels of a run (:func:`labels_for`), a list of names checked against the
  known settings with a one-line error (:func:`pick`).
* **Token cache**: a setting's tokens are a function of what :func:`setting_key` puts in its canonical
  JSON; the cache file ``<folder>/<slug>.npz`` keeps the key's digest, and a file whose digest does not
  match is never reused (:func:`load_cache`). :func:`generate_setting` decodes batch by batch into a
  resumable ``.partial.npz`` (and, if asked, each batch's row statistics into ``<slug>.rows.json``).
  **The key, digest, slug and file layout are what the committed caches were made with: changing any of
  them silently orphans hours of decoding** (``tests/test_quality_speed.py`` recomputes the committed keys).
* **Statistics**: percentile-bootstrap intervals over images, paired differences to AR on the same
  draws, the parity rule, fast Fréchet distances against a fixed reference (:class:`ReferenceSet`),
  per-image features and draws cached in a git-ignored work folder (:class:`WorkCache`), the sampling
  gap D kept per tokens folder (:func:`gap_of`), and the three levels of fidelity.
* **Reports**: interval formatting, a report's ``.md`` + ``.json`` (:func:`write_tables`) and the
  generated blocks between marker comments in the docs (:func:`replace_block`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
QUALITY_CACHE = os.path.join(ROOT, "benchmarks", "results", "quality_speed_tokens")  # the 512-image settings'


# --- settings and context -----------------------------------------------------------------------------
def zoo_context(ckpt_dir=None) -> tuple:
    """The Zoo checkpoints' paths, their digest and the sampling every setting uses."""
    from vvs_engine import zoo
    from vvs_engine.zoo import model_path

    names = ("zoo-gpt", "zoo-vq", "zoo-drafter", "zoo-classifier")
    paths = {n: (os.path.join(ckpt_dir, n + ".safetensors") if ckpt_dir and n != "zoo-classifier"
                 else model_path(n)) for n in names}
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 4.0}
    if hasattr(zoo, "sampling_defaults"):
        sampling.update({k: v for k, v in zoo.sampling_defaults().items() if k in sampling})
    return paths, checkpoint_digest(paths), sampling


def labels_for(num_classes: int, per_class: int) -> list:
    """The labels of a run, class-major: image i has label i // per_class (the committed caches' order)."""
    return [c for c in range(num_classes) for _ in range(per_class)]


def pick(names: str, known, what: str = "setting") -> list:
    """A comma list of names, each one of ``known`` -> the names in order; a one-line VVSError otherwise."""
    from vvs_engine.errors import VVSError

    chosen = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in chosen if n not in known]
    if bad:
        raise VVSError(f"unknown {what}(s) {', '.join(bad)}; known: {', '.join(known)}")
    return chosen


# --- the token cache ---------------------------------------------------------------------------------
def checkpoint_digest(engine_paths: dict) -> str:
    h = hashlib.sha1()
    for k in sorted(engine_paths):
        p = engine_paths[k]
        h.update(k.encode())
        if p and os.path.exists(p):
            with open(p, "rb") as f:
                h.update(hashlib.sha1(f.read()).digest())
    return h.hexdigest()[:16]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def cache_path(folder: str, name: str) -> str:
    return os.path.join(folder, slug(name) + ".npz")


def load_setting(key: str, places) -> tuple:
    """The first complete cache of ``key`` among ``places`` ([(folder, setting name)], searched in order)
    -> (the cached setting with int64 tokens and float64 forwards, its per-batch row statistics or None),
    or (None, None)."""
    for folder, name in places:
        gen = load_cache(cache_path(folder, name), digest_of(key))
        if gen is None:
            continue
        gen["tokens"], gen["forwards"] = gen["tokens"].astype(np.int64), gen["forwards"].astype(np.float64)
        rows, path = None, os.path.join(folder, slug(name) + ".rows.json")
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            rows = saved["batches"] if saved.get("key") == key else None
        return gen, rows
    return None, None


def cached(folder: str, name: str, key: str):
    """The complete cache of ``key`` at ``folder``/``name`` (int64 tokens, float64 forwards), or None."""
    return load_setting(key, [(folder, name)])[0]


def setting_key(ckpt_key: str, method: str, opts: dict, sampling: dict, labels, seed: int, batch_size: int,
                device: str = "cpu", dtype: str = "fp32") -> str:
    """What a setting's tokens are a function of, as canonical JSON. The method's *effective* options
    (defaults filled in) go in, so a changed default invalidates the cache too. Batch size, device and
    dtype are part of it: in fp32 a sampled method's tokens can depend on the batch shape, and other
    devices round differently."""
    from vvs_engine.methods import resolve_options

    effective = resolve_options(method, opts)
    if method == "zipar":  # PJD's options, where they leave ZipAR's tokens as before, stay out of the key
        from vvs_engine.methods.zipar import PJD_OPTION_DEFAULTS

        effective = {k: v for k, v in effective.items() if k not in PJD_OPTION_DEFAULTS or PJD_OPTION_DEFAULTS[k] != v}
    extra = {}
    if method == "vvs" and effective.get("skip_policy") == "dynamic":
        # VVS-D decides skips per sequence since the one loop (it decided per batch before): new tokens
        extra["skip_decision"] = "per-sequence"
    return json.dumps({**extra, "checkpoints": ckpt_key, "method": method, "options": effective, "sampling": sampling,
                       "labels": list(labels), "seed": seed, "batch_size": batch_size, "rng": "counter-rng",
                       "device": torch.device(device).type, "dtype": dtype}, sort_keys=True, default=str)


def digest_of(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def save_npz(path: str, **arrays) -> None:
    """Atomic write: an interrupted save never leaves a truncated cache file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_cache(path: str, digest: str):
    """The cached setting at ``path`` if it is complete and its digest matches, else None."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as z:
            if str(z["digest"]) != digest:
                return None
            return {k: (z[k] if z[k].shape else z[k].item()) for k in z.files}
    except Exception:  # an unreadable file is regenerated, never trusted
        return None


def code_revision() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def machine_id(device) -> str:
    """What the tokens depend on beyond the code and the settings: in fp32 the CPU's model and vector unit
    (its BLAS and vectorised kernels round differently) or the GPU's name. Seen here: the same code and
    settings reproduce 14 of 16 sampled AR images on an AMD EPYC with AVX-512 that were made on another
    machine; on the same machine, 16 of 16."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def generate_setting(eng, name, method, opts, labels, seed, sampling, batch_size=16, cache=None, key="",
                     show=True, ops=True, batch_stats=(), tag="quality_speed") -> dict:
    """Tokens of one setting -> {"tokens": [n, T] int64, "forwards": [n], "ops_per_token", ...};
    loaded from ``cache`` (an .npz path) when it holds the same digest. Batch k is images
    [k*batch_size, (k+1)*batch_size); after each batch the tokens so far go to ``<cache>.partial.npz``,
    so an interrupted run resumes at the next batch. ``batch_stats``: stats keys kept per batch in
    ``<cache minus .npz>.rows.json`` ({"key", "batches"}; the cache itself keeps tokens and forwards only),
    resumed with the tokens from ``<cache>.rows.partial.json``."""
    digest = digest_of(key)
    if cache:
        done = load_cache(cache, digest)
        if done is not None:
            done["tokens"] = done["tokens"].astype(np.int64)
            done["forwards"] = done["forwards"].astype(np.float64)
            return done
    partial = cache[: -len(".npz")] + ".partial.npz" if cache else None
    partial_rows = cache + ".rows.partial.json" if cache and batch_stats else None
    toks, fwd, seconds, batches = [], [], 0.0, []
    if partial:
        prev = load_cache(partial, digest)
        if prev is not None:
            toks, fwd, seconds = [prev["tokens"].astype(np.int64)], list(prev["forwards"]), float(prev["gen_seconds"])
    if partial_rows and os.path.exists(partial_rows):
        with open(partial_rows) as f:
            saved = json.load(f)
        batches = saved["batches"] if saved.get("key") == key else []
    n_done = sum(len(t) for t in toks)
    n = len(labels)
    for start in range(n_done, n, batch_size):
        chunk = list(range(start, min(start + batch_size, n)))
        t0 = time.time()
        # image i's random numbers come from (seed, i): batch-invariant, paired across settings
        out = eng.generate(class_labels=[labels[i] for i in chunk], method=method, seed=seed,
                           image_indices=chunk, batch_size=batch_size, decode_images=False, **sampling, **opts)
        seconds += time.time() - t0
        toks.append(out.tokens.numpy())
        fwd += list(out.stats["per_image"]["target_forward_passes"])
        done = chunk[-1] + 1
        if partial_rows:  # the row statistics follow the resumable token cache batch by batch
            batches.append({k: out.stats.get(k) for k in batch_stats})
            with open(partial_rows, "w") as f:
                json.dump({"key": key, "batches": batches}, f)
        if partial:
            save_npz(partial, tokens=np.concatenate(toks).astype(np.int16), forwards=np.asarray(fwd, np.float64),
                     digest=digest, key=key, gen_seconds=seconds)
        if show:
            rate = (done - n_done) / max(seconds - (float(prev["gen_seconds"]) if n_done else 0.0), 1e-9)
            eta = (n - done) / max(rate, 1e-9)
            print(f"[{tag}] {name}: {done}/{n} images, {rate:.3f} images/s, about {eta / 60:.0f} min left",
                  flush=True)
    res = {"tokens": np.concatenate(toks).astype(np.int64), "forwards": np.asarray(fwd, dtype=np.float64),
           "gen_seconds": seconds, "images_per_second": n / max(seconds, 1e-9),
           "ops_per_token": ops_per_token(eng, method, opts, labels[0], seed, sampling) if ops else -1.0,
           "threads": torch.get_num_threads(), "batch_size": batch_size, "torch": torch.__version__,
           "device": str(eng.device), "machine": machine_id(eng.device), "revision": code_revision(),
           "date": datetime.date.today().isoformat(), "digest": digest, "key": key}
    if cache:
        save_npz(cache, **{k: (v.astype(np.int16) if k == "tokens" else v) for k, v in res.items()})
        if partial and os.path.exists(partial):
            os.remove(partial)
        if partial_rows:
            with open(cache[: -len(".npz")] + ".rows.json", "w") as f:
                json.dump({"key": key, "batches": batches}, f)
            if os.path.exists(partial_rows):
                os.remove(partial_rows)
    return res


def ops_per_token(eng, method, opts, label, seed, sampling) -> float:
    from vvs_engine.measure.opcount import OpCounter

    with OpCounter() as c:
        eng.generate(class_labels=[label], method=method, seed=seed, decode_images=False, **sampling, **opts)
    return c.compute / eng.tokens_per_image


def verify_cache(eng, gen: dict, name, method, opts, labels, seed, sampling, batch_size, n_batches=1) -> tuple:
    """Regenerate the first ``n_batches`` batches of a cached setting exactly as the run made them
    (same labels, image indices and batch shape) -> (images compared, images that differ)."""
    n = min(len(labels), n_batches * batch_size)
    differ = 0
    for start in range(0, n, batch_size):
        chunk = list(range(start, min(start + batch_size, n)))
        out = eng.generate(class_labels=[labels[i] for i in chunk], method=method, seed=seed, image_indices=chunk,
                           batch_size=batch_size, decode_images=False, **sampling, **opts)
        differ += int((out.tokens.numpy() != gen["tokens"][chunk]).any(1).sum())
    return n, differ


# --- statistics (pure numpy; the tests check them on synthetic data) ------------------------------
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
    return summarise(value, boot, ar), boot


def summarise(value: float, boot: np.ndarray, ar=None) -> dict:
    """A metric's value and interval; with AR's (value, draws) also the paired difference."""
    out = {"value": float(value), "ci": interval(boot)}
    if ar is not None:
        out["diff"] = float(value) - ar[0]
        out["diff_ci"] = interval(np.asarray(boot) - ar[1])
    return out


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


# --- metrics ----------------------------------------------------------------------------------------
def image_features(eng, tokens, labels, inception: bool) -> dict:
    """Per-image quantities every metric is computed from (so bootstrap draws need no new images)."""
    from vvs_engine.evaluation.quality import classifier_features, classifier_input, get_inception, load_classifier

    images = eng.decode_images(torch.as_tensor(tokens))
    x = classifier_input(images)  # the classifier and the reference crops are 64 x 64 (zoo-gpt-32's 128 px resized)
    net = load_classifier()
    with torch.no_grad():
        pred = net(x).argmax(-1).numpy()
    out = {"correct": (pred == np.asarray(labels)).astype(np.float64), "cls": classifier_features(x, net)}
    if inception:
        out["inc"] = get_inception()(x)
    return out


class ReferenceSet:
    """Metrics against one fixed reference feature set, fast enough for 1000 bootstrap draws.

    FD: with X the centred [n, D] sample features, tr((S S_r)^(1/2)) is the sum of the square roots
    of the eigenvalues of the n x n matrix X S_r X^T / (n - 1) (the same non-zero spectrum as
    S_r^(1/2) S S_r^(1/2)), so a draw costs one n x n eigendecomposition instead of two D x D ones
    (D = 2048 for Inception): the same value as :func:`vvs_engine.evaluation.quality.frechet_distance`
    (checked in the tests), about 30x faster. Precision/recall: the distances are computed once per
    setting and each draw only indexes them (a resample's repeated images have distance 0 to each other,
    exactly as in ``precision_recall`` on the resampled set)."""

    def __init__(self, ref, k: int = 3):
        self.ref = np.asarray(ref, dtype=np.float64)
        self.mu = self.ref.mean(0)
        self.cov = np.cov(self.ref, rowvar=False)
        self.trace = float(np.trace(self.cov))
        self.k = k
        r = torch.as_tensor(self.ref)
        self.ref_radii = torch.cdist(r, r).kthvalue(k + 1, dim=1).values  # [n_ref]

    def fd(self, feats) -> float:
        f = np.asarray(feats, dtype=np.float64)
        n = f.shape[0]
        x = f - f.mean(0)
        gram = x @ self.cov @ x.T / (n - 1)
        tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((gram + gram.T) / 2), 0, None)).sum()
        d = float(((f.mean(0) - self.mu) ** 2).sum() + (x * x).sum() / (n - 1) + self.trace - 2 * tr_covmean)
        return max(d, 0.0)

    def precision_recall_draws(self, feats, draws: np.ndarray) -> tuple:
        """(precision, recall) of the full set and of every draw (rows of image indices)."""
        f = torch.as_tensor(np.asarray(feats, dtype=np.float64))
        r = torch.as_tensor(self.ref)
        inside_ref = (torch.cdist(f, r) <= self.ref_radii[None]).any(1).double()  # fake image in the real manifold
        d_ff, d_rf = torch.cdist(f, f), torch.cdist(r, f)

        def one(i):
            i = torch.as_tensor(i)
            radii = d_ff[i][:, i].kthvalue(self.k + 1, dim=1).values
            recall = float((d_rf[:, i] <= radii[None]).any(1).double().mean())
            return float(inside_ref[i].mean()), recall

        full = one(np.arange(f.shape[0]))
        per = np.array([one(i) for i in draws])
        return full, per


def metric_draws(feats, forwards, tokens_per_image, ref, idx, inception_reps=None, pr_k=3) -> dict:
    """Every metric's value and bootstrap draws -> {name: (value, draws)}; intervals and paired
    differences are made from these by :func:`summarise`. ``ref``: {"cls": features or ReferenceSet,
    "inc": ...} of the held-out reference crops."""
    ref = {k: (v if isinstance(v, ReferenceSet) else ReferenceSet(v, pr_k)) for k, v in ref.items()}
    all_images = np.arange(idx.shape[1])
    draws = {}

    def add(name, stat, reps):
        draws[name] = (float(stat(all_images)), np.array([stat(i) for i in reps]))

    add("class_accuracy", lambda i: feats["correct"][i].mean(), idx)
    add("fd_classifier", lambda i: ref["cls"].fd(feats["cls"][i]), idx)
    add("tpf", lambda i: len(i) * tokens_per_image / forwards[i].sum(), idx)
    if "inc" in feats and "inc" in ref:
        reps = idx[:inception_reps] if inception_reps else idx
        add("fid_inception", lambda i: ref["inc"].fd(feats["inc"][i]), reps)
        full, per = ref["inc"].precision_recall_draws(feats["inc"], reps)
        draws["precision"], draws["recall"] = (full[0], per[:, 0]), (full[1], per[:, 1])
    return draws


def setting_metrics(feats, forwards, tokens_per_image, ref, idx, inception_reps=None, ar=None, pr_k=3) -> tuple:
    """Every metric with its interval -> (metrics, draws). With ``ar`` (AR's draws from an earlier
    call on the same ``idx``) each metric also gets the paired difference to AR."""
    draws = metric_draws(feats, forwards, tokens_per_image, ref, idx, inception_reps, pr_k)
    out = {name: summarise(v, b, ar.get(name) if ar is not None else None) for name, (v, b) in draws.items()}
    return out, draws


class WorkCache:
    """Per-image features and bootstrap draws of a setting, keyed by its tokens and everything the
    metrics depend on (git-ignored: rebuilt from the committed tokens when missing)."""

    def __init__(self, folder):
        self.folder = folder

    def _path(self, kind, parts) -> str:
        h = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
        return os.path.join(self.folder, f"{kind}_{h}.npz")

    def get(self, kind, parts, make):
        if self.folder is None:
            return make()
        path = self._path(kind, parts)
        if os.path.exists(path):
            try:
                with np.load(path, allow_pickle=False) as z:
                    return _unflatten(z)
            except Exception:
                pass
        value = make()
        save_npz(path, **_flatten(value))
        return value


def _flatten(d: dict) -> dict:
    """{name: array | (value, draws)} -> flat npz arrays."""
    out = {}
    for k, v in d.items():
        if isinstance(v, tuple):
            out[f"{k}__value"], out[f"{k}__draws"] = np.asarray(v[0]), np.asarray(v[1])
        else:
            out[k] = np.asarray(v)
    return out


def _unflatten(z) -> dict:
    out = {}
    for k in z.files:
        if k.endswith("__value"):
            name = k[: -len("__value")]
            out[name] = (float(z[k]), z[name + "__draws"])
        elif not k.endswith("__draws"):
            out[k] = z[k]
    return out


def setting_draws(eng, work, name, gen, labels, ref, idx, seed, inception=False, inception_reps=None) -> tuple:
    """A cached setting's per-image features and every metric's (value, bootstrap draws) on the draws
    ``idx``, through the work cache -> (tokens' digest, features, draws)."""
    tokens, forwards = gen["tokens"].astype(np.int64), gen["forwards"].astype(np.float64)
    digest = hashlib.sha1(np.ascontiguousarray(tokens).tobytes()).hexdigest()

    def features():
        # minutes per setting on a CPU (VQ decode + classifier + Inception): say what is running
        print(f"[harness] {name}: image features of {len(labels)} images", flush=True)
        return image_features(eng, tokens, labels, inception)

    feats = work.get("features", [digest, list(labels), inception], features)
    draws = work.get("draws", [digest, forwards.tolist(), idx.shape[0], inception_reps, seed, inception],
                     lambda: metric_draws(feats, forwards, eng.tokens_per_image, ref, idx, inception_reps))
    return digest, feats, draws


# --- the sampling gap D (vvs_engine.evaluation.divergence): committed per tokens folder ---------------
GAP_FILE = "sampling_gap.json"  # in a tokens folder: {setting slug: D's summary and what it is a function of}


def gap_of(eng, name, tokens, labels, sampling, ckpt_key, cache_dir, batch_size=16, log=print, compute=True):
    """D of a setting's tokens under the target at the shared ``sampling`` (a control's own sampling is not
    used: D measures it against the target's distribution) -> its summary (``summarise_gap``). Kept in
    ``<cache_dir>/sampling_gap.json`` keyed by the tokens' digest, the target and the sampling (minutes of CPU
    for a whole table: one teacher-forced forward per image)."""
    from vvs_engine.evaluation.divergence import sampling_gap_per_image, summarise_gap

    tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    key = {"tokens": hashlib.sha1(tokens.tobytes()).hexdigest(), "labels": hashlib.sha1(
        json.dumps([int(x) for x in labels]).encode()).hexdigest(), "target": ckpt_key,
        "sampling": {k: sampling[k] for k in sorted(sampling)}}
    path = os.path.join(cache_dir, GAP_FILE) if cache_dir else None
    table = {}
    if path and os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    entry = slug(name)
    if entry in table and table[entry].get("key") == key:
        got = table[entry]
        return {k: (tuple(v) if k == "ci" else v) for k, v in got["summary"].items()}
    if not compute:
        return None
    t0 = time.time()
    per_image = sampling_gap_per_image(eng, tokens, labels, batch_size=batch_size, **sampling)
    summary = summarise_gap(per_image)
    if log:
        log(f"[quality_speed] {name}: D = {summary['value']:+.4f} ± {summary['half_width']:.4f} "
            f"({time.time() - t0:.0f} s)")
    if path:
        if os.path.exists(path):  # re-read: another process may have added settings meanwhile
            with open(path) as f:
                table = json.load(f)
        table[entry] = {"name": name, "key": key, "summary": {k: (list(v) if k == "ci" else v)
                                                               for k, v in summary.items()},
                        "sd": float(np.std(per_image, ddof=1)) if len(per_image) > 1 else None}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(sorted(table.items())), f, indent=1)
        os.replace(tmp, path)
    return summary


def gap_sampling(sampling: dict) -> dict:
    """The sampling D is measured under: the target's (temperature, top-k, top-p, CFG) of the shared setting."""
    return {k: sampling[k] for k in ("temperature", "top_k", "top_p", "cfg_scale")}


# --- three levels of fidelity (issue 52), placed by the sampling gap D and the parity rule -------------
NEAR_LOSSLESS_D = 0.025  # nats/token: a tenth of AR sampled at temperature 1.1 (D = +0.25 on the Zoo)
LEVELS = ("exact", "near-lossless", "parity")  # strictest first; a setting at a level is at every looser one
LEVEL_TEXT = {"exact": "exact (exact by construction, and D's 95 % interval holds 0)",
              "near-lossless": f"near-lossless (|D| <= {NEAR_LOSSLESS_D} nats/token and at parity)",
              "parity": "perceptual parity (not detectably worse than AR by the report's parity rule)"}


def exact_by_construction(method: str, opts: dict) -> bool:
    """Whether a setting's method samples the target's distribution exactly by its algorithm: AR, EAGLE's exact
    acceptance, SJD (any window, any initialisation), SCD's coupled SJD, SJD-PAC's exact variant. Not: the
    relaxed rules (LANTERN, LANTERN++, GSD, CASCADE), VVS (a skipped round commits unverified drafts),
    ZipAR and PJD (a row's tokens are drawn before the row above is complete: PJD-E1 is exact per forward, given
    the partial context its forward saw, not against raster AR). Row drafts are exact: ZipAR's rows only draft,
    an SJD verifier commits in raster order (but for the tests' negative control, which commits them untested)."""
    from vvs_engine.methods import resolve_options

    if method in ("ar", "eagle", "sjd", "scd"):
        return True
    if method == "row-drafts":
        return not resolve_options(method, opts).get("row_drafts_untested")
    if method == "sjd-pac":
        return resolve_options(method, opts).get("pac_variant") == "exact"
    return False


def fidelity_level(row: dict):
    """The strictest level a setting reaches on its evidence (None: not even at parity). Without D a setting
    can be placed at parity only."""
    from vvs_engine.evaluation.divergence import reads_exact

    gap = row.get("gap")
    if row["method"] == "ar" and (gap is None or reads_exact(gap)):
        return "exact"
    if gap is not None and exact_by_construction(row["method"], row.get("options", {})) and reads_exact(gap):
        return "exact"
    if gap is not None and abs(gap["value"]) <= NEAR_LOSSLESS_D and row.get("parity"):
        return "near-lossless"
    return "parity" if row.get("parity") else None


def level_fronts(rows: list) -> dict:
    """{level: the settings at that level or a stricter one, fastest (highest TPF) first; AR excluded}."""
    out = {}
    for i, level in enumerate(LEVELS):
        ok = [r for r in rows if "error" not in r and r["method"] != "ar" and r.get("level") in LEVELS[: i + 1]]
        out[level] = sorted(ok, key=lambda r: -r["tpf"]["value"])
    return out


def place_levels(rows: list) -> dict:
    """Marks every row's ``level``; returns {level: name of its fastest setting or None}."""
    for r in rows:
        if "error" not in r:
            r["level"] = fidelity_level(r)
    return {level: (front[0]["name"] if front else None) for level, front in level_fronts(rows).items()}


# --- reports ----------------------------------------------------------------------------------------
def fmt_ci(m, nd):
    if m is None:
        return "–"
    return f"{m['value']:.{nd}f} [{m['ci'][0]:.{nd}f}, {m['ci'][1]:.{nd}f}]"


def fmt_diff(m, nd):
    if m is None or "diff" not in m:
        return "–"
    return f"{m['diff']:+.{nd}f} [{m['diff_ci'][0]:+.{nd}f}, {m['diff_ci'][1]:+.{nd}f}]"


def fmt_gap(r) -> str:
    from vvs_engine.evaluation.divergence import format_gap

    return format_gap(r["gap"]) if r.get("gap") else "–"


def fmt_z(r) -> str:
    return f"{r['gap']['z']:+.1f}" if r.get("gap") else "–"


def levels_markdown(rows: list, controls=(), top: int = 5) -> list:
    """The three frontiers: per level its fastest settings with TPF, D and the parity metrics; then the
    controls that show what D and the parity rule detect."""
    fronts = level_fronts(rows)
    lines = ["## Three levels of fidelity", "",
             "D = mean over an image's tokens of (− log p(token) − entropy of p) under the target's own sampling "
             "distribution p (teacher-forced, CFG and temperature as sampled), in nats per token, averaged over "
             "images with a 95 % interval (± 1.96 standard errors); z = D / standard error. An exact sampler reads "
             "0 whatever its prefix; a mode-seeking one reads negative, an over-dispersed one positive. Levels, "
             "each including the stricter ones: " + "; ".join(LEVEL_TEXT[k] for k in LEVELS) + ".", "",
             "| level | rank | setting | TPF | D (nats/token) | z | Δ acc vs AR | Δ FD vs AR | parity |",
             "|---|---|---|---|---|---|---|---|---|"]
    for level in LEVELS:
        front = fronts[level][:top]
        if not front:
            lines.append(f"| {level} | – | none | – | – | – | – | – | – |")
        for k, r in enumerate(front, 1):
            lines.append(f"| {level if k == 1 else ''} | {k} | {r['name']} | {fmt_ci(r['tpf'], 2)} | {fmt_gap(r)} | {fmt_z(r)} | "
                         f"{fmt_diff(r.get('class_accuracy'), 3)} | {fmt_diff(r.get('fd_classifier'), 2)} | "
                         f"{'yes' if r.get('parity') else 'no'} |")
    no_gap = [r["name"] for r in rows if "error" not in r and not r.get("gap")]
    if no_gap:
        lines += ["", f"D not computed yet for {len(no_gap)} settings (placed at parity at most): {', '.join(no_gap)}."]
    if controls:
        lines += ["", "### Controls: AR sampling a known-wrong distribution", "",
                  "AR's tokens at a changed sampling, D measured against the target's own (the shared sampling). "
                  "Their class accuracy and classifier FD are paired with AR on the same bootstrap draws (no FID: "
                  "the controls' Inception features were not computed). A parity verdict of yes here is the "
                  "perceptual rule's blind spot that D closes.", "",
                  "| control | D (nats/token) | z | class acc | Δ acc vs AR | FD (classifier) | Δ FD vs AR | parity |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in controls:
            lines.append(f"| {r['name']} | {fmt_gap(r)} | {fmt_z(r)} | {fmt_ci(r['class_accuracy'], 3)} | "
                         f"{fmt_diff(r['class_accuracy'], 3)} | {fmt_ci(r['fd_classifier'], 2)} | "
                         f"{fmt_diff(r['fd_classifier'], 2)} | {'yes' if r.get('parity') else 'no'} |")
    return lines + [""]


def provenance(script: str, argv=None, device=None) -> dict:
    """What a table carries: the command that wrote it (the script's path from the repository root, its
    arguments), the UTC date and time, the device (a GPU's name, else "cpu") and torch's version."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return {"command": " ".join(["python", os.path.relpath(os.path.abspath(script), ROOT)]
                                + list(sys.argv[1:] if argv is None else argv)),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def write_report(path: str, res: dict, title: str, header, rows, notes=()) -> str:
    """A measurement's Markdown table at ``path`` (a title, ``res``'s command and date, one line per row)
    and ``res`` as JSON beside it (``.json``) -> the Markdown, also printed."""
    stem = os.path.splitext(path)[0]
    lines = [f"## {title}", "", f"`{res['command']}`  |  {res['date']}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)] + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    md = "\n".join(lines + (["", *notes] if notes else [])) + "\n"
    write_tables(stem, md, res)
    print(md, end="")
    return md


def write_tables(prefix: str, md: str, payload: dict) -> None:
    """A report's ``<prefix>.md`` and ``<prefix>.json``."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    with open(prefix + ".md", "w") as f:
        f.write(md)


def has_block(path: str, begin: str, end: str) -> bool:
    """Whether ``path`` exists and holds ``begin`` ... ``end`` (checked before hours of decoding)."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return begin in text and end in text[text.index(begin):]


def replace_block(path: str, begin: str, end: str, block: str) -> None:
    """Replace the text of ``path`` from the first ``begin`` through the next ``end`` (markers included)
    by ``block``, which carries its own markers; a one-line VVSError when they are missing."""
    from vvs_engine.errors import VVSError

    if not has_block(path, begin, end):
        raise VVSError(f"{path} has no {begin} ... {end} block")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i = text.index(begin)
    j = text.index(end, i) + len(end)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:i] + block + text[j:])
