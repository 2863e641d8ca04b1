"""The ``vvs-engine`` command (also ``python -m vvs_engine``).

Subcommands:

* ``generate``       generate images with any decoding method (the contract other tools rely on, see
                     README "Command line"): writes ``tokens.npz``, ``stats.json`` and one PNG per image.
* ``generate-dataset`` many images as resumable shards, in one process or on Ray (``vvs_engine.dataset``).
* ``zoo list|train`` list the shipped models / retrain them (``vvs_engine.zoo``).
* ``serve``          an image-generation HTTP server (``vvs_engine.serving``; the ``[serve]`` extra).
* ``eval``           quality metrics of a ``generate`` output folder (``vvs_engine.evaluation.report``).
* ``bench``          speed benchmarks (``vvs_engine.evaluation.bench``).
* ``train-drafter``  train an EAGLE-style drafter (``vvs_engine.training.drafter``).

Error policy: bad input never produces a traceback. Argument errors print one ``error: ...`` line and
exit 2 (like argparse, minus the usage dump); every other user error (:class:`VVSError`, a file that
cannot be read or written, a bad value) prints one ``error: ...`` line and exits 1. Ctrl-C prints
``error: interrupted`` and exits 130 (also while the command starts and imports torch); SIGTERM is
handled like Ctrl-C (the same clean-up: generate-dataset keeps its finished shards and writes its
manifest) and exits 143 after ``error: terminated``.
"""
from __future__ import annotations

import argparse

import importlib
import json
import math
import os
import re
import signal
import sys
import threading
from typing import List, Optional, Sequence

from .errors import OneLineParser, Terminated, UsageError, VVSError, raise_terminated
from .startup import end_of_startup
from .methods.options import method_flags
from .paths import check_writable_file
from .threads import apply_threads as _apply_threads
from .threads import default_threads  # noqa: F401  (re-exported: the CLI's default)


def add_threads_flag(parser) -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"CPU threads for torch (default: $OMP_NUM_THREADS, else half the cores, at most 4; "
                             f"here {default_threads()})")


def apply_threads(n: Optional[int]) -> int:
    """--threads N, or the default (the CLI always sets it: a command is its own process)."""
    return _apply_threads(default_threads() if n is None else n, "--threads")


# --- argument parsing ---------------------------------------------------------------------------
Parser = OneLineParser  # argparse without the usage dump: a bad argument raises UsageError


