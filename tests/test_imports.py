"""The Python package's imports flow one way: no module imports, even inside a function, a
module that imports it back through any chain. A function-level import is then only ever a
lazy one (the native library, a slow third-party package), never a circle in disguise.

And each module belongs to a layer (docs/ARCHITECTURE.md, "Layers") that imports only from
its own layer and those below it."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "python" / "kairox"

# lowest first
LAYERS = {
    # ctypes mirror of the C API, the native library's finder, GGUF reading and writing, the
    # numpy reference model, argument types
    "base": "_version capi _native argtypes gguf_header gguffile checkpoint reference default_model",
    "pack format": "pack stats",
    # pure numpy references of the runtime's policies: balancer, thresholds, placement, budget
    "policies": "costs balancer thresholds plan budget",
    # the binding: kairox.Llama, the native TAM replay, measurement helpers
    "runtime": "llama tam bench",
    # what turns a model into a pack: profiling, fitting, grouping, preparing, converting, synthesizing
    "offline": "predictor fit grouping profile prepare convert synth tiny",
    "tools": "hw server tools report trace",
    "cli": "cli packcli balancecli __main__ __init__",
}


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in PKG.glob("*.py")}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that `path` imports anywhere in its text."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "kairox" if node.level == 1 else node.module if node.level == 0 else None
            mod = node.module if node.level == 1 else None
            if node.level == 0 and node.module and node.module.startswith("kairox"):
                base, _, mod = node.module.partition(".")
            if base != "kairox":
                continue
            if mod:
                out.add(mod.split(".")[0])
            else:  # from . import x: a module, or a name of the package's __init__
                out.update(a.name if a.name in modules else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "kairox":
                    out.add(parts[1] if len(parts) > 1 else "__init__")
    return {m for m in out if m in modules and m != path.stem}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path a -> ... -> a, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = 2
        return None
    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return None


def test_the_finder_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_reads_every_form_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from .a import x\nimport kairox.b\nfrom kairox.c import y\n"
                   "def f():\n    from . import d, __version__\n    from kairox import e\n")
    assert _imports(src, {"a", "b", "c", "d", "e", "__init__", "m"}) == {"a", "b", "c", "d", "e", "__init__"}


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_has_a_layer_and_imports_downward() -> None:
    rank = {m: i for i, names in enumerate(LAYERS.values()) for m in names.split()}
    graph = import_graph()
    assert set(graph) == set(rank), f"layers to assign: {sorted(set(graph) - set(rank))}; " \
                                     f"gone: {sorted(set(rank) - set(graph))}"
    names = list(LAYERS)
    up = [f"{a} ({names[rank[a]]}) -> {b} ({names[rank[b]]})"
          for a, bs in sorted(graph.items()) for b in sorted(bs) if rank[b] > rank[a]]
    assert not up, "imports up the layers: " + "; ".join(up)
