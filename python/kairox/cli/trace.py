"""`kairox trace FILE`: a scheduler trace read back, CPU/GPU overlap per layer (kairox.trace)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..trace import (TraceError, breakdown, breakdown_text, longest_graph, pick_graph, plot_graph, read_trace,
                     summarize, summary_text)

# what `kairox trace --help` says (kairox.trace's docstring is for developers)
HELP = """Read a scheduler trace (written by any tool with --kx-sched-trace FILE, or `kairox.Llama(
sched_trace=FILE)`) and report, per hybrid layer, how long the CPU and the GPU worked and
how much of the CPU's work ran while the GPU worked. --png draws one token's timeline.
The trace may be gzip-compressed (.jsonl.gz).
"""


def cmd_trace(args: argparse.Namespace) -> int:
    try:
        recs, dropped = read_trace(args.trace)
        s = summarize(recs)
        print(summary_text(s))
        if dropped:
            print(f"kairox trace: {dropped} records were dropped (raise --kx-sched-trace-max / sched_trace_max)")
        if args.breakdown:
            b = breakdown(recs, args.graph if args.graph is not None else longest_graph(recs))
            print(breakdown_text(b))
            s = {**s, "breakdown": b}
        if args.json:
            Path(args.json).write_text(json.dumps(s, indent=1) + "\n")
        if args.png:
            g = args.graph if args.graph is not None else pick_graph(recs)
            plot_graph(recs, g, args.png)
            print(f"kairox trace: drew graph {g} to {args.png}")
    except (TraceError, RuntimeError) as e:
        print(f"kairox trace: error: {e}", file=sys.stderr)
        return 2
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("trace", help="read a scheduler trace (--kx-sched-trace FILE): CPU/GPU overlap per layer, timeline",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="trace file written by a run with --kx-sched-trace FILE (sched_trace= in Python), "
                   "plain or gzip-compressed")
    p.add_argument("--png", help="draw one step's timeline to this PNG")
    p.add_argument("--graph", type=int, help="which graph to draw (default: a typical overlapped step)")
    p.add_argument("--json", help="write the summary figures to this JSON file")
    p.add_argument("--breakdown", action="store_true",
                   help="where one graph's time went (--graph, default: the longest, e.g. a prompt's batch): "
                   "CPU, GPU, input copies, longest splits")
    p.set_defaults(func=cmd_trace)
