"""Quantized weights on the Zoo (CPU): weight bytes, decode time int8 vs fp32 in one run, and quality.

Quality is paired: every row decodes the same labels with the same seeds (image i draws the same random
numbers in every row), at temperature 1, CFG 4, no top-k/top-p. Besides class accuracy and FD (the Zoo
classifier's feature space), the sharpest measure is

    D = E_x[ NLL_p(x_t | x_<t) - H(p(. | x_<t)) ]  (per token, averaged over the tokens of each image)

with p the full-precision target's CFG-combined distribution (``Engine.score``) and x the row's samples:
for samples of p itself E[D] = 0 exactly (the fp32 rows are the controls: their D is sampling noise), and a
row whose distribution departs from p has D != 0 (> 0 where it places tokens where p puts less mass than
p's own samples do, < 0 where it is sharper than p). The row "target + drafter int8" quantizes both (EAGLE-2 is lossless w.r.t. its target, so
its D measures the quantized target's distribution too); acceptance and TPF show what the quantized
drafter and target change for a drafter method (EAGLE-2) and a Jacobi method (SJD).

The fp32 rows are quality_speed's committed 512-image caches (benchmarks/results/quality_speed_tokens/AR.npz,
SJD.npz, EAGLE_2.npz) where their key (checkpoints, options, sampling, labels, seed, batch) matches, else decoded
here. The int8 rows decode in batches of one image per class, row after row (AR, SJD, EAGLE-2), each batch
appended to ``<out>_tokens/<row>.npz``: an interrupted run resumes there, and a run stopped early reports each
row on the balanced subset it finished, paired with the fp32 row on the same images.

    nice -n 19 python benchmarks/quantize_zoo.py --per-class 32 --time-images 16   # 512 images (16 classes)
    python benchmarks/quantize_zoo.py --per-class 32 --report-only                 # the report of what is decoded
    python benchmarks/quantize_zoo.py --per-class 2 --time-images 8 --out /tmp/qz  # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import quality_speed as qs  # noqa: E402  (its token cache, bootstrap and classifier-feature helpers)

from vvs_engine import Engine  # noqa: E402
from vvs_engine.models.quantize import linear_weight_bytes, weight_bytes  # noqa: E402

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=4.0)
TOKENS_PER_IMAGE = 256


def byte_rows():
    """Weight bytes of the Zoo target and drafter per dtype and quantization."""
    rows = []
    for name, dtype, q in (("fp32", "fp32", "none"), ("bf16", "bf16", "none"), ("int8 (bf16 compute)", "bf16", "int8"),
                           ("fp8 (bf16 compute)", "bf16", "fp8"), ("int8 (fp32 compute)", "fp32", "int8")):
        eng = Engine.load(dtype=dtype, quantize=q)
        lin, other = linear_weight_bytes(eng.gpt)
        rows.append({"name": name, "target_bytes": weight_bytes(eng.gpt), "target_linear_bytes": lin,
                     "target_other_bytes": other, "drafter_bytes": weight_bytes(eng.drafter)})
    base = rows[1]
    for r in rows:
        r["target_vs_bf16"] = r["target_bytes"] / base["target_bytes"]
        r["drafter_vs_bf16"] = r["drafter_bytes"] / base["drafter_bytes"]
    return rows


def time_ar(engines: dict, n: int, batch: int, repeats: int) -> dict:
    """Seconds of an AR decode of n images per engine, the engines alternated, the median of ``repeats``."""
    labels = [i % 16 for i in range(n)]
    times = {k: [] for k in engines}
    for name, eng in engines.items():  # warm-up (first-call allocations)
        eng.generate(class_labels=labels[:2], seed=99, decode_images=False, batch_size=batch, **SAMPLING)
    for _ in range(repeats):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            eng.generate(class_labels=labels, seed=0, decode_images=False, batch_size=batch, **SAMPLING)
            times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


# --- quality, paired with the full-precision rows ----------------------------------------------------
# (name, method, quality_speed's setting whose 512-image fp32 cache the row is paired with)
QUALITY_ROWS = (("AR", "ar", "AR"), ("SJD", "sjd", "SJD"), ("EAGLE-2", "eagle", "EAGLE-2"))  # decoded in this order
QUANT_ROW_NAME = {"ar": "AR, target int8", "eagle": "EAGLE-2, target + drafter int8", "sjd": "SJD, target int8"}


def balanced_order(per_class: int, classes: int = 16) -> list:
    """Image indices (image c * per_class + j is the j-th of class c) in batches of one image per class, so
    a run stopped after k batches holds k images of every class (its metrics are over a balanced subset)."""
    return [c * per_class + j for j in range(per_class) for c in range(classes)]


def generate_rows(rows: dict, labels, order, seed: int, batch: int, tokens_dir: str, log) -> dict:
    """Tokens of each row (name -> (engine, method, key)), batch by batch with the rows interleaved, each
    batch appended to ``<tokens_dir>/<row>.npz`` (a rerun resumes there; the key's digest must match; committed,
    so --report-only rebuilds the report).
    -> {name: {"indices", "tokens", "forwards", "cpu_s", "wall_s"}} of what is done."""
    state = {}
    for name, (_, _, key) in rows.items():
        path = os.path.join(tokens_dir, qs._slug(name) + ".npz")
        got = qs.load_cache(path, qs.digest_of(key))
        state[name] = ({"indices": got["indices"].astype(np.int64), "tokens": got["tokens"].astype(np.int64),
                        "forwards": got["forwards"].astype(np.float64), "cpu_s": float(got["cpu_s"]),
                        "wall_s": float(got["wall_s"])} if got is not None else
                       {"indices": np.zeros(0, np.int64), "tokens": np.zeros((0, 0), np.int64),
                        "forwards": np.zeros(0), "cpu_s": 0.0, "wall_s": 0.0})
    for name, (eng, method, key) in rows.items():  # row after row: the cheap rows (AR, SJD) first
        st = state[name]
        for start in range(len(st["indices"]), len(order), batch):
            chunk = order[start:start + batch]
            c0, w0 = time.process_time(), time.perf_counter()
            out = eng.generate(class_labels=[labels[i] for i in chunk], method=method, seed=seed, image_indices=chunk,
                               batch_size=batch, decode_images=False, **SAMPLING)
            st["cpu_s"] += time.process_time() - c0
            st["wall_s"] += time.perf_counter() - w0
            toks = out.tokens.numpy().astype(np.int64)
            st["indices"] = np.concatenate([st["indices"], np.asarray(chunk, np.int64)])
            st["tokens"] = toks if not len(st["tokens"]) else np.concatenate([st["tokens"], toks])
            st["forwards"] = np.concatenate([st["forwards"],
                                             np.asarray(out.stats["per_image"]["target_forward_passes"], np.float64)])
            qs._save_npz(os.path.join(tokens_dir, qs._slug(name) + ".npz"), digest=qs.digest_of(key), key=key,
                         indices=st["indices"], tokens=st["tokens"].astype(np.int16), forwards=st["forwards"],
                         cpu_s=st["cpu_s"], wall_s=st["wall_s"])
            log(f"[quantize_zoo] {name}: {len(st['indices'])}/{len(order)} images, "
                f"{st['wall_s'] / len(st['indices']):.2f} s/image wall, {st['cpu_s']:.0f} s CPU so far")
    return state


def fp32_row(full, method, setting, labels, seed, batch, fp32_dir, tokens_dir, ckpt, log) -> dict:
    """The full-precision row: quality_speed's committed 512-image cache where its key (checkpoints, method
    options, sampling, labels, seed, batch) matches, else decoded here (same labels, seeds and batches)."""
    name, m, opts = qs.SETTING_BY_NAME[setting]
    key = qs.setting_key(ckpt, method, opts, SAMPLING, labels, seed, batch)
    got = qs.load_cache(os.path.join(fp32_dir, qs._slug(setting) + ".npz"), qs.digest_of(key)) if fp32_dir else None
    if got is not None:
        log(f"[quantize_zoo] {setting} fp32: quality_speed's cache ({got['date']}, {len(got['tokens'])} images)")
        return {"indices": np.arange(len(labels)), "tokens": got["tokens"].astype(np.int64),
                "forwards": got["forwards"].astype(np.float64), "cpu_s": None, "wall_s": float(got["gen_seconds"]),
                "source": os.path.relpath(os.path.join(fp32_dir, qs._slug(setting) + ".npz"), ROOT)}
    st = generate_rows({setting + " fp32": (full, method, key)}, labels, balanced_order(
        len(labels) // 16), seed, batch, tokens_dir, log)[setting + " fp32"]
    return dict(st, source="decoded by this run")


class Measures:
    """Per-image D (under the full-precision target) and classifier features, cached per image (its tokens and
    label) in ``<tokens_dir>/measures.cache.npz``, so a subset or a longer run reuses them (D is one
    teacher-forced forward per image; the features need the VQ decode; not committed)."""

    def __init__(self, full, tokens_dir):
        self.full, self.path = full, os.path.join(tokens_dir, "measures.cache.npz")
        self.table = {}  # image key -> (D, correct, classifier features)
        if os.path.exists(self.path):
            with np.load(self.path) as z:
                for k, d, c, f in zip(z["keys"], z["D"], z["correct"], z["cls"]):
                    self.table[str(k)] = (float(d), float(c), f)

    @staticmethod
    def key(tokens_row, label) -> str:
        return hashlib.sha1(np.ascontiguousarray(tokens_row, dtype=np.int64).tobytes() + str(int(label)).encode()
                            ).hexdigest()[:20]

    def get(self, tokens, labels, chunk: int = 64) -> dict:
        from vvs_engine.evaluation.divergence import sampling_gap_per_image

        keys = [self.key(t, lab) for t, lab in zip(tokens, labels)]
        todo = [i for i, k in enumerate(keys) if k not in self.table]
        for start in range(0, len(todo), chunk):  # saved after each chunk: an interrupted report resumes
            sel = todo[start:start + chunk]
            lab = [labels[i] for i in sel]
            d = sampling_gap_per_image(self.full, tokens[sel], lab, batch_size=16, **SAMPLING)
            feats = qs.image_features(self.full, tokens[sel], lab, inception=False)
            for j, i in enumerate(sel):
                self.table[keys[i]] = (float(d[j]), float(feats["correct"][j]), feats["cls"][j])
            self.save()
        return {"D": np.array([self.table[k][0] for k in keys]), "correct": np.array([self.table[k][1] for k in keys]),
                "cls": np.stack([self.table[k][2] for k in keys])}

    def save(self) -> None:
        keys = list(self.table)
        qs._save_npz(self.path, keys=np.array(keys), D=np.array([self.table[k][0] for k in keys]),
                     correct=np.array([self.table[k][1] for k in keys]),
                     cls=np.stack([self.table[k][2] for k in keys]))


def paired_quality(full_row, quant_row, labels, measures, ref, reps: int, seed: int) -> tuple:
    """The fp32 and the int8 row on the images the int8 row has (the same images, seeds and labels): class
    accuracy and classifier FD with 95 % bootstrap intervals (one draw of images shared by both rows) and
    the paired difference; D with +- 1.96 standard errors and its paired difference image by image."""
    idx = quant_row["indices"]
    pos = {int(i): k for k, i in enumerate(full_row["indices"])}
    f_sel = np.asarray([pos[int(i)] for i in idx])
    lab = [labels[i] for i in idx]
    full_m = measures.get(full_row["tokens"][f_sel], lab)
    quant_m = measures.get(quant_row["tokens"], lab)
    draws = qs.bootstrap_indices(len(idx), reps, seed)
    out = []
    base = None
    for row, m, fwd in ((full_row, full_m, full_row["forwards"][f_sel]), (quant_row, quant_m, quant_row["forwards"])):
        d = qs.metric_draws({"correct": m["correct"], "cls": m["cls"]}, fwd, TOKENS_PER_IMAGE, {"cls": ref}, draws)
        res = {k: qs.summarise(v, b, base[k] if base else None) for k, (v, b) in d.items()}
        res["D"] = summarise_d(m["D"])
        if base:
            res["D"]["diff"], res["D"]["diff_half_width"] = _mean_half(m["D"] - full_m["D"])
        out.append(res)
        base = base or d
    return out[0], out[1], len(idx)


def _mean_half(x) -> tuple:
    x = np.asarray(x, np.float64)
    return float(x.mean()), float(1.96 * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.inf


def summarise_d(d) -> dict:
    m, h = _mean_half(d)
    return {"value": m, "half_width": h}


def quality_rows(full: Engine, quant: Engine, per_class: int, batch: int, seed: int, fp32_dir: str,
                 tokens_dir: str, reps: int, generate: bool = True, log=print) -> list:
    """Each method's fp32 row and int8 row on the same images (paired), as table rows."""
    from vvs_engine.evaluation.quality import reference_features

    _, ckpt, _ = qs.zoo_context()
    labels = [c for c in range(16) for _ in range(per_class)]
    full_rows = {method: fp32_row(full, method, setting, labels, seed, batch, fp32_dir, tokens_dir, ckpt, log)
                 for _, method, setting in QUALITY_ROWS}
    rows = {}
    for _, method, setting in QUALITY_ROWS:
        _, _, opts = qs.SETTING_BY_NAME[setting]
        key = json.dumps({"setting": qs.setting_key(ckpt, method, opts, SAMPLING, labels, seed, batch),
                          "quantize": quant.quantization, "order": "one image per class per batch"}, sort_keys=True)
        rows[QUANT_ROW_NAME[method]] = (quant, method, key)
    if generate:
        quant_rows = generate_rows(rows, labels, balanced_order(per_class), seed, batch, tokens_dir, log)
    else:  # --report-only: what the partial files hold
        quant_rows = generate_rows(rows, labels, [], seed, batch, tokens_dir, log)
    ref = qs.ReferenceSet(reference_features("classifier"))
    measures = Measures(full, tokens_dir)
    table = []
    for name, method, setting in QUALITY_ROWS:
        q = quant_rows[QUANT_ROW_NAME[method]]
        if not len(q["indices"]):
            continue
        fm, qm, n = paired_quality(full_rows[method], q, labels, measures, ref, reps, seed)
        full_n = len(full_rows[method]["indices"])
        table.append({"name": name + " fp32", "method": method, "quantize": "none", "images": n, "metrics": fm,
                      "source": full_rows[method]["source"], "cpu_s": full_rows[method]["cpu_s"],
                      "wall_s": full_rows[method]["wall_s"] * n / full_n})
        table.append({"name": QUANT_ROW_NAME[method], "method": method, "quantize": quant.quantization, "images": n,
                      "metrics": qm, "source": "decoded by this run", "cpu_s": q["cpu_s"], "wall_s": q["wall_s"]})
        log(json.dumps({k: v for k, v in table[-1].items() if k != "metrics"}))
    return table


