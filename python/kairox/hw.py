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

import os
import time
from concurrent.futures import ThreadPoolExecutor
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


def measure_bandwidths(threads: int | None = None) -> dict[str, float | None]:
    out: dict[str, float | None] = {"cpu_read": cpu_read_gbs(threads=threads)}
    out.update(gpu_bandwidths() or {"gpu_hbm": None, "pcie_h2d": None})
    return out
