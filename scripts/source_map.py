#!/usr/bin/env python3
"""Writes the source map of docs/ARCHITECTURE.md: every source file of the repository, one
line each, the line being the first sentence of the file's own header (a Python docstring,
a leading comment block, a patch's subject). The map sits between two markers in the page;
everything else in the page is written by hand.

  python3 scripts/source_map.py           # rewrite the map
  python3 scripts/source_map.py --check   # exit 1 when the map is not the tree's
(tests/test_docs.py runs the check.)
"""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
BEGIN = "<!-- source map: written by scripts/source_map.py, do not edit by hand -->"
END = "<!-- end of the source map -->"
# the folders whose files are sources, in the map's order, and the suffixes that count
FOLDERS = ("python/kairox", "ggml_ext", "patches", "scripts", "bench", "tests", ".ci")
SUFFIXES = {".py", ".c", ".cpp", ".h", ".cu", ".cuh", ".patch", ".sh", ".txt", ""}
MAX_CHARS = 150


def sources() -> list[str]:
    """Tracked source files under FOLDERS (bench/results holds results, not sources)."""
    out = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    keep = []
    for f in out:
        p = Path(f)
        if f.startswith("bench/results/") or p.suffix not in SUFFIXES:
            continue
        if p.suffix == "" and f != ".ci/run":
            continue
        if p.suffix == ".txt" and p.name != "CMakeLists.txt":
            continue
        keep.append(f)
    return sorted(keep, key=lambda f: (next(i for i, d in enumerate(FOLDERS) if f.startswith(d)), f))


def _comment_block(lines: list[str], marker: str) -> str:
    """The first run of comment lines (after a shebang), their markers stripped."""
    text, started = [], False
    for ln in lines:
        s = ln.strip()
        if s.startswith("#!") and not started:
            continue
        if s.startswith(marker) and not s.startswith(marker + "!"):
            started = True
            text.append(s[len(marker):].strip())
        elif started or s:
            break
    return " ".join(t for t in text if t)


def header(path: Path) -> str:
    """What a file says of itself first: its docstring or comment block, or a patch's subject."""
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        try:
            doc = ast.get_docstring(ast.parse(text)) or ""
        except SyntaxError:
            doc = ""
        return " ".join(doc.split()) or _comment_block(text.splitlines(), "#")
    if path.suffix == ".patch":
        return text.splitlines()[0] if text else ""
    if path.suffix in (".sh", ".txt", ""):
        return _comment_block(text.splitlines(), "#")
    block = _comment_block(text.splitlines(), "//")
    if not block and text.lstrip().startswith("/*"):
        block = " ".join(text.lstrip()[2:text.find("*/")].replace("*", " ").split())
    return block


def first_sentence(text: str) -> str:
    """Up to the first full stop (not one inside a name like kx-pack.h or e.g.)."""
    m = re.search(r"(?<=[^.\s]{2}\.)\s", text + " ")
    s = text[:m.start()] if m else text
    return s if len(s) <= MAX_CHARS else s[:MAX_CHARS - 1].rstrip() + "…"


def render() -> str:
    lines = [BEGIN, "", "| file | what it is |", "|---|---|"]
    for f in sources():
        what = (first_sentence(header(ROOT / f)) or "(no header)").replace("|", r"\|")
        lines.append(f"| `{f}` | {what} |")
    return "\n".join(lines + ["", END])


def current_page() -> tuple[str, str, str]:
    page = PAGE.read_text()
    i, j = page.find(BEGIN), page.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"{PAGE} has no source map markers ({BEGIN} ... {END})")
    return page[:i], page[i:j + len(END)], page[j + len(END):]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the page's map is stale")
    args = ap.parse_args()
    head, old, tail = current_page()
    new = render()
    if args.check:
        if old != new:
            print(f"{PAGE.relative_to(ROOT)}: the source map is stale; run python3 scripts/source_map.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(head + new + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
