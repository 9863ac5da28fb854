"""Activation-sparsity quality: what skipping work does to a model's perplexity.

Two training-free ways to sparsify a gated (SwiGLU/GeGLU) FFN model are compared here:

* CATS, what kairox runs: per layer a threshold t_l on |act(g)| (g the gate pre-activation,
  act SiLU or GELU in its tanh form); neuron i of a token is skipped, its h_i = act(g_i) u_i
  taken as 0, when |act(g_i)| <= t_l. The up and down rows of skipped neurons need not be
  read.
* TEAL (Liu et al., ICLR 2025): a magnitude threshold on the *input* of every projection;
  entries x_j with |x_j| <= t are zeroed before the matmul, so column j of the weight need
  not be read. Four inputs per layer: the attention input shared by q/k/v (`attn_norm-L` in
  llama.cpp's graph), the attention output projection's input (`kqv_out-L`), the FFN input
  shared by gate/up (`ffn_norm-L`) and the down projection's input, the GLU product
  (`ffn_geglu-L` / `ffn_swiglu-L`).

Both are emulated on the unmodified dense model, in process: a llama.cpp context on the
CPU whose eval callback (`cb_eval`) is a Python function. In the ask phase it claims the
watched tensors, so the scheduler computes the graph up to each of them and calls back;
in the observe phase the callback reads the tensor through numpy and, on the CPU backend,
rewrites it in place. Later nodes read the rewritten values, so the rest of the forward
pass sees exactly the sparsified activations. CATS is applied by zeroing g_i itself:
act(0) = 0 for SiLU and GELU, so h_i = 0 follows without touching the GLU node.

Thresholds come from calibration: per layer, a bounded random subsample of |act(g)| and of
|x| for each TEAL input over calibration tokens; the s-quantile of a sample is the
threshold that zeroes a fraction s. Evaluation reports the realized fraction.

Perplexity convention (as llama-perplexity): each segment is one prompt decoded from an
empty KV cache with logits for every token; only its second half is scored (the tokens
after position n//2, each predicted from the logits of the position before it), so every
scored token has at least n//2 tokens of context. Perplexity is exp of the mean natural-log
NLL over all scored tokens of all segments.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .pack import BaseModel, inspect_model
from .profile import fill_batch, hist_edges, tokenize, vocab_bos

# kairox.Llama's sparse mode that skips neurons with |act(gate)| <= the pack's threshold
CATS_MODE = "threshold"

# TEAL inputs, by the llama.cpp graph names (name-L) of the tensors that feed the projections
TEAL_INPUTS: dict[str, tuple[str, ...]] = {
    "attn_in": ("attn_norm",),                # q, k, v
    "attn_out": ("kqv_out",),                 # attention output projection
    "ffn_in": ("ffn_norm",),                  # gate, up
    "down_in": ("ffn_geglu", "ffn_swiglu"),   # down: the GLU product
}
GATE = "ffn_gate"  # gate pre-activation g: the CATS decision, and where it is applied
KINDS = ("gate", *TEAL_INPUTS)

GGML_TYPE_F32 = 0
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64


class QualityError(RuntimeError):
    """The emulation cannot run as asked; the message says why."""


class _GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h), read-only use: type, shape, strides, data, name."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (np.float32(1.0) + np.exp(-v))


def _gelu(v: np.ndarray) -> np.ndarray:
    c = np.float32(0.7978845608028654)  # sqrt(2/pi); the tanh form, as ggml_gelu and kx_act_value
    return np.float32(0.5) * v * (np.float32(1.0) + np.tanh(c * (v + np.float32(0.044715) * v * v * v)))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"silu": _silu, "gelu": _gelu}


# ------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class Rule:
    """How activations are sparsified: "none" (dense), "cats" (per-layer thresholds on
    |act(g)|, `cats` [n_layer]) or "teal" (per-layer thresholds per input kind, `teal`
    {kind: [n_layer]} over TEAL_INPUTS; a kind left out stays dense)."""
    method: str
    cats: np.ndarray | None = None
    teal: dict[str, np.ndarray] | None = None

    @classmethod
    def none(cls) -> "Rule":
        return cls("none")

    @classmethod
    def of_cats(cls, thresholds: Sequence[float]) -> "Rule":
        return cls("cats", cats=np.asarray(thresholds, np.float32))

    @classmethod
    def of_teal(cls, thresholds: dict[str, Sequence[float]]) -> "Rule":
        unknown = set(thresholds) - set(TEAL_INPUTS)
        if unknown:
            raise ValueError(f"unknown TEAL inputs {sorted(unknown)}; known: {list(TEAL_INPUTS)}")
        return cls("teal", teal={k: np.asarray(v, np.float32) for k, v in thresholds.items()})

    def threshold(self, kind: str, il: int) -> float | None:
        """The threshold applied to `kind` in layer il, or None when it stays dense."""
        if self.method == "cats" and kind == "gate":
            return float(self.cats[il])
        if self.method == "teal" and self.teal is not None and kind in self.teal:
            return float(self.teal[kind][il])
        return None

    def check(self, n_layer: int) -> None:
        if self.method not in ("none", "cats", "teal"):
            raise ValueError(f"rule method must be none, cats or teal, not {self.method!r}")
        arrays = ([self.cats] if self.method == "cats" else
                  list((self.teal or {}).values()) if self.method == "teal" else [])
        for a in arrays:
            if a is None or a.shape != (n_layer,) or not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"a rule needs {n_layer} finite thresholds >= 0 per layer")


@dataclass
class Sparsity:
    """Entries zeroed by a rule, per kind (KINDS) and layer, and the entries seen."""
    zeroed: dict[str, np.ndarray]
    seen: dict[str, np.ndarray]

    @classmethod
    def zeros(cls, n_layer: int) -> "Sparsity":
        return cls({k: np.zeros(n_layer, np.int64) for k in KINDS}, {k: np.zeros(n_layer, np.int64) for k in KINDS})

    def per_layer(self, kind: str) -> np.ndarray:
        """Realized sparsity of `kind` per layer (0 where nothing was seen)."""
        return self.zeroed[kind] / np.maximum(self.seen[kind], 1)

    def fraction(self, kind: str) -> float:
        return float(self.zeroed[kind].sum() / max(int(self.seen[kind].sum()), 1))

    def to_json(self) -> dict[str, dict[str, object]]:
        return {k: {"mean": self.fraction(k), "per_layer": [round(float(v), 6) for v in self.per_layer(k)]}
                for k in KINDS}


@dataclass
class Calibration:
    """Per layer, sorted subsamples of |act(g)| ("gate") and of |x| for each TEAL input."""
    samples: dict[str, list[np.ndarray]]
    tokens: int

    def threshold(self, kind: str, il: int, target: float) -> float:
        """The value t with about `target` of layer il's `kind` values <= t."""
        if not 0.0 <= target < 1.0:
            raise ValueError(f"target sparsity must be in [0, 1), got {target}")
        s = self.samples[kind][il]
        if s.size == 0:
            raise QualityError(f"no calibration values for {kind} in layer {il}")
        if target == 0.0:
            return 0.0  # nothing zeroed beyond exact zeros
        # the largest value at rank < target * n: values <= it make up about `target`
        return float(s[max(int(np.ceil(target * s.size)) - 1, 0)])

    def thresholds(self, kind: str, target: float) -> np.ndarray:
        return np.array([self.threshold(kind, il, target) for il in range(len(self.samples[kind]))], np.float32)

    def hist(self, kind: str) -> np.ndarray:
        """[n_layer, bins] histograms of the samples on the profiler's bins
        (kairox.profile.hist_edges; exact zeros in bin 0), for kairox.threshold_search."""
        edges = hist_edges()
        out = np.zeros((len(self.samples[kind]), len(edges)), np.int64)
        for il, v in enumerate(self.samples[kind]):
            k = np.searchsorted(edges, v, side="right") - 1
            k[v == 0] = 0
            out[il] = np.bincount(k, minlength=len(edges))
        return out

    def rule(self, method: str, target: float) -> Rule:
        """A uniform rule: every layer (and, for TEAL, every input) at sparsity `target`."""
        if target == 0.0 or method == "none":
            return Rule.none()
        if method == "cats":
            return Rule.of_cats(self.thresholds("gate", target))
        if method == "teal":
            return Rule.of_teal({k: self.thresholds(k, target) for k in TEAL_INPUTS})
        raise ValueError(f"method must be none, cats or teal, not {method!r}")


