"""Console entry points that run the patched llama.cpp tools with every flag untouched.

`kairox-cli ARGS` is `llama-cli ARGS` from kairox's build (same for server, bench,
perplexity, completion, quantize): the process is replaced, so signals, exit codes and
terminal behaviour are the tool's own.
"""
from __future__ import annotations

import os
import sys

from ._native import NativeLibraryNotFound, find_bin_dir

TOOLS = {
    "kairox-cli": "llama-cli",
    "kairox-server": "llama-server",
    "kairox-bench": "llama-bench",
    "kairox-perplexity": "llama-perplexity",
    "kairox-completion": "llama-completion",
    "kairox-quantize": "llama-quantize",
    "kairox-rpc-server": "ggml-rpc-server",
}


def exec_tool(tool: str, argv: list[str]) -> None:
    try:
        path = find_bin_dir() / tool
    except NativeLibraryNotFound as e:
        sys.exit(f"kairox: {e}")
    if not os.access(path, os.X_OK):
        sys.exit(f"kairox: {tool} is not in {path.parent}; reinstall kairox (bash scripts/setup.sh)")
    os.execv(path, [tool, *argv])


def _entry(name: str):
    def main() -> None:
        exec_tool(TOOLS[name], sys.argv[1:])
    main.__name__ = name.replace("-", "_")
    return main


cli = _entry("kairox-cli")
server = _entry("kairox-server")
bench = _entry("kairox-bench")
perplexity = _entry("kairox-perplexity")
completion = _entry("kairox-completion")
quantize = _entry("kairox-quantize")
rpc_server = _entry("kairox-rpc-server")
