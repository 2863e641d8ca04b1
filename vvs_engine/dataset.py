"""Dataset-scale generation: many images, written as shards, in one process or on a Ray cluster.

    from vvs_engine import dataset
    dataset.generate("out/c2i", class_labels=dataset.parse_label_ranges("0-15"), per_condition=4, method="vvs")

Shard k holds images [k*S, (k+1)*S) of the job (S = ``shard_size``), whoever generates it, and a shard
is one queue of the decode loop: B = ``batch_size`` images in flight, a finished image's rows going to
the shard's next image between rounds (continuous batching; ``static_batches=True``: batch j is images
[j*B, (j+1)*B), S a multiple of B). The schedule is a function of the shard alone, so every image is
decoded with the same batch-mates whatever the number of workers: runs write the same files, byte for
byte (the shard size is part of the job's identity: in fp32 other batch-mates can flip a near-tie). The output folder holds ``manifest.json``, ``shard-NNNNN.npz`` (tokens, index, labels,
prompt ids, per-image forward passes; no times, which go to the manifest) and one PNG per image named by
its global index. A shard is written to temporary files and renamed into place, so the folder only ever
holds complete shards; a re-run skips them.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import re
import sys
import time
import zipfile
from collections import deque
from typing import Callable, List, Optional, Sequence

import numpy as np

from .errors import VVSError, check
from .stats import merge_stats, plain

MANIFEST = "manifest.json"
FORMAT = "vvs-engine dataset v1"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.npz$")
DEFAULT_SHARD_SIZE = 64
DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_RETRIES = 2
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 ** 2  # the started local cluster only moves tokens and PNG bytes
# The most images one job may hold. The job's plan (one condition per image group, one entry per
# shard) lives in memory; ten million images keep it to a few hundred MB, while a typo such as
# --per-class 1000000000000 would otherwise grow until the machine runs out of memory.
MAX_IMAGES = 10_000_000


# --- conditions ---------------------------------------------------------------------------------
def parse_label_ranges(text: str) -> List[int]:
    """"0-3,7,9-10" -> [0, 1, 2, 3, 7, 9, 10] (ranges inclusive; range checks happen against the model).
    More than ``MAX_IMAGES`` labels in all is an error, counted before any range is expanded."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            check(a <= b, f"empty class range {part!r}")
            check(len(out) + b - a + 1 <= MAX_IMAGES,
                  f"class labels {part} name {b - a + 1} labels; a job holds at most {MAX_IMAGES} images")
            out += range(a, b + 1)
        elif re.fullmatch(r"-?\d+", part):
            check(len(out) < MAX_IMAGES, f"more than {MAX_IMAGES} class labels; a job holds at most {MAX_IMAGES} images")
            out.append(int(part))
        else:
            raise VVSError(f"class labels must be integers or ranges like 0-999, got {part!r}")
    return out


def read_labels_file(path: str) -> List[int]:
    """A text file of class labels: integers or ranges, separated by commas, spaces or new lines."""
    text = _read_text(path, "labels")
    parts = [p for p in re.split(r"[\s,]+", text) if p]
    check(bool(parts), f"labels file {path} holds no labels")
    return parse_label_ranges(",".join(parts))


