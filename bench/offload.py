#!/usr/bin/env python3
"""One offload benchmark configuration, end to end: a model that does not fit a VRAM
budget, decoded by the unpatched llama.cpp and by kairox at that budget.

  python3 bench/offload.py --config KB-7B --stock-bin /tmp/kx/build-stock/bin \
      --work /tmp/kxbench --out bench/results/KB-7B-f16-h200
  python3 bench/offload.py --summarize bench/results --summary-dir bench/results/offload
                                                          # table + plots of all results

Steps (docs/benchmarking.md): write the synthetic model (kairox synth, with its pack)
unless it exists; measure the machine's bandwidths (kairox.hw); find the largest -ngl
whose GPU buffers (model + KV + compute, from llama.cpp's own load log) fit the budget,
by probing the unpatched llama-bench; then at that -ngl:

* llama.cpp: unpatched `llama-bench -p 512 -n 128 -d 64` (prefill 512 tokens, decode 128
  after a 64-token context), and the same with `--fit-target` (llama.cpp's own fitting)
  at a margin leaving exactly the budget;
* kairox dense: kairox's patched llama-bench, same arguments (must equal llama.cpp);
* per-token decode time (TPOT p50/p99) of every implementation and kairox mode with
  bench/tpot.py, one process per run, the same teacher-forced tokens for all;
* the physical bound per token, max(GPU bytes / HBM, CPU bytes / CPU read, PCIe bytes /
  PCIe), from the model's tensor sizes and the measured bandwidths; efficiency =
  bound / measured time per token.

Writes <out>/offload-<config>.json (raw: commands, logs' numbers, samples, commit,
machine) and .md. The model is deleted afterwards unless --keep.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts, write_results  # noqa: E402
from kairox.costs import Rates  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20

# name -> (synth preset or None for a given model, VRAM budget in GiB)
CONFIGS = {
    "KB-7B": ("KB-7B", 7.0),
    "KB-13B": ("KB-13B", 12.0),
    "KB-70B": ("KB-70B", 22.0),
    "gemma3-270m": (None, 0.25),
}
PROMPT, GEN, PP = 64, 128, 512
BUF_RE = re.compile(r"(CUDA\d+) (model|KV|compute|RS|output) buffer size\s*=\s*([\d.]+) MiB")
OFFLOAD_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smi_mib(what: str = "free") -> float | None:
    """The GPU's memory.free or memory.used now (MiB), None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu=memory.{what}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return float(r.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def run(cmd: list[str], env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    log("$ " + shlex.join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {shlex.join(cmd)}\n{r.stderr[-3000:]}")
    return r


class DevicePeak:
    """The GPU's peak memory use while a row runs, over what it used before (MiB), from
    `nvidia-smi -lms` (the GPU machine runs one row at a time, so the difference is the row's:
    its CUDA context, buffers, pools and workspaces, what a card of that size must hold).
    `mib` stays None without nvidia-smi."""

    def __init__(self, period_ms: int = 20) -> None:
        self.period_ms, self.mib, self._proc, self._base = period_ms, None, None, None

    def __enter__(self) -> "DevicePeak":
        self._base = smi_mib("used")
        if self._base is not None:
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                           f"-lms={self.period_ms}"], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=20)
        vals = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
        self.mib = max(vals) - self._base if vals else None


def gpu_buffers(stderr: str) -> dict:
    """GPU memory llama.cpp allocated, from its load log: model buffers, and the largest
    KV and compute buffers of the contexts it created (MiB)."""
    model = kv = comp = 0.0
    for dev, kind, mib in BUF_RE.findall(stderr):
        v = float(mib)
        if kind == "model":
            model += v
        elif kind in ("KV", "RS"):
            kv = max(kv, v)
        else:
            comp = max(comp, v)
    m = OFFLOAD_RE.findall(stderr)
    return {"model_mib": model, "kv_mib": kv, "compute_mib": comp, "total_mib": model + kv + comp,
            "offloaded": f"{m[-1][0]}/{m[-1][1]}" if m else None}


def bench_cmd(binary: str, model: Path, threads: int, reps: int, extra: list[str], n_gen: int = GEN) -> list[str]:
    return [binary, "-m", str(model), "-p", str(PP), "-n", str(n_gen), "-d", str(PROMPT), "-r", str(reps),
            "-t", str(threads), "-o", "json", "-v", *extra]


def parse_bench(r: subprocess.CompletedProcess) -> dict:
    rows = json.loads(r.stdout)
    pp = next(x for x in rows if x["n_prompt"] > 0)
    tg = next(x for x in rows if x["n_gen"] > 0)
    return {"pp_tok_s": pp["avg_ts"], "pp_samples": pp.get("samples_ts"), "tg_tok_s": tg["avg_ts"],
            "tg_samples": tg.get("samples_ts"), "gpu": gpu_buffers(r.stderr)}


def probe(binary: str, model: Path, ngl: int, threads: int) -> dict:
    """GPU buffers at -ngl: the prefill test allocates the most (largest KV and compute); with
    its measured device use and fit_mib as decode_buffers has them."""
    return measured_buffers(binary, model, threads, bench_cmd(binary, model, threads, 1, ["-ngl", str(ngl)], n_gen=0))


