"""Damaged packs are refused by both readers, naming what is damaged: the Python reference
(kairox.pack.read_pack) and the runtime's loader (kx_model_load_pack, the path of every tool).

A pack carries an XXH3-64 checksum of every tensor and of its header (docs/pack-format.md), and
the rows the FFN reads must be finite. These tests flip bytes where a disk, a copy or a
download would, and check that nothing altered loads.
"""
from __future__ import annotations

import ctypes
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from kairox.gguffile import CHECKSUM_NAME
from kairox.pack import PackError, PackPredictor, read_pack, write_pack
from test_pack import restamp, rewrite, toy_factors

SMALL = 300
N_MUTATIONS = 100
FUZZ_SPAN = 64 << 10  # the first 64 KiB: header, metadata, tensor infos and the first rows


@pytest.fixture(scope="module")
def model(tiny_gguf: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("integrity")
    m = d / "m.gguf"
    shutil.copy(tiny_gguf("f32", hidden_act="relu", vocab_size=SMALL), m)
    return m


@pytest.fixture(scope="module")
def pack(model: Path) -> Path:
    """F16 down rows and a predictor on every layer: every kind of tensor the FFN reads."""
    return write_pack(model, down_type="f16", predictor=PackPredictor(4, lambda il: toy_factors(il, 4), "f16"),
                      quiet=True)


@pytest.fixture(scope="module")
def native_load(native: Path, model: Path):
    """load(pack) -> None when the runtime's loader accepts it, else its sentence. One model,
    loaded once; each call attaches a pack to it as kx_model_load_pack does for every tool."""
    import kairox
    from kairox.llama import _lib
    llm = kairox.Llama(str(model), n_ctx=64, verbose=False)
    err = ctypes.create_string_buffer(1024)

    def load(p: Path) -> str | None:
        rc = _lib.kx_model_load_pack(llm._model.model, str(model).encode(), str(p).encode(), err, len(err))
        return None if rc == 0 else err.value.decode()
    yield load
    llm.close()


def _tensor(p: Path, name: str) -> gguf.ReaderTensor:
    return next(t for t in gguf.GGUFReader(p).tensors if t.name == name)


def _patch(src: Path, dst: Path, at: int, data: bytes) -> Path:
    buf = bytearray(src.read_bytes())
    buf[at:at + len(data)] = data
    dst.write_bytes(bytes(buf))
    return dst


def _flip(src: Path, dst: Path, at: int) -> Path:
    return _patch(src, dst, at, bytes([src.read_bytes()[at] ^ 0x10]))


def _kv_offset(p: Path, key: str) -> int:
    """A byte inside the value of string key `key`."""
    return p.read_bytes().index(str(gguf.GGUFReader(p).get_field(key).contents()).encode()) + 1


CASES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    # a flipped bit in a down row, past the 12 KiB the model fingerprint samples
    "down row": (lambda s, d: _flip(s, d, _tensor(s, "blk.1.kx_down_t").data_offset + 20000),
                 "tensor blk.1.kx_down_t does not match its checksum"),
    "predictor bias": (lambda s, d: _flip(s, d, _tensor(s, "blk.0.kx_pred_c").data_offset + 3),
                       "tensor blk.0.kx_pred_c does not match its checksum"),
    "permutation": (lambda s, d: _flip(s, d, _tensor(s, "blk.0.kx_perm").data_offset + 40),
                    "tensor blk.0.kx_perm does not match its checksum"),
    "metadata": (lambda s, d: _flip(s, d, _kv_offset(s, "kx.pack.created_by")),
                 r"header \(metadata and tensor list\) does not match its checksum"),
    "checksum": (lambda s, d: _flip(s, d, _tensor(s, CHECKSUM_NAME).data_offset + 9),
                 "does not match its checksum"),
    # 64 KiB of 0xFF over the down rows (F16 NaN) by a writer that then checksummed them
    "NaN rows": (lambda s, d: restamp(_patch(s, d, _tensor(s, "blk.0.kx_down_t").data_offset + 512,
                                             b"\xff" * min(64 << 10, _tensor(s, "blk.0.kx_down_t").n_bytes - 512))),
                 r"blk.0.kx_down_t has non-finite values \(row 4\)"),
    "NaN predictor": (lambda s, d: restamp(_patch(s, d, _tensor(s, "blk.1.kx_pred_b").data_offset + 2 * 4 * 7,
                                                  b"\xff\xff")),
                      r"blk.1.kx_pred_b has non-finite values \(row 7\)"),
    "no checksums": (lambda s, d: rewrite(s, d, checksums=False), "lacks its checksum tensor kx_checksum"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_pack_is_refused_by_both_readers(case: str, pack: Path, model: Path, tmp_path: Path,
                                                 native_load) -> None:
    damage, words = CASES[case]
    bad = damage(pack, tmp_path / "bad.kxpack.gguf")
    assert bad.read_bytes() != pack.read_bytes()
    with pytest.raises(PackError, match=words):
        read_pack(bad, model)
    why = native_load(bad)
    assert why is not None and re.search(words, why), why
    assert native_load(pack) is None  # the undamaged pack still loads


def _covered(p: Path) -> np.ndarray:
    """Per byte of the file: whether a checksum covers it (the header, every tensor's bytes);
    the alignment padding between tensors is not read by anyone."""
    r = gguf.GGUFReader(p)
    cov = np.zeros(p.stat().st_size, bool)
    cov[:r.tensors[0].data_offset] = True
    for t in r.tensors:
        cov[t.data_offset:t.data_offset + t.n_bytes] = True
    return cov


def test_no_mutation_of_the_first_64k_loads(pack: Path, model: Path, tmp_path: Path, native_load) -> None:
    """100 random byte changes in the first 64 KiB: each is refused by both readers, except one
    in alignment padding (nothing reads it; then both load, and the data is the same)."""
    rng = np.random.default_rng(38)
    raw = pack.read_bytes()
    cov = _covered(pack)
    span = min(FUZZ_SPAN, len(raw))
    refused = 0
    for i in range(N_MUTATIONS):
        at = int(rng.integers(0, span))
        bad = _patch(pack, tmp_path / f"m{i}.kxpack.gguf", at, bytes([raw[at] ^ int(rng.integers(1, 256))]))
        try:
            read_pack(bad, model)
            py = None
        except PackError as e:
            py = str(e)
        native = native_load(bad)
        assert (py is None) == (native is None), (at, py, native)
        if py is None:
            assert not cov[at], f"a change at byte {at} (checksummed) loaded"
        else:
            refused += 1
        bad.unlink()
    assert refused >= N_MUTATIONS * 0.9  # padding is a few bytes per tensor


@pytest.mark.parametrize("down_type,scale_at", [("q4_k", 2), ("q6_k", 208)])
def test_k_quant_rows_with_an_infinite_scale_are_refused(tiny_gguf: Callable[..., Path], native: Path,
                                                         tmp_path: Path, down_type: str, scale_at: int) -> None:
    """A K-quant down row whose block scale is infinite (Q4_K's dmin, Q6_K's d at the block's
    end), checksummed by its writer, is refused by both readers, naming the row."""
    import kairox
    from kairox.llama import _lib
    model = tmp_path / "w.gguf"
    shutil.copy(tiny_gguf("f32", hidden_act="relu", n_layer=2, n_embd=256, vocab_size=SMALL), model)
    good = write_pack(model, tmp_path / "good.kxpack.gguf", down_type=down_type, quiet=True)
    t = _tensor(good, "blk.1.kx_down_t")
    row_bytes = t.n_bytes // int(t.shape[1])
    bad = restamp(_patch(good, tmp_path / "bad.kxpack.gguf", t.data_offset + 5 * row_bytes + scale_at, b"\x00\x7c"))
    words = r"blk.1.kx_down_t has non-finite values \(row 5\)"
    with pytest.raises(PackError, match=words):
        read_pack(bad, model)
    llm = kairox.Llama(str(model), n_ctx=64, verbose=False)
    try:
        err = ctypes.create_string_buffer(1024)
        for p, want in ((bad, words), (good, None)):
            rc = _lib.kx_model_load_pack(llm._model.model, str(model).encode(), str(p).encode(), err, len(err))
            assert (rc == 0) if want is None else re.search(want, err.value.decode()), err.value.decode()
    finally:
        llm.close()


def test_header_scan_sizes_tensors_and_refuses_partial_blocks(tmp_path: Path) -> None:
    """scan_header gives a quantized tensor's bytes from its type's blocks, and names the tensor
    whose rows are not whole blocks (a header edited to ne[0] = 48 for Q8_0's 32-wide blocks)."""
    from kairox.gguf_header import GGUFHeaderError, scan_header, tensor_nbytes
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.t", gguf.quants.quantize(np.ones((3, 64), np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert scan_header(path).tensors[0].nbytes == 3 * 2 * 34 == tensor_nbytes((3, 64), q8)
    raw = path.read_bytes()
    name = b"blk.0.t"
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert raw[at:at + 12] == (2).to_bytes(4, "little") + (64).to_bytes(8, "little")  # n_dims, ne[0]
    path.write_bytes(raw[:at + 4] + (48).to_bytes(8, "little") + raw[at + 12:])
    with pytest.raises(GGUFHeaderError, match=r"tensor blk\.0\.t: .*not a multiple of Q8_0 block size"):
        scan_header(path)
    with pytest.raises(ValueError):
        tensor_nbytes((3, 48), q8)
