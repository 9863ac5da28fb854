"""Writing GGUF files so that a reader never sees a partial one."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def encode_tensor(w: np.ndarray, qtype: Any, name: str) -> np.ndarray:
    """float data -> the bytes/array GGUFWriter stores for ggml type `qtype` (F32, F16, BF16,
    or a type gguf.quants can quantize). F16 overflow is an error, not a silent inf."""
    import gguf
    Q = gguf.GGMLQuantizationType
    w32 = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == Q.F32:
        return w32
    if qtype == Q.F16:
        with np.errstate(over="ignore"):  # overflow is reported below, as an error
            out = w32.astype(np.float16)
        if np.isinf(out).any() and not np.isinf(w32).any():
            raise ValueError(f"{name} has values beyond float16's range (65504); "
                             f"store it as bf16 or f32")
        return out
    return gguf.quants.quantize(w32, qtype)


def finish_atomically(writer: Any, tmp: Path, out: Path, data: Iterable[np.ndarray]) -> Path:
    """Write header, KV and tensor infos already declared on `writer` (a gguf.GGUFWriter
    opened on `tmp`), then each tensor's data in declaration order, streamed one at a time;
    rename `tmp` to `out` only once complete. On any error `tmp` is removed."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for arr in data:
            writer.write_tensor_data(arr)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(out)


def map_ahead(fn: Callable[[int], T], items: Iterable[int], workers: int) -> Iterator[T]:
    """fn(i) for each item, in order, computed by up to `workers` forked processes, at most
    2 x workers items ahead of the consumer (so results waiting in memory stay bounded).

    A layer's pack data is numpy and BLAS work. Threads do not speed it up: on the GPU
    machine 4 threads packed KB-70B no faster than one (BLAS calls contend, and gguf's
    quantizers hold the GIL between small steps). Forked processes share the parent's
    state (fn may be a closure) and each gets cores/workers BLAS threads. workers <= 1, or
    no fork on this platform: computed one at a time, in this process."""
    import multiprocessing as mp
    if workers <= 1 or "fork" not in mp.get_all_start_methods():
        yield from map(fn, items)
        return
    from collections import deque
    global _FORKED
    _FORKED = fn
    blas = max(1, (os.cpu_count() or 1) // workers)
    try:
        with mp.get_context("fork").Pool(workers, initializer=_limit_blas_threads, initargs=(blas,)) as pool:
            pending: deque = deque()
            for it in items:
                pending.append(pool.apply_async(_run_forked, (it,)))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
    finally:
        _FORKED = None


_FORKED: Callable[[int], Any] | None = None  # the function forked workers run (inherited)


def _run_forked(i: int) -> Any:
    assert _FORKED is not None
    return _FORKED(i)


def _limit_blas_threads(n: int) -> None:
    """Cap the BLAS threads of this (forked) process at n: the OpenBLAS that numpy loaded,
    found in the process's mappings (numpy has no API for it). Any other BLAS is left as is."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            libs = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln}
    except OSError:
        return
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads64_", "openblas_set_num_threads"):
            f = getattr(lib, sym, None)
            if f is not None:
                f(ctypes.c_int(n))
                break
