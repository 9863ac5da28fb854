#!/usr/bin/env python3
"""One decode run, timed per token (a worker of bench/offload.py, one process per run).

Evaluates a prompt as one batch, then the following tokens one at a time (teacher-forced:
the next token is taken from the token file, not sampled, so every implementation and
mode decodes the same text), and prints JSON: prefill seconds, seconds per decoded token,
and for kairox's sparse modes the CPU kernels' counters over the decode.

  stock:  LLAMA_CPP_LIB_PATH=<unpatched build>/bin python3 bench/tpot.py --impl stock ...
  kairox: KAIROX_LIB_DIR=<kairox install>/lib python3 bench/tpot.py --impl kairox --mode predicted ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["stock", "kairox"], required=True)
    ap.add_argument("--mode", default="dense", choices=["dense", "exact", "predicted"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="JSON list of token ids: prompt, then decoded tokens")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--ngl", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    # The library is loaded before numpy (on the GPU machine, numpy first makes the CUDA
    # build's first model load crash; see bench/device/sparse_smoke.sh).
    if args.impl == "kairox":
        sys.path.insert(0, str(ROOT / "python"))
        import kairox
        cls, extra = kairox.Llama, {"sparse": args.mode}
    else:
        import llama_cpp
        cls, extra = llama_cpp.Llama, {}
        if args.mode != "dense":
            sys.exit("the unpatched llama.cpp runs dense only")
    from llama_cpp._logger import set_verbose
    set_verbose(False)

    toks = json.loads(Path(args.tokens).read_text())
    n_ctx = len(toks) + 16
    llm = cls(model_path=args.model, n_gpu_layers=args.ngl, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
              n_threads=args.threads, n_threads_batch=args.threads, verbose=False, **extra)
    counters = None
    sparse = args.impl == "kairox" and args.mode != "dense"
    if sparse:
        from kairox._native import sparse_counters
    t0 = time.perf_counter()
    llm.eval(toks[:args.prompt_len])
    prefill = time.perf_counter() - t0
    if sparse:
        sparse_counters(reset=True)  # count the decode only
    times = []
    for t in toks[args.prompt_len:]:
        t0 = time.perf_counter()
        llm.eval([t])
        times.append(time.perf_counter() - t0)
    if sparse:
        c = sparse_counters(reset=True)
        counters = {"selected": c.selected, "total": c.total, "calls": c.calls,
                    "fallbacks": c.fallbacks, "nonzero": c.nonzero}
    mode = getattr(llm, "sparse", "dense")
    llm.close()
    print(json.dumps({"prefill_s": prefill, "tpot_s": times, "counters": counters, "mode_used": mode}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
