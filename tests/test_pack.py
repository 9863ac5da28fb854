"""The sparse pack sidecar: fingerprint, identity-pack writing, reading and validation."""
from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kairox.checkpoint import Checkpoint
from kairox.gguffile import CHECKSUM_NAME
from kairox.pack import (FORBIDDEN_SUBSTRINGS, PackError, PackLayout, PackPredictor, fingerprint,
                         inspect_model, pack_path_for, read_pack_stats,
                         read_pack, write_pack)

SMALL = 300  # vocabulary of the models whose GGUF this file parses with GGUFReader


@pytest.fixture(scope="module")
def small_relu(tiny_gguf: Callable[..., Path]) -> Path:
    return tiny_gguf("f32", hidden_act="relu", vocab_size=SMALL)


@pytest.fixture(scope="module")
def small_pack(tmp_path_factory: pytest.TempPathFactory, small_relu: Path) -> Path:
    return write_pack(small_relu, tmp_path_factory.mktemp("pack") / "small.kxpack.gguf", quiet=True)


def reference_fingerprint(path: Path) -> str:
    """The spec's fingerprint, written independently of kairox.pack: GGUFReader for the
    tensor infos, the whole file in memory, one byte stream, then FNV-1a over it."""
    raw = path.read_bytes()
    stream = bytearray()
    for t in gguf.GGUFReader(path).tensors:
        ne = [int(d) for d in t.shape]
        while len(ne) > 1 and ne[-1] == 1:  # ggml_n_dims: trailing 1s do not count
            ne.pop()
        stream += t.name.encode() + b"\0" + int(t.tensor_type).to_bytes(4, "little")
        stream += b"".join(v.to_bytes(8, "little") for v in [len(ne), *ne])
        data = raw[t.data_offset:t.data_offset + t.n_bytes]
        n, s = len(data), 4096
        mid = n // 2 - (n // 2) % s
        stream += data[:s] + data[mid:mid + s] + data[n - min(s, n):]
    h = 0xCBF29CE484222325
    for b in stream:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return "kxfp1-%016x" % h


def restamp(path: Path) -> Path:
    """Recompute a pack's checksum tensor in place (the writer's rule, gguffile.finish_atomically),
    as a pack written with these contents would have it: the tests of the checks behind the
    checksums need packs that are wrong but undamaged."""
    import xxhash
    r = gguf.GGUFReader(path)
    ts = r.tensors
    assert ts[-1].name == CHECKSUM_NAME
    sums = [xxhash.xxh3_64_intdigest(r.data[t.data_offset:t.data_offset + t.n_bytes]) for t in ts[:-1]]
    sums.append(xxhash.xxh3_64_intdigest(r.data[:ts[0].data_offset]))
    off = ts[-1].data_offset
    del r
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(np.array(sums, np.uint64).tobytes())
    return path


