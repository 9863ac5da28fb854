#!/usr/bin/env python3
"""The live balancer's ablation table across configurations, folded from the raw results of
bench/balance_live.py (each row one process; several files and repeats per configuration).

Rows with the same label, thread count and host steps are one line (the warm-up, on by
default from d4679eb, and stealing in the host op, from 45525ec, are read from each row's
counters, not from its label): tok/s as median (min-max over the
repeats), TPOT p50 / p99 medians, GPU share, reloads per token, the physical bound of the
row's placement and the efficiency (bound / measured), against the static split's median in
the same call and against llama.cpp's best decode at the same budget (bench/offload.py's
results: -ngl or --fit, llama-bench).

  python3 bench/ablation.py bench/results/**/balance-live-KB-*.json \\
      --offload bench/results -o bench/results/archive/balance-live/ablation.md
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from offload import result_name  # noqa: E402

# the ablation's steps, in order (kind -> what the row adds); static-split and static-sync are
# rows of older results only (bench/results/archive/balance-live/fused/), their switches retired
STEPS = {"static-split": "static split, CPU part as four nodes (gate rows, up rows, GLU, axpy)",
         "static-sync": "static split, the scheduler's stock synchronous hand-off copies",
         "static": "static split (profiled hot neurons in the slots)",
         "mapped": "static split, the GPU also computing a share of the host side over PCIe (mapped rows)",
         "fixed": "between decodes, TAM fixed λ",
         "adaptive": "between decodes, TAM adaptive λ",
         "pipe-fixed": "one layer ahead, TAM fixed λ (compute threads decide)",
         "pipe": "one layer ahead, TAM adaptive λ (compute threads decide)",
         "pipe-thread": "one layer ahead, TAM adaptive λ (balancer thread decides)"}


def llama_cpp_best(offload_dir: Path, config: str, budget: float) -> float | None:
    """llama.cpp's best decode tok/s at that budget (llama-bench rows, -ngl and --fit), from the
    offload results in offload_dir or its folders (bench/results: one folder per configuration)."""
    f = next(iter(sorted(offload_dir.rglob(f"{result_name(config, budget)}.json"))), None)
    if f is None:
        return None
    rows = json.loads(f.read_text())["rows"]
    best = [r["tg_tok_s"] for r in rows if r["impl"] == "llama.cpp" and r.get("tg_tok_s")]
    return max(best) if best else None


def warmed(r: dict) -> bool:
    """Whether the row's host threads read the next layer's rows ahead (kx-warm.cpp)."""
    return bool((r.get("layer_us") or {}).get("warm_kib"))


def host_steps(r: dict) -> str:
    """What the row's host threads did beyond the split, from its counters: the warm-up, and
    chunks of other threads' own shares taken when theirs was done (kx-ffn-rows.c)."""
    lu = r.get("layer_us") or {}
    return (", host warm-up" if lu.get("warm_kib") else "") + (", stealing" if lu.get("stolen") else "")


def plain_label(r: dict) -> str:
    """The row's label without the warm-up switch (KX_WARM in older results, --warm now: what
    warmed() says is shown apart)."""
    label = r["row"]
    if "[" in label:
        head, _, env = label.partition(" [")
        rest = [e for e in env.rstrip("]").split() if not e.startswith(("KX_WARM=", "--warm="))]
        label = head + (f" [{' '.join(rest)}]" if rest else "")
    return label


