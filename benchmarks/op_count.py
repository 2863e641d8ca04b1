"""Compute ops per decode round and per committed token for every method on the Zoo model.

On a GPU every dispatched op is at least one kernel launch, so ops per committed token is the launch
budget a method spends for what it saves in target forwards (TPF). Counted on the CPU by
``vvs_engine.measure.opcount.OpCounter`` (aten + vvs:: ops below autograd; views, no-op casts and bare
allocations excluded), over one whole generation (prefill included) of one image, fp32, default
sampling, so the counts are deterministic. A round is an AR step, a verify or skip round, or a Jacobi
iteration; the AR step is the unit. Each method is counted twice: as the CPU runs it (every kernel's
torch reference inlined), and with ``VVS_KERNELS=reference``, which routes each kernel through its
``vvs::`` custom op (one op, as one launch on a GPU) while still computing with the reference. The
compiled columns run the same generation with ``compile=True`` and count, per round kind, the launches
of the code Inductor generated for it (``vvs_engine.measure.launches``: generated kernels + extern GEMMs
+ custom ops + other fallbacks); a method's launches per round average its round kinds by how often
each ran (prefill, which stays eager, is not in them). The compiled launches are counted as a GPU
replays them: Inductor lowers each round to Triton kernels as it does for CUDA (``launches.recording
("gpu")``; the rounds then run eagerly); ``--cpu-compile`` also compiles every round for the CPU (C++)
and records whether its tokens equal the eager ones, and its kernel-function count (not launches: the
C++ backend puts several loop nests in one function). The second table counts one call of
``verify_tree`` on a Zoo-sized tree: the vectorised torch walk against the fused ``vvs::tree_verify`` op.

    python benchmarks/op_count.py                       # writes benchmarks/results/op_count.{md,json}
    python benchmarks/op_count.py --cpu-compile         # also compiled-on-the-CPU tokens (tens of minutes)
    python benchmarks/op_count.py --batch-sizes 1,4,16  # per-B columns once Engine.generate batches
    python benchmarks/op_count.py --quick --out /tmp/oc # two methods, for the test
"""
from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, has_block, replace_block, write_tables  # noqa: E402  (sets the checkout's path first)

from vvs_engine.kernels.backends import ENV  # noqa: E402
from vvs_engine.measure.opcount import OpCounter  # noqa: E402

