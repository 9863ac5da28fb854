"""Activation statistics of a model's FFN, measured on calibration text, next to the papers'.

Every measure starts from one layer's boolean *active masks* `masks[T, n_ff]` (row t: which
FFN neurons fire on token t; tokens in text order) and `doc_id[T]` (which document each token
comes from; a document is a maximal run of equal ids, so tokens of one document must be
contiguous). "Active set" A_t is the set of neurons with masks[t] true; counts[i] is the
number of tokens on which neuron i fires.

Measures, with the published values they are compared with:

density
    mean over tokens of |A_t| / n_ff.

hot_fraction (PowerInfer: 17-26% of neurons carry 80% of the activations)
    sort counts descending; the smallest k with counts[0] + ... + counts[k-1] >= 0.8 *
    sum(counts); reported as k / n_ff. NaN when no neuron ever fires.

adjacent_jaccard (DynamicInfer: 0.70-0.75 between adjacent tokens)
    mean of the Jaccard distance d(A, B) = 1 - |A ∩ B| / |A ∪ B| over pairs (A_t, A_t+1)
    of consecutive tokens of the same document. Pairs across a document boundary are not
    adjacent text; pairs with both sets empty have no defined distance; both are skipped.

cross_prompt_jaccard (DynamicInfer: 0.53-0.57 between prompts)
    the tokens are cut into prompt-sized segments (e.g. 128 tokens, never across
    documents). A segment's *working set* is the k neurons it activates most often, k =
    round-half-up(mean |A_t| over its tokens), ties broken by lower neuron id. Reported:
    the mean Jaccard distance between the working sets of segments from different
    documents (all such pairs, or a seeded uniform sample of at most 2000 of them). The
    union of a prompt's active sets is not used: over 128 tokens it holds almost every
    neuron of the layer, so every pair of prompts would look identical (distance ≈ 0).
    The top-k set has the size of one token's active set, so this distance is on the same
    scale as the adjacent one and says how much the neurons a prompt keeps using change
    from one prompt to another.

reactivation (KAIROX: bottom-70% neurons by frequency have < 0.2 probability of firing
again after a gap > 2 tokens)
    a hazard per gap g = 1..max_gap: among (token t, neuron i) with i's last activation in
    the same document exactly g tokens before t (so i stayed silent in between), the
    fraction where i fires at t. Computed separately for the *cold* class (the
    cold_fraction = 70% of neurons with the lowest counts, ties by neuron id) and the *hot*
    class (the rest). `reactivation_after_gap` pools gaps 3..max_gap (at-risk weighted),
    the single number compared with the paper's 0.2.

hidden_cosine (KAIROX: ≈ 0.98 between adjacent layers), predictor recall / precision,
over-fetch ((neurons loaded − neurons active) ÷ neurons active when every group holding an
active neuron is fetched whole, per grouping method such as metis / frequency / random;
0 is perfect, kairox.grouping.overfetch) and the activation threshold are measured by
the caller and stored here as given. The papers' predictor recall is not reduced to one
reference number here.

`ModelStats` holds one `LayerStats` per layer plus free-form `extra` (e.g. `ppl_curve`: a
list of {target_sparsity, measured_sparsity, ppl}, and `dense_ppl`), and round-trips
through plain JSON (NaN is written as null). `format_table` prints it and `plot_stats` draws
it; `kairox stats PACK` (kairox.cli.stats) shows the statistics a pack carries.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# (low, high, source, how the paper states it). A point value has low == high.
PAPER = {
    "hot_fraction_80": (0.17, 0.26, "PowerInfer", "17-26% of neurons hold 80% of activations"),
    "adjacent_jaccard": (0.70, 0.75, "DynamicInfer", "Jaccard distance 0.70-0.75 between adjacent tokens"),
    "cross_prompt_jaccard": (0.53, 0.57, "DynamicInfer", "Jaccard distance 0.53-0.57 between prompts"),
    "cold_reactivation": (0.0, 0.2, "KAIROX", "bottom-70% neurons re-fire with p < 0.2 after a gap > 2"),
    "hidden_cosine": (0.98, 0.98, "KAIROX", "adjacent-layer hidden-state cosine ≈ 0.98"),
}

# Cells of a [T, n] bool block handled at once: bounds the temporaries (and np.nonzero's
# int64 index arrays) to tens of MiB whatever T and n_ff are.
_BLOCK_CELLS = 1 << 22


# ---------------------------------------------------------------------------------------
# helpers

def _as_masks(masks: np.ndarray) -> np.ndarray:
    m = np.asarray(masks)
    if m.ndim != 2:
        raise ValueError(f"masks must be 2-D [tokens, n_ff], got shape {m.shape}")
    return m if m.dtype == np.bool_ else m.astype(bool)


def _as_doc_id(doc_id: np.ndarray | None, T: int) -> np.ndarray:
    if doc_id is None:
        return np.zeros(T, dtype=np.int64)
    d = np.asarray(doc_id).reshape(-1)
    if d.shape[0] != T:
        raise ValueError(f"doc_id has {d.shape[0]} entries for {T} tokens")
    return d


def _runs(doc_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token: index of its document run, and the (exclusive) end token of that run.

    A document is a maximal run of equal ids, so "same document" means "no id change in
    between" and an id reused later starts a new document rather than continuing one.
    """
    T = doc_id.shape[0]
    if T == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(doc_id[1:] != doc_id[:-1]) + 1
    run = np.zeros(T, dtype=np.int64)
    run[starts] = 1
    run = np.cumsum(run)
    ends = np.append(starts, T)
    return run, ends[run]