def rows_arg(text: str):
    """argparse type of a rows flag (generate's ``--batch-size``, serve's ``--rows``): an integer or ``auto``
    (the most images in flight that fit the device's free memory: ``Engine.auto_rows``)."""
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def build_parser() -> Parser:
    p = Parser(prog="vvs-engine", description="Fast autoregressive image generation with speculative decoding.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"vvs-engine {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate images (writes tokens.npz, stats.json, PNGs)",
                       description="Generate one image per class label (or prompt).")
    m = g.add_argument_group("model")
    from .zoo import TARGETS

    m.add_argument("--model", default=None, metavar="NAME",
                   help=f"a Zoo target by name: {', '.join(TARGETS)} (32x32 tokens, 128 px); loads its own "
                        f"drafter and zoo-vq (default without --gpt-ckpt: zoo-gpt)")
    m.add_argument("--gpt-ckpt", default=None, metavar="PATH",
                   help="target checkpoint: official LlamaGen .pt/.pth or the project's .safetensors (+ .json "
                        "config). Default: the shipped Zoo model")
    m.add_argument("--gpt-model", default=None, metavar="NAME",
                   help="preset for official checkpoints without a config file: GPT-B, GPT-L, GPT-XL, GPT-XXL, "
                        "GPT-XXXL, GPT-1B, GPT-3B, GPT-7B")
    m.add_argument("--vq-ckpt", default=None, metavar="PATH",
                   help="VQ tokenizer checkpoint (without one only tokens are written, no PNGs)")
    m.add_argument("--vq-model", default="VQ-16", metavar="NAME", help="tokenizer preset for official VQ files "
                                                                      "(VQ-16 or VQ-8; default VQ-16)")
    m.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="image size in pixels (default: from the config file, else 256)")
    m.add_argument("--t5-path", default=None, metavar="DIR", help="local flan-t5 directory (text-conditional models)")
    m.add_argument("--model-dir", default=None, metavar="DIR",
                   help="local Hugging Face folder of another target family (Janus-Pro, Lumina-mGPT, Emu3); "
                        "replaces --gpt-ckpt/--vq-ckpt")
    m.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="with --model-dir: prompts are left-padded to N tokens (default 128)")
    m.add_argument("--drafter", default=None, metavar="PATH", help="drafter checkpoint (speculative methods)")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (= cuda when available; default)")
    m.add_argument("--dtype", default="fp32", help="fp32, bf16, fp16 or fp64 (default fp32; fp64: slow, but no batch "
                                                     "composition changes an image's tokens)")
    m.add_argument("--quantize", default="none", metavar="MODE",
                   help="none, int8, fp8 or int4: the target's and drafter's linear weights quantized at load, "
                        "weight-only, through torchao (default none; int4 needs CUDA and bf16; docs/quantization.md)")
    m.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant decoding: an image's tokens and pixels do not depend on its batch-mates "
                        "or the rows in flight, in fp32 and bf16 too (CPU; docs/batching.md; default: off for "
                        "generate, on for serve)")

    c = g.add_argument_group("conditions")
    c.add_argument("--class-labels", default=None, metavar="L1,L2,...",
                   help="comma-separated class labels, one image each, in order (repeats allowed)")
    c.add_argument("--prompts", default=None, metavar="FILE", help="text file, one prompt per line (t2i models)")

    s = g.add_argument_group("sampling")
    from .methods import method_names

    s.add_argument("--method", default="ar", help=f"decoding method (default ar): {', '.join(method_names())}")
    from .presets import PRESET_NAMES, presets_help

    s.add_argument("--preset", default=None, choices=PRESET_NAMES, help=presets_help())
    s.add_argument("--cfg-scale", type=float, default=4.0, help="classifier-free guidance scale (default 4.0; 1 = off)")
    s.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0; 0 = greedy)")
    s.add_argument("--top-k", type=int, default=0, help="top-k filter (default 0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="top-p (nucleus) filter in (0, 1] (default 1.0 = off)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--batch-size", type=rows_arg, default=16, metavar="N",
                   help="images in flight, every method (default 16): a finished image's rows go to the next "
                        "image between rounds; tokens do not depend on it in fp64, in fp32 a near-tie can flip "
                        "(docs/batching.md). 'auto': the most that fit the device's free memory once the model is "
                        "loaded (docs/quantization.md)")
    s.add_argument("--static-batches", action="store_true",
                   help="decode --batch-size images at a time to the end instead (for comparison)")
    s.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode rounds with torch.compile (default: on for CUDA, off on the CPU; "
                        "the same tokens either way)")

    # Generated from the method option dataclasses. All default to None ("not given"): the method
    # registry drops None so the method's own default applies.
    mo = g.add_argument_group("method options (default: the method's own)")
    for fl in method_flags():
        mo.add_argument(fl.flag, type=fl.type, default=None, help=fl.help.replace("%", "%%"))

    o = g.add_argument_group("output")
    o.add_argument("--out", default="out", metavar="DIR",
                   help="output folder (default ./out), created if missing; an earlier run's tokens.npz, "
                        "stats.json and NNNNNN.png there are replaced, other files are left alone")
    o.add_argument("--no-images", action="store_true", help="do not decode PNGs even with a tokenizer")
    o.add_argument("--no-clean-captions", action="store_true",
                   help="pass prompts to the T5 tokenizer unchanged (default: cleaned as LlamaGen does)")
    o.add_argument("--profile", default=None, metavar="PATH", help="write a torch.profiler (Chrome) trace here")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_flag(o)
    g.set_defaults(func=cmd_generate)

    from .dataset_cli import add_dataset_parser

    add_dataset_parser(sub, generate_parser=g)

    from .serving.cli import add_serve_parser

    add_serve_parser(sub, generate_parser=g).set_defaults(func=cmd_serve)

    z = sub.add_parser("zoo", help="the shipped model family")
    zsub = z.add_subparsers(dest="zoo_command", metavar="ZOO_COMMAND")
    zsub.required = True
    zl = zsub.add_parser("list", help="list the shipped models")
    zl.set_defaults(func=cmd_zoo_list)
    zt = zsub.add_parser("train", help="retrain the Zoo's models (fixed seeds; --grid 32: the 32x32 member)")
    zt.add_argument("--out", default="zoo-retrained", metavar="DIR",
                    help="where to write the checkpoints (default ./zoo-retrained; the shipped ones are never "
                         "overwritten unless you name their folder)")
    zt.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    zt.add_argument("--resume", action="store_true",
                    help="keep the stages whose outputs already exist in --out (after an interrupted run)")
    zt.add_argument("--grid", type=int, default=16, choices=(16, 32),
                    help="16: the whole 64-px Zoo (default); 32: zoo-gpt-32 and zoo-drafter-32 at 128 px on the "
                         "shipped zoo-vq, fine-tuned from the shipped zoo-gpt (python -m vvs_engine.training.zoo "
                         "--grid 32 has every option)")
    add_threads_flag(zt)
    zt.set_defaults(func=cmd_zoo_train)

    e = sub.add_parser("eval", help="quality metrics of a generate output folder")
    e.add_argument("--images", required=True, metavar="DIR", help="a `generate` output folder")
    e.add_argument("--out", default=None, metavar="JSON",
                   help="metrics file (default: metrics.json in the --images folder, beside the images it scores)")
    e.add_argument("--no-inception", action="store_true",
                   help="skip FID and precision/recall (the Inception network: slow on a CPU)")
    e.add_argument("--target", default=None, metavar="MODEL",
                   help="also the sampling gap D of the folder's tokens.npz under this target (a Zoo target: "
                        "zoo-gpt, zoo-gpt-32, or a GPT checkpoint) at the run's sampling (stats.json): mean over "
                        "tokens of NLL - entropy, 0 for an exact sampler (docs/quality_speed.md)")
    add_threads_flag(e)
    e.set_defaults(func=cmd_eval)

    # These parse their own flags: main() hands everything after the subcommand over as a list
    # (see PASSTHROUGH); they are listed here for `vvs-engine --help`.
    sub.add_parser("bench", help="speed benchmarks (flags: vvs-engine bench --help)", add_help=False)
    sub.add_parser("train-drafter", help="train an EAGLE-style drafter (flags: vvs-engine train-drafter --help)",
                   add_help=False)
    return p


