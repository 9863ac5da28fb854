"""`kairox run` and `kairox info`: generate text with a model, and describe the build or a GGUF."""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

from .._version import __version__
from ..argtypes import positive_int
from ..plan import parse_size

DEFAULT_PROMPT = "The three most important inventions of the printing age were"


def _context_length(path: Path) -> int | None:
    """The model's training context, from the GGUF header (None if absent or unreadable)."""
    from ..gguf_header import GGUFHeaderError, scan_header
    try:
        kv = scan_header(path).kv
        return int(kv[f"{kv['general.architecture']}.context_length"])
    except (GGUFHeaderError, KeyError, ValueError, OSError):
        return None


# llama.cpp pads a context's size to a multiple of this many tokens
CTX_STEP = 256


def cmd_run(args: argparse.Namespace) -> int:
    from ..default_model import DefaultModelError, default_model_path
    if args.model is None:
        try:
            model = default_model_path()
        except DefaultModelError as e:
            print(f"kairox run: error: {e}", file=sys.stderr)
            return 2
    else:
        model = Path(args.model)
        if not model.is_file():
            what = "is a directory, not a model file" if model.is_dir() else "not found"
            print(f"kairox run: error: model file {what}: {model}" if not model.is_dir() else
                  f"kairox run: error: {model} {what}", file=sys.stderr)
            return 2
    from .. import llama as kxl
    ctx = args.ctx or min(2048, _context_length(model) or 2048)
    if ctx % CTX_STEP:
        # llama.cpp pads the context to this step; asking for it keeps Python's buffers the same size
        print(f"kairox run: note: context {ctx} rounded up to {-(-ctx // CTX_STEP) * CTX_STEP} "
              f"(llama.cpp sizes it in steps of {CTX_STEP})", file=sys.stderr)
        ctx = -(-ctx // CTX_STEP) * CTX_STEP
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kxl.SparsePackWarning)
            warnings.simplefilter("always", kxl.SparseApproximationWarning)
            hybrid = {k: v for k, v in (("gpu_slots", args.gpu_slots), ("vram_budget", args.vram_budget),
                                        ("plan", args.plan)) if v is not None}
            if hybrid and not args.pinned:
                hybrid["pinned"] = False
            if args.mapped_share:
                hybrid["mapped_share"] = args.mapped_share
            if args.error_budget is not None:
                hybrid["error_budget"] = args.error_budget
            if args.balancer:
                from ..backoff import BackoffConfig
                from ..balancer import BalancerConfig
                hybrid["balancer"] = BalancerConfig(adaptive=args.balancer == "adaptive")
                hybrid["balancer_pipeline"] = args.pipeline
                window = BackoffConfig().window if args.backoff is None else args.backoff
                if window:
                    hybrid["balancer_backoff"] = BackoffConfig(window=window)
                if args.balancer_thread:
                    if not args.pipeline:
                        raise ValueError("--balancer-thread is a mode of --pipeline")
                    hybrid["balancer_decide"] = "worker"
                if args.kx_trace:
                    hybrid["trace"] = args.kx_trace
                if args.hw:
                    hybrid["hw_profile"] = args.hw
            elif args.kx_trace or args.pipeline or args.balancer_thread or args.hw or args.backoff is not None:
                flag = ("--kx-trace" if args.kx_trace else "--pipeline" if args.pipeline else
                        "--balancer-thread" if args.balancer_thread else "--hw" if args.hw else "--backoff")
                raise ValueError(f"{flag} needs the live balancer: "
                                 "add --balancer")
            if not args.warm:
                hybrid["warm"] = False
            if not args.stream:
                hybrid["stream"] = False
            if args.migrate:
                hybrid["migrate"] = True
            if args.adapt_threads:
                hybrid["adapt_threads"] = True
            if args.sched_trace:
                hybrid["sched_trace"] = args.sched_trace
            if args.n_gpu_layers is not None or not hybrid:  # hybrid: every layer's dense part on the GPU
                hybrid["n_gpu_layers"] = args.n_gpu_layers or 0
            llm = kxl.Llama(str(model), n_ctx=ctx, n_threads=args.threads, seed=args.seed,
                            verbose=args.verbose, sparse=args.sparse, sparse_pack=args.sparse_pack,
                            fallback=args.fallback, **hybrid)
    except kxl.SparsePackError as e:
        print(f"kairox run: error: {e.reason} (--fallback dense runs the model dense instead)", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kairox run: error: {e}", file=sys.stderr)
        return 2
    for w in caught:
        print(f"kairox run: warning: {w.message}", file=sys.stderr)
    sparse_layers = (f", {llm.sparse_layers} of {llm.n_layer} layers sparse" if llm.sparse != "dense"
                     else ", the whole model on the GPU: it fits the budget" if llm.whole_fits else "")
    print(f"kairox: {model.name} ({llm.n_ctx()} ctx, {llm.context_params.n_threads} threads, "
          f"FFN {llm.sparse}{sparse_layers})", file=sys.stderr)
    if llm.vram is not None:
        print(f"kairox: {llm.vram.text()}", file=sys.stderr)
    n_prompt = len(llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=True))
    if n_prompt + 1 > llm.n_ctx():
        print(f"kairox run: error: the prompt is {n_prompt} tokens and the context holds {llm.n_ctx()}: "
              f"shorten the prompt or raise -c (the model was trained with {_context_length(model) or '?'})",
              file=sys.stderr)
        llm.close()
        return 2
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    t0 = time.perf_counter()
    n_out = 0
    try:
        for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict, stream=True,
                                           temperature=args.temp, seed=args.seed):
            sys.stdout.write(chunk["choices"][0]["text"])
            sys.stdout.flush()
            n_out += 1
    except KeyboardInterrupt:
        # Ctrl-C: what was generated stays on stdout; the shell's convention for SIGINT
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"kairox run: interrupted after {n_out} tokens", file=sys.stderr)
        llm.close()
        return 130
    wall = time.perf_counter() - t0
    sys.stdout.write("\n")
    perf = kxl.llama_cpp.llama_perf_context(llm.ctx)
    n_p, n_e = perf.n_p_eval, perf.n_eval
    pp = n_p / (perf.t_p_eval_ms / 1e3) if perf.t_p_eval_ms > 0 else float("nan")
    tg = n_e / (perf.t_eval_ms / 1e3) if perf.t_eval_ms > 0 else float("nan")
    # The first generated token comes out of the prompt pass; the decode rate is over the rest.
    print(f"kairox: prompt {n_p} tokens at {pp:.1f} tokens/s, generated {n_e + 1} tokens, decode "
          f"{tg:.1f} tokens/s ({wall:.2f} s wall)", file=sys.stderr)
    if args.balancer:
        from ..report import summary
        records = llm.balance_trace()
        if records:
            s = summary(records)
            print(f"kairox: balancer: GPU hit rate {s['hit_rate']:.3f}, {s['loads_per_step']:.0f} neurons "
                  f"reloaded per token, λ {s['lam_first']:.2f} -> {s['lam_last']:.2f}", file=sys.stderr)
        if args.kx_trace:
            print(f"kairox: balancer trace in {args.kx_trace} (`kairox report {args.kx_trace}`)", file=sys.stderr)
    if args.sched_trace:
        print(f"kairox: scheduler trace in {args.sched_trace}, written at exit (`kairox trace {args.sched_trace}`)",
              file=sys.stderr)
    return 0


