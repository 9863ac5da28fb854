"""The Python package's imports flow one way: no module imports, even inside a function, a
module that imports it back through any chain. A function-level import is then only ever a
lazy one (the native library, a slow third-party package), never a circle in disguise.

And each module belongs to a layer (docs/ARCHITECTURE.md, "Layers") that imports only from
its own layer and those below it. A module is named by its path inside the package: `pack`,
`cli` (the subpackage kairox/cli/), `cli.pack`; the package's own __init__.py is `__init__`.
The command line (kairox.cli) is the top layer: no library module imports it."""
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
    # pure numpy references of the runtime's policies: balancer, its back-off, its two-level
    # cache, thresholds, placement, budget, migration, decode threads
    "policies": "costs balancer backoff neuron_cache thresholds plan budget migrate threads",
    # the binding: kairox.Llama, the native TAM replay, measurement helpers
    "runtime": "llama tam bench",
    # what turns a model into a pack: profiling, fitting, grouping, preparing, converting, synthesizing;
    # the workloads that profile it
    "offline": "predictor fit grouping profile quality threshold_search prepare convert synth tiny workload",
    "tools": "hw server tools report trace",
    # the command line: kairox.cli, one module per subcommand group; `python -m kairox`
    "cli": "cli cli.__main__ cli.run cli.convert cli.synth cli.pack cli.prepare cli.stats cli.plan cli.hw "
           "cli.trace cli.balance cli.report __main__ __init__",
}

# the modules that may import the command line: its own and `python -m kairox`
CLI = "cli"
CLI_USERS = {"__main__"}


def _name(path: Path, root: Path = PKG) -> str:
    """The module's name inside the package: `pack`, `cli` (cli/__init__.py), `cli.pack`;
    the package's own __init__.py stays `__init__`."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules(root: Path = PKG) -> dict[str, Path]:
    """Every module of the package and its subpackages (folders with an __init__.py; data
    folders are not)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        folders = p.relative_to(root).parts[:-1]
        if all((root.joinpath(*folders[:n]) / "__init__.py").is_file() for n in range(1, len(folders) + 1)):
            out[_name(p, root)] = p
    return out


def _resolve(target: str, modules: set[str]) -> str | None:
    """The module that importing `target` (a dotted name inside the package, "" for the
    package itself) reads: the longest prefix of it that is a module."""
    if not target:
        return "__init__"
    parts = target.split(".")
    return next((m for n in range(len(parts), 0, -1) if (m := ".".join(parts[:n])) in modules), None)


def _imports(path: Path, modules: set[str], root: Path = PKG) -> set[str]:
    """Modules of the package that `path` imports anywhere in its text."""
    package = path.parent.relative_to(root).parts  # what `from . import` means in path
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(package):
                    continue  # above the package
                base = package[:len(package) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module == "kairox" or (node.module or "").startswith("kairox."):
                target = node.module.partition(".")[2]
            else:
                continue
            for a in node.names:  # from X import a: the module X.a where there is one, else X
                sub = f"{target}.{a.name}" if target else a.name
                out.add(sub if sub in modules else _resolve(target, modules))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "kairox" or a.name.startswith("kairox."):
                    out.add(_resolve(a.name.partition(".")[2], modules))
    me = _name(path, root)
    return {m for m in out if m is not None and m != me}


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(root)
    return {m: _imports(p, set(mods), root) for m, p in mods.items()}


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


def up_imports(graph: dict[str, set[str]], layers: dict[str, str]) -> list[str]:
    """Each import of a module from a higher layer, as `a (its layer) -> b (its layer)`."""
    rank = {m: i for i, names in enumerate(layers.values()) for m in names.split()}
    names = list(layers)
    return [f"{a} ({names[rank[a]]}) -> {b} ({names[rank[b]]})"
            for a, bs in sorted(graph.items()) for b in sorted(bs) if rank[b] > rank[a]]


def cli_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of the command line by a module outside it, as `a -> b`."""
    def in_cli(m: str) -> bool:
        return m == CLI or m.startswith(CLI + ".")
    return [f"{a} -> {b}" for a, bs in sorted(graph.items()) if not in_cli(a) and a not in CLI_USERS
            for b in sorted(bs) if in_cli(b)]


def test_the_layer_checks_see_a_wrong_import() -> None:
    layers = {"low": "a", "high": "b cli cli.x __main__"}
    assert up_imports({"a": {"b"}, "b": set()}, layers) == ["a (low) -> b (high)"]
    assert up_imports({"a": set(), "b": {"a"}}, layers) == []
    assert cli_imports({"a": {"cli.x"}, "b": {"cli"}, "cli": {"cli.x", "a"}, "cli.x": {"a"},
                        "__main__": {"cli"}}) == ["a -> cli.x", "b -> cli"]


def test_the_graph_reads_every_form_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from .a import x\nimport kairox.b\nfrom kairox.c import y\n"
                   "def f():\n    from . import d, __version__\n    from kairox import e\n")
    mods = {"a", "b", "c", "d", "e", "__init__", "m", "sub", "sub.x", "sub.y", "sub.z", "sub.w"}
    assert _imports(src, mods, tmp_path) == {"a", "b", "c", "d", "e", "__init__"}
    # in a subpackage: `.` is the subpackage, `..` the package; a subpackage's modules by dotted name
    (tmp_path / "sub").mkdir()
    src = tmp_path / "sub" / "x.py"
    src.write_text("from . import y, helper\nfrom .z import q\nfrom .. import a, __version__\n"
                   "from ..b import r\nimport kairox.sub.w\nfrom kairox.sub import x\nfrom kairox import sub\n"
                   "from kairox.c.inner import s\nfrom ... import beyond\n")
    assert _imports(src, mods, tmp_path) == {"sub.y", "sub", "sub.z", "a", "__init__", "b", "sub.w", "c"}
    (tmp_path / "sub" / "__init__.py").write_text("from .x import f\n")
    assert _imports(tmp_path / "sub" / "__init__.py", mods, tmp_path) == {"sub.x"}


def test_modules_are_named_by_their_path_in_the_package(tmp_path: Path) -> None:
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/x.py", "data/not_a_module.py"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).write_text("")
    assert set(_modules(tmp_path)) == {"__init__", "a", "sub", "sub.x"}


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_has_a_layer_and_imports_downward() -> None:
    placed = {m for names in LAYERS.values() for m in names.split()}
    graph = import_graph()
    assert set(graph) == placed, f"layers to assign: {sorted(set(graph) - placed)}; gone: {sorted(placed - set(graph))}"
    up = up_imports(graph, LAYERS)
    assert not up, "imports up the layers: " + "; ".join(up)


def test_the_library_does_not_import_the_command_line() -> None:
    graph = import_graph()
    assert {m for m in graph if m == CLI or m.startswith(CLI + ".")} >= {"cli", "cli.run", "cli.pack"}
    wrong = cli_imports(graph)
    assert not wrong, "imports of kairox.cli from outside it: " + "; ".join(wrong)
