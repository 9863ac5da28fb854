#!/usr/bin/env python3
"""Cache policies on recorded workloads: the static split, the momentum balancer between
decodes (TAM, what `--balancer` runs), TAM one layer ahead (`--pipeline`) and DynamicInfer's
two-level cache (kairox.neuron_cache: pinned frequent groups + predicted groups loaded one
layer ahead), on a synthetic model's drifting session (requests changing domain) and a
stationary one. CPU only: a dense pass records which neurons fire; the predictor is the
oracle or one of a given recall and precision.

  python3 bench/cache_sim.py --out bench/results/KB-350M-cpu/cache-sim

Every dynamic policy loads at most `window` neurons per layer step: what the PCIe link moves
while a layer computes (--pcie-gbs over --step-us, in neurons of --neuron-bytes, scaled to
this model's width as a share of the layer). These figures rank policies by the CPU work they
leave; the speed-up column carries that work over to KB-7B F16 @ 7 GiB's measured step
(--step-us per layer, of which --host-us the host's FFN op at the static split). They ignore
the memory bandwidth a reload takes from the CPU's own reads and whether a reload lands in
time: the live rows measure those.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

SESSIONS = {"drifting": ["code", "prose", "dialogue", "code"], "stationary": ["code"]}


def main() -> int:
    from kairox.balancer import BalancerConfig, freq_by_neuron, static_residents
    from kairox.bench import git_commit, machine_facts, write_results
    from kairox.cli import main as kx
    from kairox.neuron_cache import CacheConfig, predicted_lists, replay_listed
    from kairox.pack import pack_path_for, read_pack
    from kairox.profile import record_trace
    from kairox.synth import topic_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="KB-350M")
    ap.add_argument("--model", help="a synthetic model with its pack (default: synthesize --preset)")
    ap.add_argument("--capacity", type=float, default=0.2, help="resident share of each layer's neurons "
                    "(KB-7B F16 @ 7 GiB holds about 0.2)")
    ap.add_argument("--requests", type=int, default=12, help="requests per session")
    ap.add_argument("--request-tokens", type=int, default=64)
    ap.add_argument("--pcie-gbs", type=float, default=44.0, help="reload rate (GB/s; a throttled gather, "
                    "shared/reference/hardware.md)")
    ap.add_argument("--step-us", type=float, default=284.0, help="a layer's decode step (µs)")
    ap.add_argument("--host-us", type=float, default=125.0, help="of which the host's FFN op (µs)")
    ap.add_argument("--neuron-bytes", type=int, default=3 * 4096 * 2, help="a neuron's rows (KB-7B F16)")
    ap.add_argument("--ref-ff", type=int, default=11008, help="the reference model's neurons per layer")
    ap.add_argument("--predictors", default="1,1;0.95,0.5", help="recall,precision pairs (1,1: the oracle)")
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "KB-350M-cpu" / "cache-sim"))
    args = ap.parse_args()
    t0 = time.time()
    window_share = args.pcie_gbs * 1e9 * args.step_us * 1e-6 / args.neuron_bytes / args.ref_ff
    preds = [tuple(float(x) for x in p.split(",")) for p in args.predictors.split(";")]
    fixed = BalancerConfig(lam=0.5, adaptive=False)
    micro = BalancerConfig(lam=0.5, eps=-1.0, adaptive=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / f"{args.preset}.gguf"
        if not args.model and kx(["synth", "--preset", args.preset, "-o", str(model), "--pack", "--profile", "512", "-q"]):
            return 1
        pk = read_pack(pack_path_for(model), model)
        n_ff, n_layer = pk.base.n_ff, len(pk.layers)
        capacity = int(round(args.capacity * n_ff))
        window = max(1, int(round(window_share * n_ff)))
        initial = static_residents(pk, n_ff, capacity, 1)
        freq = {il: freq_by_neuron(layer.perm, layer.freq, np.float32) for il, layer in enumerate(pk.layers)}
        policies = [("static", "static", None, None),
                    ("TAM between decodes (λ 0.5)", "tam", fixed, window),
                    ("TAM one layer ahead (λ 0.5)", "tam-ahead", fixed, window),
                    ("TAM one layer ahead, every listed group admitted (λ 0.5, ε -1)", "tam-ahead", micro, window),
                    ("two-level, micro only (λ 0.5)", "two-level", CacheConfig(0.5, 0.0), window),
                    ("two-level, macro 0.5 + micro", "two-level", CacheConfig(0.5, 0.5), window),
                    ("two-level, macro 0.8 + micro", "two-level", CacheConfig(0.5, 0.8), window),
                    ("two-level, macro 0.5 + micro, no window", "two-level", CacheConfig(0.5, 0.5), None)]
        runs = []
        for wl, doms in SESSIONS.items():
            order = [doms[i % len(doms)] for i in range(args.requests)]
            toks = [t for req in topic_prompts(model, args.requests, args.request_tokens, seed=2, domains=order)
                    for t in req]
            trace, _, _ = record_trace(model, None, [toks], threads=args.threads, group_size=1)
            for rec, prec in preds:
                listed = predicted_lists(trace, n_ff, rec, prec, freq, seed=3)
                base = None
                for name, pol, cfg, win in policies:
                    r = replay_listed(trace, listed, n_ff, capacity, initial, pol, cfg, freq, win, name=name)
                    base = base or r
                    ratio = r.cpu_per_token / base.cpu_per_token if base.cpu_per_token else 1.0
                    runs.append({"workload": wl, "recall": rec, "precision": prec, "policy": name,
                                 "share": r.share, "cpu_neurons_per_token": r.cpu_per_token,
                                 "cpu_vs_static": ratio, "loads_per_token": r.loads_per_token,
                                 "reload_mib_per_token_ref": r.loads_per_token / n_ff * args.ref_ff
                                 * args.neuron_bytes / 2**20,
                                 "speedup_ref": args.step_us / (args.step_us - args.host_us + args.host_us * ratio)})
    result = {"benchmark": "cache-sim", "model": model.name, "n_ff": n_ff, "n_layer": n_layer,
              "capacity": capacity, "window": window, "window_share": window_share,
              "sessions": SESSIONS, "requests": args.requests,
              "request_tokens": args.request_tokens, "command": shlex.join([sys.executable] + sys.argv),
              "commit": git_commit(), "machine": machine_facts(), "runs": runs, "wall_s": time.time() - t0}
    lines = [f"# Cache policies on recorded workloads: {model.name}, {capacity} of {n_ff} neurons resident per layer",
             "",
             f"Sessions of {args.requests} requests of {args.request_tokens} tokens, domains cycling "
             f"{'/'.join(SESSIONS['drifting'])} (drifting) or code only (stationary); {n_layer} layers; "
             f"window {window} neurons per layer step ({window_share:.4f} of a layer: {args.pcie_gbs:g} GB/s over "
             f"{args.step_us:g} µs in {args.neuron_bytes}-byte neurons); commit {result['commit'][:10]}.",
             "GPU share: of the predicted lists' neurons, those resident when the layer ran. Speed-up: the CPU "
             f"work left, carried to a {args.step_us:g} µs step whose host op takes {args.host_us:g} µs at the static split.",
             "", "| workload | predictor (recall, precision) | policy | GPU share | CPU neurons / token | vs static | "
             "reloads / token | MiB / token (KB-7B F16) | speed-up (modelled) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['workload']} | {r['recall']:g}, {r['precision']:g} | {r['policy']} | {r['share']:.3f} | "
                     f"{r['cpu_neurons_per_token']:.0f} | {r['cpu_vs_static']:.3f} | {r['loads_per_token']:.0f} | "
                     f"{r['reload_mib_per_token_ref']:.0f} | {r['speedup_ref']:.2f}x |")
    write_results(Path(args.out) / f"cache-sim-{model.stem}", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
