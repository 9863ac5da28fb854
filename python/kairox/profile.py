"""Activation profiling: run a model densely over text and record what its FFNs do.

The work happens in native code (`kx_collector_*` in ggml_ext/llama/kx-collect.cpp), an
eval callback on llama.cpp's graph that reads three tensors per layer as they are
computed: the FFN input x (`ffn_norm-L`), the gate pre-activation g (`ffn_gate-L`) and the
residual stream (`l_out-L`). It keeps aggregates (a histogram of |act(g)|, per-neuron
active counts, the cosine between adjacent layers' hidden states) and, for the decode in
flight, each token's x and active mask (|act(g)| > threshold, the rule of the sparse
kernels). Python pulls the aggregates and those rows after each decode; it never sees a
full activation tensor.

`Profiler` is the low-level driver (one model, one context, one collector);
`kairox.prepare` decides what to run and where the rows go on disk.
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .balancer import TraceStep, neuron_groups
from .pack import BaseModel, inspect_model, pack_path_for, read_pack

# enum kx_select_act (ggml_ext/include/kx-ops.h)
ACT_IDS = {"relu": 1, "silu": 2, "gelu": 3}
KX_COLLECT_X, KX_COLLECT_MASK = 0, 1


class ProfileError(RuntimeError):
    """The model cannot be profiled; the message says why."""


def _lib():
    from .llama import _C
    lib = _C._lib
    if getattr(lib, "_kx_collect_ready", False):
        return lib
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    sig = {
        "kx_collector_new": (vp, [i32, i32, i32, i32, i32]),
        "kx_collector_free": (None, [vp]),
        "kx_collector_set_thresholds": (i32, [vp, ctypes.POINTER(ctypes.c_float)]),
        "kx_collector_begin": (None, [vp]),
        "kx_collector_reset": (None, [vp]),
        "kx_collector_n_rows": (i32, [vp, i32, i32]),
        "kx_collector_get_x": (i64, [vp, i32, ctypes.POINTER(ctypes.c_float), i64]),
        "kx_collector_get_mask": (i64, [vp, i32, ctypes.POINTER(ctypes.c_uint8), i64]),
        "kx_collector_get_counts": (i32, [vp, i32, ctypes.POINTER(ctypes.c_int64)]),
        "kx_collector_get_hist": (i32, [vp, i32, ctypes.POINTER(ctypes.c_int64)]),
        "kx_collector_get_cosine": (i32, [vp, i32, ctypes.POINTER(ctypes.c_double),
                                          ctypes.POINTER(ctypes.c_int64)]),
        "kx_collector_n_skipped": (i64, [vp]),
        "kx_collector_set_stop_after_last": (None, [vp, ctypes.c_bool]),
        "kx_collect_hist_bins": (i32, []),
        "kx_collect_hist_range": (None, [ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    lib._kx_collect_ready = True
    return lib


def hist_edges() -> np.ndarray:
    """Lower edges of the |act| histogram bins (bin 0 = exact zeros, edge 0).

    Bin k >= 1 covers [edges[k], edges[k+1]); the last bin is open above."""
    lib = _lib()
    n = lib.kx_collect_hist_bins()
    lo, hi = ctypes.c_double(), ctypes.c_double()
    lib.kx_collect_hist_range(ctypes.byref(lo), ctypes.byref(hi))
    width = (hi.value - lo.value) / (n - 2)
    edges = np.zeros(n, np.float64)
    edges[1:] = 10.0 ** (lo.value + width * np.arange(n - 1))
    edges[1] = 0.0  # bin 1 also takes (0, 10^lo)
    return edges


def threshold_for_sparsity(hist: np.ndarray, target: float) -> tuple[float, float]:
    """(threshold, expected sparsity) such that about `target` of the |act| values are <= the
    threshold, read from one layer's histogram (log-linear inside the bin that crosses the
    target). The rule |act| > threshold then leaves a fraction ~(1 - target) active.

    Exact zeros (ReLU) are inactive under any threshold >= 0, so a target below the zero
    fraction gives threshold 0 and the zero fraction as the sparsity."""
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target sparsity must be in [0, 1), got {target}")
    h = _checked_hist(hist)
    cum = np.cumsum(h) / h.sum()
    if cum[0] >= target:
        return 0.0, float(cum[0])
    return _threshold_at(cum, target), float(target)


def threshold_for_mass(hist: np.ndarray, share: float) -> tuple[float, float]:
    """(threshold, expected sparsity) such that the |act| values <= the threshold carry about
    `share` of the layer's total |act| (its L1 mass; each bin's values counted at its
    geometric centre). Skipping them leaves out that share of the activation mass: equal
    shares give every layer about the same relative error, where equal sparsity would cut
    deeper into layers whose activations are spread evenly."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"mass share must be in [0, 1), got {share}")
    h = _checked_hist(hist)
    mass = np.cumsum(h * _bin_centres()) / max(float(np.sum(h * _bin_centres())), 1e-300)
    if mass[0] >= share or share == 0.0:
        return 0.0, float(h[0] / h.sum())
    thr = _threshold_at(mass, share)
    return thr, sparsity_at(hist, thr)