@dataclass
class PerplexityResult:
    ppl: float
    nll: float              # mean natural-log NLL of the scored tokens
    scored: int             # tokens scored
    sparsity: Sparsity
    seconds: float = 0.0
    per_segment: list[float] = field(default_factory=list)  # mean NLL of each segment


# --------------------------------------------------------------------------- emulator


class Emulator:
    """A model on the CPU with a Python eval callback that watches, samples or rewrites the
    tensors of KINDS in every layer. `logits`, `calibrate` and `perplexity` run segments,
    each one prompt from an empty KV cache, decoded in batches of n_batch tokens (one
    micro-batch each, so every watched tensor is seen once per layer per decode).

    f32_kv keeps the KV cache in F32 and flash_attn=False turns flash attention off (both as
    kairox.Llama's tests run, for comparisons with a float tolerance); the defaults are
    llama.cpp's (F16 cache, flash attention where supported). callback=False loads the same
    context without a callback (the reference the callback is tested against)."""

    def __init__(self, model_path: str | Path, *, n_ctx: int = 512, n_batch: int = 512,
                 threads: int | None = None, f32_kv: bool = False, flash_attn: bool | None = None,
                 callback: bool = True, verbose: bool = False) -> None:
        from llama_cpp._logger import set_verbose

        from .llama import _C
        self._C = _C
        set_verbose(verbose)
        self.path = Path(model_path)
        _, self.base = inspect_model(self.path)
        b: BaseModel = self.base
        if b.activation not in ACTIVATIONS:
            raise QualityError(f"the emulator handles gated SiLU/GELU FFNs, not {b.activation!r}")
        self.act = ACTIVATIONS[b.activation]
        self.n_ctx, self.n_batch = int(n_ctx), int(min(n_batch, n_ctx))
        self._watch = {f"{GATE}-{il}": ("gate", il) for il in range(b.n_layer)}
        for kind, names in TEAL_INPUTS.items():
            for name in names:
                self._watch.update({f"{name}-{il}": (kind, il) for il in range(b.n_layer)})
        self._mode = "none"
        self._rule = Rule.none()
        self._stats = Sparsity.zeros(b.n_layer)
        self._seen = np.zeros((len(KINDS), b.n_layer), np.int64)  # callbacks in this decode
        self._error: str | None = None
        self._samples: dict[str, list[list[np.ndarray]]] = {}
        self._sample_frac: dict[str, float] = {}
        self._rng = np.random.default_rng(0)
        self.model = self.ctx = self.batch = None
        try:
            mp = _C.llama_model_default_params()
            mp.n_gpu_layers = 0  # the callback rewrites host memory: CPU backend only
            self.model = _C.llama_model_load_from_file(os.fsencode(self.path), mp)
            if not self.model:
                raise QualityError(f"llama.cpp could not load {self.path}")
            cp = _C.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = self.n_ctx, self.n_batch, self.n_batch
            cp.n_threads = cp.n_threads_batch = threads or max(1, os.cpu_count() or 1)
            # with a GPU in the build, llama.cpp would still run a batch's big matmuls (and the
            # attention) there, and the callback would be handed device memory
            cp.op_offload = False
            cp.offload_kqv = False
            if f32_kv:
                cp.type_k = cp.type_v = GGML_TYPE_F32
            if flash_attn is not None:  # None: llama.cpp's choice (auto)
                cp.flash_attn_type = int(flash_attn)
            self._cb = None
            if callback:
                self._cb = _C.ggml_backend_sched_eval_callback(self._eval)
                cp.cb_eval = self._cb
            self.callback = callback
            self.ctx = _C.llama_init_from_model(self.model, cp)
            if not self.ctx:
                raise QualityError("llama.cpp could not create a context")
            self.vocab = _C.llama_model_get_vocab(self.model)
            self.n_vocab = int(_C.llama_vocab_n_tokens(self.vocab))
            self.batch = _C.llama_batch_init(self.n_batch, 0, 1)
        except BaseException:
            self.close()
            raise

    # ---- the callback

    def _eval(self, t: int, ask: bool, _user: int) -> bool:
        try:
            tt = _GgmlTensor.from_address(t)
            hit = self._watch.get(tt.name.decode("utf-8", "replace"))
            if ask or hit is None:
                return hit is not None
            kind, il = hit
            self._seen[KINDS.index(kind), il] += 1
            x = self._view(tt)
            if self._mode == "calib":
                self._sample(kind, il, x)
            elif self._mode == "apply":
                self._apply(kind, il, x)
            return True
        except Exception as e:  # an exception cannot cross the C boundary: stop the graph, raise after
            self._error = self._error or f"{type(e).__name__}: {e}"
            return False

    @staticmethod
    def _view(tt: _GgmlTensor) -> np.ndarray:
        """The tensor's data as a writable float32 [rows, cols] array (no copy)."""
        ne, nb = list(tt.ne), list(tt.nb)
        name = tt.name.decode()
        if tt.type != GGML_TYPE_F32:
            raise QualityError(f"{name} has ggml type {tt.type}, not F32")
        if ne[2] != 1 or ne[3] != 1 or nb[0] != 4 or nb[1] != 4 * ne[0]:
            raise QualityError(f"{name} is not a contiguous 2-D tensor (ne {ne}, nb {nb})")
        if not tt.data:
            raise QualityError(f"{name} has no host data")
        buf = (ctypes.c_float * (ne[0] * ne[1])).from_address(tt.data)
        return np.ctypeslib.as_array(buf).reshape(ne[1], ne[0])

    def _magnitude(self, kind: str, x: np.ndarray) -> np.ndarray:
        return np.abs(self.act(x)) if kind == "gate" else np.abs(x)

    def _sample(self, kind: str, il: int, x: np.ndarray) -> None:
        k = min(x.size, max(1, int(round(self._sample_frac[kind] * x.size))))
        idx = self._rng.integers(0, x.size, k) if k < x.size else slice(None)
        self._samples[kind][il].append(self._magnitude(kind, x.reshape(-1)[idx]))

    def _apply(self, kind: str, il: int, x: np.ndarray) -> None:
        s = self._stats
        s.seen[kind][il] += x.size
        thr = self._rule.threshold(kind, il)
        if thr is None:
            return
        m = self._magnitude(kind, x) <= thr
        x[m] = 0.0  # in place: the next graph nodes read it; for the gate, act(0) = 0 zeroes h
        s.zeroed[kind][il] += int(np.count_nonzero(m))

    # ---- decoding

    def tokenize(self, text: str, add_bos: bool = False) -> np.ndarray:
        return tokenize(self._C, self.vocab, text, add_bos)

    def bos(self) -> int | None:
        return vocab_bos(self._C, self.vocab)

    def _run(self, tokens: np.ndarray, on_logits: Callable[[int, np.ndarray], None] | None) -> None:
        """Decode one segment from an empty cache; on_logits(first_pos, logits [n, vocab])
        after each batch (the array is llama.cpp's buffer: copy what is kept)."""
        C = self._C
        n = len(tokens)
        if not 1 <= n <= self.n_ctx:
            raise ValueError(f"a segment has 1..{self.n_ctx} tokens, got {n}")
        C.llama_memory_clear(C.llama_get_memory(self.ctx), True)
        for lo in range(0, n, self.n_batch):
            hi = min(lo + self.n_batch, n)
            bt = fill_batch(self.batch, tokens, lo, hi)
            self._seen[:] = 0
            self._error = None
            rc = C.llama_decode(self.ctx, bt)
            if self._error:
                raise QualityError(f"the eval callback failed: {self._error}")
            if rc != 0:
                raise QualityError(f"llama_decode failed ({rc})")
            if self.callback and not np.all(self._seen == 1):
                bad = [(KINDS[k], il, int(self._seen[k, il])) for k, il in zip(*np.nonzero(self._seen != 1))]
                raise QualityError(
                    f"watched tensors were not seen once per layer per decode ({bad[:4]}...): this model's graph "
                    f"does not name {GATE}-L / {', '.join(n for v in TEAL_INPUTS.values() for n in v)}-L as expected")
            if on_logits is not None:
                ptr = C.llama_get_logits(self.ctx)
                on_logits(lo, np.ctypeslib.as_array(ptr, shape=(hi - lo, self.n_vocab)))

    def _set(self, mode: str, rule: Rule | None = None) -> None:
        if mode != "none" and not self.callback:
            raise QualityError("this emulator was built without a callback")
        rule = rule or Rule.none()
        rule.check(self.base.n_layer)
        self._mode, self._rule = mode, rule
        self._stats = Sparsity.zeros(self.base.n_layer)

    def logits(self, tokens: Sequence[int], rule: Rule | None = None) -> tuple[np.ndarray, Sparsity]:
        """Logits of every token of one segment [n, vocab] under `rule`, and its sparsity."""
        tokens = np.asarray(tokens, np.int32)
        out = np.empty((len(tokens), self.n_vocab), np.float32)
        self._set("apply" if self.callback else "none", rule)
        try:
            self._run(tokens, lambda lo, lg: out.__setitem__(slice(lo, lo + len(lg)), lg))
        finally:
            self._mode = "none"
        return out, self._stats

    def calibrate(self, segments: Sequence[np.ndarray], *, max_values: int = 200_000, seed: int = 0,
                  progress: Callable[[int], None] | None = None) -> Calibration:
        """Dense pass over `segments` sampling, per layer, up to about max_values |act(g)| and
        |x| of each TEAL input (uniformly over all their entries)."""
        b = self.base
        n_tok = int(sum(len(s) for s in segments))
        width = {"gate": b.n_ff, "attn_in": b.n_embd, "ffn_in": b.n_embd, "down_in": b.n_ff}
        width["attn_out"] = self._attn_out_width()
        self._sample_frac = {k: min(1.0, max_values / max(1, n_tok * width[k])) for k in KINDS}
        self._samples = {k: [[] for _ in range(b.n_layer)] for k in KINDS}
        self._rng = np.random.default_rng(seed)
        self._set("calib")
        try:
            for seg in segments:
                self._run(np.asarray(seg, np.int32), None)
                if progress is not None:
                    progress(len(seg))
        finally:
            self._mode = "none"
        samples = {k: [np.sort(np.concatenate(v)) if v else np.zeros(0, np.float32) for v in per]
                   for k, per in self._samples.items()}
        self._samples = {}
        return Calibration(samples, n_tok)

    def _attn_out_width(self) -> int:
        hdr, _ = inspect_model(self.path)
        t = next((t for t in hdr.tensors if t.name == "blk.0.attn_output.weight"), None)
        return int(t.ne[0]) if t is not None else self.base.n_embd

    def cats_perplexity(self, segments: Sequence[np.ndarray], thresholds: np.ndarray) -> tuple[float, float]:
        """(perplexity, realized gate sparsity) of `segments` under CATS at per-layer `thresholds`
        (all 0: dense): what kairox.threshold_search measures at each step."""
        thr = np.asarray(thresholds, np.float32)
        r = self.perplexity(segments, Rule.of_cats(thr) if np.any(thr > 0) else Rule.none())
        return r.ppl, r.sparsity.fraction("gate")

    def perplexity(self, segments: Sequence[np.ndarray], rule: Rule | None = None,
                   progress: Callable[[int], None] | None = None) -> PerplexityResult:
        """Perplexity of `segments` under `rule` (module docstring: the second half of each
        segment is scored), with the sparsity realized over all of their tokens."""
        import time

        t0 = time.perf_counter()
        self._set("apply" if self.callback else "none", rule)
        total = Sparsity.zeros(self.base.n_layer)
        nll_sum, scored, per_seg = 0.0, 0, []
        try:
            for seg in segments:
                seg = np.asarray(seg, np.int32)
                first = len(seg) // 2
                acc = [0.0, 0]

                def score(lo: int, lg: np.ndarray, seg: np.ndarray = seg, first: int = first,
                          acc: list = acc) -> None:
                    # rows lo+i predict seg[lo+i+1]; scored positions first .. n-2
                    a, z = max(first, lo), min(lo + len(lg), len(seg) - 1)
                    for r0 in range(a, z, 64):  # bounded temporaries: 64 x vocab
                        r1 = min(r0 + 64, z)
                        x = lg[r0 - lo:r1 - lo].astype(np.float64)
                        mx = x.max(axis=1)
                        lse = mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))
                        acc[0] += float(np.sum(lse - x[np.arange(r1 - r0), seg[r0 + 1:r1 + 1]]))
                        acc[1] += r1 - r0

                self._run(seg, score)
                nll_sum += acc[0]
                scored += acc[1]
                per_seg.append(acc[0] / max(acc[1], 1))
                for k in KINDS:
                    total.zeroed[k] += self._stats.zeroed[k]
                    total.seen[k] += self._stats.seen[k]
                    self._stats.zeroed[k][:] = 0
                    self._stats.seen[k][:] = 0
                if progress is not None:
                    progress(len(seg))
        finally:
            self._mode = "none"
        if scored == 0:
            raise QualityError("no token was scored: segments need at least 3 tokens")
        nll = nll_sum / scored
        return PerplexityResult(float(np.exp(nll)), nll, scored, total, time.perf_counter() - t0, per_seg)

    def close(self) -> None:
        C = self._C
        if getattr(self, "batch", None) is not None:
            C.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            C.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            C.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "Emulator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------- weight bytes

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# the input each projection reads (TEAL skips the weight columns of zeroed input entries)
PROJECTION_INPUT = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_output": "attn_out",
                    "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "ffn_down": "down_in"}


