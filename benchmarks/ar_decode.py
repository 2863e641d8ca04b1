"""Plain-AR decode benchmark: per-step latency and tokens/s of the engine's AR baseline.

    python benchmarks/ar_decode.py --gpt-model GPT-B --batch 2 --dtype fp32 --device cpu --steps 64

Random weights (speed does not depend on them). ``--batch`` counts the rows the target runs per step,
i.e. CFG rows: with CFG on (the default) batch 2 is one image (conditional + unconditional row) and
batch 2k is k images; ``--no-cfg`` makes every row an image.

Measured:
* per-step latency: one decode step exactly as the AR loop does it (target forward of one token per
  row through the static KV cache, CFG combination, logits processing, sampling), timed step by step
  (with a device synchronisation per step on GPUs) -> median, p10, p90;
* tokens/s: a full ``Engine.generate(method="ar")`` without VQ decoding (prefill included), images x
  tokens per image / wall time;
* memory traffic per step: the target weights read once (all parameters except the two embedding
  tables, of which one row per query is read) plus the K/V read by attention. The reference attention
  reads the whole static cache buffer every step (masked slots included), so that is what is counted;
  the KV actually in use at the measured positions is reported alongside. On a GPU the achieved
  bandwidth is compared with ``--peak-gbps`` (default: H200, 4800 GB/s).

Prints a table and writes JSON to ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from vvs_engine import Engine  # noqa: E402
from vvs_engine.engine import resolve_device, resolve_dtype  # noqa: E402
from vvs_engine.runtime.masks import causal_local  # noqa: E402
from vvs_engine.models.gpt import GPT, gpt_config  # noqa: E402
from vvs_engine.sampling import SamplingParams, guided_logits, make_generator, process_logits, sample  # noqa: E402
from vvs_engine.runtime.target import TargetSession  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpt-model", default="GPT-B", help="preset (GPT-B, GPT-L, GPT-XL, ...); default GPT-B")
    p.add_argument("--image-size", type=int, default=256, help="pixels with a downsampling-16 tokenizer (256 -> 256 tokens)")
    p.add_argument("--batch", type=int, default=2, help="rows per step = CFG rows (default 2 = one image with CFG)")
    p.add_argument("--no-cfg", action="store_true", help="no CFG: every row is an image")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed one by one (default 64)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--no-e2e", action="store_true", help="skip the full-image Engine.generate measurement")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="device peak memory bandwidth (default H200 4800)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ar_decode_<...>.json)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bytes_per_step(model: GPT, session: TargetSession, rows: int, position: int):
    """(weight bytes, KV bytes read by attention over the whole static buffer, KV bytes in use)."""
    el = next(model.parameters()).element_size()
    tables = {id(model.tok_embeddings.weight)}
    tables |= {id(p) for p in model.cls_embedding.parameters()}
    weights = sum(p.numel() for p in model.parameters() if id(p) not in tables) * el
    weights += rows * model.config.dim * el  # the embedding rows actually looked up
    cfg = model.config
    per_slot = 2 * cfg.n_layer * rows * cfg.n_head * cfg.head_dim * session.kv.k.element_size()  # K and V
    return weights, per_slot * session.kv.n_slots, per_slot * (position + 1)


def time_steps(model, rows, n_images, use_cfg, params, steps, warmup, device, seed):
    """Time ``steps`` decode steps one by one, mirroring the loop of vvs_engine/methods/ar.py."""
    cond = torch.randint(0, model.config.num_classes, (n_images,), device=device)
    if use_cfg:
        cond = torch.cat([cond, torch.full_like(cond, model.null_class)])
    s = TargetSession(model, cond, n_images, use_cfg)
    gen = make_generator(seed, device)
    total = warmup + steps
    if total > s.T - 1:
        raise SystemExit(f"--steps + --warmup must be <= {s.T - 1} (tokens per image - 1)")
    times = []
    with torch.inference_mode():
        h = s.prefill()
        h = h[:, -1] if h.dim() == 3 else h  # features of the last condition position
        tok = sample(process_logits(guided_logits(s.logits(h), params), params), gen)
        pos = torch.full((1,), s.c, dtype=torch.long, device=device)
        one = causal_local(1, device)
        for i in tqdm(range(total), desc="timed decode steps", file=sys.stderr, leave=False):
            sync(device)
            t0 = time.perf_counter()
            h = s.forward(tok[:, None], pos, pos, one)[:, -1]
            tok = sample(process_logits(guided_logits(s.logits(h), params), params), gen)
            pos += 1
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    mid_position = s.c + warmup + steps // 2
    return times, s, mid_position


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def main(argv=None):
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = resolve_device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                            ("cpu" if a.device == "auto" else a.device))
    dtype = resolve_dtype(a.dtype)
    use_cfg = not a.no_cfg and a.cfg_scale != 1.0
    if use_cfg and a.batch % 2:
        raise SystemExit("--batch counts CFG rows: it must be even with CFG (or pass --no-cfg)")
    n_images = a.batch // 2 if use_cfg else a.batch
    params = SamplingParams(a.temperature, a.top_k, 1.0, a.cfg_scale if use_cfg else 1.0).validate()

    torch.manual_seed(a.seed)
    cfg = gpt_config(a.gpt_model, block_size=(a.image_size // 16) ** 2)
    with torch.device(device):
        model = GPT(cfg)
    model = model.to(dtype=dtype).eval()

    times, session, position = time_steps(model, a.batch, n_images, use_cfg, params, a.steps, a.warmup, device,
                                          a.seed)
    med = statistics.median(times)
    w_bytes, kv_bytes, kv_used = bytes_per_step(model, session, a.batch, position)
    step_gbps = (w_bytes + kv_bytes) / med / 1e9

    e2e = None
    if not a.no_e2e:
        eng = Engine(model)
        labels = list(range(n_images))
        print("full-image generation: warm-up, then the timed run (--no-e2e skips both)", file=sys.stderr)
        eng.generate(class_labels=labels, method="ar", temperature=a.temperature, top_k=a.top_k,
                     cfg_scale=params.cfg_scale, seed=a.seed, decode_images=False,
                     progress=True)  # warm-up (imports, allocator)
        sync(device)
        out = eng.generate(class_labels=labels, method="ar", temperature=a.temperature, top_k=a.top_k,
                           cfg_scale=params.cfg_scale, seed=a.seed, decode_images=False, progress=True)
        st = out.stats
        e2e = {"wall_time_s": st["wall_time_s"], "tokens_generated": st["tokens_generated"],
               "tokens_per_s": st["tokens_generated"] / st["wall_time_s"],
               "s_per_image": st["wall_time_s"] / n_images, "target_forward_passes": st["target_forward_passes"]}

    result = {
        "benchmark": "ar_decode", "gpt_model": a.gpt_model, "params": model.num_params(),
        "tokens_per_image": cfg.block_size, "batch_rows": a.batch, "images": n_images, "cfg": use_cfg,
        "dtype": a.dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or
        platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "steps_timed": len(times), "step_ms_median": med * 1e3, "step_ms_p10": percentile(times, 0.1) * 1e3,
        "step_ms_p90": percentile(times, 0.9) * 1e3, "step_ms_mean": statistics.fmean(times) * 1e3,
        "image_tokens_per_s_step": n_images / med,
        "weight_bytes_per_step": w_bytes, "kv_bytes_per_step_static_buffer": kv_bytes,
        "kv_bytes_in_use_at_mid_position": kv_used, "kv_slots": session.kv.n_slots,
        "achieved_gbps": step_gbps,
        "peak_gbps": a.peak_gbps if device.type == "cuda" else None,
        "fraction_of_peak": step_gbps / a.peak_gbps if device.type == "cuda" else None,
        "e2e_generate": e2e,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", "benchmarks/ar_decode.py"] + (argv if argv is not None else sys.argv[1:])),
    }
    print_table(result)
    out = a.out or os.path.join(RESULTS, f"ar_decode_{a.gpt_model}_{device.type}_{a.dtype}_b{a.batch}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return result


def print_table(r):
    rows = [
        ("model", f"{r['gpt_model']} ({r['params'] / 1e6:.1f}M params), {r['tokens_per_image']} tokens/image"),
        ("device / dtype", f"{r['device']} ({r['device_name']}, {r['threads']} threads) / {r['dtype']}"),
        ("batch", f"{r['batch_rows']} rows = {r['images']} image(s)" + (" with CFG" if r["cfg"] else "")),
        ("step latency median", f"{r['step_ms_median']:.2f} ms  (p10 {r['step_ms_p10']:.2f}, p90 "
                                f"{r['step_ms_p90']:.2f}, {r['steps_timed']} steps)"),
        ("image tokens/s (steps)", f"{r['image_tokens_per_s_step']:.1f}"),
        ("bytes/step", f"weights {r['weight_bytes_per_step'] / 1e6:.1f} MB + KV {r['kv_bytes_per_step_static_buffer'] / 1e6:.1f} MB "
                       f"(in use {r['kv_bytes_in_use_at_mid_position'] / 1e6:.1f} MB)"),
        ("achieved bandwidth", f"{r['achieved_gbps']:.1f} GB/s" +
         (f" = {100 * r['fraction_of_peak']:.1f}% of {r['peak_gbps']:.0f} GB/s peak" if r["peak_gbps"] else "")),
    ]
    if r["e2e_generate"]:
        e = r["e2e_generate"]
        rows.append(("full image (generate)", f"{e['wall_time_s']:.2f} s, {e['tokens_per_s']:.1f} tokens/s, "
                                              f"{e['s_per_image']:.2f} s/image"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


if __name__ == "__main__":
    main()
