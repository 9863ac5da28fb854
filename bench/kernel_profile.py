#!/usr/bin/env python3
"""Where a decode's device time goes, kernel by kernel: reads an Nsight Compute CSV
(`ncu --metrics gpu__time_duration.sum --csv`, one row per kernel launch; written by
bench/device/hybrid.sh with KX_NCU) and prints, per layer step (from one layer's attention kernel to
the next's), each kernel's count and µs, and the kernels of the median step in order. Why the
attention: every layer runs it once, while a hybrid layer with the warm-up runs two selects (its
own list and the next layer's), so steps cut at the select were half layers.

Each kernel is timed alone (Nsight Compute serializes launches), so the sums leave out the
gaps between kernels and any overlap: they say what the device computes, not how long the
host waits for it (bench/balance_live.py's scheduler counters say that).

  python3 bench/kernel_profile.py ncu-KB-7B.csv [-o kernel-profile.md]
  python3 bench/kernel_profile.py ncu-KB-7B.csv --step kx_select   # steps cut at another kernel
"""
from __future__ import annotations

import argparse
import csv
import gzip
import re
import statistics
import sys
from pathlib import Path

UNIT = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def short_name(name: str) -> str:
    """A kernel's name without its parameter list and template arguments (void f<T>(int) -> f)."""
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or name


def read_kernels(path: Path) -> list[tuple[str, float]]:
    """(kernel name, µs) per launch, in launch order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(str(r["Metric Value"]).replace(",", ""))
        out.append((short_name(r["Kernel Name"]), v * UNIT.get(r.get("Metric Unit", "nsecond"), 1e-3)))
    return out


def summarize(kernels: list[tuple[str, float]], step: str = "flash_attn_ext") -> list[str]:
    """Per layer step: a step begins at the first of consecutive kernels whose name starts with
    `step` (a run of them counts once: CUDA's select can be two, ballots then the write)."""
    if not kernels:
        return ["no kernel timings in the file"]
    sel = [n.startswith(step) for n, _ in kernels]
    starts = [i for i, s in enumerate(sel) if s and not (i and sel[i - 1])]
    steps = [kernels[a:b] for a, b in zip(starts, starts[1:])]
    n_steps = max(1, len(steps))
    body = [k for s in steps for k in s] or kernels
    total = sum(t for _, t in body)
    by: dict[str, list[float]] = {}
    for n, t in body:
        by.setdefault(n, []).append(t)
    lines = [f"{len(kernels)} kernels timed, {len(steps)} whole layer steps ({step} to {step}): "
             f"{total / n_steps:.1f} µs of kernel time per step", "",
             "| kernel | launches / step | µs / step | µs / launch (median) | share |", "|---|---:|---:|---:|---:|"]
    for n, ts in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {n} | {len(ts) / n_steps:.2f} | {sum(ts) / n_steps:.1f} | {statistics.median(ts):.1f} | "
                     f"{sum(ts) / total:.1%} |")
    if steps:
        tot = [sum(t for _, t in s) for s in steps]
        med = sorted(range(len(steps)), key=lambda i: tot[i])[len(steps) // 2]
        lines += ["", f"The median step ({tot[med]:.1f} µs, {len(steps[med])} kernels), in launch order:", "",
                  "| # | kernel | µs |", "|---:|---|---:|"]
        lines += [f"| {i} | {n} | {t:.1f} |" for i, (n, t) in enumerate(steps[med])]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path, help="Nsight Compute CSV (or .csv.gz)")
    ap.add_argument("-o", "--out", type=Path, help="also write the table here (Markdown)")
    ap.add_argument("--step", default="flash_attn_ext",
                    help="the name prefix of the kernel that starts a layer step (default: %(default)s)")
    args = ap.parse_args()
    if not args.csv.exists():
        print(f"kernel_profile: {args.csv} not found", file=sys.stderr)
        return 2
    lines = summarize(read_kernels(args.csv), args.step)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(f"# Device kernels per layer step ({args.csv.name})\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
