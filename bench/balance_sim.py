#!/usr/bin/env python3
"""Offline balancer ablation: a synthetic model's recorded activations (topic text that
drifts every 64 tokens) replayed through a static placement, TAM at a fixed λ and TAM with
adaptive λ (`kairox balance`), for several group sizes at one capacity. CPU only.

  python3 bench/balance_sim.py --preset KB-350M --out bench/results/KB-350M-cpu

Writes balance-sim-PRESET.json (raw: every run, the command, the commit) and .md (table).
The stall type each step ends in comes from a cost model (CPU read and PCIe bandwidths of
--hw, or kairox plan's defaults), not from a measured pipeline: these figures rank policies,
they do not predict tok/s.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))


def main() -> int:
    from kairox.bench import git_commit, machine_facts, write_results
    from kairox.cli import main as kx
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="KB-350M")
    ap.add_argument("--capacity", type=float, default=0.25, help="resident fraction of each layer's neurons")
    ap.add_argument("--group-sizes", default="32,8,1")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--hw", help="hardware profile (kairox profile-hw)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / f"{args.preset}.gguf"
        if kx(["synth", "--preset", args.preset, "-o", str(model), "--pack", "--profile", "512", "-q"]):
            return 1
        trace = Path(tmp) / "trace.jsonl"
        runs = []
        for gs in (int(g) for g in args.group_sizes.split(",")):
            out = Path(tmp) / f"g{gs}.json"
            argv = ["balance", str(model), "--group-size", str(gs), "--capacity", str(args.capacity),
                    "--tokens", str(args.tokens), "--prompts", str(args.prompts), "--json", str(out),
                    *(["--hw", args.hw] if args.hw else [])]
            # one recording per group size: the groups are part of the trace
            if kx(argv + ["--record", str(trace)]):
                return 1
            runs.append({"group_size": gs, **json.loads(out.read_text())})
    result = {"benchmark": "balance-sim", "preset": args.preset, "capacity": args.capacity,
              "command": shlex.join([sys.executable] + sys.argv), "commit": git_commit(),
              "machine": machine_facts(), "runs": runs, "wall_s": time.time() - t0}
    lines = [f"# Offline balancer ablation: {args.preset}, {args.capacity:g} of each layer's neurons resident", "",
             f"{runs[0]['tokens']} tokens ({args.prompts} prompts of topic text switching every 64 tokens) x "
             f"{runs[0]['n_layer']} layers; commit {result['commit'][:10]}. Hit rate: share of active neurons "
             "whose group was resident when needed; loads: groups loaded per token (all layers). Stalls come "
             "from a cost model (bench/balance_sim.py), not a measured pipeline.", "",
             "| group size | policy | hit rate | loads / token | stalls io / cpu / none |",
             "|---:|---|---:|---:|---|"]
    for r in runs:
        for p in r["runs"]:
            s = p["stalls"]
            lines.append(f"| {r['group_size']} | {p['policy']} | {p['hit_rate']:.3f} | {p['loads_per_token']:.1f} | "
                         f"{s['io']} / {s['cpu']} / {s['none']} |")
    write_results(Path(args.out) / f"balance-sim-{args.preset}", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
