"""Hugging Face checkpoint I/O with numpy only: config.json and safetensors.

The safetensors reader is written by hand rather than taken from the `safetensors`
package because its numpy API cannot represent BF16, the dtype most llama-family
checkpoints are published in. The format is small enough to read directly:

    [8 bytes: little-endian u64 N][N bytes: JSON header][raw tensor data]

where the header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]},
offsets being byte offsets into the raw data section (i.e. relative to 8 + N), plus an
optional "__metadata__" string map. Tensors are row-major, little-endian.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Bytes per element of each dtype we accept. Anything else (I8, F64, FP8, ...) is an
# error, not a silent cast: llama-family checkpoints only ship float weights in these.
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}

# A header above this is not a real checkpoint (real ones are at most a few MiB even
# for thousands of tensors); refusing it early avoids reading gigabytes of garbage.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as described."""


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True)
class HFConfig:
    """The subset of a llama-family `config.json` that the forward pass depends on."""

    architectures: tuple[str, ...]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    torch_dtype: str | None = None
    rope_scaling: dict[str, Any] | None = None
    # Every key of config.json, for the fields this dataclass does not model.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def head_size(self) -> int:
        """Per-head dimension: `head_dim` when given, else hidden_size / heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else "<none>"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = CONFIG_NAME) -> HFConfig:
        def need(key: str) -> Any:
            if d.get(key) is None:
                raise CheckpointError(f"{source}: missing required key {key!r}")
            return d[key]

        def need_int(key: str) -> int:
            v = need(key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"{source}: {key!r} must be a positive integer, got {v!r}")
            return v

        archs = d.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        n_head = need_int("num_attention_heads")
        n_head_kv = d.get("num_key_value_heads")
        if n_head_kv is None:  # plain multi-head attention
            n_head_kv = n_head
        hidden = need_int("hidden_size")
        head_dim = d.get("head_dim")
        if head_dim is None and hidden % n_head != 0:
            raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of "
                                  f"num_attention_heads {n_head} and no head_dim is given")
        if not isinstance(n_head_kv, int) or n_head_kv <= 0 or n_head % n_head_kv != 0:
            raise CheckpointError(f"{source}: num_key_value_heads {n_head_kv!r} must divide "
                                  f"num_attention_heads {n_head}")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            # Newer transformers nest it under rope_parameters; 10000 is Llama's default.
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            architectures=tuple(str(a) for a in archs),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_hidden_layers=need_int("num_hidden_layers"),
            num_attention_heads=n_head,
            num_key_value_heads=int(n_head_kv),
            hidden_act=str(d.get("hidden_act") or d.get("hidden_activation") or "silu"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            vocab_size=need_int("vocab_size"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            head_dim=int(head_dim) if head_dim is not None else None,
            # transformers >= 4.56 writes "dtype"; older versions "torch_dtype"
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            rope_scaling=d.get("rope_scaling") or None,
            raw=dict(d),
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json content as transformers writes it (model_type llama)."""
        d: dict[str, Any] = {
            "architectures": list(self.architectures),
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.head_dim is not None:
            d["head_dim"] = self.head_dim
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling
        return d


def _require_dir(hf_dir: str | Path) -> Path:
    p = Path(hf_dir)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a directory (expected a Hugging Face checkpoint folder)")
    return p


def load_config(hf_dir: str | Path) -> HFConfig:
    """Read `<hf_dir>/config.json`."""
    p = _require_dir(hf_dir) / CONFIG_NAME
    if not p.is_file():
        raise CheckpointError(f"{p.parent} has no {CONFIG_NAME}; is it a Hugging Face checkpoint?")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: cannot parse: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{p}: expected a JSON object")
    return HFConfig.from_dict(d, source=str(p))


# ------------------------------------------------------------------------ safetensors


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str              # safetensors dtype tag: F32, F16 or BF16
    shape: tuple[int, ...]
    path: Path
    offset: int             # absolute byte offset of the first element in `path`
    nbytes: int


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header (reads no tensor data)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: safetensors header length {n} overflows the file "
                                      f"({size} bytes); the file is truncated or not safetensors")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")

    data_start = 8 + n
    data_size = size - data_start
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for {name!r}: {entry!r}") from e
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype} "
                                  f"(supported: {', '.join(_ITEMSIZE)})")
        want = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        if not 0 <= begin <= end or end - begin != want:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs {want} bytes "
                                  f"but its data_offsets are [{begin}, {end}]")
        if end > data_size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {end} of the data section "
                                  f"but the file holds only {data_size}; the file is truncated")
        out[name] = TensorInfo(name, dtype, shape, path, data_start + begin, want)
    return out


