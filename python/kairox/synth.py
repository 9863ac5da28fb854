"""`kairox synth`: synthetic LLaMA-shaped models for benchmarks, sparse and predictable with ReLU.

Real sparse 7B-70B checkpoints cannot be downloaded here, so speed is measured on
models of the same shapes and types. Most weights are slices of one seeded random pool
(values ~ N(0, 0.02)), so a 12.6 GiB model is written at disk speed and the same seed
gives the same bytes. With --act silu that is the whole model: a dense-speed baseline
(llama.cpp's dense cost depends only on shapes and types).

With --act relu (the default) the FFN behaves like a sparse ReLU model's: a fraction S
(--sparsity, default 0.89) of the FFN activations is exactly zero, and which ones is
predictable from a low-rank view of the gate. The llama architecture has no biases, so
the model carries its own (as kairox.tiny does):

* Bias channel. Residual channel 0 holds the same value c_e = σ_e·sqrt((n_embd−1)/3) in
  every token's embedding (σ_e = 0.02, the other entries' std). It then carries a quarter
  of the row's energy, so after RMSNorm it equals x̂₀ = sqrt(n_embd)/2 for every token and
  the other channels are ≈ N(0, 3/4).
* Quiet layers. Attention and FFN add updates of at most ~1% of the embedding's RMS:
  v and output, up and down projections are all scaled by one factor s from the shapes
  (0.0076 for KB-7B), the reduction split evenly between the two projections of a block
  so that F16 weights stay clear of subnormals. The output projections' row 0 is zero.
  So the residual stream stays ≈ the embedding, and channel 0 constant, in every layer.
* Low-rank gate with a bias column. ffn_gate [n_ff, n_embd] is U·V on the token channels
  (U [n_ff, R−1], V [R−1, n_embd−1] Gaussian, each row scaled to entry RMS 0.02) plus
  dense noise of 10% of that (from the pool), and column 0 is the bias
  W[i,0] = −z·σ_i / x̂₀, where σ_i = ‖W[i,1:]‖·sqrt(3/4) is the std of the row's token
  part applied to x̂ and z = Φ⁻¹(S). The gate pre-activation is then N(−z·σ_i, σ_i²),
  so P(gate > 0) = 1 − S. R (--gate-rank, default n_embd/16) counts the bias direction:
  the gate is exactly rank R plus noise. The sketch predictor (kairox pack) assumes an
  isotropic x̂ and cannot know that channel 0 is constant; with the bias column among the
  R directions, a sketch of rank ≥ R keeps it, and its error is the noise alone.

Norm weights are 1; q, k and the output head are pool slices as in the dense model.
Measured on KB-350M (64 random tokens, real forward pass): 88.4-89.3% zeros in every
layer; the default sketch (rank 64, margin 3) has recall >= 0.9999 at 1.65-1.71x
over-prediction.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from collections.abc import Callable
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
POOL_STD = 0.02         # std of the pool's values, hence of most weights and the embedding

DEFAULT_SPARSITY = 0.89
# Each layer's attention and FFN update: this fraction of the embedding's RMS (an upper
# bound: the estimates below assume the largest update the shapes allow).
UPDATE_RATIO = 0.01
# Dense noise on the gate, relative to the low-rank part's entries.
GATE_NOISE = 0.1


class SynthError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class SparseFFN:
    """How a ReLU model's FFN is made sparse and predictable (module docstring)."""
    sparsity: float = DEFAULT_SPARSITY  # target fraction of zero FFN activations, in (0, 1)
    gate_rank: int | None = None        # rank of the gate incl. the bias channel; None: n_embd // 16

    def rank_for(self, shape: Shape) -> int:
        limit = min(shape.n_ff, shape.n_embd)
        rank = min(max(2, shape.n_embd // 16), limit) if self.gate_rank is None else self.gate_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 2 <= rank <= limit:
            raise SynthError(f"gate rank must be an integer in 2..{limit} (one direction is the "
                             f"bias channel; min of n_ff {shape.n_ff} and n_embd {shape.n_embd}), "
                             f"got {rank!r}")
        return rank

    def check(self) -> None:
        if not (isinstance(self.sparsity, (int, float)) and 0 < self.sparsity < 1):
            raise SynthError(f"sparsity must be a fraction strictly between 0 and 1, got {self.sparsity!r}")


def sparse_gate(rng: np.random.Generator, noise: np.ndarray, rank: int, sparsity: float) -> np.ndarray:
    """A ReLU gate [n_ff, n_embd] float32 with P(gate > 0) = 1 − sparsity for bias-channel
    inputs (module docstring). `noise` [n_ff, n_embd]: the dense noise to add."""
    n_ff, n_embd = noise.shape
    u = rng.standard_normal((n_ff, rank - 1), dtype=np.float32)  # rank − 1 token directions
    v = rng.standard_normal((rank - 1, n_embd), dtype=np.float32)
    v[:, 0] = 0.0  # ... on the token channels; the bias channel is the last direction
    gate = u @ v
    # Every row gets entry RMS POOL_STD, like the dense weights, so that all neurons have
    # the same spread; the bias below adapts to each row's actual spread anyway.
    norms = np.sqrt(np.einsum("ij,ij->i", gate, gate))
    gate *= (POOL_STD * math.sqrt(n_embd - 1) / np.maximum(norms, 1e-30))[:, None]
    np.add(gate, noise, out=gate)
    gate[:, 0] = 0.0
    # x̂ on the token channels has variance 3n/(4(n−1)) (3/4 of the energy over n−1
    # channels) and x̂₀ = sqrt(n)/2, so the bias column puts the gate's mean z·σ_i below 0.
    sigma = np.sqrt(np.einsum("ij,ij->i", gate, gate) * (3 * n_embd / (4 * (n_embd - 1))))
    gate[:, 0] = -statistics.NormalDist().inv_cdf(sparsity) * sigma / (math.sqrt(n_embd) / 2)
    return gate


def synth(out: str | Path, shape: Shape, *, seed: int = 0, vocab_gguf: Path | None = None,
          act: str = "relu", sparse: SparseFFN | None = None, quiet: bool = False) -> Path:
    """Write a synthetic model of `shape`; returns its path.

    With act "relu" the FFN is sparse and predictable as `sparse` says (default SparseFFN());
    with "silu" all weights are random and `sparse` must be None.
    """
    import gguf
    from tqdm import tqdm

    out = Path(out)
    if act not in ("relu", "silu"):
        raise SynthError(f"unsupported activation {act!r} (relu, silu)")
    if act == "relu":
        sparse = sparse or SparseFFN()
        sparse.check()
        gate_rank = sparse.rank_for(shape)
    elif sparse is not None:
        raise SynthError("sparsity and gate rank apply only to ReLU models (--act relu)")
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
    n, n_ff = shape.n_embd, shape.n_ff

    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(min(POOL_ELEMS, 8 * n * n_ff + n_vocab * n),
                                dtype=np.float32) * POOL_STD).astype(dtype)

    # numpy's float16 arithmetic is slow (scaling one 7B FFN matrix takes ~1.2 s on 2
    # cores), so scaled weights are slices of scaled copies of the pool, made once.
    pools: dict[float, np.ndarray] = {1.0: pool}

    def rand(shape_: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        if scale not in pools:
            m = min(pool.size, 2 * n * n_ff)  # room for any one tensor at many offsets
            pools[scale] = (pool[:m].astype(np.float32) * np.float32(scale)).astype(dtype)
        src = pools[scale]
        count = int(np.prod(shape_))
        if count > src.size:
            raise SynthError(f"tensor of {count} values exceeds the random pool")
        off = int(rng.integers(0, src.size - count + 1))
        return src[off:off + count].reshape(shape_)

    # A tensor is (name, numpy shape, how to make its data); makers run one at a time
    # while the file is written, so at most one tensor is ever built in memory.
    Maker = Callable[[], np.ndarray]
    ones = np.ones(n, np.float32)  # the norm weights

    def pooled(shp: tuple[int, ...], scale: float = 1.0, zero_row0: bool = False) -> Maker:
        def make() -> np.ndarray:
            w = rand(shp, scale)
            if zero_row0:
                w = w.copy()
                w[0] = 0.0  # output channel 0 is the bias channel: never written
            return w
        return make

    if act == "relu":
        # Per-update RMS bounds, x̂ having RMS 1 and the two projections of each block
        # scaled by s: attention ≤ s²·σ²·n (one attended token), FFN ≤ s²·σ³·n·sqrt(n_ff)
        # (as if every neuron fired). One s, the smaller, serves both.
        target = UPDATE_RATIO * POOL_STD
        s_quiet = math.sqrt(min(target / (POOL_STD ** 2 * n),
                                target / (POOL_STD ** 3 * n * math.sqrt(n_ff))))

        def embd() -> np.ndarray:
            e = rand((n_vocab, n)).copy()
            e[:, 0] = POOL_STD * math.sqrt((n - 1) / 3)  # the bias channel
            return e

        def gate() -> np.ndarray:
            return sparse_gate(rng, rand((n_ff, n), GATE_NOISE), gate_rank, sparse.sparsity)
    else:
        s_quiet = 1.0
        embd, gate = pooled((n_vocab, n)), pooled((n_ff, n))

    quiet_rows = act == "relu"
    tensors: list[tuple[str, tuple[int, ...], Maker | None]] = [
        ("token_embd.weight", (n_vocab, n), embd),
        ("output_norm.weight", (n,), None),
        ("output.weight", (n_vocab, n), pooled((n_vocab, n))),
    ]
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        tensors += [
            (p + "attn_norm.weight", (n,), None),
            (p + "attn_q.weight", (n, n), pooled((n, n))),
            (p + "attn_k.weight", (n_kv, n), pooled((n_kv, n))),
            (p + "attn_v.weight", (n_kv, n), pooled((n_kv, n), s_quiet)),
            (p + "attn_output.weight", (n, n), pooled((n, n), s_quiet, quiet_rows)),
            (p + "ffn_norm.weight", (n,), None),
            (p + "ffn_gate.weight", (n_ff, n), gate),
            (p + "ffn_up.weight", (n_ff, n), pooled((n_ff, n), s_quiet)),
            (p + "ffn_down.weight", (n, n_ff), pooled((n, n_ff), s_quiet, quiet_rows)),
        ]

    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(tmp, "llama")
    cfg = HFConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": n,
        "intermediate_size": n_ff, "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_head_kv,
        "hidden_act": act, "rms_norm_eps": 1e-5, "max_position_embeddings": shape.n_ctx_train,
        "vocab_size": n_vocab}, source="synth preset")
    name = f"kairox-synth {shape.n_layer}x{n} seed {seed}"
    if act == "relu":
        name += f" sparsity {sparse.sparsity:g} gate rank {gate_rank}"
    add_hparams(w, cfg, act, name, shape.ftype)
    copy_tokenizer_fields(w, vocab_gguf, n_vocab)
    for tname, shp, make in tensors:
        dt = np.dtype(np.float32) if make is None else np.dtype(dtype)
        w.add_tensor_info(tname, shp, dt, int(np.prod(shp)) * dt.itemsize)

    def data():
        for tname, shp, make in tqdm(tensors, desc=f"synth {out.name}", unit="tensor",
                                     disable=quiet, file=sys.stderr):
            yield ones if make is None else make().astype(dtype, copy=False)

    return finish_atomically(w, tmp, out, data())


