"""`kairox profile-hw`: this machine's bandwidths and matvec rates measured, for `kairox plan --hw` (kairox.hw)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import hw

# what `kairox profile-hw --help` says (kairox.hw's docstring is for developers)
HELP = """Measure this machine's memory bandwidths (CPU read, GPU memory, PCIe host to device) and
the matrix-vector rate of each weight type on the CPU and the GPU, and write them as a
profile for `kairox plan --hw`. Takes about a minute.
"""


def cmd_profile_hw(args: argparse.Namespace) -> int:
    print("kairox profile-hw: measuring (CPU read, GPU HBM, PCIe by transfer size, matvec per weight type; ~1 min)...", file=sys.stderr)
    prof = hw.profile(args.threads)
    # how it was measured (HwProfile.from_json reads only its own keys)
    from ..bench import git_commit, machine_facts
    prof.update(command=f"kairox profile-hw{'' if args.threads is None else f' -t {args.threads}'} -o {args.output}",
                commit=git_commit(), machine=machine_facts())
    try:
        Path(args.output).write_text(json.dumps(prof, indent=1) + "\n")
    except OSError as e:
        print(f"kairox profile-hw: error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"CPU read {prof['cpu_gbs']:.1f} GB/s, GPU {prof['gpu_gbs']:.0f} GB/s, PCIe {prof['pcie_gbs']:.1f} GB/s"
          + ("" if prof["details"]["gpu"] else " (no GPU measured: defaults)"))
    for side in ("cpu", "gpu"):
        r = prof[f"{side}_type_gbs"]
        if r:
            print(f"{side.upper()} matvec GB/s: " + ", ".join(f"{t} {v:.1f}" for t, v in r.items()))
    print(f"kairox profile-hw: wrote {args.output} (use it with `kairox plan --hw {args.output}`)")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("profile-hw", help="measure this machine's bandwidths for `kairox plan --hw`",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", default="kxhw.json", help="profile file (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.set_defaults(func=cmd_profile_hw)
