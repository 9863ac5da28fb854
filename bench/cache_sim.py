#!/usr/bin/env python3
"""Cache policies on recorded workloads: the static split, the momentum balancer between
decodes (TAM, what `--balancer` runs), TAM one layer ahead (`--pipeline`) and DynamicInfer's
two-level cache (kairox.neuron_cache: pinned frequent groups + predicted groups loaded one
layer ahead), on a synthetic model's drifting session (requests changing domain) and a
stationary one, or with --text on a real model's sessions of real text (kairox.workload).
CPU only: a dense pass records which neurons fire (above the pack's thresholds); the predictor
is the oracle or one of a given recall and precision. Beside the policies: what the workload
is (density, working-set distances within and across domains) and the static split's hit
rate as the back-off's drift gate reads it.

  python3 bench/cache_sim.py --out bench/results/KB-350M-cpu/cache-sim
  python3 bench/cache_sim.py --text --model gemma.gguf --predictors '1,1;0.99,0.53' --out DIR

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
# real text (kairox.workload): text no offline profile saw; stationary in one of the pack's styles
TEXT_SESSIONS = {"drifting": ["code", "novel", "economics", "detective"], "stationary": ["novel"]}


def drift_stats(trace, n_ff: int, per: int, domains: list[str]) -> dict:
    """What the workload is, from its recorded activations: density, adjacent-token Jaccard
    distance within requests, working-set distance between requests of one domain and of
    different domains (kairox.stats), means over layers."""
    from kairox.stats import adjacent_jaccard, request_distances
    by_layer: dict[int, list] = {}
    for st in trace:
        by_layer.setdefault(st.layer, []).append(st.active)
    rid = np.repeat(np.arange(len(domains)), per)
    dens, adj, same, other = [], [], [], []
    for acts in by_layer.values():
        m = np.zeros((len(acts), n_ff), bool)
        for t, a in enumerate(acts):
            m[t, list(a)] = True
        dens.append(m.mean())
        adj.append(adjacent_jaccard(m, rid))
        a, b = request_distances(m, rid, domains)
        same.append(a)
        other.append(b)
    mean = lambda v: float(np.nanmean(v)) if np.isfinite(v).any() else None  # noqa: E731
    return {"density": mean(dens), "adjacent_jaccard": mean(adj), "request_distance_same_domain": mean(same),
            "request_distance_other_domain": mean(other)}


def hit_windows(hits: np.ndarray, per: int, window: int) -> dict:
    """The static split's hit rate as the back-off's drift gate reads it: per request the
    median, and the medians of every `window`-token window."""
    w = np.array([np.median(hits[i:i + window]) for i in range(len(hits) - window + 1)])
    return {"per_request": [float(np.median(hits[i:i + per])) for i in range(0, len(hits), per)],
            "window_min": float(w.min()), "window_max": float(w.max()), "series": hits.tolist()}


def losing_probes(hits: np.ndarray, per: int, drift: float, tokens: int = 8192, seed: int = 0) -> int:
    """Tokens a balancer that always loses (its tokens 2% slower than held ones) runs under the
    default back-off (kairox.backoff) with the drift gate at `drift` (0: probes on schedule),
    over `tokens` tokens of the session's requests in a seeded random order: the recorded
    session repeats with a period (a domain cycle of 4 x 64 tokens is the longest hold), which
    would put every check of a hold at the same point of it."""
    from kairox.backoff import Backoff, BackoffConfig
    reqs = hits[:len(hits) // per * per].reshape(-1, per)
    order = np.random.default_rng(seed).integers(0, len(reqs), -(-tokens // per))
    b = Backoff(BackoffConfig(drift=drift))
    ran = 0
    for h in reqs[order].reshape(-1)[:tokens]:
        ran += b.on
        b.step(1.02 if b.on else 1.0, float(h) if b.wants_hit else None)
    return ran


def main() -> int:
    from kairox.balancer import BalancerConfig, static_residents
    from kairox.bench import git_commit, machine_facts, write_results
    from kairox.cli import main as kx
    from kairox.neuron_cache import CacheConfig, predicted_lists, replay_listed, static_hits
    from kairox.pack import pack_path_for, read_pack
    from kairox.profile import record_trace
    from kairox.synth import topic_prompts
    from kairox.workload import model_requests

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="KB-350M")
    ap.add_argument("--model", help="a model with its pack (default: synthesize --preset)")
    ap.add_argument("--text", action="store_true", help="sessions of real text (kairox.workload: code, novel, "
                    "economics, detective), each request from an empty cache; needs --model, any model with a pack")
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
    ap.add_argument("--window", type=int, default=16, help="tokens per median of the drift gate's hit rate "
                    "(the back-off's probe length)")
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "KB-350M-cpu" / "cache-sim"))
    args = ap.parse_args()
    if args.text and not args.model:
        ap.error("--text needs --model (a model with its pack, e.g. from kairox prepare)")
    t0 = time.time()
    window_share = args.pcie_gbs * 1e9 * args.step_us * 1e-6 / args.neuron_bytes / args.ref_ff
    preds = [tuple(float(x) for x in p.split(",")) for p in args.predictors.split(";")]
    fixed = BalancerConfig(lam=0.5, adaptive=False)
    micro = BalancerConfig(lam=0.5, eps=-1.0, adaptive=False)
    sessions = TEXT_SESSIONS if args.text else SESSIONS
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / f"{args.preset}.gguf"
        if not args.model and kx(["synth", "--preset", args.preset, "-o", str(model), "--pack", "--profile", "512", "-q"]):
            return 1
        pk = read_pack(pack_path_for(model), model)
        n_ff, n_layer = pk.base.n_ff, len(pk.layers)
        capacity = int(round(args.capacity * n_ff))
        window = max(1, int(round(window_share * n_ff)))
        initial = static_residents(pk, n_ff, capacity, 1)
        freq = {il: np.asarray(layer.freq, np.float32) for il, layer in enumerate(pk.layers)}  # by neuron id
        policies = [("static", "static", None, None),
                    ("TAM between decodes (λ 0.5)", "tam", fixed, window),
                    ("TAM one layer ahead (λ 0.5)", "tam-ahead", fixed, window),
                    ("TAM one layer ahead, every listed group admitted (λ 0.5, ε -1)", "tam-ahead", micro, window),
                    ("two-level, micro only (λ 0.5)", "two-level", CacheConfig(0.5, 0.0), window),
                    ("two-level, macro 0.5 + micro", "two-level", CacheConfig(0.5, 0.5), window),
                    ("two-level, macro 0.8 + micro", "two-level", CacheConfig(0.5, 0.8), window),
                    ("two-level, macro 0.5 + micro, no window", "two-level", CacheConfig(0.5, 0.5), None)]
        runs, workloads = [], {}
        orders = {wl: [doms[i % len(doms)] for i in range(args.requests)] for wl, doms in sessions.items()}
        if args.text:
            text = dict(zip(orders, model_requests(model, list(orders.values()), args.request_tokens, args.threads)))
        for wl, order in orders.items():
            if args.text:
                prompts = text[wl]
            else:  # one document: the synthetic sessions as measured before
                prompts = [[t for req in topic_prompts(model, args.requests, args.request_tokens, seed=2,
                                                       domains=order) for t in req]]
            trace, _, _ = record_trace(model, None, prompts, threads=args.threads, group_size=1)
            hits = static_hits(trace, n_ff, initial)
            workloads[wl] = {"domains": order, **drift_stats(trace, n_ff, args.request_tokens, order),
                             "static_hit_rate": hit_windows(hits, args.request_tokens, args.window),
                             "losing_probe_tokens": {"gate": losing_probes(hits, args.request_tokens, 0.03),
                                                     "no_gate": losing_probes(hits, args.request_tokens, 0.0)}}
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
              "sessions": sessions, "text": args.text, "requests": args.requests,
              "request_tokens": args.request_tokens, "workloads": workloads,
              "command": shlex.join([sys.executable] + sys.argv),
              "commit": git_commit(), "machine": machine_facts(), "runs": runs, "wall_s": time.time() - t0}
    source = ("real text, each request from an empty cache (kairox.workload)" if args.text
              else "the synthetic domains' text, one document (kairox.synth.topic_prompts)")
    lines = [f"# Cache policies on recorded workloads: {model.name}, {capacity} of {n_ff} neurons resident per layer",
             "",
             f"Sessions of {args.requests} requests of {args.request_tokens} tokens, {source}: domains cycling "
             f"{'/'.join(sessions['drifting'])} (drifting) or {sessions['stationary'][0]} only (stationary); "
             f"{n_layer} layers; window {window} neurons per layer step ({window_share:.4f} of a layer: "
             f"{args.pcie_gbs:g} GB/s over {args.step_us:g} µs in {args.neuron_bytes}-byte neurons); commit "
             f"{result['commit'][:10]}.",
             "",
             "The workloads (means over layers; a neuron is active above its layer's pack threshold; request "
             "distance: Jaccard distance between requests' working sets, as the cross-prompt statistic) and the "
             f"static split's hit rate on the active neurons per token, as the back-off's drift gate reads it "
             f"(medians per request, and the range of {args.window}-token window medians); of 8192 tokens of the "
             "session's requests in a random order, those a balancer that always loses runs under the default "
             "back-off, with the drift gate (0.03) and without:",
             "",
             "| workload | density | adjacent | request distance, same domain | other domains | "
             "hit rate per request | window medians | losing balancer's tokens, gate / none |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for wl, w in workloads.items():
        h = w["static_hit_rate"]
        lines.append(f"| {wl} | {fmt(w['density'])} | {fmt(w['adjacent_jaccard'])} | "
                     f"{fmt(w['request_distance_same_domain'])} | {fmt(w['request_distance_other_domain'])} | "
                     f"{' '.join(f'{x:.2f}' for x in h['per_request'])} | {h['window_min']:.3f}-{h['window_max']:.3f} | "
                     f"{w['losing_probe_tokens']['gate']} / {w['losing_probe_tokens']['no_gate']} |")
    lines += ["",
              "GPU share: of the predicted lists' neurons, those resident when the layer ran. Speed-up: the CPU "
              f"work left, carried to a {args.step_us:g} µs step whose host op takes {args.host_us:g} µs at the "
              "static split.",
              "", "| workload | predictor (recall, precision) | policy | GPU share | CPU neurons / token | vs static | "
              "reloads / token | MiB / token (KB-7B F16) | speed-up (modelled) |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['workload']} | {r['recall']:g}, {r['precision']:g} | {r['policy']} | {r['share']:.3f} | "
                     f"{r['cpu_neurons_per_token']:.0f} | {r['cpu_vs_static']:.3f} | {r['loads_per_token']:.0f} | "
                     f"{r['reload_mib_per_token_ref']:.0f} | {r['speedup_ref']:.2f}x |")
    suffix = "" if args.capacity == 0.2 else f"-cap{round(100 * args.capacity)}"
    write_results(Path(args.out) / f"cache-sim-{model.stem}{suffix}", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
