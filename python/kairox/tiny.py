"""Tiny random Hugging Face llama checkpoints, for tests that need a real model quickly.

`make_tiny_checkpoint` writes config.json + model.safetensors of a LlamaForCausalLM with
random weights, deterministic in `seed`. The weights are scaled for a well-behaved
forward pass: activations stay O(1) through the layers and the logits have a spread of a
few units, so greedy decoding does not collapse onto ties.

How a ReLU model is made sparse without biases. The llama architecture has no bias
terms, so a negative offset on the FFN gate needs a constant input to multiply. Embedding
channel 0 is that constant ("bias channel"): every token's embedding holds the same
positive value there, and the attention and FFN output projections never write into it
(row 0 of o_proj and down_proj is zero), so it reaches every layer's RMSNorm unchanged
relative to the token-dependent channels. Column 0 of each gate_proj then works as a
per-neuron bias. It is calibrated layer by layer on a forward pass over random tokens:
the offset is `relu_bias` standard deviations of the gate's token-dependent part, which
leaves about Phi(relu_bias) of the neurons active (Phi(-1.1) = 14%, i.e. ~86% zeros).
The same pass rescales each down_proj so the FFN adds a unit-RMS update to the residual.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from .checkpoint import HFConfig, write_safetensors

VOCAB_FILE_NAME = "ggml-vocab-llama-spm.gguf"
_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}

# Standard deviation of the logits (final RMSNorm output has unit RMS).
_LOGIT_STD = 3.0
# Standard deviation of q and k entries: q.k / sqrt(head_dim) then has std ~ _QK_STD^2,
# enough for attention to be far from uniform, so RoPE's effect is visible in the output.
_QK_STD = 1.3
# Tokens of the calibration pass.
_N_CALIB = 64


def default_vocab_gguf() -> Path:
    """The GGUF vocabulary tiny models are converted with (llama SentencePiece, 32000 tokens).

    Looked up in order: $KAIROX_VOCAB_GGUF, the copy installed with the package,
    vendor/llama.cpp/models/ in a source checkout.
    """
    env = os.environ.get("KAIROX_VOCAB_GGUF")
    if env:
        p = Path(env)
        if not p.is_file():
            raise FileNotFoundError(f"KAIROX_VOCAB_GGUF={env} does not name a file")
        return p
    pkg = Path(__file__).resolve().parent
    candidates = [pkg / "data" / VOCAB_FILE_NAME,
                  pkg.parent.parent / "vendor" / "llama.cpp" / "models" / VOCAB_FILE_NAME]
    for p in candidates:
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"no {VOCAB_FILE_NAME} found (looked in {', '.join(str(c) for c in candidates)}); "
        f"set KAIROX_VOCAB_GGUF to a GGUF holding a llama vocabulary")


def vocab_size_of(vocab_gguf: str | Path) -> int:
    """Number of tokens in a GGUF's tokenizer.ggml.tokens."""
    from .convert import gguf_vocab_size
    return gguf_vocab_size(vocab_gguf)


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    hidden_act: str = "relu",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 256,
    vocab_size: int | None = None,
    dtype: str = "f32",
    seed: int = 0,
    tie_embeddings: bool = False,
    relu_bias: float = -1.1,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-5,
    max_position_embeddings: int = 512,
    architecture: str = "LlamaForCausalLM",
) -> Path:
    """Write a random LlamaForCausalLM checkpoint to `out_dir`; returns `out_dir`.

    vocab_size defaults to that of `default_vocab_gguf()`, the vocabulary the model is
    meant to be converted with. relu_bias: ReLU gate offset in standard deviations of the
    gate pre-activation (see the module docstring); other activations get no offset.
    """
    from .reference import ACTIVATIONS, LayerWeights, LlamaReference

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {', '.join(sorted(ACTIVATIONS))}, got {hidden_act!r}")
    if n_embd % n_head or n_head % n_head_kv or (n_embd // n_head) % 2:
        raise ValueError(f"need n_embd ({n_embd}) divisible by n_head ({n_head}) into an even "
                         f"head size, and n_head divisible by n_head_kv ({n_head_kv})")
    if vocab_size is None:
        vocab_size = vocab_size_of(default_vocab_gguf())

    cfg = HFConfig(
        architectures=(architecture,), hidden_size=n_embd, intermediate_size=n_ff,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head_kv,
        hidden_act=hidden_act, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings, vocab_size=vocab_size,
        tie_word_embeddings=tie_embeddings, torch_dtype={"f32": "float32", "f16": "float16",
                                                          "bf16": "bfloat16"}[dtype])
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return rng.standard_normal(shape) * std

    # Token-dependent channels ~ N(0, 1); the bias channel holds a quarter of the energy.
    embed = normal((vocab_size, n_embd), 1.0)
    embed[:, 0] = math.sqrt((n_embd - 1) / 3)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        wo = normal((n_embd, n_head * hd), 1.0 / math.sqrt(n_head * hd))
        wo[0] = 0.0  # keep the bias channel constant
        w.update({
            # Norm weights away from 1 so that a norm applied wrongly would show.
            p + "input_layernorm.weight": rng.uniform(0.8, 1.2, n_embd),
            p + "self_attn.q_proj.weight": normal((n_head * hd, n_embd), _QK_STD / math.sqrt(n_embd)),
            p + "self_attn.k_proj.weight": normal((n_head_kv * hd, n_embd), _QK_STD / math.sqrt(n_embd)),
            p + "self_attn.v_proj.weight": normal((n_head_kv * hd, n_embd), 1.0 / math.sqrt(n_embd)),
            p + "self_attn.o_proj.weight": wo,
            p + "post_attention_layernorm.weight": rng.uniform(0.8, 1.2, n_embd),
            p + "mlp.gate_proj.weight": normal((n_ff, n_embd), 1.0 / math.sqrt(n_embd)),
            p + "mlp.up_proj.weight": normal((n_ff, n_embd), 1.0 / math.sqrt(n_embd)),
            p + "mlp.down_proj.weight": normal((n_embd, n_ff), 1.0 / math.sqrt(n_ff)),
        })
    w["model.norm.weight"] = rng.uniform(0.8, 1.2, n_embd)
    if not tie_embeddings:
        w["lm_head.weight"] = normal((vocab_size, n_embd), _LOGIT_STD / math.sqrt(n_embd))
    calib_tokens = rng.integers(0, vocab_size, _N_CALIB)

    # Calibrate each layer's FFN on the forward pass of the layers before it.
    ref = LlamaReference(cfg, w)
    act = ACTIVATIONS[hidden_act]

    def calibrate(il: int, h: np.ndarray, lw: LayerWeights) -> None:
        if hidden_act == "relu":
            lw.w_gate[:, 0] = 0.0
            spread = float(np.std(h @ lw.w_gate.T))
            # h[:, 0] is the normalised bias channel: nearly the same for every token
            lw.w_gate[:, 0] = relu_bias * spread / float(np.mean(h[:, 0]))
        a = act(h @ lw.w_gate.T) * (h @ lw.w_up.T)
        lw.w_down *= 1.0 / max(float(np.sqrt(np.mean(a * a))), 1e-6)
        lw.w_down[0] = 0.0  # keep the bias channel constant

    ref._forward(calib_tokens, ffn_input_hook=calibrate)
    for i, lw in enumerate(ref.layers):  # the reference holds the calibrated copies
        w[f"model.layers.{i}.mlp.gate_proj.weight"] = lw.w_gate
        w[f"model.layers.{i}.mlp.down_proj.weight"] = lw.w_down

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    write_safetensors(out / "model.safetensors", w, dtype=_DTYPES[dtype],
                      metadata={"format": "pt"})
    return out
