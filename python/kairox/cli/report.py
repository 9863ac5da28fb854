"""`kairox report TRACE`: a live balancer trace drawn over time and summed up (kairox.report)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..report import TraceError, draw, read_trace, summary

# what `kairox report --help` says (kairox.report's docstring is for developers)
HELP = """Draw a live balancer trace (written by `kairox run --kx-trace FILE`) over time: the share
of active neurons the GPU computed, the neurons reloaded, why steps waited and λ, per token,
and print a summary. The trace may be gzip-compressed (.jsonl.gz).
"""


def cmd_report(args: argparse.Namespace) -> int:
    try:
        records = read_trace(args.trace)
    except (OSError, TraceError) as e:
        print(f"kairox report: error: {e}", file=sys.stderr)
        return 2
    s = summary(records)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        st = s["stalls"]
        print(f"{s['steps']} steps x {s['layers']} layers: GPU hit rate {s['hit_rate']:.3f}, "
              f"{s['loads_per_step']:.0f} loads ({s['reload_mib_per_step']:.2f} MiB) per step, "
              f"stalls io {st['io']} / cpu {st['cpu']} / none {st['none']}, worst reload wait "
              f"{s['wait_us_max']:.0f} µs, decision {s['decide_us_per_step']:.0f} µs per step, "
              f"λ {s['lam_first']:.3f} -> {s['lam_last']:.3f}")
    if args.png:
        draw(records, args.png, title=Path(args.trace).name)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("report", help="draw a live-balancer trace (hit rate, reloads, stalls, λ)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="JSON-lines trace from `kairox run --kx-trace` or bench/tpot.py --balance-trace, "
                   "plain or gzip-compressed")
    p.add_argument("--png", help="draw the four panels into this PNG")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_report)
