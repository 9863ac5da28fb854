#!/usr/bin/env python3
"""The index of bench/results and the README's results table, generated from the results'
JSON files (each holds its command, commit and machine).

  python3 bench/summarize.py          # write bench/results/INDEX.md and README.md's table
  python3 bench/summarize.py --check  # exit 1 when either is not what the files say

INDEX.md, in the layout's order: the configuration folders first (a folder named for its model
and machine, KB-7B-f16-h200: its current figures), then the folders that cut across
configurations, one line per JSON file (.json or .json.gz) with the benchmark script, the model
or configuration, the machine, the commit, and the first rows' decode speed (median of a row's
rounds); then archive/, one line per folder (its README's title). The README's table: the rows
CURRENT names, each a median with its spread. tests/test_docs.py runs the check.
"""
from __future__ import annotations

import argparse
import gzip
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
ARCHIVE = "archive"
# a configuration folder's name ends in its machine: KB-7B-f16-h200, KB-7B-f16-h100, KB-350M-cpu
MACHINES = ("h200", "h100", "cpu")


@dataclass(frozen=True)
class Current:
    """A README row: a results file and how to read one figure from it."""
    label: str
    path: str                 # under bench/results
    row: str | None = None    # the row's name (rows[].row); None: the file's own streams
    streams: bool = False     # server streams: per-stream decode speeds


