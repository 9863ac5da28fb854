#!/usr/bin/env python3
"""Dense parity: kairox's llama.cpp vs the unpatched vendored llama.cpp, same model.

Runs `kairox-bench` (kairox's patched llama-bench, through the Python entry point) and
the stock llama-bench alternately, one repetition at a time, at each -ngl, so drift
(thermal, page cache) hits both alike. Writes raw JSON (with the exact commands, the
git commit and machine facts) and a markdown table.

  python3 bench/dense_parity.py --stock-bench /path/to/stock/llama-bench \
      --model KB-7B-f16.gguf --ngl 0 16 99 --reps 3 \
      --out bench/results/KB-7B-f16-h200/dense-parity-KB-7B
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts, write_results  # noqa: E402


def run_bench(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {shlex.join(cmd)}\n{r.stderr[-2000:]}")
    rows = json.loads(r.stdout)
    tg = [x for x in rows if x.get("n_gen", 0) > 0]
    return tg[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stock-bench", required=True, help="llama-bench built from the unpatched tree")
    ap.add_argument("--kairox-bench", default=None,
                    help="command for kairox's bench (default: this repo's kairox-bench entry point)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--ngl", type=int, nargs="+", default=[0, 16, 99])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", required=True, help="output path prefix (.json and .md are added)")
    args = ap.parse_args()

    kx = shlex.split(args.kairox_bench) if args.kairox_bench else [
        sys.executable, "-c", "import sys; sys.argv[0] = 'kairox-bench'; "
        "from kairox.tools import bench; bench()"]
    common = ["-m", args.model, "-p", "0", "-n", str(args.n_gen), "-r", "1", "-t", str(args.threads),
              "-o", "json"]
    runs = []
    for rep in range(args.reps):
        for ngl in args.ngl:
            for name, base in (("llama.cpp", [args.stock_bench]), ("kairox", kx)):
                cmd = base + common + ["-ngl", str(ngl)]
                row = run_bench(cmd)
                runs.append({"impl": name, "ngl": ngl, "rep": rep, "tok_s": row["avg_ts"],
                             "command": shlex.join(cmd), "raw": row})
                print(f"{name:9s} ngl={ngl:3d} rep={rep} {row['avg_ts']:8.2f} tok/s", flush=True)

    table = []
    for ngl in args.ngl:
        cell = {}
        for name in ("llama.cpp", "kairox"):
            v = [r["tok_s"] for r in runs if r["impl"] == name and r["ngl"] == ngl]
            cell[name] = (statistics.median(v), min(v), max(v))
        ratio = cell["kairox"][0] / cell["llama.cpp"][0]
        table.append({"ngl": ngl, "llama.cpp": cell["llama.cpp"], "kairox": cell["kairox"], "ratio": ratio})

    result = {
        "benchmark": "dense-parity", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": shlex.join([sys.executable] + sys.argv), "commit": git_commit(),
        "model": os.path.basename(args.model), "model_bytes": os.path.getsize(args.model),
        "machine": machine_facts(), "n_gen": args.n_gen, "threads": args.threads,
        "table": table, "runs": runs,
    }
    lines = [f"# Dense parity: kairox vs unpatched llama.cpp ({result['model']})", "",
             f"decode tok/s (batch 1, {args.n_gen} tokens, {args.threads} threads), median of "
             f"{args.reps} alternating runs [min-max]; commit {result['commit'][:10]}; "
             f"{result['machine'].get('gpu') or 'no GPU'}; {result['machine'].get('cpu', '')}", "",
             "| -ngl | llama.cpp | kairox | kairox / llama.cpp |", "|---:|---:|---:|---:|"]
    for row in table:
        a, b = row["llama.cpp"], row["kairox"]
        lines.append(f"| {row['ngl']} | {a[0]:.2f} [{a[1]:.2f}-{a[2]:.2f}] | "
                     f"{b[0]:.2f} [{b[1]:.2f}-{b[2]:.2f}] | {row['ratio']:.3f} |")
    write_results(args.out, result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
