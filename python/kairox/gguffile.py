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
    """fn(i) for each item, in order, computed up to `workers` items ahead on threads.

    A layer's pack data is numpy and BLAS work that releases the GIL (dequantize, sketch,
    transpose, quantize: ~8 s per KB-70B layer on one core of the GPU machine), so layers
    overlap on threads without pickling; at most `workers` results wait in memory.
    workers <= 1: computed one at a time, in this thread."""
    if workers <= 1:
        yield from map(fn, items)
        return
    from concurrent.futures import ThreadPoolExecutor
    from collections import deque
    with ThreadPoolExecutor(workers) as ex:
        pending: deque = deque()
        try:
            for it in items:
                pending.append(ex.submit(fn, it))
                if len(pending) >= workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # an error or a closed generator: queued layers are not started
            for f in pending:
                f.cancel()