def _nanmean(values: list[float | None]) -> float:
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    return float(np.mean(v)) if v else math.nan


# ---------------------------------------------------------------------------------------
# measures

def hot_fraction(counts: np.ndarray, mass: float = 0.8) -> float:
    """Smallest fraction of neurons whose activation counts sum to >= `mass` of the total.

    Neurons are taken in descending count order, which is what makes the subset smallest.
    NaN when the total is 0 (no activations: no subset carries any share of them).
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    total = c.sum()
    if c.size == 0 or total <= 0:
        return math.nan
    csum = np.cumsum(np.sort(c)[::-1])
    # relative slack so that exact splits (e.g. 80 of 100) are not lost to float rounding
    k = int(np.searchsorted(csum, mass * total * (1 - 1e-12), side="left")) + 1
    return min(k, c.size) / c.size


def adjacent_jaccard(masks: np.ndarray, doc_id: np.ndarray | None = None) -> float:
    """Mean Jaccard distance 1 - |A∩B|/|A∪B| between consecutive tokens of one document.

    Pairs crossing a document boundary and pairs with both sets empty are skipped. NaN if
    no pair is left.
    """
    m = _as_masks(masks)
    T, n = m.shape
    d = _as_doc_id(doc_id, T)
    if T < 2:
        return math.nan
    same = d[1:] == d[:-1]
    total, pairs = 0.0, 0
    step = max(1, _BLOCK_CELLS // max(n, 1))
    for s in range(0, T - 1, step):
        e = min(s + step, T - 1)
        a, b = m[s:e], m[s + 1:e + 1]
        inter = np.count_nonzero(a & b, axis=1)
        union = np.count_nonzero(a | b, axis=1)
        keep = same[s:e] & (union > 0)
        total += float(np.sum(1.0 - inter[keep] / union[keep]))
        pairs += int(np.count_nonzero(keep))
    return total / pairs if pairs else math.nan


def prompt_segments(doc_id: np.ndarray, segment_len: int = 128, min_len: int | None = None) -> np.ndarray:
    """Cut each document into consecutive segments of `segment_len` tokens.

    Returns segment ids [T]; tokens of a document's last segment shorter than `min_len`
    (default segment_len // 2) get -1 (in no segment), since a working set taken from a
    handful of tokens is mostly noise. A document shorter than min_len has no segment.
    """
    if segment_len <= 0:
        raise ValueError(f"segment_len must be positive, got {segment_len}")
    d = np.asarray(doc_id).reshape(-1)
    min_len = segment_len // 2 if min_len is None else min_len
    seg = np.full(d.shape[0], -1, dtype=np.int64)
    _, end = _runs(d)
    nxt = 0
    t = 0
    while t < d.shape[0]:
        stop = int(end[t])
        for s in range(t, stop, segment_len):
            e = min(s + segment_len, stop)
            if e - s >= max(min_len, 1):
                seg[s:e] = nxt
                nxt += 1
        t = stop
    return seg


def working_set(masks: np.ndarray) -> np.ndarray:
    """The k neurons a run of tokens activates most often, k = round-half-up(mean |A_t|).

    Ties are broken by lower neuron id so the set is deterministic. Returns sorted ids.
    """
    m = _as_masks(masks)
    if m.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    cnt = np.count_nonzero(m, axis=0)
    k = int(math.floor(cnt.sum() / m.shape[0] + 0.5))
    order = np.lexsort((np.arange(cnt.size), -cnt))  # by count desc, then id asc
    return np.sort(order[:k])


def cross_prompt_jaccard(masks: np.ndarray, segment_id: np.ndarray, doc_id: np.ndarray | None,
                         max_pairs: int | None = 2000, seed: int = 0) -> float:
    """Mean Jaccard distance between working sets of segments from different documents.

    segment_id[T] gives each token's segment (negative: in none); a segment must lie in one
    document. All pairs of segments from different documents are used, or a seeded uniform
    sample of `max_pairs` of them when there are more. Pairs of two empty working sets are
    skipped. NaN if fewer than two documents have a segment.
    """
    m = _as_masks(masks)
    T, n = m.shape
    d = _as_doc_id(doc_id, T)
    sid = np.asarray(segment_id).reshape(-1)
    if sid.shape[0] != T:
        raise ValueError(f"segment_id has {sid.shape[0]} entries for {T} tokens")
    run, _ = _runs(d)
    ids = np.unique(sid[sid >= 0])
    W = np.zeros((ids.size, n), dtype=bool)
    seg_doc = np.zeros(ids.size, dtype=np.int64)
    for j, s in enumerate(ids):
        rows = np.flatnonzero(sid == s)
        r = run[rows]
        if r.min() != r.max():
            raise ValueError(f"segment {s} spans more than one document")
        seg_doc[j] = r[0]
        W[j, working_set(m[rows])] = True
    ii, jj = np.triu_indices(ids.size, 1)
    diff = seg_doc[ii] != seg_doc[jj]
    ii, jj = ii[diff], jj[diff]
    if ii.size == 0:
        return math.nan
    if max_pairs is not None and ii.size > max_pairs:
        pick = np.sort(np.random.default_rng(seed).choice(ii.size, size=max_pairs, replace=False))
        ii, jj = ii[pick], jj[pick]
    total, pairs = 0.0, 0
    step = max(1, _BLOCK_CELLS // max(n, 1))
    for s in range(0, ii.size, step):
        a, b = W[ii[s:s + step]], W[jj[s:s + step]]
        inter = np.count_nonzero(a & b, axis=1)
        union = np.count_nonzero(a | b, axis=1)
        keep = union > 0
        total += float(np.sum(1.0 - inter[keep] / union[keep]))
        pairs += int(np.count_nonzero(keep))
    return total / pairs if pairs else math.nan


def request_distances(masks: np.ndarray, request_id: np.ndarray, domain: Sequence[str]) -> tuple[float, float]:
    """Mean Jaccard distance between the working sets (working_set) of requests of one domain
    and of requests of different domains: (same, other). request_id[T] numbers each token's
    request from 0; domain[r] names request r's domain. NaN where no pair exists; pairs of
    two empty sets are skipped."""
    m = _as_masks(masks)
    rid = np.asarray(request_id).reshape(-1)
    if rid.shape[0] != m.shape[0]:
        raise ValueError(f"request_id has {rid.shape[0]} entries for {m.shape[0]} tokens")
    n_req = len(domain)
    if rid.size and (rid.min() < 0 or rid.max() >= n_req):
        raise ValueError(f"request ids must lie in [0, {n_req})")
    W = np.zeros((n_req, m.shape[1]), dtype=bool)
    for r in range(n_req):
        W[r, working_set(m[rid == r])] = True
    sums = {True: [0.0, 0], False: [0.0, 0]}
    for a in range(n_req):
        for b in range(a + 1, n_req):
            union = np.count_nonzero(W[a] | W[b])
            if union:
                acc = sums[domain[a] == domain[b]]
                acc[0] += 1.0 - np.count_nonzero(W[a] & W[b]) / union
                acc[1] += 1
    return tuple(t / n if n else math.nan for t, n in (sums[True], sums[False]))


def cold_mask(counts: np.ndarray, cold_fraction: float = 0.7) -> np.ndarray:
    """True for the round(cold_fraction * n) neurons with the lowest counts (ties: lower id)."""
    c = np.asarray(counts).reshape(-1)
    n_cold = int(math.floor(cold_fraction * c.size + 0.5))
    cold = np.zeros(c.size, dtype=bool)
    cold[np.argsort(c, kind="stable")[:n_cold]] = True
    return cold


def reactivation_curve(masks: np.ndarray, counts: np.ndarray | None = None, max_gap: int = 16,
                       cold_fraction: float = 0.7, doc_id: np.ndarray | None = None) -> dict[str, list]:
    """Hazard of re-firing vs gap, for the cold and the hot neurons.

    For g = 1..max_gap: P(neuron fires at t | its last activation in this document was at
    t - g). Returns {"gap": [1..max_gap], "cold": [...], "hot": [...], "cold_at_risk": [...],
    "hot_at_risk": [...]}, a hazard being NaN where no (token, neuron) was at risk. counts
    (default: column sums of masks) only decides the classes.

    Instead of stepping through tokens with a "last fired" array, each neuron's firing
    times are split into intervals between consecutive firings in one document, plus the
    silent tail after its last firing there. An interval of length L puts the neuron at
    risk at gaps 1..L and fires at gap L; a tail of length L is at risk at gaps 1..L
    without firing. That is the same count as the token loop, done with a few array
    operations over blocks of neurons.
    """
    if max_gap < 1:
        raise ValueError(f"max_gap must be >= 1, got {max_gap}")
    m = _as_masks(masks)
    T, n = m.shape
    d = _as_doc_id(doc_id, T)
    c = np.count_nonzero(m, axis=0) if counts is None else np.asarray(counts).reshape(-1)
    if c.size != n:
        raise ValueError(f"counts has {c.size} entries for {n} neurons")
    cls_of = (~cold_mask(c, cold_fraction)).astype(np.int64)  # 0 cold, 1 hot
    run, run_end = _runs(d)
    G = max_gap + 1
    fired = np.zeros(2 * G, dtype=np.int64)   # [class * G + gap]: intervals of that length
    length = np.zeros(2 * G, dtype=np.int64)  # [class * G + min(length, max_gap)]: intervals and tails
    B = max(1, _BLOCK_CELLS // max(T, 1))
    for c0 in range(0, n, B):
        sub = np.ascontiguousarray(m[:, c0:c0 + B].T)  # [neurons, T]: nonzero comes out per neuron
        nz_n, nz_t = np.nonzero(sub)
        if nz_n.size == 0:
            continue
        cls = cls_of[c0 + nz_n]
        same = (nz_n[1:] == nz_n[:-1]) & (run[nz_t[1:]] == run[nz_t[:-1]])
        gaps = (nz_t[1:] - nz_t[:-1])[same]
        gcls = cls[1:][same]
        last = np.append(~same, True)  # last firing of this neuron in this document
        tail = run_end[nz_t[last]] - nz_t[last] - 1
        tcls = cls[last]
        ok = gaps <= max_gap
        fired += np.bincount(gcls[ok] * G + gaps[ok], minlength=2 * G)
        length += np.bincount(gcls * G + np.minimum(gaps, max_gap), minlength=2 * G)
        length += np.bincount(tcls * G + np.minimum(tail, max_gap), minlength=2 * G)
    out: dict[str, list] = {"gap": list(range(1, max_gap + 1))}
    for k, name in ((0, "cold"), (1, "hot")):
        lens = length[k * G:(k + 1) * G]
        at_risk = np.cumsum(lens[::-1])[::-1][1:]  # at_risk[g-1] = #(length >= g)
        f = fired[k * G + 1:(k + 1) * G]
        with np.errstate(invalid="ignore", divide="ignore"):
            h = np.where(at_risk > 0, f / np.maximum(at_risk, 1), np.nan)
        out[name] = [float(x) for x in h]
        out[f"{name}_at_risk"] = [int(x) for x in at_risk]
    return out


def reactivation_after_gap(curve: dict[str, list], cls: str = "cold", min_gap: int = 3) -> float:
    """P(fire | last fired g tokens ago) pooled over g >= min_gap, weighted by the at-risk count.

    With min_gap=3 this is the number compared with KAIROX's "< 0.2 after a gap > 2". Falls
    back to an unweighted mean of the hazards when the curve carries no at-risk counts.
    """
    h = curve.get(cls) or []
    gaps = curve.get("gap") or list(range(1, len(h) + 1))
    risk = curve.get(f"{cls}_at_risk")
    num = den = 0.0
    vals = []
    for i, (g, p) in enumerate(zip(gaps, h)):
        if g < min_gap or p is None or math.isnan(p):
            continue
        vals.append(p)
        if risk is not None and i < len(risk):
            num += p * risk[i]
            den += risk[i]
    if risk is not None and den > 0:
        return num / den
    return float(np.mean(vals)) if vals else math.nan


# ---------------------------------------------------------------------------------------
# containers

@dataclass
class LayerStats:
    """One layer's statistics; see the module docstring for each definition."""
    layer: int
    density: float
    hot_fraction_80: float
    adjacent_jaccard: float
    cross_prompt_jaccard: float
    reactivation: dict[str, list] = field(default_factory=dict)
    hidden_cosine: float | None = None
    recall: float | None = None
    precision: float | None = None
    overfetch: dict[str, float] | None = None
    threshold: float | None = None


_REQUIRED_FLOATS = ("density", "hot_fraction_80", "adjacent_jaccard", "cross_prompt_jaccard")
_OPTIONAL_FLOATS = ("hidden_cosine", "recall", "precision", "threshold")


def _plain(x: Any) -> Any:
    """JSON-ready copy: numpy scalars/arrays to Python, NaN and ±inf to None (null)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        f = float(x)
        return f if math.isfinite(f) else None
    return x


def _float(x: Any) -> float:
    return math.nan if x is None else float(x)


@dataclass
class ModelStats:
    """A model's statistics: one LayerStats per layer, plus free-form `extra`."""
    model: str
    n_layer: int
    n_ff: int
    tokens: int
    layers: list[LayerStats] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(_plain(dataclasses.asdict(self)), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> ModelStats:
        """Parse `to_json`'s output. Raises ValueError on anything else."""
        try:
            o = json.loads(text)
            layers = []
            for lo in o["layers"]:
                reac = {k: ([_float(v) for v in vs] if k in ("cold", "hot") else list(vs))
                        for k, vs in (lo.get("reactivation") or {}).items()}
                ov = lo.get("overfetch")
                layers.append(LayerStats(
                    layer=int(lo["layer"]),
                    **{k: _float(lo.get(k)) for k in _REQUIRED_FLOATS},
                    reactivation=reac,
                    **{k: (None if lo.get(k) is None else float(lo[k])) for k in _OPTIONAL_FLOATS},
                    overfetch=None if ov is None else {str(k): _float(v) for k, v in ov.items()},
                ))
            extra = o.get("extra") or {}
            if not isinstance(extra, dict):
                raise TypeError("extra is not an object")
            return cls(model=str(o["model"]), n_layer=int(o["n_layer"]), n_ff=int(o["n_ff"]),
                       tokens=int(o["tokens"]), layers=layers, extra=extra)
        except ValueError:
            raise
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a kairox statistics object ({type(e).__name__}: {e})") from None


def compute_layer_stats(masks: np.ndarray, doc_id: np.ndarray | None, segment_len: int = 128, *,
                        layer: int = 0, counts: np.ndarray | None = None, max_gap: int = 16,
                        cold_fraction: float = 0.7, max_pairs: int | None = 2000, seed: int = 0,
                        hidden_cosine: float | None = None, recall: float | None = None,
                        precision: float | None = None, overfetch: dict[str, float] | None = None,
                        threshold: float | None = None) -> LayerStats:
    """All mask-derived measures of one layer; the caller-measured ones are passed through.

    counts defaults to the masks' column sums. Segments for the cross-prompt distance are
    `prompt_segments(doc_id, segment_len)`.
    """
    m = _as_masks(masks)
    T, _ = m.shape
    d = _as_doc_id(doc_id, T)
    c = np.count_nonzero(m, axis=0) if counts is None else np.asarray(counts)
    return LayerStats(
        layer=layer,
        density=float(np.count_nonzero(m) / m.size) if m.size else math.nan,
        hot_fraction_80=hot_fraction(c, 0.8),
        adjacent_jaccard=adjacent_jaccard(m, d),
        cross_prompt_jaccard=cross_prompt_jaccard(m, prompt_segments(d, segment_len), d,
                                                  max_pairs=max_pairs, seed=seed),
        reactivation=reactivation_curve(m, c, max_gap=max_gap, cold_fraction=cold_fraction, doc_id=d),
        hidden_cosine=None if hidden_cosine is None else float(hidden_cosine),
        recall=None if recall is None else float(recall),
        precision=None if precision is None else float(precision),
        overfetch=None if overfetch is None else {str(k): float(v) for k, v in overfetch.items()},
        threshold=None if threshold is None else float(threshold),
    )


# ---------------------------------------------------------------------------------------
# table

_METHOD_ORDER = ("metis", "frequency", "random")


def _methods(stats: ModelStats) -> list[str]:
    seen = {k for ly in stats.layers if ly.overfetch for k in ly.overfetch}
    return [m for m in _METHOD_ORDER if m in seen] + sorted(seen - set(_METHOD_ORDER))


def _fmt(x: float | None, kind: str = "f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if kind == "%":
        return f"{100 * x:.1f}%"
    if kind == "g":
        return f"{x:.4g}"
    return f"{x:.3f}"


def _range(lo: float, hi: float, kind: str) -> str:
    if kind == "%":
        return f"{100 * lo:.0f}-{100 * hi:.0f}%"
    if lo == hi:
        return f"≈{lo:.2f}"
    return f"< {hi:.2f}" if lo == 0 else f"{lo:.2f}-{hi:.2f}"


def format_table(stats: ModelStats) -> str:
    """Markdown table, one row per layer and a mean row, then the papers' values beside ours."""
    methods = _methods(stats)
    # (header, per-layer value getter, format); optional columns only when some layer has them
    cols: list[tuple[str, Any, str]] = [
        ("layer", None, ""),
        ("density", lambda s: s.density, "%"),
        ("hot 80%", lambda s: s.hot_fraction_80, "%"),
        ("adj J", lambda s: s.adjacent_jaccard, "f"),
        ("prompt J", lambda s: s.cross_prompt_jaccard, "f"),
        ("cold re-fire g>2", lambda s: reactivation_after_gap(s.reactivation, "cold"), "f"),
        ("hot re-fire g>2", lambda s: reactivation_after_gap(s.reactivation, "hot"), "f"),
    ]
    for name, attr, kind in (("cos", "hidden_cosine", "f"), ("recall", "recall", "f"),
                             ("precision", "precision", "f"), ("threshold", "threshold", "g")):
        if any(getattr(s, attr) is not None for s in stats.layers):
            cols.append((name, lambda s, a=attr: getattr(s, a), kind))
    for meth in methods:
        cols.append((f"over-fetch {meth}",
                     lambda s, m=meth: (s.overfetch or {}).get(m), "f"))

    rows = []
    for s in stats.layers:
        rows.append([str(s.layer)] + [_fmt(get(s), kind) for _, get, kind in cols[1:]])
    means = {h: _nanmean([get(s) for s in stats.layers]) for h, get, _ in cols[1:]}
    rows.append(["mean"] + [_fmt(means[h], kind) for h, _, kind in cols[1:]])

    heads = [h for h, _, _ in cols]
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    line = lambda cells: "| " + " | ".join(c.rjust(w[i]) for i, c in enumerate(cells)) + " |"  # noqa: E731
    out = [f"{stats.model}: {stats.n_layer} layers x {stats.n_ff} neurons, {stats.tokens} tokens",
           "", line(heads), "|" + "|".join("-" * (x + 1) + ":" for x in w) + "|"]
    out += [line(r) for r in rows]

    ours = {"hot_fraction_80": (means["hot 80%"], "%"),
            "adjacent_jaccard": (means["adj J"], "f"),
            "cross_prompt_jaccard": (means["prompt J"], "f"),
            "cold_reactivation": (means["cold re-fire g>2"], "f"),
            "hidden_cosine": (means.get("cos"), "f")}
    out += ["", "paper vs ours (mean over layers):"]
    for key, (lo, hi, src, text) in PAPER.items():
        val, kind = ours[key]
        out.append(f"  {src:<12} {key:<20} paper {_range(lo, hi, kind):<10} "
                   f"ours {_fmt(val, kind):<8} ({text})")

    curve = stats.extra.get("ppl_curve")
    if curve:
        out += ["", "perplexity vs sparsity:", "| target sparsity | measured sparsity | perplexity |",
                "|---:|---:|---:|"]
        for p in curve:
            out.append(f"| {_fmt(p.get('target_sparsity'), '%')} | {_fmt(p.get('measured_sparsity'), '%')} "
                       f"| {_fmt(p.get('ppl'), 'g')} |")
        if stats.extra.get("dense_ppl") is not None:
            out.append(f"dense perplexity: {_fmt(stats.extra['dense_ppl'], 'g')}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# plots

def plot_stats(stats: ModelStats, out_dir: str | Path) -> list[Path]:
    """Write the PNGs into out_dir and return their paths.

    stats-locality.png and stats-reactivation.png always; stats-perplexity.png when
    extra['ppl_curve'] exists; stats-overfetch.png when some layer has over-fetch ratios.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise RuntimeError(f"plotting needs matplotlib ({e}); "
                           "install it with `pip install matplotlib`") from None
    # Figure + the Agg canvas directly: no pyplot, so no GUI backend and no global state.

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def new(figsize: tuple[float, float], *grid: int) -> tuple[Any, Any]:
        fig = Figure(figsize=figsize, layout="constrained")
        FigureCanvasAgg(fig)
        return fig, fig.subplots(*grid) if grid else fig.subplots()

    def save(fig: Any, name: str) -> None:
        p = out / name
        fig.savefig(p, dpi=110)
        written.append(p)

    layers = [s.layer for s in stats.layers]
    nan = lambda v: math.nan if v is None else v  # noqa: E731

    # (1) locality
    fig, axs = new((11, 7.5), 2, 2)
    panels = [("hot_fraction_80", "fraction of neurons holding 80% of activations", "fraction of neurons"),
              ("adjacent_jaccard", "Jaccard distance, adjacent tokens", "Jaccard distance (0 = same set)"),
              ("cross_prompt_jaccard", "Jaccard distance, working sets of different prompts",
               "Jaccard distance (0 = same set)"),
              ("hidden_cosine", "hidden-state cosine, layer vs previous layer", "cosine similarity")]
    for ax, (key, title, ylab) in zip(axs.flat, panels):
        vals = [nan(getattr(s, key)) for s in stats.layers]
        lo, hi, src, _ = PAPER[key]
        if lo == hi:
            ax.axhline(lo, color="tab:orange", ls="--", label=f"{src} ≈{lo:g}")
        else:
            ax.axhspan(lo, hi, color="tab:orange", alpha=0.25, label=f"{src} {lo:g}-{hi:g}")
        if any(not math.isnan(v) for v in vals):
            ax.plot(layers, vals, "o-", color="tab:blue", label=f"{stats.model}")
        else:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center")
        ax.set_title(title, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
        ax.set_xlabel("layer")
        ax.set_ylabel(ylab)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{stats.model}: activation locality per layer ({stats.tokens} tokens)")
    save(fig, "stats-locality.png")

    # (2) reactivation
    fig, ax = new((8, 5))
    colors = {"cold": "tab:blue", "hot": "tab:red"}
    for cls, label in (("cold", "cold (bottom 70% by count)"), ("hot", "hot (top 30%)")):
        curves = [s.reactivation.get(cls) for s in stats.layers if s.reactivation.get(cls)]
        if not curves:
            continue
        g = max(curves, key=len)
        gaps = list(range(1, len(g) + 1))
        for s in stats.layers:
            c = s.reactivation.get(cls)
            if c:
                ax.plot(s.reactivation.get("gap") or gaps[:len(c)], [nan(v) for v in c],
                        color=colors[cls], alpha=0.15, lw=0.8)
        arr = np.full((len(curves), len(gaps)), np.nan)
        for i, c in enumerate(curves):
            arr[i, :len(c)] = [nan(v) for v in c]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a gap no layer had at risk
            mean = np.nanmean(arr, axis=0)
        ax.plot(gaps, mean, "o-", color=colors[cls], lw=2, label=f"{label}, mean over layers")
    ax.axhline(0.2, color="k", ls="--", lw=1, label="KAIROX: cold < 0.2 after gap > 2")
    ax.axvline(2.5, color="gray", ls=":", lw=1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("gap g since the neuron last fired (tokens)")
    ax.set_ylabel("P(fires at t | last fired at t − g)")
    ax.set_title(f"{stats.model}: re-activation probability vs gap (faint: single layers)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, "stats-reactivation.png")

    # (3) perplexity
    curve = stats.extra.get("ppl_curve")
    if curve:
        pts = sorted(curve, key=lambda p: nan(p.get("target_sparsity")))
        fig, ax = new((8, 5))
        x = [100 * nan(p.get("target_sparsity")) for p in pts]
        y = [nan(p.get("ppl")) for p in pts]
        ax.plot(x, y, "o-", label="vs target sparsity")
        if any(p.get("measured_sparsity") is not None for p in pts):
            ax.plot([100 * nan(p.get("measured_sparsity")) for p in pts], y, "s--", alpha=0.7,
                    label="vs measured sparsity")
        if stats.extra.get("dense_ppl") is not None:
            ax.axhline(float(stats.extra["dense_ppl"]), color="k", ls="--",
                       label=f"dense ({float(stats.extra['dense_ppl']):.4g})")
        ax.set_xlabel("FFN sparsity (% of neurons skipped)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title(f"{stats.model}: perplexity vs FFN sparsity")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "stats-perplexity.png")

    # (4) over-fetch
    methods = _methods(stats)
    if methods:
        fig, ax = new((max(8, 0.5 * len(layers) * len(methods) / 2 + 3), 5))
        width = 0.8 / len(methods)
        for i, meth in enumerate(methods):
            vals = [nan((s.overfetch or {}).get(meth)) for s in stats.layers]
            ax.bar([j + (i - (len(methods) - 1) / 2) * width for j in range(len(layers))], vals,
                   width=width, label=meth)
        ax.axhline(1.0, color="k", ls="--", lw=1, label="no over-fetch")
        ax.set_xticks(range(len(layers)), [str(x) for x in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("over-fetch (neurons loaded ÷ neurons active)")
        ax.set_title(f"{stats.model}: over-fetch per layer by grouping method")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        save(fig, "stats-overfetch.png")
    return written
