"""Writing GGUF files so that a reader never sees a partial one."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np


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