def sparsity_at(hist: np.ndarray, threshold: float) -> float:
    """The share of |act| values <= threshold (log-linear inside its bin): the sparsity the
    rule |act| > threshold gives on the histogram's tokens."""
    h = _checked_hist(hist)
    edges = hist_edges()
    cum = np.cumsum(h) / h.sum()
    if threshold <= 0.0:
        return float(cum[0])
    k = int(np.searchsorted(edges, threshold, side="right")) - 1  # bin holding it
    lo, hi = _bin_bounds(edges, k)
    frac = float(np.clip((np.log(threshold) - np.log(lo)) / (np.log(hi) - np.log(lo)), 0.0, 1.0))
    return float(cum[k - 1] + frac * (cum[k] - cum[k - 1]))


def _checked_hist(hist: np.ndarray) -> np.ndarray:
    h = np.asarray(hist, np.float64)
    if h.sum() <= 0:
        raise ProfileError("the histogram is empty: no activation was recorded")
    return h


def _bin_bounds(edges: np.ndarray, k: int) -> tuple[float, float]:
    """Bin k's range for log interpolation: bin 1's open lower end is read as one bin width
    below its upper edge, the last bin's open upper end as one width above its lower edge."""
    lo = edges[k] if edges[k] > 0 else edges[2] / (edges[3] / edges[2])
    hi = edges[k + 1] if k + 1 < len(edges) else edges[k] * (edges[k] / edges[k - 1])
    return float(lo), float(hi)


def _bin_centres() -> np.ndarray:
    edges = hist_edges()
    c = np.zeros(len(edges))
    for k in range(1, len(edges)):
        lo, hi = _bin_bounds(edges, k)
        c[k] = math.sqrt(lo * hi)
    return c


def _threshold_at(cum: np.ndarray, target: float) -> float:
    """The threshold where the cumulative curve `cum` (per bin, from bin 0) reaches target,
    log-linear inside the bin that crosses it; cum[0] < target."""
    edges = hist_edges()
    k = int(np.searchsorted(cum, target))  # first bin whose cumulative share reaches it
    below = cum[k - 1]
    frac = (target - below) / max(cum[k] - below, 1e-300)
    lo, hi = _bin_bounds(edges, k)
    return float(np.exp(np.log(lo) + frac * (np.log(hi) - np.log(lo))))


def tokenize(C: Any, vocab: Any, text: str, add_bos: bool = False) -> np.ndarray:
    """`text`'s tokens with llama.cpp's tokenizer (C: kairox.llama._C)."""
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = (C.llama_token * cap)()
    n = C.llama_tokenize(vocab, data, len(data), buf, cap, add_bos, False)
    if n < 0:
        raise ProfileError("tokenization overflowed its buffer")
    return np.array(buf[:n], dtype=np.int32)