def fold(files: list[Path], offload_dir: Path | None) -> list[str]:
    by_cfg: dict[str, dict] = {}
    for f in files:
        d = json.loads(f.read_text())
        c = by_cfg.setdefault(d["config"], {"budget": d["budget_gib"], "rows": defaultdict(list), "src": []})
        c["src"].append(f"{f.name} ({d['commit'][:7]})")
        # each row against the static rows of its own call (the machine's spread between calls
        # is larger than most differences between rows)
        own = [r["tok_s"] for r in d["rows"] if r["kind"] == "static" and not warmed(r) and
               set(r.get("env") or {}) <= {"KX_WARM", "--warm"} and (r.get("threads") or 16) == 16]
        for r in d["rows"]:
            r = {**r, "static_here": statistics.median(own) if own else None}
            c["rows"][(r["kind"], host_steps(r), plain_label(r), r.get("threads") or 16)].append(r)
    out = ["# Live balancer ablation (folded by bench/ablation.py)", "",
           "tok/s: median (min-max) over the repeats of each row; vs static: median of each run against the "
           "static rows (16 threads, no host warm-up) of its own call; "
           "vs llama.cpp: its best decode at the same budget (bench/results/*/offload-*.json). "
           "Bound: the row's placement at its own GPU share (docs/benchmarking.md); efficiency = bound / measured "
           "(median row). Every row: teacher-forced text drifting topic every 64 tokens, 16 compute threads unless "
           "given, reloads by the gather kernel. Warm-up: the host threads read the next layer's predicted rows "
           "while they wait for the device (kx-warm.cpp); each then starts on its own share. Stealing: a thread "
           "whose share is done takes chunks from the back of other shares (kx-ffn-rows.c).", ""]
    for cfg, c in sorted(by_cfg.items(), key=lambda kv: kv[1]["budget"]):
        ref = llama_cpp_best(offload_dir, cfg, c["budget"]) if offload_dir else None
        out += [f"## {cfg} @ {c['budget']:g} GiB", "", "Sources: " + ", ".join(c["src"]) +
                (f"; llama.cpp best decode {ref:.2f} tok/s." if ref else "."), "",
                "| step | row | threads | runs | tok/s | vs static | vs llama.cpp | TPOT p50 / p99 ms | GPU share | "
                "reload MiB / token | late loads | bound ms/tok | efficiency |",
                "|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"]
        order = list(STEPS)
        for (kind, host, label, threads), rs in sorted(c["rows"].items(), key=lambda kv: (order.index(kv[0][0]),
                                                                                          kv[0][1], kv[0][3], kv[0][2])):
            tok = sorted(r["tok_s"] for r in rs)
            med = statistics.median(tok)
            mid = min(rs, key=lambda r: abs(r["tok_s"] - med))
            bd = mid.get("bound")
            p50 = statistics.median(r["tpot_p50_ms"] for r in rs)
            p99 = statistics.median(r["tpot_p99_ms"] for r in rs)
            share = statistics.mean(r["gpu_share"] or 0.0 for r in rs)
            mib = statistics.mean(r["reload_mib_per_token"] or 0.0 for r in rs)
            late = statistics.mean(r.get("late_loads") or 0 for r in rs)
            rng = f"{med:.2f}" + (f" ({tok[0]:.2f}-{tok[-1]:.2f})" if len(tok) > 1 else "")
            vs = [r["tok_s"] / r["static_here"] for r in rs if r["static_here"]]
            step = STEPS[kind] + host
            out.append(f"| {step} | {label} | {threads} | {len(rs)} | {rng} | "
                       + (f"{statistics.median(vs):.2f}x | " if vs else "- | ")
                       + (f"{med / ref:.2f}x | " if ref else "- | ")
                       + f"{p50:.1f} / {p99:.1f} | {share:.3f} | {mib:.1f} | {late:.0f} | "
                       + (f"{bd['seconds'] * 1e3:.2f} ({bd['limit']}) | {bd['seconds'] * med:.2f} |" if bd else "- | - |"))
        out.append("")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="balance-live-<config>*.json files")
    ap.add_argument("--offload", type=Path, default=None, help="folder of bench/offload.py results (llama.cpp)")
    ap.add_argument("-o", "--out", type=Path, default=None, help="write the table here (default: stdout)")
    args = ap.parse_args()
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    cmd = shlex.join(["python3", "bench/ablation.py"] + sys.argv[1:])
    text = "\n".join(fold(args.files, args.offload) + ["Command:", "", "```", cmd, "```"]) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
