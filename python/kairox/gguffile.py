"""Writing GGUF files so that a reader never sees a partial one."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np


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
