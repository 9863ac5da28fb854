#!/usr/bin/env python3
"""What the load-aware thresholds cost in output and save in CPU work: one model, teacher-forced
text, the static split against each error budget, rows interleaved.

Per row: the CPU's listed rows and weight rows read per token (the host kernels' counters),
each hybrid layer's thresholds (mean grid points, the calibrated error added), and against the
static row: top-1 agreement, mean KL(static || row) of the next-token distributions, the
largest logit difference relative to the largest logit, and the perplexity of the text.

  python3 bench/thresholds_error.py --model KB-350M-f16.gguf --gpu-slots 1070 --slots-device CPU
Writes <out>/thresholds-error-<model>.json (raw, with the command) and .md.
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
    ap.add_argument("--model", required=True, help="a ReLU model whose pack has the thresholds' calibration")
    ap.add_argument("--gpu-slots", type=int, help="neurons per layer in the slots")
    ap.add_argument("--vram-budget", help="or a VRAM budget (e.g. 7GiB)")
    ap.add_argument("--slots-device", help="CPU: the same split without a GPU")
    ap.add_argument("--budgets", default="0,0.01,0.03", help="error budgets, comma-separated")
    ap.add_argument("--session", default="code,prose,dialogue,code", help="request domains (synthetic models)")
    ap.add_argument("--text", help="real text instead of a synthetic session (its first --tokens tokens)")
    ap.add_argument("--tokens", type=int, default=384, help="with --text: tokens decoded (prompt included)")
    ap.add_argument("--request", type=int, default=96, help="tokens per request")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "thresholds"))
    args = ap.parse_args()
    if (args.gpu_slots is None) == (args.vram_budget is None):
        ap.error("give --gpu-slots or --vram-budget")

    import kairox  # before numpy (bench/tpot.py)
    import numpy as np
    from kairox._native import sparse_counters
    from kairox.bench import (git_commit, log_softmax, logits_agreement, machine_facts, thresholds_summary,
                              write_results)
    from kairox.synth import topic_prompts

    if args.text:
        voc = kairox.Llama(args.model, vocab_only=True, verbose=False)
        toks = voc.tokenize(Path(args.text).read_text().encode(), add_bos=True)[:args.tokens]
        voc.close()
        workload = f"the first {len(toks)} tokens of {Path(args.text).name}"
    else:
        doms = args.session.split(",")
        toks = [t for req in topic_prompts(args.model, len(doms), args.request, seed=4, domains=doms) for t in req]
        workload = f"requests of {args.request} tokens in domains {args.session}"
    place = {k: v for k, v in (("gpu_slots", args.gpu_slots), ("vram_budget", args.vram_budget),
                               ("slots_device", args.slots_device)) if v is not None}
    budgets = [None] + [float(b) for b in args.budgets.split(",") if b]

    def decode(budget: float | None) -> dict:
        llm = kairox.Llama(args.model, n_ctx=len(toks) + 8, n_batch=512, verbose=False, sparse="predicted",
                           error_budget=budget, n_threads=args.threads, **place)
        try:
            llm.eval(toks[:args.prompt])
            sparse_counters(reset=True)
            logits, times = [], []
            for t in toks[args.prompt:]:
                t0 = time.perf_counter()
                llm.eval([t])
                times.append(time.perf_counter() - t0)
                logits.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
            c = sparse_counters(reset=True)
            nth = llm.n_threads
            thr = thresholds_summary(llm) or {}
        finally:
            llm.close()
        n = len(times)
        return {"budget": budget, "logits": np.stack(logits), "tok_s": n / sum(times),
                "up_skipped_per_token": c.up_skipped / n,
                # the host part's fused op: weight rows read (its mean thread's, times the threads)
                "rows_read_per_token": c.ffn_rows_mean * nth / n,
                **{k: thr.get(k) for k in ("kg_mean", "kc_mean", "err_added_mean")}}

    rows: list[dict] = []
    for _ in range(args.rounds):
        for b in budgets:
            rows.append(decode(b))
            print(f"budget {b}: {rows[-1]['tok_s']:.2f} tok/s, host rows {rows[-1]['rows_read_per_token']:.0f}/token",
                  file=sys.stderr)

    ref = rows[0]["logits"]
    nxt = np.array(toks[args.prompt + 1:] + [toks[-1]])[:len(ref)]
    table = []
    for b in budgets:
        rs = [r for r in rows if r["budget"] == b]
        lg = rs[0]["logits"]
        lp = log_softmax(lg)
        nll = -lp[np.arange(len(nxt) - 1), nxt[:-1]].mean()
        table.append({
            "budget": b, "rounds": len(rs),
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "tok_s_range": [min(r["tok_s"] for r in rs), max(r["tok_s"] for r in rs)],
            **{k: rs[0][k] for k in ("up_skipped_per_token", "rows_read_per_token",
                                     "kg_mean", "kc_mean", "err_added_mean")},
            **logits_agreement(ref, lg),
            "max_dlogit_rel": float(np.abs(lg - ref).max() / np.abs(ref).max()),
            "ppl": float(np.exp(nll)),
        })
    static = table[0]
    name = Path(args.model).name.removesuffix(".gguf")
    lines = [f"# Load-aware thresholds: output error and CPU work, {name}",
             "",
             f"{len(toks) - args.prompt} teacher-forced tokens after a {args.prompt}-token prompt, {workload}; "
             f"placement {place}; {args.rounds} interleaved rounds; "
             f"commit {git_commit()[:10]}. Rows read: the weight rows the host part's fused op reads per token "
             "(a listed ReLU neuron whose gate is <= 0 reads its gate row only). Error budget: the relative FFN output error the thresholds may "
             "add to the static threshold's (calibrated upper bound); '-' is the static split.",
             "",
             "| error budget | tok/s (median, range) | host rows read / token | vs static | "
             "θ_g / θ_c grid (5 static) | calibrated error added | top-1 vs static | KL vs static | "
             "max Δlogit / max logit | perplexity (static) |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for t in table:
        lines.append(
            f"| {'-' if t['budget'] is None else format(t['budget'], 'g')} | {t['tok_s']:.2f} "
            f"({t['tok_s_range'][0]:.2f}-{t['tok_s_range'][1]:.2f}) | "
            f"{t['rows_read_per_token']:.0f} | {t['rows_read_per_token'] / static['rows_read_per_token']:.3f} | "
            + (f"{t['kg_mean']:.2f} / {t['kc_mean']:.2f} | {t['err_added_mean']:.2g} | " if t["kg_mean"] is not None
               else "- | - | ")
            + f"{t['top1_vs_static']:.3f} | {t['kl_vs_static']:.2g} | {t['max_dlogit_rel']:.2g} | "
              f"{t['ppl']:.4f} ({static['ppl']:.4f}) |")
    cmd = shlex.join([sys.executable] + sys.argv)
    write_results(Path(args.out) / f"thresholds-error-{name}",
                  {"command": cmd, "commit": git_commit(), "machine": machine_facts(), "model": args.model,
                   "placement": place, "workload": workload, "rows": table}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
