#!/usr/bin/env python3
"""The live balancer's ablation on the GPU machine: one standard configuration at its VRAM
budget, teacher-forced text whose topic drifts every --switch-every tokens, decoded by the
static hybrid and by the live balancer with a fixed λ and with the adaptive λ.

Each row is one bench/tpot.py process (the same tokens for all): tok/s, TPOT p50/p99, GPU
share (listed neurons computed from slots, from the host kernels' counters), reloads per
token (neurons, MiB), the stall types the balancer saw, its worst wait for a reload, the
decision's time per step, and λ at the end. The adaptive row's per-step records go to
<out>/balance-live-<config>.jsonl, drawn by `kairox report`.

  python3 bench/balance_live.py --config KB-7B --work /tmp/kxbench --out bench/results/KB-7B-f16-h200
Writes <out>/balance-live-<config>.json (raw, with every command) and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from offload import CONFIGS, PROMPT, log, run, tpot_run  # noqa: E402

sys.path.insert(0, str(ROOT / "python"))
from kairox.balancer import PIPE_MAX_ADMIT  # noqa: E402
from kairox.bench import git_commit, machine_facts, write_results  # noqa: E402

# pipe*: one layer ahead within each token; pipe-thread: its prefetch made by the balancer's
# own thread beside the CPU part (give it a core: a row thread count below the cores);
# mapped:F: the static split with the GPU computing share F of the host side over PCIe
# (kairox.Llama mapped_share; F in the λ position); plain: the static split with no balancer
# at all, as users run it by default (the static row's balancer observes: it counts the GPU
# share at the boundary, which costs time per layer). Older results also hold static-split and
# static-sync rows, whose switches are retired (docs/benchmarking.md, "Switches retired").
ROWS = ("static", "plain", "mapped", "fixed", "adaptive", "pipe-fixed", "pipe", "pipe-thread")
POLICY = {"plain": "none", "mapped": "static", "pipe": "adaptive", "pipe-fixed": "fixed", "pipe-thread": "adaptive"}
PIPELINED = ("pipe", "pipe-fixed", "pipe-thread")


def parse_row(spec: str, lam: float, max_admit: int | None,
              threads: int) -> tuple[str, float, int | None, int]:
    """KIND[:LAM[:MAX_ADMIT[:THREADS]]] -> (kind, λ, max_admit, threads); missing parts from
    --lam / --max-admit / --threads (an empty part too)."""
    parts = spec.split(":")
    if parts[0] not in ROWS or len(parts) > 4:
        raise ValueError(spec)
    part = lambda k: parts[k] if len(parts) > k and parts[k] else None  # noqa: E731
    return (parts[0], float(part(1) or lam), int(part(2)) if part(2) else max_admit,
            int(part(3)) if part(3) else threads)


def split_env(spec: str) -> tuple[str, dict[str, str]]:
    """ROW[@VAR=VAL...] -> (ROW, {VAR: VAL}): a row run with extra environment (such as
    GGML_CUDA_DISABLE_GRAPHS=1); a VAR starting with -- is an argument of bench/tpot.py
    (@--flash-attn=off)."""
    head, *pairs = spec.split("@")
    env = {}
    for kv in pairs:
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ValueError(spec)
        env[k] = v
    return head, env


def sched_summary(path: Path) -> dict:
    """A row's scheduler trace summarized (kairox.trace.summarize: overlap, and the hand-offs and
    splits beside the reloads), the file then gzip-compressed in place."""
    import gzip
    import shutil
    from kairox.trace import read_trace, summarize
    recs, dropped = read_trace(path)
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return {**summarize(recs), "file": gz.name, "records": len(recs), "dropped": dropped}


def trace_lines(what: str, summary: dict) -> list[str]:
    """The call table's lines for a scheduler trace's summary (what: the run it is of, with an
    opening parenthesis the line closes)."""
    from kairox.trace import summary_text
    return ["", f"Scheduler trace of {what}; stamps cost a few µs each, so it is not a timing run):", ""] + \
        ["    " + ln for ln in summary_text(summary).splitlines()]


def row_bound(lay, costs, counters: dict, n_tok: int, reload_bytes: float, pipeline: bool, bw: dict) -> dict:
    """The row's physical floor per token (offload.py's bound of the static hybrid's placement
    at the row's own GPU share), with its reloads on PCIe and, one layer ahead, every
    predictor read twice."""
    from offload import bound, hybrid_bytes_per_token
    b = hybrid_bytes_per_token(lay, counters, n_tok, costs.per_neuron, costs.pred * (2 if pipeline else 1),
                               costs.n_ff, costs.gate_row)
    b["pcie"] += reload_bytes
    return {"bytes": b, **bound(b, bw)}


def host_op_us(res: dict) -> dict | None:
    """Per layer step (µs): the token's time over its host FFN calls, the fused op's span (thread
    0), its slowest and its mean thread's neuron loop (kx_cpu_ffn_stats), its phases
    (kx_cpu_ffn_phases); with the scheduler's
    counters (kx_sched_stats), per CPU split: its compute (the op plus thread start and join
    and its other nodes), the wait for the device before it, the device launches and copies,
    and per token the time outside the split loop (graph build and allocation, output, the
    driver), spread over the layers. None without calls."""
    c = res.get("counters") or {}
    calls, n_tok = c.get("ffn_calls", 0), len(res.get("tpot_s") or [])
    if not calls or not n_tok:
        return None
    us = {"step": 1e6 * sum(res["tpot_s"]) / calls, "op": c["ffn_op_ns"] / calls / 1e3,
          "loop_max": c["ffn_work_max_ns"] / calls / 1e3, "loop_mean": c["ffn_work_mean_ns"] / calls / 1e3}
    sc = c.get("sched") or {}
    if sc.get("cpu_splits"):
        n = sc["cpu_splits"]
        us.update(cpu_split=sc["cpu_ns"] / n / 1e3, device_wait=sc["drain_ns"] / n / 1e3,
                  launch=sc["launch_ns"] / n / 1e3, copy=sc["copy_ns"] / n / 1e3,
                  outside=(1e9 * sum(res["tpot_s"]) - sc["splits_ns"]) / n / 1e3)
    w = c.get("warm") or {}
    if w.get("calls"):  # the host-cache warm-up (on unless --warm=off): per layer step, KiB read ahead
        us.update(warm_kib=w["bytes"] / calls / 1024, warm_lists=w["lists"] / w["calls"])
    if c.get("ffn_stolen") is not None:  # own shares: chunks taken from another thread's share
        us.update(stolen=c["ffn_stolen"] / calls)
    bd = c.get("boundary") or {}
    if bd.get("steps") and sc.get("cpu_splits"):  # the balancer's boundary after each decode (in outside)
        n = sc["cpu_splits"]
        us.update(boundary=bd["ns"] / n / 1e3,
                  boundary_phases={k[:-3]: v / n / 1e3 for k, v in bd.items() if k.endswith("_ns")})
    ph = c.get("ffn_phases") or {}
    if any(ph.values()):  # where the op's span goes, µs per call (kx_cpu_ffn_phases: the mean thread's)
        us.update(op_phases={k[:-3]: v / calls / 1e3 for k, v in ph.items()})
    pp = c.get("pipeline") or {}
    if pp.get("steps"):  # the pipeline's prefetch and publish within the decode, µs per prefetch step
        us.update(pipe_phases={k[:-3]: v / pp["steps"] / 1e3 for k, v in pp.items() if k.endswith("_ns")})
    return us


def medians(results: list[dict]) -> list[str]:
    """The rows of one label over the call's rounds, in first-seen order: runs, median tok/s
    with the range, against the median of the static rows (- without one), against the plain
    row of the same round (the users' static split; the n-th row of a label is in round n):
    the median of those ratios with their range, so a machine whose speed drifts over the call
    moves both sides of each ratio (- without plain rows), held boundaries and returns to the
    static split with the neurons they loaded and the held boundaries that ran before those
    had landed (the back-off). Markdown table lines."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["row"], []).append(r)
    base = statistics.median(r["tok_s"] for r in groups["static"]) if "static" in groups else None
    plain = [r["tok_s"] for r in groups.get("plain", [])]
    lines = ["| row | runs | tok/s median (min-max) | vs static median | vs plain, by round (min-max) "
             "| held boundaries | returns (neurons, boundaries in flight) |",
             "|---|---:|---|---:|---|---|---|"]
    for label, rs in groups.items():
        t = [r["tok_s"] for r in rs]
        med = statistics.median(t)
        paired = [a / b for a, b in zip(t, plain)]
        bd = [((r.get("counters") or {}).get("boundary") or {}) for r in rs]
        held = [b.get("held") for b in bd]
        homes = [f"{b['homes']} ({b.get('home_loads', 0)}, {b.get('home_late', 0)})" for b in bd if b.get("homes")]
        lines.append(f"| {label} | {len(rs)} | {med:.2f} ({min(t):.2f}-{max(t):.2f}) | "
                     + (f"{med / base:.2f}x" if base else "-") + " | "
                     + (f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})" if paired else "-")
                     + " | " + (", ".join(str(h) for h in held) if any(held) else "-") + " | "
                     + (", ".join(homes) or "-") + " |")
    return lines


