"""A numpy reference forward pass of the llama architecture, from a Hugging Face checkpoint.

It reads the weights in Hugging Face's layout and applies RoPE the way transformers'
LlamaAttention does (rotate_half: dimension i of a head is paired with i + head_dim/2),
i.e. *before* the row permutation that `kairox.convert` applies for llama.cpp. Agreement
between this and llama.cpp running the converted GGUF therefore checks the conversion
end to end, the Q/K permutation included.

Everything is computed in float64 so that the reference's own rounding error is
negligible next to llama.cpp's float32 arithmetic. It holds all weights in memory as
float64: it is meant for the small checkpoints tests use, not for real models.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import Checkpoint, HFConfig


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), written with exp(-|x|) so large |x| neither overflows nor loses x
    e = np.exp(-np.abs(x))
    sig = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return x * sig


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    # The tanh approximation, which is what llama.cpp's GELU computes (transformers'
    # "gelu" is the erf form; the two differ by < 1e-3 over the whole real line).
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": _relu,
    "silu": _silu,
    "swish": _silu,
    "gelu": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
}


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotate_half(x: np.ndarray) -> np.ndarray:
    """[x1, x2] -> [-x2, x1] over the last axis (halves, not adjacent pairs)."""
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope_hf(x: np.ndarray, positions: np.ndarray, theta: float, scale: float = 1.0) -> np.ndarray:
    """Rotary embedding as transformers applies it to x [n_tokens, n_heads, head_dim].

    Pair i (dims i and i + head_dim/2) turns by angle pos * theta^(-2i/head_dim);
    `scale` > 1 is linear position interpolation (positions divided by it).
    """
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)          # [d/2]
    ang = (positions.astype(np.float64) / scale)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None, :]      # [T, 1, d]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None, :]
    return x * cos + rotate_half(x) * sin


@dataclass
class LayerWeights:
    """One decoder layer, HF layout: projections are [out_features, in_features]."""

    attn_norm: np.ndarray   # [n_embd]
    wq: np.ndarray          # [n_head * head_dim, n_embd]
    wk: np.ndarray          # [n_head_kv * head_dim, n_embd]
    wv: np.ndarray          # [n_head_kv * head_dim, n_embd]
    wo: np.ndarray          # [n_embd, n_head * head_dim]
    ffn_norm: np.ndarray    # [n_embd]
    w_gate: np.ndarray      # [n_ff, n_embd]
    w_up: np.ndarray        # [n_ff, n_embd]
    w_down: np.ndarray      # [n_embd, n_ff]


# Called with (layer index, ffn_norm output [n_tokens, n_embd], that layer's weights)
# just before the FFN runs; it may modify the weights in place.
FfnInputHook = Callable[[int, np.ndarray, LayerWeights], None]


class LlamaReference:
    """Reference llama forward pass (LlamaForCausalLM / MistralForCausalLM semantics)."""

    def __init__(self, config: HFConfig, weights: Mapping[str, np.ndarray]) -> None:
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} "
                             f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        scaling = config.rope_scaling
        self.rope_scale = 1.0
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "linear":
                self.rope_scale = float(scaling["factor"])
            elif kind != "default":
                raise ValueError(f"unsupported rope_scaling {scaling!r} (only linear)")
        self.config = config
        self.act = ACTIVATIONS[config.hidden_act]

        def get(name: str) -> np.ndarray:
            if name not in weights:
                raise KeyError(f"reference: weight {name!r} is missing")
            return np.array(weights[name], dtype=np.float64)

        self.embed = get("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                attn_norm=get(p + "input_layernorm.weight"),
                wq=get(p + "self_attn.q_proj.weight"),
                wk=get(p + "self_attn.k_proj.weight"),
                wv=get(p + "self_attn.v_proj.weight"),
                wo=get(p + "self_attn.o_proj.weight"),
                ffn_norm=get(p + "post_attention_layernorm.weight"),
                w_gate=get(p + "mlp.gate_proj.weight"),
                w_up=get(p + "mlp.up_proj.weight"),
                w_down=get(p + "mlp.down_proj.weight"),
            ))
        self.norm = get("model.norm.weight")
        if "lm_head.weight" in weights:
            self.lm_head = get("lm_head.weight")
        elif config.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            raise KeyError("reference: lm_head.weight is missing and tie_word_embeddings is false")

    @classmethod
    def from_checkpoint(cls, hf_dir: str | Path) -> LlamaReference:
        ckpt = Checkpoint(hf_dir)
        weights = {n: ckpt.tensor(n) for n in ckpt.names if not n.endswith("rotary_emb.inv_freq")}
        return cls(ckpt.config, weights)

    # ------------------------------------------------------------------- forward

    def _attention(self, h: np.ndarray, lw: LayerWeights) -> np.ndarray:
        cfg = self.config
        n_tok = h.shape[0]
        hd = cfg.head_size
        n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        pos = np.arange(n_tok)
        q = (h @ lw.wq.T).reshape(n_tok, n_head, hd)
        k = (h @ lw.wk.T).reshape(n_tok, n_kv, hd)
        v = (h @ lw.wv.T).reshape(n_tok, n_kv, hd)
        q = rope_hf(q, pos, cfg.rope_theta, self.rope_scale)
        k = rope_hf(k, pos, cfg.rope_theta, self.rope_scale)
        # grouped-query attention: query head j reads kv head j // (n_head / n_kv)
        group = n_head // n_kv
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)     # [head, query, key]
        future = np.triu(np.ones((n_tok, n_tok), dtype=bool), k=1)
        scores = np.where(future[None], -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("hts,shd->thd", p, v).reshape(n_tok, n_head * hd)
        return out @ lw.wo.T

    def _forward(self, tokens: Sequence[int], ffn_input_hook: FfnInputHook | None = None,
                 layer_out_hook: Callable[[int, np.ndarray], None] | None = None,
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(final hidden states after the output norm [n_tokens, n_embd], FFN activations per layer)."""
        toks = np.asarray(list(tokens), dtype=np.int64)
        if toks.ndim != 1 or toks.size == 0:
            raise ValueError("tokens must be a non-empty sequence of token ids")
        vocab = self.embed.shape[0]
        bad = toks[(toks < 0) | (toks >= vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab})")
        eps = self.config.rms_norm_eps
        x = self.embed[toks]
        acts: list[np.ndarray] = []
        for il, lw in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, lw.attn_norm, eps), lw)
            h = rms_norm(x, lw.ffn_norm, eps)
            if ffn_input_hook is not None:
                ffn_input_hook(il, h, lw)
            a = self.act(h @ lw.w_gate.T) * (h @ lw.w_up.T)
            acts.append(a)
            x = x + a @ lw.w_down.T
            if layer_out_hook is not None:
                layer_out_hook(il, x)  # the residual stream after the layer (llama.cpp's l_out)
        return rms_norm(x, self.norm, eps), acts

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits at every position, [n_tokens, vocab] float64."""
        h, _ = self._forward(tokens)
        return h @ self.lm_head.T

    def ffn_activations(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """Per layer, the FFN hidden values act(gate x) * (up x), [n_tokens, n_ff] float64.

        These are what the down projection multiplies; their exact zeros (ReLU models)
        are the neurons a sparse FFN may skip.
        """
        _, acts = self._forward(tokens)
        return acts

    def greedy(self, prompt: Sequence[int], n_new: int) -> list[int]:
        """Greedy continuation of `prompt`: the `n_new` argmax tokens, recomputing from scratch."""
        toks = list(prompt)
        out: list[int] = []
        for _ in range(n_new):
            h, _ = self._forward(toks)
            nxt = int(np.argmax(h[-1] @ self.lm_head.T))
            out.append(nxt)
            toks.append(nxt)
        return out
