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
    a type gguf.quants can quantize, or Q4_K / Q6_K through libggml). F16 overflow is an error,
    not a silent inf."""
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
    if qtype in (Q.Q4_K, Q.Q6_K):  # gguf.quants reads K-quants but cannot write them
        from ._native import ggml_quantize
        return ggml_quantize(w32.reshape(-1, w32.shape[-1]), int(qtype))
    return gguf.quants.quantize(w32, qtype)


# The checksums of a checksummed GGUF (a sparse pack): the last tensor, I64 [n_tensors],
# element i < n_tensors - 1 the XXH3-64 (seed 0) of tensor i's data bytes (file order, no
# padding), the last element that of the bytes before the data section (header, metadata,
# tensor infos and their alignment padding). docs/pack-format.md.
CHECKSUM_NAME = "kx_checksum"


def xxh3(data: Any) -> int:
    """XXH3-64 (seed 0) of a buffer (bytes, a contiguous numpy array or a memory map)."""
    import xxhash
    return xxhash.xxh3_64_intdigest(data)


def declare_checksums(writer: Any) -> None:
    """Declare the checksum tensor, after every other tensor of `writer`."""
    n = sum(len(t) for t in writer.tensors) + 1
    writer.add_tensor_info(CHECKSUM_NAME, (n,), np.dtype(np.int64), 8 * n)


def temp_path_for(out: Path) -> Path:
    """A temporary file beside `out` for this process (`.NAME.PID.tmp`). Temporaries for the
    same output whose writer no longer runs (killed mid-write) are removed first, so an
    interrupted conversion leaves nothing behind once it is run again."""
    out = Path(out)
    for old in out.parent.glob(f".{out.name}.*.tmp"):
        pid = old.name[len(out.name) + 2:-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            old.unlink(missing_ok=True)
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def finish_atomically(writer: Any, tmp: Path, out: Path, data: Iterable[np.ndarray]) -> Path:
    """Write header, KV and tensor infos already declared on `writer` (a gguf.GGUFWriter
    opened on `tmp`), then each tensor's data in declaration order, streamed one at a time;
    when the last declared tensor is the checksum tensor (declare_checksums), its data is
    computed here from what was written. The file reaches the disk (fsync) and is renamed
    to `out` only once complete, so a crash leaves either the old `out` or the new one. On
    any error `tmp` is removed."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        summed = bool(writer.tensors[0]) and next(reversed(writer.tensors[0])) == CHECKSUM_NAME
        sums: list[int] = []
        if summed:
            fout.flush()
            head = Path(tmp).read_bytes()
            head += bytes(-len(head) % writer.data_alignment)
        for arr in data:
            if summed:
                sums.append(xxh3(np.ascontiguousarray(arr)))
            writer.write_tensor_data(arr)
        if summed:
            writer.write_tensor_data(np.array(sums + [xxh3(head)], np.uint64).view(np.int64))
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(tmp, out)
        _fsync_dir(Path(out).parent)
    except BaseException:
        writer.close()
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(out)


def _fsync_dir(path: Path) -> None:
    """The rename itself reaches the disk (POSIX: the directory entry is the folder's data)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
