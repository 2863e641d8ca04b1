"""``vvs-engine generate-dataset``: the command line of :mod:`vvs_engine.dataset`.

The model, sampling and method flags are those of ``generate`` (copied from its parser, so the two
commands cannot drift apart); conditions, output and Ray flags are its own.
"""
from __future__ import annotations

import copy
import sys

from . import dataset
from .errors import VVSError


# generate's flags that generate-dataset does not take (or defines its own way).
OWN_FLAGS = {"help", "class_labels", "prompts", "out", "no_images", "profile", "quiet", "threads", "batch_size"}


def add_dataset_parser(sub, generate_parser) -> None:
    d = sub.add_parser("generate-dataset", help="generate a whole evaluation set as resumable shards (one process "
                                                "or Ray)",
                       description="Generate many images into shard-NNNNN.npz files, PNGs named by global image "
                                   "index and manifest.json. A re-run finishes an interrupted job. Ctrl-C and "
                                   "SIGTERM stop it cleanly (finished shards kept, the run and its per-shard times "
                                   "in manifest.json; exit 130 after Ctrl-C, 143 after SIGTERM). One run at a "
                                   "time may write a folder: a second is refused while the first is alive.")
    # generate's model, sampling and method flags, copied so that the two commands cannot drift apart.
    method_options = []
    for group in generate_parser._action_groups:
        actions = [a for a in group._group_actions if a.dest not in OWN_FLAGS]
        if actions:
            copy_group = d.add_argument_group(group.title)
            for action in actions:
                copy_group._add_action(copy.copy(action))
            if (group.title or "").startswith("method options"):
                method_options += [a.dest for a in actions]
    c = d.add_argument_group("conditions (one of)")
    c.add_argument("--class-labels", default=None, metavar="SPEC",
                   help="class labels and ranges, e.g. 0-999 or 0,3,7-9")
    c.add_argument("--labels-file", default=None, metavar="FILE", help="text file of class labels / ranges")
    c.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts file: COCO captions .json, PartiPrompts-style .tsv (Prompt column) or text, one "
                        "prompt per line (text-conditional models)")
    c.add_argument("--per-class", "--per-prompt", dest="per_class", type=int, default=1, metavar="N",
                   help="images per label / prompt (default 1); image i uses condition i // N")

    o = d.add_argument_group("output")
    o.add_argument("--out", required=True, metavar="DIR", help="output folder (an existing one is resumed)")
    o.add_argument("--shard-size", type=int, default=dataset.DEFAULT_SHARD_SIZE, metavar="N",
                   help=f"images per shard (default {dataset.DEFAULT_SHARD_SIZE}); fixes the files, not the speed")
    batch_type = next(a.type for g in generate_parser._action_groups for a in g._group_actions
                      if a.dest == "batch_size")  # generate's: an integer or 'auto'
    o.add_argument("--batch-size", type=batch_type, default=dataset.DEFAULT_BATCH_SIZE, metavar="N",
                   help=f"images per engine call (default {dataset.DEFAULT_BATCH_SIZE}); 'auto': the most that fit "
                        f"the device's free memory, picked once per job (one process, a project checkpoint)")
    o.add_argument("--no-images", action="store_true", help="write tokens only, no PNGs")
    o.add_argument("--quiet", action="store_true", help="no progress bar")

    r = d.add_argument_group("workers")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: no ADDRESS starts a local cluster of --workers workers; 'auto' or an "
                        "address joins a running cluster (default: this process only)")
    r.add_argument("--workers", type=int, default=None, metavar="N",
                   help="engines (default: one per GPU of the cluster, else one per --threads CPUs)")
    r.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads per worker (default: $OMP_NUM_THREADS, else half the cores, at most 4; "
                        "1 per Ray worker)")
    r.add_argument("--gpus-per-worker", type=float, default=None, metavar="G",
                   help="GPUs per worker (default 1 when the cluster has GPUs, else 0)")
    r.add_argument("--max-retries", type=int, default=dataset.DEFAULT_MAX_RETRIES, metavar="N",
                   help=f"Ray: times a failed shard is retried on another worker (default "
                        f"{dataset.DEFAULT_MAX_RETRIES})")
    d.set_defaults(func=cmd_generate_dataset, method_option_names=tuple(method_options))