class Layout:
    """Bytes a decode step reads, per tensor group, from the model's header."""

    def __init__(self, model: Path) -> None:
        from kairox.gguf_header import scan_header
        hdr = scan_header(model)
        arch = hdr.kv["general.architecture"]
        self.n_layer = int(hdr.kv[f"{arch}.block_count"])
        self.n_embd = int(hdr.kv[f"{arch}.embedding_length"])
        self.layer_ffn = [0] * self.n_layer
        self.layer_gate = [0] * self.n_layer
        self.layer_other = [0] * self.n_layer
        self.layer_experts = [0] * self.n_layer  # an MoE layer's expert tensors (within layer_other)
        self.output = 0
        self.n_vocab = 0
        names = {t.name: t for t in hdr.tensors}
        for t in hdr.tensors:
            m = re.match(r"blk\.(\d+)\.(.*)", t.name)
            if m:
                il, rest = int(m.group(1)), m.group(2)
                if rest.startswith(("ffn_gate.", "ffn_up.", "ffn_down.")):
                    self.layer_ffn[il] += t.nbytes
                    if rest.startswith("ffn_gate."):
                        self.layer_gate[il] += t.nbytes
                else:
                    self.layer_other[il] += t.nbytes
                    if re.match(r"ffn_(gate|up|down)_exps\.", rest):
                        self.layer_experts[il] += t.nbytes
            elif t.name in ("output.weight", "output_norm.weight"):
                self.output += t.nbytes
        emb = names["token_embd.weight"]
        self.n_vocab = emb.ne[1]
        if "output.weight" not in names:  # tied: the output head reads the embedding matrix
            self.output += emb.nbytes

    def bytes_per_token(self, ngl: int, density: float | None = None, exact: bool = False,
                        pred_bytes: float = 0.0) -> dict:
        """(GPU, CPU, PCIe) bytes of one decode step at -ngl: llama.cpp offloads the last
        ngl layers, and the output head when ngl > n_layer. density: kairox's sparse FFN
        on the CPU layers reads that fraction of the rows (exact mode: the whole gate)."""
        n_gpu = min(ngl, self.n_layer)
        gpu_layers = range(self.n_layer - n_gpu, self.n_layer)
        gpu = cpu = 0.0
        for il in range(self.n_layer):
            ffn = self.layer_ffn[il]
            if il in gpu_layers:
                gpu += self.layer_other[il] + ffn
            elif density is None:
                cpu += self.layer_other[il] + ffn
            else:
                gate = self.layer_gate[il]
                cpu += self.layer_other[il] + (gate + density * (ffn - gate) if exact else density * ffn)
        cpu += pred_bytes
        out_gpu = ngl > self.n_layer
        gpu, cpu = (gpu + self.output, cpu) if out_gpu else (gpu, cpu + self.output)
        pcie = 0 if ngl == 0 else self.n_embd * 4 + (self.n_vocab * 4 if out_gpu else self.n_embd * 4)
        return {"gpu": gpu, "cpu": cpu, "pcie": pcie}


def bound(b: dict, bw: dict) -> dict:
    """The physical floor per token (seconds), and which resource sets it."""
    r = Rates.from_bandwidths(bw)  # (a resource the probe did not measure costs nothing here)
    parts = {"gpu": r.gpu_s(b["gpu"]) if bw.get("gpu_hbm") else 0.0, "cpu": r.cpu_s(b["cpu"]),
             "pcie": r.pcie_s(b["pcie"]) if bw.get("pcie_h2d") else 0.0}
    key = max(parts, key=parts.get)
    return {"seconds": parts[key], "limit": key, "parts": parts}


_CONTEXT_MIB: dict = {}


def context_mib(stock: str, model: Path, threads: int) -> float | None:
    """What holding the GPU costs a row before any weight is on it: the peak device use of
    llama.cpp at -ngl 0 (the CUDA context, its kernels, its small -ngl 0 buffers), measured
    once per binary and model. Counting all of it as context favours llama.cpp's rows."""
    key = (stock, str(model))
    if key not in _CONTEXT_MIB:
        with DevicePeak() as dp:
            run([stock, "-m", str(model), "-p", "0", "-n", "1", "-r", "1", "-t", str(threads), "-o", "json",
                 "-ngl", "0"])
        _CONTEXT_MIB[key] = dp.mib
        log(f"-ngl 0 (the CUDA context): {dp.mib} MiB")
    return _CONTEXT_MIB[key]


def decode_buffers(stock: str, model: Path, threads: int, n_gen: int, extra: list[str], prompt: int = 0) -> dict:
    """GPU buffers of a decode-only row of n_gen tokens (its context) with these flags; with
    `prompt`, of a prefill-only row of that many tokens instead; measured as measured_buffers
    measures (llama.cpp's pools, workspaces and kernels' temporaries are outside its buffers,
    and a card of the budget's size must hold them too)."""
    return measured_buffers(stock, model, threads, [stock, "-m", str(model), "-p", str(prompt), "-n",
                                                    "0" if prompt else str(n_gen), "-r", "1", "-t", str(threads),
                                                    "-o", "json", "-v", *extra])


def measured_buffers(stock: str, model: Path, threads: int, cmd: list[str]) -> dict:
    """gpu_buffers of the llama-bench command `cmd` (run with -v), with its measured device use
    over the CUDA context's (`device_mib`) and `fit_mib`, the larger of the two: what a budget
    is held against."""
    ctx = context_mib(stock, model, threads)
    with DevicePeak() as dp:
        r = run(cmd)
    d = gpu_buffers(r.stderr)
    d["device_mib"] = dp.mib - ctx if dp.mib is not None and ctx is not None else None
    d["fit_mib"] = max(d["total_mib"], d["device_mib"] or 0.0)
    return d


