#!/usr/bin/env python3
"""The hybrid measured as users run it, through the binaries: kairox-bench (llama-bench with
kairox's flags) against `kairox run` on the same model and VRAM budget, beside llama.cpp's
best-fitting dense placement from the same build, in one table.

Rows are interleaved (each round runs every row once) and reported as medians with their
spread. Writes raw results (JSON with the exact commands and the commit) and a Markdown table.

    python3 bench/tools_bench.py --model KB-7B-f16.gguf --budget 7GiB --ngl 17 --bin BUILD/bin --out OUT
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type made books "
          "cheaper to produce, and")


# The context of the text rows: its KV cache counts against the budget, so every row keeps it
# small, as llama-bench's own (prompt + generated tokens) is
CTX = 256


def commit() -> str:
    if os.environ.get("KX_COMMIT"):
        return os.environ["KX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KX_COMMIT", "unknown")


def bench_row(exe: Path, model: str, gen: int, threads: int, extra: list[str],
              prompt: int = 0, peak: list | None = None) -> tuple[list[str], float]:
    """llama-bench's tok/s decoding `gen` tokens, or with `prompt`, prefilling that many instead;
    with `peak`, the row's peak device memory (DevicePeak, MiB) appended to it."""
    cmd = [str(exe), "-m", model, "-p", str(prompt), "-n", "0" if prompt else str(gen), "-r", "1", "-t", str(threads),
           "-o", "json", *extra]
    from offload import DevicePeak  # bench/ is the script's own folder
    with DevicePeak() as dp:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if peak is not None and dp.mib is not None:
        peak.append(dp.mib)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-1500:]}")
    rows = json.loads(r.stdout)
    return cmd, float(rows[0]["avg_ts"])


def completion_row(exe: Path, model: str, gen: int, threads: int, extra: list[str]) -> tuple[list[str], float]:
    """llama-completion (kairox-completion): the same prompt and free generation as `kairox run`,
    from C++; its decode rate is common_perf_print's eval line."""
    cmd = [str(exe), "-m", model, "-p", PROMPT, "-n", str(gen), "-t", str(threads), "--temp", "0", "-no-cnv",
           "--ignore-eos", "-c", str(CTX), *extra]
    # a random model's text need not be valid UTF-8
    r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=600)
    m = re.search(r"eval time =.*?([0-9.]+) tokens per second", r.stderr.split("prompt eval time")[-1])
    if r.returncode != 0 or not m:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-1500:]}")
    return cmd, float(m.group(1))


def run_row(model: str, gen: int, threads: int, extra: list[str]) -> tuple[list[str], float]:
    cmd = [sys.executable, "-m", "kairox", "run", "-m", model, "-n", str(gen), "-t", str(threads), "-p", PROMPT,
           "-c", str(CTX), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=600)
    m = re.search(r"decode ([0-9.]+) tokens/s", r.stderr)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-1500:]}")
    return cmd, float(m.group(1))