# --- generate -----------------------------------------------------------------------------------
def parse_class_labels(text: str) -> List[int]:
    """"3,141,207" -> [3, 141, 207]; "0-3" -> [0, 1, 2, 3]: the syntax of generate-dataset, so both
    commands read --class-labels alike. The range is checked later, against the model's config."""
    from .dataset import parse_label_ranges

    return parse_label_ranges(text)


def read_prompts(path: str) -> List[str]:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except OSError as e:
        raise VVSError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise VVSError(f"prompts file {path} is not UTF-8 text") from None
    if not prompts:
        raise VVSError(f"prompts file {path} holds no prompts")
    return prompts


def pick_device(name: str) -> str:
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def method_options(args) -> dict:
    """The method flags as ``Engine.generate`` keyword options (None = not given)."""
    return {fl.name: getattr(args, fl.name) for fl in method_flags()}


# Options that the sampling and dataset checks name in words (they serve the Python API too); in the CLI
# every option is named as its flag. Multi-word names are replaced anywhere, single words only as the
# subject that starts the message ("seed must be ..."), because elsewhere they are ordinary words.
SPELLED_OPTIONS = {"shard size": "--shard-size", "batch size": "--batch-size", "batch-size": "--batch-size",
                   "per-class": "--per-class", "max retries": "--max-retries"}
SUBJECT_OPTIONS = {"temperature": "--temperature", "top-k": "--top-k", "top-p": "--top-p",
                   "cfg-scale": "--cfg-scale", "seed": "--seed", "workers": "--workers", "threads": "--threads"}