def _ci(m, nd) -> str:
    return f"{m['value']:.{nd}f} [{m['ci'][0]:.{nd}f}, {m['ci'][1]:.{nd}f}]"


def _diff(m, nd) -> str:
    return f"{m['diff']:+.{nd}f} [{m['diff_ci'][0]:+.{nd}f}, {m['diff_ci'][1]:+.{nd}f}]" if "diff" in m else "–"


def verdict(row: dict) -> str:
    """Near-lossless (the frontier's level): |D| <= 0.025 nats/token and not detectably worse than the fp32
    row (neither paired interval, class accuracy or classifier FD, wholly on the worse side)."""
    m = row["metrics"]
    worse = [k for k, sign in (("class_accuracy", +1), ("fd_classifier", -1))
             if (m[k]["diff_ci"][1] if sign > 0 else -m[k]["diff_ci"][0]) < 0]
    near = abs(m["D"]["value"]) <= 0.025
    settled = abs(m["D"]["value"]) + m["D"]["half_width"] <= 0.025
    return ((f"near-lossless ({'D' if settled else 'but D'}'s 95 % interval {'inside' if settled else 'reaches past'} "
             f"±0.025)") if near and not worse else
            ("|D| > 0.025" if not near else "") + ("; " if not near and worse else "") +
            (" and ".join(worse) + " detectably worse" if worse else ""))


