#!/usr/bin/env python3
"""Sparse FFN on the CPU: decode tokens/s of dense vs exact vs predicted, same model.

Every mode decodes the same token sequence (the dense model's greedy continuation of a
short prompt, fed one token at a time), so the work differs only by the FFN mode.
Modes alternate within each repetition so drift hits all alike. Per mode it records
tokens/s, the neuron density the kernels computed, the recall of the predictor (ReLU:
correctly predicted active neurons / truly active ones, from the kernels' counters on the
same tokens) and the weight bytes read per token, computed from the tensor sizes of the
model and the pack with the measured density.

A fourth run, "no-ffn", decodes in predicted mode with a predictor that never fires: its
time is everything but the FFN (attention, norms, output, graph overhead). Subtracting it
gives the FFN's own time per token in each mode, which is what sparsity speeds up; the
whole-model speedup is bounded by the share of that floor (Amdahl).

  python3 bench/sparse_cpu.py --model KB-350M-relu-f16.gguf --threads 2 --tokens 64 \
      --reps 3 --out bench/results/KB-350M-cpu/sparse-cpu-KB-350M
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts, write_results  # noqa: E402

MODES = ("dense", "exact", "predicted", "no-ffn")
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975]  # 8 tokens; prefill is dense anyway


def weight_bytes(model: Path, pack: Path) -> dict[str, float]:
    """Bytes per decoded token that each part of the model costs when read in full."""
    from kairox.gguf_header import scan_header
    parts = {"ffn_gate": 0, "ffn_up": 0, "ffn_down": 0, "other": 0, "embd_row": 0}
    hdr = scan_header(model)
    for t in hdr.tensors:
        if t.name == "token_embd.weight":
            parts["embd_row"] += t.nbytes // t.ne[1]   # one row per token
            continue
        key = next((k for k in ("ffn_gate", "ffn_up", "ffn_down") if f".{k}." in t.name), "other")
        parts[key] += t.nbytes
    pk = {"down_t": 0, "pred": 0}
    for t in scan_header(pack).tensors:
        if t.name.endswith("kx_down_t"):
            pk["down_t"] += t.nbytes
        elif "kx_pred_" in t.name:
            pk["pred"] += t.nbytes
    return {**parts, **{"pack_" + k: v for k, v in pk.items()}}


def bytes_per_token(wb: dict[str, float], mode: str, density: float) -> float:
    base = wb["other"] + wb["embd_row"]
    if mode == "dense":
        return base + wb["ffn_gate"] + wb["ffn_up"] + wb["ffn_down"]
    if mode == "exact":
        return base + wb["ffn_gate"] + density * (wb["ffn_up"] + wb["pack_down_t"])
    return base + wb["pack_pred"] + density * (wb["ffn_gate"] + wb["ffn_up"] + wb["pack_down_t"])


def blind_pack(model: Path, out: Path) -> Path:
    """A pack whose predictor never fires: predicted mode then skips every FFN."""
    from kairox.pack import write_pack
    from kairox.predictor import never_fires
    return write_pack(model, out, down_type="f16", quiet=True, predictor=never_fires(model))


def decode(model: Path, pack: Path, mode: str, seq: list[int], threads: int) -> dict:
    import kairox
    from kairox._native import sparse_counters
    kw = {} if mode == "dense" else {"sparse": "predicted" if mode == "no-ffn" else mode,
                                     "sparse_pack": str(pack)}
    llm = kairox.Llama(str(model), n_ctx=len(PROMPT) + len(seq) + 8, n_batch=64, n_ubatch=64,
                       n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False, **kw)
    try:
        llm.eval(PROMPT)
        sparse_counters(reset=True)
        agree = 0
        t0 = time.perf_counter()
        for i, tok in enumerate(seq):
            # the logits of the previous step predicted this token?
            agree += int(np.argmax(llm.scores[llm.n_tokens - 1]) == tok) if i else 0
            llm.eval([tok])
        dt_s = time.perf_counter() - t0
        c = sparse_counters(reset=True)
    finally:
        llm.close()
    return {"tok_s": len(seq) / dt_s, "seconds": dt_s, "density": c.density, "fallbacks": c.fallbacks,
            "calls": c.calls, "selected": c.selected, "nonzero": c.nonzero,
            "argmax_agree": agree / max(1, len(seq) - 1)}


def greedy_sequence(model: Path, n: int, threads: int) -> list[int]:
    import kairox
    llm = kairox.Llama(str(model), n_ctx=len(PROMPT) + n + 8, n_threads=threads, logits_all=True,
                       verbose=False)
    try:
        llm.eval(PROMPT)
        seq = []
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            seq.append(tok)
            llm.eval([tok])
        return seq
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--pack", type=Path, help="sparse pack (default: MODEL.kxpack.gguf)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=64, help="decoded tokens per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="output path prefix (.json and .md are added)")
    args = ap.parse_args()
    from kairox.pack import pack_path_for
    pack = args.pack or pack_path_for(args.model)
    if not pack.is_file():
        raise SystemExit(f"no pack at {pack}; make one with `kairox pack {args.model}`")

    seq = greedy_sequence(args.model, args.tokens, args.threads)
    import tempfile
    tmp = tempfile.TemporaryDirectory()
    packs = {m: pack for m in args.modes}
    if "no-ffn" in args.modes:
        packs["no-ffn"] = blind_pack(args.model, Path(tmp.name) / "never.kxpack.gguf")
    runs = []
    for rep in range(args.reps):
        for mode in args.modes:
            r = decode(args.model, packs[mode], mode, seq, args.threads)
            runs.append({"mode": mode, "rep": rep, **r})
            print(f"{mode:9s} rep={rep} {r['tok_s']:8.2f} tok/s density {r['density']:.3f} "
                  f"agree {r['argmax_agree']:.3f}", flush=True)

    wb = weight_bytes(args.model, pack)
    exact_nz = statistics.median(r["nonzero"] for r in runs if r["mode"] == "exact") \
        if "exact" in args.modes else None
    table = []
    for mode in args.modes:
        rs = [r for r in runs if r["mode"] == mode]
        ts = [r["tok_s"] for r in rs]
        density = statistics.median(r["density"] for r in rs)
        row = {"mode": mode, "tok_s": (statistics.median(ts), min(ts), max(ts)), "density": density,
               "bytes_per_token": bytes_per_token(wb, mode, density),
               "argmax_agree": statistics.median(r["argmax_agree"] for r in rs),
               "fallbacks": max(r["fallbacks"] for r in rs)}
        if mode == "predicted" and exact_nz:
            nz = statistics.median(r["nonzero"] for r in rs)
            sel = statistics.median(r["selected"] for r in rs)
            row["recall"] = nz / exact_nz
            row["over_prediction"] = sel / exact_nz
        table.append(row)
    dense = next((r for r in table if r["mode"] == "dense"), None)
    floor = next((r for r in table if r["mode"] == "no-ffn"), None)
    for row in table:
        row["speedup"] = row["tok_s"][0] / dense["tok_s"][0] if dense else None
        row["ms_per_token"] = 1000 / row["tok_s"][0]
        if floor and row["mode"] != "no-ffn":
            row["ffn_ms"] = row["ms_per_token"] - 1000 / floor["tok_s"][0]
    for row in table:
        if dense and "ffn_ms" in row:
            row["ffn_speedup"] = dense["ffn_ms"] / row["ffn_ms"]

    result = {
        "benchmark": "sparse-cpu", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": shlex.join([sys.executable] + sys.argv), "commit": git_commit(),
        "model": args.model.name, "model_bytes": os.path.getsize(args.model), "pack": pack.name,
        "pack_bytes": os.path.getsize(pack), "machine": machine_facts(), "threads": args.threads,
        "tokens": args.tokens, "weight_bytes": wb, "table": table, "runs": runs,
    }
    lines = [f"# Sparse FFN on the CPU ({args.model.name})", "",
             f"decode tok/s (batch 1, {args.tokens} tokens, {args.threads} threads), median of {args.reps} "
             f"alternating runs [min-max]; commit {result['commit'][:10]}; {result['machine'].get('cpu', '')}", "",
             "| mode | tok/s | vs dense | ms/token | FFN ms/token | FFN vs dense | density | recall | "
             "over-pred. | MB read/token | argmax = dense |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        t = row["tok_s"]
        rec = f"{row['recall']:.4f}" if "recall" in row else "-"
        ovr = f"{row['over_prediction']:.2f}" if "over_prediction" in row else "-"
        dens = "1 (all)" if row["mode"] == "dense" else f"{row['density']:.3f}"
        ffn = f"{row['ffn_ms']:.1f}" if "ffn_ms" in row else "-"
        ffx = f"{row['ffn_speedup']:.2f}x" if "ffn_speedup" in row else "-"
        mb = "-" if row["mode"] == "no-ffn" else f"{row['bytes_per_token'] / 1e6:.1f}"
        lines.append(f"| {row['mode']} | {t[0]:.2f} [{t[1]:.2f}-{t[2]:.2f}] | {row['speedup']:.2f}x | "
                     f"{row['ms_per_token']:.1f} | {ffn} | {ffx} | {dens} | {rec} | {ovr} | {mb} | "
                     f"{row['argmax_agree']:.3f} |")
    write_results(args.out, result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
