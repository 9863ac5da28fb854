"""The numpy reference forward pass and the tiny checkpoint generator."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kairox.checkpoint import Checkpoint, HFConfig
from kairox.reference import ACTIVATIONS, LlamaReference, rope_hf
from kairox.tiny import default_vocab_gguf, make_tiny_checkpoint

SMALL = 300
TOKENS = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 3575, 338]


@pytest.fixture(scope="module")
def relu_ref(tiny_relu_hf: Path) -> LlamaReference:
    return LlamaReference.from_checkpoint(tiny_relu_hf)


@pytest.fixture(scope="module")
def silu_ref(tiny_silu_hf: Path) -> LlamaReference:
    return LlamaReference.from_checkpoint(tiny_silu_hf)


def test_logits_shape_and_causality(relu_ref: LlamaReference) -> None:
    full = relu_ref.logits(TOKENS)
    assert full.shape == (len(TOKENS), 32000) and full.dtype == np.float64
    # a position never sees later tokens
    np.testing.assert_allclose(relu_ref.logits(TOKENS[:5]), full[:5], rtol=0, atol=1e-10)


@pytest.mark.parametrize("which", ["relu", "silu"])
def test_logits_are_well_spread(which: str, relu_ref: LlamaReference, silu_ref: LlamaReference) -> None:
    logits = (relu_ref if which == "relu" else silu_ref).logits(TOKENS)
    std = logits.std(axis=1)
    assert (std > 1.5).all() and (std < 10).all()
    top2 = np.sort(logits, axis=1)[:, -2:]
    # argmax is decided by a margin far above float32 noise
    assert (top2[:, 1] - top2[:, 0] > 1e-3).all()
    # the prediction depends on context, not only on the current token
    assert len(set(np.argmax(logits, axis=1).tolist())) > len(TOKENS) // 2


def test_relu_sparsity(relu_ref: LlamaReference, silu_ref: LlamaReference) -> None:
    acts = relu_ref.ffn_activations(TOKENS)
    assert len(acts) == 2 and all(a.shape == (len(TOKENS), 256) for a in acts)
    for a in acts:
        zeros = (a == 0).mean(axis=1)  # per token
        assert 0.7 < zeros.mean() < 0.95, zeros.mean()
        assert (zeros > 0.5).all()
        assert 0.2 < math.sqrt((a * a).mean()) < 5       # O(1) values, not vanishing
    # SiLU has no exact zeros
    assert all((a == 0).mean() == 0 for a in silu_ref.ffn_activations(TOKENS))


def test_greedy(relu_ref: LlamaReference) -> None:
    out = relu_ref.greedy(TOKENS[:4], 6)
    assert len(out) == 6
    assert out[0] == int(np.argmax(relu_ref.logits(TOKENS[:4])[-1]))
    assert out[1] == int(np.argmax(relu_ref.logits(TOKENS[:4] + out[:1])[-1]))


def test_bad_tokens(relu_ref: LlamaReference) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        relu_ref.logits([1, 32000])
    with pytest.raises(ValueError, match="non-empty"):
        relu_ref.logits([])


def test_rope_properties() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 2, 8))
    k = rng.standard_normal((6, 2, 8))
    pos = np.arange(6)
    rq, rk = rope_hf(q, pos, 10000.0), rope_hf(k, pos, 10000.0)
    np.testing.assert_allclose(rq[0], q[0])                              # position 0: identity
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1))
    # scores depend only on the relative position: shift both by 3
    shifted_q = rope_hf(q, pos + 3, 10000.0)
    shifted_k = rope_hf(k, pos + 3, 10000.0)
    np.testing.assert_allclose(np.einsum("thd,shd->hts", shifted_q, shifted_k),
                               np.einsum("thd,shd->hts", rq, rk), atol=1e-12)
    # linear scaling is position interpolation
    np.testing.assert_allclose(rope_hf(q, pos, 500.0, scale=2.0), rope_hf(q, pos / 2, 500.0))


def test_activations() -> None:
    x = np.linspace(-30, 30, 2001)
    erf_gelu = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert np.abs(ACTIVATIONS["gelu"](x) - erf_gelu).max() < 1e-3
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        silu = ACTIVATIONS["silu"](np.array([-1e4, -30.0, 0.0, 30.0, 1e4]))
    np.testing.assert_allclose(silu, [0.0, -30 / (1 + math.exp(30)), 0.0, 30 / (1 + math.exp(-30)), 1e4])
    np.testing.assert_array_equal(ACTIVATIONS["relu"](np.array([-1.0, 0.0, 2.0])), [0, 0, 2])


def test_gqa_equals_mha_with_repeated_kv(tiny_hf: Callable[..., Path]) -> None:
    """Query head j reads KV head j // (n_head / n_head_kv), as transformers' repeat_kv."""
    ck = Checkpoint(tiny_hf(hidden_act="silu", vocab_size=SMALL))
    cfg = ck.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    group, hd = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_size
    w = {n: np.array(ck.tensor(n)) for n in ck.names}
    mha = dict(w)
    for n in list(w):
        if n.endswith(("k_proj.weight", "v_proj.weight")):
            heads = w[n].reshape(cfg.num_key_value_heads, hd, -1)
            mha[n] = np.repeat(heads, group, axis=0).reshape(cfg.num_attention_heads * hd, -1)
    mha_cfg = HFConfig.from_dict({**cfg.to_dict(), "num_key_value_heads": cfg.num_attention_heads})
    toks = [5, 17, 99, 3, 250, 42, 7]
    np.testing.assert_allclose(LlamaReference(mha_cfg, mha).logits(toks),
                               LlamaReference(cfg, w).logits(toks), rtol=0, atol=1e-10)


def test_tied_embeddings(tiny_hf: Callable[..., Path]) -> None:
    hf = tiny_hf(hidden_act="relu", n_layer=1, tie_embeddings=True, vocab_size=SMALL)
    assert "lm_head.weight" not in Checkpoint(hf)
    ref = LlamaReference.from_checkpoint(hf)
    assert ref.lm_head is ref.embed
    assert ref.logits([1, 2, 3]).shape == (3, SMALL)


def test_tiny_is_deterministic(tmp_path: Path) -> None:
    kw = dict(n_layer=1, vocab_size=SMALL, n_ff=64)
    a = make_tiny_checkpoint(tmp_path / "a", seed=3, **kw) / "model.safetensors"
    b = make_tiny_checkpoint(tmp_path / "b", seed=3, **kw) / "model.safetensors"
    c = make_tiny_checkpoint(tmp_path / "c", seed=4, **kw) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_tiny_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_checkpoint(tmp_path, dtype="f8", vocab_size=SMALL)
    with pytest.raises(ValueError, match="hidden_act"):
        make_tiny_checkpoint(tmp_path, hidden_act="tanh", vocab_size=SMALL)
    with pytest.raises(ValueError, match="n_head"):
        make_tiny_checkpoint(tmp_path, n_embd=60, n_head=8, vocab_size=SMALL)


def test_default_vocab_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, vocab_gguf: Path) -> None:
    monkeypatch.setenv("KAIROX_VOCAB_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="KAIROX_VOCAB_GGUF"):
        default_vocab_gguf()
    monkeypatch.setenv("KAIROX_VOCAB_GGUF", str(vocab_gguf))
    assert default_vocab_gguf() == vocab_gguf
