#!/usr/bin/env python3
"""Decode speed against the VRAM budget, through the binaries: kairox-bench at each budget
(its own placement: dense tensors that do not fit wait on the CPU, neuron slots fill what is
left; without a pack, whole tensors) beside llama.cpp's best placement that fits the same
budget, from the same build: the largest -ngl that fits, and every layer on the GPU but the FFN
weights of the fewest first layers (-ot ...=CPU; an MoE model's experts with
--n-cpu-moe), each probed at the rows' own context as bench/offload.py probes and run with
-fa 0 and -fa 1; the fastest of these is the row's llama.cpp figure. A placement fits when both
its buffers and its measured device use over the CUDA context's (pools, workspaces: what a card
of that size must hold) are within the budget; every row's peak is in the results.

Each round runs every budget's rows once, budgets in order. A budget kairox refuses is
recorded with its message, not skipped. Writes raw results (JSON with the exact commands and
the commit), a Markdown table and a plot of tok/s against the budget.

    python3 bench/budget_sweep.py --model KB-7B-f16.gguf --budgets 1,2,4,7,10,14 --bin BUILD/bin --out OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import (MiB, Layout, context_mib, ffn_cpu_flags, find_ffn_cpu, find_ngl, tpot_run,  # noqa: E402
                     write_tokens)
from tools_bench import add_run_args, bench_row, commit  # noqa: E402

from kairox.bench import machine_facts  # noqa: E402


def kairox_row(exe: Path, model: str, gen: int, threads: int, budget_gib: float, sparse: str, prompt: int = 0,
               flags: list[str] | None = None, peak: list | None = None) -> tuple[list[str], float | None, str]:
    extra = ["--vram-budget", f"{budget_gib:g}GiB", *(["--sparse", sparse] if sparse != "auto" else []), "-fa", "1",
             *(flags or [])]
    try:
        cmd, ts = bench_row(exe, model, gen, threads, extra, prompt, peak)
        return cmd, ts, ""
    except RuntimeError as e:  # a refused budget (its message) or a failed run: the result either way
        msg = str(e)
        if "kairox:" in msg:
            return extra, None, "refused: " + msg[msg.rfind("kairox:"):].strip()
        return extra, None, "failed: " + " / ".join(msg.strip().splitlines()[-2:])[-300:]


def tpot_flags(la: list[str]) -> list[str]:
    """bench/tpot.py's flags for llama-bench's -fa, -ot and -ncmoe (whose patterns are
    common/common.h's LLM_FFN_EXPS_REGEX for each of the first N layers)."""
    out = ["--flash-attn", "on" if la[la.index("-fa") + 1] == "1" else "off"]
    for o, v in zip(la, la[1:]):
        if o == "-ot":
            out += ["--override-tensor", v]
        elif o == "-ncmoe":
            out += [x for i in range(int(v)) for x in ("--override-tensor",
                                                         f"blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU")]
    return out


def gib_list(text: str) -> list[float]:
    """argparse type: budgets in GiB, comma-separated ("1,2,3.5")."""
    try:
        return [float(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets in GiB, comma-separated, not {text!r}") from None


def tpot_rows(rows: list[dict], args: argparse.Namespace, model: Path, lib: Path) -> None:
    """Per-token decode times (TPOT p50/p99) after the rounds: bench/tpot.py, one process per
    row, the same teacher-forced tokens for all, kairox at each budget beside llama.cpp's
    fastest placement of that budget's decode rows (its -ngl, -fa and -ot flags)."""
    tokens = Path(args.out) / f"{model.stem}.tokens.json"
    write_tokens(model, tokens)
    env = {"LLAMA_CPP_LIB_PATH": str(lib), "KAIROX_LIB_DIR": os.environ.get("KAIROX_LIB_DIR", str(lib))}
    mode = "dense" if args.sparse == "auto" else args.sparse
    only = set(getattr(args, "tpot", None) or ())  # empty: every budget
    for r in rows:
        if not r["kairox"]["tok_s"] or not all(v["tok_s"] for v in r["llama"].values()):
            continue
        if only and r["budget_gib"] not in only:
            continue
        best = max(r["llama"], key=lambda f: statistics.median(r["llama"][f]["tok_s"]))
        la = r["llama"][best]["args"]
        stock = tpot_flags(la)
        r["tpot"] = {"llama_flags": best}
        for who, impl, m, ngl, extra in (
                ("kairox", "kairox", mode, 999, ["--vram-budget", f"{r['budget_gib']:g}GiB", "--flash-attn", "on",
                                                 "--balancer", "none"]),
                ("llama", "stock", "dense", int(la[la.index("-ngl") + 1]), stock)):
            try:
                res = tpot_run(impl, m, model, tokens, ngl, args.threads, env, extra)
                r["tpot"][who] = {k: res[k] for k in ("command", "tok_s", "tpot_p50_ms", "tpot_p99_ms")}
            except SystemExit as e:  # a failed row is recorded, the others still run
                r["tpot"][who] = {"error": str(e)[-300:]}
        print(f"{r['budget_gib']:g} GiB TPOT: {r['tpot']}", flush=True)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("kairox", "kairox-bench --vram-budget"), ("llama", "llama.cpp best -ngl/-ot/-fa")):
        pts = [(b["budget_gib"], b[key]["median"]) for b in res["budgets"] if b[key]["median"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_yscale("log")
    ax.set_title(f"{res['model']}: decode against the VRAM budget")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(rows: list[dict], args: argparse.Namespace, model: Path) -> list[str]:
    """The results so far (budgets with at least one round) as JSON, Markdown and a plot: a run
    cut short by the call's deadline keeps the budgets it finished."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"budget-sweep-{model.stem}"
    budgets_out = []
    for r in rows:
        if not all(v["tok_s"] for v in r["llama"].values()):
            continue
        best = max(r["llama"], key=lambda f: statistics.median(r["llama"][f]["tok_s"]))
        lr = r["llama"][best]
        kx = r["kairox"]
        budgets_out.append({
            "budget_gib": r["budget_gib"], "ngl_search": r["ngl_search"], "ffn_cpu_search": r["ffn_cpu_search"],
            "kairox": {"command": " ".join(kx["cmd"]), "tok_s": kx["tok_s"], "error": kx["error"],
                       "peak_mib": kx["peak_mib"],
                       "median": statistics.median(kx["tok_s"]) if kx["tok_s"] else None,
                       "pp_tok_s": kx["pp"], "pp_median": statistics.median(kx["pp"]) if kx["pp"] else None},
            "llama": {"flags": best, "command": " ".join(lr["cmd"]), "tok_s": lr["tok_s"],
                      "median": statistics.median(lr["tok_s"]),
                      "all": {f: v["tok_s"] for f, v in r["llama"].items()},
                      "peak_mib_all": {f: v["peak_mib"] for f, v in r["llama"].items()},
                      "pp_all": {f: v["pp"] for f, v in r["llama_pp"].items() if v["pp"]}},
            "prefill_search": r.get("prefill_search"), "tpot": r.get("tpot"),
            "also": {k: {"command": " ".join(v["cmd"] or []), "tok_s": v["tok_s"], "error": v["error"],
                         "peak_mib": v["peak_mib"],
                         "median": statistics.median(v["tok_s"]) if v["tok_s"] else None}
                     for k, v in r["also"].items()}})
    res = {"commit": commit(), "command": " ".join([sys.executable, *sys.argv]), "model": model.name,
           "model_mib": round(model.stat().st_size / MiB), "sparse": args.sparse, "gen": args.gen,
           "threads": args.threads, "rounds": args.rounds, "prefill": args.prefill,
           "machine": getattr(args, "machine", None),
           "ngl0_peak_mib": getattr(args, "ctx_peak_mib", None), "budgets": budgets_out}
    return render(res, out, stem)


def render(res: dict, out: Path, stem: str) -> list[str]:
    """A sweep's results (write's, or merge's) as JSON, a Markdown table and a plot."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    budgets_out = res["budgets"]
    also = list(budgets_out[0]["also"]) if budgets_out else []
    how = (f"{res['rounds']} round(s); commit {res['commit']}" if "parts" not in res else
           "; ".join(f"{p['budgets']} GiB: {p['rounds']} round(s), commit {p['commit']}" for p in res["parts"]))
    lines = [f"# {res['model']} ({res['model_mib']} MiB): decode against the VRAM budget", "",
             f"decode of {res['gen']} tokens, {res['threads']} threads, {how}",
             "", "| budget | kairox-bench tok/s | " + "".join(f"kairox {a} tok/s | " for a in also) +
             "llama.cpp best (flags) tok/s | kairox / llama.cpp |", "|---:|---:|" + "---:|" * len(also) + "---:|---:|"]
    for b in budgets_out:
        kx, lr = b["kairox"], b["llama"]
        spread = lambda v: f" ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else ""  # noqa: E731
        kxs = f"{kx['median']:.2f}{spread(kx['tok_s'])}" if kx["median"] else kx["error"]
        ratio = f"{kx['median'] / lr['median']:.2f}x" if kx["median"] else "-"
        cols = "".join(f"{v['median']:.2f}{spread(v['tok_s'])} | " if v["median"] else f"{v['error'] or '-'} | "
                       for v in b["also"].values())
        lines.append(f"| {b['budget_gib']:g} GiB | {kxs} | {cols}{lr['median']:.2f}{spread(lr['tok_s'])} "
                     f"(`{lr['flags']}`) | {ratio} |")
    peaks = [b for b in budgets_out if b["kairox"].get("peak_mib")]
    ctx = res["ngl0_peak_mib"]
    if peaks:
        lines += ["", "Each row's device use against its budget: the GPU's peak memory use during the row over the "
                  f"idle GPU's, less llama.cpp's at `-ngl 0` ({ctx if ctx is not None else '-'} MiB: the CUDA context), "
                  "MiB, median of the rounds (pools and workspaces included, as a card of that size must hold them):",
                  "", "| budget | kairox-bench | " + "".join(f"kairox {a} | " for a in also) + "llama.cpp (flags) |",
                  "|---:|---:|" + "---:|" * len(also) + "---|"]
        med = lambda v: f"{statistics.median(v) - (ctx or 0):.0f}" if v else "-"  # noqa: E731
        for b in peaks:
            ll = ", ".join(f"`{f}` {med(v)}" for f, v in b["llama"]["peak_mib_all"].items())
            lines.append(f"| {b['budget_gib'] * 1024:.0f} | {med(b['kairox']['peak_mib'])} | "
                         + "".join(f"{med(v['peak_mib'])} | " for v in b["also"].values()) + f"{ll} |")
    if res.get("prefill"):
        lines += ["", f"Prefill of {res['prefill']} tokens (llama-bench -p {res['prefill']} -n 0), tok/s; llama.cpp's "
                  "placements searched again at the prefill's context (its compute buffers are larger):", "",
                  "| budget | kairox-bench | llama.cpp best (flags) | kairox / llama.cpp |", "|---:|---:|---:|---:|"]
        for b in budgets_out:
            kx, pa = b["kairox"], b["llama"]["pp_all"]
            if not pa:
                continue
            best = max(pa, key=lambda f: statistics.median(pa[f]))
            lm = statistics.median(pa[best])
            kxs = f"{kx['pp_median']:.1f}" if kx["pp_median"] else "-"
            ratio = f"{kx['pp_median'] / lm:.2f}x" if kx["pp_median"] else "-"
            lines.append(f"| {b['budget_gib']:g} GiB | {kxs} | {lm:.1f} (`{best}`) | {ratio} |")
    tp = [b for b in budgets_out if b.get("tpot")]
    if tp:
        ms = lambda t: f"{t['tpot_p50_ms']:.1f} / {t['tpot_p99_ms']:.1f}" if "tpot_p50_ms" in t else "failed"  # noqa
        lines += ["", "Per-token decode time, ms p50 / p99 (bench/tpot.py: one process a row, the same teacher-forced "
                  "tokens, each decoded alone after a 64-token prompt; llama.cpp at its fastest decode placement):", "",
                  "| budget | kairox | llama.cpp (flags) |", "|---:|---:|---:|"]
        lines += [f"| {b['budget_gib']:g} GiB | {ms(b['tpot']['kairox'])} | {ms(b['tpot']['llama'])} "
                  f"(`{b['tpot']['llama_flags']}`) |" for b in tp]
    lines += ["", "Commands (kairox-bench; llama.cpp's rows are the same binary with the flags shown):", "", "```",
              *[b["kairox"]["command"] for b in budgets_out], "```", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    try:
        plot(res, out / f"{stem}.png")
    except ImportError:
        pass
    return lines


def merge(paths: list[Path]) -> dict:
    """Sweeps of one model on one machine (calls of one warm machine: a 1-14 GiB sweep does
    not fit one call) as one: their budgets in order, each part's commit and rounds kept. Extra
    rows (--also) one part measured and another did not stay blank at the other's budgets. A
    budget in two files, or files of different models, decode lengths or thread counts, are
    refused: the table would mix what it compares."""
    parts = [json.loads(p.read_text()) for p in paths]
    first = parts[0]
    for key in ("model", "gen", "threads", "sparse"):
        if any(p[key] != first[key] for p in parts):
            raise ValueError(f"the sweeps differ in {key}: " + ", ".join(f"{p[key]}" for p in parts))
    hosts = {(p.get("machine") or {}).get("host") for p in parts}
    if len(hosts) > 1:
        raise ValueError(f"the sweeps ran on different machines: {sorted(map(str, hosts))}")
    budgets = [b for p in parts for b in p["budgets"]]
    also = list(dict.fromkeys(a for b in budgets for a in b["also"]))
    blank = {"command": "", "tok_s": [], "error": "", "peak_mib": [], "median": None}
    budgets = [{**b, "also": {a: b["also"].get(a, blank) for a in also}} for b in budgets]
    seen = [b["budget_gib"] for b in budgets]
    if len(set(seen)) != len(seen):
        raise ValueError(f"a budget is in more than one sweep: {sorted(seen)}")
    # a part may have prefilled and another not (its budgets have no prefill row); two
    # prefill lengths would put unlike rows in one column
    prefill = {p.get("prefill", 0) for p in parts} - {0}
    if len(prefill) > 1:
        raise ValueError(f"the sweeps prefilled different lengths: {sorted(prefill)}")
    return {**{k: first.get(k) for k in ("model", "model_mib", "sparse", "gen", "threads", "ngl0_peak_mib",
                                         "machine")},
            "commit": ",".join(dict.fromkeys(p["commit"] for p in parts)),
            "rounds": min(p["rounds"] for p in parts), "prefill": max(prefill, default=0),
            "command": " ".join([sys.executable, *sys.argv]),
            "parts": [{"file": path.name, "commit": p["commit"], "rounds": p["rounds"], "command": p["command"],
                       "budgets": ",".join(f"{b['budget_gib']:g}" for b in p["budgets"])}
                      for path, p in zip(paths, parts)],
            "budgets": sorted(budgets, key=lambda b: b["budget_gib"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the model GGUF (required unless --merge)")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="no runs: write these sweeps' results (one model, one machine) as one table and plot "
                         "to --out (file stem: --name, default budget-sweep-MODEL)")
    ap.add_argument("--budgets", type=gib_list, default="1,2,3,4,6,8,10,12,14",
                    help="GiB, comma-separated (default: %(default)s)")
    ap.add_argument("--sparse", default="predicted",
                    help="kairox's --sparse; auto: none given (a model without a pack, an MoE model: whole "
                         "tensors) (default: %(default)s)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also prefill N tokens on every row (llama-bench -p N -n 0) (default: none)")
    ap.add_argument("--tpot", nargs="?", type=gib_list, const=[], default=None, metavar="GIB,...",
                    help="after the rounds, also time each decoded token (bench/tpot.py) of kairox and of "
                         "llama.cpp's fastest placement at every budget, or at these budgets only: TPOT p50/p99")
    ap.add_argument("--also", action="append", default=[], metavar="LABEL=FLAGS",
                    help="one more kairox row per budget with these extra kairox-bench flags, e.g. "
                         "no-stream=--no-kx-stream (repeatable; rows interleaved with the others)")
    add_run_args(ap, gen=32, rounds=1, stem="budget-sweep", bin_required=False)
    args = ap.parse_args()
    if args.merge:
        try:
            res = merge(args.merge)
        except (ValueError, KeyError, OSError) as e:
            ap.error(f"--merge: {e}")
        stem = args.name or f"budget-sweep-{Path(res['model']).stem}"
        print("\n".join(render(res, Path(args.out), stem)))
        return 0
    if not args.model or not args.bin:
        ap.error("--model and --bin are required (or --merge)")
    exe = Path(args.bin) / "llama-bench"
    model = Path(args.model)
    lay = Layout(model)
    budgets = args.budgets
    also = dict(a.split("=", 1) for a in args.also)
    t0 = time.time()
    # what holding the GPU costs without weights on it: the peaks below include it, the budgets not
    args.ctx_peak_mib = context_mib(str(exe), model, args.threads)
    args.machine = machine_facts()  # (a merge refuses sweeps of two machines)
    rows = []
    for b in budgets:
        ngl, _, search = find_ngl(str(exe), model, lay, b * 1024, args.threads, n_gen=args.gen)
        k, ffn_search = find_ffn_cpu(str(exe), model, lay, b * 1024, args.threads, args.gen)
        placements = [["-ngl", str(ngl)]] + ([ffn_cpu_flags(lay, k)] if k is not None else [])
        pp_places, pp_search = [], None
        if args.prefill:
            ngl_pp, _, s1 = find_ngl(str(exe), model, lay, b * 1024, args.threads, n_gen=args.gen, prompt=args.prefill)
            k_pp, s2 = find_ffn_cpu(str(exe), model, lay, b * 1024, args.threads, args.gen, args.prefill)
            pp_places = [["-ngl", str(ngl_pp)]] + ([ffn_cpu_flags(lay, k_pp)] if k_pp is not None else [])
            pp_search = {"ngl": s1, "ffn_cpu": s2}
        rows.append({"budget_gib": b, "ngl_search": search, "ffn_cpu_search": ffn_search, "prefill_search": pp_search,
                     "kairox": {"tok_s": [], "cmd": None, "error": "", "pp": [], "peak_mib": []},
                     "also": {k: {"tok_s": [], "cmd": None, "error": "", "peak_mib": []} for k in also},
                     "llama": {" ".join([*p, "-fa", f]): {"args": [*p, "-fa", f], "tok_s": [], "cmd": None,
                                                          "peak_mib": []}
                               for p in placements for f in ("0", "1")},
                     "llama_pp": {" ".join([*p, "-fa", f]): {"args": [*p, "-fa", f], "pp": []}
                                  for p in pp_places for f in ("0", "1")}})
        print(f"{b:g} GiB: llama.cpp fits {' / '.join(' '.join(p) for p in placements)} ({time.time() - t0:.0f} s)",
              flush=True)
    for k in range(args.rounds):
        for r in rows:
            cmd, ts, err = kairox_row(exe, str(model), args.gen, args.threads, r["budget_gib"], args.sparse,
                                      peak=r["kairox"]["peak_mib"])
            r["kairox"]["cmd"], r["kairox"]["error"] = cmd, err
            if ts is not None:
                r["kairox"]["tok_s"].append(ts)
                if args.prefill:
                    _, pp, _ = kairox_row(exe, str(model), args.gen, args.threads, r["budget_gib"], args.sparse,
                                          args.prefill)
                    r["kairox"]["pp"] += [pp] if pp is not None else []
            for label, ar in r["also"].items():
                ar["cmd"], t, ar["error"] = kairox_row(exe, str(model), args.gen, args.threads, r["budget_gib"],
                                                       args.sparse, flags=also[label].split(), peak=ar["peak_mib"])
                ar["tok_s"] += [t] if t is not None else []
            for lr in r["llama"].values():
                lr["cmd"], t = bench_row(exe, str(model), args.gen, args.threads, lr["args"], peak=lr["peak_mib"])
                lr["tok_s"].append(t)
            for lr in r["llama_pp"].values():
                lr["pp"].append(bench_row(exe, str(model), args.gen, args.threads, lr["args"], args.prefill)[1])
            print(f"round {k + 1}: {r['budget_gib']:g} GiB: kairox {ts if ts is not None else err} / llama.cpp "
                  f"{[lr['tok_s'][-1] for lr in r['llama'].values()]} ({time.time() - t0:.0f} s)", flush=True)
            lines = write(rows, args, model)
    if args.tpot is not None:
        tpot_rows(rows, args, model, Path(args.bin))
        lines = write(rows, args, model)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