# (row, method, options): the methods of the issue's table with their default options.
ROWS = [
    ("AR", "ar", {}),
    ("EAGLE-2", "eagle", {}),
    ("LANTERN d=0.2", "lantern", {"lantern_delta": 0.2}),
    ("LANTERN++", "lantern++", {"lantern_lambda": 2.0}),  # the default when the table was made (pinned)
    ("VVS-U i=2", "vvs", {"skip_policy": "uniform", "skip_interval": 2}),
    ("CASCADE", "cascade", {}),
    ("SJD", "sjd", {}),
    ("GSD", "gsd", {}),
    ("SCD", "scd", {"jacobi_window": 16}),  # the defaults when the committed table was made (pinned)
    ("SJD-PAC", "sjd-pac", {"pac_width": 3}),
]
QUICK_ROWS = [ROWS[0], ROWS[2]]
COMMAND = "python benchmarks/op_count.py"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1", help="comma-separated B (B > 1 needs Engine.generate(batch_size=))")
    ap.add_argument("--label", type=int, default=0, help="class label of the image (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="AR and LANTERN only, eager columns (the test's configuration)")
    ap.add_argument("--no-compiled", dest="compiled", action="store_false",
                    help="eager columns only (the compiled ones generate every round kind's Triton code: minutes)")
    ap.add_argument("--cpu-compile", action="store_true",
                    help="also compile every round for the CPU and compare its tokens with eager (tens of minutes)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="output folder")
    return ap.parse_args(argv)


def batching_supported(engine) -> bool:
    return "batch_size" in inspect.signature(engine.generate).parameters


def rounds_of(stats: dict) -> int:
    """Verify + skip rounds of the drafter methods, Jacobi iterations, AR steps."""
    if "verified_steps" in stats:
        return int(stats["verified_steps"]) + int(stats.get("skip_steps", 0))
    return int(stats.get("jacobi_rounds", stats["target_forward_passes"]))


def rounds_by_kind(stats: dict) -> dict:
    """{round kind: how many ran} (the kind names of the compiled rounds)."""
    if "rounds_by_kind" in stats:
        return dict(stats["rounds_by_kind"])
    if "jacobi_rounds" in stats:
        return {"jacobi": int(stats["jacobi_rounds"])}
    return {"ar_step": int(stats["target_forward_passes"])}


def count_compiled(engine, kw, eager_tokens, cpu_compile=False):
    """Compiled launches of each round kind of this generation as a GPU replays them (Inductor's Triton
    code, generated on the CPU), weighted by how often each kind ran; with ``cpu_compile`` also the
    CPU-compiled run's tokens against eager and its C++ kernel functions."""
    from vvs_engine.measure import launches

    with launches.recording("gpu") as codes:
        out = engine.generate(compile=True, **kw)  # code generated, rounds run eagerly
    per_kind = {kind: launches.count(c[0]) for kind, c in codes.items() if kind != "?"}  # one compile per kind at one batch size
    ran = rounds_by_kind(out.stats)
    total = sum(n * per_kind[kind].total for kind, n in ran.items())
    row = dict(compiled_launches_by_kind={k: v.to_dict() for k, v in per_kind.items()}, rounds_by_kind=ran,
               compiled_launches_per_round=total / sum(ran.values()),
               compiled_launches_per_token=total / out.stats["tokens_generated"])
    if cpu_compile:
        with launches.recording("cpu") as cpu_codes:
            compiled = engine.generate(compile=True, **kw)
        assert all(compiled.stats["compiled"].values()), compiled.stats["compiled"]
        row.update(compiled_tokens_equal=bool(torch.equal(compiled.tokens, eager_tokens)),
                   cpu_kernel_functions_by_kind={k: launches.count(c[0]).to_dict() for k, c in cpu_codes.items()
                                                 if k != "?"})
    return row


def count_method(engine, method, opts, label, seed, batch_size, compiled=True, cpu_compile=False):
    kw = dict(class_labels=[label] * batch_size, method=method, seed=seed, decode_images=False, **opts)
    if batch_size > 1:
        kw["batch_size"] = batch_size
    with OpCounter() as ops:
        out = engine.generate(**kw)
    previous = os.environ.get(ENV)
    os.environ[ENV] = "reference"  # every kernel through its custom op: one op each
    try:
        with OpCounter() as kernel_ops:
            again = engine.generate(**kw)
    finally:
        if previous is None:
            os.environ.pop(ENV)
        else:
            os.environ[ENV] = previous
    st = out.stats
    assert torch.equal(out.tokens, again.tokens), "routing through the custom ops changed the tokens"
    tokens = st["tokens_generated"]
    rounds = rounds_of(st)
    row = dict(method=method, compute_ops=ops.compute, host_reads=ops.syncs, rounds=rounds, tokens=tokens,
               ops_per_round=ops.compute / rounds, ops_per_token=ops.compute / tokens, tpf=st["tpf"],
               kernel_ops_per_round=kernel_ops.compute / rounds, kernel_ops_per_token=kernel_ops.compute / tokens,
               eager_kernels_per_round=kernel_ops.compute / rounds, eager_kernels_per_token=kernel_ops.compute / tokens,
               top_ops=ops.by_name.most_common(8))
    if compiled:
        row.update(count_compiled(engine, kw, out.tokens, cpu_compile))
    return row


def verify_call_ops(engine):
    """Compute ops of one verify_tree call on a Zoo-sized dynamic tree (59 nodes, 10 children per
    node at most, the Zoo vocabulary), exact and LANTERN: the torch walk vs the fused op."""
    from types import SimpleNamespace

    from vvs_engine.acceptance.verify import ExactRule, LanternRule, verify_tree_torch
    from vvs_engine.kernels import ops as kernel_ops
    from vvs_engine.drafting.tree import children_table
    from vvs_engine.kernels.reference import tree_meta

    gen = torch.Generator().manual_seed(0)
    N, C, D, V = 59, 10, 4, engine.config.vocab_size
    parents = [-1] + [int(torch.randint(max(0, (i - 1) // 3 - 4), max(1, (i - 1) // 3 + 1), (1,), generator=gen))
                      for i in range(1, N)]
    parents = torch.tensor(parents)
    _, depth, paths, _ = tree_meta(parents, N)
    D = int(depth.max())
    tree = SimpleNamespace(tokens=torch.randint(0, V, (1, N), generator=gen), parents=parents[None],
                           depth=depth[None], paths=paths[None, :, : D + 1], children=children_table(parents, C)[None],
                           q=None, sampled=False)
    p = torch.softmax(3 * torch.randn(1, N, V, generator=gen), -1)
    u_accept, u_sample = 1.0 - torch.rand(1, N, generator=gen), 1.0 - torch.rand(1, generator=gen)
    nb = engine.codebook_neighbors(max(1, V // 16))
    rows = []
    for name, rule, nb_arg, delta in (("exact", ExactRule(), None, 0.0), ("lantern d=0.2", LanternRule(nb, 0.2), nb, 0.2)):
        with OpCounter() as torch_ops:
            verify_tree_torch(tree, p, rule, u_accept, u_sample, False)
        with OpCounter() as fused_ops:
            kernel_ops.tree_verify(tree.tokens, tree.children, p, None, u_accept, u_sample, nb_arg, delta, False, False,
                                   False, D)
        rows.append(dict(rule=name, nodes=N, max_children=C, vocab=V, torch_walk_ops=torch_ops.compute,
                         fused_ops=fused_ops.compute))
    return rows


def render(results, verify_rows, batch_sizes, note) -> str:
    rows = results.get(1, {})
    ar = rows.get("AR")
    unit, unit_k = (ar["ops_per_round"], ar["kernel_ops_per_round"]) if ar else (float("nan"), float("nan"))
    tok, tok_k = (ar["ops_per_token"], ar["kernel_ops_per_token"]) if ar else (float("nan"), float("nan"))
    lines = [f"<!-- written by: {COMMAND} {' '.join(sys.argv[1:])} -->", "",
             "# Compute ops per round (Zoo model, CPU, fp32, one image, default options)", "",
             f"Unit: the AR step = {unit:.1f} compute ops as the CPU runs it, {unit_k:.1f} with every kernel "
             f"as one op (`VVS_KERNELS=reference`, the GPU's launch count). Prefill amortised in. {note}", "",
             "| method | ops per round | x AR step | per committed token | x AR | kernels as ops: per round | x AR step "
             "| per token | x AR | TPF | host reads |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['ops_per_round']:.0f} | {r['ops_per_round'] / unit:.2f} | {r['ops_per_token']:.0f} | "
                     f"{r['ops_per_token'] / tok:.2f} | {r['kernel_ops_per_round']:.0f} | "
                     f"{r['kernel_ops_per_round'] / unit_k:.2f} | {r['kernel_ops_per_token']:.0f} | "
                     f"{r['kernel_ops_per_token'] / tok_k:.2f} | {r['tpf']:.2f} | {r['host_reads']} |")
    if ar and "compiled_launches_per_round" in ar:
        lines += compiled_table(rows)
    extra = [b for b in batch_sizes if b != 1 and b in results]
    if extra:
        lines += ["", "## Per batch size: compute ops per committed token (TPF)", "",
                  "| method | " + " | ".join(f"B={b}" for b in [1] + extra) + " |",
                  "|---|" + "---|" * (1 + len(extra))]
        for name in rows:
            cells = [f"{results[b][name]['ops_per_token']:.0f} ({results[b][name]['tpf']:.2f})"
                     if name in results[b] else "-" for b in [1] + extra]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if verify_rows:
        lines += ["", "## One verify_tree call (59-node tree, batch 1)", "",
                  "| rule | vocab | torch walk ops | fused op ops |", "|---|---|---|---|"]
        for v in verify_rows:
            lines.append(f"| {v['rule']} | {v['vocab']} | {v['torch_walk_ops']} | {v['fused_ops']} |")
    return "\n".join(lines) + "\n"


KIND_ORDER = ("ar_step", "verify", "verify_after_skip", "skip", "jacobi")


def compiled_table(rows) -> list:
    """Compiled launches: per round kind, per method round and per committed token, AR's step the unit."""
    ar = rows["AR"]
    unit = ar["compiled_launches_by_kind"]["ar_step"]["total"]
    tok = ar["compiled_launches_per_token"]
    cpu = any("compiled_tokens_equal" in r for r in rows.values())
    lines = ["", "## Compiled rounds: launches as a GPU replays them (Inductor's Triton code, read on the CPU)", "",
             f"Unit: the compiled AR step = {unit} launches (Triton kernels + extern GEMMs + custom ops + other "
             "fallbacks; Inductor lowers each round to Triton as for CUDA, combo kernels included: "
             "`measure/launches.py`, `recording(\"gpu\")`). Per round kind: launches (kernels + GEMMs + custom ops + "
             "other) and x the compiled AR step. Per round / per token: the method's rounds weighted by how often "
             "each kind ran (eager prefill excluded); eager = the kernels-as-ops count above. Custom ops count one "
             "launch each (at real shapes some launch more: `round_cost.py` adds them)."
             + (" Compiled tokens = eager: the same generation compiled for the CPU (C++), fp32." if cpu else ""), "",
             "| method | round kinds: launches (k + g + c + o), x AR step | compiled launches per round | x AR step "
             "| per committed token | x AR | eager kernels per round | compiled / eager |"
             + (" compiled tokens = eager |" if cpu else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if cpu else "")]
    for name, r in rows.items():
        if "compiled_launches_by_kind" not in r:
            continue
        kinds = sorted(r["compiled_launches_by_kind"].items(), key=lambda kv: KIND_ORDER.index(kv[0])
                       if kv[0] in KIND_ORDER else 99)
        cell = "; ".join(f"{k} {v['total']} ({v['kernels']} + {v['gemms']} + {v['custom_ops']} + {v['other']}), "
                         f"{v['total'] / unit:.2f}x" for k, v in kinds)
        per_round = r["compiled_launches_per_round"]
        lines.append(f"| {name} | {cell} | {per_round:.0f} | {per_round / unit:.2f} | "
                     f"{r['compiled_launches_per_token']:.0f} | {r['compiled_launches_per_token'] / tok:.2f} | "
                     f"{r['eager_kernels_per_round']:.0f} | {per_round / r['eager_kernels_per_round']:.2f} |"
                     + (f" {'yes' if r.get('compiled_tokens_equal') else 'no'} |" if cpu else ""))
    return lines


# The issue's budgets, in compiled AR steps: a dynamic-tree verify round 2.0, a VVS skip round 1.2, a
# Jacobi iteration 1.1 (docs/launches.md).
BUDGETS = {"verify": 2.0, "skip": 1.2, "jacobi": 1.1}
DOC = os.path.join(ROOT, "docs", "launches.md")
DOC_MARKERS = ("<!-- op_count:begin -->", "<!-- op_count:end -->")


def budget_table(rows) -> list:
    """Compiled launches of every round kind against the budgets (docs/launches.md's summary)."""
    unit = rows["AR"]["compiled_launches_by_kind"]["ar_step"]["total"]
    lines = [f"Written by `{COMMAND}` (Zoo, 6 layers, batch 1; Triton code as for CUDA, counted on the CPU). "
             f"Unit: the compiled AR step, {unit} launches.", "",
             "| method | round kind | launches (kernels + GEMMs + custom ops + other) | x AR step | budget | meets it |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        for kind, v in sorted(r.get("compiled_launches_by_kind", {}).items(),
                              key=lambda kv: KIND_ORDER.index(kv[0]) if kv[0] in KIND_ORDER else 99):
            ratio = v["total"] / unit
            budget = BUDGETS.get(kind) if not (kind == "verify" and r["method"] in ("lantern++", "cascade")) else None
            meets = "-" if budget is None else ("yes" if ratio <= budget + 1e-9 else "**no**")
            lines.append(f"| {name} | {kind} | {v['total']} ({v['kernels']} + {v['gemms']} + {v['custom_ops']} + "
                         f"{v['other']}) | {ratio:.2f} | {'-' if budget is None else budget} | {meets} |")
    lines += ["", "The budget of 2.0 is the dynamic tree's (EAGLE-2, LANTERN, VVS); LANTERN++ and CASCADE draft a "
                  "static 58-node tree and have none."]
    return lines


def write_doc(rows) -> None:
    if "AR" not in rows or "compiled_launches_by_kind" not in rows["AR"] or not has_block(DOC, *DOC_MARKERS):
        return
    replace_block(DOC, *DOC_MARKERS, DOC_MARKERS[0] + "\n" + "\n".join(budget_table(rows)) + "\n" + DOC_MARKERS[1])


def write(out_dir, results, verify_rows, batch_sizes, note, meta) -> str:
    md = render(results, verify_rows, batch_sizes, note)
    write_tables(os.path.join(out_dir, "op_count"), md,
                 dict(meta=meta, results={str(b): r for b, r in results.items()}, verify_call=verify_rows))
    return md


def main(argv=None, engine=None):
    """Runs the table; ``engine`` defaults to the shipped Zoo model (the test passes a tiny one)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    if engine is None:
        from vvs_engine import Engine

        engine = Engine.load()
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")} | {1})
    note = ""
    if not batching_supported(engine) and batch_sizes != [1]:
        note = "Engine.generate has no batch_size yet: B = 1 only."
        batch_sizes = [1]
    rows = QUICK_ROWS if args.quick else ROWS
    meta = dict(command=f"{COMMAND} {' '.join(argv if argv is not None else sys.argv[1:])}".strip(),
                torch=torch.__version__, python=platform.python_version(), label=args.label, seed=args.seed)
    verify_rows = verify_call_ops(engine)
    for v in verify_rows:
        print(f"verify_tree {v['rule']}: torch walk {v['torch_walk_ops']} ops, fused {v['fused_ops']} ops")
    results = {}
    for b in batch_sizes:
        results[b] = {}
        for name, method, opts in rows:
            r = count_method(engine, method, opts, args.label, args.seed, b, compiled=args.compiled and not args.quick and b == 1,
                             cpu_compile=args.cpu_compile)
            results[b][name] = r
            print(f"B={b} {name:16s} ops/round {r['ops_per_round']:8.1f}  ops/token {r['ops_per_token']:8.1f}  "
                  f"kernels as ops: {r['kernel_ops_per_round']:8.1f} / {r['kernel_ops_per_token']:8.1f}  "
                  f"tpf {r['tpf']:.2f}  host reads {r['host_reads']}"
                  + (f"  compiled launches/round {r['compiled_launches_per_round']:.1f} "
                     f"{ {k: v['total'] for k, v in r['compiled_launches_by_kind'].items()} }"
                     if "compiled_launches_per_round" in r else ""), flush=True)
            write(args.out, results, verify_rows, batch_sizes, note, meta)  # partial tables survive a stop
    print(write(args.out, results, verify_rows, batch_sizes, note, meta))
    if os.path.abspath(args.out) == os.path.join(ROOT, "benchmarks", "results") and 1 in results:
        write_doc(results[1])
    return results


if __name__ == "__main__":
    main()