def cmd_generate_dataset(args) -> int:
    if not args.out:
        raise VVSError("--out is empty: name the dataset folder")
    given = [x for x in (args.class_labels, args.labels_file, args.prompts) if x is not None]
    if len(given) != 1:
        raise VVSError("give exactly one of --class-labels, --labels-file or --prompts")
    labels = prompts = ids = None
    if args.class_labels is not None:
        labels = dataset.parse_label_ranges(args.class_labels)
    elif args.labels_file is not None:
        labels = dataset.read_labels_file(args.labels_file)
    else:
        ids, prompts = dataset.read_prompt_file(args.prompts)
    device = args.device  # "auto": each worker takes its GPU when it has one (dataset.load_engine)
    from .engine import check_load_args, resolve_dtype
    from .zoo import resolve_model

    # --model NAME (a Zoo target) -> its files; explicit --vq-ckpt / --drafter win
    args.gpt_ckpt, args.vq_ckpt, args.drafter = resolve_model(args.model, args.gpt_ckpt, args.vq_ckpt, args.drafter,
                                                              args.model_dir, cli=True)
    check_load_args(gpt_ckpt=args.gpt_ckpt, gpt_model=args.gpt_model, vq_ckpt=args.vq_ckpt, drafter=args.drafter,
                    t5_path=args.t5_path, model_dir=args.model_dir, max_prompt_tokens=args.max_prompt_tokens,
                    image_size=args.image_size, cli=True, vq_model=args.vq_model)
    from .models.quantize import check_quantize

    # refused here in one line, before any shard: on the device a local worker would take ("auto": its GPU if any)
    check_quantize(args.quantize, dataset.worker_device(device), resolve_dtype(args.dtype), flag="--quantize")
    model = {"gpt_ckpt": args.gpt_ckpt, "gpt_model": args.gpt_model, "vq_ckpt": args.vq_ckpt,
             "vq_model": args.vq_model, "image_size": args.image_size, "drafter": args.drafter, "device": device,
             "dtype": args.dtype, "t5_path": args.t5_path, "model_dir": args.model_dir,
             "max_prompt_tokens": args.max_prompt_tokens, "quantize": args.quantize}
    if args.workers is not None and args.ray is None:
        raise VVSError("--workers counts Ray workers: add --ray (without it one process runs one engine)")
    threads = args.threads if args.threads is not None else (1 if args.ray is not None else None)
    try:
        summary = dataset.generate(
            args.out, class_labels=labels, prompts=prompts, prompt_ids=ids, per_condition=args.per_class,
            method=args.method, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            cfg_scale=args.cfg_scale, seed=args.seed, shard_size=args.shard_size, batch_size=args.batch_size,
            decode_images=not args.no_images, model=model, ray=args.ray, workers=args.workers, threads=threads,
            gpus_per_worker=args.gpus_per_worker, max_retries=args.max_retries, progress=not args.quiet,
            compile=args.compile, static_batches=args.static_batches,
            **{name: getattr(args, name) for name in args.method_option_names})
    except KeyboardInterrupt:
        print(resume_hint(args.out), file=sys.stderr)
        raise
    print_summary(summary, args.out)
    return 0


def resume_hint(out_dir: str) -> str:
    """What an interrupted job left, and how to finish it."""
    try:
        m = dataset.read_manifest(out_dir)
        # a shard file counts only when it reads back whole (a truncated one is redone by the re-run)
        done = sum(1 for k in range(m["n_shards"])
                   if dataset.shard_complete(out_dir, k, range(k * m["shard_size"],
                                                               min((k + 1) * m["shard_size"], m["n_images"])))) if m else 0
    except (VVSError, OSError, KeyError, TypeError):
        m, done = None, 0
    kept = f"{done} of {m['n_shards']} shards are complete in {out_dir}" if m else f"nothing was written to {out_dir}"
    return f"generate-dataset interrupted: {kept}; run the same command again to finish the rest"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_summary(s: dict, out_dir: str) -> None:
    rows = [("method", s.get("method")), ("images (all shards)", s.get("n_images")),
            ("images this run", s.get("images_this_run")), ("shards skipped (done before)", s.get("shards_skipped")),
            ("workers", s.get("workers")), ("start-up (s)", _fmt(s.get("startup_s"))),
            ("mean shard time (s)", _fmt(s.get("mean_shard_s"))), ("job wall time (s)", _fmt(s.get("job_wall_s"))),
            ("images / s", _fmt(s.get("images_per_s"))), ("tokens / forward (tpf)", _fmt(s.get("tpf"))),
            ("retried shards", s.get("retries"))]
    skip = {"method", "n_images", "images_this_run", "shards_skipped", "workers", "startup_s", "mean_shard_s",
            "job_wall_s", "images_per_s", "tpf", "retries", "seed", "tokens_per_image", "shards_this_run"}
    rows += [(k, _fmt(v)) for k, v in s.items()
             if k not in skip and isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"wrote {out_dir}/manifest.json and shard-*.npz")
