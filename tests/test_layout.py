"""The package layout: dependency arrows point one way, and inference never loads training or evaluation."""
import ast
import json
import os
import subprocess
import sys

import vvs_engine

PKG_DIR = os.path.dirname(vvs_engine.__file__)

# Lower rank = lower layer. A module may import its own layer and lower ranks only.
RANK = {
    "errors": 0, "startup": 0,  # startup: the command's first seconds (imports nothing but the standard library)
    "sampling": 1, "rng": 1, "presets": 1, "checkpoint": 1, "zoo": 1, "stats": 1, "threads": 1, "paths": 1,
    "kernels": 2, "triton_kernels": 2,
    "models": 3,
    "runtime": 4,
    "drafting": 5, "acceptance": 5, "measure": 5,  # measure: launches, op counts, profiler ranges of the rounds
    "methods": 6,
    "engine": 7,
    "": 8,  # vvs_engine/__init__.py: the public API
    "dataset": 9,  # dataset-scale generation (one process or Ray); evaluation reads its folders
    "evaluation": 10,
    "training": 11,
    "dataset_cli": 12,  # generate-dataset's flags, built into the CLI's parser
    "serving": 12,  # vvs-engine serve: the server (FastAPI only inside it), its flags built into the CLI's parser
    "cli": 13, "__main__": 14,
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_imports():
    """{module: set of vvs_engine modules it imports}, lazy (function-level) imports included."""
    found = {}
    for root, _, files in os.walk(PKG_DIR):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, os.path.dirname(PKG_DIR))[:-3].replace(os.sep, ".")
            mod = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            pkg = mod if f == "__init__.py" else mod.rsplit(".", 1)[0]
            targets = set()
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                        tgt = ".".join(base + ([node.module] if node.module else []))
                    else:
                        tgt = node.module or ""
                    if tgt.split(".")[0] != "vvs_engine":
                        continue
                    for alias in node.names:  # `from .. import kernels` imports the module vvs_engine.kernels
                        sub = f"{tgt}.{alias.name}"
                        sub_path = os.path.join(os.path.dirname(PKG_DIR), *sub.split("."))
                        targets.add(sub if os.path.isdir(sub_path) or os.path.exists(sub_path + ".py") else tgt)
                elif isinstance(node, ast.Import):
                    targets |= {a.name for a in node.names if a.name.split(".")[0] == "vvs_engine"}
            found[mod] = targets
    return found


def test_every_layer_is_ranked():
    layers = {layer_of(m) for m in module_imports()}
    assert layers <= set(RANK), f"new top-level module(s) without a layer: {sorted(layers - set(RANK))}"


def test_imports_point_down_the_layers():
    wrong = []
    for mod, targets in module_imports().items():
        for tgt in targets:
            a, b = layer_of(mod), layer_of(tgt)
            if tgt != "vvs_engine" and a != b and RANK[b] >= RANK[a]:
                wrong.append(f"{mod} -> {tgt}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_ranking_would_catch_an_upward_import():
    # The check above is only as good as its parser: a known upward edge must be classified as wrong.
    assert RANK[layer_of("vvs_engine.runtime.runner")] < RANK[layer_of("vvs_engine.drafting.session")]
    assert RANK[layer_of("vvs_engine.engine")] < RANK[layer_of("vvs_engine.training.zoo")]
    imports = module_imports()
    assert "vvs_engine.kernels" in imports["vvs_engine.acceptance.verify"]  # `from .. import kernels`
    assert "vvs_engine.training.drafter" in imports["vvs_engine.training.zoo"]  # lazy import inside a function


GENERATE = """
import json, sys
import torch
torch.set_num_threads(1)
import vvs_engine
from vvs_engine import Engine
engine = Engine.load()
out = engine.generate(class_labels=[1], method="eagle", temperature=0.0, decode_images=True)
assert out.tokens.shape[0] == 1 and len(out.images) == 1
out = engine.generate(class_labels=[1], method="gsd", temperature=1.0, decode_images=False)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("vvs_engine"))))
"""


def test_generate_imports_no_training_or_evaluation_module():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", GENERATE], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    assert "vvs_engine.methods.speculative" in loaded and "vvs_engine.drafting.session" in loaded
    leaked = [m for m in loaded if layer_of(m) in ("training", "evaluation", "cli")]
    assert not leaked, f"inference imported {leaked}"


def import_cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan): each is an import cycle."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    """No module reaches itself through imports (lazy ones included); registries load their plugin
    modules by name (``methods.registry.METHOD_MODULES``, ``acceptance.registry``)."""
    assert import_cycles(module_imports()) == []
    # the check finds a cycle when there is one (negative control)
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_DECODER_FIELDS = 20  # issue 50: constants grouped in small frozen dataclasses, device state in one


def class_fields(sources: dict) -> dict:
    """{class name: (fields, methods)} over the classes of ``sources`` ({file name: source}), bases in
    the same sources included. A field is an attribute stored on the instance (``self.x = ...``, or on
    an instance a classmethod builds with ``cls(...)``); properties and class attributes are none."""
    own = {}
    for source in sources.values():
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef):
                continue
            fields, methods = set(), set()
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                methods.add(item.name)
                instances = {item.args.args[0].arg} if item.args.args else set()
                for n in ast.walk(item):
                    if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and \
                            isinstance(n.value.func, ast.Name) and n.value.func.id == "cls":
                        instances |= {t.id for t in n.targets if isinstance(t, ast.Name)}
                for n in ast.walk(item):
                    if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                            isinstance(n.value, ast.Name) and n.value.id in instances and n.value.id != "cls":
                        fields.add(n.attr)
            own[node.name] = ([b.id for b in node.bases if isinstance(b, ast.Name)], fields, methods)

    def gather(name, index):
        bases, *mine = own[name]
        out = set(mine[index])
        for base in bases:
            if base in own:
                out |= gather(base, index)
        return out

    return {name: (gather(name, 0), gather(name, 1)) for name in own}


def loop_decoders(sources: dict) -> dict:
    """{class: fields} of every class with the decoder protocol (``round_functions`` and ``declare_rows``,
    its own or inherited)."""
    return {name: f for name, (f, m) in class_fields(sources).items() if {"round_functions", "declare_rows"} <= m}


def test_no_decoder_class_over_twenty_fields():
    folder = os.path.join(PKG_DIR, "methods")
    sources = {f: open(os.path.join(folder, f), encoding="utf-8").read() for f in os.listdir(folder) if f.endswith(".py")}
    decoders = loop_decoders(sources)
    assert {"ARDecoder", "JacobiDecoder", "PACDecoder", "SpeculativeRounds", "ZipARDecoder"} <= set(decoders)
    over = {name: sorted(f) for name, f in decoders.items() if len(f) > MAX_DECODER_FIELDS}
    assert not over, f"decoder classes over {MAX_DECODER_FIELDS} fields (group constants in frozen dataclasses): {over}"
    # the count sees inherited fields and classmethod-built instances (negative control)
    toy = ("class Base:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(15))
           + "    def round_functions(self): pass\n    def declare_rows(self, t): pass\n"
           "class Child(Base):\n    @classmethod\n    def start(cls):\n        d = cls()\n        d.state = 0\n"
           "    def __init__(self):\n        self.b, self.c = 1, 2\n        self.a0 += 1\n")
    assert {name: len(f) for name, f in loop_decoders({"toy.py": toy}).items()} == {"Base": 15, "Child": 18}