def auto_ngl(exe: Path, model: Path, budget: str, threads: int) -> tuple[int, list]:
    """The largest -ngl that fits the budget: its GPU buffers (llama.cpp's load log) and its measured
    device use over the CUDA context's (offload.py's probe)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offload import Layout, find_ngl
    from kairox.plan import parse_size
    budget_mib = parse_size(budget) / (1 << 20)
    ngl, mem, probes = find_ngl(str(exe), model, Layout(model), budget_mib, threads)
    print(f"-ngl {ngl} fits {budget}: buffers {mem['total_mib']:.0f} MiB, device {mem['device_mib']} MiB", flush=True)
    return ngl, probes


def add_run_args(ap: argparse.ArgumentParser, gen: int, rounds: int, stem: str, bin_required: bool = True) -> None:
    """The options every through-the-binaries bench shares: build, tokens, rounds, threads, output."""
    ap.add_argument("--bin", required=bin_required, help="folder with kairox's llama-bench")
    ap.add_argument("--gen", type=int, default=gen)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default=None, help=f"results file stem (default: {stem}-MODEL)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="7GiB", help="VRAM budget of the hybrid rows (default: %(default)s)")
    ap.add_argument("--ngl", required=True,
                    help="llama.cpp's best -ngl that fits the budget, or 'auto': the largest whose GPU "
                         "buffers fit, probed as bench/offload.py does; its rows run with -fa 0 and -fa 1")
    ap.add_argument("--sparse", default="predicted")
    add_run_args(ap, gen=128, rounds=3, stem="tools-bench")
    ap.add_argument("--completion-row", action="append", default=[], metavar="LABEL=FLAGS",
                    help="one more kairox-completion row: the hybrid's flags and these (any common "
                         "flag: --mapped-share, --no-kx-warm, -t; repeatable)")
    ap.add_argument("--bench-row", action="append", default=[], metavar="LABEL=FLAGS",
                    help="one more kairox-bench row at each searched thread count: the hybrid's flags and "
                         "these (a llama-bench flag: --no-kx-warm, --balancer adaptive; repeatable)")
    ap.add_argument("--bench-threads", default=None, metavar="N,N",
                    help="thread counts searched for the llama-bench rows (llama.cpp's and kairox-bench's; "
                         "llama.cpp's best over them is the baseline); default: --threads")
    args = ap.parse_args()
    bench_threads = [int(v) for v in args.bench_threads.split(",")] if args.bench_threads else [args.threads]
    exe = Path(args.bin) / "llama-bench"
    hybrid = ["--vram-budget", args.budget, "--sparse", args.sparse]
    search = None
    if args.ngl == "auto":
        ngl, search = auto_ngl(exe, Path(args.model), args.budget, args.threads)
        fas = ("0", "1")
    else:
        ngl, fas = int(args.ngl), ("1",)
    tl = (lambda n: f" -t {n}") if len(bench_threads) > 1 else (lambda n: "")  # labels name searched counts
    rows: dict[str, dict] = {
        **{f"llama.cpp dense -ngl {ngl} -fa {fa}{tl(n)} (kairox-bench)": {"kind": "bench", "llama": True, "threads": n,
                                                                         "extra": ["-ngl", str(ngl), "-fa", fa]}
           for n in bench_threads for fa in fas},
        **{f"kairox-bench {' '.join(hybrid)}{tl(n)}": {"kind": "bench", "threads": n, "extra": hybrid}
           for n in bench_threads},
        f"kairox-completion {' '.join(hybrid)}": {"kind": "completion", "extra": hybrid},
        f"kairox run {' '.join(hybrid)}": {"kind": "run", "extra": hybrid},
    }
    for spec in args.bench_row:
        label, _, flags = spec.partition("=")
        for n in bench_threads:
            rows[f"kairox-bench {' '.join(hybrid)} {flags}{tl(n)} ({label})"] = {
                "kind": "bench", "threads": n, "extra": hybrid + flags.split()}
    for spec in args.completion_row:
        label, _, flags = spec.partition("=")
        rows[f"kairox-completion {' '.join(hybrid)} {flags} ({label})"] = {"kind": "completion",
                                                                           "extra": hybrid + flags.split()}
    for r in rows.values():
        r["tok_s"], r["cmd"], r["peak_mib"] = [], None, []
    from offload import context_mib
    ctx = context_mib(str(exe), Path(args.model), args.threads)  # the llama-bench rows' device use less it
    t0 = time.time()
    for k in range(args.rounds):
        for label, r in rows.items():
            if r["kind"] == "bench":
                r["cmd"], ts = bench_row(exe, args.model, args.gen, r["threads"], r["extra"], peak=r["peak_mib"])
            elif r["kind"] == "completion":
                r["cmd"], ts = completion_row(exe.parent / "llama-completion", args.model, args.gen, args.threads,
                                              r["extra"])
            else:
                r["cmd"], ts = run_row(args.model, args.gen, args.threads, r["extra"])
            r["tok_s"].append(ts)
            print(f"round {k + 1}: {label}: {ts:.2f} tok/s ({time.time() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"tools-bench-{Path(args.model).stem}"
    res = {"commit": commit(), "command": " ".join([sys.executable, *sys.argv]), "model": Path(args.model).name,
           "budget": args.budget, "gen": args.gen, "threads": args.threads, "bench_threads": bench_threads,
           "ngl_search": search,
           "ngl0_peak_mib": ctx,
           "rows": [{"row": label, "command": " ".join(r["cmd"]), "tok_s": r["tok_s"], "peak_mib": r["peak_mib"]}
                    for label, r in rows.items()]}
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    base = max(statistics.median(r["tok_s"]) for r in rows.values() if r.get("llama"))  # llama.cpp's best
    run_med = statistics.median(rows[f"kairox run {' '.join(hybrid)}"]["tok_s"])
    lines = [f"# {Path(args.model).name} at a {args.budget} VRAM budget, through the binaries",
             "", f"decode of {args.gen} tokens, {args.threads} threads (llama-bench rows: {','.join(map(str, bench_threads))}), "
             f"{args.rounds} interleaved rounds; "
             f"commit {res['commit']}", "",
             "| row | decode tok/s median | spread | vs llama.cpp | vs kairox run | device MiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, r in rows.items():
        med = statistics.median(r["tok_s"])
        dev = f"{statistics.median(r['peak_mib']) - (ctx or 0):.0f}" if r["peak_mib"] else "-"
        lines.append(f"| {label} | {med:.2f} | {min(r['tok_s']):.2f}-{max(r['tok_s']):.2f} | {med / base:.2f}x | "
                     f"{med / run_med:.3f} | {dev} |")
    lines += ["", "device MiB: the GPU's peak memory use during a llama-bench row over the idle GPU's, less "
              f"llama.cpp's at `-ngl 0` ({ctx} MiB, the CUDA context), median of the rounds"]
    lines += ["", "Commands:", "", "```", *[" ".join(r["cmd"]) for r in rows.values()], "```", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