def read_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor's values: F32 and F16 as memory-mapped views (no copy), BF16 as float32.

    BF16 is the high half of an IEEE float32, so widening is exact: place the 16 bits
    in the upper half of a uint32 and reinterpret.
    """
    if info.nbytes == 0:
        dt = np.float16 if info.dtype == "F16" else np.float32
        return np.zeros(info.shape, dtype=dt)
    if info.dtype == "F32":
        return np.memmap(info.path, dtype="<f4", mode="r", offset=info.offset, shape=info.shape)
    if info.dtype == "F16":
        return np.memmap(info.path, dtype="<f2", mode="r", offset=info.offset, shape=info.shape)
    if info.dtype == "BF16":
        u16 = np.memmap(info.path, dtype="<u2", mode="r", offset=info.offset, shape=info.shape)
        return (u16.astype(np.uint32) << 16).view(np.float32)
    raise CheckpointError(f"{info.path}: tensor {info.name!r} has unsupported dtype {info.dtype}")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> BF16 bit patterns (uint16), rounding to nearest-even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    # a quiet NaN with the sign kept: truncation could turn a NaN's payload into inf
    rounded = np.where(is_nan, (u >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], dtype: str = "F32",
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write float arrays to one safetensors file, all stored as `dtype` (F32, F16 or BF16)."""
    dtype = dtype.upper()
    if dtype not in _ITEMSIZE:
        raise CheckpointError(f"cannot write dtype {dtype} (supported: {', '.join(_ITEMSIZE)})")
    blobs: list[bytes] = []
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, arr in tensors.items():
        a = np.asarray(arr)
        if not np.issubdtype(a.dtype, np.floating):
            raise CheckpointError(f"tensor {name!r}: expected a float array, got {a.dtype}")
        if dtype == "F32":
            blob = np.ascontiguousarray(a, dtype="<f4").tobytes()
        elif dtype == "F16":
            blob = np.ascontiguousarray(a, dtype="<f2").tobytes()
        else:
            blob = bf16_bits(a).astype("<u2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad the header with spaces so the data section starts 8-byte aligned, which lets
    # readers memory-map F32 tensors with aligned addresses.
    hbytes += b" " * (-len(hbytes) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for blob in blobs:
            f.write(blob)
    return path


# ------------------------------------------------------------------------- checkpoint


class Checkpoint:
    """A Hugging Face checkpoint folder: its config and its tensors by name.

    Reads either a single `model.safetensors` or the shards listed by
    `model.safetensors.index.json`. Tensors are read lazily, one at a time.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = _require_dir(hf_dir)
        self.config = load_config(self.dir)
        self._infos = self._index()

    def _index(self) -> dict[str, TensorInfo]:
        index = self.dir / INDEX_NAME
        single = self.dir / SINGLE_FILE_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: cannot read its weight_map: {e}") from e
            infos: dict[str, TensorInfo] = {}
            for fname in files:
                shard = self.dir / fname
                if not shard.is_file():
                    raise CheckpointError(f"{index} lists shard {fname}, which is missing")
                infos.update(read_safetensors_header(shard))
            missing = [n for n in weight_map if n not in infos]
            if missing:
                raise CheckpointError(f"{index} lists tensor {missing[0]!r} but no shard holds it")
            return infos
        if single.is_file():
            return read_safetensors_header(single)
        if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pth")):
            raise CheckpointError(f"{self.dir} holds only PyTorch pickles (*.bin / *.pth); "
                                  f"kairox reads safetensors only: re-save the model with safe_serialization=True")
        raise CheckpointError(f"{self.dir} has no {SINGLE_FILE_NAME} or {INDEX_NAME}")

    @property
    def names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint") from None

    def tensor(self, name: str) -> np.ndarray:
        """Tensor values as float16 (F16 on disk) or float32 (F32, BF16)."""
        return read_tensor(self.info(name))