def row_of(kind: str, lam: float, max_admit: int | None, threads: int, res: dict, bd: dict | None) -> dict:
    if max_admit is None and kind in PIPELINED:
        max_admit = PIPE_MAX_ADMIT  # the runtime's cap for the pipeline
    c = res.get("counters") or {}
    b = res.get("balance") or {}  # kairox.report.summary of the row's records
    if kind == "mapped":
        label = f"mapped {lam:g}"
    elif POLICY.get(kind, kind) in ("static", "none"):
        label = kind
    else:
        label = f"{kind} λ{'0' if kind in ('adaptive', 'pipe', 'pipe-thread') else ''}={lam:g}" + (
            f", ≤{max_admit} loads" if max_admit is not None else "")
    return {"row": label, "kind": kind, "lam": lam, "max_admit": max_admit, "threads": threads,
            "tok_s": res["tok_s"], "tpot_p50_ms": res["tpot_p50_ms"], "tpot_p99_ms": res["tpot_p99_ms"],
            "bound": bd, "efficiency": bd["seconds"] * res["tok_s"] if bd else None,
            "hold_us_per_step": b.get("hold_us_per_step"),
            # listed neurons computed from slots (the balancer's records; the static row observes)
            "gpu_share": b.get("hit_rate"),
            "loads_per_token": b.get("loads_per_step", 0.0), "reload_mib_per_token": b.get("reload_mib_per_step", 0.0),
            "stalls": b.get("stalls"), "wait_us_max": b.get("wait_us_max"), "late_loads": b.get("late_loads"),
            "decide_us_per_step": b.get("decide_us_per_step"), "lam_last_mean": b.get("lam_last"),
            "layer_us": host_op_us(res), "command": res["command"], "balance": b or None, "counters": c, "tpot_s": res.get("tpot_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=[k for k, v in CONFIGS.items() if v[0]])
    ap.add_argument("--work", default="/tmp/kxbench", help="where the synthetic model and its pack are (or go)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--budget", type=float, help="VRAM budget in GiB (default: the configuration's)")
    ap.add_argument("--gen", type=int, default=256, help="decoded tokens per row")
    ap.add_argument("--switch-every", type=int, default=64,
                    help="tokens per topic; with --session, tokens per request")
    ap.add_argument("--session", metavar="DOMAINS",
                    help="a session workload instead: requests of --switch-every tokens whose domains follow "
                         "this comma-separated list (code,prose,dialogue,math; cycled to fill the tokens), "
                         "e.g. code,prose,dialogue,code (drifting) or code (stationary)")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"comma-separated KIND[:LAM[:MAX_ADMIT[:THREADS]]][@VAR=VAL...], KIND one of "
                         f"{', '.join(ROWS)}; @VAR=VAL runs that row with extra environment")
    ap.add_argument("--lam", type=float, default=0.5)
    ap.add_argument("--max-admit", type=int, help="neurons loaded per step and layer (default: no cap)")
    ap.add_argument("--reload-method", default="gather", choices=["gather", "memcpy", "batch"])
    ap.add_argument("--decide", default="auto", choices=["auto", "worker", "inline"],
                    help="where the TAM step runs (auto: one kernel on the GPU for every layer)")
    ap.add_argument("--trace", action="store_true",
                    help="after the rows, one static run with the scheduler trace (--sched-trace): per-layer CPU, "
                         "GPU and hand-off times, trace-<config>-live.png / .jsonl")
    ap.add_argument("--cpu-gbs", type=float, default=117.0,
                    help="CPU read roof for the bound (GB/s; the run's own probe where it measures more)")
    args = ap.parse_args()
    try:
        rows = []
        for r in (r for r in args.rows.split(",") if r):
            head, renv = split_env(r)
            rows.append((*parse_row(head, args.lam, args.max_admit, args.threads), renv))
    except ValueError as e:
        ap.error(f"--rows: bad entry {e} (KIND[:LAM[:MAX_ADMIT[:THREADS]]], KIND one of {', '.join(ROWS)})")
    if not rows:
        ap.error("--rows is empty")

    from kairox.pack import pack_path_for
    from kairox.synth import PRESETS, topic_prompts
    preset, budget = CONFIGS[args.config]
    budget = args.budget or budget
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{preset}-{PRESETS[preset].ftype}.gguf"
    if not model.exists() or not pack_path_for(model).exists():
        run([sys.executable, "-m", "kairox", "synth", "--preset", preset, "-o", str(model), "--pack", "-q"],
            timeout=3600)
    if args.session:
        order = args.session.split(",")
        n_req = -(-(PROMPT + args.gen) // args.switch_every)
        doms = [order[i % len(order)] for i in range(n_req)]
        toks = [t for req in topic_prompts(model, n_req, args.switch_every, seed=2, domains=doms) for t in req]
        toks = toks[:PROMPT + args.gen]
        tokens = work / f"{model.stem}.session-{'-'.join(order)}-{args.switch_every}.tokens.json"
        workload = f"a session of {args.switch_every}-token requests in domains {','.join(order)}"
    else:
        toks = topic_prompts(model, 1, PROMPT + args.gen, seed=2, switch_every=args.switch_every)[0]
        tokens = work / f"{model.stem}.drift{args.switch_every}.tokens.json"
        workload = f"text drifting every {args.switch_every} tokens"
    tokens.write_text(json.dumps(toks))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"balance-live-{args.config}" + (f"-session-{'-'.join(args.session.split(','))}" if args.session else "")
    env = {"KAIROX_LIB_DIR": os.environ.get("KAIROX_LIB_DIR", "")}
    from offload import Layout
    from kairox.hw import measure_bandwidths
    from kairox.plan import slot_costs
    bw = measure_bandwidths(args.threads)
    bw["cpu_read"] = max(bw.get("cpu_read") or 0.0, args.cpu_gbs)
    log(f"bandwidths GB/s (CPU read: the larger of the probe and --cpu-gbs): {bw}")
    lay, costs = Layout(model), slot_costs(model)
    results = []
    trace: dict = {}  # --trace: the traced static run's summary (offload.hybrid_trace)
    traced = traced_pipe = False

    def write() -> None:
        base = next((r["tok_s"] for r in results if r["row"] == "static"), None)
        lines = [f"# Live balancer: {args.config} at {budget:g} GiB, {workload}",
                 "",
                 f"{args.gen} decoded tokens (teacher-forced, after a {PROMPT}-token prompt), {args.threads} threads, "
                 f"reloads by {args.reload_method}; commit {git_commit()[:10]}. GPU share: listed neurons computed from "
                 "slots. Reloads and stalls: per decoded token, from the balancer's records; late loads: layer steps "
                 "(pipe rows) whose reloads had not landed when their layer began.",
                 "",
                 "Bound: the physical floor per token of the row's placement at its own GPU share "
                 f"(docs/benchmarking.md; CPU read {bw['cpu_read']:.0f} GB/s, reloads on PCIe); efficiency = bound / "
                 "measured. Hold: the CPU part's wait for the balancer thread's decision (pipe-thread rows). "
                 "µs per layer: the decode time over the host FFN calls, the fused host op's span, its "
                 "slowest and mean thread's neuron loop (the rest of the span: x conversion, barriers, sums); "
                 "per CPU split (scheduler counters): its compute (the op with thread start and join), the wait for "
                 "the device's results before it, the device launches and input copies queued, and the token's "
                 "time outside the split loop (graph build, allocation, output, driver) spread over the layers; "
                 "of that, the balancer's boundary after each decode (kx_balance_stats; phases in the JSON).",
                 "",
                 "Thresholds (rows with --error-budget): mean grid points of θ_g / θ_c (5: static), CPU work vs "
                 "the static thresholds', calibrated error added (share of the FFN output norm); output: top-1 agreement and mean KL of the "
                 "teacher-forced next-token distributions against the static row.",
                 "",
                 "| row | threads | tok/s | vs static | TPOT p50 / p99 ms | thresholds θ_g / θ_c, CPU neurons, error | "
                 "top-1 / KL vs static | GPU share | loads / token | reload MiB / token | "
                 "stalls io / cpu / none | worst reload wait µs | late loads | decision µs / token | hold µs / token | "
                 "λ at end | bound ms/tok (limit) | efficiency | µs per layer: step / host op / loop max / mean | "
                 "µs per layer: CPU split / device wait / launches / copies / outside (boundary) |",
                 "|---|---:|---:|---:|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
        for r in results:
            st = r["stalls"] or {}
            bd = r["bound"]
            lines.append(
                f"| {r['row']} | {r['threads']} | {r['tok_s']:.2f} | {r['tok_s'] / base:.2f}x | "
                f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                + (f"{t['kg_mean']:.1f} / {t['kc_mean']:.1f}, {t['cpu_neurons_vs_static']:.2f}, "
                   f"{t['err_added_mean']:.2g} | " if (t := r.get("thresholds")) else "- | ")
                + (f"{r['top1_vs_static']:.3f} / {r['kl_vs_static']:.2g} | " if "top1_vs_static" in r else "- | ")
                + f"{r['gpu_share'] or 0:.3f} | {r['loads_per_token']:.0f} | {r['reload_mib_per_token']:.1f} | "
                f"{st.get('io', 0)} / {st.get('cpu', 0)} / {st.get('none', 0)} | "
                f"{(r['wait_us_max'] or 0):.0f} | {r.get('late_loads') or 0} | {(r['decide_us_per_step'] or 0):.0f} | "
                f"{(r['hold_us_per_step'] or 0):.0f} | "
                f"{'' if r['lam_last_mean'] is None else format(r['lam_last_mean'], '.3f')} | "
                + (f"{bd['seconds'] * 1e3:.2f} ({bd['limit']}) | {r['efficiency']:.2f} |" if bd else "- | - |")
                + (" {step:.0f} / {op:.0f} / {loop_max:.0f} / {loop_mean:.0f} |".format(**lu)
                   if (lu := r.get("layer_us")) else " - |")
                + (" {cpu_split:.0f} / {device_wait:.0f} / {launch:.0f} / {copy:.0f} / {outside:.0f}".format(**lu)
                   + (f" ({lu['boundary']:.0f}) |" if "boundary" in lu else " |")
                   if lu and "cpu_split" in lu else " - |")
                if base else f"| {r['row']} | {r['threads']} | {r['tok_s']:.2f} |")
        if base:
            lines += ["", "Over the rounds (vs the median of the static rows; the table above compares each row with "
                      "the first static row):", ""] + medians(results)
        if trace:
            lines += trace_lines(f"one more static run ({trace['png']}, records {trace['records']}", trace)
        for r in results:
            if r.get("sched_trace"):
                lines += trace_lines(f"row {r['row']} ({r['sched_trace']['file']}", r["sched_trace"])
        cmd = shlex.join([sys.executable] + sys.argv)
        write_results(out / name, {"command": cmd, "commit": git_commit(), "machine": machine_facts(), "bandwidths": bw,
                                   "config": args.config, "budget_gib": budget, "gen": args.gen,
                                   "switch_every": args.switch_every, "session": args.session, "rows": results, "trace": trace or None}, lines)

    for kind, lam, max_admit, threads, renv in rows:
        policy = POLICY.get(kind, kind)
        extra = ["--vram-budget", f"{budget:g}GiB", "--balancer", policy, "--lam", str(lam),
                 "--reload-method", args.reload_method] + (["--pipeline"] if kind in PIPELINED else [])
        if max_admit is not None:
            extra += ["--max-admit", str(max_admit)]
        if kind == "mapped":
            extra += ["--mapped-share", str(lam)]
        if kind == "adaptive" and not traced:  # the first adaptive row's records
            extra += ["--balance-trace", str(out / f"{name}.jsonl")]
            traced = True
        if kind == "pipe" and not traced_pipe:
            extra += ["--balance-trace", str(out / f"{name}-pipe.jsonl")]
            traced_pipe = True
        extra += ["--decide", "worker" if kind == "pipe-thread" else "auto" if kind in PIPELINED else args.decide]
        row_env = {k: v for k, v in renv.items() if not k.startswith("--")}
        sched = None  # @--sched-trace=FILE: the row's scheduler trace, FILE under --out
        if "--sched-trace" in renv:
            sched = out / Path(renv["--sched-trace"]).name
            renv = {**renv, "--sched-trace": str(sched)}
        extra += [a for k, v in renv.items() if k.startswith("--") for a in (k, v)]
        logits = work / f"{name}.row{len(results)}.logits.npy"
        extra += ["--logits-out", str(logits)]
        res = tpot_run("kairox", "predicted", model, tokens, 999, threads, {**env, **row_env}, extra)
        if row_env:
            res["command"] = " ".join(f"{k}={v}" for k, v in row_env.items()) + " " + res["command"]
        bd = None
        if res.get("counters") and gpu_hbm_known(bw):
            reload = (res.get("balance") or {}).get("reload_mib_per_step", 0.0) * 2**20
            bd = row_bound(lay, costs, res["counters"], args.gen, reload, kind in PIPELINED, bw)
        results.append(row_of(kind, lam, max_admit, threads, res, bd))
        results[-1]["thresholds"] = res.get("thresholds")
        if sched is not None and sched.exists():
            results[-1]["sched_trace"] = sched_summary(sched)
        ref = next((i for i, r in enumerate(results) if r["row"] == "static"), None)
        if ref is not None:
            import numpy as np
            from kairox.bench import logits_agreement
            results[-1].update(logits_agreement(np.load(work / f"{name}.row{ref}.logits.npy"), np.load(logits)))
        if renv:
            results[-1]["row"] += " [" + " ".join(f"{k}={v}" for k, v in renv.items()) + "]"
            results[-1]["env"] = renv
        log(f"{kind}: {results[-1]['tok_s']:.2f} tok/s, GPU share {results[-1]['gpu_share']}")
        write()  # after every row: a call cut short keeps the rows it measured
    if args.trace:
        from offload import hybrid_trace
        trace.update(hybrid_trace(out, f"{args.config}-live", model, tokens, args.threads, env,
                                  ["--vram-budget", f"{budget:g}GiB", "--balancer", "static"]))
        write()
    return 0


def gpu_hbm_known(bw: dict) -> bool:
    return bw.get("gpu_hbm") is not None


if __name__ == "__main__":
    sys.exit(main())