def rewrite(src: Path, dst: Path, kv: dict[str, tuple[Any, Any]] | None = None,
            tensors: dict[str, np.ndarray | None] | None = None, checksums: bool = True) -> Path:
    """Copy a GGUF, replacing KV values ({key: (value, GGUFValueType)}) and tensors
    ({name: array, or None to drop it}); names not in `src` are appended. A pack's checksum
    tensor stays last and is recomputed (dropped when not `checksums`)."""
    kv, tensors = kv or {}, dict(tensors or {})
    r = gguf.GGUFReader(src)
    summed = r.tensors and r.tensors[-1].name == CHECKSUM_NAME
    w = gguf.GGUFWriter(dst, str(r.get_field("general.architecture").contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, vtype = kv.pop(name, (f.contents(), f.types[0]))
        w.add_key_value(name, value, vtype)
    for name, (value, vtype) in kv.items():
        w.add_key_value(name, value, vtype)
    for t in r.tensors:
        if t.name == CHECKSUM_NAME:
            continue
        if t.name in tensors:
            arr = tensors.pop(t.name)
            if arr is not None:
                w.add_tensor(t.name, arr)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, arr in tensors.items():
        if arr is not None:
            w.add_tensor(name, arr)
    if summed and checksums:
        w.add_tensor(CHECKSUM_NAME, np.zeros(sum(len(t) for t in w.tensors) + 1, np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return restamp(dst) if summed and checksums else dst


# --------------------------------------------------------------------------- fingerprint


def test_pack_path_for() -> None:
    assert pack_path_for("/m/model.gguf") == Path("/m/model.kxpack.gguf")
    assert pack_path_for("/m/Model.Q4_K_M.GGUF") == Path("/m/Model.Q4_K_M.kxpack.gguf")
    assert pack_path_for("weights") == Path("weights.kxpack.gguf")


def test_fingerprint_is_deterministic(tmp_path: Path, tiny_relu_gguf: Path) -> None:
    fp = fingerprint(tiny_relu_gguf)
    assert re.fullmatch(r"kxfp1-[0-9a-f]{16}", fp)
    assert fingerprint(tiny_relu_gguf) == fp
    copy = shutil.copy(tiny_relu_gguf, tmp_path / "elsewhere.gguf")
    assert fingerprint(copy) == fp  # depends on content only, not on the path


def test_fingerprint_matches_reference(small_relu: Path) -> None:
    assert fingerprint(small_relu) == reference_fingerprint(small_relu)


def test_fingerprint_sees_sampled_bytes_only(tmp_path: Path, small_relu: Path) -> None:
    t = next(t for t in gguf.GGUFReader(small_relu).tensors if t.name == "blk.1.ffn_down.weight")
    assert t.n_bytes >= 4 * 4096  # so that [4096, 8192) lies outside all three samples
    fp = fingerprint(small_relu)

    def flipped(rel: int) -> str:
        p = tmp_path / f"flip-{rel}.gguf"
        buf = bytearray(small_relu.read_bytes())
        buf[t.data_offset + rel] ^= 0x01
        p.write_bytes(buf)
        return fingerprint(p)

    mid = t.n_bytes // 2 // 4096 * 4096
    for rel in (0, 4095, mid, mid + 100, t.n_bytes - 1):
        assert flipped(rel) != fp, rel
    assert flipped(5000) == fp  # unsampled: the documented price of reading only 12 KiB


# ------------------------------------------------------------------------- round trip


def test_round_trip_f32(tmp_path: Path, tiny_relu_gguf: Path, tiny_relu_hf: Path) -> None:
    out = write_pack(tiny_relu_gguf, tmp_path / "p.kxpack.gguf", group_size=48, quiet=True)
    pack = read_pack(out, tiny_relu_gguf)
    b = pack.base
    assert (b.architecture, b.n_layer, b.n_embd, b.n_ff, b.activation) == ("llama", 2, 64, 256, "relu")
    assert pack.version == 3 and pack.created_by.startswith("kairox ")
    assert pack.method == {"kind": "identity"}
    assert pack.fingerprint == fingerprint(tiny_relu_gguf)
    assert pack.group_size == 48 and pack.n_groups == 6  # ceil(256 / 48)
    ck = Checkpoint(tiny_relu_hf)
    ids = np.arange(256)
    for il, layer in enumerate(pack.layers):
        hf_down = np.asarray(ck.tensor(f"model.layers.{il}.mlp.down_proj.weight"), np.float32)
        assert layer.down_type == "f32"
        np.testing.assert_array_equal(layer.down_t(), hf_down.T)  # [n_ff, n_embd]
        np.testing.assert_array_equal(layer.perm, ids)
        np.testing.assert_array_equal(layer.group, ids // 48)
        np.testing.assert_array_equal(layer.freq, np.ones(256, np.float32))
        assert layer.pred_a is None and layer.pred_b is None
    np.testing.assert_array_equal(pack.threshold, np.zeros(2, np.float32))
    names = [t.name for t in gguf.GGUFReader(out).tensors]
    assert "blk.1.kx_down_t" in names and "kx_threshold" in names
    assert not [n for n in names if any(s in n for s in FORBIDDEN_SUBSTRINGS)]


@pytest.mark.parametrize("down_type,rtol", [("f16", 1e-3), ("q8_0", 1e-2)])
def test_round_trip_reduced_precision(tmp_path: Path, small_relu: Path, tiny_hf: Callable[..., Path],
                                      down_type: str, rtol: float) -> None:
    pack = read_pack(write_pack(small_relu, tmp_path / "p.kxpack.gguf", down_type=down_type,
                                quiet=True), small_relu)
    hf = Checkpoint(tiny_hf(hidden_act="relu", vocab_size=SMALL))
    for il, layer in enumerate(pack.layers):
        want = np.asarray(hf.tensor(f"model.layers.{il}.mlp.down_proj.weight"), np.float32).T
        assert layer.down_type == down_type
        # Q8_0: per-row blocks of 32 share one scale, so the error is relative to a row's max
        np.testing.assert_allclose(layer.down_t(), want, rtol=0, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("down_type", ["q4_k", "q6_k"])
def test_round_trip_k_quant_rows(tmp_path: Path, tiny_gguf: Callable[..., Path], native: Path,
                                 down_type: str) -> None:
    """K-quant down rows are ggml's quantization of the transposed rows, row by row: read back
    (dequantized by gguf), they equal ggml_quantize_chunk then dequantization of the model's
    own float rows, exactly."""
    from kairox._native import ggml_quantize
    from kairox.gguf_header import scan_header
    from kairox.pack import read_model_tensor
    model = tiny_gguf("f32", hidden_act="relu", n_layer=2, n_embd=256, vocab_size=SMALL)
    pack = read_pack(write_pack(model, tmp_path / "k.kxpack.gguf", down_type=down_type, quiet=True), model)
    q = gguf.GGMLQuantizationType[down_type.upper()]
    for il, layer in enumerate(pack.layers):
        rows = read_model_tensor(scan_header(model), f"blk.{il}.ffn_down.weight").T  # [n_ff, n_embd]
        raw = ggml_quantize(rows, int(q))
        want = np.asarray(gguf.quants.dequantize(raw, q), np.float32).reshape(rows.shape)
        assert layer.down_type == down_type
        np.testing.assert_array_equal(layer.down_t(), want)
        assert np.abs(want - rows).max() < 0.2 * np.abs(rows).max()  # and it is the rows


def test_default_down_type_follows_the_model() -> None:
    """F32 rows stay F32, F16/BF16 go F16, a 2-4-bit K-quant model (gate Q4_K, down Q6_K as in
    Q4_K_M's first layers) gets Q4_K rows where n_embd splits into 256, other quantized models
    Q8_0 (F16 where n_embd does not split into 32)."""
    from types import SimpleNamespace
    from kairox.pack import default_down_type
    Q = gguf.GGMLQuantizationType

    def hdr(gate: Q, down: Q, n_embd: int = 4096) -> SimpleNamespace:
        return SimpleNamespace(tensors=[SimpleNamespace(name="blk.0.ffn_gate.weight", type_id=int(gate), ne=(n_embd, 64)),
                                        SimpleNamespace(name="blk.0.ffn_down.weight", type_id=int(down), ne=(64, n_embd))])
    assert default_down_type(hdr(Q.F32, Q.F32)) == "f32"
    assert default_down_type(hdr(Q.BF16, Q.BF16)) == "f16"
    for gate in (Q.Q2_K, Q.Q3_K, Q.Q4_K):
        assert default_down_type(hdr(gate, Q.Q6_K)) == "q4_k"
    assert default_down_type(hdr(Q.Q4_K, Q.Q4_K, n_embd=4096 + 32)) == "q8_0"
    for gate in (Q.Q4_0, Q.Q5_K, Q.Q6_K, Q.Q8_0):
        assert default_down_type(hdr(gate, gate)) == "q8_0"
    assert default_down_type(hdr(Q.Q4_0, Q.Q4_0, n_embd=4096 + 16)) == "f16"


def test_default_path_is_next_to_the_model(tmp_path: Path, small_relu: Path) -> None:
    model = shutil.copy(small_relu, tmp_path / "m.gguf")
    before = Path(model).read_bytes()
    assert write_pack(model, quiet=True) == tmp_path / "m.kxpack.gguf"
    assert Path(model).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.kxpack.gguf"]  # no temp left


def test_write_refusals(tmp_path: Path, tiny_gguf: Callable[..., Path], small_relu: Path,
                        small_pack: Path) -> None:
    narrow = tiny_gguf("f32", hidden_act="relu", n_layer=1, n_embd=48, vocab_size=SMALL)
    with pytest.raises(PackError, match="multiple of 32"):
        write_pack(narrow, tmp_path / "n.kxpack.gguf", down_type="q8_0", quiet=True)
    with pytest.raises(PackError, match="q4_k needs n_embd to be a multiple of 256"):
        write_pack(small_relu, tmp_path / "k.kxpack.gguf", down_type="q4_k", quiet=True)
    with pytest.raises(PackError, match="has no dense FFN"):
        write_pack(small_pack, tmp_path / "x.kxpack.gguf", quiet=True)  # a pack is no model
    with pytest.raises(PackError, match="down_type"):
        write_pack(small_relu, tmp_path / "y.kxpack.gguf", down_type="q4_0", quiet=True)
    with pytest.raises(PackError, match="is the model itself"):
        write_pack(small_relu, small_relu, quiet=True)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- validation


def test_refuses_pack_of_another_model(tiny_gguf: Callable[..., Path], small_pack: Path) -> None:
    other = tiny_gguf("f32", hidden_act="relu", vocab_size=SMALL, seed=1)
    with pytest.raises(PackError, match="was made for a different model"):
        read_pack(small_pack, other)


def test_refuses_truncated_and_non_packs(tmp_path: Path, small_relu: Path, small_pack: Path) -> None:
    cut = tmp_path / "cut.kxpack.gguf"
    cut.write_bytes(small_pack.read_bytes()[: small_pack.stat().st_size // 2])
    with pytest.raises(PackError, match="truncated"):
        read_pack(cut)
    with pytest.raises(PackError, match="not a kairox pack"):
        read_pack(small_relu)
    with pytest.raises(PackError, match="no pack at"):
        read_pack(tmp_path / "missing.kxpack.gguf")


@pytest.mark.parametrize("version", [1, 2, 4])
def test_refuses_other_versions(tmp_path: Path, small_pack: Path, version: int) -> None:
    """Versions before 3 carry no checksums: their data cannot be checked, so they are rebuilt."""
    bad = rewrite(small_pack, tmp_path / f"v{version}.gguf",
                  kv={"kx.pack.version": (version, gguf.GGUFValueType.UINT32)})
    with pytest.raises(PackError, match=f"format version {version}.*rebuild"):
        read_pack(bad)


def test_refuses_base_mismatch(tmp_path: Path, small_relu: Path, small_pack: Path) -> None:
    bad = rewrite(small_pack, tmp_path / "act.gguf",
                  kv={"kx.base.activation": ("silu", gguf.GGUFValueType.STRING)})
    read_pack(bad)  # self-consistent on its own
    with pytest.raises(PackError, match="records"):
        read_pack(bad, small_relu)


@pytest.mark.parametrize("edit,message", [
    (lambda p: {"blk.1.kx_perm": np.r_[p[:1], p[:-1]].astype(np.int32)}, "not a permutation"),
    (lambda p: {"blk.0.kx_group": np.r_[p[:-1] // 32, 8].astype(np.int32)}, "outside 0..7"),
    (lambda p: {"blk.0.kx_group": (p[::-1] // 32).astype(np.int32)}, "non-decreasing"),
    (lambda p: {"blk.1.kx_freq": None}, "lacks the tensor blk.1.kx_freq"),
    (lambda p: {"blk.0.kx_freq": np.ones(255, np.float32)}, "has shape"),
    (lambda p: {"blk.0.kx_freq": np.full(256, 2.0, np.float32)}, r"outside \[0, 1\]"),
    (lambda p: {"blk.0.kx_perm": p.astype(np.float32)}, "has type F32"),
    (lambda p: {"blk.0.kx_pred_a": np.zeros((4, 64), np.float32)}, "lacks blk.0.kx_pred_b"),
    (lambda p: {"blk.0.ffn_down.weight": np.zeros((64, 256), np.float32)}, "take for a model weight"),
    (lambda p: {"blk.0.kx_extra": np.zeros(4, np.float32)}, "unexpected tensor"),
])
def test_refuses_bad_tensors(tmp_path: Path, small_pack: Path, edit: Callable, message: str) -> None:
    bad = rewrite(small_pack, tmp_path / "bad.gguf", tensors=edit(np.arange(256)))
    with pytest.raises(PackError, match=message):
        read_pack(bad)


# --------------------------------------------------------------------------- predictor


def pred_tensors(n_layer: int = 2, rank: int = 8, dtype: type = np.float16,
                 **override: np.ndarray | None) -> dict[str, np.ndarray | None]:
    """kx_pred_a/b/c of every layer for the small model (n_embd 64, n_ff 256), with
    `override` ({"a1": array or None, ...}: key = letter + layer) replacing some."""
    out: dict[str, np.ndarray | None] = {}
    for il in range(n_layer):
        for k, shape, dt in (("a", (rank, 64), dtype), ("b", (256, rank), dtype), ("c", (256,), np.float32)):
            out[f"blk.{il}.kx_pred_{k}"] = override.get(f"{k}{il}", np.zeros(shape, dt))
    return out


def test_accepts_predictor(tmp_path: Path, small_relu: Path, small_pack: Path) -> None:
    pack = read_pack(rewrite(small_pack, tmp_path / "pred.gguf", tensors=pred_tensors()), small_relu)
    layer = pack.layers[1]
    assert layer.has_predictor and not read_pack(small_pack).layers[1].has_predictor
    assert layer.pred_a.shape == (8, 64) and layer.pred_b.shape == (256, 8)
    assert layer.pred_c.shape == (256,) and layer.pred_c.dtype == np.float32


def test_accepts_predictor_on_some_layers_only(tmp_path: Path, small_pack: Path) -> None:
    some = pred_tensors(a0=None, b0=None, c0=None, a1=np.zeros((3, 64), np.float32),
                        b1=np.zeros((256, 3), np.float16))
    pack = read_pack(rewrite(small_pack, tmp_path / "some.gguf", tensors=some))
    assert not pack.layers[0].has_predictor
    assert pack.layers[1].pred_a.dtype == np.float32 and pack.layers[1].pred_b.dtype == np.float16


@pytest.mark.parametrize("override,message", [
    ({"c0": None}, "has blk.0.kx_pred_a but lacks blk.0.kx_pred_c"),
    ({"a1": None}, "has blk.1.kx_pred_b but lacks blk.1.kx_pred_a"),
    ({"a0": None, "b0": None}, "has blk.0.kx_pred_c but lacks blk.0.kx_pred_a"),
    ({"a1": None, "c1": None}, "has blk.1.kx_pred_b but lacks blk.1.kx_pred_a"),
    ({"b0": np.zeros((256, 4), np.float16)}, "kx_pred_b has shape"),          # rank 4 vs 8
    ({"a0": np.zeros((8, 63), np.float16)}, "kx_pred_a has shape"),
    ({"a0": np.zeros(64, np.float16)}, "must be 2-D"),
    ({"c1": np.zeros(255, np.float32)}, "kx_pred_c has shape"),
    ({"c1": np.zeros(256, np.float16)}, "kx_pred_c has type F16"),
    ({"a1": np.zeros((8, 64), np.int32)}, "kx_pred_a has type I32"),
    ({"c0": np.r_[np.zeros(255), np.inf].astype(np.float32)}, "kx_pred_c has non-finite"),
    ({"c0": np.r_[np.nan, np.zeros(255)].astype(np.float32)}, "kx_pred_c has non-finite"),
])
def test_refuses_bad_predictor(tmp_path: Path, small_pack: Path, override: dict, message: str) -> None:
    bad = rewrite(small_pack, tmp_path / "bad.gguf", tensors=pred_tensors(**override))
    with pytest.raises(PackError, match=message):
        read_pack(bad)


def toy_factors(il: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(il)
    return (rng.standard_normal((rank, 64)).astype(np.float32),
            rng.standard_normal((256, rank)).astype(np.float32),
            rng.standard_normal(256).astype(np.float32))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_round_trip_predictor(tmp_path: Path, small_relu: Path, dtype: str) -> None:
    calls: list[int] = []

    def layer(il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        calls.append(il)
        return toy_factors(il, 5)

    pred = PackPredictor(5, layer, dtype, {"kind": "toy"})
    pack = read_pack(write_pack(small_relu, tmp_path / "p.kxpack.gguf", predictor=pred, quiet=True),
                     small_relu)
    assert sorted(calls) == [0, 1]  # asked for once per layer (layers may run on threads)
    assert pack.method == {"kind": "identity", "predictor": {"kind": "toy", "rank": 5, "type": dtype}}
    tol = 0 if dtype == "f32" else 2e-3
    x = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
    for il, layer_ in enumerate(pack.layers):
        a, b, c = toy_factors(il, 5)
        assert layer_.pred_a.dtype == np.dtype(np.float32 if dtype == "f32" else np.float16)
        np.testing.assert_allclose(layer_.pred_a, a, rtol=tol, atol=tol * 1e-3)
        np.testing.assert_allclose(layer_.pred_b, b, rtol=tol, atol=tol * 1e-3)
        np.testing.assert_array_equal(layer_.pred_c, c)  # the bias is always F32
        rtol, atol = (1e-5, 1e-3) if dtype == "f32" else (1e-2, 0.1)
        np.testing.assert_allclose(layer_.predictor_scores(x), (x @ a.T) @ b.T + c, rtol=rtol, atol=atol)
        np.testing.assert_array_equal(layer_.perm, np.arange(256))  # the rest is unchanged


def test_round_trip_q8_0_predictor_pads_its_rank(tmp_path: Path, small_relu: Path) -> None:
    """A q8_0 predictor of rank 5 is stored at rank 32 (one block per row of B): the extra
    rows of A and columns of B read back as exact zeros, each stored value is its own Q8_0
    rounding (gguf's quantizer), so the scores are those of the rounded factors, and the
    method records the rank stored. The reader dequantizes a factor when it is first used."""
    Q8 = gguf.GGMLQuantizationType.Q8_0
    pred = PackPredictor(5, lambda il: toy_factors(il, 5), "q8_0", {"kind": "toy"})
    path = write_pack(small_relu, tmp_path / "p.kxpack.gguf", predictor=pred, quiet=True)
    pack = read_pack(path, small_relu)
    assert pack.method["predictor"] == {"kind": "toy", "rank": 32, "type": "q8_0"}
    # read lazily: the blocks stay mapped until a factor is asked for, then are kept as float32
    assert all(layer_.has_predictor and not layer_._dequantized for layer_ in pack.layers)
    assert pack.layers[0].stored["pred_b"][1] == "q8_0" and pack.layers[0].pred_b is pack.layers[0].pred_b
    x = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
    for il, layer_ in enumerate(pack.layers):
        a, b, c = toy_factors(il, 5)
        assert layer_.pred_a.shape == (32, 64) and layer_.pred_b.shape == (256, 32)
        assert not layer_.pred_a[5:].any() and not layer_.pred_b[:, 5:].any()
        ra = gguf.quants.dequantize(gguf.quants.quantize(a, Q8), Q8)
        rb = gguf.quants.dequantize(gguf.quants.quantize(np.pad(b, ((0, 0), (0, 27))), Q8), Q8)[:, :5]
        np.testing.assert_array_equal(layer_.pred_a[:5], ra)
        np.testing.assert_array_equal(layer_.pred_b[:, :5], rb)
        np.testing.assert_allclose(layer_.pred_a[:5], a, atol=np.abs(a).max() / 127)
        np.testing.assert_allclose(layer_.predictor_scores(x), (x @ ra.T) @ rb.T + c, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(layer_.predictor_scores(x), (x @ a.T) @ b.T + c, rtol=0.05, atol=0.5)


def test_default_predictor_type_follows_the_gate(tmp_path: Path, small_relu: Path) -> None:
    """f32 for an F32 gate, f16 for F16, q8_0 for a quantized one (kairox.pack.default_pred_type)."""
    from kairox.gguf_header import scan_header
    from kairox.pack import default_pred_type
    hdr = scan_header(small_relu)
    gate = next(t for t in hdr.tensors if t.name == "blk.0.ffn_gate.weight")
    want = {0: "f32", 1: "f16", 30: "f16"}.get(gate.type_id, "q8_0")
    assert default_pred_type(hdr) == want
    for type_id, name in ((0, "f32"), (1, "f16"), (30, "f16"), (8, "q8_0"), (12, "q8_0"), (2, "q8_0")):
        t2 = dataclasses.replace(gate, type_id=type_id)
        h2 = dataclasses.replace(hdr, tensors=[t2 if t is gate else t for t in hdr.tensors])
        assert default_pred_type(h2) == name, type_id


def test_method_given_by_the_caller_is_kept(tmp_path: Path, small_relu: Path) -> None:
    pred = PackPredictor(2, lambda il: toy_factors(il, 2), info={"kind": "toy"})
    method = {"kind": "identity", "predictor": {"kind": "mine"}}
    out = write_pack(small_relu, tmp_path / "m.kxpack.gguf", predictor=pred, method=method, quiet=True)
    assert read_pack(out).method == method


@pytest.mark.parametrize("pred,message", [
    (PackPredictor(4, lambda il: toy_factors(il, 5)), r"predictor A of layer 0 has shape \(5, 64\)"),
    (PackPredictor(5, lambda il: toy_factors(il, 5)[:2]), r"must be a tuple \(A, B, c\)"),
    (PackPredictor(5, lambda il: (*toy_factors(il, 5)[:2], np.zeros(255))),
     "predictor c of layer 0 has shape"),
    (PackPredictor(5, lambda il: (*toy_factors(il, 5)[:2], np.full(256, np.nan))), "non-finite"),
    (PackPredictor(5, lambda il: toy_factors(il, 5) if il == 0 else toy_factors(il, 6)),
     "predictor A of layer 1 has shape"),
    (PackPredictor(2, lambda il: (np.full((2, 64), 1e6), *toy_factors(il, 2)[1:]), "f16"), "float16's range"),
    (PackPredictor(65, lambda il: toy_factors(il, 65)), r"exceeds min\(n_ff, n_embd\) = 64"),
    (PackPredictor(0, lambda il: toy_factors(il, 0)), "positive integer"),
    (PackPredictor(2, lambda il: toy_factors(il, 2), "q4_0"), "unsupported predictor type"),
])
def test_write_refuses_bad_predictor(tmp_path: Path, small_relu: Path, pred: PackPredictor,
                                     message: str) -> None:
    with pytest.raises(PackError, match=message):
        write_pack(small_relu, tmp_path / "p.kxpack.gguf", predictor=pred, quiet=True)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind


def test_layout_ahead_and_stats_round_trip(tmp_path: Path, small_relu: Path, tiny_hf: Callable[..., Path]) -> None:
    """A profiled pack (version 2): permuted rows, groups, frequencies, thresholds, an ahead
    predictor and statistics come back as written; down rows follow the permutation."""
    _, base = inspect_model(small_relu)
    rng = np.random.default_rng(3)
    perms = [rng.permutation(base.n_ff).astype(np.int32) for _ in range(base.n_layer)]
    freq = rng.uniform(0, 1, (base.n_layer, base.n_ff)).astype(np.float32)
    g = 16
    layout = PackLayout(lambda il: (perms[il], np.arange(base.n_ff) // g, freq[il]),
                        np.array([0.0, 0.25][:base.n_layer], np.float32))
    fac = {il: (rng.standard_normal((4, base.n_embd)), rng.standard_normal((base.n_ff, 4)),
                rng.standard_normal(base.n_ff)) for il in range(base.n_layer)}
    ahead = PackPredictor(4, lambda il: fac[il], "f32", {"kind": "test"})
    out = write_pack(small_relu, tmp_path / "p.kxpack.gguf", group_size=g, layout=layout,
                     ahead=ahead, stats='{"x": 1}', quiet=True)
    pack = read_pack(out, small_relu)
    assert pack.version == 3 and pack.stats == '{"x": 1}' and read_pack_stats(out) == '{"x": 1}'
    assert pack.method["ahead"] == {"kind": "test", "rank": 4, "type": "f32"}
    hf = Checkpoint(tiny_hf(hidden_act="relu", vocab_size=SMALL))
    np.testing.assert_array_equal(pack.threshold, layout.threshold)
    for il, layer in enumerate(pack.layers):
        np.testing.assert_array_equal(layer.perm, perms[il])
        np.testing.assert_array_equal(layer.freq, freq[il])
        want = np.asarray(hf.tensor(f"model.layers.{il}.mlp.down_proj.weight"), np.float32).T
        np.testing.assert_array_equal(layer.down_t(), want[perms[il]])
        assert not layer.has_predictor
        for got, exp in zip((layer.ahead_a, layer.ahead_b, layer.ahead_c), fac[il]):
            np.testing.assert_allclose(np.asarray(got), exp.astype(np.float32))


def test_write_refuses_bad_layout(tmp_path: Path, small_relu: Path) -> None:
    _, base = inspect_model(small_relu)
    ids = np.arange(base.n_ff)
    bad = {"perm": (np.zeros(base.n_ff, np.int32), ids // 32, np.ones(base.n_ff)),
           "group": (ids, ids[::-1] // 32, np.ones(base.n_ff)),
           "freq": (ids, ids // 32, np.full(base.n_ff, 2.0))}
    for what, f in bad.items():
        layout = PackLayout(lambda il, f=f: f, np.zeros(base.n_layer, np.float32))
        with pytest.raises(PackError, match=what):
            write_pack(small_relu, tmp_path / "p.kxpack.gguf", layout=layout, quiet=True)
    with pytest.raises(PackError, match="threshold"):
        write_pack(small_relu, tmp_path / "p.kxpack.gguf", quiet=True,
                   layout=PackLayout(lambda il: (ids, ids // 32, np.ones(base.n_ff)),
                                     np.full(base.n_layer, np.nan, np.float32)))
    assert not any(tmp_path.iterdir())


def test_layers_in_processes_write_the_same_pack(tmp_path: Path, small_relu: Path) -> None:
    """Layers computed several at a time in forked processes come out in order: the same
    bytes as one at a time (the sketch is seeded per layer), and an error in a layer still
    leaves no file behind."""
    from kairox.predictor import sketch_for_model
    _, base = inspect_model(small_relu)
    rng = np.random.default_rng(4)
    perms = [rng.permutation(base.n_ff).astype(np.int32) for _ in range(base.n_layer)]
    layout = PackLayout(lambda il: (perms[il], np.arange(base.n_ff) // 16, np.full(base.n_ff, 0.5, np.float32)),
                        np.zeros(base.n_layer, np.float32))
    outs = [write_pack(small_relu, tmp_path / f"w{w}.kxpack.gguf", group_size=16, layout=layout, quiet=True,
                       predictor=sketch_for_model(small_relu), down_type="q8_0", workers=w) for w in (1, 3)]
    assert outs[0].read_bytes() == outs[1].read_bytes()

    def bad_layer(il: int):
        if il == base.n_layer - 1:
            raise PackError("layer broke")
        return perms[il], np.arange(base.n_ff) // 16, np.full(base.n_ff, 0.5, np.float32)
    with pytest.raises(PackError, match="layer broke"):
        write_pack(small_relu, tmp_path / "bad.kxpack.gguf", group_size=16, quiet=True, workers=3,
                   layout=PackLayout(bad_layer, np.zeros(base.n_layer, np.float32)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w1.kxpack.gguf", "w3.kxpack.gguf"]


def test_map_ahead_keeps_order_and_runs_in_other_processes() -> None:
    import os
    import time
    from kairox.gguffile import map_ahead

    def fn(i: int) -> tuple[int, int]:
        time.sleep(0.01 * (5 - i % 5))  # later items finish first
        return i * i, os.getpid()
    got = list(map_ahead(fn, range(20), 4))
    assert [v for v, _ in got] == [i * i for i in range(20)]
    pids = {p for _, p in got}
    assert os.getpid() not in pids and 1 <= len(pids) <= 4
    assert list(map_ahead(fn, range(5), 1)) == [(i * i, os.getpid()) for i in range(5)]