def read_prompt_file(path: str) -> tuple:
    """-> (prompt ids, prompts). COCO captions JSON (a list of captions, or ``{"annotations": [{"id",
    "caption"}]}``), a TSV with a ``Prompt`` column (PartiPrompts), or a text file of one prompt per line.
    Ids are the COCO annotation ids where given, else the 0-based position in the file."""
    text = _read_text(path, "prompts")
    low = path.lower()
    if low.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise VVSError(f"prompts file {path} is not valid JSON: {e.msg} (line {e.lineno})") from None
        if isinstance(data, dict) and isinstance(data.get("annotations"), list):
            ann = data["annotations"]
            check(all(isinstance(a, dict) and isinstance(a.get("caption"), str) for a in ann),
                  f"prompts file {path}: every annotation needs a 'caption' string")
            ids = [int(a["id"]) if isinstance(a.get("id"), int) else i for i, a in enumerate(ann)]
            prompts = [a["caption"].strip() for a in ann]
        elif isinstance(data, list) and all(isinstance(x, str) for x in data):
            ids, prompts = list(range(len(data))), [x.strip() for x in data]
        else:
            raise VVSError(f"prompts file {path}: expected a JSON list of captions or COCO 'annotations'")
    elif low.endswith(".tsv"):
        rows = list(csv.reader(io.StringIO(text), delimiter="\t"))
        check(bool(rows) and "Prompt" in rows[0], f"prompts file {path}: a TSV needs a 'Prompt' header column")
        col = rows[0].index("Prompt")
        body = [r for r in rows[1:] if len(r) > col]
        ids, prompts = list(range(len(body))), [r[col].strip() for r in body]
    else:
        lines = [line.strip() for line in text.splitlines()]
        ids = [i for i, line in enumerate(lines) if line]
        prompts = [lines[i] for i in ids]
    check(len(prompts) > 0 and all(prompts), f"prompts file {path} holds no prompts (or an empty one)")
    return ids, prompts


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise VVSError(f"cannot read {what} file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise VVSError(f"{what} file {path} is not UTF-8 text") from None


# --- workers ------------------------------------------------------------------------------------
def load_engine(model: dict, threads: Optional[int] = None):
    """The engine of one worker. ``model`` holds ``Engine.load`` arguments; device ``auto`` picks the
    worker's GPU (Ray sets CUDA_VISIBLE_DEVICES) when there is one. ``threads``: torch's CPU threads
    (None: the engine's default)."""
    from .engine import Engine

    spec = {k: v for k, v in model.items() if v is not None}
    spec["device"] = worker_device(spec.get("device", "auto"))
    return Engine.load(threads=threads, **spec)


def worker_device(device: Optional[str]) -> str:
    """A worker's device: ``auto`` (or None) is its GPU when it sees one, else the CPU."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class ShardWorker:
    """One engine; generates whole shards. Used in-process, or as a Ray actor (one per GPU / CPU slot)."""

    def __init__(self, model: dict, threads: Optional[int] = None, engine_factory: Optional[Callable] = None):
        from .threads import apply_threads

        if engine_factory is None:
            self.engine = load_engine(model, threads)
        else:  # a test's engine: the thread count is still this worker's
            self.engine = engine_factory(model)
            apply_threads(threads)

    def device(self) -> str:
        return str(self.engine.device)

    def run_shard(self, indices: Sequence[int], labels, prompts, job: dict, on_batch=None) -> dict:
        """-> tokens [n, T], the PNGs as bytes, the stats of the shard's decode (a list of one). The shard
        is one call of the decode loop: ``batch_size`` images in flight (continuous batching) or, with
        ``static_batches``, static batches of the job's global batches (the shard starts at a multiple of
        the batch size). ``on_batch(k)``: k more images finished."""
        bs = job["batch_size"]
        static = bool(job.get("static_batches", False))
        check(not static or indices[0] % bs == 0,
              f"shard starting at image {indices[0]} is not aligned to batches of {bs}")
        out = self.engine.generate(class_labels=None if labels is None else list(labels),
                                   prompts=None if prompts is None else list(prompts),
                                   method=job["method"], seed=job["seed"], image_indices=list(indices),
                                   decode_images=job["decode_images"], progress=False, batch_size=bs,
                                   static_batches=static, compile=job.get("compile"), on_images=on_batch,
                                   **job["sampling"], **job["options"])
        pngs = []
        for img in out.images:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            pngs.append(buf.getvalue())
        return {"tokens": out.tokens.numpy().astype(np.int64), "pngs": pngs, "stats": [out.stats],
                "device": self.device()}


# --- the output folder --------------------------------------------------------------------------
def shard_path(out_dir: str, k: int) -> str:
    return os.path.join(out_dir, f"shard-{k:05d}.npz")


def png_name(i: int, n_images: int) -> str:
    return f"{i:0{max(6, len(str(n_images - 1)))}d}.png"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_checksums(model: dict) -> dict:
    """sha256 of every checkpoint file the job loads (the Zoo files when no target is given; every file
    of a ``model_dir`` folder)."""
    if model.get("model_dir"):
        folder = model["model_dir"]
        check(os.path.isdir(folder), f"model folder not found: {folder}")
        out = {f"model_dir/{name}": file_sha256(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
               if os.path.isfile(os.path.join(folder, name))}
        if model.get("drafter"):
            check(os.path.isfile(model["drafter"]), f"drafter checkpoint not found: {model['drafter']}")
            out["drafter"] = file_sha256(model["drafter"])
        return out
    files = {"gpt": model.get("gpt_ckpt"), "vq": model.get("vq_ckpt"), "drafter": model.get("drafter")}
    if files["gpt"] is None:
        from . import zoo

        paths = zoo.default_paths()
        files = {"gpt": paths["gpt"], "vq": files["vq"] or paths["vq"], "drafter": files["drafter"] or paths.get("drafter")}
    out = {}
    for kind, path in files.items():
        if path:
            check(os.path.isfile(path), f"checkpoint not found: {path}")
            out[kind] = file_sha256(path)
    return out


UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)  # what a truncated or foreign .npz raises


def shard_complete(out_dir: str, k: int, indices: range) -> bool:
    """The shard file exists, reads, and holds exactly these images (anything else is redone)."""
    try:
        with np.load(shard_path(out_dir, k), allow_pickle=False) as z:
            return np.array_equal(z["index"], np.arange(indices.start, indices.stop)) and "tokens" in z.files
    except UNREADABLE:
        return False


def load_shard(path: str, keys: Sequence[str]) -> dict:
    """The arrays ``keys`` (those present) of a shard file; an unreadable file is a one-line error naming it."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {key: z[key] for key in keys if key in z.files}
    except UNREADABLE as e:
        raise VVSError(f"{path} is unreadable ({type(e).__name__}: truncated or not a shard); re-run the same "
                       f"generate-dataset command to redo it") from None