def flag_names(message: str) -> str:
    """An option error in CLI terms: ``lantern_delta`` -> ``--lantern-delta``, ``tree must`` -> ``--tree must``,
    ``top-p must`` -> ``--top-p must``, ``shard size 20`` -> ``--shard-size 20``. Flags already spelled
    as flags are left alone."""
    for words, flag in SPELLED_OPTIONS.items():
        message = re.sub(rf"(?<![\w-]){re.escape(words)}(?![\w-])", flag, message)
    for word, flag in SUBJECT_OPTIONS.items():
        message = re.sub(rf"^{re.escape(word)}(?= (?:must|is|needs) )", flag, message)
    for fl in method_flags():
        if "_" not in fl.name:
            # one-word options (tree, accept, select) are ordinary words elsewhere in a message: only the
            # subject of "... must/is/needs" at its start names the option
            message = re.sub(rf"^{re.escape(fl.name)}(?= (?:must|is|needs) )", fl.flag, message)
            continue
        names = "|".join(re.escape(n) for n in {fl.name, fl.flag[2:]})
        message = re.sub(rf"(?<![\w-])(?:{names})(?![\w-])", fl.flag, message)
    return message


def prepare_out_dir(path: str) -> str:
    """Create the output folder (or accept an existing one) and check that it is writable, before any
    model is loaded. A generate-dataset folder is refused: its PNGs share the names of ours."""
    if not path:
        raise VVSError("--out is empty: name the output folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise VVSError(f"--out {path} is a file, not a folder")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        raise VVSError(f"--out {path} holds a generate-dataset dataset (manifest.json): generate would replace "
                       f"its PNGs; use another folder")
    head = os.path.abspath(path)
    while not os.path.exists(head):
        head = os.path.dirname(head)
    if not os.path.isdir(head):
        raise VVSError(f"--out {path}: {head} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise VVSError(f"cannot create the output folder {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise VVSError(f"the output folder {path} is not writable")
    return path


def resolve_model_flag(args) -> None:
    """``--model NAME`` (a Zoo target) -> the files it names in ``args.gpt_ckpt`` / ``vq_ckpt`` / ``drafter``
    (flags given explicitly win), so every later check and the loader see ordinary paths."""
    from .zoo import resolve_model

    args.gpt_ckpt, args.vq_ckpt, args.drafter = resolve_model(args.model, args.gpt_ckpt, args.vq_ckpt, args.drafter,
                                                              args.model_dir, cli=True)


def apply_preset(args, peek_shape) -> None:
    """``--preset NAME`` -> ``args.method`` and its option flags, for the target's grid (``vvs_engine.presets``)."""
    from .presets import resolve_preset

    given = [fl.name for fl in method_flags() if getattr(args, fl.name, None) is not None]
    if args.method != "ar" or given:
        named = ["--method"] * (args.method != "ar") + ["--" + n.replace("_", "-") for n in given]
        raise VVSError(f"--preset sets the method and its options: give --preset or {', '.join(named)}, not both")
    shape = peek_shape(args.gpt_ckpt, args.vq_ckpt) if args.model_dir is None and args.image_size is None else None
    if shape is None:
        raise VVSError("--preset needs a Zoo target (its grid picks the preset); choose --method for this model")
    args.method, opts = resolve_preset(args.preset, shape.tokens_per_image)
    for name, value in opts.items():
        setattr(args, name, value)


def cmd_generate(args) -> int:
    from .engine import (Engine, check_batch_fits, check_load_args, check_method_fits, check_seed, peek_shape,
                         resolve_device, resolve_dtype)
    from .methods import get_method_options
    from .sampling import SamplingParams

    # Everything that can be checked without the model is checked first, so bad flags fail in
    # milliseconds instead of after loading a multi-GB checkpoint.
    if args.class_labels is not None and args.prompts is not None:
        raise VVSError("give either --class-labels or --prompts, not both")
    if args.class_labels is None and args.prompts is None:
        raise VVSError("give --class-labels (class-conditional) or --prompts FILE (text-conditional)")
    resolve_model_flag(args)
    check_load_args(gpt_ckpt=args.gpt_ckpt, gpt_model=args.gpt_model, vq_ckpt=args.vq_ckpt, drafter=args.drafter,
                    t5_path=args.t5_path, model_dir=args.model_dir, max_prompt_tokens=args.max_prompt_tokens,
                    image_size=args.image_size, cli=True, vq_model=args.vq_model)
    if args.preset is not None:
        apply_preset(args, peek_shape)
    labels = parse_class_labels(args.class_labels) if args.class_labels is not None else None
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.cfg_scale).validate()
    check_seed(args.seed)
    auto_rows = args.batch_size == "auto"
    if not auto_rows and args.batch_size < 1:
        raise VVSError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    device = str(resolve_device(pick_device(args.device)))
    from .models.quantize import check_quantize

    check_quantize(args.quantize, device, resolve_dtype(args.dtype), flag="--quantize")
    from .methods import method_names

    if args.method not in method_names():
        raise VVSError(f"unknown method '{args.method}'; known: {', '.join(method_names())}")
    try:
        opts = get_method_options(args.method, method_options(args))
        if getattr(opts, "accept", None) is not None:  # the rule is looked up only when the method starts
            from .acceptance.registry import check_rule_name

            check_rule_name(opts.accept)
        # a project checkpoint's config (the Zoo's) tells the image and vocabulary before loading
        shape = peek_shape(args.gpt_ckpt, args.vq_ckpt) if args.model_dir is None and args.image_size is None else None
        if shape is not None:
            check_method_fits(shape, opts)
            if not auto_rows:
                check_batch_fits(shape, opts, len(labels or prompts), args.batch_size, params.use_cfg, device,
                                 args.dtype)
    except VVSError as e:
        raise VVSError(flag_names(str(e))) from None
    from .dataset import check_conditions

    # labels or prompts against the model's kind and classes, from its config (no weights read)
    check_conditions({"gpt_ckpt": args.gpt_ckpt, "model_dir": args.model_dir}, labels, prompts)
    prepare_out_dir(args.out)
    if args.profile:
        check_writable_file(args.profile, "--profile")
    threads = apply_threads(args.threads)

    engine = Engine.load(gpt_ckpt=args.gpt_ckpt, gpt_model=args.gpt_model, vq_ckpt=args.vq_ckpt,
                         vq_model=args.vq_model, image_size=args.image_size, drafter=args.drafter,
                         device=device, dtype=args.dtype, t5_path=args.t5_path, model_dir=args.model_dir,
                         max_prompt_tokens=args.max_prompt_tokens, threads=threads, quantize=args.quantize,
                         deterministic=bool(args.deterministic))
    if auto_rows:  # with the weights loaded, the free memory is what the decode state may take
        try:
            args.batch_size = engine.auto_rows(args.method, args.cfg_scale, cap=len(labels or prompts),
                                               flag="--batch-size", **method_options(args))
        except VVSError as e:
            raise VVSError(flag_names(str(e))) from None
        print(f"--batch-size auto: {args.batch_size} images in flight", file=sys.stderr)
    if prompts is not None:
        enc = engine.caption_encoder
        if engine.config.model_type == "t2i" and enc is not None and enc.dim != engine.config.caption_dim:
            raise VVSError(f"T5 features have {enc.dim} channels but the model expects {engine.config.caption_dim}")

    def run():
        try:
            return engine.generate(class_labels=labels, prompts=prompts, method=args.method,
                                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                   cfg_scale=args.cfg_scale, seed=args.seed, decode_images=not args.no_images,
                                   progress=not args.quiet, clean_captions=not args.no_clean_captions,
                                   batch_size=args.batch_size, compile=args.compile,
                                   static_batches=getattr(args, "static_batches", False), **method_options(args))
        except VVSError as e:
            raise VVSError(flag_names(str(e))) from None

    from .measure.profiling import torch_trace

    with torch_trace(args.profile):
        out = run()
    if args.profile:
        if not os.path.isfile(args.profile):
            raise VVSError(f"--profile: torch.profiler wrote no trace to {args.profile}")
        print(f"profiler trace: {args.profile}", file=sys.stderr)

    write_outputs(args.out, out)
    print_stats(out.stats, args.out, len(out.images))
    return 0


def cmd_serve(args) -> int:
    from .serving.cli import serve

    return serve(args, method_options(args), pick_device(args.device))


def json_ready(x):
    """Stats may hold tensors, numpy values and infinities; JSON wants plain numbers (inf -> null)."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(x, "item") and not isinstance(x, (list, dict, str)):
        try:
            x = x.item()
        except (ValueError, TypeError):
            x = x.tolist()
    if isinstance(x, dict):
        return {str(k): json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


OWNED_FILE = re.compile(r"^(tokens\.npz|stats\.json|grid\.png|\d{6}\.png)$")
GRID_IMAGES, GRID_COLUMNS, GRID_CELL_PX = 64, 8, 256  # the contact sheet: the first 64 images, 8 a row


def contact_sheet(images) -> "object":
    """``grid.png``: the first ``GRID_IMAGES`` images in rows of ``GRID_COLUMNS``, in row order of
    tokens.npz, each at most ``GRID_CELL_PX`` px, 2 px apart on white."""
    from PIL import Image

    images = list(images)[:GRID_IMAGES]
    w, h = images[0].size
    scale = min(1.0, GRID_CELL_PX / max(w, h))
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    cols = min(GRID_COLUMNS, len(images))
    rows = -(-len(images) // cols)
    gap = 2
    sheet = Image.new("RGB", (cols * cw + (cols - 1) * gap, rows * ch + (rows - 1) * gap), (255, 255, 255))
    for i, img in enumerate(images):
        cell = img.convert("RGB") if scale == 1.0 else img.convert("RGB").resize((cw, ch), Image.BICUBIC)
        sheet.paste(cell, ((i % cols) * (cw + gap), (i // cols) * (ch + gap)))
    return sheet


def write_outputs(out_dir: str, out) -> None:
    """tokens.npz (tokens int64 [n, T], labels int64 [n] (-1 for prompts), prompts for t2i),
    stats.json, and 000000.png, 000001.png, ... in row order.

    The run is written to a temporary folder first; then the files an earlier run left here
    (``OWNED_FILE`` names only) are removed and the new ones moved in, so the PNGs always match
    tokens.npz and a failed write leaves the earlier run untouched."""
    import shutil
    import tempfile

    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".vvs-run-", dir=out_dir)
    try:
        tokens = out.tokens.cpu().numpy().astype(np.int64)
        n = tokens.shape[0]
        arrays = {"tokens": tokens}
        if out.labels is not None:
            arrays["labels"] = np.asarray(out.labels, dtype=np.int64)
        else:
            arrays["labels"] = np.full(n, -1, dtype=np.int64)
            arrays["prompts"] = np.asarray(out.prompts, dtype=np.str_)
        np.savez(os.path.join(tmp, "tokens.npz"), **arrays)
        stats = dict(out.stats)
        if out.labels is not None:
            stats["labels"] = list(out.labels)
        with open(os.path.join(tmp, "stats.json"), "w") as f:
            json.dump(json_ready(stats), f, indent=2)
        # Zero-padded names: sorting the file names gives the row order of tokens.npz.
        for i, img in enumerate(out.images):
            img.save(os.path.join(tmp, f"{i:06d}.png"))
        if out.images:
            contact_sheet(out.images).save(os.path.join(tmp, "grid.png"))
        for name in os.listdir(out_dir):
            if OWNED_FILE.match(name) and os.path.isfile(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        for name in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_stats(stats: dict, out_dir: str, n_png: int) -> None:
    wall = stats.get("wall_time_s") or 0.0
    rows = [("method", stats.get("method")), ("images", stats.get("n_images")),
            ("tokens / image", stats.get("tokens_per_image")),
            ("tokens generated", stats.get("tokens_generated")),
            ("target forward passes", stats.get("target_forward_passes")),
            ("tokens / forward (tpf)", _fmt(stats.get("tpf"))),
            ("tpf per image min/median/max", "/".join(_fmt(stats["tpf_per_image"][k]) for k in ("min", "median", "max"))
             if "tpf_per_image" in stats else "-"),
            ("wall time (s)", _fmt(wall)),
            ("tokens / s", _fmt(stats["tokens_generated"] / wall) if wall else "-")]
    shown = {"method", "n_images", "tokens_per_image", "tokens_generated", "target_forward_passes", "tpf",
             "wall_time_s", "sampling", "labels"}
    # Method-specific scalars (mean accepted length, skip steps, ...) follow the common ones.
    rows += [(k, _fmt(v)) for k, v in stats.items()
             if k not in shown and isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    width = max(len(k) for k, _ in rows)
    print(f"{'stat':<{width}}  value")
    print(f"{'-' * width}  {'-' * 12}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"wrote {out_dir}/tokens.npz, stats.json" + (f", {n_png} PNG{'' if n_png == 1 else 's'} and grid.png (contact sheet)" if n_png else ""))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


# --- other subcommands: thin dispatch to the modules that implement them -------------------------
def call(module: str, attr: str, *args):
    """Call ``module.attr(*args)``; a missing optional dependency is a one-line error, not a traceback."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "vvs_engine":
            raise
        raise VVSError(f"this command needs the Python package '{(e.name or '?').split('.')[0]}' "
                       f"(pip install -e \".[zoo]\")") from None
    return getattr(mod, attr)(*args)


def cmd_zoo_list(args) -> int:
    return _exit_code(call("vvs_engine.zoo", "cli_list"))


ZOO_EXTRA = ("skimage", "sklearn", "matplotlib")  # the Zoo's photos ship in these (pip install -e ".[zoo]")


def require_zoo_extra(what: str) -> None:
    """The Zoo's training photos come from the `.[zoo]` extra: say so in one line before any work."""
    import importlib.util

    missing = [m for m in ZOO_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise VVSError(f"{what} needs the Zoo photos from scikit-image, scikit-learn and matplotlib "
                       f"({', '.join(missing)} missing): pip install -e \".[zoo]\"")


def cmd_zoo_train(args) -> int:
    require_zoo_extra("zoo train")
    prepare_out_dir(args.out)
    threads = apply_threads(args.threads)
    if args.grid == 32:
        return _exit_code(call("vvs_engine.training.zoo", "train_grid32", args.out, args.seed, None, None,
                               args.resume, print, threads))
    return _exit_code(call("vvs_engine.training.zoo", "train_all", args.out, args.seed, None, None, args.resume,
                           print, threads))


def cmd_eval(args) -> int:
    if args.out == "":
        raise VVSError("--out is empty: name the metrics file (or leave --out out: metrics.json beside the images)")
    if not os.path.isdir(args.images):
        raise VVSError(f"not a folder: {args.images}")
    out_json = args.out or os.path.join(args.images, "metrics.json")
    check_writable_file(out_json, "--out" if args.out else "eval's metrics file")  # before minutes of compute
    apply_threads(args.threads)
    gap_args = (None, args.target) if args.target else ()  # (inception_path, target): the sampling gap when asked
    metrics = call("vvs_engine.evaluation.report", "evaluate_dir", args.images, None, not args.no_inception, *gap_args)
    if not isinstance(metrics, dict):
        return _exit_code(metrics)
    print(json.dumps(json_ready(metrics), indent=2))  # shown even if writing the file fails
    for note in metrics.get("warnings", []):
        print(f"warning: {note}", file=sys.stderr)
    try:
        with open(out_json, "w") as f:
            json.dump(json_ready(metrics), f, indent=2)
    except OSError as e:
        raise VVSError(f"the metrics above could not be written to {out_json}: {e.strerror or e}") from None
    print(f"wrote {out_json}", file=sys.stderr)
    return 0


def cmd_bench(rest: List[str]) -> int:
    return _exit_code(call("vvs_engine.evaluation.bench", "main", rest))


def cmd_train_drafter(rest: List[str]) -> int:
    return _exit_code(call("vvs_engine.training.drafter", "cli_train", rest))


# Subcommands that own their flags: they receive the rest of the command line unparsed.
PASSTHROUGH = {"bench": cmd_bench, "train-drafter": cmd_train_drafter}


def _exit_code(result) -> int:
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


# --- entry point --------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 user error, 2 bad arguments, 130 interrupted by Ctrl-C,
    143 terminated by SIGTERM)."""
    end_of_startup()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, raise_terminated) if in_main_thread else None
    try:
        return run_command(sys.argv[1:] if argv is None else list(argv))
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)


def run_command(argv: List[str]) -> int:
    command = None
    try:
        if argv and argv[0] in PASSTHROUGH:
            return PASSTHROUGH[argv[0]](argv[1:])
        args = build_parser().parse_args(argv)
        command = args.command
        return args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (VVSError, ValueError, OSError) as e:
        # VVSError is a ValueError. OSError covers unwritable output folders, full disks and the like.
        message = _one_line(e)
        if isinstance(e, VVSError) and command in ("generate", "generate-dataset", "serve"):
            message = flag_names(message)  # the checks are shared with the Python API, which names no flags
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        terminated = isinstance(e, Terminated)
        print(f"error: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