def write_md(path: str, res: dict) -> None:
    lines = [f"# Quantized weights on the Zoo (CPU, {res['threads']} thread)", "",
             f"Written by `{res['command']}` on {res['date']} ({res['machine']}; torch {res['torch']}, "
             f"torchao {res['torchao']}).", "", "## Weight bytes", "",
             "| weights | target bytes | of which linear | target vs bf16 | drafter bytes | drafter vs bf16 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in res["bytes"]:
        lines.append(f"| {r['name']} | {r['target_bytes']:,} | {r['target_linear_bytes']:,} | "
                     f"{r['target_vs_bf16']:.3f} | {r['drafter_bytes']:,} | {r['drafter_vs_bf16']:.3f} |")
    t = res["timing"]
    lines += ["", "## Decode time (AR, one run, engines alternated, median of "
              f"{t['repeats']})", "",
              f"{t['images']} images, batch {t['batch']} (CFG: {2 * t['batch']} rows): fp32 {t['fp32_s']:.2f} s, "
              f"int8 weights (fp32 compute) {t['int8_s']:.2f} s: **int8 / fp32 = {t['ratio']:.2f}**" +
              (f" (timed by `{t['command']}`; load average {t['load_average']}: the ratio is noisy)" if "command" in t
               else f" (load average {t['load_average']} before timing)" if "load_average" in t else "") +
              ". The Zoo is small enough that a CPU round is bound by launches and attention, not by reading "
              "weights; the decode where fewer weight bytes pay, a large model on a GPU, is not measured here.", ""]
    q = res["quality"]
    n_max = res.get("images_requested")
    lines += ["## Quality, paired with the full-precision rows (same labels, seeds and images)", "",
              f"{q[0]['images'] if q else 0} of {n_max} images per row" +
              (" (the run was stopped early: each row's images are the first batches of one image per class, "
               "and its fp32 row is taken on the same images)" if q and q[0]["images"] < (n_max or 0) else "") +
              f". Intervals: 95 % bootstrap over images ({res['reps']} draws shared by a row and its fp32 row; Δ = "
              "int8 − fp32 on the same draws); D ± 1.96 standard errors, its Δ paired image by image. Verdict: "
              "near-lossless = |D| <= 0.025 nats/token and neither Δ interval (class accuracy, FD) wholly on the "
              "worse side (an FD interval from resamples that repeat images sits above the full-set value; the shift "
              "cancels in Δ).", "",
              "| row | images | TPF | class acc. | Δ acc. | FD (classifier) | Δ FD | D (nats/token) | Δ D | verdict |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in q:
        m = r["metrics"]
        dd = f"{m['D']['diff']:+.4f} ± {m['D']['diff_half_width']:.4f}" if "diff" in m["D"] else "–"
        lines.append(f"| {r['name']} | {r['images']} | {_ci(m['tpf'], 2)} | {_ci(m['class_accuracy'], 3)} | "
                     f"{_diff(m['class_accuracy'], 3)} | {_ci(m['fd_classifier'], 2)} | {_diff(m['fd_classifier'], 2)} | "
                     f"{m['D']['value']:+.4f} ± {m['D']['half_width']:.4f} | {dd} | "
                     f"{verdict(r) if r['quantize'] != 'none' else '–'} |")
    lines += ["", "Where each row's tokens come from, and its CPU time (one thread, `nice -n 19` on a shared "
              "2-core machine):", ""]
    for r in q:
        cpu = f"{r['cpu_s']:.0f} s CPU, " if r.get("cpu_s") is not None else ""
        lines.append(f"* {r['name']}: {r['source']} ({cpu}{r['wall_s']:.0f} s wall for these images).")
    lines += ["", "D = E[NLL − entropy] per token of the row's samples under the full-precision target's sampling "
              "distribution (CFG 4, temperature 1; `vvs_engine.evaluation.divergence`, the frontier's measure): 0 in "
              "expectation for the target's own samples (the fp32 rows: AR, and EAGLE-2 and SJD, which are lossless; "
              "their values are sampling noise); > 0 where the samples are more spread than the target, < 0 where "
              "sharper. The int8 rows quantize fp32 weights (the CPU computes in fp32); EAGLE-2's row quantizes its "
              "drafter too, and EAGLE-2 being lossless w.r.t. its (int8) target, its D measures that target's "
              "distribution; TPF shows what int8 changes in acceptance.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-class", type=int, default=32, help="images per class for quality (16 classes)")
    ap.add_argument("--time-images", type=int, default=32, help="images of each timed AR decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1000, help="bootstrap draws")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quantize_zoo"))
    ap.add_argument("--fp32-tokens", default=os.path.join(ROOT, "benchmarks", "results", "quality_speed_tokens"),
                    help="quality_speed's token cache: its AR, EAGLE-2 and SJD rows are the fp32 rows where their "
                         "key matches ('' to decode them here)")
    ap.add_argument("--timing-json", default=None,
                    help="take the timing from this JSON (the timing line an earlier run printed) instead of timing")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from the tokens decoded so far (<out>_tokens/*.npz) without decoding")
    args = ap.parse_args(argv)
    if args.batch != 16:
        ap.error("--batch must be 16 (one image per class per batch; the fp32 caches were decoded at 16)")
    torch.set_num_threads(1)
    import torchao

    tokens_dir = args.out + "_tokens"
    os.makedirs(tokens_dir, exist_ok=True)
    full, quant = Engine.load(threads=1), Engine.load(threads=1, quantize="int8")
    assert full.tokens_per_image == TOKENS_PER_IMAGE
    res = {"command": "python benchmarks/quantize_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "torchao": torchao.__version__, "threads": torch.get_num_threads(),
           "reps": args.reps, "images_requested": 16 * args.per_class}
    old = {}
    if os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            old = json.load(f)
    if args.report_only and "bytes" in old and "timing" in old:
        res["bytes"], res["timing"] = old["bytes"], old["timing"]
        decoded_by = old.get("command", "?").split(" (report: ")[0]  # the decoding run's command, once
        res["command"] = decoded_by + f" (report: {res['command']})"
    else:
        res["bytes"] = byte_rows()
        print(json.dumps(res["bytes"]), flush=True)
        if args.timing_json:
            with open(args.timing_json) as f:
                res["timing"] = dict(json.load(f), source=args.timing_json)
        else:
            load = os.getloadavg()[0]
            t = time_ar({"fp32": full, "int8": quant}, args.time_images, args.batch, args.repeats)
            res["timing"] = {"images": args.time_images, "batch": args.batch, "repeats": args.repeats,
                             "fp32_s": t["fp32"], "int8_s": t["int8"], "ratio": t["int8"] / t["fp32"],
                             "load_average": f"{load:.1f}"}
        print(json.dumps(res["timing"]), flush=True)
        with open(args.out + ".json", "w") as f:  # so --report-only has them while the quality rows decode
            json.dump(dict(old, bytes=res["bytes"], timing=res["timing"], command=res["command"]), f, indent=1)
    res["quality"] = quality_rows(full, quant, args.per_class, args.batch, args.seed, args.fp32_tokens, tokens_dir,
                                  args.reps, generate=not args.report_only)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_md(args.out + ".md", res)
    print(f"wrote {args.out}.md / .json")


if __name__ == "__main__":
    main()