# The zip entries' date: np.savez stamps the current time, so two identical runs would differ byte for byte.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def save_npz_reproducible(f, arrays: dict) -> None:
    """``np.savez`` (uncompressed, the same reader) with fixed entry dates: equal arrays give equal bytes."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(key + ".npy", date_time=ZIP_DATE)
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)


# Stats that describe the run, not the tokens (times; what the engine's persistent core had to build, which
# depends on what ran before in the process): kept out of the shard files (identical runs give identical
# files) and recorded per shard in the manifest's run entry instead.
TIME_STATS = ("wall_time_s", "round_seconds", "graph_captures", "compiles")


def write_shard(out_dir: str, k: int, indices: range, labels, prompt_ids, prompts, result: dict, n_images: int):
    """PNGs first, the shard file last, each via a temporary file and a rename: a shard file exists only
    when its images do. On any interruption this shard's files are removed again."""
    written, tmp = [], None
    try:
        for i, data in zip(indices, result["pngs"]):
            path = os.path.join(out_dir, png_name(i, n_images))
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            written.append(path)
        per_image = {}
        for s in result["stats"]:
            for key, vals in (s.get("per_image") or {}).items():
                per_image.setdefault(key, []).extend(vals)
        merged = _merge([_without(s, ("per_image",) + TIME_STATS) for s in result["stats"]])
        arrays = {"tokens": result["tokens"], "index": np.arange(indices.start, indices.stop, dtype=np.int64),
                  "labels": np.asarray(labels if labels is not None else [-1] * len(indices), dtype=np.int64),
                  "stats": np.asarray(json.dumps(plain(merged), sort_keys=True)),
                  "device": np.asarray(result.get("device", ""))}
        if prompts is not None:
            arrays["prompt_ids"] = np.asarray(prompt_ids, dtype=np.int64)
            arrays["prompts"] = np.asarray(prompts, dtype=np.str_)
        for key, vals in per_image.items():
            if len(vals) == len(indices):
                arrays[key] = np.asarray(vals)
        path = shard_path(out_dir, k)
        tmp = os.path.join(out_dir, f".shard-{k:05d}.npz.tmp")
        with open(tmp, "wb") as f:
            save_npz_reproducible(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        for p in written + ([tmp] if tmp else []):
            if os.path.exists(p):
                os.remove(p)
        raise


def clean_tmp(out_dir: str) -> None:
    """Remove temporary files (left by a run that was killed while writing)."""
    for name in os.listdir(out_dir):
        if name.endswith(".tmp"):
            os.remove(os.path.join(out_dir, name))


def _stray_pngs(out_dir: str, shard_size: int, done: set) -> List[str]:
    return [n for n in os.listdir(out_dir) if re.fullmatch(r"\d+\.png", n) and int(n[:-4]) // shard_size not in done]


def read_manifest(out_dir: str) -> Optional[dict]:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, json.JSONDecodeError):
        raise VVSError(f"{path} is not a readable dataset manifest") from None
    check(isinstance(m, dict) and m.get("format") == FORMAT, f"{path} is not a vvs-engine dataset manifest")
    return m


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(plain(obj), f, indent=2)
    os.replace(tmp, path)


def is_dataset_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def read_dataset(path: str, require_complete: bool = True) -> dict:
    """The complete shards of a dataset folder, concatenated in image order: tokens, index, labels,
    prompt_ids (t2i), the PNG paths, the manifest, and ``missing`` (the names of shards that are absent
    or unreadable: a run that was interrupted or a truncated file). ``require_complete``: a missing or
    unreadable shard is an error (naming it) instead."""
    m = read_manifest(path)
    check(m is not None, f"{path} has no {MANIFEST}")
    n, size = m["n_images"], m["shard_size"]
    parts, missing = {}, []
    for k in range((n + size - 1) // size):
        p = shard_path(path, k)
        rng = range(k * size, min(n, (k + 1) * size))
        if not os.path.exists(p):
            missing.append(os.path.basename(p))
            continue
        if require_complete:
            parts[k] = load_shard(p, ("tokens", "index", "labels", "prompt_ids"))
        elif shard_complete(path, k, rng):
            parts[k] = load_shard(p, ("tokens", "index", "labels", "prompt_ids"))
        else:
            missing.append(os.path.basename(p) + " (unreadable)")
    check(not (require_complete and missing), f"{path}: {len(missing)} shard(s) missing; re-run the same command "
                                              f"to finish")
    check(bool(parts), f"{path} holds no complete shard ({len(missing)} missing or unreadable); re-run the "
                       f"generate-dataset command that made it")
    out = {key: np.concatenate([parts[k][key] for k in sorted(parts)]) for key in parts[min(parts)]}
    out["pngs"] = [os.path.join(path, png_name(int(i), n)) for i in out["index"]]
    out["manifest"] = m
    out["missing"] = missing
    return out


# --- the job ------------------------------------------------------------------------------------
def generate(out_dir: str, class_labels: Optional[Sequence[int]] = None, prompts: Optional[Sequence[str]] = None,
             prompt_ids: Optional[Sequence[int]] = None, per_condition: int = 1, method: str = "ar",
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, cfg_scale: float = 4.0, seed: int = 0,
             shard_size: int = DEFAULT_SHARD_SIZE, batch_size: int = DEFAULT_BATCH_SIZE, decode_images: bool = True,
             model: Optional[dict] = None, ray: Optional[str] = None, workers: Optional[int] = None,
             threads: Optional[int] = None, gpus_per_worker: Optional[float] = None,
             max_retries: int = DEFAULT_MAX_RETRIES, progress: bool = True, command: Optional[List[str]] = None,
             engine_factory: Optional[Callable] = None, compile: Optional[bool] = None, static_batches: bool = False,
             **method_opts) -> dict:
    """Generate ``per_condition`` images for each label (or prompt) into ``out_dir`` as shards; returns
    the job's merged stats. ``model``: ``Engine.load`` arguments (default: the Zoo). ``ray``: None (this
    process), ``"local"`` (start a local Ray cluster of ``workers`` workers), ``"auto"`` or an address
    (connect; one worker per GPU, else per ``threads`` CPUs). Finished shards in ``out_dir`` are kept.
    ``compile``: ``Engine.generate``'s (compiled decode rounds; the same tokens, so not part of the
    dataset's identity). Each shard is one queue of ``batch_size`` images in flight (continuous
    batching); ``static_batches=True`` decodes the job's global batches of ``batch_size`` instead."""
    from . import __version__
    from .methods import resolve_options
    from .sampling import SamplingParams

    t_start = time.perf_counter()
    check(class_labels is None or prompts is None, "give either class labels or prompts, not both")
    check(class_labels is not None or prompts is not None, "give class labels or prompts")
    if isinstance(class_labels, str):  # "0-15,20": the CLI's range syntax
        class_labels = parse_label_ranges(class_labels)
    if class_labels is not None:
        class_labels = _integer_list(class_labels, "class labels")
    if prompts is not None:
        check(not isinstance(prompts, str) and all(isinstance(x, str) for x in prompts),
              "prompts must be a list of strings (one condition each)")
    if batch_size == "auto":
        batch_size = auto_batch_size(out_dir, dict(model or {}), ray, method, method_opts, cfg_scale,
                                     len(class_labels if class_labels is not None else prompts or []) * per_condition)
    for name, v, lo in (("per-class", per_condition, 1), ("shard size", shard_size, 1), ("batch size", batch_size, 1),
                        ("max retries", max_retries, 0)):
        check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{name} must be an integer >= {lo}, got {v!r}")
    n_conditions = len(class_labels if class_labels is not None else prompts)
    check(n_conditions * per_condition <= MAX_IMAGES,
          f"{n_conditions} conditions x per-class {per_condition} = {n_conditions * per_condition} images; a job "
          f"holds at most {MAX_IMAGES} images (split it over several output folders)")
    # Static batches: batch j is images [j*B, (j+1)*B) of the job; a shard of whole batches never splits
    # one, so the shard size and the number of workers cannot change an image's batch-mates.
    if static_batches and shard_size % batch_size:
        # the nearest multiples of the batch size either side (only the upper one below one batch)
        nearest = sorted({max(batch_size, shard_size // batch_size * batch_size), -(-shard_size // batch_size) * batch_size})
        raise VVSError(f"shard size {shard_size} must be a multiple of the batch size {batch_size} (a decode batch "
                       f"never spans two shards); e.g. shard size {' or '.join(map(str, nearest))}")
    from .engine import check_seed

    check_seed(seed)  # an integer that fits in 64 bits, as Engine.generate requires (checked before any worker)
    check(workers is None or (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1),
          f"workers must be >= 1, got {workers!r}")
    check(workers is None or ray is not None, "workers are Ray workers: give ray (--ray) too, or leave workers out "
                                              "(one process runs one engine)")
    check(gpus_per_worker is None or ray is not None, "gpus-per-worker needs ray (--ray)")
    check(threads is None or (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1),
          f"threads must be >= 1, got {threads!r}")
    params = SamplingParams(temperature, top_k, top_p, cfg_scale).validate()
    options = resolve_options(method, method_opts)
    if options.get("accept") is not None:  # otherwise an unknown rule fails in each worker, after loading
        from .acceptance.registry import check_rule_name

        check_rule_name(options["accept"])
    model = {k: v for k, v in dict(model or {}).items() if v is not None}
    model.setdefault("device", "auto")
    model.setdefault("dtype", "fp32")
    if model.get("quantize") not in (None, "none"):  # refused before any worker loads (int4 off CUDA, fp64, ...)
        from .engine import resolve_dtype
        from .models.quantize import check_quantize

        check_quantize(model["quantize"], worker_device(model["device"]), resolve_dtype(model["dtype"]))
    check_conditions(model, class_labels, prompts)

    conds = list(class_labels if class_labels is not None else prompts)
    if prompts is not None:
        prompt_ids = list(prompt_ids) if prompt_ids is not None else list(range(len(prompts)))
        check(len(prompt_ids) == len(prompts), "one prompt id per prompt")
    # Image i has condition conds[i // per_condition]: all images of a condition are neighbours.
    n = len(conds) * per_condition
    check(n > 0, "no class labels or prompts given")

    def cond_of(rng):
        c = [conds[i // per_condition] for i in rng]
        ids = None if prompts is None else [prompt_ids[i // per_condition] for i in rng]
        return (c, None, None) if prompts is None else (None, c, ids)

    # batch_size is part of the identity: in fp32/bf16 it can change a sampled token (README).
    identity = {"engine_version": __version__, "method": method, "method_options": options,
                "sampling": params.to_dict(), "seed": seed, "n_images": n, "shard_size": shard_size,
                "batch_size": batch_size, "batching": "static" if static_batches else "continuous",
                "per_condition": per_condition,
                "conditions_sha256": _sha256_json([conds, prompt_ids]),
                "kind": "labels" if prompts is None else "prompts", "dtype": model["dtype"],
                "decode_images": bool(decode_images), "model_checksums": model_checksums(model)}
    for key in ("max_prompt_tokens", "image_size"):
        if key in model:
            identity[key] = model[key]
    if model.get("quantize") not in (None, "none"):  # quantized weights sample other tokens (absent: none)
        identity["quantize"] = model["quantize"]
    check_dataset_folder(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # one run at a time writes a folder: a second would redo the same shards and remove the PNGs the
    # first is writing. The lock is the kernel's (flock): a killed run never leaves it behind.
    with folder_lock(out_dir):
        manifest = read_manifest(out_dir)
        if manifest is not None and not _any_shard(out_dir):
            manifest = None  # an earlier run that failed before its first shard: nothing to keep or to match
        if manifest is not None:
            diff = [k for k in set(identity) | set(manifest["identity"])
                    if plain(manifest["identity"].get(k)) != plain(identity.get(k))]
            check(not diff, f"{out_dir} holds a dataset made with different settings ({', '.join(sorted(diff))}); "
                            f"use another folder or the same options")
        else:
            manifest = {"format": FORMAT, "identity": identity, "n_images": n, "shard_size": shard_size,
                        "n_shards": (n + shard_size - 1) // shard_size, "model": model, "runs": []}
        run_info = {"command": list(command) if command is not None else sys.argv, "started": time.time(),
                    "ray": ray, "batch_size": batch_size, "shards": []}
        manifest["runs"].append(run_info)
        manifest["command"] = manifest["runs"][0]["command"]
        write_json_atomic(os.path.join(out_dir, MANIFEST), manifest)

        n_shards = manifest["n_shards"]
        shards = {k: range(k * shard_size, min((k + 1) * shard_size, n)) for k in range(n_shards)}
        done = {k for k, rng in shards.items() if shard_complete(out_dir, k, rng)}
        clean_tmp(out_dir)
        for name in _stray_pngs(out_dir, shard_size, done):
            os.remove(os.path.join(out_dir, name))
        todo = [k for k in range(n_shards) if k not in done]
        job = {"method": method, "seed": seed, "sampling": params.to_dict(),
               "options": {k: v for k, v in method_opts.items() if v is not None}, "batch_size": batch_size,
               "static_batches": bool(static_batches), "decode_images": bool(decode_images), "compile": compile}

        from tqdm import tqdm

        bar = tqdm(total=n, initial=sum(len(shards[k]) for k in done), unit="img", desc="generate-dataset",
                   disable=not progress, dynamic_ncols=True)
        timing = {"shard_wall_s": [], "shard_decode_s": [], "per_shard": run_info["shards"]}
        try:
            def commit(k, result, t_handed_out):
                """Write shard k, then record its times in the manifest on disk at once: they survive a kill."""
                c, p, ids = cond_of(shards[k])
                write_shard(out_dir, k, shards[k], c, ids, p, result, n)
                timing["per_shard"].append({"shard": k, "device": result.get("device", ""),
                                            "decode_s": sum(s.get("wall_time_s", 0.0) for s in result["stats"])})
                _record_shard(timing, t_handed_out, result)
                run_info["images"] = sum(len(shards[e["shard"]]) for e in run_info["shards"])
                write_json_atomic(os.path.join(out_dir, MANIFEST), manifest)

            if ray is None:
                _run_local(model, threads, engine_factory, shards, todo, cond_of, job, commit, bar, timing)
            else:
                _run_ray(ray, workers, threads, gpus_per_worker, model, engine_factory, shards, todo, cond_of, job,
                         commit, bar, timing, max_retries)
        except BaseException:
            # the shards done so far are kept; the manifest records this run's per-shard times
            run_info.update(interrupted=time.time(), images=sum(len(shards[e["shard"]]) for e in run_info["shards"]))
            write_json_atomic(os.path.join(out_dir, MANIFEST), manifest)
            raise
        finally:
            bar.close()
            clean_tmp(out_dir)

        wall = time.perf_counter() - t_start
        summary = merged_dataset_stats(out_dir, n_shards)
        made = sum(len(shards[k]) for k in todo)
        summary.update(images_this_run=made, shards_this_run=len(todo), shards_skipped=len(done),
                       job_wall_s=wall, images_per_s=made / wall if wall else None, startup_s=timing.get("startup_s"),
                       workers=timing.get("workers"), retries=timing.get("retries", 0),
                       mean_shard_s=float(np.mean(timing["shard_wall_s"])) if todo else None,
                       # per shard, time outside the decode loop: VQ decoding, PNG encoding, hand-off, writing
                       mean_shard_outside_decode_s=float(np.mean(np.subtract(timing["shard_wall_s"],
                                                                             timing["shard_decode_s"]))) if todo else None)
        run_info.update(finished=time.time(), images=made, wall_s=wall)
        manifest["stats"] = summary
        write_json_atomic(os.path.join(out_dir, MANIFEST), manifest)
        return summary


def merged_dataset_stats(out_dir: str, n_shards: int) -> dict:
    """The engine stats of every complete shard, merged (TPF, forward passes, method counters)."""
    stats = []
    for k in range(n_shards):
        p = shard_path(out_dir, k)
        if os.path.exists(p):
            try:
                stats.append(json.loads(str(load_shard(p, ("stats",))["stats"])))
            except (VVSError, KeyError):  # an unreadable shard counts for nothing (a re-run redoes it)
                continue
    out = _merge(stats)
    out.pop("per_image", None)
    return out


def _run_local(model, threads, engine_factory, shards, todo, cond_of, job, commit, bar, timing):
    t0 = time.perf_counter()
    worker = ShardWorker(model, threads, engine_factory)
    timing.update(startup_s=time.perf_counter() - t0, workers=1)
    for k in todo:
        t = time.perf_counter()
        labels, prompts, _ = cond_of(shards[k])
        result = worker.run_shard(list(shards[k]), labels, prompts, job, on_batch=bar.update)
        commit(k, result, t)


def _run_ray(address, workers, threads, gpus_per_worker, model, engine_factory, shards, todo, cond_of, job, commit,
             bar, timing, max_retries):
    try:
        import ray
        from ray.exceptions import RayActorError, RayTaskError
    except ImportError:
        raise VVSError("--ray needs Ray: pip install 'vvs-engine[ray]' (from a checkout: pip install -e \".[ray]\")") \
            from None
    t0 = time.perf_counter()
    threads = threads or 1
    started_here = False
    if not ray.is_initialized():
        if address in (None, "local"):
            ray.init(num_cpus=(workers or os.cpu_count() or 1) * threads, include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        started_here = True
    actors, running = [], {}
    try:
        res = ray.cluster_resources()
        gpus = gpus_per_worker if gpus_per_worker is not None else (1 if res.get("GPU", 0) >= 1 else 0)
        if workers is None:
            workers = int(res.get("GPU", 0) // gpus) if gpus else max(1, int(res.get("CPU", 1) // threads))
        workers = max(1, min(workers, len(todo))) if todo else 0
        remote_cls = ray.remote(ShardWorker).options(num_cpus=threads, num_gpus=gpus, max_restarts=0)

        def new_actor():
            return remote_cls.remote(model, threads, engine_factory)

        actors = [new_actor() for _ in range(workers)]
        if actors:
            ray.get([a.device.remote() for a in actors])  # engines loaded: start-up ends here
        timing.update(startup_s=time.perf_counter() - t0, workers=workers, retries=0)
        pending, idle, tries = deque(todo), list(actors), {k: 0 for k in todo}
        while pending or running:
            while idle and pending:
                a, k = idle.pop(), pending.popleft()
                labels, prompts, _ = cond_of(shards[k])
                running[a.run_shard.remote(list(shards[k]), labels, prompts, job)] = (a, k, time.perf_counter())
            (ref,), _ = ray.wait(list(running), num_returns=1)
            a, k, t = running.pop(ref)
            try:
                result = ray.get(ref)
            except (RayActorError, RayTaskError) as e:
                cause = getattr(e, "cause", None)
                if isinstance(e, RayTaskError) and isinstance(cause, VVSError):
                    raise VVSError(str(cause)) from None
                tries[k] += 1
                timing["retries"] += 1
                if tries[k] > max_retries:
                    raise VVSError(f"shard {k} failed {tries[k]} times; last error: {_first_line(e)}") from None
                pending.appendleft(k)
                if isinstance(e, RayActorError):  # the worker died: replace it
                    ray.kill(a)
                    actors.remove(a)
                    a = new_actor()
                    actors.append(a)
                idle.append(a)
                continue
            commit(k, result, t)
            bar.update(len(shards[k]))
            idle.append(a)
    finally:
        for a in actors:  # killing a worker also ends its running shard
            ray.kill(a)
        if started_here:
            ray.shutdown()


def _record_shard(timing: dict, t_start: float, result: dict) -> None:
    """Shard wall time (hand-out to files written) and the engine's decode-loop time within it."""
    timing["shard_wall_s"].append(time.perf_counter() - t_start)
    timing["shard_decode_s"].append(sum(s.get("wall_time_s", 0.0) for s in result["stats"]))
    if timing["per_shard"]:
        timing["per_shard"][-1]["wall_s"] = timing["shard_wall_s"][-1]


def _integer_list(values, what: str) -> List[int]:
    """Python or numpy integers (a list, an integer array or tensor) -> a list of ints."""
    import numbers

    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    check(isinstance(values, (list, tuple)), f"{what} must be a list of integers, got {type(values).__name__}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    check(not bad, f"{what} must be integers, got {bad[0]!r}" if bad else "")
    return [int(v) for v in values]


def auto_batch_size(out_dir: str, model: dict, ray, method: str, method_opts: dict, cfg_scale: float,
                    n_images: int) -> int:
    """``batch_size="auto"`` (``--batch-size auto``): the most images in flight whose decode state fits the
    worker's device (``engine.rows_that_fit``), picked before any worker loads: the free memory now less the
    checkpoint files' bytes (the weights as stored; at most what they take loaded in the same or a smaller
    dtype, quantized or not). The batch size is part of the dataset's identity, so a resumed job keeps the one
    its first run picked, and one process decides it (not Ray, whose workers may sit on other devices)."""
    from .engine import available_bytes, peek_shape, rows_that_fit
    from .methods import get_method_options

    check(ray is None, "batch size auto is for one process: under Ray give a number (it is part of the "
                       "dataset's identity, the same for every worker)")
    if os.path.isdir(out_dir) and _any_shard(out_dir):
        manifest = read_manifest(out_dir)
        if manifest is not None and isinstance(manifest.get("identity", {}).get("batch_size"), int):
            return manifest["identity"]["batch_size"]  # a resumed job keeps its first run's figure
    project = model.get("model_dir") is None and model.get("image_size") is None
    shape = peek_shape(model.get("gpt_ckpt"), model.get("vq_ckpt")) if project else None
    check(shape is not None, "batch size auto needs a project checkpoint (its config tells the decode state before "
                             "loading): give a number")
    files = [model.get("gpt_ckpt"), model.get("vq_ckpt"), model.get("drafter")]
    if model.get("gpt_ckpt") is None:
        from . import zoo

        paths = zoo.default_paths()
        files = [paths["gpt"], model.get("vq_ckpt") or paths["vq"], model.get("drafter") or paths.get("drafter")]
    device = worker_device(model.get("device"))
    free = available_bytes(device)
    if free is not None:
        free -= sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
    from .engine import resolve_dtype

    return rows_that_fit(shape, get_method_options(method, method_opts), cfg_scale != 1.0, device,
                         resolve_dtype(model.get("dtype", "fp32")), cap=max(1, n_images), free=free,
                         flag="batch size")


def _any_shard(out_dir: str) -> bool:
    return any(SHARD_RE.match(name) for name in os.listdir(out_dir))


GENERATE_FILES = ("tokens.npz", "stats.json")  # what `vvs-engine generate` writes (its PNGs share our names)


@contextlib.contextmanager
def folder_lock(out_dir: str):
    """Hold the dataset folder's lock for the job: another process (or another job of this one) that
    writes the same folder meanwhile is refused in one line. The lock is an ``fcntl.flock`` on the
    folder itself: no lock file to leave behind, and the kernel drops the lock when its holder ends,
    however it ends (kill -9 included), so a lock is never stale. Where fcntl is missing (Windows)
    the folder is not locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise VVSError(f"{out_dir} is being written by another generate-dataset run; wait for it to end, or "
                           f"use another folder") from None
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def check_dataset_folder(out_dir: str) -> None:
    """A dataset folder may be new, empty, or a dataset; a `generate` output folder is refused, because
    a dataset re-run removes PNGs that belong to no finished shard (and theirs have our names)."""
    check(bool(out_dir), "--out is empty: name the dataset folder")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise VVSError(f"--out {out_dir} is a file, not a folder")
    if os.path.isdir(out_dir) and not is_dataset_dir(out_dir):
        found = [f for f in GENERATE_FILES if os.path.exists(os.path.join(out_dir, f))]
        check(not found, f"{out_dir} holds the output of `vvs-engine generate` ({', '.join(found)}): its PNGs would "
                         f"be replaced; use another folder for the dataset")


def check_conditions(model: dict, labels, prompts) -> None:
    """Fail before any worker starts when the conditions cannot fit the model (read from its config)."""
    from .checkpoint import config_path, read_project_config
    from .models.gpt import checked_gpt_config

    if model.get("model_dir"):  # every Hugging Face family is text-conditional
        from .models.hf_loader import read_folder_config

        check(not (model.get("gpt_ckpt") or model.get("vq_ckpt")),
              "--model-dir replaces --gpt-ckpt/--vq-ckpt: give one or the other")
        read_folder_config(model["model_dir"])
        check(labels is None, "this model is text-conditional: pass a prompts file, not class labels")
        return
    path = model.get("gpt_ckpt")
    if path is None:
        from . import zoo

        path = zoo.default_paths()["gpt"]
    check(os.path.isfile(path), f"checkpoint not found: {path}")
    config = read_project_config(path, "gpt")
    if config is None:  # an official checkpoint: only loading it tells
        return
    cfg = checked_gpt_config(config, f"config {config_path(path)}")
    if prompts is not None and cfg.model_type == "c2i":
        raise VVSError("this model is class-conditional: pass class labels, not a prompts file")
    if labels is not None and cfg.model_type == "t2i":
        raise VVSError("this model is text-conditional: pass a prompts file, not class labels")
    if labels is not None:
        bad = [x for x in labels if not 0 <= x < cfg.num_classes]
        check(not bad, f"class label {bad[0] if bad else ''} out of range [0, {cfg.num_classes})")


def _merge(stats: List[dict]) -> dict:
    return merge_stats(stats)


def _without(d: dict, keys: Sequence[str]) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__
