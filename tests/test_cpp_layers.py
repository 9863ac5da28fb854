"""The C++ runtime's files include one way (docs/ARCHITECTURE.md, "Ownership in the runtime").

A file pair (kx-NAME.h with kx-NAME.cpp) is one node; an `#include "kx-....h"` is an edge.
The graph has no circle, the pack and the slots know no policy, and the policies know
nothing of their owner (kx-hybrid.h).
"""
from __future__ import annotations

import re
from pathlib import Path

from test_imports import find_cycle

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "ggml_ext" / "llama"
INCLUDE = re.compile(r'^\s*#\s*include\s+"(kx-[\w-]+)\.h"', re.M)


def include_graph(folder: Path = LLAMA) -> dict[str, set[str]]:
    """Node (file stem) -> the nodes of this folder it includes."""
    files = sorted(folder.glob("kx-*.h")) + sorted(folder.glob("kx-*.cpp"))
    nodes = {f.stem for f in files}
    graph: dict[str, set[str]] = {n: set() for n in nodes}
    for f in files:
        for inc in INCLUDE.findall(f.read_text()):
            if inc in nodes and inc != f.stem:
                graph[f.stem].add(inc)
    return graph


def reaches(graph: dict[str, set[str]], a: str, b: str) -> bool:
    seen, todo = set(), [a]
    while todo:
        n = todo.pop()
        if n == b:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(graph.get(n, ()))
    return False


def test_the_checks_can_fail() -> None:
    circle = {"kx-slots": {"kx-balance"}, "kx-balance": {"kx-slots"}, "kx-pack": set()}
    assert find_cycle(circle) == ["kx-balance", "kx-slots", "kx-balance"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert reaches({"a": {"b"}, "b": {"c"}, "c": set()}, "a", "c")


def test_no_include_circle() -> None:
    graph = include_graph()
    assert {"kx-pack", "kx-slots", "kx-balance", "kx-pipeline", "kx-thresholds", "kx-hybrid"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_mechanism_knows_no_policy_and_policies_no_owner() -> None:
    graph = include_graph()
    for part in ("kx-pack", "kx-slots", "kx-reload-engine"):
        for policy in ("kx-balance", "kx-pipeline", "kx-thresholds", "kx-hybrid"):
            assert not reaches(graph, part, policy), f"{part} reaches {policy}"
    for policy in ("kx-balance", "kx-pipeline", "kx-thresholds"):
        assert not reaches(graph, policy, "kx-hybrid"), f"{policy} reaches its owner"
