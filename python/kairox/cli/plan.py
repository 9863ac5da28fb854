"""`kairox plan MODEL --budget S`: the GPU placement for a VRAM budget, written as a plan file (kairox.plan)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..plan import MiB, HwProfile, PlanError, make_plan, parse_size

# what `kairox plan --help` says (kairox.plan's docstring is for developers)
HELP = """Choose what goes on the GPU for a VRAM budget: which dense tensors, and how many of each
layer's FFN neurons (the most active ones), so that per token the slower of the CPU and
GPU parts is as fast as possible. Prints the placement with its expected cost and writes
a plan file for `kairox run --plan` and the tools' --kx-plan. --hw uses this machine's
measured rates (`kairox profile-hw`).
"""


def cmd_plan(args: argparse.Namespace) -> int:
    hw = HwProfile()
    if args.hw:
        try:
            hw = HwProfile.from_json(json.loads(Path(args.hw).read_text()))
        except (OSError, ValueError, TypeError) as e:
            print(f"kairox plan: error: cannot read the hardware profile {args.hw}: {e}", file=sys.stderr)
            return 2
    try:
        plan = make_plan(args.model, args.budget, hw, pack_path=args.pack, reserved=args.reserve)
    except (PlanError, OSError, ValueError) as e:
        print(f"kairox plan: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output or Path(args.model).with_suffix(".kxplan.json"))
    out.write_text(plan.to_json() + "\n")
    if args.explain:
        print(plan.explain())
    print(f"kairox plan: wrote {out}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="choose the GPU placement for a VRAM budget (dense tensors + neuron slots)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model GGUF (its pack next to it is used when present)")
    p.add_argument("--budget", type=parse_size, required=True, help="VRAM budget, e.g. 7GiB")
    p.add_argument("--pack", help="sparse pack (default: MODEL.kxpack.gguf when present)")
    p.add_argument("--hw", help="hardware profile JSON from `kairox profile-hw` (default: the GPU machine's figures)")
    p.add_argument("--reserve", type=parse_size, default=512 * MiB,
                   help="bytes kept for KV cache and compute buffers (default: 512MiB)")
    p.add_argument("-o", "--output", help="plan file (default: MODEL.kxplan.json)")
    p.add_argument("--explain", action="store_true", help="print why each part went where")
    p.set_defaults(func=cmd_plan)