def vocab_bos(C: Any, vocab: Any) -> int | None:
    """The BOS token a prompt starts with, None when the vocabulary adds none."""
    if not C.llama_vocab_get_add_bos(vocab):
        return None
    return int(C.llama_vocab_bos(vocab))


def fill_batch(bt: Any, tokens: np.ndarray, lo: int, hi: int) -> Any:
    """tokens[lo:hi] at positions lo.., one sequence, logits for every token (else llama.cpp
    drops the last layer's other rows); returns the batch."""
    bt.n_tokens = hi - lo
    for j in range(hi - lo):
        bt.token[j] = int(tokens[lo + j])
        bt.pos[j] = lo + j
        bt.n_seq_id[j] = 1
        bt.seq_id[j][0] = 0
        bt.logits[j] = 1
    return bt


@dataclass
class Rows:
    """One decode's rows for one layer: FFN inputs and bit-packed active masks."""
    x: np.ndarray      # float32 [n, n_embd]
    mask: np.ndarray   # uint8 [n, ceil(n_ff / 8)], bit order little


@dataclass
class Aggregates:
    """What the collector summed since the last pull, per layer."""
    counts: np.ndarray     # int64 [n_layer, n_ff]: tokens where each neuron was active
    hist: np.ndarray       # int64 [n_layer, bins]: |act(g)| histogram
    cos_sum: np.ndarray    # float64 [n_layer]: sum of cos(l_out[l-1], l_out[l]) (layer 0: 0)
    cos_n: np.ndarray      # int64 [n_layer]
    skipped: int

    def __iadd__(self, o: "Aggregates") -> "Aggregates":
        self.counts += o.counts
        self.hist += o.hist
        self.cos_sum += o.cos_sum
        self.cos_n += o.cos_n
        self.skipped += o.skipped
        return self

    @classmethod
    def zeros(cls, n_layer: int, n_ff: int, bins: int) -> "Aggregates":
        return cls(np.zeros((n_layer, n_ff), np.int64), np.zeros((n_layer, bins), np.int64),
                   np.zeros(n_layer), np.zeros(n_layer, np.int64), 0)

    def to_npz(self) -> dict[str, np.ndarray]:
        return {"counts": self.counts, "hist": self.hist, "cos_sum": self.cos_sum,
                "cos_n": self.cos_n, "skipped": np.array(self.skipped)}

    @classmethod
    def from_npz(cls, z) -> "Aggregates":
        return cls(z["counts"].copy(), z["hist"].copy(), z["cos_sum"].copy(), z["cos_n"].copy(),
                   int(z["skipped"]))


