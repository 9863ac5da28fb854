#!/usr/bin/env python3
"""A decode soak: one model decoding for a long time as a server would, its memory and speed
sampled at a fixed interval; they must stay flat (no leak, no slow-down).

Requests of a synthetic session (domains changing request to request) are decoded one after
the other, each a prompt and `--request` free-generated tokens from an empty KV cache, with
the hybrid and the live balancer (or whatever the options say). Every `--every` seconds: the
process's RSS, the GPU memory in use (the device's, every process), the tokens/s of the
interval, the requests done. The summary compares the first and the last quarter.

  python3 bench/soak.py --model KB-7B-f16.gguf --vram-budget 7GiB --balancer adaptive --seconds 3600
Writes <out>/soak-<model>.json (raw samples, with the command and commit) and .md.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a synthetic model with its pack")
    ap.add_argument("--vram-budget", help="hybrid under this budget (e.g. 7GiB)")
    ap.add_argument("--gpu-slots", type=int, help="or this many neurons per layer in slots")
    ap.add_argument("--slots-device", help="CPU: the same split without a GPU")
    ap.add_argument("--balancer", choices=["off", "fixed", "adaptive"], default="adaptive")
    ap.add_argument("--seconds", type=float, default=3600.0, help="how long to decode")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--request", type=int, default=256, help="tokens generated per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--session", default="code,prose,dialogue,code", help="request domains, in turn")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak"))
    args = ap.parse_args()

    import kairox  # before numpy (bench/tpot.py)
    from kairox._native import gpu_memory
    from kairox.balancer import BalancerConfig
    from kairox.bench import git_commit, machine_facts, rss_bytes, write_results
    from kairox.synth import topic_prompts

    doms = args.session.split(",")
    prompts = topic_prompts(args.model, 4 * len(doms), args.prompt, seed=7, domains=doms * 4)
    place = {k: v for k, v in (("gpu_slots", args.gpu_slots), ("vram_budget", args.vram_budget),
                               ("slots_device", args.slots_device)) if v is not None}
    if args.balancer != "off":
        place["balancer"] = BalancerConfig(adaptive=args.balancer == "adaptive")
    llm = kairox.Llama(args.model, n_ctx=args.prompt + args.request + 16, n_batch=512, verbose=False,
                       sparse="predicted", n_threads=args.threads, **place)
    gm = gpu_memory()
    samples: list[dict] = []
    t_start = time.perf_counter()
    t_next, n_tok, n_req = t_start + args.every, 0, 0
    last_t, last_tok = t_start, 0
    while True:
        llm.reset()
        llm.eval(prompts[n_req % len(prompts)])
        for _ in range(args.request):
            llm.eval([llm.sample(temp=0.0)])
            n_tok += 1
        n_req += 1
        now = time.perf_counter()
        if now >= t_next or now - t_start >= args.seconds:
            gm = gpu_memory()
            samples.append({"t_s": round(now - t_start, 1), "rss_mib": rss_bytes() / 2**20,
                            "gpu_used_mib": None if gm is None else (gm[1] - gm[0]) / 2**20,
                            "tok_s": (n_tok - last_tok) / (now - last_t), "requests": n_req, "tokens": n_tok})
            print(f"soak: {samples[-1]}", file=sys.stderr, flush=True)
            last_t, last_tok, t_next = now, n_tok, t_next + args.every
        if now - t_start >= args.seconds:
            break
    llm.close()

    q = max(1, len(samples) // 4)
    first, last = samples[:q], samples[-q:]

    def med(rows: list[dict], k: str) -> float | None:
        vals = [r[k] for r in rows if r[k] is not None]
        return statistics.median(vals) if vals else None
    summary = {k: {"first": med(first, k), "last": med(last, k)} for k in ("rss_mib", "gpu_used_mib", "tok_s")}
    name = Path(args.model).stem
    cmd = shlex.join([sys.executable] + sys.argv)
    result = {"command": cmd, "commit": git_commit(), "machine": machine_facts(), "options": vars(args),
              "samples": samples, "summary": summary}
    lines = [f"# Decode soak: {name}", "", f"`{cmd}`", "",
             f"{args.seconds:.0f} s, a sample every {args.every:.0f} s; requests of {args.prompt} + {args.request} "
             f"tokens in domains {args.session}; balancer {args.balancer}; commit {git_commit()[:10]}.", "",
             "| measure | first quarter (median) | last quarter (median) | change |", "|---|---|---|---|"]
    for k, v in summary.items():
        if v["first"] is None:
            continue
        lines.append(f"| {k} | {v['first']:.1f} | {v['last']:.1f} | {100 * (v['last'] / v['first'] - 1):+.1f}% |")
    lines += ["", "| t (s) | RSS MiB | GPU used MiB | tok/s | requests |", "|---|---|---|---|---|"]
    lines += [f"| {s['t_s']} | {s['rss_mib']:.1f} | {s['gpu_used_mib'] if s['gpu_used_mib'] is None else round(s['gpu_used_mib'])} "
              f"| {s['tok_s']:.1f} | {s['requests']} |" for s in samples]
    write_results(Path(args.out) / f"soak-{name}", result, lines)
    print("\n".join(lines[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
