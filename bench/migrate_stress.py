#!/usr/bin/env python3
"""Runtime migration under load: per-token decode time under a VRAM budget of whole tensors,
with an external stress started mid-run, with and without migration (`migrate=False`, the
load's streaming choice kept).

Each row is a worker process (this script with --worker): it loads the model through
kairox.Llama under the budget, evaluates a short prompt, then decodes `--tokens` tokens one at a
time (teacher-forced ids, so every row decodes the same text) and times each. At token `--at`
it starts the stress and stops it at the end:

  cpu   round(0.6 x cores) processes copying 256 MiB arrays (numpy): CPU time and memory
        bandwidth taken from the decode's host threads (ATSInfer's CPU stress: 60% of the cores)
  pcie  one process copying 1 GiB from page-locked host memory to the GPU in a loop (torch):
        PCIe and the GPU's copy engines taken from the streamed tensors' copies

Rows of one round run in order, rounds interleave them. Reported per row: TPOT median before
the stress (tokens 8..at) and under it (at+8..end), the degradation, p99, the means (the decode
rate: descheduled steps weigh in them, not in the medians), and the streaming
counters (migrations made, tensors streamed at the end). Rows per stress (`--rows`): `migrate`
(migration on), `off` (the load's streaming kept), `threads` (migration off, load-aware decode
threads on: kairox.threads). Writes raw JSON (the exact commands,
the commit) and a Markdown table.

    python3 bench/migrate_stress.py --model KB-7B-silu-f16.gguf --budget 7GiB --stress cpu,pcie --out OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools_bench import commit  # noqa: E402

CPU_STRESS = ("import numpy as np\n"
              "a = np.ones(1 << 25); b = np.empty_like(a)\n"
              "while True:\n"
              "    np.copyto(b, a)\n")
PCIE_STRESS = ("import torch\n"
               "h = torch.ones(1 << 28, dtype=torch.float32).pin_memory()\n"
               "g = torch.empty_like(h, device='cuda')\n"
               "while True:\n"
               "    g.copy_(h, non_blocking=True)\n"
               "    torch.cuda.synchronize()\n")


def stress_procs(kind: str, torch_python: str) -> list[subprocess.Popen]:
    if kind == "cpu":
        n = max(1, round(0.6 * (os.cpu_count() or 1)))
        return [subprocess.Popen([sys.executable, "-c", CPU_STRESS]) for _ in range(n)]
    if kind == "pcie":
        return [subprocess.Popen([torch_python, "-c", PCIE_STRESS])]
    return []


def worker(a: argparse.Namespace) -> int:
    import kairox
    llm = kairox.Llama(a.model, vram_budget=None if a.budget == "none" else a.budget, n_ctx=a.tokens + 64, n_threads=a.threads,
                       migrate=a.variant == "migrate", adapt_threads=a.variant == "threads", verbose=False)
    ids = [(7 + 13 * k) % 30000 + 100 for k in range(a.tokens + 16)]
    llm.eval(ids[:16])
    times: list[float] = []
    procs: list[subprocess.Popen] = []
    try:
        for k in range(a.tokens):
            if k == a.at:
                procs = stress_procs(a.stress, a.torch_python)
            t = time.perf_counter()
            llm.eval([ids[16 + k]])
            times.append(time.perf_counter() - t)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    print(json.dumps({"tpot_s": times, "stream": llm.stream_stats()}))
    llm.close()
    return 0


def summary(tpot: list[float], at: int) -> dict[str, float]:
    before, under = tpot[8:at], tpot[at + 8:]
    b, u = statistics.median(before), statistics.median(under)
    return {"before_ms": b * 1e3, "under_ms": u * 1e3, "degradation": u / b - 1,
            "before_mean_ms": statistics.fmean(before) * 1e3, "under_mean_ms": statistics.fmean(under) * 1e3,
            "under_p99_ms": sorted(under)[int(0.99 * (len(under) - 1))] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", required=True, help="VRAM budget, e.g. 7GiB; none: no budget (a CPU-only run)")
    ap.add_argument("--stress", default="cpu,pcie", help="comma-separated: cpu, pcie, none")
    ap.add_argument("--tokens", type=int, default=160, help="tokens decoded per row")
    ap.add_argument("--at", type=int, default=0, help="token at which the stress starts (0: a third of the way)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--torch-python", default="/opt/torch/.venv/bin/python3",
                    help="a Python with torch and CUDA, for the PCIe stress")
    ap.add_argument("--out", type=Path, help="folder for the JSON and Markdown results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", default="migrate,off",
                    help="rows per stress, comma-separated: migrate, off, threads (default: %(default)s)")
    ap.add_argument("--variant", default="migrate", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.at = a.at or a.tokens // 3
    if a.worker:
        return worker(a)
    stresses = [s for s in a.stress.split(",") if s]
    variants = [v for v in a.rows.split(",") if v]
    if not variants or any(v not in ("migrate", "off", "threads") for v in variants):
        ap.error(f"--rows: migrate, off and threads only, not {a.rows!r}")
    rows = [(s, v) for s in stresses for v in variants]
    res: dict = {"commit": commit(), "command": " ".join([sys.executable, *sys.argv]), "model": Path(a.model).name,
                 "budget": a.budget, "tokens": a.tokens, "at": a.at, "threads": a.threads, "rounds": a.rounds,
                 "rows": [{"stress": s, "variant": v, "migrate": v == "migrate", "runs": []} for s, v in rows]}
    for r in range(a.rounds):
        for row, (s, m) in zip(res["rows"], rows):
            cmd = [sys.executable, __file__, "--worker", "--model", a.model, "--budget", a.budget, "--stress", s,
                   "--tokens", str(a.tokens), "--at", str(a.at), "--threads", str(a.threads),
                   "--torch-python", a.torch_python, "--variant", m]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                row["runs"].append({"error": p.stderr.strip().splitlines()[-3:]})
                print(f"round {r + 1}: {s} {m}: FAILED {row['runs'][-1]['error']}", flush=True)
                continue
            run = json.loads(p.stdout.strip().splitlines()[-1])
            run.update(summary(run["tpot_s"], a.at))
            row["runs"].append(run)
            print(f"round {r + 1}: {s} {m}: {run['before_ms']:.2f} -> {run['under_ms']:.2f} ms "
                  f"({run['degradation']:+.0%}), stream {run['stream']}", flush=True)
    lines = [f"# {res['model']} at {a.budget}: TPOT with a stress from token {a.at} of {a.tokens}", "",
             f"commit {res['commit']}, {a.threads} threads, {a.rounds} round(s); medians over the rounds "
             "(range)", "",
             "| stress | row | TPOT before (ms) | TPOT under stress (ms) | degradation | p99 under (ms) | "
             "mean before / under (ms) | migrations | streamed at the end |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def med(runs: list[dict], k: str, fmt: str) -> str:
        v = [x[k] for x in runs]
        return f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"
    for row in res["rows"]:
        ok = [x for x in row["runs"] if "error" not in x]
        if not ok:
            lines.append(f"| {row['stress']} | {row['variant']} | failed | | | | | | |")
            continue
        lines.append(f"| {row['stress']} | {row['variant']} | {med(ok, 'before_ms', '{:.2f}')} | "
                     f"{med(ok, 'under_ms', '{:.2f}')} | {med(ok, 'degradation', '{:+.1%}')} | "
                     f"{med(ok, 'under_p99_ms', '{:.2f}')} | {med(ok, 'before_mean_ms', '{:.2f}')} / "
                     f"{med(ok, 'under_mean_ms', '{:.2f}')} | {statistics.median(x['stream']['migrations'] for x in ok):g} | "
                     f"{statistics.median(x['stream']['tensors'] for x in ok):g} of "
                     f"{ok[0]['stream']['slotted']} |")
    lines += ["", "```", res["command"], "```", ""]
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = f"migrate-stress-{Path(a.model).stem}"
        (a.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (a.out / f"{stem}.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