@dataclass
class WeightBytes:
    """Bytes of the weight matrices one token reads, from the model file: per layer and
    projection, plus the output head (output.weight, or the tied token_embd) read whole and
    the embedding row a token looks up."""
    layers: list[dict[str, int]]
    head: int
    embd_row: int

    @classmethod
    def of_model(cls, path: str | Path) -> "WeightBytes":
        import gguf
        r = gguf.GGUFReader(str(path))
        size = {t.name: int(t.n_bytes) for t in r.tensors}
        shape = {t.name: [int(v) for v in t.shape] for t in r.tensors}
        n_layer = 0
        while f"blk.{n_layer}.ffn_down.weight" in size:
            n_layer += 1
        layers = [{p: size.get(f"blk.{il}.{p}.weight", 0) for p in PROJECTIONS} for il in range(n_layer)]
        emb = size["token_embd.weight"]
        head = size.get("output.weight", emb)
        return cls(layers, head, emb // max(shape["token_embd.weight"][-1], 1))

    @property
    def dense(self) -> int:
        return sum(sum(d.values()) for d in self.layers) + self.head + self.embd_row

    @property
    def dense_layers(self) -> int:
        return sum(sum(d.values()) for d in self.layers)

    def read(self, density: Callable[[int, str], float]) -> tuple[float, float]:
        """(fraction of dense bytes per token, the same over the layers' matrices only) when
        projection p of layer il reads density(il, p) of its weight."""
        lay = sum(b * density(il, p) for il, d in enumerate(self.layers) for p, b in d.items())
        return ((lay + self.head + self.embd_row) / self.dense, lay / self.dense_layers)

    def cats(self, sparsity: np.ndarray, predicted: bool) -> tuple[float, float]:
        """CATS as kairox runs it: up and down rows of skipped neurons are not read; the gate
        is read whole in threshold mode (it decides) and sparsely in predicted mode (a
        predictor decides; its own cost is not counted here)."""
        skip = ("ffn_up", "ffn_down", "ffn_gate") if predicted else ("ffn_up", "ffn_down")
        return self.read(lambda il, p: 1.0 - float(sparsity[il]) if p in skip else 1.0)

    def teal(self, sparsity: dict[str, np.ndarray]) -> tuple[float, float]:
        """TEAL: each projection reads the columns of its input's nonzero entries."""
        return self.read(lambda il, p: 1.0 - float(sparsity[PROJECTION_INPUT[p]][il]))

    def teal_layout_bytes(self) -> int:
        """Bytes of the transposed copies column access needs: q/k/v/o/gate/up (kairox's pack
        already holds down transposed, as rows per neuron)."""
        return sum(b for d in self.layers for p, b in d.items() if p != "ffn_down")


def realized(s: Sparsity, kinds: Iterable[str] = KINDS) -> dict[str, float]:
    return {k: s.fraction(k) for k in kinds}


__all__ = ["ACTIVATIONS", "CATS_MODE", "Calibration", "Emulator", "GATE", "KINDS", "PROJECTIONS",
           "PerplexityResult", "QualityError", "Rule", "Sparsity", "TEAL_INPUTS", "WeightBytes", "realized"]
