#!/usr/bin/env python3
"""Speculative decoding with a hybrid target, through kairox-server (llama-server): each row
is one server with its own flags, all started once (one after the other, so each measures its
own VRAM base) and then asked in interleaved rounds, one greedy /completion at a time, so the
rows share the machine's state. Per request: decode tok/s, tokens drafted and accepted (the
server's own `timings`), and whether the text equals the first row's.

    python3 bench/spec_decode.py --bin BUILD/bin --model KB-7B-f16.gguf --out OUT \\
        --row "plain=--vram-budget 7GiB --sparse predicted" \\
        --row "draft self=--vram-budget 7GiB --sparse predicted --spec-type draft-simple --spec-draft-model KB-7B-f16.gguf -ngld 99"
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from kairox.bench import LocalServer, free_port, git_commit, machine_facts, write_results  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a steam engine works.",
           "Describe the water cycle to a child."]


def complete(port: int, prompt: str, n: int) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        d = json.loads(r.read())
    t = d["timings"]
    return {"content": d["content"], "predicted_n": t["predicted_n"], "tok_s": t["predicted_per_second"],
            "draft_n": t.get("draft_n", 0), "draft_accepted": t.get("draft_n_accepted", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder with llama-server")
    ap.add_argument("--model", required=True, help="the target model")
    ap.add_argument("--row", action="append", required=True, metavar="NAME=FLAGS",
                    help="a server: its name and kairox-server flags (repeat; the first is the reference)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="spec-decode")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.row:
        name, _, flags = spec.partition("=")
        rows.append({"name": name, "flags": flags, "requests": []})
    servers: list[LocalServer] = []
    try:
        for i, row in enumerate(rows):
            port = free_port()
            cmd = [str(Path(args.bin) / "llama-server"), "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(args.threads), "-c", str(args.ctx), "--parallel", "1", "--no-webui",
                   *shlex.split(row["flags"])]
            row["command"] = shlex.join(cmd)
            servers.append(LocalServer(cmd, port, out / f"{args.name}-{i}.log"))
        for rnd in range(args.rounds):
            for row, srv in zip(rows, servers):
                for p in PROMPTS:
                    r = complete(srv.port, p, args.tokens)
                    r.update(round=rnd, prompt=p)
                    row["requests"].append(r)
                    print(f"round {rnd} {row['name']}: {r['tok_s']:.2f} tok/s, "
                          f"drafted {r['draft_n']} accepted {r['draft_accepted']}", flush=True)
    finally:
        for s in servers:
            s.stop()
    ref = {r["prompt"]: r["content"] for r in rows[0]["requests"] if r["round"] == 0}
    lines = [f"# Speculative decoding with a hybrid target: {Path(args.model).name}, {args.tokens} tokens, "
             f"{args.rounds} interleaved rounds x {len(PROMPTS)} prompts", "",
             "| row | decode tok/s (median; range) | vs first row | drafted / accepted | acceptance | "
             "text = first row's |", "|---|---:|---:|---:|---:|---:|"]
    base = None
    for row in rows:
        req = row["requests"]
        rates = [r["tok_s"] for r in req]
        med = statistics.median(rates)
        base = base or med
        dn = sum(r["draft_n"] for r in req)
        da = sum(r["draft_accepted"] for r in req)
        same = sum(r["content"] == ref.get(r["prompt"]) for r in req)
        row.update(median_tok_s=med, min_tok_s=min(rates), max_tok_s=max(rates), draft_n=dn, draft_accepted=da,
                   same_text=same)
        lines.append(f"| {row['name']} | {med:.2f} ({min(rates):.2f}-{max(rates):.2f}) | {med / base:.2f}x | "
                     f"{dn} / {da} | {(da / dn if dn else 0):.3f} | {same}/{len(req)} |")
    lines += ["", "Servers:", ""] + [f"- {row['name']}: `{row['command']}`" for row in rows]
    result = {"command": shlex.join(sys.argv), "commit": git_commit(), "machine": machine_facts(), "rows": rows}
    write_results(out / args.name, result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