def model_summary(path: Path) -> list[tuple[str, str]]:
    """Human-readable facts about a GGUF, read from its header only (not its vocabulary
    arrays: GGUFReader takes ~14 s to parse Gemma 3's 262k tokens)."""
    import collections
    import math
    import gguf
    from ..gguf_header import scan_header
    hdr = scan_header(path)
    arch = hdr.kv.get("general.architecture", "?")
    rows = [("file", str(path)), ("size", f"{path.stat().st_size / 2**20:.1f} MiB"),
            ("architecture", arch), ("name", str(hdr.kv.get("general.name", "-")))]
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length"):
        v = hdr.kv.get(f"{arch}.{key}")
        if v is not None:
            rows.append((key, str(v)))
    from ..pack import DEFAULT_ACTIVATION
    act = hdr.kv.get(f"{arch}.hidden_activation")
    if act is not None:
        rows.append(("activation", str(act)))
    elif arch in DEFAULT_ACTIVATION:  # the architecture's own (the GGUF has no key for it)
        rows.append(("activation", f"{DEFAULT_ACTIVATION[arch]} (the {arch} architecture's)"))
    types = collections.Counter(gguf.GGMLQuantizationType(t.type_id).name for t in hdr.tensors)
    n_params = sum(math.prod(t.ne) for t in hdr.tensors)
    rows.append(("tensors", f"{len(hdr.tensors)} ({', '.join(f'{n} {k}' for k, n in types.most_common())})"))
    rows.append(("parameters", f"{n_params / 1e6:.1f} M"))
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str]] = [("kairox", __version__)]
    if args.model:
        path = Path(args.model)
        if not path.is_file():
            print(f"kairox info: error: no such file: {path}", file=sys.stderr)
            return 2
        try:
            rows += model_summary(path)
        except (ValueError, OSError) as e:  # GGUFHeaderError is a ValueError
            print(f"kairox info: error: {path} is not a readable GGUF file ({e})", file=sys.stderr)
            return 2
    else:
        from .._native import NativeLibraryNotFound, ext, find_bin_dir, find_lib_dir
        try:
            lib = find_lib_dir()
            rows += [("native", ext().kx_version().decode()), ("libraries", str(lib)),
                     ("tools", str(find_bin_dir()))]
            from ..llama import llama_cpp
            C = llama_cpp.llama_cpp
            rows += [("gpu offload", "yes" if C.llama_supports_gpu_offload() else "no"),
                     ("system", C.llama_print_system_info().decode().strip())]
        except NativeLibraryNotFound as e:
            rows.append(("native", f"not found: {e}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def register(sub) -> None:
    """Add the `run` and `info` subcommands to an argparse subparsers object."""
    p = sub.add_parser("run", help="generate text from a prompt, streaming, with tokens/s",
                       description="Generate text with kairox's llama.cpp and print tokens/s. "
                       "Without -m, uses the embedded default model (Gemma 3 270M Q4_K_M, "
                       "installed from PyPI and verified on first use).")
    p.add_argument("-m", "--model", help="GGUF model file (default: Gemma 3 270M)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text (default: %(default)r)")
    p.add_argument("-n", "--n-predict", type=positive_int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("-c", "--ctx", type=positive_int, default=None,
                   help="context size (default: the model's, at most 2048)")
    p.add_argument("-t", "--threads", type=positive_int, default=None,
                   help="CPU threads (default: half the cores, as llama-cpp-python)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                   help="layers on the GPU; -1 = all (default: 0, or all with a hybrid FFN option)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--sparse", choices=["dense", "exact", "predicted", "threshold"], default=None,
                   help="FFN mode: dense (the model's own), exact (only neurons that fire: the dense "
                   "output; a gated model's FFN runs dense, all its neurons fire), predicted (the pack's "
                   "predictor picks them) or threshold (as exact, skipping activations at or below the "
                   "pack's per-layer thresholds: close to dense on gated models); default: dense, or "
                   "predicted when --sparse-pack is given")
    p.add_argument("--sparse-pack", default=None,
                   help="sparse pack (default with --sparse: MODEL.kxpack.gguf next to the model; "
                   "make one with `kairox pack MODEL`)")
    p.add_argument("--gpu-slots", type=int, default=None,
                   help="hybrid FFN: neurons per layer kept on the GPU (the most active ones); the rest "
                   "run on the CPU at the same time; dense tensors on the GPU unless -ngl says otherwise")
    p.add_argument("--vram-budget", type=parse_size, default=None,
                   help="hybrid FFN under a GPU memory budget (e.g. 7GiB): dense tensors on the GPU, "
                   "slots fill the rest; measured on the device, a clear error when it cannot fit. A budget "
                   "that holds the whole model dense runs it on the GPU unsplit unless --sparse names a mode")
    p.add_argument("--plan", default=None, help="hybrid FFN placed by a `kairox plan` file")
    p.add_argument("--no-pinned", dest="pinned", action="store_false",
                   help="map the host-side weights from the file instead of page-locking them (less RAM "
                   "pinned; prompts offloaded to the GPU then copy them more slowly, and nothing is streamed)")
    p.add_argument("--no-kx-warm", dest="warm", action="store_false",
                   help="hybrid: do not warm the host caches with the next layer's predicted rows while the GPU works")
    p.add_argument("--no-kx-stream", dest="stream", action="store_false",
                   help="a budget of whole tensors (a model without a pack): do not stream host-resident "
                   "tensors to the GPU through a scratch buffer beside the CPU's work")
    p.add_argument("--kx-migrate", dest="migrate", action="store_true",
                   help="streamed tensors: follow the CPU, GPU and PCIe rates measured while decoding instead of "
                   "keeping the load's choice (runtime migration; off by default)")
    p.add_argument("--kx-adapt-threads", dest="adapt_threads", action="store_true",
                   help="load-aware decode threads: each decode's thread count follows its measured time; when "
                   "other processes take cores, -t, 3/4, 1/2 and 1/4 of it are timed and the fastest kept "
                   "(off by default; an idle machine keeps -t)")
    p.add_argument("--mapped-share", type=float, default=0.0, metavar="F",
                   help="hybrid: the GPU also computes this share (0-1, by activation frequency) of the "
                   "host-side neurons, reading their rows from the page-locked host weights over PCIe "
                   "while the CPU computes the rest (default 0: the CPU computes them all)")
    p.add_argument("--error-budget", type=float, default=None, metavar="F",
                   help="hybrid, predicted: load-aware thresholds (the GPU computes more of its resident "
                   "neurons, the CPU skips its least likely ones while it is the slower side), adding at most "
                   "F (0-1) of the FFN output's norm to the static threshold's error (0: none; default: off)")
    p.add_argument("--balancer", choices=["fixed", "adaptive"], default=None,
                   help="hybrid: move neurons between the GPU slots and the CPU while decoding (TAM policy, "
                   "reloads behind the next token); fixed or adaptive λ (default: the static split)")
    p.add_argument("--pipeline", action="store_true",
                   help="with --balancer: decide one layer ahead within each token (layer i+1's active set "
                   "predicted from layer i's input, its missing neurons loaded while layer i computes) "
                   "instead of between tokens; needs a pack with a predictor")
    p.add_argument("--balancer-thread", action="store_true",
                   help="with --pipeline: a thread of its own makes each layer's prefetch while the CPU part "
                   "of the layer before computes (instead of the compute threads before it); give it a core: "
                   "--threads one less than the cores")
    p.add_argument("--backoff", type=int, default=None, metavar="N",
                   help="with --balancer: the balancer runs N tokens, is held N tokens on the static split "
                   "(the slots go back to it), and keeps running only where its median token time is lower; "
                   "the outcome holds 2^k x N tokens before the next probe (default with --balancer: 16; 0: "
                   "it always runs)")
    p.add_argument("--kx-trace", default=None, metavar="FILE",
                   help="with --balancer: write its per-step records here (JSON lines; `kairox report FILE`)")
    p.add_argument("--kx-sched-trace", dest="sched_trace", default=None, metavar="FILE",
                   help="write when the CPU and the GPU ran each part of every token (splits, hand-offs, slot "
                   "reloads) to FILE at exit (`kairox trace FILE`); the stamps cost a few µs each")
    p.add_argument("--hw", default=None, metavar="FILE",
                   help="with --balancer: a `kairox profile-hw` file; its measured CPU and GPU rates name each "
                   "step's stall (default: 100 and 2000 GB/s)")
    p.add_argument("--fallback", choices=["dense"], default=None,
                   help="when the sparse mode or hybrid asked for cannot run (no usable pack, no GPU for the "
                   "slots): run the model dense with a warning instead of stopping with the reason")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's load log")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("info", help="show the build (backends, CPU features) or a GGUF's shape",
                       description="Without MODEL: kairox and llama.cpp build facts. With MODEL: "
                       "its architecture, shapes and tensor types, read from the GGUF header.")
    p.add_argument("model", nargs="?", help="GGUF file to describe")
    p.set_defaults(func=cmd_info)