def ffn_cpu_flags(lay: Layout, k: int) -> list[str]:
    """llama.cpp's flags for every layer on the GPU but the FFN weights of the first k layers:
    -ncmoe (its experts) for an MoE model, an -ot pattern for a dense one."""
    if any(lay.layer_experts):
        return ["-ngl", "99", "-ncmoe", str(k)]
    if k == 0:
        return ["-ngl", "99"]
    return ["-ngl", "99", "-ot", "blk\\.(" + "|".join(map(str, range(k))) + ")\\.ffn_(gate|up|down)\\.weight=CPU"]


def find_ffn_cpu(stock: str, model: Path, lay: Layout, budget_mib: float, threads: int,
                 n_gen: int, prompt: int = 0) -> tuple[int | None, list]:
    """Fewest layers whose FFN (or experts) must stay on the CPU, all else on the GPU, for the
    row to fit the budget (its fit_mib, measured_buffers) with llama.cpp's -ot / --n-cpu-moe
    placement; None when even all of them on the CPU does not fit. Probed as find_ngl probes."""
    tried: dict[int, dict] = {}

    def mem(k: int) -> float:
        if k not in tried:
            tried[k] = decode_buffers(stock, model, threads, n_gen, ffn_cpu_flags(lay, k), prompt)
            log(f"FFN of {k} layers on the CPU: buffers {tried[k]['total_mib']:.0f} MiB, "
                f"device {tried[k]['device_mib']} MiB")
        return tried[k]["fit_mib"]

    n = lay.n_layer
    if mem(n) > budget_mib:
        return None, [{"ffn_cpu": a, **b} for a, b in sorted(tried.items())]
    per = max(max(lay.layer_experts) or max(lay.layer_ffn), 1) / MiB
    k = max(0, min(n, n - int((budget_mib - mem(n)) // per)))
    while k < n and mem(k) > budget_mib:
        k += 1
    while k > 0 and mem(k - 1) <= budget_mib:
        k -= 1
    return k, [{"ffn_cpu": a, **b} for a, b in sorted(tried.items())]


def find_ngl(stock: str, model: Path, lay: Layout, budget_mib: float, threads: int,
             n_gen: int | None = None, prompt: int = 0) -> tuple[int, dict, list]:
    """Largest -ngl that fits the budget (its fit_mib, measured_buffers), by probing (linear
    model + checks); with n_gen, at the context of a decode-only row of that many tokens
    instead of the prefill test's (with `prompt` too, of a prefill-only row of that many)."""
    tried: dict[int, dict] = {}

    def measure(k: int) -> dict:
        if n_gen is None:
            return probe(stock, model, k, threads)
        return decode_buffers(stock, model, threads, n_gen, ["-ngl", str(k)], prompt)

    def mem(k: int) -> float:
        if k not in tried:
            tried[k] = measure(k)
            log(f"ngl {k}: buffers {tried[k]['total_mib']:.0f} MiB, device {tried[k].get('device_mib')} MiB "
                f"({tried[k]['offloaded']})")
        return tried[k]["fit_mib"]

    top = lay.n_layer + 1
    if model.stat().st_size / MiB <= budget_mib and mem(top) <= budget_mib:
        k = top
    else:
        m1 = mem(1)
        per = max(max(lay.layer_ffn) + max(lay.layer_other), 1) / MiB
        k = max(0, min(top - 1, 1 + int((budget_mib - m1) // per)))
        while k > 0 and mem(k) > budget_mib:
            k -= 1
        while k + 1 < top and mem(k + 1) <= budget_mib:
            k += 1
    return k, tried.get(k) or measure(k), [{"ngl": a, **b} for a, b in sorted(tried.items())]


def summarize_tpot(res: dict) -> dict:
    t = sorted(res["tpot_s"])
    q = lambda p: t[min(len(t) - 1, int(round(p * (len(t) - 1))))]  # noqa: E731
    return {"tok_s": len(t) / sum(t), "tpot_p50_ms": q(0.5) * 1e3, "tpot_p99_ms": q(0.99) * 1e3,
            "prefill_s": res["prefill_s"], "counters": res.get("counters"), "mode_used": res.get("mode_used")}


def write_tokens(model: Path, path: Path) -> str:
    """The decode rows' PROMPT + GEN tokens of `model` into `path` (JSON): text on topics for a
    synthetic model (kairox.synth.topic_prompts), else random ids; returns which."""
    try:
        from kairox.synth import topic_prompts
        toks, kind = topic_prompts(model, 1, PROMPT + GEN, seed=1)[0], "topic"
    except Exception:  # not a synthetic model
        import random
        rnd = random.Random(1)
        toks, kind = [rnd.randrange(1000, 20000) for _ in range(PROMPT + GEN)], "random"
    path.write_text(json.dumps(toks))
    return kind


def tpot_run(impl: str, mode: str, model: Path, tokens: Path, ngl: int, threads: int, env: dict,
             extra: list[str] = ()) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "tpot.py"), "--impl", impl, "--mode", mode, "--model",
           str(model), "--tokens", str(tokens), "--prompt-len", str(PROMPT), "--ngl", str(ngl),
           "--threads", str(threads)] + list(extra)
    r = run(cmd, env=env)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"command": shlex.join(cmd), **summarize_tpot(out), "slots_bytes": out.get("slots_bytes"),
            "gpu_mem_mib": out.get("gpu_mem_mib"), "vram": out.get("vram"), "pp_tok_s": out.get("pp_tok_s"),
            "balance": out.get("balance"), "thresholds": out.get("thresholds"), "tpot_s": out["tpot_s"]}


def run_config(args: argparse.Namespace) -> int:
    preset, budget_gib = CONFIGS[args.config]
    budget_gib = args.budget or budget_gib
    budget_mib = budget_gib * 1024
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    threads = args.threads
    t_start = time.time()
    times: dict[str, float] = {}

    # 1. model (and its pack)
    if preset is None:
        if not args.model:
            raise SystemExit(f"--config {args.config} needs --model")
        model = Path(args.model)
    else:
        from kairox.synth import PRESETS
        model = Path(args.model or work / f"{preset}-{PRESETS[preset].ftype}.gguf")
        if not model.exists():
            t0 = time.time()
            cmd = [sys.executable, "-m", "kairox", "synth", "--preset", preset, "-o", str(model), "-q"]
            if args.pack:
                cmd.append("--pack")
            run(cmd, timeout=1800)
            times["synth"] = time.time() - t0
            log(f"synth {model.name}: {times['synth']:.0f} s")
    from kairox.pack import pack_path_for
    has_pack = pack_path_for(model).exists()

    # 2. tokens: text on topics for synthetic models (kairox.synth.topic_prompts), else random
    tokens_file = work / f"{model.stem}.tokens.json"
    token_kind = write_tokens(model, tokens_file)

    # 3. bandwidths
    from kairox.hw import measure_bandwidths
    bw = measure_bandwidths(threads)
    log(f"bandwidths GB/s: {bw}")

    lay = Layout(model)
    stock = str(Path(args.stock_bin) / "llama-bench")
    kxbench = str(Path(args.kairox_bin) / "llama-bench")
    stock_env = {"LLAMA_CPP_LIB_PATH": str(Path(args.stock_bin))}

    # 4. -ngl for the budget (without a GPU everything runs on the CPU: -ngl 0)
    t0 = time.time()
    if bw.get("gpu_hbm") is None:
        ngl, probes = 0, []
        mem = probe(stock, model, 0, threads)
    else:
        ngl, mem, probes = find_ngl(stock, model, lay, budget_mib, threads)
    times["find_ngl"] = time.time() - t0
    log(f"budget {budget_gib} GiB -> -ngl {ngl} ({mem['total_mib']:.0f} MiB)")

    rows = []

    def add(impl: str, mode: str, how: str, res: dict, density: float | None = None, cmd: str = "") -> None:
        exact = mode == "exact"
        pred = 0.0
        if mode == "predicted" and has_pack:
            pred = pred_bytes_per_token(model, lay, ngl)
        b = lay.bytes_per_token(ngl, density, exact, pred)
        bd = bound(b, bw)
        tok_s = res.get("tg_tok_s") or res.get("tok_s")
        rows.append({"impl": impl, "mode": mode, "how": how, "ngl": ngl, **res, "bytes": b, "bound": bd,
                     "efficiency": bd["seconds"] * tok_s if tok_s else None,
                     "gpu_share": min(ngl, lay.n_layer) / lay.n_layer, "density": density, "command": cmd})

    # 5. llama-bench rows: stock at ngl, stock --fit, kairox dense at ngl
    t0 = time.time()
    for impl, binary, extra, how in (
            *([] if not args.baseline else [("llama.cpp", stock, ["-ngl", str(ngl)], "llama-bench")]),
            *([] if not args.dense else [("kairox", kxbench, ["-ngl", str(ngl)], "llama-bench")])):
        cmd = bench_cmd(binary, model, threads, args.reps, extra)
        add(impl, "dense", how, parse_bench(run(cmd)), cmd=shlex.join(cmd))
    free = smi_mib("free") if args.baseline else None
    if free is not None:
        margin = max(0, int(free - budget_mib))
        cmd = bench_cmd(stock, model, threads, args.reps, ["-fitt", str(margin), "-fitc", str(PROMPT + PP)])
        res = parse_bench(run(cmd))
        add("llama.cpp", "dense", f"llama-bench --fit-target {margin}", res, cmd=shlex.join(cmd))
        rows[-1]["fit_ngl"] = res["gpu"]["offloaded"]
    times["llama_bench"] = time.time() - t0

    # 6. per-token timing
    t0 = time.time()
    kx_env = {"KAIROX_LIB_DIR": str(Path(args.kairox_lib))}
    runs = (([("llama.cpp", "dense", stock_env)] if args.baseline else [])
            + ([("kairox", "dense", kx_env)] if args.dense else []))
    modes = [m for m in args.modes.split(",") if m]
    if has_pack:
        runs += [("kairox", m, kx_env) for m in modes if m != "hybrid"]
    for impl, mode, env in runs:
        res = tpot_run("stock" if impl == "llama.cpp" else "kairox", mode, model, tokens_file, ngl, threads, env)
        c = res.get("counters")
        density = c["selected"] / c["total"] if c and c["total"] else None
        add(impl, mode, "tpot", res, density=density, cmd=res.pop("command"))
    hybrid = trace = None
    if has_pack and "hybrid" in modes and bw.get("gpu_hbm") is not None:
        slots, hybrid = hybrid_slots(kxbench, model, lay, budget_mib, threads)
        log(f"static hybrid: harness estimate {slots} slots per layer ({hybrid['slots_mib']:.0f} MiB) + "
            f"{hybrid['total_mib']:.0f} MiB; the runtime picks its own under --vram-budget")
        budget_arg = ["--vram-budget", f"{int(budget_mib)}MiB"]
        n_tok, n_ff = GEN, lay_n_ff(model)

        def add_hybrid(mode: str, res: dict) -> None:
            c = res["counters"]
            b = hybrid_bytes_per_token(lay, c, n_tok, hybrid["per_neuron_bytes"], hybrid["pred_mib"] * MiB, n_ff,
                                       hybrid.get("gate_row_bytes", 0))
            bd = bound(b, bw)
            listed = c["rows"] + c["elsewhere"]
            rows.append({"impl": "kairox", "mode": mode, "how": "tpot", "ngl": 999, **res, "bytes": b,
                         "bound": bd, "efficiency": bd["seconds"] * res["tok_s"],
                         "gpu_share": c["elsewhere"] / listed if listed else None,
                         "density": listed / (n_tok * lay.n_layer * n_ff),
                         "slots": (res.get("vram") or {}).get("slot_counts", [None])[0],
                         "command": res.pop("command")})
        add_hybrid("static hybrid", tpot_run("kairox", "predicted", model, tokens_file, 999, threads, kx_env,
                                             budget_arg + ["--pp", str(PP)]))
        if args.ab_pageable:  # A/B: host weights mapped from the file instead of page-locked
            add_hybrid("static hybrid, pageable host weights",
                       tpot_run("kairox", "predicted", model, tokens_file, 999, threads, kx_env,
                                budget_arg + ["--pp", str(PP), "--no-pinned"]))
        if args.trace:
            trace = hybrid_trace(Path(args.out), result_name(args.config, budget_gib), model, tokens_file,
                                 threads, kx_env, budget_arg)
    times["tpot"] = time.time() - t0

    result = {
        "benchmark": "offload", "config": args.config, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": shlex.join([sys.executable] + sys.argv), "commit": git_commit(),
        "machine": machine_facts(), "model": model.name, "model_bytes": model.stat().st_size,
        "budget_gib": budget_gib, "ngl": ngl, "gpu_memory": mem, "probes": probes, "bandwidth_gbs": bw,
        "threads": threads, "prompt": PROMPT, "gen": GEN, "pp": PP, "reps": args.reps,
        "tokens": token_kind, "has_pack": has_pack, "rows": rows, "seconds": times, "note": args.note,
        "hybrid": hybrid, "trace": trace,
        "wall_s": time.time() - t_start,
    }
    name = result_name(args.config, budget_gib) + ("" if args.baseline else "-kairox")
    write_results(Path(args.out) / name, result, summary_lines(result))
    if preset is not None and not args.keep:
        for p in (model, pack_path_for(model)):
            p.unlink(missing_ok=True)
    return 0


def result_name(config: str, budget_gib: float) -> str:
    """offload-<config> at the configuration's own budget, offload-<config>-<b>GiB otherwise
    (a budget sweep keeps one file per point)."""
    if budget_gib == CONFIGS[config][1]:
        return f"offload-{config}"
    return f"offload-{config}-{budget_gib:g}GiB"


FFN_ON_CPU = r"ffn_(gate|up|down)=CPU"


def hybrid_slots(kxbench: str, model: Path, lay: Layout, budget_mib: float, threads: int) -> tuple[int, dict]:
    """Neuron slots per layer for the static hybrid at a VRAM budget: every layer's
    attention and the output head on the GPU, FFN weights in host memory, and the memory
    left (measured by kairox's llama-bench at that placement, less the GPU predictors and
    a 3% margin for the hybrid graph's buffers) filled with slots, the same count per
    layer (the solver's per-layer balance is kairox plan's job)."""
    from kairox.plan import slot_costs
    mem = gpu_buffers(run(bench_cmd(kxbench, model, threads, 1, ["-ngl", "999", "-ot", FFN_ON_CPU], n_gen=0)).stderr)
    c = slot_costs(model)
    free = budget_mib * 0.97 * MiB - mem["total_mib"] * MiB - c.pred
    slots = max(0, min(c.n_ff, int(free // (c.per_neuron * lay.n_layer))))
    return slots, {**mem, "pred_mib": c.pred / MiB, "per_neuron_bytes": c.per_neuron, "gate_row_bytes": c.gate_row, "slots": slots,
                   "slots_mib": slots * c.per_neuron * lay.n_layer / MiB}


def hybrid_trace(out: Path, name: str, model: Path, tokens: Path, threads: int, env: dict,
                 extra: list[str]) -> dict:
    """One more static-hybrid run with the scheduler trace on (tpot.py --sched-trace; stamps cost a few
    µs each, so it is not a timing run): the overlap figures, a typical step's timeline
    (trace-NAME.png) and that step's records with its neighbours (trace-NAME.jsonl)."""
    from kairox import trace as kxtrace
    raw = out / f"trace-{name}.full.jsonl"
    tpot_run("kairox", "predicted", model, tokens, 999, threads,
             env, [*extra, "--sched-trace", str(raw), "--sched-trace-max", "1000000"])
    recs, dropped = kxtrace.read_trace(raw)
    summary = kxtrace.summarize(recs)
    g = kxtrace.pick_graph(recs)
    kxtrace.plot_graph(recs, g, out / f"trace-{name}.png")
    kxtrace.trim(raw, out / f"trace-{name}.jsonl", [g - 1, g, g + 1])
    raw.unlink()
    log("trace: " + kxtrace.summary_text(summary).replace("\n", "; "))
    return {**summary, "graph_drawn": g, "dropped": dropped, "png": f"trace-{name}.png",
            "records": f"trace-{name}.jsonl"}


def lay_n_ff(model: Path) -> int:
    from kairox.gguf_header import scan_header
    return next(t.ne[1] for t in scan_header(model).tensors if t.name == "blk.0.ffn_up.weight")


def hybrid_bytes_per_token(lay: Layout, counters: dict, n_tokens: int, per_neuron: float, pred: float,
                           n_ff: int, gate_row: float = 0.0) -> dict:
    """(GPU, CPU, PCIe) bytes of one static-hybrid decode step: all dense tensors, the
    predictors and the listed resident rows on the GPU; the listed other rows on the CPU;
    per layer x and the active list down, the CPU part's output up. With gate_row known, the
    CPU reads a gate row per listed neuron and its up and down rows only where it fired
    (counters' nonzero; decode: one token per call): what the host part must read. Without
    it, every listed neuron's three rows (the bound of results before the ReLU up skip)."""
    rows, hot = counters["rows"] / n_tokens, counters["elsewhere"] / n_tokens
    gpu = sum(lay.layer_other) + lay.output + pred + hot * per_neuron
    if gate_row:
        cpu = rows * gate_row + counters["nonzero"] / n_tokens * (per_neuron - gate_row)
    else:
        cpu = rows * per_neuron
    pcie = lay.n_layer * (2 * lay.n_embd * 4 + 4 * (n_ff + 1))
    return {"gpu": gpu, "cpu": cpu, "pcie": pcie}


def pred_bytes_per_token(model: Path, lay: Layout, ngl: int) -> float:
    """Bytes of the predictors of the CPU layers (read once per token)."""
    from kairox.gguf_header import scan_header
    from kairox.pack import pack_path_for
    n_cpu = lay.n_layer - min(ngl, lay.n_layer)
    total = 0
    for t in scan_header(pack_path_for(model)).tensors:
        m = re.match(r"blk\.(\d+)\.kx_pred_", t.name)
        if m and int(m.group(1)) < n_cpu:
            total += t.nbytes
    return float(total)


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def summary_lines(r: dict) -> list[str]:
    bw = r["bandwidth_gbs"]
    gpu = r["machine"].get("gpu") or "no GPU"
    lines = [f"# Offload benchmark: {r['model']} at a {r['budget_gib']:g} GiB VRAM budget", "",
             f"-ngl {r['ngl']} (GPU buffers {r['gpu_memory']['total_mib']:.0f} MiB: model "
             f"{r['gpu_memory']['model_mib']:.0f} + KV {r['gpu_memory']['kv_mib']:.0f} + compute "
             f"{r['gpu_memory']['compute_mib']:.0f}); {r['threads']} threads; decode = {r['gen']} tokens "
             f"after {r['prompt']} ({r['tokens']} tokens), prefill = {r['pp']}; commit {r['commit'][:10]}; "
             f"{gpu}; bandwidths GB/s: CPU read {fmt(bw['cpu_read'], '.1f')}, HBM {fmt(bw['gpu_hbm'], '.0f')}, "
             f"PCIe H2D {fmt(bw['pcie_h2d'], '.1f')}", "",
             *([r["note"], ""] if r.get("note") else []),
             "| impl | mode | measured by | decode tok/s | prefill tok/s | TPOT p50 ms | TPOT p99 ms | "
             "GPU share | density | PCIe KB/tok | bound ms/tok (limit) | efficiency |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        tok_s = x.get("tg_tok_s") or x.get("tok_s")
        how = x["how"] + (f" (ngl {x['fit_ngl']})" if x.get("fit_ngl") else "")
        lines.append(f"| {x['impl']} | {x['mode']} | {how} | {fmt(tok_s)} | {fmt(x.get('pp_tok_s'), '.1f')} | "
                     f"{fmt(x.get('tpot_p50_ms'), '.1f')} | {fmt(x.get('tpot_p99_ms'), '.1f')} | "
                     f"{x['gpu_share']:.2f} | {fmt(x['density'], '.3f')} | {x['bytes']['pcie'] / 1e3:.1f} | "
                     f"{x['bound']['seconds'] * 1e3:.2f} ({x['bound']['limit']}) | {fmt(x['efficiency'], '.2f')} |")
    for x in r["rows"]:
        if x.get("vram"):
            v = x["vram"]
            lines += ["", f"{x['mode']}: runtime VRAM check: {v['used'] / MiB:.0f} MiB used of {v['budget'] / MiB:.0f} "
                          f"MiB (base {v['base'] / MiB:.0f}, slots {v['slots'] / MiB:.0f} MiB = {v['slot_counts'][0]} "
                          f"neurons/layer; {fmt((v.get('used_after_run') or 0) / MiB, '.0f')} MiB after the run)"]
            break
    t = r.get("trace")
    if t:
        from kairox.trace import summary_text
        lines += ["", f"Overlap trace (the scheduler trace, one more run; [{t['png']}]({t['png']}), records {t['records']}):", "",
                  *[f"    {ln}" for ln in summary_text(t).splitlines()]]
    return lines


def summarize(folder: Path, cpu_gbs: float | None = None, out: Path | None = None) -> int:
    """All offload-*.json in a folder and its folders (archive/ left out): one table and a plot
    of decode tok/s per mode, written to out (default: the folder).

    cpu_gbs: a CPU read roof (GB/s) for the bound where the run's own probe measured less
    (bounds and efficiencies are recomputed from each row's bytes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or folder
    results = sorted((json.loads(p.read_text()) for p in folder.rglob("offload-*.json")
                      if "archive" not in p.relative_to(folder).parts),
                     key=lambda r: (r["model_bytes"], r["budget_gib"]))
    if not results:
        raise SystemExit(f"no offload-*.json in {folder}")
    # kairox-only runs (--no-baseline) join the baseline run of the same model and budget
    def key(r: dict) -> tuple:
        return r["model"], r["budget_gib"]
    extra = [r for r in results if not any(x["impl"] == "llama.cpp" for x in r["rows"])]
    results = [r for r in results if r not in extra]
    for e in extra:
        base = next((r for r in results if key(r) == key(e)), None)
        if base is not None:
            base["rows"] = base["rows"] + [x for x in e["rows"] if x["how"] == "tpot" and x["impl"] == "kairox"
                                           and x["mode"] != "dense"]
    lines = ["# Offload benchmarks: summary", "",
             "Decode tok/s, batch 1, 128 tokens after a 64-token context; prefill tok/s of 512 "
             "tokens (llama-bench). Bound = physical floor per token of that placement "
             "(docs/benchmarking.md); efficiency = bound / measured."
             + (f" CPU read roof for the bound: {cpu_gbs:g} GB/s (or the run's own probe if higher)."
                if cpu_gbs else ""), "",
             "| model | budget GiB | -ngl (GPU MiB) | llama.cpp tok/s | llama.cpp --fit tok/s (ngl) | "
             "kairox dense tok/s | kairox dense / llama.cpp | llama.cpp TPOT p50 / p99 ms | "
             "prefill llama.cpp / kairox | bound ms/tok | efficiency llama.cpp (best) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.4), squeeze=False)
    for ax, r in zip(axes[0], results):
        bw = dict(r["bandwidth_gbs"])
        if cpu_gbs:
            bw["cpu_read"] = max(bw["cpu_read"], cpu_gbs)
        for x in r["rows"]:
            x["bound"] = bound(x["bytes"], bw)
            tok_s = x.get("tg_tok_s") or x.get("tok_s")
            x["efficiency"] = x["bound"]["seconds"] * tok_s if tok_s else None
        st = next(x for x in r["rows"] if x["impl"] == "llama.cpp" and x["how"] == "llama-bench")
        fit = next((x for x in r["rows"] if x["how"].startswith("llama-bench --fit")), None)
        kx = next((x for x in r["rows"] if x["impl"] == "kairox" and x["how"] == "llama-bench"), None)
        tp = next((x for x in r["rows"] if x["impl"] == "llama.cpp" and x["how"] == "tpot"), None)
        best = max((x for x in (st, fit) if x), key=lambda x: x["tg_tok_s"])
        lines.append(
            f"| {r['model']} | {r['budget_gib']:g} | {r['ngl']} ({r['gpu_memory']['total_mib']:.0f}) | "
            f"{fmt(st['tg_tok_s'])} | {fmt(fit and fit['tg_tok_s'])} ({fit and fit.get('fit_ngl') or '-'}) | "
            f"{fmt(kx and kx['tg_tok_s'])} | {fmt(kx and kx['tg_tok_s'] / st['tg_tok_s'], '.3f')} | "
            f"{fmt(tp and tp['tpot_p50_ms'], '.0f')} / {fmt(tp and tp['tpot_p99_ms'], '.0f')} | "
            f"{fmt(st['pp_tok_s'], '.0f')} / {fmt(kx and kx['pp_tok_s'], '.0f')} | "
            f"{st['bound']['seconds'] * 1e3:.1f} ({st['bound']['limit']}) | {fmt(best['efficiency'])} |")
        labels = [f"{x['impl']} {x['mode']}\n{x['how'].split(' (')[0][:26]}" for x in r["rows"]]
        vals = [x.get("tg_tok_s") or x.get("tok_s") for x in r["rows"]]
        ax.barh(range(len(vals)), vals, color=["tab:gray" if x["impl"] == "llama.cpp" else "tab:blue"
                                               for x in r["rows"]])
        ax.axvline(1 / st["bound"]["seconds"], color="tab:red", ls="--", label="bound")
        ax.set_yticks(range(len(vals)), labels, fontsize=6)
        ax.set_xlabel("decode tok/s")
        ax.legend(fontsize=7)
        ax.set_title(f"{r['model']} @ {r['budget_gib']:g} GiB (ngl {r['ngl']})", fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "offload-summary.png", dpi=110)
    lines += ["", "![decode tok/s](offload-summary.png)", ""] + kairox_mode_lines(results)
    if plot_budgets(results, out / "offload-budget.png"):
        lines += ["Decode tok/s against the VRAM budget (models measured at more than one budget):", "",
                  "![tok/s vs budget](offload-budget.png)", ""]
    (out / "offload-summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def pp_vs(pp: float | None, ref: float | None) -> str:
    """'496 (0.78x)': a prefill tok/s and its ratio to llama.cpp's, '-' when not measured."""
    return "-" if not pp else f"{pp:.0f}" + (f" ({pp / ref:.2f}x)" if ref else "")


def kairox_mode_lines(results: list[dict]) -> list[str]:
    """kairox's sparse modes (per-token timing) against llama.cpp's best at the same budget."""
    out = ["kairox sparse modes (per-token timing, teacher-forced) against llama.cpp's best decode "
           "(-ngl or --fit) at the same budget:", "",
           "| model | budget GiB | mode | tok/s | vs llama.cpp | TPOT p50 / p99 ms | prefill tok/s (vs llama.cpp) | "
           "GPU share | density | GPU MiB measured | bound ms/tok (limit) | efficiency |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    n = len(out)
    for r in results:
        best = max((x.get("tg_tok_s") or 0.0) for x in r["rows"] if x["impl"] == "llama.cpp")
        st_pp = next((x.get("pp_tok_s") for x in r["rows"] if x["impl"] == "llama.cpp" and x["how"] == "llama-bench"), None)
        for x in r["rows"]:
            if x["impl"] != "kairox" or x["how"] != "tpot" or x["mode"] == "dense":
                continue
            mode = x["mode"] + (f" ({x['slots']} slots/layer)" if x.get("slots") is not None else "")
            out.append(f"| {r['model']} | {r['budget_gib']:g} | {mode} | {fmt(x['tok_s'])} | "
                       f"{fmt(x['tok_s'] / best if best else None)}x | {fmt(x['tpot_p50_ms'], '.1f')} / "
                       f"{fmt(x['tpot_p99_ms'], '.1f')} | {pp_vs(x.get('pp_tok_s'), st_pp)} | "
                       f"{fmt(x.get('gpu_share'))} | {fmt(x.get('density'), '.3f')} | "
                       f"{fmt(x.get('gpu_mem_mib'), '.0f')} | {x['bound']['seconds'] * 1e3:.2f} ({x['bound']['limit']}) | "
                       f"{fmt(x['efficiency'])} |")
    return out + [""] if len(out) > n else []


def plot_budgets(results: list[dict], path: Path) -> bool:
    """Decode tok/s vs VRAM budget, one panel per model with two or more budgets, one line
    per (implementation, mode, how). Returns False (no file) when no model has a sweep."""
    import matplotlib.pyplot as plt

    by_model: dict[str, list[dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    sweeps = {m: rs for m, rs in by_model.items() if len({r["budget_gib"] for r in rs}) > 1}
    if not sweeps:
        return False
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.5 * len(sweeps), 3.4), squeeze=False)
    for ax, (m, rs) in zip(axes[0], sweeps.items()):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rs:
            for x in r["rows"]:
                tok_s = x.get("tg_tok_s") or x.get("tok_s")
                if tok_s and not x["how"].startswith("llama-bench --fit"):
                    series.setdefault(f"{x['impl']} {x['mode']} ({x['how']})", []).append((r["budget_gib"], tok_s))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    ls="--" if label.startswith("llama.cpp") else "-")
        ax.set_xlabel("VRAM budget (GiB)")
        ax.set_ylabel("decode tok/s")
        ax.set_title(m, fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS))
    ap.add_argument("--model", help="model GGUF (default: synthesized into --work)")
    ap.add_argument("--budget", type=float, help="VRAM budget in GiB (default: the configuration's)")
    ap.add_argument("--stock-bin", help="bin/ of the unpatched llama.cpp build (llama-bench, libllama)")
    ap.add_argument("--kairox-bin", help="bin/ of kairox's build (its llama-bench)")
    ap.add_argument("--kairox-lib", help="lib/ of kairox's install (KAIROX_LIB_DIR)")
    ap.add_argument("--work", default="/tmp/kxbench", help="where models are written")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--reps", type=int, default=2, help="llama-bench repetitions (default: %(default)s)")
    ap.add_argument("--modes", default="exact,predicted",
                    help="kairox sparse modes to time when the model has a pack (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-pack", dest="pack", action="store_false", help="skip the sparse pack (no sparse rows)")
    ap.add_argument("--keep", action="store_true", help="keep the synthesized model")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the unpatched llama.cpp rows (--stock-bin is then only used to probe "
                         "-ngl and may be kairox's own bin/); writes offload-<config>-kairox.json, "
                         "which --summarize sets beside the baseline of the same model and budget")
    ap.add_argument("--no-dense", dest="dense", action="store_false",
                    help="skip kairox's dense rows (llama-bench and per-token timing)")
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="hybrid: skip the traced run (overlap figures and timeline)")
    ap.add_argument("--ab-pageable", action="store_true",
                    help="hybrid: also a row with the host weights pageable (--no-pinned), for prefill")
    ap.add_argument("--note", default="", help="a line stored with the result (e.g. what the model is)")
    ap.add_argument("--summarize", metavar="DIR", help="only summarize the results in DIR and its folders")
    ap.add_argument("--summary-dir", metavar="DIR", help="with --summarize: where the summary goes (default: DIR)")
    ap.add_argument("--cpu-gbs", type=float, help="with --summarize: CPU read roof for the bound (GB/s)")
    args = ap.parse_args()
    if args.summarize:
        return summarize(Path(args.summarize), args.cpu_gbs,
                         Path(args.summary_dir) if args.summary_dir else None)
    if not (args.config and args.stock_bin and args.kairox_bin and args.kairox_lib):
        ap.error("--config, --stock-bin, --kairox-bin and --kairox-lib are required")
    return run_config(args)


if __name__ == "__main__":
    sys.exit(main())
