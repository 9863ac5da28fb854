#!/usr/bin/env python3
"""The index of bench/results and the README's results table, generated from the results'
JSON files (each holds its command, commit and machine).

  python3 bench/summarize.py          # write bench/results/INDEX.md and README.md's table
  python3 bench/summarize.py --check  # exit 1 when either is not what the files say

INDEX.md: one line per JSON file, grouped by folder: the benchmark script, the model or
configuration, the machine, the commit, and the first rows' decode speed (median of a row's
rounds). The README's table: the rows CURRENT names, each a median with its spread.
tests/test_docs.py runs the check.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "INDEX.md"
README = ROOT / "README.md"
BEGIN = "<!-- results table: written by bench/summarize.py -->"
END = "<!-- end of the results table -->"
HEADLINE_ROWS = 4


@dataclass(frozen=True)
class Current:
    """A README row: a results file and how to read one figure from it."""
    label: str
    path: str                 # under bench/results
    row: str | None = None    # the row's name (rows[].row); None: the file's own streams
    streams: bool = False     # server streams: per-stream decode speeds


# what the README shows, newest measurements of the configuration users run first
CURRENT = (
    Current("llama.cpp, best fitting `-ngl 17 -fa 1`", "tools/tools-bench-KB-7B-f16.json",
            "llama.cpp dense -ngl 17 -fa 1 (kairox-bench)"),
    Current("`kairox-bench --vram-budget 7GiB --sparse predicted`", "tools/tools-bench-KB-7B-f16.json",
            "kairox-bench --vram-budget 7GiB --sparse predicted"),
    Current("`kairox run --vram-budget 7GiB --sparse predicted`", "tools/tools-bench-KB-7B-f16.json",
            "kairox run --vram-budget 7GiB --sparse predicted"),
    Current("`kairox-server`, same flags, 4 concurrent streams (per stream)", "tools/server-streams-static.json",
            streams=True),
)


def _median_spread(v) -> tuple[float, float, float] | None:
    vals = [float(x) for x in (v if isinstance(v, list) else [v]) if isinstance(x, (int, float))]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _speed(row: dict) -> tuple[float, float, float] | None:
    for k in ("tok_s", "median_tok_s", "decode_tok_s"):
        if k in row:
            return _median_spread(row[k])
    return None


def _rows(d: dict) -> list[dict]:
    for k in ("rows", "runs", "results"):
        if isinstance(d.get(k), list):
            return [r for r in d[k] if isinstance(r, dict)]
    return []


def _row_name(r: dict) -> str:
    for k in ("row", "name", "policy", "mode", "impl", "method"):
        if isinstance(r.get(k), str):
            return r[k]
    return "?"


def _script(cmd: str) -> str:
    m = re.search(r"(bench/[\w/]+\.(?:py|sh))", cmd) or re.search(r"(kairox \w[\w-]*)", cmd)
    if m:
        return m.group(1)
    tool = re.search(r"/(llama-[\w-]+)", cmd)
    return tool.group(1) if tool else cmd.split()[0].rsplit("/", 1)[-1] if cmd else "?"


def _model(d: dict) -> str:
    if isinstance(d.get("model"), str):
        return Path(d["model"]).name
    if isinstance(d.get("config"), str):
        return d["config"]
    m = re.search(r"--(?:model|config)[ =](\S+)", d.get("command", "")) or re.search(r" -m (\S+)", d.get("command", ""))
    return Path(m.group(1)).name if m else ""


def _machine(d: dict) -> str:
    m = d.get("machine")
    if not isinstance(m, dict):
        return ""
    if m.get("gpu"):
        gpu = m["gpu"].split(",")[0].replace("NVIDIA ", "")
        return f"{gpu}, {m.get('cpus', '?')} CPUs"
    return f"CPU, {m.get('cpus', '?')} cores"


def headline(d: dict) -> str:
    out = []
    for r in _rows(d):
        s = _speed(r)
        if s:
            out.append(f"{_row_name(r)}: {s[0]:.1f}")
        if len(out) == HEADLINE_ROWS:
            break
    return " · ".join(out).replace("|", "/")


def render_index() -> str:
    lines = ["# bench/results: the index", "",
             "Written by `python3 bench/summarize.py` from the JSON files; each folder's README.md says",
             "what its experiment asked and concluded. Speeds are decode tokens/s, the median of a",
             "row's rounds, for the file's first rows.", ""]
    files = sorted(RESULTS.rglob("*.json"), key=lambda p: (p.parent != RESULTS, str(p.relative_to(RESULTS))))
    folder = None
    for p in files:
        rel = p.relative_to(RESULTS)
        here = str(rel.parent) if rel.parent != Path(".") else "(top)"
        if here != folder:
            folder = here
            readme = (p.parent / "README.md").exists()
            lines += ["", f"## {here}" + (f" ([README]({rel.parent}/README.md))" if readme and here != "(top)" else ""),
                      "", "| results | benchmark | model | machine | commit | decode tok/s |", "|---|---|---|---|---|---|"]
        try:
            d = json.loads(p.read_text())
        except ValueError:
            lines.append(f"| `{rel}` | (not JSON) | | | | |")
            continue
        md = p.with_suffix(".md")
        name = f"[{rel.name}]({rel})" + (f" ([table]({rel.with_suffix('.md')}))" if md.exists() else "")
        lines.append(f"| {name} | {_script(d.get('command', ''))} | {_model(d)} | {_machine(d)} | "
                     f"{str(d.get('commit', ''))[:7]} | {headline(d)} |")
    return "\n".join(lines) + "\n"


def render_table() -> str:
    lines = [BEGIN, "", "| run | decode tok/s, median (spread) |", "|---|---:|"]
    for c in CURRENT:
        d = json.loads((RESULTS / c.path).read_text())
        if c.streams:
            s = _median_spread([r["decode_tok_s"] for r in d["results"]])
        else:
            s = next((_speed(r) for r in _rows(d) if _row_name(r) == c.row), None)
        if s is None:
            raise SystemExit(f"bench/summarize.py: no row {c.row!r} in bench/results/{c.path}")
        lines.append(f"| {c.label} | {s[0]:.1f} ({s[1]:.1f}-{s[2]:.1f}) |")
    return "\n".join(lines + ["", END])


def readme_with(table: str) -> tuple[str, str]:
    text = README.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"README.md has no results table markers ({BEGIN} ... {END})")
    return text, text[:i] + table + text[j + len(END):]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when INDEX.md or README.md's table is stale")
    args = ap.parse_args()
    index = render_index()
    old_readme, new_readme = readme_with(render_table())
    if args.check:
        stale = [n for n, ok in (("bench/results/INDEX.md", INDEX.exists() and INDEX.read_text() == index),
                                 ("README.md's results table", old_readme == new_readme)) if not ok]
        if stale:
            print(f"stale: {', '.join(stale)}; run python3 bench/summarize.py", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(index)
    README.write_text(new_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
