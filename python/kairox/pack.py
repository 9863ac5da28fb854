"""The sparse pack: a sidecar GGUF (`model.kxpack.gguf`) holding what kairox needs to run a
model's FFN sparsely. The user's GGUF is only ever read. The format is specified in
docs/pack-format.md; this module writes identity packs (pack order = original neuron
order), optionally with a predictor per layer, and reads and validates packs of the current version.
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .gguf_header import GGUFHeader, GGUFHeaderError, TensorInfo, scan_header, tensor_nbytes
from .gguffile import (CHECKSUM_NAME, declare_checksums, encode_tensor, finish_atomically, map_ahead,
                       temp_path_for, xxh3)

# The load-aware thresholds' grid (kairox.thresholds): score offsets relative to the layer's
# score spread (the standard deviation of its calibration scores: the sketch predictor
# scores in gate units, fitted ones in logits). Its width and zero are the pack format's.
THR_GRID_REL = np.array([-1.0, -0.5, -0.25, -0.125, -0.0625, 0.0, 0.0625, 0.125, 0.25, 0.5, 1.0], np.float32)
THR_K0 = int(np.flatnonzero(THR_GRID_REL == 0.0)[0])
THR_K = len(THR_GRID_REL)


# `gguf` and `tqdm` are imported inside the functions that use them, as in convert.py.

# version 2 = version 1 + optional ahead predictors and kx.stats; version 3 = version 2 + the
# checksum tensor (required). Packs before version 3 are refused: their data cannot be checked.
PACK_VERSION = 3
READ_VERSIONS = (3,)
PACK_ARCH = "kxpack"
PACK_SUFFIX = ".kxpack.gguf"

BASE_ARCHS = ("llama", "qwen2", "gemma3")
# Activation when the model GGUF has no `<arch>.hidden_activation` (kairox's own key).
DEFAULT_ACTIVATION = {"llama": "silu", "qwen2": "silu", "gemma3": "gelu"}
ACTIVATIONS = ("relu", "silu", "gelu")
DOWN_TYPES = ("f32", "f16", "q8_0", "q4_k", "q6_k")
# storage of kx_pred_a and kx_pred_b; kx_pred_c is always F32. q8_0 stores the rank padded to a
# whole block (pred_rank_stored): zero rows of A and columns of B leave every score as it was.
PRED_TYPES = ("f32", "f16", "q8_0")
# llama-quantize and llama.cpp's --fit select tensors by these substrings; a pack tensor
# carrying one would be quantized or placed as if it were a model weight.
FORBIDDEN_SUBSTRINGS = ("ffn_up", "ffn_gate", "ffn_down")

# Fingerprint: bytes sampled at the start, middle and end of every tensor.
FP_PREFIX = "kxfp1-"
FP_SAMPLE = 4096
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1
_FP_RE = re.compile(r"kxfp1-[0-9a-f]{16}")

# KV keys
K_VERSION = "kx.pack.version"
K_CREATED_BY = "kx.pack.created_by"
K_METHOD = "kx.pack.method"
K_ARCH = "kx.base.architecture"
K_N_LAYER = "kx.base.n_layer"
K_N_EMBD = "kx.base.n_embd"
K_N_FF = "kx.base.n_ff"
K_ACT = "kx.base.activation"
K_FP = "kx.base.fingerprint"
K_GROUP_SIZE = "kx.group_size"
K_STATS = "kx.stats"  # optional (version 2): JSON activation statistics, `kairox stats`
# optional: per layer, the share of its neurons the predicted lists held on calibration
# tokens; the runtime reads it before the model loads and runs a layer whose lists hold more
# than LISTED_GAINS_BELOW dense (with llama.cpp's repacked weights)
K_LISTED = "kx.listed_density"
LISTED_GAINS_BELOW = 0.6  # ggml_ext/llama/kx-pack.h kx_max_density
# ... and, timed on the CPU that runs (kairox.llama.sparse_cost), a layer whose sparse FFN takes
# this share of the dense FFN's time or more runs dense too (ggml_ext/llama/kx-pays.h kx_pays_max_ratio)
TIMED_GAINS_BELOW = 0.95


class PackError(ValueError):
    """A pack that cannot be written or used; the message says why in one sentence."""


# --------------------------------------------------------------------------- naming


def pack_path_for(model_path: str | Path) -> Path:
    """`dir/model.gguf` -> `dir/model.kxpack.gguf` (a name without .gguf gets the suffix appended)."""
    p = Path(model_path)
    stem = p.name[:-len(".gguf")] if p.name.lower().endswith(".gguf") else p.name
    return p.with_name(stem + PACK_SUFFIX)


# A layer's predictor is these three tensors, all or none; so is its ahead predictor
# (version 2), which reads the previous layer's FFN input.
PRED_KEYS = ("pred_a", "pred_b", "pred_c")
AHEAD_KEYS = ("ahead_a", "ahead_b", "ahead_c")


# The load-aware thresholds' calibration (kairox.thresholds): every layer's two tables and
# one grid for all layers, or none of them.
THR_KEYS = ("thr_sel", "thr_err")


def _tensor_names(il: int) -> dict[str, str]:
    b = f"blk.{il}."
    return {k: b + "kx_" + k for k in ("down_t", "perm", "group", "freq", *PRED_KEYS, *AHEAD_KEYS, *THR_KEYS)}


THRESHOLD_NAME = "kx_threshold"
THR_GRID_NAME = "kx_thr_grid"
THR_NORM_NAME = "kx_thr_norm"


# ---------------------------------------------------------------------- fingerprint


def fnv1a64(data: bytes, h: int = _FNV_OFFSET) -> int:
    """64-bit FNV-1a of `data`, continuing from state `h`."""
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _U64
    return h


def sample_ranges(nbytes: int) -> list[tuple[int, int]]:
    """The three [start, end) byte ranges of a tensor's data that the fingerprint hashes.

    Always three, possibly overlapping (a tensor under 4 KiB is hashed three times), so
    the C++ side needs no special cases.
    """
    head = (0, min(FP_SAMPLE, nbytes))
    mid_start = (nbytes // 2) // FP_SAMPLE * FP_SAMPLE  # <= nbytes // 2, inside the tensor
    mid = (mid_start, min(mid_start + FP_SAMPLE, nbytes))
    tail = (nbytes - min(FP_SAMPLE, nbytes), nbytes)
    return [head, mid, tail]


def ggml_dims(ne: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """ne without trailing 1s (at least one dimension): ggml_n_dims, which is all a ggml
    reader knows (gguf_init_from_file does not keep the n_dims stored in the file)."""
    ne = tuple(int(d) for d in ne)
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return ne[:max(n, 1)]


def _fingerprint_header(hdr: GGUFHeader) -> str:
    h = _FNV_OFFSET
    with open(hdr.path, "rb") as f:
        for t in hdr.tensors:
            h = fnv1a64(t.name.encode("utf-8") + b"\0", h)
            h = fnv1a64(struct.pack("<I", t.type_id), h)
            ne = ggml_dims(t.ne)
            h = fnv1a64(struct.pack(f"<{1 + len(ne)}Q", len(ne), *ne), h)
            if t.offset + t.nbytes > hdr.file_size:
                raise PackError(f"{hdr.path} is truncated: tensor {t.name} ends past the end of the file")
            for start, end in sample_ranges(t.nbytes):
                f.seek(t.offset + start)
                h = fnv1a64(f.read(end - start), h)
    return f"{FP_PREFIX}{h:016x}"


def fingerprint(model_path: str | Path) -> str:
    """The model's fingerprint (docs/pack-format.md): "kxfp1-" + 16 hex digits."""
    return _fingerprint_header(_scan_model(Path(model_path)))


