#!/usr/bin/env python3
"""The drift gate's input: the static split's hit rate, token by token, on session workloads.

After a lost probe the back-off (kairox.backoff, `drift`) probes again only once the median
hit rate of a window of held tokens has fallen by `drift` below the one its held probe phase
measured. Whether a threshold separates "the same text" from "other text" is a property of
the workload: this runs a model's hybrid split with an observing balancer (it records each
decode's active lists and GPU hits, moving nothing), teacher-forced on a stationary session
(every request one domain) and a drifting one (domains cycled), and reports per request the
median hit rate, and per workload the range of the window medians the gate compares.

  python3 bench/backoff_drift.py --model M.gguf --slots 700 --out DIR/backoff-drift
Writes DIR/backoff-drift.json (raw: every token's hit rate, with the command) and .md.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, write_results  # noqa: E402


def hit_series(model: str, slots: int, domains: list[str], requests: int, per: int, threads: int) -> list[float]:
    """The static split's hit rate (GPU hits over listed neurons, every hybrid layer) per token."""
    import kairox
    from kairox.synth import topic_prompts
    doms = [domains[i % len(domains)] for i in range(requests)]
    toks = [t for req in topic_prompts(model, requests, per, seed=2, domains=doms) for t in req]
    llm = kairox.Llama(model, n_ctx=requests * per + 8, n_threads=threads, verbose=False, sparse="predicted",
                       gpu_slots=slots, slots_device="CPU", balancer_record=True)
    try:
        llm.start_balancer(True, observe=True)
        for t in toks:
            llm.eval([t])
        trace = llm.balance_trace()
    finally:
        llm.close()
    n = max(r["step"] for r in trace) + 1
    hit, act = np.zeros(n), np.zeros(n)
    for r in trace:
        hit[r["step"]] += r["n_hit"]
        act[r["step"]] += r["n_active"]
    return (hit / np.maximum(act, 1)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a synthetic model with its pack (kairox synth --pack)")
    ap.add_argument("--slots", type=int, required=True, help="neuron slots per layer (the static split's GPU side)")
    ap.add_argument("--sessions", nargs="+", default=["code", "code,prose,dialogue,code"],
                    help="comma-separated domains per session")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--per", type=int, default=64, help="tokens per request")
    ap.add_argument("--window", type=int, default=16, help="the back-off's window (tokens per median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="output prefix")
    args = ap.parse_args()
    lines = [f"# The static split's hit rate on session workloads: {Path(args.model).name}, {args.slots} slots per layer",
             "", f"{args.requests} requests of {args.per} tokens, teacher-forced, one token per decode; commit "
             f"{git_commit()}. Per request: the median of its tokens' hit rates. Window medians: every "
             f"{args.window}-token window's median (what the drift gate compares), min-max and 1st-99th "
             "percentile.", "",
             "| session | median | per request | window medians min-max | p1-p99 |", "|---|---:|---|---|---|"]
    series = {}
    for s in args.sessions:
        v = np.array(hit_series(args.model, args.slots, s.split(","), args.requests, args.per, args.threads))
        series[s] = v.tolist()
        per_req = [statistics.median(v[i:i + args.per]) for i in range(0, len(v), args.per)]
        w = np.array([np.median(v[i:i + args.window]) for i in range(len(v) - args.window + 1)])
        p1, p99 = np.percentile(w, [1, 99])
        lines.append(f"| {s} | {np.median(v):.3f} | {', '.join(f'{x:.3f}' for x in per_req)} | "
                     f"{w.min():.3f}-{w.max():.3f} | {p1:.3f}-{p99:.3f} |")
        print(lines[-1], flush=True)
    write_results(args.out, {"command": shlex.join(sys.argv), "commit": git_commit(), "model": args.model,
                             "slots": args.slots, "per": args.per, "window": args.window, "series": series}, lines)


if __name__ == "__main__":
    main()
