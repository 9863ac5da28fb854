#!/usr/bin/env python3
"""How well packs' predictors list a model's active FFN neurons, measured by the runtime on
the same text: each pack runs predicted mode on every layer (no gain timing), teacher-forced,
one token per step, beside an exact-mode run of the first pack (the truly active neurons).
Recall is the share of active neurons a pack listed; over-prediction the listed neurons per
active one (the host kernels' counters, kairox._native.sparse_counters).

    python3 bench/pred_recall.py --model m.gguf --text held-out.txt --pack f16=a.kxpack.gguf \\
        --pack q8_0=b.kxpack.gguf --out bench/results/X/pred-recall.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts  # noqa: E402


def counters(model: str, tokens_of: str, n_tokens: int, threads: int, **kw: object):
    from kairox import Llama
    from kairox._native import sparse_counters
    llm = Llama(model, n_ctx=n_tokens + 16, n_threads=threads, n_batch=1, n_ubatch=1, verbose=False, **kw)
    try:
        toks = llm.tokenize(tokens_of.encode())[:n_tokens]
        sparse_counters(reset=True)
        llm.eval(toks)
        return sparse_counters(reset=True), len(toks)
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, help="text to teacher-force (e.g. prepare's held-out.txt)")
    ap.add_argument("--pack", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="results JSON")
    args = ap.parse_args()
    packs = [p.partition("=")[::2] for p in args.pack]
    text = Path(args.text).read_text()
    exact, n = counters(args.model, text, args.tokens, args.threads, sparse="exact", sparse_pack=packs[0][1])
    rows = []
    for name, path in packs:
        c, _ = counters(args.model, text, args.tokens, args.threads, sparse="predicted", sparse_pack=path,
                        measure_gain=False)
        rows.append({"pack": name, "path": path, "recall": c.nonzero / exact.nonzero,
                     "over_prediction": c.selected / exact.nonzero, "density": c.density,
                     "exact_density": exact.density, "calls": c.calls})
        print(f"{name}: recall {rows[-1]['recall']:.5f}, over-prediction {rows[-1]['over_prediction']:.3f}, "
              f"listed {c.density:.4f} of the neurons (active {exact.density:.4f})", flush=True)
    res = {"commit": git_commit(), "command": shlex.join([sys.executable, *sys.argv]), "machine": machine_facts(),
           "model": Path(args.model).name, "tokens": n, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