# ------------------------------------------------------------------------- the model


def predictor_scores(a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray) -> np.ndarray:
    """B (A x) + c for an FFN input x [n_embd] or a batch [n_tokens, n_embd] (float32).

    A neuron is predicted active where its score is > 0.
    """
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    x32 = np.asarray(x, np.float32)
    if x32.shape[-1] != a32.shape[1]:
        raise ValueError(f"x has {x32.shape[-1]} channels but the predictor reads {a32.shape[1]}")
    return (x32 @ a32.T) @ b32.T + np.asarray(c, np.float32)


@dataclass(frozen=True)
class BaseModel:
    """What a pack records about the model it was made for."""
    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    activation: str


def _scan_model(path: Path) -> GGUFHeader:
    if not path.is_file():
        raise PackError(f"model {path} does not exist")
    try:
        return scan_header(path)
    except GGUFHeaderError as e:
        raise PackError(str(e)) from e


def _open_gguf(path: Path) -> Any:
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises assorted errors on bad or short files
        raise PackError(f"{path} is not a readable GGUF file; it may be truncated or corrupt ({e})") from e


def _kv(reader: Any, key: str) -> Any:
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _base_model(hdr: GGUFHeader) -> BaseModel:
    path, arch = hdr.path, hdr.kv.get("general.architecture")
    if arch not in BASE_ARCHS:
        raise PackError(f"{path} (architecture {arch!r}) has no dense FFN kairox can pack "
                        f"(supported: {', '.join(BASE_ARCHS)})")
    n_layer = hdr.kv.get(f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise PackError(f"{path} has no valid {arch}.block_count")
    tensors = {t.name: t for t in hdr.tensors}
    n_embd = n_ff = 0
    for il in range(n_layer):
        t = tensors.get(f"blk.{il}.ffn_down.weight")
        if t is None or len(t.ne) != 2:
            raise PackError(f"{path} has no dense FFN in layer {il} (no 2-D blk.{il}.ffn_down.weight)")
        ff, embd = t.ne  # ggml ne = {n_ff, n_embd}
        if il == 0:
            n_embd, n_ff = embd, ff
        elif (embd, ff) != (n_embd, n_ff):
            raise PackError(f"{path}: layer {il} has FFN shape {ff}x{embd} but layer 0 has "
                            f"{n_ff}x{n_embd}; layers of different FFN widths are not supported")
    act = hdr.kv.get(f"{arch}.hidden_activation") or DEFAULT_ACTIVATION[arch]
    if act not in ACTIVATIONS:
        raise PackError(f"{path} has FFN activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    return BaseModel(arch, n_layer, n_embd, n_ff, act)


# ---------------------------------------------------------------------- the pack


@dataclass
class PackLayer:
    """One layer's pack tensors. Pack position p holds original neuron perm[p]."""
    down_t_raw: np.ndarray          # as stored: [n_ff, n_embd] (F32/F16) or Q8_0 bytes
    down_type: str                  # f32 | f16 | q8_0
    perm: np.ndarray                # int32 [n_ff], a permutation of 0..n_ff-1
    group: np.ndarray               # int32 [n_ff], group id of each pack position
    freq: np.ndarray                # float32 [n_ff], indexed by ORIGINAL neuron id, 0..1
    pred_c: np.ndarray | None = None  # float32 [n_ff], indexed by ORIGINAL neuron id
    # version 2: the ahead predictor's bias, reading the previous layer's FFN input
    ahead_c: np.ndarray | None = None
    # the load-aware thresholds' tables, float32 [n_ff, K] by neuron id (kairox.thresholds)
    thr_sel: np.ndarray | None = None
    thr_err: np.ndarray | None = None
    # the predictors' A [rank, n_embd] and B [n_ff, rank] as stored, by key (pred_a, pred_b,
    # ahead_a, ahead_b): (data, type name); read through `factor` or the properties below
    stored: dict[str, tuple[Any, str]] = field(default_factory=dict, repr=False)
    _dequantized: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def factor(self, key: str) -> np.ndarray | None:
        """Predictor factor `key` (None where the layer has none): F32 or F16 as stored
        (memory-mapped), Q8_0 dequantized to float32 once, when first asked for (read eagerly,
        a 70B pack's Q8_0 predictors would take ~12 GB as float32)."""
        if key not in self.stored:
            return None
        data, type_name = self.stored[key]
        if type_name != "q8_0":
            return data
        if key not in self._dequantized:
            import gguf
            q = gguf.GGMLQuantizationType.Q8_0
            self._dequantized[key] = np.asarray(gguf.quants.dequantize(data, q), np.float32)
        return self._dequantized[key]

    pred_a = property(lambda self: self.factor("pred_a"))
    pred_b = property(lambda self: self.factor("pred_b"))
    ahead_a = property(lambda self: self.factor("ahead_a"))
    ahead_b = property(lambda self: self.factor("ahead_b"))

    @property
    def has_predictor(self) -> bool:
        return "pred_a" in self.stored  # asked without dequantizing a Q8_0 factor

    def predictor_scores(self, x: np.ndarray) -> np.ndarray:
        """pred_b @ (pred_a @ x) + pred_c for FFN inputs x [.., n_embd]: one score per
        original neuron id, > 0 where the neuron is predicted active."""
        if not self.has_predictor:
            raise PackError("this pack layer has no predictor")
        return predictor_scores(self.pred_a, self.pred_b, self.pred_c, x)

    def down_t(self) -> np.ndarray:
        """The down projection, float32 [n_ff, n_embd], one row per neuron in pack order."""
        import gguf
        q = gguf.GGMLQuantizationType[self.down_type.upper()]
        return np.asarray(gguf.quants.dequantize(self.down_t_raw, q), dtype=np.float32)


@dataclass
class Pack:
    path: Path
    version: int
    created_by: str
    method: dict[str, Any]
    base: BaseModel
    fingerprint: str
    group_size: int
    layers: list[PackLayer]
    threshold: np.ndarray = field(repr=False)   # float32 [n_layer]
    stats: str | None = field(default=None, repr=False)  # kx.stats JSON (version 2)
    thr_grid: np.ndarray | None = field(default=None, repr=False)  # float32 [n_layer, K] (kairox.thresholds)
    thr_norm: np.ndarray | None = field(default=None, repr=False)  # float32 [n_layer]: mean FFN output norm
    listed_density: list[float] | None = None  # kx.listed_density (optional)

    @property
    def n_groups(self) -> int:
        return -(-self.base.n_ff // self.group_size)


# -------------------------------------------------------------------------- writing


def _available_memory() -> int:
    """Bytes of memory available to new allocations (MemAvailable), 8 GiB when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


def _read_dequantized(path: Path, t: TensorInfo) -> np.ndarray:
    """A tensor of the model as float32, in numpy shape (ne reversed: [ne[1], ne[0]] for 2-D)."""
    import gguf
    qtype = gguf.GGMLQuantizationType(t.type_id)
    shape = tuple(reversed(t.ne))
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    rows = np.memmap(path, dtype=np.uint8, mode="r", offset=t.offset,
                     shape=(n_rows, t.nbytes // n_rows))  # one row of bytes per ne[0] values
    try:
        w = gguf.quants.dequantize(rows, qtype)
    except NotImplementedError as e:
        raise PackError(f"{t.name} has type {qtype.name}, which kairox cannot dequantize") from e
    return np.asarray(w, dtype=np.float32).reshape(shape)


def inspect_model(model_path: str | Path) -> tuple[GGUFHeader, BaseModel]:
    """A model GGUF's header and the FFN facts a pack records; PackError if kairox cannot pack it."""
    hdr = _scan_model(Path(model_path))
    return hdr, _base_model(hdr)


def read_model_tensor(hdr: GGUFHeader, name: str) -> np.ndarray:
    """One tensor of the model `hdr` was scanned from, float32 in numpy shape (dequantized)."""
    t = next((t for t in hdr.tensors if t.name == name), None)
    if t is None:
        raise PackError(f"{hdr.path} has no tensor {name}")
    return _read_dequantized(hdr.path, t)


PredictorFactors = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class PackPredictor:
    """Where write_pack gets each layer's predictor (A [rank, n_embd], B [n_ff, rank],
    c [n_ff]): `layer(il)` is called while layer il is written, so only one layer's
    factors are ever in memory. A and B are stored as `dtype` (f32 or f16), c as F32.
    `info` (e.g. {"kind": "sketch", "margin": 3.0}) is recorded under "predictor" in
    kx.pack.method, together with the rank and type."""
    rank: int
    layer: Callable[[int], PredictorFactors]
    dtype: str = "f32"
    info: dict[str, Any] = field(default_factory=dict)


def pred_rank_stored(rank: int, dtype: str) -> int:
    """The rank a predictor's tensors hold: a q8_0 B's rows are whole 32-value blocks."""
    if dtype != "q8_0":
        return rank
    import gguf
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    return -(-rank // block) * block


def _pad_rank(a: np.ndarray, b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A [r, n_embd] and B [n_ff, r] with zero rows / columns up to `rank`: the scores B (A x)
    are unchanged (each extra term is an exact 0)."""
    extra = rank - a.shape[0]
    if extra == 0:
        return a, b
    return np.pad(a, ((0, extra), (0, 0))), np.pad(b, ((0, 0), (0, extra)))


def _check_factors(il: int, f: Any, rank: int, n_embd: int, n_ff: int) -> PredictorFactors:
    """The predictor of layer il as float32 arrays, or PackError naming what is wrong."""
    if not (isinstance(f, (tuple, list)) and len(f) == 3):
        raise PackError(f"the predictor of layer {il} must be a tuple (A, B, c)")
    out = []
    for what, arr, shape in zip("ABc", f, ((rank, n_embd), (n_ff, rank), (n_ff,))):
        arr = np.asarray(arr)
        if arr.shape != shape:
            raise PackError(f"predictor {what} of layer {il} has shape {arr.shape}, expected {shape}")
        arr = arr.astype(np.float32, copy=False)
        if not np.all(np.isfinite(arr)):
            raise PackError(f"predictor {what} of layer {il} has non-finite values")
        out.append(arr)
    return out[0], out[1], out[2]


@dataclass(frozen=True)
class PackLayout:
    """Neuron order, grouping and statistics from profiling (`kairox prepare`):
    `layer(il)` gives (perm, group, freq) of layer il as the pack stores them (perm[p] is
    the neuron at pack position p, group[p] its group id, freq indexed by neuron id), and
    `threshold` the per-layer activation threshold."""
    layer: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]
    threshold: np.ndarray


def _check_layout(il: int, f: Any, n_ff: int, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    perm, group, freq = (np.asarray(v) for v in f)
    if perm.shape != (n_ff,) or not np.array_equal(np.sort(perm), np.arange(n_ff)):
        raise PackError(f"layout of layer {il}: perm is not a permutation of 0..{n_ff - 1}")
    n_groups = -(-n_ff // group_size)
    if group.shape != (n_ff,) or group.min() < 0 or group.max() >= n_groups or np.any(np.diff(group) < 0):
        raise PackError(f"layout of layer {il}: group ids must be non-decreasing in 0..{n_groups - 1}")
    if freq.shape != (n_ff,) or not np.all((freq >= 0) & (freq <= 1)):
        raise PackError(f"layout of layer {il}: freq must be {n_ff} values in [0, 1]")
    return perm.astype(np.int32), group.astype(np.int32), freq.astype(np.float32)


def _check_thr_grid(grid: np.ndarray, n_layer: int, what: str) -> np.ndarray:
    if (grid.shape != (n_layer, THR_K) or not np.all(np.isfinite(grid)) or np.any(grid[:, THR_K0] != 0)
            or np.any(np.diff(grid, axis=1) <= 0)):
        raise PackError(f"{what} must be [{n_layer}, {THR_K}] ascending finite offsets, 0 at position {THR_K0}")
    return grid


def _check_thr_table(tab: np.ndarray, n_ff: int, what: str) -> np.ndarray:
    if tab.shape != (n_ff, THR_K) or not np.all(np.isfinite(tab)) or np.any(tab < 0):
        raise PackError(f"the threshold table of {what} must be [{n_ff}, {THR_K}] finite values >= 0")
    return tab


def default_pred_type(hdr: GGUFHeader) -> str:
    """The predictor's storage for a model: f32 for a model whose ffn_gate is F32, f16 for
    F16/BF16, q8_0 for a quantized one. Why q8_0 there: on a 4-bit model an f16 predictor
    reads more bytes than the sparse FFN it steers (KB-350M Q4_K_M: 0.92 MB against ~0.55 MB
    a layer), and its 8-bit rounding is far under the predictor's own error."""
    import gguf
    Q = gguf.GGMLQuantizationType
    q = Q(next(t for t in hdr.tensors if t.name == "blk.0.ffn_gate.weight").type_id)
    return "f32" if q == Q.F32 else "f16" if q in (Q.F16, Q.BF16) else "q8_0"


def default_down_type(hdr: GGUFHeader) -> str:
    """The pack's down-row type for a model: f32 for a model whose ffn_down is F32 (keep it
    exact), f16 for F16/BF16, q4_k for a 2-4-bit K-quant (ffn_gate Q2_K, Q3_K or Q4_K: Q4_K_M
    and its kin) whose n_embd splits into 256-value super-blocks, q8_0 for other quantized ones
    (Q4_0, Q5_K, Q6_K, ...) whose rows split into 32-value blocks. The pack's rows are the
    model's down weights transposed and requantized per neuron. Why q8_0: for weights of at most
    8 bits its rounding (1/254 of a block's largest value) is far under the model's own, in 53%
    of f16's bytes. Why q4_k for 4-bit models: their own rounding is already 4-bit, and a row
    takes 53% of q8_0's bytes, so the pack shrinks by 37% and the GPU slots hold more neurons;
    on the H200 (KB-7B Q4_K_M, 3 GiB) it decoded 171.8 tok/s against q8_0's 166.9
    (bench/results/KB-7B-q4_k_m-h200/)."""
    import gguf
    Q = gguf.GGMLQuantizationType
    t = next(t for t in hdr.tensors if t.name == "blk.0.ffn_down.weight")
    q = Q(t.type_id)
    if q == Q.F32:
        return "f32"
    if q in (Q.F16, Q.BF16):
        return "f16"
    n_embd = int(t.ne[1]) if len(t.ne) > 1 else 0  # ffn_down: ne = (n_ff, n_embd)
    gate = next((t for t in hdr.tensors if t.name == "blk.0.ffn_gate.weight"), None)
    if (gate is not None and Q(gate.type_id) in (Q.Q2_K, Q.Q3_K, Q.Q4_K)
            and n_embd % gguf.GGML_QUANT_SIZES[Q.Q4_K][0] == 0):
        return "q4_k"
    return "q8_0" if n_embd % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0 else "f16"


def write_pack(model_path: str | Path, out_path: str | Path | None = None, *, group_size: int = 32,
               down_type: str = "f32", method: dict[str, Any] | None = None,
               predictor: PackPredictor | None = None, ahead: PackPredictor | None = None,
               layout: PackLayout | None = None, stats: str | None = None,
               thresholds: Any = None, listed_density: Any = None, quiet: bool = False,
               workers: int | None = None) -> Path:
    """Write a pack for the model at `model_path`; returns the pack's path.

    Without `layout` the pack is an identity pack (original neuron order, groups of
    consecutive neurons, frequencies unknown, threshold 0). With `predictor` (`ahead`),
    every layer also gets kx_pred_* (kx_ahead_*) from its `layer(il)`; `stats` is stored
    as kx.stats; `thresholds` (kairox.thresholds.ThresholdTables, needs `predictor`) the
    load-aware thresholds' calibration; `listed_density` (n_layer values in [0, 1]) the share of
    each layer's neurons its predicted lists held on calibration tokens. The model is only read. The pack is streamed, one layer at a time, to a
    temporary file and renamed into place when complete. Layers are computed `workers`
    at a time in forked processes (None: from the model's size, the cores and the free
    memory), written in order.
    """
    import gguf
    from tqdm import tqdm


    model_path = Path(model_path)
    out = Path(out_path) if out_path is not None else pack_path_for(model_path)
    down_type = down_type.lower()
    if down_type not in DOWN_TYPES:
        raise PackError(f"unsupported down_type {down_type!r} (supported: {', '.join(DOWN_TYPES)})")
    if not isinstance(group_size, int) or group_size < 1:
        raise PackError(f"group_size must be a positive integer, not {group_size!r}")
    method = {"kind": "identity"} if method is None else method
    if not isinstance(method, dict):
        raise PackError("method must be a dict (it is stored as a JSON object)")
    trios = [(keys, pr) for keys, pr in ((PRED_KEYS, predictor), (AHEAD_KEYS, ahead)) if pr is not None]
    for keys, pr in trios:
        if pr.dtype not in PRED_TYPES:
            raise PackError(f"unsupported predictor type {pr.dtype!r} "
                            f"(supported: {', '.join(PRED_TYPES)})")
        if isinstance(pr.rank, bool) or not isinstance(pr.rank, int) or pr.rank < 1:
            raise PackError(f"predictor rank must be a positive integer, not {pr.rank!r}")
        what = "predictor" if keys is PRED_KEYS else "ahead"
        if what not in method:  # a caller's own description wins
            method = {**method, what: {**pr.info, "rank": pred_rank_stored(pr.rank, pr.dtype), "type": pr.dtype}}
    if stats is not None and not isinstance(stats, str):
        raise PackError("stats must be a JSON string")
    if thresholds is not None and predictor is None:
        raise PackError("threshold tables calibrate a predictor: give the predictor too")
    try:
        method_json = json.dumps(method, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise PackError(f"method is not JSON-serializable ({e})") from e

    hdr = _scan_model(model_path)
    base = _base_model(hdr)
    for _, pr in trios:
        if pr.rank > min(base.n_ff, base.n_embd):
            raise PackError(f"predictor rank {pr.rank} exceeds min(n_ff, n_embd) = "
                            f"{min(base.n_ff, base.n_embd)} of {model_path}")
    if listed_density is not None:
        ld = np.asarray(listed_density, np.float64)
        if ld.shape != (base.n_layer,) or not np.all((ld >= 0) & (ld <= 1)):
            raise PackError(f"listed_density must be {base.n_layer} values in [0, 1]")
    if layout is not None:
        thr = np.asarray(layout.threshold, np.float32)
        if thr.shape != (base.n_layer,) or not np.all(np.isfinite(thr)) or np.any(thr < 0):
            raise PackError(f"layout threshold must be {base.n_layer} finite values >= 0")
    qblock = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[down_type.upper()]][0]
    if base.n_embd % qblock:
        # each neuron's row is quantized on its own, so it must split into whole blocks
        raise PackError(f"down_type {down_type} needs n_embd to be a multiple of {qblock}, "
                        f"but {model_path} has n_embd = {base.n_embd}; use q8_0, f16 or f32")
    if out.exists() and out.resolve() == model_path.resolve():
        raise PackError(f"the pack path {out} is the model itself; the model is never overwritten")
    if not out.parent.is_dir():
        raise PackError(f"output directory {out.parent} does not exist")
    fp = _fingerprint_header(hdr)
    tensors = {t.name: t for t in hdr.tensors}

    tmp = temp_path_for(out)
    w = gguf.GGUFWriter(tmp, PACK_ARCH)  # writes general.architecture = kxpack
    w.add_uint32(K_VERSION, PACK_VERSION)
    w.add_string(K_CREATED_BY, f"kairox {__version__}")
    w.add_string(K_METHOD, method_json)
    w.add_string(K_ARCH, base.architecture)
    w.add_uint32(K_N_LAYER, base.n_layer)
    w.add_uint32(K_N_EMBD, base.n_embd)
    w.add_uint32(K_N_FF, base.n_ff)
    w.add_string(K_ACT, base.activation)
    w.add_string(K_FP, fp)
    w.add_uint32(K_GROUP_SIZE, group_size)
    if stats is not None:
        w.add_string(K_STATS, stats)
    if listed_density is not None:
        w.add_array(K_LISTED, [float(v) for v in listed_density])

    Q = gguf.GGMLQuantizationType
    dq = Q[down_type.upper()]
    down_shape = (base.n_ff, base.n_embd)
    down_nbytes = tensor_nbytes(down_shape, dq)
    vec = base.n_ff * 4  # I32 / F32 vectors of n_ff entries
    for il in range(base.n_layer):
        n = _tensor_names(il)
        w.add_tensor_info(n["down_t"], down_shape, np.dtype(np.float32), down_nbytes, raw_dtype=dq)
        w.add_tensor_info(n["perm"], (base.n_ff,), np.dtype(np.int32), vec)
        w.add_tensor_info(n["group"], (base.n_ff,), np.dtype(np.int32), vec)
        w.add_tensor_info(n["freq"], (base.n_ff,), np.dtype(np.float32), vec)
        for keys, pr in trios:
            pq = Q[pr.dtype.upper()]
            pblock, psize = gguf.GGML_QUANT_SIZES[pq]
            rank = pred_rank_stored(pr.rank, pr.dtype)
            w.add_tensor_info(n[keys[0]], (rank, base.n_embd), np.dtype(np.float32),
                              rank * base.n_embd // pblock * psize, raw_dtype=pq)
            w.add_tensor_info(n[keys[1]], (base.n_ff, rank), np.dtype(np.float32),
                              base.n_ff * rank // pblock * psize, raw_dtype=pq)
            w.add_tensor_info(n[keys[2]], (base.n_ff,), np.dtype(np.float32), vec)
        if thresholds is not None:
            for k in THR_KEYS:
                w.add_tensor_info(n[k], (base.n_ff, THR_K), np.dtype(np.float32), base.n_ff * THR_K * 4)
    w.add_tensor_info(THRESHOLD_NAME, (base.n_layer,), np.dtype(np.float32), base.n_layer * 4)
    if thresholds is not None:
        grid = np.asarray(thresholds.grid, np.float32)
        _check_thr_grid(grid, base.n_layer, "threshold grid")
        w.add_tensor_info(THR_GRID_NAME, (base.n_layer, THR_K), np.dtype(np.float32), grid.nbytes)
        norm = np.asarray(thresholds.norm, np.float32)
        if norm.shape != (base.n_layer,) or not np.all(np.isfinite(norm)) or np.any(norm < 0):
            raise PackError(f"the threshold calibration's norms must be {base.n_layer} finite values >= 0")
        w.add_tensor_info(THR_NORM_NAME, (base.n_layer,), np.dtype(np.float32), norm.nbytes)

    ids = np.arange(base.n_ff, dtype=np.int32)

    def layer_data(il: int) -> list[np.ndarray]:
        """Layer il's tensors, in declaration order."""
        if layout is None:  # identity order and groups, frequency unknown
            perm, group, freq = ids, ids // np.int32(group_size), np.ones(base.n_ff, np.float32)
        else:
            perm, group, freq = _check_layout(il, layout.layer(il), base.n_ff, group_size)
        t = tensors[f"blk.{il}.ffn_down.weight"]
        down = _read_dequantized(model_path, t)        # [n_embd, n_ff]
        try:  # one row per neuron, in pack order
            arrs = [encode_tensor(down.T[perm] if layout is not None else down.T, dq, t.name)]
        except ValueError as e:
            raise PackError(str(e)) from None
        del down
        arrs += [perm, group, freq]
        n = _tensor_names(il)
        for keys, pr in trios:
            a, b, c = _check_factors(il, pr.layer(il), pr.rank, base.n_embd, base.n_ff)
            a, b = _pad_rank(a, b, pred_rank_stored(pr.rank, pr.dtype))
            for name, f in ((keys[0], a), (keys[1], b)):
                try:
                    arrs.append(encode_tensor(f, Q[pr.dtype.upper()], n[name]))
                except ValueError:
                    raise PackError(f"{n[name]} has values too large for {pr.dtype} (float16's range is "
                                    f"65504); store the predictor as f32") from None
            arrs.append(c)
        if thresholds is not None:
            for k, tab in zip(THR_KEYS, thresholds.layer(il)):
                arrs.append(_check_thr_table(np.asarray(tab, np.float32), base.n_ff, f"layer {il}: {k}"))
        return arrs

    if workers is None:
        # ~5 float32 copies of one FFN matrix per layer in flight (KB-70B: ~5 GB), so
        # processes scale with the cores (2 BLAS threads each) and stop where memory would
        # run short; small models are packed in this process (forking costs more)
        per_layer = 5 * 4 * base.n_ff * base.n_embd
        workers = (1 if base.n_ff * base.n_embd * base.n_layer < 2**30 else
                   max(1, min((os.cpu_count() or 1) // 2, 8, _available_memory() // (2 * per_layer))))

    def data():
        layers = map_ahead(layer_data, range(base.n_layer), workers)
        for arrs in tqdm(layers, total=base.n_layer, desc=f"pack {out.name}", unit="layer",
                         disable=quiet, file=sys.stderr):
            yield from arrs
        # threshold: fire when |act| > threshold (0 without a layout)
        yield (np.zeros(base.n_layer, np.float32) if layout is None
               else np.asarray(layout.threshold, np.float32))
        if thresholds is not None:
            yield np.asarray(thresholds.grid, np.float32)
            yield np.asarray(thresholds.norm, np.float32)

    declare_checksums(w)
    return finish_atomically(w, tmp, out, data())


# -------------------------------------------------------------------------- reading


def _check_sums(r: Any, path: Path) -> None:
    """Every tensor's bytes and the header against the checksum tensor (gguffile.CHECKSUM_NAME)."""
    import gguf
    ts = r.tensors
    if not ts or ts[-1].name != CHECKSUM_NAME:
        raise PackError(f"pack {path} lacks its checksum tensor {CHECKSUM_NAME} (the last tensor); "
                        f"rebuild the pack with this kairox")
    t = ts[-1]
    if t.tensor_type != gguf.GGMLQuantizationType.I64 or [int(d) for d in t.shape] != [len(ts)]:
        raise PackError(f"pack {path}: {CHECKSUM_NAME} must be I64 [{len(ts)}], one value per tensor and "
                        f"one for the header")
    sums = np.asarray(t.data).view(np.uint64)
    head = r.data[:ts[0].data_offset]
    if xxh3(head) != int(sums[-1]):
        raise PackError(f"pack {path}: its header (metadata and tensor list) does not match its checksum; "
                        f"the file is damaged: rebuild or copy the pack again")
    for i, ti in enumerate(ts[:-1]):
        if xxh3(r.data[ti.data_offset:ti.data_offset + ti.n_bytes]) != int(sums[i]):
            raise PackError(f"pack {path}: tensor {ti.name} does not match its checksum; "
                            f"the file is damaged: rebuild or copy the pack again")


# Where a quantized block keeps its f16 scales (byte offsets in ggml's block_*): the quants
# themselves are integers, finite by construction
_BLOCK_SCALES = {"q8_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}


def first_nonfinite_row(data: np.ndarray, type_name: str, n_cols: int) -> int:
    """The first row (of n_cols values) holding an inf or NaN, -1 when all are finite. A
    quantized row is checked through its blocks' f16 scales (_BLOCK_SCALES)."""
    raw = np.asarray(data)
    if type_name in _BLOCK_SCALES:
        import gguf
        per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
        blocks = raw.view(np.uint8).reshape(-1, size)
        ok = np.ones(blocks.shape[0], bool)
        for o in _BLOCK_SCALES[type_name]:
            ok &= np.isfinite(blocks[:, o:o + 2].copy().view(np.float16)[:, 0])
        bad = ~ok.reshape(-1, n_cols // per).all(axis=1)
    else:
        bad = ~np.isfinite(raw.reshape(-1, n_cols)).all(axis=1)
    rows = np.flatnonzero(bad)
    return int(rows[0]) if rows.size else -1


def _req(reader: Any, path: Path, key: str, kind: type) -> Any:
    import gguf
    f = reader.get_field(key)
    if f is None:
        raise PackError(f"pack {path} lacks the key {key}")
    want = {int: gguf.GGUFValueType.UINT32, str: gguf.GGUFValueType.STRING}[kind]
    if f.types != [want]:
        raise PackError(f"pack {path}: {key} has type {f.types[0].name}, expected {want.name}")
    return f.contents()


def _check_tensor(t: Any, path: Path, types: tuple[str, ...], ne: tuple[int, ...]) -> None:
    got = tuple(int(d) for d in t.shape)
    if got != ne:
        raise PackError(f"pack {path}: {t.name} has shape (ggml ne) {list(got)}, expected {list(ne)}")
    if t.tensor_type.name not in types:
        raise PackError(f"pack {path}: {t.name} has type {t.tensor_type.name}, "
                        f"expected {' or '.join(types)}")


def read_pack(pack_path: str | Path, model_path: str | Path | None = None) -> Pack:
    """Read and validate a pack; with `model_path`, also check it was made for that model.

    Tensor data is memory-mapped, not loaded. Any violation of docs/pack-format.md raises
    PackError.
    """
    path = Path(pack_path)
    if not path.is_file():
        raise PackError(f"no pack at {path}")
    r = _open_gguf(path)
    arch = _kv(r, "general.architecture")
    if arch != PACK_ARCH:
        raise PackError(f"{path} is not a kairox pack (general.architecture is {arch!r}, "
                        f"not {PACK_ARCH!r})")
    version = _req(r, path, K_VERSION, int)
    if version not in READ_VERSIONS:
        raise PackError(f"pack {path} has format version {version}, but this kairox reads "
                        f"versions {', '.join(map(str, READ_VERSIONS))}; rebuild the pack with this kairox")
    _check_sums(r, path)
    stats = _req(r, path, K_STATS, str) if r.get_field(K_STATS) is not None else None
    created_by = _req(r, path, K_CREATED_BY, str)
    try:
        method = json.loads(_req(r, path, K_METHOD, str))
    except json.JSONDecodeError as e:
        raise PackError(f"pack {path}: {K_METHOD} is not valid JSON ({e})") from e
    if not isinstance(method, dict):
        raise PackError(f"pack {path}: {K_METHOD} is not a JSON object")
    base = BaseModel(_req(r, path, K_ARCH, str), _req(r, path, K_N_LAYER, int),
                     _req(r, path, K_N_EMBD, int), _req(r, path, K_N_FF, int),
                     _req(r, path, K_ACT, str))
    if min(base.n_layer, base.n_embd, base.n_ff) < 1:
        raise PackError(f"pack {path} records an empty model ({base})")
    if base.activation not in ACTIVATIONS:
        raise PackError(f"pack {path} records activation {base.activation!r} "
                        f"(supported: {', '.join(ACTIVATIONS)})")
    fp = _req(r, path, K_FP, str)
    if not _FP_RE.fullmatch(fp):
        raise PackError(f"pack {path} has a malformed fingerprint {fp!r}")
    group_size = _req(r, path, K_GROUP_SIZE, int)
    if group_size < 1:
        raise PackError(f"pack {path} has group size 0")

    if model_path is not None:
        mpath = Path(model_path)
        mhdr = _scan_model(mpath)
        mfp = _fingerprint_header(mhdr)
        if mfp != fp:
            raise PackError(f"pack {path} was made for a different model (pack fingerprint {fp}, "
                            f"{mpath.name} has {mfp}); rebuild the pack for this model")
        mbase = _base_model(mhdr)
        if mbase != base:
            raise PackError(f"pack {path} records {base} but {mpath.name} is {mbase}")

    tensors = {t.name: t for t in r.tensors}
    bad = [n for n in tensors if any(s in n for s in FORBIDDEN_SUBSTRINGS)]
    if bad:
        raise PackError(f"pack {path} holds tensor {bad[0]!r}, whose name llama.cpp tools "
                        f"would take for a model weight")
    expected = {THRESHOLD_NAME, CHECKSUM_NAME}
    n_ff, n_embd = base.n_ff, base.n_embd
    n_groups = -(-n_ff // group_size)
    ids = np.arange(n_ff)
    layers: list[PackLayer] = []
    for il in range(base.n_layer):
        names = _tensor_names(il)
        required = ("down_t", "perm", "group", "freq")
        has_pred: list[str] = []
        for keys in (PRED_KEYS, AHEAD_KEYS):
            have = [k for k in keys if names[k] in tensors]
            if have and len(have) < len(keys):
                missing = next(names[k] for k in keys if k not in have)
                raise PackError(f"pack {path}: layer {il} has {names[have[0]]} but lacks {missing} "
                                f"(a predictor is its _a, _b and _c tensors together)")
            has_pred += have
        for k in (*required, *has_pred):
            if names[k] not in tensors:
                raise PackError(f"pack {path} lacks the tensor {names[k]}")
            expected.add(names[k])
        t = {k: tensors[names[k]] for k in (*required, *has_pred)}
        _check_tensor(t["down_t"], path, tuple(d.upper() for d in DOWN_TYPES), (n_embd, n_ff))
        _check_tensor(t["perm"], path, ("I32",), (n_ff,))
        _check_tensor(t["group"], path, ("I32",), (n_ff,))
        _check_tensor(t["freq"], path, ("F32",), (n_ff,))
        row = first_nonfinite_row(t["down_t"].data, t["down_t"].tensor_type.name.lower(), n_embd)
        if row >= 0:
            raise PackError(f"pack {path}: {names['down_t']} has non-finite values (row {row})")
        perm = np.asarray(t["perm"].data)
        if not np.array_equal(np.sort(perm), ids):
            raise PackError(f"pack {path}: {names['perm']} is not a permutation of 0..{n_ff - 1}")
        group = np.asarray(t["group"].data)
        if group.min() < 0 or group.max() >= n_groups:
            raise PackError(f"pack {path}: {names['group']} has group ids outside 0..{n_groups - 1} "
                            f"(n_ff {n_ff}, group size {group_size})")
        if np.any(np.diff(group) < 0):
            raise PackError(f"pack {path}: {names['group']} is not non-decreasing "
                            f"(a group must be a contiguous run of pack rows)")
        freq = np.asarray(t["freq"].data)
        if not np.all((freq >= 0) & (freq <= 1)):  # also rejects NaN
            raise PackError(f"pack {path}: {names['freq']} has values outside [0, 1]")
        factors: dict[str, Any] = {}
        stored: dict[str, tuple[Any, str]] = {}
        for keys in (PRED_KEYS, AHEAD_KEYS):
            if keys[0] not in has_pred:
                continue
            ka, kb, kc = keys
            rank = int(t[ka].shape[1]) if len(t[ka].shape) == 2 else 0
            if rank < 1:
                raise PackError(f"pack {path}: {names[ka]} must be 2-D [rank, n_embd]")
            _check_tensor(t[ka], path, ("F32", "F16", "Q8_0"), (n_embd, rank))
            _check_tensor(t[kb], path, ("F32", "F16", "Q8_0"), (rank, n_ff))
            _check_tensor(t[kc], path, ("F32",), (n_ff,))
            factors[kc] = np.asarray(t[kc].data)
            for k, n_cols in ((ka, n_embd), (kb, rank), (kc, n_ff)):
                row = first_nonfinite_row(t[k].data, t[k].tensor_type.name.lower(), n_cols)
                if row >= 0:
                    raise PackError(f"pack {path}: {names[k]} has non-finite values (row {row})")
            for k in (ka, kb):
                stored[k] = (t[k].data, t[k].tensor_type.name.lower())
        if THR_GRID_NAME in tensors:
            for k in THR_KEYS:
                if names[k] not in tensors:
                    raise PackError(f"pack {path} lacks the tensor {names[k]} (it has {THR_GRID_NAME})")
                expected.add(names[k])
                _check_tensor(tensors[names[k]], path, ("F32",), (THR_K, n_ff))
                factors[k] = _check_thr_table(np.asarray(tensors[names[k]].data), n_ff, f"{path} layer {il}")
            if np.any(factors["thr_sel"] > 1):
                raise PackError(f"pack {path}: {names['thr_sel']} has shares above 1")
        layers.append(PackLayer(t["down_t"].data, t["down_t"].tensor_type.name.lower(),
                                perm, group, freq, **factors, stored=stored))

    if THRESHOLD_NAME not in tensors:
        raise PackError(f"pack {path} lacks the tensor {THRESHOLD_NAME}")
    _check_tensor(tensors[THRESHOLD_NAME], path, ("F32",), (base.n_layer,))
    threshold = np.asarray(tensors[THRESHOLD_NAME].data)
    if not np.all(np.isfinite(threshold)):
        raise PackError(f"pack {path}: {THRESHOLD_NAME} has non-finite values")
    thr_grid = thr_norm = None
    if THR_GRID_NAME in tensors:
        expected.add(THR_GRID_NAME)
        _check_tensor(tensors[THR_GRID_NAME], path, ("F32",), (THR_K, base.n_layer))
        thr_grid = _check_thr_grid(np.asarray(tensors[THR_GRID_NAME].data), base.n_layer, f"pack {path}: {THR_GRID_NAME}")
        if THR_NORM_NAME not in tensors:
            raise PackError(f"pack {path} lacks the tensor {THR_NORM_NAME} (it has {THR_GRID_NAME})")
        expected.add(THR_NORM_NAME)
        _check_tensor(tensors[THR_NORM_NAME], path, ("F32",), (base.n_layer,))
        thr_norm = np.asarray(tensors[THR_NORM_NAME].data)
        if not np.all(np.isfinite(thr_norm)) or np.any(thr_norm < 0):
            raise PackError(f"pack {path}: {THR_NORM_NAME} must be finite values >= 0")
    extra = sorted(set(tensors) - expected)
    if extra:
        raise PackError(f"pack {path} holds unexpected tensor {extra[0]!r} "
                        f"({len(extra)} in all); it is not part of pack version {version}")
    listed = None
    if r.get_field(K_LISTED) is not None:
        listed = [float(v) for v in r.get_field(K_LISTED).contents()]
        if len(listed) != base.n_layer or not all(0.0 <= v <= 1.0 for v in listed):
            raise PackError(f"pack {path}: {K_LISTED} must be {base.n_layer} values in [0, 1]")
    return Pack(path, version, created_by, method, base, fp, group_size, layers, threshold, stats, thr_grid, thr_norm,
                listed)


def read_pack_stats(pack_path: str | Path) -> str | None:
    """The kx.stats JSON of a pack (None when it has none); PackError for a bad pack."""
    return read_pack(pack_path).stats