# what the README shows, newest measurements of the configuration users run first
CURRENT = (
    Current("llama.cpp, best fitting `-ngl 17 -fa 1`", "KB-7B-f16-h200/tools/tools-bench-KB-7B-f16.json",
            "llama.cpp dense -ngl 17 -fa 1 (kairox-bench)"),
    Current("`kairox-bench --vram-budget 7GiB --sparse predicted`", "KB-7B-f16-h200/tools/tools-bench-KB-7B-f16.json",
            "kairox-bench --vram-budget 7GiB --sparse predicted"),
    Current("`kairox run --vram-budget 7GiB --sparse predicted`", "KB-7B-f16-h200/tools/tools-bench-KB-7B-f16.json",
            "kairox run --vram-budget 7GiB --sparse predicted"),
    Current("`kairox-server`, same flags, 4 concurrent streams (per stream)",
            "KB-7B-f16-h200/tools/server-streams-static.json", streams=True),
    Current("Q4_K_M: llama.cpp, best fitting `-ngl 22 -fa 1`", "KB-7B-q4_k_m-h200/tools-bench-KB-7B-q4_k_m.json",
            "llama.cpp dense -ngl 22 -fa 1 (kairox-bench)"),
    Current("Q4_K_M: `kairox-bench --vram-budget 3GiB --sparse predicted`",
            "KB-7B-q4_k_m-h200/tools-bench-KB-7B-q4_k_m.json", "kairox-bench --vram-budget 3GiB --sparse predicted"),
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


def _load(p: Path) -> dict:
    return json.loads(gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_text())


def _json_files(folder: Path) -> list[Path]:
    return sorted([*folder.rglob("*.json"), *folder.rglob("*.json.gz")], key=lambda p: str(p.relative_to(folder)))


def _table_of(p: Path) -> Path:
    """The Markdown table written beside a results file (x.json or x.json.gz: x.md)."""
    return p.with_name(p.name.removesuffix(".gz").removesuffix(".json") + ".md")


def _title(readme: Path) -> str:
    return next((ln[2:].strip() for ln in readme.read_text().splitlines() if ln.startswith("# ")), "")


def _link(target: Path, text: str) -> str:
    return f"[{text}]({target.relative_to(RESULTS).as_posix()})"


def _rows_of(folder: Path, files: list[Path] | None = None) -> list[str]:
    """A table of the JSON files under folder (or those given), named from it."""
    files = _json_files(folder) if files is None else files
    if not files:
        return []
    lines = ["| results | benchmark | model | machine | commit | decode tok/s |", "|---|---|---|---|---|---|"]
    for p in files:
        name = _link(p, p.relative_to(folder).as_posix())
        if _table_of(p).exists():
            name += f" ({_link(_table_of(p), 'table')})"
        try:
            d = _load(p)
        except ValueError:
            lines.append(f"| {name} | (not JSON) | | | | |")
            continue
        lines.append(f"| {name} | {_script(d.get('command', ''))} | {_model(d)} | {_machine(d)} | "
                     f"{str(d.get('commit', ''))[:7]} | {headline(d)} |")
    return lines


def _folder_section(folder: Path) -> list[str]:
    readme = folder / "README.md"
    head = f"### {folder.name}" + (f" ({_link(readme, 'README')})" if readme.exists() else "")
    paras = [[_title(readme)]] if readme.exists() else []
    subs = sorted(r.parent for r in folder.rglob("README.md") if r.parent != folder)
    if subs:
        paras.append(["Folders with their own README: " + ", ".join(
            _link(s / "README.md", s.relative_to(folder).as_posix() + "/") for s in subs) + "."])
    paras.append(_rows_of(folder) or ["(no JSON results)"])
    lines = ["", head]
    for para in paras:
        lines += ["", *para]
    return lines


def _described_in(folder: Path) -> Path | None:
    """For a folder without a README: the README of a neighbouring folder (or the parent's) that
    names it."""
    name = re.compile(rf"(?<![\w-]){re.escape(folder.name)}/")
    for r in sorted(folder.parent.glob("*/README.md")) + [folder.parent / "README.md"]:
        if r.parent != folder and r.exists() and name.search(r.read_text()):
            return r
    return None


def _archive_rows() -> list[str]:
    archive = RESULTS / ARCHIVE
    folders = sorted({p.parent for p in archive.rglob("*") if p.is_file()} - {archive})
    lines = ["| folder | JSON files | what |", "|---|---:|---|"]
    for f in folders:
        readme = f / "README.md"
        if readme.exists():
            what = _title(readme) + f" ({_link(readme, 'README')})"
        else:
            r = _described_in(f)
            what = f"described in {_link(r, r.parent.relative_to(RESULTS).as_posix() + '/README.md')}" if r else ""
        n = len([p for p in _json_files(f) if p.parent == f])
        lines.append(f"| {_link(f, f.relative_to(RESULTS).as_posix() + '/')} | {n} | {what} |")
    return lines


def _config_order(folder: Path) -> tuple:
    """The machine's order in MACHINES, then the name with its numbers as numbers (KB-7B, KB-13B)."""
    return (MACHINES.index(folder.name.rsplit("-", 1)[-1]),
            [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", folder.name)])


def render_index() -> str:
    top = sorted(p for p in RESULTS.iterdir() if p.is_dir() and p.name != ARCHIVE)
    configs = sorted((p for p in top if p.name.rsplit("-", 1)[-1] in MACHINES), key=_config_order)
    lines = ["# bench/results: the index", "",
             "Written by `python3 bench/summarize.py` from the JSON files. First the configurations (a",
             "folder per model and machine holding its current figures; its README.md says which file is",
             "the current figure of what, and the commands), then the folders that cut across",
             "configurations, then the archive of superseded experiments (one line per folder; each",
             "folder's README.md says what its experiment asked and concluded). Speeds are decode",
             "tokens/s, the median of a row's rounds, for the file's first rows.", "",
             "## Configurations"]
    for c in configs:
        lines += _folder_section(c)
    lines += ["", "## Across configurations"]
    for c in top:
        if c not in configs:
            lines += _folder_section(c)
    loose = [p for p in _json_files(RESULTS) if p.parent == RESULTS]
    if loose:
        lines += ["", "### (top)", "", *_rows_of(RESULTS, loose)]
    if (RESULTS / ARCHIVE).is_dir():
        lines += ["", "## Archive", "", "Superseded experiments, their conclusions folded into docs/benchmarking.md and",
                  "docs/results-log.md; commands recorded inside their files name the paths of the time",
                  f"({_link(RESULTS / ARCHIVE / 'README.md', 'archive/README.md')}).", "", *_archive_rows()]
    return "\n".join(lines) + "\n"


def render_table() -> str:
    lines = [BEGIN, "", "| run | decode tok/s, median (spread) |", "|---|---:|"]
    for c in CURRENT:
        d = _load(RESULTS / c.path)
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
