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
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gpu_used_mib() -> float | None:
    """Device memory in use on GPU 0 (MiB, whole device), or None without nvidia-smi."""
    import subprocess
    try:
        r = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return float(r.stdout.split()[0]) if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def host_overrides(patterns: list[str]) -> None:
    """llama.cpp's `-ot PATTERN=CPU` for llama_cpp.Llama, which leaves the model parameters'
    tensor_buft_overrides unset: every model loaded after this keeps the tensors whose names
    match a pattern in host memory (the CPU's buffer type, as common/arg.cpp resolves `CPU`)."""
    import ctypes
    from llama_cpp import llama_cpp as lc
    ggml = ctypes.CDLL(str(Path(lc._lib._name).parent / "libggml.so"))  # symbols of its dependencies too
    ggml.ggml_backend_dev_by_name.argtypes, ggml.ggml_backend_dev_by_name.restype = [ctypes.c_char_p], ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_name(b"CPU"))

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    arr = (Override * (len(patterns) + 1))(*[Override(p.encode(), buft) for p in patterns])  # NULL-terminated
    load = lc.llama_model_load_from_file

    def load_with(path, params):
        params.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p).value
        return load(path, params)
    load_with.overrides = arr  # alive as long as the loader
    lc.llama_model_load_from_file = load_with


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["stock", "kairox"], required=True)
    ap.add_argument("--mode", default="dense", choices=["dense", "exact", "predicted", "threshold"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="JSON list of token ids: prompt, then decoded tokens")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--ngl", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--pp", type=int, default=0,
                    help="after the decode, also time a prefill of this many tokens (best of 2)")
    ap.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="PATTERN=CPU",
                    help="stock: keep tensors matching PATTERN in host memory (llama.cpp's -ot; CPU only)")
    ap.add_argument("--gpu-slots", type=int, help="kairox: neuron slots per layer on the GPU (static hybrid)")
    ap.add_argument("--vram-budget", help="kairox: static hybrid under this GPU budget (e.g. 7GiB); the "
                    "runtime picks the slots and checks the budget on the device")
    ap.add_argument("--no-pinned", dest="pinned", action="store_false",
                    help="kairox hybrid: host-side weights mapped from the file, not page-locked")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                    help="auto: the implementation's default (kairox hybrid: on; stock: off)")
    ap.add_argument("--mapped-share", type=float, default=0.0,
                    help="kairox hybrid: the GPU's share of the host-side neurons, read over PCIe")
    ap.add_argument("--balancer", choices=["none", "static", "fixed", "adaptive"], default="static",
                    help="kairox hybrid: the live balancer with a fixed or an adaptive λ; static: the split as "
                         "loaded, a balancer only recording which listed neurons ran from slots (the GPU share); "
                         "none: no balancer at all, as `kairox run` and the tools run without --balancer")
    ap.add_argument("--lam", type=float, default=0.5, help="balancer: λ (at start, when adaptive)")
    ap.add_argument("--max-admit", type=int, help="balancer: neurons loaded per step and layer")
    ap.add_argument("--eps", type=float, default=0.01,
                    help="balancer: ε of τ = (1 − λ) + ε; -1 admits every listed neuron (the micro level)")
    ap.add_argument("--reload-method", default="gather", choices=["gather", "memcpy", "batch"])
    ap.add_argument("--max-blocks", type=int, default=32, help="balancer: the gather kernel's grid cap")
    ap.add_argument("--decide", default="auto", choices=["auto", "worker", "inline"],
                    help="balancer: where the TAM step runs (auto: on the GPU)")
    ap.add_argument("--pipeline", action="store_true",
                    help="balancer: decide one layer ahead within each token instead of between tokens")
    ap.add_argument("--backoff", type=int, default=0,
                    help="balancer: back off to the split as it stands where it does not pay, probing N tokens "
                         "(kairox.backoff; 0: always run)")
    ap.add_argument("--backoff-doubling", type=int,
                    help="balancer, with --backoff: a repeated outcome holds at most N x 2^this tokens "
                         "(default: kairox.backoff.BackoffConfig's; bench/backoff_schedule.py models it)")
    ap.add_argument("--backoff-drift", type=float,
                    help="balancer, with --backoff: a lost probe repeats once the static split's hit rate fell by "
                         "this (0: on schedule; default: kairox.backoff.BackoffConfig's)")
    ap.add_argument("--balance-trace", help="balancer: write its per-step records here (JSON lines)")
    ap.add_argument("--sched-trace", help="kairox: the scheduler's split trace to this file (kairox trace FILE)")
    ap.add_argument("--sched-trace-max", type=int, default=0, help="kairox: records the trace keeps (0: 131072)")
    ap.add_argument("--warm", choices=["on", "off"], default="on",
                    help="kairox hybrid: the host-cache warm-up (kx_params.warm; rows: static@--warm=off)")
    ap.add_argument("--error-budget", type=float,
                    help="kairox hybrid, predicted: load-aware thresholds adding at most this relative FFN "
                         "output error to the static threshold's (0: none; default: off)")
    ap.add_argument("--logits-out", help="save each decoded position's logits (float16 .npy, after timing)")
    args = ap.parse_args()
    moves = args.balancer in ("fixed", "adaptive")  # a balancer that reloads slots (static observes, none is absent)

    # The library is loaded before numpy (on the GPU machine, numpy first makes the CUDA
    # build's first model load crash; see bench/device/sparse_smoke.sh).
    if args.impl == "kairox":
        if args.override_tensor:
            sys.exit("--override-tensor is for --impl stock (kairox places tensors under --vram-budget)")
        sys.path.insert(0, str(ROOT / "python"))
        import kairox
        cls, extra = kairox.Llama, {"sparse": args.mode}
        if args.gpu_slots is not None:
            extra["gpu_slots"] = args.gpu_slots
        if args.vram_budget is not None:
            extra["vram_budget"] = args.vram_budget
        if not args.pinned:
            extra["pinned"] = False
        if args.mapped_share:
            extra["mapped_share"] = args.mapped_share
        if args.warm == "off":
            extra["warm"] = False
        if args.error_budget is not None:
            extra["error_budget"] = args.error_budget
        if args.sched_trace:
            extra["sched_trace"], extra["sched_trace_max"] = args.sched_trace, args.sched_trace_max
        if moves:
            extra["reload_method"] = args.reload_method
    else:
        import llama_cpp
        cls, extra = llama_cpp.Llama, {}
        if args.mode != "dense":
            sys.exit("the unpatched llama.cpp runs dense only")
        bad = [o for o in args.override_tensor if not o.endswith("=CPU")]
        if bad:
            sys.exit(f"--override-tensor: only PATTERN=CPU is supported, not {bad[0]!r}")
        if args.override_tensor:
            host_overrides([o[:-len("=CPU")] for o in args.override_tensor])
    if args.flash_attn != "auto":
        extra["flash_attn"] = args.flash_attn == "on"
    from llama_cpp._logger import set_verbose
    set_verbose(False)

    toks = json.loads(Path(args.tokens).read_text())
    n_ctx = max(len(toks), args.pp) + 16
    mem0 = gpu_used_mib()
    llm = cls(model_path=args.model, n_gpu_layers=args.ngl, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
              n_threads=args.threads, n_threads_batch=args.threads, verbose=False, **extra)
    counters = None
    hybrid = args.impl == "kairox" and (args.gpu_slots is not None or args.vram_budget is not None)
    if hybrid and args.balancer != "none":  # static: the balancer only records what ran (GPU hits), moving nothing
        from kairox.backoff import BackoffConfig
        from kairox.balancer import BalancerConfig
        llm.start_balancer(BalancerConfig(lam=args.lam, eps=args.eps, adaptive=args.balancer == "adaptive",
                                          max_admit=args.max_admit), max_blocks=args.max_blocks,
                           observe=args.balancer == "static", decide=args.decide,
                           pipeline=args.pipeline and moves,
                           backoff=BackoffConfig(window=args.backoff, **{k: v for k, v in (
                               ("max_doubling", args.backoff_doubling), ("drift", args.backoff_drift)) if v is not None})
                           if args.backoff and moves else None)
    sparse = args.impl == "kairox" and args.mode != "dense"
    if sparse:
        from kairox._native import (balance_counters, ffn_phase_counters, pipe_counters, sched_counters,
                                    sparse_counters, warm_counters)
    t0 = time.perf_counter()
    llm.eval(toks[:args.prompt_len])
    prefill = time.perf_counter() - t0
    if sparse:
        sparse_counters(reset=True)  # count the decode only
        sched_counters(reset=True)
        warm_counters(reset=True)
        balance_counters(reset=True)
        pipe_counters(reset=True)
        ffn_phase_counters(reset=True)
    times = []
    logits = []
    if args.logits_out:
        import numpy as np
    for t in toks[args.prompt_len:]:
        t0 = time.perf_counter()
        llm.eval([t])
        times.append(time.perf_counter() - t0)
        if args.logits_out:  # the decode's own row (scores holds rows only with logits_all)
            logits.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype("float16"))
    if sparse:
        c = sparse_counters(reset=True)
        counters = {**dataclasses.asdict(c), "sched": sched_counters(reset=True), "warm": warm_counters(reset=True),
                    "boundary": balance_counters(reset=True),
                    "pipeline": pipe_counters(reset=True), "ffn_phases": ffn_phase_counters(reset=True)}
    balance = None
    if hybrid:  # the prompt is one batch of > 8 tokens (dense, not a step): every record is a decode's
        from kairox.report import summary, write_trace
        trace = llm.balance_trace()
        if args.balance_trace:
            write_trace(args.balance_trace, trace)
        balance = summary(trace) if trace else None
        bo = llm.backoff_trace()
        if bo and balance is not None:  # the back-off's probes (switches to running) and its hit-rate counts
            balance["backoff"] = {"tokens": len(bo), "probes": sum(on and not was for (_, _, was), (_, _, on)
                                                                    in zip(bo, bo[1:])),
                                  "hits_counted": sum(h is not None for _, h, _ in bo)}
    pp_s = None
    if args.pp:
        batch = (toks * (args.pp // len(toks) + 1))[:args.pp]
        for _ in range(2):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(batch)
            pp_s = min(pp_s or 1e30, time.perf_counter() - t0)
    if args.logits_out:
        np.save(args.logits_out, np.stack(logits))
    thr = None
    if hasattr(llm, "thresholds"):
        from kairox.bench import thresholds_summary
        thr = thresholds_summary(llm)
    mem1 = gpu_used_mib()
    mode = getattr(llm, "sparse", "dense")
    slots_bytes = getattr(llm, "slots_bytes", 0)
    vram = getattr(llm, "vram", None)
    vram = None if vram is None else {**dataclasses.asdict(vram), "used_after_run": llm.vram_used()}
    llm.close()
    print(json.dumps({"prefill_s": prefill, "tpot_s": times, "counters": counters, "mode_used": mode,
                      "slots_bytes": slots_bytes, "vram": vram, "balance": balance, "thresholds": thr,
                      "pp_tok_s": args.pp / pp_s if pp_s else None,
                      "gpu_mem_mib": None if mem0 is None or mem1 is None else mem1 - mem0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
