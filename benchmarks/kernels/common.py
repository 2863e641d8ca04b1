"""Shared pieces of the kernel microbenchmarks: model shapes, the timer, CSV and plot output.

Liger-Kernel layout: each ``bench_<op>.py`` times the kernel against the same torch reference the
tests use (``vvs_engine.kernels.reference``), plus external baselines where installed. On a GPU the
timer is ``triton.testing.do_bench`` (median of the 0.5/0.2/0.8 quantiles); on the CPU only the
references run, timed by ``time.perf_counter`` medians (kernels are not meaningful under the
interpreter).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "kernels"


@dataclass(frozen=True)
class ModelShape:
    name: str
    dim: int
    heads: int
    layers: int
    vocab: int  # the draft head's output rows
    image_vocab: int  # tokens that can appear in an image (the LANTERN neighbour table)
    cfg_batch: int = 2  # cond + uncond rows

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


LLAMAGEN_XL = ModelShape("LlamaGen-XL", dim=1280, heads=20, layers=36, vocab=16384, image_vocab=16384)
# Janus-Pro: a separate 16384-code image head on DeepSeek-LLM 1.5B / 7B bodies.
JANUS_PRO_1B = ModelShape("Janus-Pro-1B", dim=2048, heads=16, layers=24, vocab=16384, image_vocab=16384)
JANUS_PRO_7B = ModelShape("Janus-Pro-7B", dim=4096, heads=32, layers=30, vocab=16384, image_vocab=16384)
# Lumina-mGPT 7B (Chameleon body): 65536-token vocabulary of which 8192 are image codes.
LUMINA_MGPT_7B = ModelShape("Lumina-mGPT-7B", dim=4096, heads=32, layers=32, vocab=65536, image_vocab=8192)
# Emu3: only its vocabulary (184622 rows, 32768 image codes) matters here (draft sampling).
EMU3_8B = ModelShape("Emu3-8B", dim=4096, heads=32, layers=32, vocab=184622, image_vocab=32768)
MODELS = (LLAMAGEN_XL, JANUS_PRO_1B, JANUS_PRO_7B, LUMINA_MGPT_7B)
TREE_SIZES = (1, 60, 70)  # AR decode, then EAGLE-2-sized trees (60) and a 70-node one (two 64-row tiles)
PREFIXES = (121, 632, 1144, 4096)  # c2i/t2i condition + image prefixes; Lumina-mGPT 1024^2 reaches ~4096


def parse_args(description: str):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="one small shape per model (CPU smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the CSV and PNG")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for the CPU fallback (1 keeps timings stable on a shared machine)")
    args = parser.parse_args()
    Results.autosave_dir = args.out  # a run stopped by its time limit keeps the rows measured so far
    if not on_gpu():
        torch.set_num_threads(args.threads)
    return args


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if on_gpu() else "cpu")


def half_dtype() -> torch.dtype:
    """The benchmark dtype: bf16 on a GPU, fp32 on the CPU (CPU bf16 kernels are not representative)."""
    return torch.bfloat16 if on_gpu() else torch.float32


def median_ms(fn, quick: bool = False) -> float:
    if on_gpu():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                             quantiles=[0.5, 0.2, 0.8])[0])
    fn()  # warm-up
    reps = 5 if quick else 20
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_ms(n_bytes: int, dev: torch.device, dtype: torch.dtype, quick: bool = False) -> float:
    """Median time of a plain device-to-device copy of ``n_bytes`` (read + write counted once each):
    the bandwidth bound a data-movement kernel is compared with."""
    src = torch.empty(n_bytes // torch.tensor([], dtype=dtype).element_size(), device=dev, dtype=dtype)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), quick)


def triton_launchers():
    """``vvs_engine.triton_kernels`` when the kernels can be benchmarked (a GPU and Triton), else None."""
    if not on_gpu() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    from vvs_engine.kernels.backends import triton_module

    return triton_module()


def cuda_launchers():
    if not on_gpu():
        return None
    from vvs_engine.kernels.backends import cuda_module

    return cuda_module()


def flashinfer():
    try:
        import flashinfer as fi  # noqa: F401

        return fi if on_gpu() else None
    except ImportError:
        return None


class Results:
    """Rows of (op, model, shape, impl, median_ms, extra) -> CSV + a grouped bar plot. With
    ``autosave_dir`` set (``parse_args`` does), the CSV is rewritten after every row."""

    autosave_dir = None

    def __init__(self, op: str):
        self.op = op
        self.rows: list[dict] = []
        self.env = "cuda:" + torch.cuda.get_device_name() if on_gpu() else "cpu"

    def add(self, model: str, shape: str, impl: str, ms: float, **extra):
        row = {"op": self.op, "device": self.env, "model": model, "shape": shape, "impl": impl, "median_ms": round(ms, 5)}
        row.update(extra)
        self.rows.append(row)
        print(f"{self.op:16s} {model:13s} {shape:34s} {impl:22s} {ms:10.4f} ms"
              + "".join(f"  {k}={v}" for k, v in extra.items()), flush=True)
        if self.autosave_dir is not None:
            self.save(Path(self.autosave_dir), plot=False)

    def save(self, out: Path, plot: bool = True) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.op}.csv"
        keys = sorted({k for r in self.rows for k in r}, key=lambda k: list(self.rows[0]).index(k) if k in self.rows[0] else 99)
        with open(path, "w", newline="") as f:
            # Provenance line (read the CSV with comment="#"): the command that wrote it, when and where.
            command = " ".join(["python", str(Path(sys.argv[0]).resolve().relative_to(ROOT))] + sys.argv[1:])
            f.write(f"# {command}  |  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  |  {self.env}"
                    f"  |  threads {torch.get_num_threads()}\n")
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
        if plot:
            self.plot(out / f"{self.op}.png")
        return path

    def plot(self, path: Path) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
            return
        groups = list(dict.fromkeys(f"{r['model']}\n{r['shape']}" for r in self.rows))
        impls = list(dict.fromkeys(r["impl"] for r in self.rows))
        width = 0.8 / max(1, len(impls))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for i, g in enumerate(groups):
                for r in self.rows:
                    if r["impl"] == impl and f"{r['model']}\n{r['shape']}" == g:
                        xs.append(i + j * width)
                        ys.append(r["median_ms"])
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels(groups, fontsize=7)
        ax.set_ylabel("median ms (lower is better)")
        ax.set_yscale("log")
        ax.set_title(f"{self.op} on {self.env}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
