"""Measured memory bandwidths of this machine: the denominators of the physical bound.

A decode step must at least read its weights once: those in GPU memory at HBM speed, those
in host memory at the CPU's read speed, and whatever crosses PCIe at the link's speed.
`measure_bandwidths()` measures the three (GB/s, 1e9 bytes per second) with large
transfers, best of a few repetitions:

* cpu_read: a streaming read of one float32 array by all cores, the best of two kernels
  (BLAS matrix-vector products over the whole array, and numpy max over disjoint slices in
  a thread pool; numpy releases the GIL inside both). A plain reduction (np.sum) reaches
  only ~60% of the memory bandwidth on the GPU machine, which made llama.cpp look faster
  than the "bound" (efficiency 1.16 on KB-7B); the bound must use the best read we can do;
* gpu_hbm: a device-to-device copy, counted as bytes read plus bytes written;
* pcie_h2d: one copy from pinned host memory to the device.

GPU figures need torch with CUDA (present on the GPU machine); without it they are None.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


def cpu_read_gbs(nbytes: int = 2 << 30, threads: int | None = None, reps: int = 3) -> float:
    threads = threads or os.cpu_count() or 1
    a = np.ones(nbytes // 4, np.float32).reshape(-1, 4096)
    v = np.ones(4096, np.float32)
    parts = np.array_split(a, threads * 4)
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        for kernel in (lambda: a @ v, lambda: list(ex.map(np.max, parts))):
            kernel()
            for _ in range(reps):
                t0 = time.perf_counter()
                kernel()
                best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def gpu_bandwidths(nbytes: int = 2 << 30, reps: int = 3) -> dict[str, float] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def best(fn: Any, moved: int) -> float:
        fn()
        torch.cuda.synchronize()
        out = 0.0
        for _ in range(reps):
            ev0.record()
            fn()
            ev1.record()
            ev1.synchronize()
            out = max(out, moved / (ev0.elapsed_time(ev1) / 1e3) / 1e9)
        return out

    r = {"gpu_hbm": best(lambda: dst.copy_(src), 2 * nbytes),
         "pcie_h2d": best(lambda: src.copy_(host, non_blocking=True), nbytes)}
    del src, dst, host
    torch.cuda.empty_cache()
    return r


def pcie_by_size(sizes: tuple[int, ...] = tuple(1 << k for k in range(12, 29, 2)), reps: int = 5
                 ) -> dict[int, float] | None:
    """Host-to-device GB/s of one pinned copy per size (bytes): small reloads pay latency."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    host = torch.empty(max(sizes), dtype=torch.uint8).pin_memory()
    dev = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")
    out = {}
    for n in sizes:
        dev[:n].copy_(host[:n], non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dev[:n].copy_(host[:n], non_blocking=True)
        torch.cuda.synchronize()
        out[n] = n * reps / (time.perf_counter() - t0) / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out


def measure_bandwidths(threads: int | None = None) -> dict[str, float | None]:
    out: dict[str, float | None] = {"cpu_read": cpu_read_gbs(threads=threads)}
    out.update(gpu_bandwidths() or {"gpu_hbm": None, "pcie_h2d": None})
    return out


# one CPU<->GPU hand-off of the hidden state (a stream sync each way), measured on the GPU
# machine (shared/reference/hardware.md): the solver's default when nothing else is known
HANDOFF_US = 23.5


def profile(threads: int | None = None) -> dict[str, Any]:
    """The hardware profile `kairox plan --hw` reads: HwProfile's fields plus details."""
    bw = measure_bandwidths(threads)
    from .plan import HwProfile
    hp = HwProfile.from_bandwidths(bw)
    out: dict[str, Any] = {"cpu_gbs": hp.cpu_gbs, "gpu_gbs": hp.gpu_gbs, "pcie_gbs": hp.pcie_gbs,
                           "handoff_us": HANDOFF_US}
    curve = pcie_by_size()
    out["details"] = {"measured": dict(bw), "threads": threads or os.cpu_count(),
                      "pcie_h2d_gbs_by_bytes": {str(k): v for k, v in (curve or {}).items()},
                      "gpu": bw.get("gpu_hbm") is not None,
                      "note": "GPU and PCIe figures need torch with CUDA; without them the solver's defaults stand"}
    return out


def cmd_profile_hw(args: argparse.Namespace) -> int:
    print("kairox profile-hw: measuring (CPU read, GPU HBM, PCIe by transfer size; ~30 s)...", file=sys.stderr)
    prof = profile(args.threads)
    try:
        Path(args.output).write_text(json.dumps(prof, indent=1) + "\n")
    except OSError as e:
        print(f"kairox profile-hw: error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"CPU read {prof['cpu_gbs']:.1f} GB/s, GPU {prof['gpu_gbs']:.0f} GB/s, PCIe {prof['pcie_gbs']:.1f} GB/s"
          + ("" if prof["details"]["gpu"] else " (no GPU measured: defaults)"))
    print(f"kairox profile-hw: wrote {args.output} (use it with `kairox plan --hw {args.output}`)")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("profile-hw", help="measure this machine's bandwidths for `kairox plan --hw`",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", default="kxhw.json", help="profile file (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.set_defaults(func=cmd_profile_hw)
