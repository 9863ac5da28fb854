#!/usr/bin/env python3
"""Whether a sparse setting is ever slower than dense, through the binaries: kairox-bench
(llama-bench) decode rows on one model, interleaved rounds, medians with their spread.

Each --row is LABEL=FLAGS (llama-bench flags added to `-m MODEL -p 0 -n GEN -r 1 -t THREADS`).
--bin NAME=DIR, given more than once, runs every row on each build ("LABEL (NAME)"), so an
earlier build's kernels interleave with this one's.
The usual set: dense as llama.cpp loads it (repacked CPU weights), dense without repacking
(the layout the sparse kernels read), predicted with a `kairox prepare` pack (which measures
whether a layer gains and steps aside where it does not), predicted with a `kairox pack`
pack (no such measure: every layer sparse).

    python3 bench/gain_cpu.py --model gemma.gguf --bin build/bin --out bench/results/gemma3-270m-cpu \\
        --row 'dense=' --row 'dense, no repack=--no-repack' \\
        --row 'predicted, prepare pack=--sparse predicted --sparse-pack P1' ...
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts  # noqa: E402
from tools_bench import bench_row  # noqa: E402  (bench/ is the script's own folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True, action="append",
                    help="folder with kairox's llama-bench, or NAME=DIR (repeatable: rows run on each)")
    ap.add_argument("--row", action="append", required=True, metavar="LABEL=FLAGS")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--name", default=None, help="results file stem (default: gain-cpu-MODEL)")
    args = ap.parse_args()
    bins = [b.partition("=")[::2] if "=" in b else ("", b) for b in args.bin]
    rows = {}
    for spec in args.row:
        label, _, flags = spec.partition("=")
        for name, folder in bins:
            rows[f"{label} ({name})" if len(bins) > 1 else label] = {
                "extra": shlex.split(flags), "exe": Path(folder) / "llama-bench", "tok_s": [], "cmd": None}
    t0 = time.time()
    for k in range(args.rounds):
        for label, r in rows.items():
            r["cmd"], ts = bench_row(r["exe"], args.model, args.gen, args.threads, r["extra"])
            r["tok_s"].append(ts)
            print(f"round {k + 1}: {label}: {ts:.2f} tok/s ({time.time() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"gain-cpu-{Path(args.model).stem}"
    res = {"commit": git_commit(), "command": shlex.join([sys.executable, *sys.argv]), "machine": machine_facts(),
           "model": Path(args.model).name, "gen": args.gen, "threads": args.threads, "rounds": args.rounds,
           "rows": [{"row": label, "command": shlex.join(r["cmd"]), "tok_s": r["tok_s"]} for label, r in rows.items()]}
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    base = statistics.median(next(iter(rows.values()))["tok_s"])
    lines = [f"# {Path(args.model).name}: decode through kairox-bench, {args.threads} threads",
             "", f"{args.gen} tokens, {args.rounds} interleaved rounds; commit {res['commit']}", "",
             "| row | decode tok/s median | spread | vs the first row |", "|---|---:|---:|---:|"]
    for label, r in rows.items():
        med = statistics.median(r["tok_s"])
        lines.append(f"| {label} | {med:.2f} | {min(r['tok_s']):.2f}-{max(r['tok_s']):.2f} | {med / base:.2f}x |")
    lines += ["", "Commands:", "", "```", *[shlex.join(r["cmd"]) for r in rows.values()], "```", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
