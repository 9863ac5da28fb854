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

* Uneven firing rates. Each neuron i gets its own rate p_i (log-normal across neurons,
  σ = --rate-spread, rescaled to mean 1 − S, clipped to [1e-4, 0.95]) and z_i = Φ⁻¹(1 − p_i)
  in the bias column instead of one z: a minority of neurons fires on most tokens and
  carries most of the activations, as in real ReLU models (PowerInfer's hot neurons).
* Topics and domains. Every token belongs to one of --topics topics or to the common
  words (topic 0), by a seeded assignment (`token_topics`). With --domains D, topic k ≥ 1
  lies in domain (k − 1) mod D, and topic d + 1 holds domain d's own common words (code's
  brackets, prose's articles). The token channels of a token's embedding are
  sqrt(ρ_t)·T[topic] + sqrt(ρ_d)·V[domain] + sqrt(1 − ρ_t − ρ_d)·ε_token (topic 0: no
  domain part, its share goes to ε), T, V and ε Gaussian with the pool's std, ρ_t =
  --topic-share, ρ_d = --domain-share. Tokens of one domain share part of their gate
  pre-activations, so text that stays in a domain keeps reusing neurons (temporal
  locality) and texts of different domains use different ones (cross-prompt distance);
  `topic_prompts` writes such text, a list of domains gives a session that changes
  domain from request to request. Random tokens (llama-bench) change domain at every
  token and see the rates alone.

Norm weights are 1; q, k and the output head are pool slices as in the dense model. The
parameters (rate spread 1.2, 32 topics in 4 domains, domain share 0.35, topic share 0.05,
a prompt's words half its domain's common words) were fitted to the papers' statistics
(density 0.11, 20-40% of neurons carrying 80% of activations, adjacent-token distance
0.70-0.75, cross-prompt distance 0.53-0.57) on a Gaussian simulation of this gate and
then measured on the real forward pass (docs/benchmarking.md, bench/results/*/synth-stats-*).

Mixture of experts (the KB-MoE presets): Qwen3-MoE's architecture and tensors (per-head
q/k norms, a router, each layer's experts stacked in three 3-D tensors), all weights random
from the pool and the router F32, as converters keep it. Tokens pick their experts at
random, which is what a placement sees of a real MoE model: each expert tensor is read at
n_expert_used / n_expert of its bytes per token on average.

Types: f32, f16, and q4_0 (KB-70B), quantized while streaming: the pools are quantized
once and sliced at block boundaries, gates and embeddings are quantized per tensor on all
cores, so no tensor beyond the one being written is ever held in float32.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np

from .checkpoint import HFConfig
from .convert import add_hparams, copy_tokenizer_fields, gguf_vocab_size
from .gguffile import finish_atomically, temp_path_for
from .tiny import default_vocab_gguf

FTYPES = ("f32", "f16", "q4_0")


@dataclasses.dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    ftype: str          # f32 | f16 | q4_0
    n_ctx_train: int = 4096
    # Mixture of experts (Qwen3-MoE's layout): n_ff is then each expert's FFN width
    n_expert: int = 0
    n_expert_used: int = 0
    head_dim: int = 0   # 0: n_embd / n_head

    @property
    def moe(self) -> bool:
        return self.n_expert > 0


PRESETS: dict[str, Shape] = {
    # LLaMA-2-7B / 13B shapes in F16 (~12.6 / ~24 GiB)
    "KB-7B": Shape(32, 4096, 11008, 32, 32, "f16"),
    "KB-13B": Shape(40, 5120, 13824, 40, 40, "f16"),
    # LLaMA-2-70B shape (grouped-query attention, 8 KV heads) in Q4_0 (~36 GiB)
    "KB-70B": Shape(80, 8192, 28672, 64, 8, "q4_0"),
    # small shapes for CPU benchmarks and tests
    "KB-350M": Shape(24, 1024, 2816, 16, 16, "f16"),
    "KB-tiny": Shape(2, 64, 256, 4, 2, "f32"),
    # Qwen3-30B-A3B's shape (128 experts of width 768, 8 per token; 128-wide heads, 4 KV
    # heads) in Q4_0 (~16 GiB), and a small one for tests: dense random (SwiGLU) weights
    "KB-MoE": Shape(48, 2048, 768, 32, 4, "q4_0", n_expert=128, n_expert_used=8, head_dim=128),
    "KB-MoE-tiny": Shape(2, 64, 32, 4, 2, "f32", n_expert=8, n_expert_used=2, head_dim=32),
}

POOL_ELEMS = 1 << 28    # 256 Mi values: larger than any single 7B/13B tensor
POOL_STD = 0.02         # std of the pool's values, hence of most weights and the embedding

DEFAULT_SPARSITY = 0.89
# Each layer's attention and FFN update: this fraction of the embedding's RMS (an upper
# bound: the estimates below assume the largest update the shapes allow).
UPDATE_RATIO = 0.01
# Dense noise on the gate, relative to the low-rank part's entries.
GATE_NOISE = 0.1
# Realistic-statistics defaults (module docstring).
DEFAULT_RATE_SPREAD = 1.2
DEFAULT_TOPICS = 32
DEFAULT_TOPIC_SHARE = 0.05
DEFAULT_DOMAINS = 4
DEFAULT_DOMAIN_SHARE = 0.35
DEFAULT_COMMON = 0.5
RATE_CLIP = (1e-4, 0.95)
# Metadata written into synthetic models: how to rebuild the token topics and domains.
K_SEED, K_TOPICS, K_DOMAINS = "kairox.synth.seed", "kairox.synth.topics", "kairox.synth.domains"
# The session workload's domains by name (topic_prompts' `domains`), in domain order.
DOMAIN_NAMES = ("code", "prose", "dialogue", "math")


class SynthError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class SparseFFN:
    """How a ReLU model's FFN is made sparse and predictable (module docstring)."""
    sparsity: float = DEFAULT_SPARSITY  # target fraction of zero FFN activations, in (0, 1)
    gate_rank: int | None = None        # rank of the gate incl. the bias channel; None: n_embd // 16
    rate_spread: float = DEFAULT_RATE_SPREAD  # σ of log firing rate across neurons; 0: equal rates
    topics: int = DEFAULT_TOPICS              # token topics in the embedding; 0: none
    topic_share: float = DEFAULT_TOPIC_SHARE  # ρ_t: share of a token channel's variance from its topic
    domains: int = DEFAULT_DOMAINS            # topic domains (topic k in domain (k − 1) mod D); 0: none
    domain_share: float = DEFAULT_DOMAIN_SHARE  # ρ_d: share from its domain

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
        if not (isinstance(self.rate_spread, (int, float)) and 0 <= self.rate_spread <= 4):
            raise SynthError(f"rate spread must be in 0..4 (σ of the log firing rate), got {self.rate_spread!r}")
        if isinstance(self.topics, bool) or not isinstance(self.topics, int) or not 0 <= self.topics <= 255:
            raise SynthError(f"topics must be an integer in 0..255, got {self.topics!r}")
        if not (isinstance(self.topic_share, (int, float)) and 0 <= self.topic_share < 1):
            raise SynthError(f"topic share must be in [0, 1), got {self.topic_share!r}")
        if isinstance(self.domains, bool) or not isinstance(self.domains, int) or not (
                self.domains == 0 or self.topics == 0 or 2 * self.domains <= self.topics):
            raise SynthError(f"domains must be 0 or an integer up to topics / 2 (each domain needs its common "
                             f"words and a topic), got {self.domains!r} with {self.topics} topics")
        share = self.topic_share + (self.domain_share if self.domains and self.topics else 0)
        if not (isinstance(self.domain_share, (int, float)) and 0 <= self.domain_share < 1) or share >= 1:
            raise SynthError(f"domain share must be in [0, 1) and with the topic share below 1, got "
                             f"{self.domain_share!r} + {self.topic_share!r}")
        if 1 - self.sparsity > RATE_CLIP[1]:
            raise SynthError(f"sparsity {self.sparsity} leaves a mean firing rate above {RATE_CLIP[1]}")


def firing_rates(rng: np.random.Generator, n_ff: int, mean: float, spread: float) -> np.ndarray:
    """Per-neuron firing rates: log-normal with σ = spread, rescaled to `mean` inside
    RATE_CLIP (a few rescale-and-clip rounds; clipping moves the mean, rescaling restores it)."""
    if spread == 0:
        return np.full(n_ff, mean)
    r = np.exp(spread * rng.standard_normal(n_ff))
    for _ in range(100):
        r = np.clip(r * (mean / r.mean()), *RATE_CLIP)
        if abs(r.mean() - mean) < 1e-6 * mean:
            break
    return r


def token_topics(seed: int, n_vocab: int, topics: int) -> np.ndarray:
    """Topic of every token id (0: common words, 1..topics), the same for the same seed."""
    if topics == 0:
        return np.zeros(n_vocab, np.int64)
    return np.random.default_rng([seed, 0x70]).integers(0, topics + 1, n_vocab)


def topic_domains(topic: np.ndarray, domains: int) -> np.ndarray:
    """Domain of each topic id (topic k ≥ 1 in domain (k − 1) mod D; 0, the shared common
    words, and every topic when there are no domains: 0, which is then unused)."""
    topic = np.asarray(topic)
    return np.where(topic > 0, (topic - 1) % max(domains, 1), 0)


def sparse_gate(rng: np.random.Generator, noise: np.ndarray, rank: int, rates: np.ndarray) -> np.ndarray:
    """A ReLU gate [n_ff, n_embd] float32 with P(gate_i > 0) = rates[i] for bias-channel
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
    inv = statistics.NormalDist().inv_cdf
    z = np.array([inv(1 - p) for p in np.asarray(rates, np.float64)], np.float32)
    gate[:, 0] = -z * sigma / (math.sqrt(n_embd) / 2)
    return gate


def _quantize_rows(w: np.ndarray, qtype: Any, threads: int | None = None) -> np.ndarray:
    """gguf's numpy quantizer over row chunks on all cores (its array ops release the GIL:
    measured 2.9x on 2 cores for Q4_0); rows [n, cols] -> bytes [n, cols/32*block bytes]."""
    import gguf
    from concurrent.futures import ThreadPoolExecutor

    w = np.ascontiguousarray(w, np.float32)
    threads = threads or os.cpu_count() or 1
    step = max(1, -(-w.shape[0] // (4 * threads)))
    with ThreadPoolExecutor(threads) as ex:
        parts = list(ex.map(lambda lo: gguf.quants.quantize(w[lo:lo + step], qtype),
                            range(0, w.shape[0], step)))
    return np.concatenate(parts)


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
    if shape.moe and act != "silu":
        raise SynthError("an MoE shape is written with dense random SwiGLU experts (act silu); "
                         "its sparsity is the router's")
    if shape.moe and not 0 < shape.n_expert_used <= shape.n_expert:
        raise SynthError(f"experts used per token must be in 1..{shape.n_expert}, got {shape.n_expert_used}")
    if act == "relu":
        sparse = sparse or SparseFFN()
        sparse.check()
        gate_rank = sparse.rank_for(shape)
    elif sparse is not None:
        raise SynthError("sparsity and gate rank apply only to ReLU models (--act relu)")
    vocab_gguf = Path(vocab_gguf or default_vocab_gguf())
    n_vocab = gguf_vocab_size(vocab_gguf)
    if shape.ftype not in FTYPES:
        raise SynthError(f"unsupported type {shape.ftype!r} ({', '.join(FTYPES)})")
    qtype = gguf.GGMLQuantizationType.Q4_0 if shape.ftype == "q4_0" else None
    # float values are made in this type; quantized models quantize float32
    dtype = np.float16 if shape.ftype == "f16" else np.float32
    if qtype is not None:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape.n_embd % block or shape.n_ff % block:
            raise SynthError(f"{shape.ftype} needs n_embd and n_ff to be multiples of {block}")
    head_dim = shape.head_dim or shape.n_embd // shape.n_head
    if (not shape.head_dim and head_dim * shape.n_head != shape.n_embd) or shape.n_head % shape.n_head_kv:
        raise SynthError(f"inconsistent heads: n_embd={shape.n_embd} n_head={shape.n_head} "
                         f"n_head_kv={shape.n_head_kv}")
    n_q, n_kv = head_dim * shape.n_head, head_dim * shape.n_head_kv
    n, n_ff = shape.n_embd, shape.n_ff
    n_ff_all = n_ff * max(shape.n_expert, 1)  # FFN rows of a layer, every expert's

    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(min(POOL_ELEMS, 8 * n * n_ff_all + n_vocab * n),
                                dtype=np.float32) * POOL_STD).astype(dtype)

    # numpy's float16 arithmetic is slow (scaling one 7B FFN matrix takes ~1.2 s on 2
    # cores), so scaled weights are slices of scaled copies of the pool, made once.
    pools: dict[float, np.ndarray] = {1.0: pool}

    def rand(shape_: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        if scale not in pools:
            m = min(pool.size, 2 * n * n_ff_all)  # room for any one tensor at many offsets
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
    qpools: dict[float, np.ndarray] = {}

    def qrand(shape_: tuple[int, ...], scale: float) -> np.ndarray:
        """A slice of the quantized pool, cut at block boundaries: bytes [..., rows, row bytes]."""
        if scale not in qpools:
            src = rand((min(pool.size, 2 * n * n_ff_all),), scale) if scale != 1.0 else pool
            blk = gguf.GGML_QUANT_SIZES[qtype]
            qpools[scale] = _quantize_rows(src[:src.size // 256 * 256].reshape(-1, 256),
                                           qtype).reshape(-1, blk[1])  # [blocks, block bytes]
        src = qpools[scale]
        nblk = int(np.prod(shape_)) // block
        off = int(rng.integers(0, src.shape[0] - nblk + 1))
        return src[off:off + nblk].reshape(*shape_[:-1], -1)

    def encode(w: np.ndarray) -> np.ndarray:
        return w.astype(dtype, copy=False) if qtype is None or w.ndim == 1 else _quantize_rows(w, qtype)

    def pooled(shp: tuple[int, ...], scale: float = 1.0, zero_row0: bool = False) -> Maker:
        def make() -> np.ndarray:
            if qtype is not None:
                w = qrand(shp, scale)
                if zero_row0:
                    w = w.copy()
                    w[0] = _quantize_rows(np.zeros((1, shp[1]), np.float32), qtype)[0]
                return w
            w = rand(shp, scale)
            if zero_row0:
                w = w.copy()
                w[0] = 0.0  # output channel 0 is the bias channel: never written
            return encode(w)
        return make

    if act == "relu":
        # Per-update RMS bounds, x̂ having RMS 1 and the two projections of each block
        # scaled by s: attention ≤ s²·σ²·n (one attended token), FFN ≤ s²·σ³·n·sqrt(n_ff)
        # (as if every neuron fired). One s, the smaller, serves both.
        target = UPDATE_RATIO * POOL_STD
        s_quiet = math.sqrt(min(target / (POOL_STD ** 2 * n),
                                target / (POOL_STD ** 3 * n * math.sqrt(n_ff))))

        topic = token_topics(seed, n_vocab, sparse.topics)
        topic_vecs = np.random.default_rng([seed, 0x7e]).standard_normal(
            (sparse.topics + 1, n), dtype=np.float32) * POOL_STD
        n_dom = sparse.domains if sparse.topics else 0
        domain_vecs = np.random.default_rng([seed, 0xd0]).standard_normal((max(n_dom, 1), n), dtype=np.float32) * POOL_STD

        def embd() -> np.ndarray:
            rho = sparse.topic_share if sparse.topics else 0.0
            rho_d = np.where(topic > 0, sparse.domain_share if n_dom else 0.0, 0.0).astype(np.float32)
            e = rand((n_vocab, n)).astype(np.float32) * np.sqrt(1 - rho - rho_d)[:, None]
            if rho:
                e += np.float32(math.sqrt(rho)) * topic_vecs[topic]
            if n_dom:
                e += np.sqrt(rho_d)[:, None] * domain_vecs[topic_domains(topic, n_dom)]
            e[:, 0] = POOL_STD * math.sqrt((n - 1) / 3)  # the bias channel
            return encode(e)

        def gate() -> np.ndarray:
            rates = firing_rates(rng, n_ff, 1 - sparse.sparsity, sparse.rate_spread)
            return encode(sparse_gate(rng, rand((n_ff, n), GATE_NOISE).astype(np.float32),
                                      gate_rank, rates))
    else:
        s_quiet = 1.0
        embd, gate = pooled((n_vocab, n)), pooled((n_ff, n))

    def router() -> np.ndarray:  # kept in F32, as converters keep it
        return rand((shape.n_expert, n)).astype(np.float32)

    quiet_rows = act == "relu"
    # (name, numpy shape, maker; None: a norm's ones) and whether it is stored in F32
    tensors: list[tuple[str, tuple[int, ...], Maker | None, bool]] = [
        ("token_embd.weight", (n_vocab, n), embd, False),
        ("output_norm.weight", (n,), None, True),
        ("output.weight", (n_vocab, n), pooled((n_vocab, n)), False),
    ]
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        tensors += [
            (p + "attn_norm.weight", (n,), None, True),
            (p + "attn_q.weight", (n_q, n), pooled((n_q, n)), False),
            (p + "attn_k.weight", (n_kv, n), pooled((n_kv, n)), False),
            (p + "attn_v.weight", (n_kv, n), pooled((n_kv, n), s_quiet), False),
            (p + "attn_output.weight", (n, n_q), pooled((n, n_q), s_quiet, quiet_rows), False),
            (p + "ffn_norm.weight", (n,), None, True),
        ]
        if shape.moe:  # Qwen3-MoE: per-head q/k norms, a router, experts stacked in 3-D tensors
            e = shape.n_expert
            tensors += [
                (p + "attn_q_norm.weight", (head_dim,), None, True),
                (p + "attn_k_norm.weight", (head_dim,), None, True),
                (p + "ffn_gate_inp.weight", (e, n), router, True),
                (p + "ffn_gate_exps.weight", (e, n_ff, n), pooled((e, n_ff, n)), False),
                (p + "ffn_up_exps.weight", (e, n_ff, n), pooled((e, n_ff, n)), False),
                (p + "ffn_down_exps.weight", (e, n, n_ff), pooled((e, n, n_ff)), False),
            ]
        else:
            tensors += [
                (p + "ffn_gate.weight", (n_ff, n), gate, False),
                (p + "ffn_up.weight", (n_ff, n), pooled((n_ff, n), s_quiet), False),
                (p + "ffn_down.weight", (n, n_ff), pooled((n, n_ff), s_quiet, quiet_rows), False),
            ]

    tmp = temp_path_for(out)
    w = gguf.GGUFWriter(tmp, "qwen3moe" if shape.moe else "llama")
    cfg = HFConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM" if shape.moe else "LlamaForCausalLM"], "hidden_size": n,
        "intermediate_size": n_ff, "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_head_kv,
        "head_dim": head_dim, "hidden_act": act, "rms_norm_eps": 1e-5,
        "max_position_embeddings": shape.n_ctx_train, "vocab_size": n_vocab}, source="synth preset")
    name = f"kairox-synth {shape.n_layer}x{n} seed {seed}"
    if shape.moe:
        name += f" experts {shape.n_expert} used {shape.n_expert_used}"
    if act == "relu":
        name += (f" sparsity {sparse.sparsity:g} gate rank {gate_rank} rate spread "
                 f"{sparse.rate_spread:g} topics {sparse.topics} share {sparse.topic_share:g}")
        if sparse.domains and sparse.topics:
            name += f" domains {sparse.domains} share {sparse.domain_share:g}"
    # the hidden activation is a llama-architecture key (llama.cpp's Qwen3-MoE is SwiGLU)
    add_hparams(w, cfg, None if shape.moe else act, name, shape.ftype)
    if shape.moe:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(n_ff)
    w.add_uint32(K_SEED, seed & 0xFFFFFFFF)
    w.add_uint32(K_TOPICS, sparse.topics if act == "relu" else 0)
    w.add_uint32(K_DOMAINS, sparse.domains if act == "relu" and sparse.topics else 0)
    copy_tokenizer_fields(w, vocab_gguf, n_vocab)
    for tname, shp, make, f32 in tensors:
        if f32:
            w.add_tensor_info(tname, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        elif qtype is not None:
            bshape = gguf.quant_shape_to_byte_shape(shp, qtype)
            w.add_tensor_info(tname, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=qtype)
        else:
            dt = np.dtype(dtype)
            w.add_tensor_info(tname, shp, dt, int(np.prod(shp)) * dt.itemsize)

    def data():
        for tname, shp, make, _ in tqdm(tensors, desc=f"synth {out.name}", unit="tensor",
                                     disable=quiet, file=sys.stderr):
            yield np.ones(shp, np.float32) if make is None else make()

    return finish_atomically(w, tmp, out, data())


def has_topics(model_path: str | Path) -> bool:
    """Whether the model is a kairox synthetic model with topics (topic_prompts writes its text)."""
    from .gguf_header import scan_header
    return int(scan_header(model_path).kv.get(K_TOPICS, 0)) > 0


def topic_prompts(model_path: str | Path, n_prompts: int, length: int, *, seed: int = 0,
                  common: float = DEFAULT_COMMON, switch_every: int | None = None,
                  domains: list[int | str] | None = None) -> list[list[int]]:
    """Token streams for a synthetic model that read like text on topics. Without domains
    in the model: each prompt picks a topic; each token is a common word (topic 0) with
    probability `common`, else a word of the prompt's topic. With domains: each prompt
    picks a domain (or takes `domains[i]`, an index or a DOMAIN_NAMES name: a session whose
    requests change domain), its common words are the domain's own, its topic one of the
    domain's. Words are uniform among a topic's normal tokens. With `switch_every`, the
    topic changes every that many tokens (a drifting conversation; within the domain when
    there is one). No BOS is added."""
    import gguf

    from .gguf_header import scan_header

    hdr = scan_header(model_path)
    if K_TOPICS not in hdr.kv:
        raise SynthError(f"{model_path} is not a kairox synthetic model (no {K_TOPICS})")
    topics = int(hdr.kv[K_TOPICS])
    n_dom = int(hdr.kv.get(K_DOMAINS, 0))
    if domains is not None:
        if not n_dom:
            raise SynthError(f"{model_path} has no domains (synthesize it with --domains)")
        if len(domains) != n_prompts:
            raise SynthError(f"{len(domains)} domains for {n_prompts} prompts")
        names = DOMAIN_NAMES[:n_dom]
        try:
            domains = [names.index(d) if isinstance(d, str) else int(d) for d in domains]
        except ValueError:
            raise SynthError(f"unknown domain in {domains!r}: this model's are {', '.join(names)} "
                             f"or 0..{n_dom - 1}") from None
        if any(not 0 <= d < n_dom for d in domains):
            raise SynthError(f"domains must be in 0..{n_dom - 1}, got {domains!r}")
    field = gguf.GGUFReader(str(model_path)).get_field("tokenizer.ggml.token_type")
    types = np.array([int(field.parts[i][0]) for i in field.data])
    topic = token_topics(int(hdr.kv[K_SEED]), types.size, topics)
    normal = types == int(gguf.TokenType.NORMAL)
    words = [np.flatnonzero(normal & (topic == k)) for k in range(topics + 1)]
    if any(w.size == 0 for w in words):
        raise SynthError(f"{model_path}: a topic has no normal tokens (vocabulary too small for {topics} topics)")
    rng = np.random.default_rng([seed, 0x9e])
    out = []
    for i in range(n_prompts):
        k = np.zeros(length, np.int64)
        if n_dom:
            d = domains[i] if domains is not None else int(rng.integers(n_dom))
            own = np.arange(d + 1 + n_dom, topics + 1, n_dom)  # the domain's topics, its common words apart
            common_topic = d + 1
        else:
            own, common_topic = np.arange(1, topics + 1), 0
        for st in range(0, length, switch_every or length):  # one topic per stretch (0 if the model has none)
            k[st:st + (switch_every or length)] = rng.choice(own) if topics else 0
        k[rng.random(length) < common] = common_topic
        out.append([int(words[kk][rng.integers(words[kk].size)]) for kk in k])
    return out


def measured_layout(model: Path, n_tokens: int, seed: int, quiet: bool = True, keep_x: int = 0):
    """Identity neuron order with frequencies measured on `n_tokens` of topic text (a seed
    apart from the benchmarks' prompts), so a static placement can rank neurons by use; and
    up to keep_x of the FFN inputs per layer (None without)."""
    import numpy as np

    from .pack import PackLayout
    from .profile import measure_freqs
    from ._native import has_gpu

    seg = min(512, n_tokens)
    prompts = topic_prompts(model, max(1, n_tokens // seg), seg, seed=seed + 1000)
    freqs, xs = measure_freqs(model, prompts, n_gpu_layers=99 if has_gpu() else 0, quiet=quiet, keep_x=keep_x)
    n_ff = freqs.shape[1]
    perm = np.arange(n_ff, dtype=np.int32)
    group = perm // 32
    return PackLayout(layer=lambda il: (perm, group, freqs[il]),
                      threshold=np.zeros(freqs.shape[0], np.float32)), xs


def calibrated_thresholds(model: Path, predictor, xs, quiet: bool = True):
    """(predictor, tables): the load-aware thresholds' calibration of `predictor` on the FFN
    inputs xs, and the predictor with its factors kept (computed once for both)."""
    import dataclasses as dc

    from .thresholds import calibrate

    cache: dict[int, tuple] = {}

    def layer(il: int) -> tuple:
        if il not in cache:
            cache[il] = predictor.layer(il)
        return cache[il]
    kept = dc.replace(predictor, layer=layer)
    return kept, calibrate(model, kept.layer, xs, quiet=quiet)
