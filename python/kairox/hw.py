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

`matvec_rates()` adds what the placement solver divides by: the rate (weight GB/s) of one
token times a matrix of each weight type, through ggml's own kernels on the CPU and the GPU
(`kx_profile_matvec` in libllama). Quantized CPU matvecs spend compute per byte and run
below the streaming read; the solver uses the measured rate of each tensor's type.
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


# the types of the models people run: F16/BF16 conversions, the legacy quants and the
# K-quants of Q4_K_M / Q5_K_M / Q6_K files (a type left out is priced at the streaming read,
# which a quantized matvec on the CPU does not reach)
MATVEC_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
MATVEC_COLS = 4096  # a multiple of every block size (k-quants: 256)


def matvec_seconds(type_name: str, n_bytes: int, gpu: bool = False, threads: int | None = None,
                   reps: int = 5, cols: int = MATVEC_COLS) -> tuple[float, int]:
    """(best seconds, weight bytes) of one matvec over ~n_bytes of `type_name` weights."""
    import ctypes

    import gguf

    from .llama import _C
    lib = _C._lib
    f = lib.kx_profile_matvec
    f.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                  ctypes.c_int32, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int64)]
    f.restype = ctypes.c_int32
    try:
        tid = int(gguf.GGMLQuantizationType[type_name.upper()])
    except KeyError:
        raise ValueError(f"unknown weight type {type_name!r}") from None
    sec, nb = ctypes.c_double(), ctypes.c_int64()
    # threads: all cores unless told (ggml's CPU backend alone would use 4: measured on the
    # GPU machine, 4 threads reach 36 GB/s on F16 where 16 reach 124)
    rc = f(tid, n_bytes, cols, int(gpu), threads or os.cpu_count() or 0, reps, ctypes.byref(sec), ctypes.byref(nb))
    if rc:
        why = {1: "unsupported type or arguments", 2: "no such device", 3: "matrix does not fit",
               4: "backend failed"}.get(rc, f"error {rc}")
        raise RuntimeError(f"matvec {type_name} on the {'GPU' if gpu else 'CPU'}: {why}")
    return sec.value, nb.value


def matvec_rates(threads: int | None = None, types: tuple[str, ...] = MATVEC_TYPES,
                 cpu_bytes: int = 512 << 20, gpu_bytes: int = 1 << 30, passes: int = 2
                 ) -> dict[str, dict[str, float]]:
    """{"cpu": {type: GB/s}, "gpu": {type: GB/s}} (gpu empty without a GPU). 512 MiB on
    the CPU and 1 GiB on the GPU: well past the last-level caches (the H200's L2 is 50 MB),
    and a GPU matvec of that size runs ~0.3 ms, far above its launch cost. The CPU types are
    measured in `passes` interleaved passes, each type's best kept: the first type measured
    in one pass right after the bandwidth probes (BLAS and torch thread pools) once read a
    quarter of what the decode reads on that host (docs/results-log.md), and a best of
    consecutive repetitions does not step out of such a window."""
    from ._native import has_gpu
    out: dict[str, dict[str, float]] = {"cpu": {}, "gpu": {}}
    for _ in range(max(1, passes)):
        for t in types:
            s, nb = matvec_seconds(t, cpu_bytes, threads=threads)
            out["cpu"][t] = max(out["cpu"].get(t, 0.0), nb / s / 1e9)
    if has_gpu():
        for t in types:
            s, nb = matvec_seconds(t, gpu_bytes, gpu=True, reps=20)
            out["gpu"][t] = nb / s / 1e9
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
    rates = matvec_rates(threads)
    out["cpu_type_gbs"], out["gpu_type_gbs"] = rates["cpu"], rates["gpu"]
    curve = pcie_by_size()
    out["details"] = {"measured": dict(bw), "threads": threads or os.cpu_count(),
                      "pcie_h2d_gbs_by_bytes": {str(k): v for k, v in (curve or {}).items()},
                      "gpu": bw.get("gpu_hbm") is not None,
                      "note": "GPU and PCIe figures need torch with CUDA; without them the solver's defaults stand"}
    return out
