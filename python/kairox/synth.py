"""`kairox synth`: synthetic LLaMA-shaped ReLU models for benchmarks.

Real sparse 7B-70B checkpoints cannot be downloaded here, so speed is measured on
models of the same shapes and types. This first version writes random weights (a
dense-speed baseline: llama.cpp's dense cost depends only on shapes and types); the
activation statistics of real ReLU models are the benchmark issue's addition.

Weights are slices of one seeded random pool (F16 values ~ N(0, 0.02)), so a 12.6 GiB
model is written at disk speed and the same seed gives the same bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

from .checkpoint import HFConfig
from .convert import add_hparams, copy_tokenizer_fields, gguf_vocab_size
from .gguffile import finish_atomically
from .tiny import default_vocab_gguf


@dataclasses.dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    ftype: str          # f16 | f32
    n_ctx_train: int = 4096


PRESETS: dict[str, Shape] = {
    # LLaMA-2-7B / 13B shapes in F16 (~12.6 / ~24 GiB)
    "KB-7B": Shape(32, 4096, 11008, 32, 32, "f16"),
    "KB-13B": Shape(40, 5120, 13824, 40, 40, "f16"),
    # small shapes for CPU benchmarks and tests
    "KB-350M": Shape(24, 1024, 2816, 16, 16, "f16"),
    "KB-tiny": Shape(2, 64, 256, 4, 2, "f32"),
}

POOL_ELEMS = 1 << 28    # 256 Mi values: larger than any single 7B/13B tensor


class SynthError(ValueError):
    pass


def synth(out: str | Path, shape: Shape, *, seed: int = 0, vocab_gguf: Path | None = None,
          act: str = "relu", quiet: bool = False) -> Path:
    import gguf
    from tqdm import tqdm

    out = Path(out)
    vocab_gguf = Path(vocab_gguf or default_vocab_gguf())
    n_vocab = gguf_vocab_size(vocab_gguf)
    dtype = {"f16": np.float16, "f32": np.float32}.get(shape.ftype)
    if dtype is None:
        raise SynthError(f"unsupported type {shape.ftype!r} (f16, f32)")
    head_dim = shape.n_embd // shape.n_head
    if head_dim * shape.n_head != shape.n_embd or shape.n_head % shape.n_head_kv:
        raise SynthError(f"inconsistent heads: n_embd={shape.n_embd} n_head={shape.n_head} "
                         f"n_head_kv={shape.n_head_kv}")
    n_kv = head_dim * shape.n_head_kv

    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(min(POOL_ELEMS, 8 * shape.n_embd * shape.n_ff + n_vocab * shape.n_embd),
                                dtype=np.float32) * 0.02).astype(dtype)

    def rand(shape_: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape_))
        if n > pool.size:
            raise SynthError(f"tensor of {n} values exceeds the random pool")
        off = int(rng.integers(0, pool.size - n + 1))
        return pool[off:off + n].reshape(shape_)

    ones = np.ones(shape.n_embd, np.float32)
    tensors: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (n_vocab, shape.n_embd), "w"),
        ("output_norm.weight", (shape.n_embd,), "one"),
        ("output.weight", (n_vocab, shape.n_embd), "w"),
    ]
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        tensors += [
            (p + "attn_norm.weight", (shape.n_embd,), "one"),
            (p + "attn_q.weight", (shape.n_embd, shape.n_embd), "w"),
            (p + "attn_k.weight", (n_kv, shape.n_embd), "w"),
            (p + "attn_v.weight", (n_kv, shape.n_embd), "w"),
            (p + "attn_output.weight", (shape.n_embd, shape.n_embd), "w"),
            (p + "ffn_norm.weight", (shape.n_embd,), "one"),
            (p + "ffn_gate.weight", (shape.n_ff, shape.n_embd), "w"),
            (p + "ffn_up.weight", (shape.n_ff, shape.n_embd), "w"),
            (p + "ffn_down.weight", (shape.n_embd, shape.n_ff), "w"),
        ]

    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(tmp, "llama")
    cfg = HFConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": shape.n_embd,
        "intermediate_size": shape.n_ff, "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_head_kv,
        "hidden_act": act, "rms_norm_eps": 1e-5, "max_position_embeddings": shape.n_ctx_train,
        "vocab_size": n_vocab}, source="synth preset")
    add_hparams(w, cfg, act, f"kairox-synth {shape.n_layer}x{shape.n_embd} seed {seed}", shape.ftype)
    copy_tokenizer_fields(w, vocab_gguf, n_vocab)
    for name, shp, kind in tensors:
        dt = np.dtype(np.float32) if kind == "one" else np.dtype(dtype)
        w.add_tensor_info(name, shp, dt, int(np.prod(shp)) * dt.itemsize)
    data = (ones if kind == "one" else rand(shp)
            for name, shp, kind in tqdm(tensors, desc=f"synth {out.name}", unit="tensor", disable=quiet))
    return finish_atomically(w, tmp, out, data)


def cmd_synth(args: argparse.Namespace) -> int:
    shape = PRESETS[args.preset]
    if args.type:
        shape = dataclasses.replace(shape, ftype=args.type)
    out = Path(args.outfile or f"{args.preset}-{shape.ftype}.gguf")
    try:
        path = synth(out, shape, seed=args.seed, vocab_gguf=args.vocab_gguf,
                     act=args.act, quiet=args.quiet)
    except SynthError as e:
        print(f"kairox synth: error: {e}", file=sys.stderr)
        return 2
    print(f"kairox synth: wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic LLaMA-shaped ReLU model (benchmarks)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="KB-7B",
                   help="model shape (default: %(default)s)")
    p.add_argument("-o", "--outfile", help="output GGUF (default: PRESET-TYPE.gguf)")
    p.add_argument("--type", choices=["f16", "f32"], help="weight type (default: the preset's)")
    p.add_argument("--act", choices=["relu", "silu"], default="relu",
                   help="FFN activation (default: relu)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--vocab-gguf", type=Path, help="GGUF whose tokenizer to copy (default: LLaMA SPM)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)