def _fraction(v: str) -> float:
    try:
        f = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {v!r}") from None
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {v}")
    return f


def cmd_synth(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"kairox synth: error: {msg}", file=sys.stderr)
        return 2

    shape = PRESETS[args.preset]
    if args.type:
        shape = dataclasses.replace(shape, ftype=args.type)
    sparse = None
    if args.act == "relu":
        sparse = SparseFFN(DEFAULT_SPARSITY if args.sparsity is None else args.sparsity, args.gate_rank)
    elif args.sparsity is not None or args.gate_rank is not None:
        return fail("--sparsity and --gate-rank apply only to --act relu (a SiLU model is dense)")
    out = Path(args.outfile or f"{args.preset}-{shape.ftype}.gguf")
    try:
        path = synth(out, shape, seed=args.seed, vocab_gguf=args.vocab_gguf,
                     act=args.act, sparse=sparse, quiet=args.quiet)
    except SynthError as e:
        return fail(str(e))
    print(f"kairox synth: wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic LLaMA-shaped model, sparse with ReLU (benchmarks)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="KB-7B",
                   help="model shape (default: %(default)s)")
    p.add_argument("-o", "--outfile", help="output GGUF (default: PRESET-TYPE.gguf)")
    p.add_argument("--type", choices=["f16", "f32"], help="weight type (default: the preset's)")
    p.add_argument("--act", choices=["relu", "silu"], default="relu",
                   help="FFN activation; silu writes a dense all-random model (default: relu)")
    p.add_argument("--sparsity", type=_fraction, metavar="S",
                   help=f"ReLU only: target fraction of zero FFN activations (default: {DEFAULT_SPARSITY})")
    p.add_argument("--gate-rank", type=int, metavar="R",
                   help="ReLU only: rank of each ffn_gate, the bias channel included, in "
                        "2..min(n_ff, n_embd); the sketch predictor needs rank >= R to see it "
                        "all (default: n_embd/16)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--vocab-gguf", type=Path, help="GGUF whose tokenizer to copy (default: LLaMA SPM)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)
