"""`kairox convert`: GGUF contents read back, the RoPE permutation, bad inputs, the CLI."""
from __future__ import annotations

import argparse
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from kairox import convert as convert_mod
from kairox.checkpoint import Checkpoint, bf16_bits
from kairox.cli import convert as convert_cli
from kairox.convert import ConvertError, convert, default_outfile, permute_qk, tokenizer_kvs
from kairox.reference import LlamaReference, rope_hf

Q = gguf.GGMLQuantizationType
# Vocabulary size of the small models: most tests do not need all 32000 tokens, whose
# GGUFReader parse alone takes a second.
SMALL = 300


@functools.lru_cache(maxsize=None)
def read(path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def kv(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader.tensors}


def as_float(t: gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order (rows, cols)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)


def rope_adjacent(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """RoPE as llama.cpp's llama architecture applies it: pairs (2i, 2i+1) of each head."""
    d = x.shape[-1]
    ang = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]   # [T, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


# ------------------------------------------------------------------ the permutation


def test_permute_row_order() -> None:
    # two heads of size 8: HF pairs (i, i+4) become adjacent rows (2i, 2i+1)
    rows = np.arange(16)[:, None].astype(float)
    got = permute_qk(rows, 2)
    assert got[:, 0].astype(int).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    # a bijection: the opposite regrouping (pairs back to halves) restores the rows
    undone = got.reshape(2, 4, 2, 1).swapaxes(1, 2).reshape(16, 1)
    np.testing.assert_array_equal(undone, rows)


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_permuted_adjacent_rope_equals_hf_rope(n_head: int) -> None:
    """llama.cpp's RoPE on the permuted projection == HF's RoPE, rows permuted the same way."""
    rng = np.random.default_rng(n_head)
    hd, n_in, n_tok = 16, 24, 7
    w = rng.standard_normal((n_head * hd, n_in))
    x = rng.standard_normal((n_tok, n_in))
    pos = np.arange(n_tok, dtype=np.float64) * 3

    hf = rope_hf((x @ w.T).reshape(n_tok, n_head, hd), pos, 10000.0)
    cpp = rope_adjacent((x @ permute_qk(w, n_head).T).reshape(n_tok, n_head, hd), pos, 10000.0)
    hf_rows_permuted = permute_qk(hf.reshape(n_tok, -1).T, n_head).T.reshape(n_tok, n_head, hd)
    np.testing.assert_allclose(cpp, hf_rows_permuted, rtol=1e-12, atol=1e-12)
    # ... so attention scores (dot products over a head) are identical
    np.testing.assert_allclose(np.einsum("thd,shd->hts", cpp, cpp),
                               np.einsum("thd,shd->hts", hf, hf), rtol=1e-10, atol=1e-10)
    # and without the permutation they are not: the test would catch a missing one
    wrong = rope_adjacent((x @ w.T).reshape(n_tok, n_head, hd), pos, 10000.0)
    assert not np.allclose(np.einsum("thd,shd->hts", wrong, wrong),
                           np.einsum("thd,shd->hts", hf, hf), atol=1e-3)


def test_permute_rejects_odd_heads() -> None:
    with pytest.raises(ConvertError, match="even size"):
        permute_qk(np.zeros((12, 4)), 4)


def test_gguf_forward_matches_reference(tiny_relu_hf: Path, tiny_relu_gguf: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole-model check without the native library: a numpy forward pass over the GGUF's
    tensors with llama.cpp's adjacent-pair RoPE matches the HF reference."""
    ref = LlamaReference.from_checkpoint(tiny_relu_hf)
    toks = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203]
    want = ref.logits(toks)

    back = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    weights = {}
    for name, t in tensors(read(tiny_relu_gguf)).items():
        stem = name.removesuffix(".weight")
        if stem.startswith("blk."):
            _, il, kind = stem.split(".")
            hf = f"model.layers.{il}.{per_layer[kind]}"
        else:
            hf = back[stem]
        weights[hf + ".weight"] = as_float(t)
    monkeypatch.setattr("kairox.reference.rope_hf", lambda x, p, th, s=1.0: rope_adjacent(x, p / s, th))
    got = LlamaReference(ref.config, weights).logits(toks)
    # float32 storage of float32 weights is exact; the rest is float64 round-off
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


# ------------------------------------------------------------------- GGUF contents


def test_f32_contents(tiny_relu_hf: Path, tiny_relu_gguf: Path, vocab_gguf: Path) -> None:
    r = read(tiny_relu_gguf)
    cfg = Checkpoint(tiny_relu_hf).config
    assert kv(r, "general.architecture") == "llama"
    assert kv(r, "llama.hidden_activation") == "relu"
    assert kv(r, "llama.context_length") == cfg.max_position_embeddings
    assert kv(r, "llama.embedding_length") == 64
    assert kv(r, "llama.block_count") == 2
    assert kv(r, "llama.feed_forward_length") == 256
    assert kv(r, "llama.attention.head_count") == 4
    assert kv(r, "llama.attention.head_count_kv") == 2
    assert kv(r, "llama.rope.dimension_count") == 16
    assert kv(r, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert kv(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert kv(r, "llama.vocab_size") == 32000
    assert kv(r, "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert "llama.attention.key_length" not in r.fields  # head size is n_embd / n_head

    # every tokenizer.* key is copied with its type and value (the source is read with the
    # converter's cached parse: a second GGUFReader pass over 32000 tokens costs a second)
    src = {k.name: k for k in tokenizer_kvs(vocab_gguf)}
    assert set(src) == {k for k in r.fields if k.startswith("tokenizer.")}
    assert len(src) >= 8
    for name, want in src.items():
        f = r.fields[name]
        assert f.types[0] == want.vtype, name
        if want.vtype == gguf.GGUFValueType.ARRAY:
            assert f.types[1] == want.sub_type and len(f.data) == len(want.value), name
    for k in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token"):
        want = src[k].value
        assert kv(r, k) == (want.decode() if isinstance(want, bytes) else want)
    assert kv(r, "tokenizer.ggml.model") == "llama"
    assert [t.encode() for t in kv(r, "tokenizer.ggml.tokens")[:300]] == src["tokenizer.ggml.tokens"].value[:300]
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 32000
    np.testing.assert_array_equal(kv(r, "tokenizer.ggml.scores"), src["tokenizer.ggml.scores"].value)
    np.testing.assert_array_equal(kv(r, "tokenizer.ggml.token_type"), src["tokenizer.ggml.token_type"].value)

    ts = tensors(r)
    assert len(ts) == 1 + 2 * 9 + 2
    assert all(t.tensor_type == Q.F32 for t in ts.values())
    assert list(ts["token_embd.weight"].shape) == [64, 32000]     # ggml order: {n_embd, n_vocab}
    assert list(ts["output.weight"].shape) == [64, 32000]
    assert list(ts["blk.0.attn_q.weight"].shape) == [64, 64]
    assert list(ts["blk.0.attn_k.weight"].shape) == [64, 32]
    assert list(ts["blk.1.ffn_gate.weight"].shape) == [64, 256]
    assert list(ts["blk.1.ffn_down.weight"].shape) == [256, 64]
    assert list(ts["blk.1.ffn_norm.weight"].shape) == [64]

    ck = Checkpoint(tiny_relu_hf)
    np.testing.assert_array_equal(as_float(ts["token_embd.weight"]), ck.tensor("model.embed_tokens.weight"))
    np.testing.assert_array_equal(as_float(ts["blk.1.attn_q.weight"]),
                                  permute_qk(ck.tensor("model.layers.1.self_attn.q_proj.weight"), 4))
    np.testing.assert_array_equal(as_float(ts["blk.1.attn_k.weight"]),
                                  permute_qk(ck.tensor("model.layers.1.self_attn.k_proj.weight"), 2))
    np.testing.assert_array_equal(as_float(ts["blk.1.attn_v.weight"]),
                                  ck.tensor("model.layers.1.self_attn.v_proj.weight"))


def test_silu_activation(tiny_gguf: Callable[..., Path]) -> None:
    path = tiny_gguf("f32", hidden_act="silu", n_layer=1, vocab_size=SMALL)
    assert kv(read(path), "llama.hidden_activation") == "silu"


def test_tied_embeddings(tiny_gguf: Callable[..., Path]) -> None:
    r = read(tiny_gguf("f32", tie_embeddings=True, n_layer=1, vocab_size=SMALL))
    names = set(tensors(r))
    assert "output.weight" not in names and "token_embd.weight" in names


@pytest.mark.parametrize("outtype,qtype,ftype,tol", [
    ("f16", Q.F16, gguf.LlamaFileType.MOSTLY_F16, 2 ** -11),
    ("bf16", Q.BF16, gguf.LlamaFileType.MOSTLY_BF16, 2 ** -8),
    ("q8_0", Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0, None),
], ids=["f16", "bf16", "q8_0"])
def test_outtypes(tiny_gguf: Callable[..., Path], tiny_hf: Callable[..., Path], outtype: str,
                  qtype: Q, ftype: int, tol: float | None) -> None:
    path = tiny_gguf(outtype, hidden_act="relu", vocab_size=SMALL)
    r = read(path)
    assert kv(r, "general.file_type") == ftype
    ts = tensors(r)
    for name, t in ts.items():
        want = Q.F32 if len(t.shape) == 1 else qtype
        assert t.tensor_type == want, name
    ck = Checkpoint(tiny_hf(hidden_act="relu", vocab_size=SMALL))
    w = ck.tensor("model.layers.0.mlp.up_proj.weight")
    got = as_float(ts["blk.0.ffn_up.weight"])
    if tol is not None:
        # atol: float16 subnormals (spacing 6e-8) have no relative precision left
        np.testing.assert_allclose(got, w, rtol=tol, atol=1e-7)
    else:
        # Q8_0: 32-value blocks scaled by max|w|/127: error <= half a step, plus the f16
        # rounding of the scale times up to 127 (127 * 2^-11 < 0.1 step)
        step = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        err = np.abs(got - w).reshape(-1, 32)
        assert (err <= 0.6 * step).all()
    np.testing.assert_array_equal(as_float(ts["blk.0.ffn_norm.weight"]),
                                  ck.tensor("model.layers.0.post_attention_layernorm.weight"))


def test_bf16_checkpoint(tiny_hf: Callable[..., Path], tmp_path: Path, small_vocab: Path) -> None:
    hf = tiny_hf(hidden_act="relu", dtype="bf16", n_layer=1, vocab_size=SMALL)
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    out = convert(hf, tmp_path / "m.gguf", outtype="f32", vocab_gguf=small_vocab, quiet=True)
    ts = tensors(read(out))
    ck = Checkpoint(hf)
    assert ck.info("model.layers.0.mlp.gate_proj.weight").dtype == "BF16"
    w = ck.tensor("model.layers.0.mlp.gate_proj.weight")
    # BF16 -> F32 is exact, so the GGUF holds the BF16 values bit for bit
    np.testing.assert_array_equal(as_float(ts["blk.0.ffn_gate.weight"]), w)
    assert (bf16_bits(w).astype(np.uint32) << 16).view(np.float32).tobytes() == w.tobytes()


def test_bpe_tokenizer_json(tiny_hf: Callable[..., Path], tmp_path: Path) -> None:
    n = 300
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf(hidden_act="silu", n_layer=1, vocab_size=n), hf)
    # a byte-level BPE vocabulary: 256 byte symbols + merged tokens + one special token
    byte_syms = [chr(c) if 33 <= c <= 126 else chr(0x100 + c) for c in range(256)]
    vocab = {s: i for i, s in enumerate(byte_syms)}
    merges = []
    while len(vocab) < n - 1:
        a, b = byte_syms[65 + len(merges) % 26], byte_syms[97 + len(merges) // 26]
        vocab[a + b] = len(vocab)
        merges.append(f"{a} {b}")
    tok = {"model": {"type": "BPE", "vocab": vocab, "merges": merges},
           "decoder": {"type": "ByteLevel"},
           "added_tokens": [{"id": n - 1, "content": "<|end|>", "special": True}]}
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    out = convert(hf, tmp_path / "m.gguf", outtype="f32", quiet=True)
    r = read(out)
    assert kv(r, "tokenizer.ggml.model") == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == n
    assert kv(r, "tokenizer.ggml.tokens")[n - 1] == "<|end|>"
    assert kv(r, "tokenizer.ggml.eos_token_id") == n - 1
    assert len(r.fields["tokenizer.ggml.merges"].data) == len(merges)


# ------------------------------------------------------------------------ bad input


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(hf: Path, **changes) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


def test_missing_dir(tmp_path: Path, vocab_gguf: Path) -> None:
    with pytest.raises(ConvertError, match="does not exist"):
        convert(tmp_path / "nope", tmp_path / "x.gguf", vocab_gguf=vocab_gguf)


def test_missing_config(tmp_path: Path, vocab_gguf: Path) -> None:
    with pytest.raises(ConvertError, match="config.json"):
        convert(tmp_path, tmp_path / "x.gguf", vocab_gguf=vocab_gguf)


@pytest.fixture
def small_hf(tiny_hf: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of a one-layer checkpoint that a test may edit."""
    return _copy(tiny_hf(hidden_act="relu", n_layer=1, vocab_size=SMALL), tmp_path / "hf")


@pytest.fixture
def small_vocab(vocab_of_size: Callable[[int], Path]) -> Path:
    return vocab_of_size(SMALL)


def test_unsupported_architecture(small_hf: Path, small_vocab: Path) -> None:
    _edit_config(small_hf, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConvertError, match="unsupported architecture 'GPT2LMHeadModel'"):
        convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab)


def test_mistral_accepted(small_hf: Path, small_vocab: Path) -> None:
    _edit_config(small_hf, architectures=["MistralForCausalLM"], sliding_window=4096)
    out = convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab, quiet=True)
    assert kv(read(out), "general.architecture") == "llama"


def test_unsupported_hidden_act(small_hf: Path, small_vocab: Path) -> None:
    _edit_config(small_hf, hidden_act="tanh")
    with pytest.raises(ConvertError, match="unsupported hidden_act 'tanh'"):
        convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab)


def test_unsupported_rope_scaling(small_hf: Path, small_vocab: Path) -> None:
    _edit_config(small_hf, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConvertError, match="rope_scaling"):
        convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab)


def test_shape_mismatch(small_hf: Path, small_vocab: Path) -> None:
    _edit_config(small_hf, intermediate_size=128)
    with pytest.raises(ConvertError, match="mlp.gate_proj.weight.*shape"):
        convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab)


def test_truncated_safetensors(small_hf: Path, small_vocab: Path) -> None:
    st = small_hf / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ConvertError, match="truncated"):
        convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab)


def test_vocab_size_mismatch(tiny_hf: Callable[..., Path], tmp_path: Path, vocab_gguf: Path) -> None:
    hf = tiny_hf(hidden_act="relu", n_layer=1, vocab_size=300)
    with pytest.raises(ConvertError, match="32000 tokens.*vocab_size is 300"):
        convert(hf, tmp_path / "x.gguf", vocab_gguf=vocab_gguf)


def test_no_tokenizer(small_hf: Path) -> None:
    with pytest.raises(ConvertError, match="--vocab-gguf"):
        convert(small_hf, small_hf / "x.gguf")


def test_spm_without_sentencepiece(small_hf: Path) -> None:
    pytest.importorskip("gguf.vocab")
    from gguf import vocab as gvocab
    if gvocab.SentencePieceProcessor is not None:
        pytest.skip("sentencepiece is installed")
    (small_hf / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(ConvertError, match="pip install sentencepiece"):
        convert(small_hf, small_hf / "x.gguf")


def test_unexpected_tensor(small_hf: Path, small_vocab: Path) -> None:
    from kairox.checkpoint import write_safetensors
    ck = Checkpoint(small_hf)
    w = {n: np.array(ck.tensor(n)) for n in ck.names}
    w["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    del ck
    write_safetensors(small_hf / "model.safetensors", w)
    with pytest.raises(ConvertError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        convert(small_hf, small_hf / "x.gguf", vocab_gguf=small_vocab)


def test_failure_leaves_no_file(small_hf: Path, tmp_path: Path, small_vocab: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    calls = []
    real = convert_mod.encode_tensor

    def failing(w, q, name):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # an interrupt mid-write, the worst case
        return real(w, q, name)

    monkeypatch.setattr(convert_mod, "encode_tensor", failing)
    with pytest.raises(KeyboardInterrupt):
        convert(small_hf, out_dir / "x.gguf", vocab_gguf=small_vocab, quiet=True)
    assert list(out_dir.iterdir()) == []


# ------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kairox")
    convert_cli.register(ap.add_subparsers(dest="command"))
    return ap


def _cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["convert", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("HF_DIR", "--outfile", "--outtype", "--vocab-gguf", "q8_0", "LlamaForCausalLM"):
        assert word in out


def test_cli_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["convert", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kairox convert: error: ") and err.count("\n") == 1


def test_cli_unsupported_architecture(small_hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_config(small_hf, architectures=["GPT2LMHeadModel"])
    assert _cli(["convert", str(small_hf), "--vocab-gguf", "x.gguf"]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture 'GPT2LMHeadModel'" in err and err.count("\n") == 1


def test_cli_default_outfile(small_hf: Path, small_vocab: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["convert", str(small_hf), "--outtype", "q8_0", "--vocab-gguf", str(small_vocab), "-q"]) == 0
    out = default_outfile(small_hf, "q8_0")
    assert out == small_hf / "hf-q8_0.gguf" and out.is_file()
    assert kv(read(out), "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert [p.name for p in small_hf.iterdir() if p.name.endswith(".tmp")] == []


def test_cli_outfile(small_hf: Path, tmp_path: Path, small_vocab: Path) -> None:
    out = tmp_path / "m.gguf"
    assert _cli(["convert", str(small_hf), "-o", str(out), "--outtype", "f32",
                 "--vocab-gguf", str(small_vocab), "--quiet"]) == 0
    assert kv(read(out), "general.file_type") == gguf.LlamaFileType.ALL_F32
