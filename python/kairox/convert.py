"""`kairox convert`: a Hugging Face llama-family checkpoint -> GGUF for kairox's llama.cpp.

Supported: LlamaForCausalLM and MistralForCausalLM (GGUF architecture "llama") with a
relu, silu or gelu FFN. The activation is recorded as `llama.hidden_activation`, which
kairox's patched llama.cpp honours (stock llama.cpp always computes SiLU), so ReLU-fied
checkpoints (ReluLLaMA, ProSparse) run with the activation they were trained with.

Two layout facts drive the conversion:

* GGUF stores a [rows, cols] numpy array with ggml shape {cols, rows}; Hugging Face
  Linear weights are [out_features, in_features], which is exactly the ggml layout
  llama.cpp's matmuls want, so weights are written without transposing.
* transformers' Llama applies RoPE with rotate_half (dimension i of a head is paired with
  i + head_dim/2) while llama.cpp's llama architecture rotates adjacent pairs (2i, 2i+1).
  The Q and K projection rows are therefore regrouped per head (`permute_qk`) so that
  llama.cpp's pairs hold what transformers' pairs held. Attention scores are dot products
  over the whole head, so permuting Q and K rows identically leaves them unchanged.

The output is written to a temporary file next to the destination and renamed into place
only when complete, so an interrupted conversion never leaves a half-written GGUF behind.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import Checkpoint, CheckpointError, HFConfig
from .gguf_header import tensor_nbytes
from .gguffile import encode_tensor, finish_atomically, temp_path_for

# `gguf` and `tqdm` are imported inside the functions that use them: `kairox --help` imports
# this module (kairox.cli.convert builds the subcommand's parser) and should not pay for them.

GGUF_ARCH = "llama"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# transformers' activation name -> the name llama.cpp's llama.hidden_activation accepts.
# llama.cpp's GELU is the tanh approximation: exact for gelu_new / gelu_pytorch_tanh and
# within 1e-3 of the erf form transformers calls "gelu".
HIDDEN_ACTS = {
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
}


class ConvertError(Exception):
    """A checkpoint that cannot be converted; the message says why and what to do."""


# ----------------------------------------------------------------------- tensor layout


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a Q or K projection from rotate_half to adjacent-pair RoPE order.

    Within each head, HF row i (i < head_dim/2) and row i + head_dim/2 form one rotation
    pair; they become rows 2i and 2i+1. `n_head` is the number of heads the rows hold
    (num_key_value_heads for K).
    """
    rows = w.shape[0]
    if rows % n_head != 0 or (rows // n_head) % 2 != 0:
        raise ConvertError(f"cannot split {rows} rows into {n_head} heads of even size for RoPE")
    hd = rows // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: where it comes from and how it is transformed."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]                       # numpy shape, expected in the checkpoint
    transform: Callable[[np.ndarray], np.ndarray] | None = None


def tensor_plan(cfg: HFConfig, has_lm_head: bool) -> list[TensorPlan]:
    d, ff, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    plan = [TensorPlan("token_embd.weight", "model.embed_tokens.weight", (cfg.vocab_size, d))]
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        plan += [
            TensorPlan(b + "attn_norm.weight", p + "input_layernorm.weight", (d,)),
            TensorPlan(b + "attn_q.weight", p + "self_attn.q_proj.weight", (nq * hd, d),
                       lambda w: permute_qk(w, nq)),
            TensorPlan(b + "attn_k.weight", p + "self_attn.k_proj.weight", (nkv * hd, d),
                       lambda w: permute_qk(w, nkv)),
            TensorPlan(b + "attn_v.weight", p + "self_attn.v_proj.weight", (nkv * hd, d)),
            TensorPlan(b + "attn_output.weight", p + "self_attn.o_proj.weight", (d, nq * hd)),
            TensorPlan(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (d,)),
            TensorPlan(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (ff, d)),
            TensorPlan(b + "ffn_up.weight", p + "mlp.up_proj.weight", (ff, d)),
            TensorPlan(b + "ffn_down.weight", p + "mlp.down_proj.weight", (d, ff)),
        ]
    plan.append(TensorPlan("output_norm.weight", "model.norm.weight", (d,)))
    # With tied embeddings llama.cpp reuses token_embd for the output projection when
    # `output.weight` is absent; a checkpoint may still carry a redundant lm_head copy.
    if has_lm_head and not cfg.tie_word_embeddings:
        plan.append(TensorPlan("output.weight", "lm_head.weight", (cfg.vocab_size, d)))
    return plan


def _qtype_for(outtype: str, shape: tuple[int, ...]) -> Any:
    import gguf
    Q = gguf.GGMLQuantizationType
    # Norm weights and other vectors stay F32: they are tiny and llama.cpp expects F32.
    if len(shape) < 2 or outtype == "f32":
        return Q.F32
    if outtype == "f16":
        return Q.F16
    if outtype == "bf16":
        return Q.BF16
    block = gguf.GGML_QUANT_SIZES[Q.Q8_0][0]
    # Q8_0 packs whole rows into 32-value blocks; a row that does not split keeps F16.
    return Q.Q8_0 if shape[-1] % block == 0 else Q.F16


# ------------------------------------------------------------------------------ vocab


@dataclass(frozen=True)
class TokenizerKV:
    """One tokenizer.* key of a GGUF with its exact GGUF value type."""
    name: str
    value: Any
    vtype: Any            # gguf.GGUFValueType
    sub_type: Any = None  # element type of an array


@functools.lru_cache(maxsize=4)
def _tokenizer_kvs_cached(path: str, mtime_ns: int, size: int) -> tuple[TokenizerKV, ...]:
    # Parsing a 32000-token vocabulary with GGUFReader takes about a second; tests convert
    # many tiny models with the same vocabulary, so the parse is cached per file version.
    import gguf
    T = gguf.GGUFValueType
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises assorted errors on a bad file
        raise ConvertError(f"{path} is not a readable GGUF file ({e})") from e
    out: list[TokenizerKV] = []
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        main = f.types[0]
        if main == T.ARRAY:
            if len(f.types) != 2:
                raise ConvertError(f"{path}: {name} is a nested array, which cannot be copied")
            sub = f.types[1]
            if sub == T.STRING:  # raw bytes: token texts need not be valid UTF-8
                val: Any = [bytes(f.parts[i]) for i in f.data]
            else:
                val = list(f.contents())
            if val:  # GGUF cannot store an empty array
                out.append(TokenizerKV(name, val, main, sub))
        elif main == T.STRING:
            out.append(TokenizerKV(name, bytes(f.parts[f.data[0]]), main))
        else:
            out.append(TokenizerKV(name, f.contents(), main))
    return tuple(out)


def tokenizer_kvs(vocab_gguf: str | Path) -> tuple[TokenizerKV, ...]:
    """Every `tokenizer.*` key of a GGUF, with its exact value type."""
    p = Path(vocab_gguf)
    if not p.is_file():
        raise ConvertError(f"vocab GGUF {p} does not exist")
    st = p.stat()
    return _tokenizer_kvs_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


def gguf_vocab_size(vocab_gguf: str | Path) -> int:
    """Number of tokens in a GGUF's tokenizer.ggml.tokens."""
    for kv in tokenizer_kvs(vocab_gguf):
        if kv.name == "tokenizer.ggml.tokens":
            return len(kv.value)
    raise ConvertError(f"{vocab_gguf} holds no tokenizer (no tokenizer.ggml.tokens)")


def copy_tokenizer_fields(writer: Any, vocab_gguf: Path, n_vocab: int) -> None:
    """Copy every `tokenizer.*` key of an existing GGUF, keeping value types exactly."""
    n = gguf_vocab_size(vocab_gguf)
    if n != n_vocab:
        raise ConvertError(f"{vocab_gguf} has {n} tokens but the checkpoint's vocab_size is "
                           f"{n_vocab}; use the vocabulary the model was trained with")
    for kv in tokenizer_kvs(vocab_gguf):
        writer.add_key_value(kv.name, kv.value, kv.vtype, sub_type=kv.sub_type)


def _add_hf_vocab(writer: Any, hf_dir: Path, n_vocab: int, quiet: bool) -> None:
    """Vocabulary from the checkpoint's tokenizer.model (SentencePiece) or tokenizer.json (BPE)."""
    import gguf
    from gguf import vocab as gvocab

    vocab: Any
    if (hf_dir / "tokenizer.model").is_file():
        if gvocab.SentencePieceProcessor is None:
            raise ConvertError("the checkpoint's tokenizer.model needs the sentencepiece package: "
                               "`pip install sentencepiece`, or pass --vocab-gguf FILE")
        try:
            vocab = gvocab.SentencePieceVocab(hf_dir)
        except Exception as e:
            raise ConvertError(f"cannot read {hf_dir / 'tokenizer.model'}: {e}") from e
    elif (hf_dir / "tokenizer.json").is_file():
        try:
            vocab = gvocab.BpeVocab(hf_dir)
        except FileNotFoundError:
            raise ConvertError(f"{hf_dir / 'tokenizer.json'} is not a byte-level BPE tokenizer; "
                               f"provide tokenizer.model or pass --vocab-gguf FILE") from None
        except (ValueError, KeyError, OSError) as e:
            raise ConvertError(f"cannot read {hf_dir / 'tokenizer.json'}: {e}") from e
    else:
        raise ConvertError(f"{hf_dir} has no tokenizer.model or tokenizer.json; "
                           f"pass --vocab-gguf FILE (a GGUF with the model's vocabulary)")

    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(float(score))
        types.append(int(ttype))
    if len(tokens) > n_vocab:
        raise ConvertError(f"the tokenizer has {len(tokens)} tokens but the embedding only "
                           f"{n_vocab} rows; the tokenizer does not belong to this checkpoint")
    # Embeddings are often padded past the tokenizer (to a multiple of 64 or 128): the
    # extra rows get placeholder tokens that tokenization never produces.
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gvocab.SpecialVocab(hf_dir, load_merges=isinstance(vocab, gvocab.BpeVocab),
                                  n_vocab=n_vocab)
    special.add_to_gguf(writer, quiet=quiet)


# ---------------------------------------------------------------------------- convert


def _check_config(cfg: HFConfig) -> str:
    """Validate what the llama architecture can run; returns the GGUF activation name."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConvertError(f"unsupported architecture {cfg.architecture!r} "
                           f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    act = HIDDEN_ACTS.get(cfg.hidden_act)
    if act is None:
        raise ConvertError(f"unsupported hidden_act {cfg.hidden_act!r} "
                           f"(supported: {', '.join(sorted(HIDDEN_ACTS))})")
    if cfg.head_size % 2 != 0:
        raise ConvertError(f"head dimension {cfg.head_size} is odd; RoPE needs pairs")
    if cfg.rope_scaling:
        kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
        if kind not in ("linear", "default"):
            raise ConvertError(f"unsupported rope_scaling type {kind!r} (only linear)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.raw.get(key):
            raise ConvertError(f"{key} = true is not supported (llama weights have no biases)")
    return act


def add_hparams(writer: Any, cfg: HFConfig, act: str | None, name: str, outtype: str) -> None:
    """The architecture's hyperparameters; `act` None writes no hidden activation (a key only
    the llama architecture reads)."""
    import gguf
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype]
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_size * cfg.num_attention_heads != cfg.hidden_size:
        # llama.cpp derives the head size as n_embd / n_head unless told otherwise
        writer.add_key_length(cfg.head_size)
        writer.add_value_length(cfg.head_size)
    writer.add_rope_dimension_count(cfg.head_size)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_act = getattr(writer, "add_hidden_act", None)
    if act is not None and add_act is not None:
        add_act(act)
    elif act is not None:  # gguf releases without the helper: same key, written directly
        writer.add_string(f"{GGUF_ARCH}.hidden_activation", act)


def default_outfile(hf_dir: str | Path, outtype: str) -> Path:
    hf_dir = Path(hf_dir)
    return hf_dir / f"{hf_dir.resolve().name}-{outtype}.gguf"


def convert(hf_dir: str | Path, out_path: str | Path, outtype: str = "f16",
            vocab_gguf: str | Path | None = None, quiet: bool = False) -> Path:
    """Convert the checkpoint in `hf_dir` to a GGUF at `out_path`; returns `out_path`."""
    import gguf
    from tqdm import tqdm

    outtype = outtype.lower()
    if outtype not in OUTTYPES:
        raise ConvertError(f"unsupported outtype {outtype!r} (supported: {', '.join(OUTTYPES)})")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    try:
        ckpt = Checkpoint(hf_dir)
    except CheckpointError as e:
        raise ConvertError(str(e)) from e
    cfg = ckpt.config
    act = _check_config(cfg)

    plan = tensor_plan(cfg, has_lm_head="lm_head.weight" in ckpt)
    used = {t.hf_name for t in plan} | {"lm_head.weight"}
    extra = [n for n in ckpt.names if n not in used and not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise ConvertError(f"unexpected tensor {extra[0]!r} in the checkpoint "
                           f"({len(extra)} in all); it is not part of the llama architecture")
    if "lm_head.weight" not in ckpt and not cfg.tie_word_embeddings:
        raise ConvertError("the checkpoint has no lm_head.weight and tie_word_embeddings is false")
    for t in plan:
        got = ckpt.info(t.hf_name).shape if t.hf_name in ckpt else None
        if got is None:
            raise ConvertError(f"tensor {t.hf_name!r} is missing from the checkpoint")
        if got != t.shape:
            raise ConvertError(f"tensor {t.hf_name!r} has shape {list(got)} but config.json "
                               f"implies {list(t.shape)}")

    if not out_path.parent.is_dir():
        raise ConvertError(f"output directory {out_path.parent} does not exist")
    tmp = temp_path_for(out_path)
    # Nothing touches the disk before finish_atomically writes the header.
    writer = gguf.GGUFWriter(tmp, GGUF_ARCH)
    name = str(cfg.raw.get("_name_or_path") or hf_dir.resolve().name)
    add_hparams(writer, cfg, act, name, outtype)
    if vocab_gguf is not None:
        copy_tokenizer_fields(writer, Path(vocab_gguf), cfg.vocab_size)
    else:
        _add_hf_vocab(writer, hf_dir, cfg.vocab_size, quiet)

    # Stream: declare every tensor up front, then encode and write one at a time, so
    # memory holds a single tensor rather than the whole model.
    qtypes = [_qtype_for(outtype, t.shape) for t in plan]
    for t, q in zip(plan, qtypes):
        writer.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), tensor_nbytes(t.shape, q),
                               raw_dtype=q)

    def encoded():
        for t, q in tqdm(list(zip(plan, qtypes)), desc="converting", unit="tensor",
                         disable=quiet, file=sys.stderr):
            w = np.asarray(ckpt.tensor(t.hf_name), dtype=np.float32)
            if t.transform is not None:
                w = t.transform(w)
            try:
                yield encode_tensor(w, q, t.hf_name)
            except ValueError as e:
                raise ConvertError(str(e)) from None
    finish_atomically(writer, tmp, out_path, encoded())
    return out_path
