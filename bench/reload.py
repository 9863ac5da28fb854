#!/usr/bin/env python3
"""Slot reload transfer methods on the GPU machine (cuda/kx-reload.cu: kx_cuda_reload_bench).

Moves rows from page-locked host memory into device memory in runs of 1, 8 or 32 contiguous
rows picked at random (a neuron's row, or a group of neurons stored together), by
  gather  one kernel reading mapped host memory (zero-copy), its grid capped at --max-blocks
  memcpy  one cudaMemcpyAsync per run (the copy engine)
  batch   one cudaMemcpyBatchAsync for all runs
and reports, per method and run length: GB/s alone; GB/s beside a device-memory-bound kernel
stream of about the same length and that stream's slowdown; and the worst time of a 64 KiB
host-to-device copy on a third stream (a decode's activation transfer) while the reload runs,
next to the same copy's time alone.

  python3 bench/reload.py --row-bytes 8192 --rows 8192 --out bench/results
Writes <out>/reload-methods.json (raw, with the command) and .md.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts, write_results  # noqa: E402

METHODS = ("gather", "memcpy", "batch")


def bench_fn():
    from kairox._native import ggml_library
    f = ggml_library("ggml-cuda").kx_cuda_reload_bench
    f.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                  ctypes.POINTER(ctypes.c_double)]
    f.restype = ctypes.c_int32
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[8192, 4608],
                    help="bytes per row (8192: an F16 row of 4096; 4608: a Q4_0 row of 8192)")
    ap.add_argument("--rows", type=int, default=8192, help="rows per reload")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 8, 32], help="contiguous rows per run")
    ap.add_argument("--max-blocks", type=int, nargs="+", default=[32, 132], help="gather grid caps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    f = bench_fn()
    rows = []
    for rb in args.row_bytes:
        for g in args.groups:
            for m, method in enumerate(METHODS):
                for mb in (args.max_blocks if method == "gather" else [0]):
                    out = (ctypes.c_double * 5)()
                    rc = f(m, rb, g, args.rows, max(mb, 1), args.reps, out)
                    r = {"method": method, "row_bytes": rb, "group_rows": g, "max_blocks": mb or None, "rc": rc,
                         "gbs": out[0], "gbs_beside_compute": out[1], "compute_slowdown": out[2],
                         "critical_wait_us": out[3], "critical_alone_us": out[4]}
                    rows.append(r)
                    print(r, flush=True)
    lines = [f"# Slot reload transfer methods ({args.rows} rows per reload, random runs)", "",
             f"commit {git_commit()[:10]}. Beside compute: a kernel stream reading device memory for about as "
             "long as the reload; slowdown = its time with / without the reload. Critical copy: 64 KiB "
             "host-to-device on a third stream while the reload runs (worst), and alone (best).", "",
             "| row bytes | rows per run | method | grid cap | GB/s | GB/s beside compute | compute slowdown | "
             "critical copy worst / alone µs |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["rc"]:
            lines.append(f"| {r['row_bytes']} | {r['group_rows']} | {r['method']} | {r['max_blocks'] or ''} | failed ({r['rc']}) | | | |")
            continue
        lines.append(f"| {r['row_bytes']} | {r['group_rows']} | {r['method']} | {r['max_blocks'] or ''} | {r['gbs']:.1f} | "
                     f"{r['gbs_beside_compute']:.1f} | {r['compute_slowdown']:.2f} | "
                     f"{r['critical_wait_us']:.0f} / {r['critical_alone_us']:.0f} |")
    write_results(Path(args.out) / "reload-methods", {"command": " ".join([sys.executable] + sys.argv),
                                                      "commit": git_commit(), "machine": machine_facts(),
                                                      "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
