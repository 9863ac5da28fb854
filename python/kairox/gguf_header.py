"""A fast GGUF header scan: scalar KV values and tensor infos, nothing else.

gguf.GGUFReader parses every KV array into numpy objects; on a model with a 262k-token
vocabulary that takes ~15 s. Fingerprinting and shape checks need only the scalar keys
and the tensor infos, which this scan reads in well under a second by skipping arrays.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> struct format of a scalar (8 = string and 9 = array are special).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF file, or a truncated or malformed header."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int            # ggml type id (gguf.GGMLQuantizationType value)
    ne: tuple[int, ...]     # ggml dims, ne[0] fastest-varying
    offset: int             # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    kv: dict[str, Any]      # scalar and string keys only; arrays are skipped
    tensors: list[TensorInfo]  # in file order
    file_size: int


def tensor_nbytes(shape: tuple[int, ...], qtype: Any) -> int:
    """Bytes of a tensor of `shape` (numpy order: the row last) in ggml type `qtype`
    (gguf.GGMLQuantizationType); ValueError where the row is not whole blocks."""
    import gguf
    n = 1
    for d in gguf.quant_shape_to_byte_shape(shape, qtype):
        n *= d
    return n


def _nbytes(type_id: int, ne: tuple[int, ...], name: str) -> int:
    import gguf
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        return tensor_nbytes(tuple(reversed(ne)) or (1,), qtype)
    except (ValueError, KeyError) as e:
        raise GGUFHeaderError(f"tensor {name}: {e}") from None


def scan_header(path: str | Path) -> GGUFHeader:
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFHeaderError(f"{path} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _scan(path, m, size)


def _scan(path: Path, m: mmap.mmap, size: int) -> GGUFHeader:
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        try:
            (v,) = struct.unpack_from(fmt, m, pos)
        except struct.error:
            raise GGUFHeaderError(f"{path} is truncated (header ends at byte {pos})") from None
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > size:
            raise GGUFHeaderError(f"{path} is truncated (header ends at byte {pos})")
        s = m[pos:pos + n]
        pos += n
        return s.decode("utf-8", errors="replace")

    def skip_array() -> None:
        nonlocal pos
        sub, count = take("<I"), take("<Q")
        if sub in _SCALAR:
            pos += count * struct.calcsize(_SCALAR[sub])
        elif sub == _STRING:
            for _ in range(count):
                n = take("<Q")  # not `pos += take(...)`: that adds to pos as it was before take
                pos += n
        elif sub == _ARRAY:
            for _ in range(count):
                skip_array()
        else:
            raise GGUFHeaderError(f"{path}: unknown GGUF array element type {sub}")
        if pos > size:
            raise GGUFHeaderError(f"{path} is truncated (header ends at byte {pos})")

    if m[:4] != GGUF_MAGIC:
        raise GGUFHeaderError(f"{path} is not a GGUF file (bad magic)")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"{path} has GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = string(), take("<I")
        if vtype in _SCALAR:
            kv[key] = take(_SCALAR[vtype])
        elif vtype == _STRING:
            kv[key] = string()
        elif vtype == _ARRAY:
            skip_array()
        else:
            raise GGUFHeaderError(f"{path}: key {key} has unknown GGUF type {vtype}")
    raw = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("<I")
        ne = tuple(take("<Q") for _ in range(n_dims))
        raw.append((name, take("<I"), ne, take("<Q")))
    align = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise GGUFHeaderError(f"{path} has invalid general.alignment {align!r}")
    data_start = -(-pos // align) * align
    tensors = [TensorInfo(name, t, ne, data_start + off, _nbytes(t, ne, name))
               for name, t, ne, off in raw]
    return GGUFHeader(path, version, kv, tensors, size)