class Profiler:
    """A model loaded once with the collector installed; `run(tokens)` profiles a segment.

    Each segment starts with an empty KV cache (one prompt), is decoded in batches of
    n_batch tokens with logits requested for every token (else llama.cpp drops the last
    layer's other rows), and returns its rows per layer."""

    def __init__(self, model_path: str | Path, *, n_ctx: int = 512, n_batch: int = 512,
                 threads: int | None = None, n_gpu_layers: int = 0, verbose: bool = False) -> None:
        from llama_cpp._logger import set_verbose

        from .llama import _C
        self._C = _C
        set_verbose(verbose)  # llama.cpp's load log only on request
        self.lib = _lib()
        self.path = Path(model_path)
        _, self.base = inspect_model(self.path)
        if self.base.activation not in ACT_IDS:
            raise ProfileError(f"cannot profile activation {self.base.activation!r}")
        b = self.base
        self.n_ctx, self.n_batch = int(n_ctx), int(min(n_batch, n_ctx))
        self.mask_bytes = (b.n_ff + 7) // 8
        self.bins = self.lib.kx_collect_hist_bins()
        self.collector = self.lib.kx_collector_new(b.n_layer, b.n_embd, b.n_ff,
                                                   ACT_IDS[b.activation], self.n_batch)
        if not self.collector:
            raise ProfileError("kx_collector_new refused the model's dimensions")
        # the logits of profiled tokens are never read: skip computing them
        self.lib.kx_collector_set_stop_after_last(self.collector, True)
        self.model = self.ctx = None
        try:
            mp = _C.llama_model_default_params()
            mp.n_gpu_layers = n_gpu_layers
            self.model = _C.llama_model_load_from_file(os.fsencode(self.path), mp)
            if not self.model:
                raise ProfileError(f"llama.cpp could not load {self.path}")
            cp = _C.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = self.n_ctx, self.n_batch, self.n_batch
            cp.n_threads = cp.n_threads_batch = threads or max(1, os.cpu_count() or 1)
            self._cb = _C.ggml_backend_sched_eval_callback(
                ctypes.cast(self.lib.kx_collector_eval, ctypes.c_void_p).value)
            cp.cb_eval = self._cb
            cp.cb_eval_user_data = self.collector
            self.ctx = _C.llama_init_from_model(self.model, cp)
            if not self.ctx:
                raise ProfileError("llama.cpp could not create a context for profiling")
            self.vocab = _C.llama_model_get_vocab(self.model)
            self.batch = _C.llama_batch_init(self.n_batch, 0, 1)
        except BaseException:
            self.close()
            raise

    def set_thresholds(self, thr: np.ndarray) -> None:
        t = np.ascontiguousarray(thr, np.float32)
        if t.shape != (self.base.n_layer,) or self.lib.kx_collector_set_thresholds(
                self.collector, t.ctypes.data_as(ctypes.POINTER(ctypes.c_float))):
            raise ValueError(f"thresholds must be {self.base.n_layer} finite values >= 0")

    def tokenize(self, text: str, add_bos: bool = False) -> np.ndarray:
        return tokenize(self._C, self.vocab, text, add_bos)

    def bos(self) -> int | None:
        return vocab_bos(self._C, self.vocab)

    def run(self, tokens: np.ndarray) -> list[Rows]:
        """Profile one segment (at most n_ctx tokens, from an empty cache)."""
        C, b = self._C, self.base
        n = len(tokens)
        if not 1 <= n <= self.n_ctx:
            raise ValueError(f"a segment has 1..{self.n_ctx} tokens, got {n}")
        C.llama_memory_clear(C.llama_get_memory(self.ctx), True)
        xs: list[list[np.ndarray]] = [[] for _ in range(b.n_layer)]
        ms: list[list[np.ndarray]] = [[] for _ in range(b.n_layer)]
        for lo in range(0, n, self.n_batch):
            hi = min(lo + self.n_batch, n)
            bt = fill_batch(self.batch, tokens, lo, hi)
            self.lib.kx_collector_begin(self.collector)
            rc = C.llama_decode(self.ctx, bt)
            if rc != 0:
                raise ProfileError(f"llama_decode failed ({rc}) while profiling")
            for il in range(b.n_layer):
                x, m = self._rows(il)
                if len(x) != hi - lo or len(m) != hi - lo:
                    raise ProfileError(
                        f"layer {il}: the collector saw {len(x)} FFN inputs and {len(m)} gates "
                        f"for {hi - lo} tokens; this model's graph does not expose "
                        f"ffn_norm-{il} / ffn_gate-{il} as kairox expects")
                xs[il].append(x)
                ms[il].append(m)
        return [Rows(np.concatenate(xs[il]), np.concatenate(ms[il])) for il in range(b.n_layer)]

    def _rows(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        lib, c = self.lib, self.collector
        nx = lib.kx_collector_n_rows(c, il, KX_COLLECT_X)
        nm = lib.kx_collector_n_rows(c, il, KX_COLLECT_MASK)
        x = np.empty((nx, self.base.n_embd), np.float32)
        m = np.empty((nm, self.mask_bytes), np.uint8)
        lib.kx_collector_get_x(c, il, x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), x.size)
        lib.kx_collector_get_mask(c, il, m.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), m.size)
        return x, m

    def pull(self) -> Aggregates:
        """The aggregates since the last pull (the collector's are then zeroed)."""
        lib, c, b = self.lib, self.collector, self.base
        agg = Aggregates.zeros(b.n_layer, b.n_ff, self.bins)
        s, k = ctypes.c_double(), ctypes.c_int64()
        for il in range(b.n_layer):
            lib.kx_collector_get_counts(c, il, agg.counts[il].ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
            lib.kx_collector_get_hist(c, il, agg.hist[il].ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
            lib.kx_collector_get_cosine(c, il, ctypes.byref(s), ctypes.byref(k))
            agg.cos_sum[il], agg.cos_n[il] = s.value, k.value
        agg.skipped = int(lib.kx_collector_n_skipped(c))
        lib.kx_collector_reset(c)
        return agg

    def close(self) -> None:
        C = self._C
        if getattr(self, "batch", None) is not None:
            C.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            C.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            C.llama_model_free(self.model)
            self.model = None
        if self.collector:
            self.lib.kx_collector_free(self.collector)
            self.collector = None

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stats_on_prompts(model_path: str | Path, prompts: list[list[int]], *, threads: int | None = None,
                     n_gpu_layers: int = 0, segment_len: int = 128, quiet: bool = True) -> Any:
    """Activation statistics (kairox.stats.ModelStats) of a ReLU model over token prompts,
    each a document profiled from an empty cache; no predictor is involved. Masks of all
    tokens are kept in memory (T x n_ff bits per layer)."""
    from tqdm import tqdm

    from .stats import ModelStats, compute_layer_stats

    n_ctx = max(len(p) for p in prompts)
    with Profiler(model_path, n_ctx=n_ctx, n_batch=min(n_ctx, 256), threads=threads,
                  n_gpu_layers=n_gpu_layers) as prof:
        b = prof.base
        if b.activation != "relu":
            raise ProfileError(f"stats_on_prompts measures ReLU models, not {b.activation!r}")
        prof.set_thresholds(np.zeros(b.n_layer, np.float32))
        masks: list[list[np.ndarray]] = [[] for _ in range(b.n_layer)]
        doc = []
        for d, toks in enumerate(tqdm(prompts, desc="profile", unit="prompt", disable=quiet, file=sys.stderr)):
            for il, r in enumerate(prof.run(np.asarray(toks, np.int32))):
                masks[il].append(r.mask)
            doc.append(np.full(len(toks), d))
        agg = prof.pull()
    doc_id = np.concatenate(doc)
    cos = np.divide(agg.cos_sum, np.maximum(agg.cos_n, 1))
    layers = [compute_layer_stats(unpack_masks(np.concatenate(masks[il]), b.n_ff), doc_id, segment_len,
                                  layer=il, counts=agg.counts[il],
                                  hidden_cosine=float(cos[il]) if agg.cos_n[il] else None)
              for il in range(b.n_layer)]
    return ModelStats(Path(model_path).name, b.n_layer, b.n_ff, int(doc_id.size), layers, {})


def measure_freqs(model_path: str | Path, prompts: list[list[int]], *, threads: int | None = None,
                  n_gpu_layers: int = 0, quiet: bool = True,
                  keep_x: int = 0) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Activation frequency of every neuron of a ReLU model, float32 [n_layer, n_ff]: the
    share of the prompts' tokens on which it fired (act > 0), each prompt decoded densely
    from an empty cache. What a static placement ranks neurons by (PowerInfer's offline
    profile), without the masks and predictor data `kairox prepare` also collects. With
    keep_x > 0, also up to keep_x FFN inputs per layer ([n, n_embd] each, spread evenly over
    the prompts' tokens; the load-aware thresholds' calibration), else None."""
    from tqdm import tqdm

    n_ctx = max(len(p) for p in prompts)
    n_tok = sum(len(p) for p in prompts)
    every = max(1, -(-n_tok // keep_x)) if keep_x > 0 else 0
    xs: list[list[np.ndarray]] | None = None
    with Profiler(model_path, n_ctx=n_ctx, n_batch=min(n_ctx, 512), threads=threads,
                  n_gpu_layers=n_gpu_layers) as prof:
        if prof.base.activation != "relu":
            raise ProfileError(f"measure_freqs measures ReLU models, not {prof.base.activation!r}")
        prof.set_thresholds(np.zeros(prof.base.n_layer, np.float32))
        if every:
            xs = [[] for _ in range(prof.base.n_layer)]
        for toks in tqdm(prompts, desc="profile", unit="prompt", disable=quiet, file=sys.stderr):
            rows = prof.run(np.asarray(toks, np.int32))
            if xs is not None:
                for il, r in enumerate(rows):
                    xs[il].append(r.x[::every])
        agg = prof.pull()
    freqs = (agg.counts / max(n_tok, 1)).astype(np.float32)
    return freqs, None if xs is None else [np.concatenate(x)[:keep_x] for x in xs]


def unpack_masks(packed: np.ndarray, n_ff: int) -> np.ndarray:
    """uint8 [n, ceil(n_ff/8)] (little bit order) -> bool [n, n_ff]."""
    return np.unpackbits(packed, axis=1, count=n_ff, bitorder="little").astype(bool)


__all__ = ["ACT_IDS", "Aggregates", "BaseModel", "ProfileError", "Profiler", "Rows", "fill_batch", "sparsity_at", "threshold_for_mass",
           "hist_edges", "stats_on_prompts", "threshold_for_sparsity", "tokenize", "unpack_masks", "vocab_bos"]


def record_trace(model_path: str | Path, pack_path: str | Path | None, prompts: list[list[int]],
                 threads: int | None = None, group_size: int | None = None
                 ) -> tuple[list[TraceStep], int, np.ndarray]:
    """Active groups of every layer for every token of the prompts (a dense forward pass
    with the native profiler; a neuron is active when |act| exceeds the pack's threshold of
    its layer, the rule of the sparse mode: 0 for ReLU models), with the
    neurons that fired in each, numbered token by token across the prompts. Groups are the
    pack's, or with `group_size` groups of that many neurons by descending offline
    frequency (hot with hot; 1: neuron-granular). Returns the trace, the group count and
    each layer's group frequency [n_layer, n_groups] (the share of tokens it was active in)."""
    pack = read_pack(pack_path or pack_path_for(model_path), model_path)
    groups = [neuron_groups(layer.perm, layer.group, layer.freq, group_size) for layer in pack.layers]
    n_groups = pack.n_groups if group_size is None else -(-pack.base.n_ff // group_size)
    steps: list[TraceStep] = []
    freq = np.zeros((len(groups), n_groups), np.float64)
    t0 = 0
    with Profiler(model_path, n_ctx=max(len(p) for p in prompts), threads=threads) as prof:
        prof.set_thresholds(np.asarray(pack.threshold, np.float32))
        for toks in prompts:
            rows = prof.run(np.asarray(toks, np.int32))
            per_layer = []
            for il, r in enumerate(rows):
                m = unpack_masks(r.mask, prof.base.n_ff)          # [tokens, n_ff]
                cnt = np.zeros((m.shape[0], n_groups), np.int32)
                tok_idx, neuron = np.nonzero(m)
                np.add.at(cnt, (tok_idx, groups[il][neuron]), 1)
                freq[il] += (cnt > 0).sum(0)
                per_layer.append(cnt)
            for t in range(len(toks)):
                for il, cnt in enumerate(per_layer):
                    g = np.flatnonzero(cnt[t])
                    steps.append(TraceStep(t0 + t, il, tuple(g.tolist()), counts=tuple(cnt[t, g].tolist())))
            t0 += len(toks)
    return steps, n_groups, (freq / max(t0, 1)).astype(np.float32)
