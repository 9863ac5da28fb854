"""`kairox balance MODEL.gguf`: the online balancer's policy (kairox.balancer) replayed on a
model's recorded activations, against the static placement."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..balancer import (BalancerConfig, SimCosts, read_activation_trace, simulate, static_residents,
                       write_activation_trace)
from ..pack import pack_path_for, read_pack
from ..plan import HwProfile, slot_costs
from ..profile import record_trace
from ..synth import has_topics, topic_prompts
from ..workload import TEXT_DOMAINS, model_requests

# what `kairox balance --help` says
HELP = """Simulate the online neuron balancer on a model's recorded activations: a dense pass on the
CPU records which neuron groups each token activates (synthetic models get topic text that
changes every --switch-every tokens; real models, requests of real text whose domain cycles
code, novel, economics, detective: kairox.workload), then the static placement, the momentum
policy with a fixed λ and the adaptive λ replay them; prints the hit rates and reloads of each.
"""


def cmd_balance(args) -> int:
    model = Path(args.model)
    pack = Path(args.pack or pack_path_for(model))
    try:
        pk = read_pack(pack, model)
        gs = args.group_size or pk.group_size
        n_groups = -(-pk.base.n_ff // gs) if args.group_size else pk.n_groups
        capacity = args.capacity if args.capacity >= 1 else int(round(args.capacity * n_groups))
        if not 0 < capacity <= n_groups:
            raise ValueError(f"--capacity gives {capacity} groups; the pack has {n_groups} per layer")
        if args.trace:
            trace = read_activation_trace(args.trace)
        else:
            if has_topics(model):
                prompts = topic_prompts(model, args.prompts, args.tokens, seed=args.seed,
                                        switch_every=args.switch_every or None)
            else:  # a real model: requests of real text changing domain (kairox.workload)
                doms = [TEXT_DOMAINS[i % len(TEXT_DOMAINS)] for i in range(args.prompts)]
                prompts = model_requests(model, [doms], args.tokens, args.threads)[0]
            trace, _, _ = record_trace(model, pack, prompts, threads=args.threads, group_size=args.group_size)
            if args.record:
                write_activation_trace(args.record, trace)
        hw = HwProfile.from_json(json.loads(Path(args.hw).read_text())) if args.hw else HwProfile()
        costs = SimCosts.from_rates(slot_costs(model, pack).per_neuron, gs, hw.rates)
    except (OSError, ValueError) as e:
        print(f"kairox balance: error: {e}", file=sys.stderr)
        return 2
    initial = static_residents(pk, n_groups, capacity, args.group_size)
    n_layer = len(pk.layers)
    runs = [simulate(trace, n_groups, capacity, costs, initial, None, "static"),
            simulate(trace, n_groups, capacity, costs, initial,
                     BalancerConfig(lam=args.lam, adaptive=False, max_admit=args.max_admit), f"TAM λ={args.lam:g}"),
            simulate(trace, n_groups, capacity, costs, initial,
                     BalancerConfig(lam=args.lam, adaptive=True, max_admit=args.max_admit), "TAM, adaptive λ")]
    print(f"{model.name}: {len(trace) // n_layer} tokens x {n_layer} layers, {n_groups} groups of {gs} "
          f"{'(by frequency)' if args.group_size else '(the pack’s)'} per layer, {capacity} resident; a neuron costs "
          f"{costs.cpu_s_per_neuron * 1e6:.2f} µs on the CPU, a group {costs.io_s_per_group * 1e6:.2f} µs to load")
    print("| policy | hit rate (active neurons resident) | loads / token | stalls io / cpu / none | λ at the end (min-max over layers) |")
    print("|---|---:|---:|---|---|")
    for r in runs:
        lam = [v[-1] for v in r.lam.values()]
        print(f"| {r.policy} | {r.hit_rate:.3f} | {r.loads_per(n_layer):.1f} | "
              f"{r.stalls['io']} / {r.stalls['cpu']} / {r.stalls['none']} | "
              f"{f'{min(lam):.2f}-{max(lam):.2f}' if lam else '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": model.name, "tokens": len(trace) // n_layer, "n_layer": n_layer, "n_groups": n_groups,
            "capacity": capacity, "costs": asdict(costs),
            "runs": [{"policy": r.policy, "hit_rate": r.hit_rate, "loads_per_token": r.loads_per(n_layer),
                      "stalls": r.stalls, "lam": {str(k): v for k, v in r.lam.items()}} for r in runs]}, indent=1))
    return 0


def register(sub) -> None:
    p = sub.add_parser("balance", help="simulate the online balancer on a model's recorded activations "
                       "(static placement vs TAM vs adaptive λ)",
                       description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model GGUF with a sparse pack (a gated model's neurons are active above "
                   "the pack's thresholds)")
    p.add_argument("--pack", help="the pack (default: MODEL.kxpack.gguf)")
    p.add_argument("--capacity", type=float, default=0.25,
                   help="groups resident per layer: a count, or a fraction of the groups below 1 (default: %(default)s)")
    p.add_argument("--group-size", type=int,
                   help="regroup: this many neurons per group by descending offline frequency, 1 for single "
                   "neurons (default: the pack's groups)")
    p.add_argument("--lam", type=float, default=0.5, help="λ (the adaptive run's start) (default: %(default)s)")
    p.add_argument("--max-admit", type=int, help="groups loaded per layer and step (default: no cap)")
    p.add_argument("--prompts", type=int, default=2, help="prompts to record (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--switch-every", type=int, default=64,
                   help="synthetic models: the topic changes every this many tokens, 0 never (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("--hw", help="hardware profile from `kairox profile-hw` (the cost model's bandwidths)")
    p.add_argument("--trace", help="replay this recorded activation trace instead of recording one")
    p.add_argument("--record", help="write the recorded activation trace (JSON lines) here")
    p.add_argument("--json", help="write the figures here")
    p.set_defaults(func=cmd_balance)
