"""Hugging Face checkpoint reading: config.json and the hand-written safetensors reader/writer."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kairox.checkpoint import (Checkpoint, CheckpointError, HFConfig, bf16_bits, load_config,
                               read_safetensors_header, read_tensor, write_safetensors)

MINIMAL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "vocab_size": 100,
}


def _folder(tmp_path: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config or MINIMAL_CONFIG))
    if tensors is not None:
        write_safetensors(tmp_path / "model.safetensors", tensors)
    return tmp_path


def test_config_defaults(tmp_path: Path) -> None:
    cfg = load_config(_folder(tmp_path))
    assert cfg.architectures == ("LlamaForCausalLM",)
    assert cfg.num_key_value_heads == 4          # defaults to the head count (plain MHA)
    assert cfg.rope_theta == 10000.0
    assert cfg.tie_word_embeddings is False
    assert cfg.head_dim is None and cfg.head_size == 16
    assert cfg.torch_dtype is None


def test_config_round_trip() -> None:
    cfg = HFConfig.from_dict({**MINIMAL_CONFIG, "num_key_value_heads": 2, "rope_theta": 5e5,
                              "tie_word_embeddings": True, "head_dim": 32, "torch_dtype": "bfloat16"})
    again = HFConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.head_size == 32 and again.num_key_value_heads == 2


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_attention_heads"])
def test_config_missing_key(tmp_path: Path, key: str) -> None:
    cfg = dict(MINIMAL_CONFIG)
    del cfg[key]
    with pytest.raises(CheckpointError, match=key):
        load_config(_folder(tmp_path, cfg))


def test_config_bad_kv_heads() -> None:
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        HFConfig.from_dict({**MINIMAL_CONFIG, "num_key_value_heads": 3})


def test_missing_dir_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot parse"):
        load_config(tmp_path)


def test_no_safetensors(tmp_path: Path) -> None:
    _folder(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="safetensors only"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_round_trip(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(np.float32),
               "scalar_like": np.array([1.5], dtype=np.float32)}
    path = write_safetensors(tmp_path / "x.safetensors", tensors, dtype=dtype)
    infos = read_safetensors_header(path)
    assert set(infos) == set(tensors)
    for name, want in tensors.items():
        got = read_tensor(infos[name])
        assert got.shape == want.shape and infos[name].dtype == dtype
        # rounding to nearest loses at most half an ulp: 2^-11 (F16), 2^-8 (BF16) relative
        rtol = {"F32": 0, "F16": 2 ** -11, "BF16": 2 ** -8}[dtype]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0)
        assert got.dtype == (np.float16 if dtype == "F16" else np.float32)


def test_bf16_exact_and_rounding() -> None:
    # exactly representable values survive; ties round to even; NaN stays NaN
    x = np.array([1.0, -2.5, 3.0e38, 1 + 2 ** -8, 1 + 3 * 2 ** -8, np.nan, np.inf], dtype=np.float32)
    bits = bf16_bits(x)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    assert back[0] == 1.0 and back[1] == -2.5
    assert back[3] == 1.0                 # halfway between 1 and 1 + 2^-7: even is 1
    assert back[4] == 1 + 2 ** -6         # halfway between 1 + 2^-7 and 1 + 2^-6: even is the latter
    assert np.isnan(back[5]) and back[6] == np.inf
    assert abs(back[2] - 3.0e38) / 3.0e38 < 2 ** -8


def test_bf16_checkpoint_reads_as_float32(tmp_path: Path) -> None:
    w = np.linspace(-4, 4, 32, dtype=np.float32).reshape(4, 8)
    _folder(tmp_path)
    write_safetensors(tmp_path / "model.safetensors", {"w": w}, dtype="BF16")
    got = Checkpoint(tmp_path).tensor("w")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, (bf16_bits(w).astype(np.uint32) << 16).view(np.float32))


def test_sharded(tmp_path: Path) -> None:
    _folder(tmp_path)
    a, b = np.ones((2, 2), np.float32), np.full(3, 2.0, np.float32)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": a})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": b}, dtype="F16")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = Checkpoint(tmp_path)
    assert sorted(ck.names) == ["a", "b"] and "a" in ck
    np.testing.assert_array_equal(ck.tensor("a"), a)
    np.testing.assert_array_equal(ck.tensor("b"), b)

    index["weight_map"]["c"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'c'"):
        Checkpoint(tmp_path)
    index["weight_map"]["c"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing"):
        Checkpoint(tmp_path)


def test_missing_tensor(tmp_path: Path) -> None:
    ck = Checkpoint(_folder(tmp_path, tensors={"a": np.zeros(4, np.float32)}))
    with pytest.raises(CheckpointError, match="'nope' is missing"):
        ck.tensor("nope")


def test_truncated_data(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros((16, 16), np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_header(path)


def test_header_overflow(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="overflows"):
        read_safetensors_header(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_header(path)


def test_header_not_json(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xff{[}")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_safetensors_header(path)


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def test_unsupported_dtype(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "x.safetensors",
                     {"a": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(CheckpointError, match="unsupported dtype I8"):
        read_safetensors_header(path)


def test_inconsistent_offsets(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "x.safetensors",
                     {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16)
    with pytest.raises(CheckpointError, match="needs 16 bytes"):
        read_safetensors_header(path)


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="dtype"):
        write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(2)}, dtype="I8")
    with pytest.raises(CheckpointError, match="float"):
        write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(2, dtype=np.int32)})
