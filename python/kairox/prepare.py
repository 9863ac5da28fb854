"""`kairox prepare MODEL.gguf`: from a model to its sparse pack, measured on real text.

Stages, each cached under one work folder so an interrupted run continues where it stopped
(a stage's result is written atomically; the profile is checkpointed after every segment):

1. corpus     calibration text (the bundled public-domain corpus or the user's files), split
              per document into a training part and a held-out tail, tokenized, cut into
              segments of n_ctx tokens (each one prompt with an empty KV cache).
2. thresholds gated SiLU/GELU models only: a first profiling pass over part of the training
              text histograms |act(gate)| per layer; the thresholds are the largest whose
              perplexity on held-out text rises by at most `ppl_budget` over dense
              (kairox.threshold_search: per layer the same share of the activation mass
              left out, measured in process by kairox.quality), or, given
              `target_sparsity`, that quantile in every layer (CATS). ReLU models use
              threshold 0 (active = nonzero).
3. profile    every segment, in native code (kairox.profile): per token and layer the
              active mask (bit-packed, all tokens) and the FFN input (float16, up to
              `max_fit_tokens` training tokens plus the held-out ones), streamed to disk;
              per-neuron counts, histograms and adjacent-layer cosines as aggregates.
4. fit        per layer two recall-first predictors (kairox.fit): *same-layer* (layer l's
              FFN input -> layer l's active set; what the CPU runtime evaluates) and
              *ahead* (layer l-1's FFN input -> layer l's set, layer 0 from the previous
              token's last layer; what a prefetching runtime needs), each scored on the
              held-out tokens.
5. grouping   per layer METIS groups of G co-activated neurons (kairox.grouping) from the
              training masks, and the over-fetch of METIS / frequency / random groupings on
              the held-out masks.
6. stats      the papers' locality measures (kairox.stats) on all profiled tokens.
7. pack       the sidecar pack (version 2): rows in group order, frequencies, thresholds,
              both predictors, the statistics as kx.stats.
8. perplexity optional (`ppl_targets`): llama-perplexity on the held-out text, dense vs threshold
              at each target sparsity vs predicted.

Memory stays bounded by one layer's training rows (N x n_embd floats + N x n_ff bits).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .pack import (BaseModel, PackError, PackLayout, PackPredictor, default_down_type, default_pred_type, fingerprint,
                   inspect_model, pack_path_for)
from .threshold_search import DEFAULT_BUDGET

PROFILE_FORMAT = 1  # bump when the cache layout changes: old work folders are then ignored


class PrepareError(RuntimeError):
    """kairox prepare cannot go on; the message says why and what to do."""


@dataclass
class PrepareConfig:
    """Parameters of `kairox prepare`; defaults work for any supported model."""
    calib: list[Path] = field(default_factory=list)  # text files; empty: the bundled corpus
    target_sparsity: float | None = None  # gated models: the same sparsity in every layer. ReLU: ignored
    ppl_budget: float = DEFAULT_BUDGET    # gated models without target_sparsity: perplexity rise allowed
    budget_tokens: int = 4096        # held-out tokens each step of the budget search measures
    group_size: int = 32
    rank: int | None = None          # predictor rank; None: from the parameter budget
    budget: float = 0.06             # both predictors together, fraction of model parameters
    max_tokens: int = 32768          # tokens profiled in all (training + held-out)
    max_fit_tokens: int = 16384      # training tokens whose FFN inputs are kept for fitting
    heldout: float = 0.15            # tail of each document kept for evaluation
    n_ctx: int = 512                 # tokens per segment (one prompt)
    hist_tokens: int = 8192          # training tokens of the threshold pass
    target_recall: float = 0.99
    threads: int | None = None
    seed: int = 0
    down_type: str | None = None     # None: pack.default_down_type
    pred_type: str | None = None     # None: pack.default_pred_type
    ppl_targets: tuple[float, ...] = ()
    ppl_chunks: int = 8
    work_dir: Path | None = None     # None: $KAIROX_CACHE/prepare/<model>-<fingerprint>
    out: Path | None = None          # None: MODEL.kxpack.gguf
    quiet: bool = False


MIN_SEGMENT = 64      # a document tail shorter than this is not worth a segment


# ------------------------------------------------------------------------------ corpus


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def default_corpus() -> list[Document]:
    """The bundled calibration corpus: public-domain prose (python/kairox/data/calib/SOURCES.md)."""
    root = resources.files("kairox") / "data" / "calib"
    docs = [Document(p.name, p.read_text(encoding="utf-8"))
            for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".txt")]
    if not docs:
        raise PrepareError(f"the bundled calibration corpus is missing from {root}; reinstall kairox")
    return docs


def read_corpus(paths: list[Path]) -> list[Document]:
    """The user's calibration files, one document each; PrepareError for unusable input."""
    docs = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise PrepareError(f"calibration file not found: {p}")
        data = p.read_bytes()
        if b"\0" in data[:1 << 20]:
            raise PrepareError(f"calibration file {p} is binary (it holds NUL bytes); give plain UTF-8 text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PrepareError(f"calibration file {p} is not UTF-8 text (invalid byte at offset "
                               f"{e.start}); convert it to UTF-8") from None
        if not text.strip():
            raise PrepareError(f"calibration file {p} is empty")
        docs.append(Document(p.name, text))
    return docs


def split_document(text: str, heldout: float) -> tuple[str, str]:
    """(training head, held-out tail) at the paragraph break nearest the split point."""
    cut = int(len(text) * (1.0 - heldout))
    para = text.rfind("\n\n", 0, cut)
    if para > len(text) * (1.0 - 2 * heldout):
        cut = para
    return text[:cut], text[cut:]


@dataclass
class Segments:
    """Token segments in profiling order (training and held-out interleaved across
    documents, so a capped run still sees every document)."""
    tokens: np.ndarray   # int32, all segments concatenated
    start: np.ndarray    # int64 [n_seg]
    length: np.ndarray   # int64 [n_seg]
    doc: np.ndarray      # int32 [n_seg]: document index
    heldout: np.ndarray  # bool [n_seg]

    def seg(self, k: int) -> np.ndarray:
        return self.tokens[self.start[k]:self.start[k] + self.length[k]]

    def save(self, path: Path) -> None:
        _atomic_npz(path, **dataclasses.asdict(self))

    @classmethod
    def load(cls, path: Path) -> "Segments":
        with np.load(path) as z:
            return cls(**{f.name: z[f.name] for f in dataclasses.fields(cls)})


def make_segments(docs: list[Document], tokenize: Callable[[str], np.ndarray], bos: int | None,
                  cfg: PrepareConfig) -> Segments:
    body = cfg.n_ctx - (bos is not None)
    per_doc: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    for d in docs:
        parts = []
        for part in split_document(d.text, cfg.heldout):
            toks = tokenize(part) if part.strip() else np.zeros(0, np.int32)
            chunks = [toks[i:i + body] for i in range(0, len(toks), body)]
            chunks = [c for c in chunks if len(c) >= MIN_SEGMENT]
            parts.append([np.concatenate([[bos], c]).astype(np.int32) if bos is not None else c
                          for c in chunks])
        per_doc.append((parts[0], parts[1]))
    train_budget = int(cfg.max_tokens * (1.0 - cfg.heldout))
    chosen: list[tuple[np.ndarray, int, bool]] = []
    for held, budget in ((False, train_budget), (True, cfg.max_tokens - train_budget)):
        used, depth = 0, 0
        while used < budget:
            added = False
            for di, (tr, ho) in enumerate(per_doc):  # round robin over documents
                lst = ho if held else tr
                if depth < len(lst) and used < budget:
                    chosen.append((lst[depth], di, held))
                    used += len(lst[depth])
                    added = True
            if not added:
                break
            depth += 1
    n_train = sum(1 for c in chosen if not c[2])
    n_held = len(chosen) - n_train
    if n_train < 2 or n_held < 1:
        raise PrepareError(
            f"the calibration text gives {n_train} training and {n_held} held-out segments of up "
            f"to {cfg.n_ctx} tokens; at least 2 and 1 are needed: give more text (--calib) or a "
            f"smaller --ctx")
    lengths = np.array([len(c[0]) for c in chosen], np.int64)
    return Segments(np.concatenate([c[0] for c in chosen]).astype(np.int32),
                    np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths,
                    np.array([c[1] for c in chosen], np.int32), np.array([c[2] for c in chosen], bool))


# ---------------------------------------------------------------------------- caching


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_npz(path: Path, **arrays: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _atomic_json(path: Path, obj: Any) -> None:
    _atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def default_work_dir(model: Path, fp: str) -> Path:
    from .default_model import cache_root
    return cache_root() / "prepare" / f"{model.stem}-{fp.removeprefix('kxfp1-')}"


# ------------------------------------------------------------------------- profiling


class _RowFile:
    """An append-only file of fixed-size rows, truncated back to the last checkpoint on resume."""

    def __init__(self, path: Path, row_bytes: int, rows: int) -> None:
        self.path, self.row_bytes = path, row_bytes
        with open(path, "ab") as f:
            f.truncate(rows * row_bytes)
        self.f = open(path, "ab")

    def append(self, a: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(a).tobytes())

    def close(self) -> None:
        self.f.close()

    @staticmethod
    def read(path: Path, dtype: Any, width: int, rows: np.ndarray | slice | None = None) -> np.ndarray:
        m = np.memmap(path, dtype=dtype, mode="r").reshape(-1, width)
        return np.array(m if rows is None else m[rows])


def _profile_pass(prof: Any, segs: Segments, order: list[int], folder: Path, thresholds: np.ndarray,
                  keep_x: np.ndarray | None, desc: str, cfg: PrepareConfig,
                  on_segment: Callable[[int], None] | None) -> Any:
    """Profile segments `order` into `folder`, resuming from its checkpoint; returns the
    aggregates. keep_x[k]: keep segment k's FFN inputs (None: keep no rows at all)."""
    from tqdm import tqdm

    from .profile import Aggregates

    b: BaseModel = prof.base
    folder.mkdir(parents=True, exist_ok=True)
    # The checkpoint is one file: the aggregates and how far they reach (segments done, rows in
    # the row files). Why one: with the progress in a file of its own, a kill between the two
    # writes left aggregates one segment ahead of the progress, and the resumed run counted that
    # segment twice (a pack unlike the uninterrupted run's, about once in 30 random kills).
    ckpt = folder / "agg.npz"
    state = {"done": 0, "mask_rows": 0, "x_rows": 0}
    agg = Aggregates.zeros(b.n_layer, b.n_ff, prof.bins)
    z = np.load(ckpt) if ckpt.exists() else None
    if z is not None and "progress" in z.files:  # (a checkpoint without it: an older form, redone)
        state = dict(zip(state, (int(v) for v in z["progress"])))
        agg = Aggregates.from_npz(z)
    prof.set_thresholds(thresholds)
    files = []
    if keep_x is not None:
        files = [(_RowFile(folder / f"mask_{il}.u8", prof.mask_bytes, state["mask_rows"]),
                  _RowFile(folder / f"x_{il}.f16", 2 * b.n_embd, state["x_rows"])) for il in range(b.n_layer)]
    n_tok = int(sum(segs.length[k] for k in order))
    done_tok = int(sum(segs.length[k] for k in order[:state["done"]]))
    bar = tqdm(total=n_tok, initial=done_tok, desc=desc, unit="tok", disable=cfg.quiet,
               file=sys.stderr, smoothing=0.1)
    try:
        prof.pull()  # drop anything a failed earlier run left in the collector
        for i in range(state["done"], len(order)):
            k = order[i]
            rows = prof.run(segs.seg(k))
            if keep_x is not None:
                for il, (mf, xf) in enumerate(files):
                    mf.append(rows[il].mask)
                    if keep_x[k]:
                        xf.append(rows[il].x.astype(np.float16))
                for mf, xf in files:
                    mf.f.flush()
                    xf.f.flush()
                state["mask_rows"] += int(segs.length[k])
                state["x_rows"] += int(segs.length[k]) if keep_x[k] else 0
            agg += prof.pull()
            state["done"] = i + 1
            _atomic_npz(ckpt, **agg.to_npz(), progress=np.array(list(state.values()), np.int64))
            bar.update(int(segs.length[k]))
            if on_segment is not None:
                on_segment(i + 1)
    finally:
        bar.close()
        for mf, xf in files:
            mf.close()
            xf.close()
    return agg


# ------------------------------------------------------------------------------ stages


@dataclass
class PrepareResult:
    pack: Path
    work_dir: Path
    stats: Any                     # kairox.stats.ModelStats
    seconds: dict[str, float]      # this run, per stage
    spent: dict[str, float]        # all runs in this work folder, per stage


def _model_params(hdr: Any) -> int:
    return int(sum(math.prod(t.ne) for t in hdr.tensors))


def prepare(model_path: str | Path, cfg: PrepareConfig | None = None, *,
            on_segment: Callable[[int], None] | None = None) -> PrepareResult:
    """Run every stage for the model; returns where the pack went and what was measured.

    on_segment(n) is called after each profiled segment (tests use it to interrupt a run)."""
    from .profile import Profiler, threshold_for_sparsity

    cfg = cfg or PrepareConfig()
    _check_config(cfg)
    model = Path(model_path)
    try:
        hdr, base = inspect_model(model)
        fp = fingerprint(model)
    except PackError as e:
        raise PrepareError(str(e)) from None
    gated = base.activation != "relu"
    target = cfg.target_sparsity if gated else None
    docs = read_corpus(cfg.calib) if cfg.calib else default_corpus()
    corpus_key = _key(PROFILE_FORMAT, [(d.name, hashlib.sha256(d.text.encode()).hexdigest()) for d in docs],
                      cfg.n_ctx, cfg.max_tokens, cfg.heldout)
    root = cfg.work_dir or default_work_dir(model, fp)
    work = root / f"corpus-{corpus_key}"
    work.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print("kairox prepare:", *a, file=sys.stderr))
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()

    # batches of at most 256 tokens: llama.cpp keeps an n_batch x vocabulary logits buffer
    with Profiler(model, n_ctx=cfg.n_ctx, n_batch=min(cfg.n_ctx, 256), threads=cfg.threads) as prof:
        # 1. corpus
        t0 = time.perf_counter()
        seg_path = work / "segments.npz"
        if seg_path.exists():
            segs = Segments.load(seg_path)
        else:
            segs = make_segments(docs, prof.tokenize, prof.bos(), cfg)
            segs.save(seg_path)
            heldout_text = "\n\n".join(split_document(d.text, cfg.heldout)[1] for d in docs)
            _atomic_write(work / "heldout.txt", heldout_text.encode())
        train = [k for k in range(len(segs.length)) if not segs.heldout[k]]
        held = [k for k in range(len(segs.length)) if segs.heldout[k]]
        say(f"{len(docs)} documents -> {len(train)} training + {len(held)} held-out segments, "
            f"{int(segs.length.sum())} tokens; work folder {work}")
        seconds["corpus"] = time.perf_counter() - t0

        # 2. thresholds
        t0 = time.perf_counter()
        hist, chosen = None, None
        if gated:
            hist_order, n = [], 0
            for k in train:
                if n >= cfg.hist_tokens:
                    break
                hist_order.append(k)
                n += int(segs.length[k])
            agg = _profile_pass(prof, segs, hist_order, work / "hist", np.zeros(base.n_layer, np.float32),
                                None, "thresholds", cfg, on_segment)
            hist = agg.hist
            if target is not None:
                thr = np.array([threshold_for_sparsity(hist[il], target)[0] for il in range(base.n_layer)],
                               np.float32)
            else:
                chosen = _budget_thresholds(model, segs, held, hist, work, cfg, say)
                thr = np.asarray(chosen["thresholds"], np.float32)
        else:
            thr = np.zeros(base.n_layer, np.float32)
        seconds["thresholds"] = time.perf_counter() - t0

        # 3. profile
        t0 = time.perf_counter()
        order = train + held
        keep_x = np.zeros(len(segs.length), bool)
        n = 0
        for k in train:
            if n < cfg.max_fit_tokens:
                keep_x[k] = True
                n += int(segs.length[k])
        keep_x[held] = True
        pdir = work / f"profile-{_key(thr.tolist(), cfg.max_fit_tokens)}"
        agg = _profile_pass(prof, segs, order, pdir, thr, keep_x, "profile", cfg, on_segment)
        seconds["profile"] = time.perf_counter() - t0
        if agg.skipped:
            raise PrepareError(f"the profiler could not read {agg.skipped} activation tensors of "
                               f"{model.name}; its graph is not laid out as kairox expects")

    data = _ProfileData(pdir, base, segs, order, keep_x)
    n_tokens = int(segs.length.sum())
    stats_extra: dict[str, Any] = {"target_sparsity": target, "calibration": [d.name for d in docs],
                                   **({"ppl_budget": chosen} if chosen else {}),
                                   "tokens": {"train": int(segs.length[train].sum()),
                                              "heldout": int(segs.length[held].sum())}}

    # 4. fit
    t0 = time.perf_counter()
    fits, rank = _fit_stage(work / f"fit-{pdir.name}", data, hdr, cfg, say)
    seconds["fit"] = time.perf_counter() - t0

    # 5. grouping
    t0 = time.perf_counter()
    groups = _group_stage(work / f"group-{pdir.name}-{cfg.group_size}-{cfg.seed}", data, cfg)
    seconds["grouping"] = time.perf_counter() - t0

    # 6. stats
    t0 = time.perf_counter()
    from .stats import ModelStats, compute_layer_stats
    from tqdm import tqdm
    layers = []
    cos = np.divide(agg.cos_sum, np.maximum(agg.cos_n, 1))
    for il in tqdm(range(base.n_layer), desc="statistics", unit="layer", disable=cfg.quiet, file=sys.stderr):
        masks = data.masks(il, None)
        layers.append(compute_layer_stats(
            masks, data.token_segment, 128, layer=il, counts=agg.counts[il], seed=cfg.seed,
            hidden_cosine=float(cos[il]) if agg.cos_n[il] else None,
            recall=fits[il]["same"]["recall"], precision=fits[il]["same"]["precision"],
            overfetch={m: v["ratio"] for m, v in groups[il]["overfetch"].items()},
            threshold=float(thr[il])))
    stats_extra["ahead"] = [{"recall": f["ahead"]["recall"], "precision": f["ahead"]["precision"],
                             "proxy_recall": f["proxy"]["recall"], "proxy_precision": f["proxy"]["precision"]}
                            for f in fits]
    stats_extra["predictor_rank"] = rank
    stats = ModelStats(model.name, base.n_layer, base.n_ff, n_tokens, layers, stats_extra)
    seconds["stats"] = time.perf_counter() - t0

    # whether predicted mode gains, layer by layer (the runtime reads the same densities)
    listed = listed_density(fits)
    stats.extra["listed_density"] = listed
    stats.extra["sparse_layers"], stats.extra["gain"] = gain_report(listed)
    say(stats.extra["gain"])

    # 7. pack, with the load-aware thresholds' calibration on held-out tokens
    t0 = time.perf_counter()
    tables = _threshold_tables(model, data, fits, cfg)
    out = _write(model, hdr, cfg, thr, agg.counts / n_tokens, fits, groups, rank, stats, target, tables)
    seconds["pack"] = time.perf_counter() - t0
    # ... and as the runtime will decide it on this machine: each layer timed both ways
    say(_measured_gain(model, out, listed, cfg.threads, stats))

    # 8. perplexity
    if cfg.ppl_targets:
        t0 = time.perf_counter()
        stats.extra.update(_ppl_stage(model, out, work, hist, thr, base, cfg, gated, say))
        seconds["perplexity"] = time.perf_counter() - t0
        out = _write(model, hdr, cfg, thr, agg.counts / n_tokens, fits, groups, rank, stats, target, tables)
    seconds["total"] = time.perf_counter() - t_all
    # compute time per stage summed over every run in this work folder: a resumed or
    # cached run still reports what the stages cost (bench/prepare_report.py)
    tpath = work / "times.json"
    spent = json.loads(tpath.read_text()) if tpath.exists() else {}
    for k, v in seconds.items():
        spent[k] = spent.get(k, 0.0) + v
    _atomic_json(tpath, spent)
    return PrepareResult(out, work, stats, seconds, spent)


def _check_config(cfg: PrepareConfig) -> None:
    def bad(msg: str) -> None:
        raise PrepareError(msg)
    if cfg.target_sparsity is not None and not 0.0 <= cfg.target_sparsity < 1.0:
        bad(f"target sparsity must be in [0, 1), got {cfg.target_sparsity}")
    if not 0.0 < cfg.heldout < 0.5:
        bad(f"held-out fraction must be in (0, 0.5), got {cfg.heldout}")
    if cfg.n_ctx < 2 * MIN_SEGMENT:
        bad(f"--ctx must be at least {2 * MIN_SEGMENT} tokens, got {cfg.n_ctx}")
    if not 0.5 <= cfg.target_recall < 1.0:
        bad(f"target recall must be in [0.5, 1), got {cfg.target_recall}")
    if not 0.0 < cfg.budget <= 0.5:
        bad(f"predictor budget must be in (0, 0.5], got {cfg.budget}")
    for t in cfg.ppl_targets:
        if not 0.0 <= t < 1.0:
            bad(f"perplexity targets must be in [0, 1), got {t}")
    if not 0.0 < cfg.ppl_budget < 1.0:
        bad(f"the perplexity budget must be in (0, 1), got {cfg.ppl_budget}")
    for name in ("group_size", "max_tokens", "max_fit_tokens", "hist_tokens", "ppl_chunks", "budget_tokens"):
        if getattr(cfg, name) < 1:
            bad(f"{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")


class _ProfileData:
    """Reads one layer at a time from the profile folder."""

    def __init__(self, folder: Path, base: BaseModel, segs: Segments, order: list[int],
                 keep_x: np.ndarray) -> None:
        self.folder, self.base = folder, base
        seg_of_row = np.concatenate([np.full(segs.length[k], k, np.int32) for k in order])
        self.token_segment = seg_of_row                    # the prompt each token belongs to
        held_row = segs.heldout[seg_of_row]
        x_row = keep_x[seg_of_row]                        # rows whose FFN input was kept
        self.x_index = np.cumsum(x_row) - 1               # mask row -> x row (where kept)
        self.train_rows = np.flatnonzero(x_row & ~held_row)
        self.held_rows = np.flatnonzero(held_row)
        # ahead predictor of layer 0: the previous token's last layer (same segment)
        self.has_prev = np.concatenate([[False], seg_of_row[1:] == seg_of_row[:-1]])

    def masks(self, il: int, rows: np.ndarray | None) -> np.ndarray:
        from .profile import unpack_masks
        packed = _RowFile.read(self.folder / f"mask_{il}.u8", np.uint8, (self.base.n_ff + 7) // 8, rows)
        return unpack_masks(packed, self.base.n_ff)

    def x(self, il: int, rows: np.ndarray) -> np.ndarray:
        return _RowFile.read(self.folder / f"x_{il}.f16", np.float16, self.base.n_embd,
                             self.x_index[rows]).astype(np.float32)

    def fit_pairs(self, il: int, rows: np.ndarray, ahead: bool) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, masks) for layer il's predictor on mask rows `rows`."""
        if not ahead:
            return self.x(il, rows), self.masks(il, rows)
        if il > 0:
            return self.x(il - 1, rows), self.masks(il, rows)
        rows = rows[self.has_prev[rows]]
        return self.x(self.base.n_layer - 1, rows - 1), self.masks(0, rows)


def _proxy_quality(arrays: dict[str, np.ndarray], x_prev: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Without an ahead predictor a runtime lists layer l's set one layer early with the layer's
    own predictor fed layer l-1's input: the baseline the ahead predictor must beat."""
    from .fit import evaluate_predictor
    q = evaluate_predictor(arrays["same_a"], arrays["same_b"], arrays["same_c"], x_prev, y)
    return {"recall": q.recall, "precision": q.precision}


def _fit_stage(folder: Path, data: _ProfileData, hdr: Any, cfg: PrepareConfig,
               say: Callable) -> tuple[list[dict], int]:
    from tqdm import tqdm

    from .fit import FitConfig, evaluate_predictor, fit_predictor, rank_for_budget

    b = data.base
    if cfg.rank is not None:
        rank = cfg.rank
        if not 1 <= rank <= min(b.n_embd, b.n_ff):
            raise PrepareError(f"--rank must be in 1..{min(b.n_embd, b.n_ff)}, got {rank}")
    else:
        # two predictors share the budget; a rank past n_embd/8 buys little recall (measured
        # on Gemma 3 270M) and costs time per token
        rank = min(rank_for_budget(b.n_embd, b.n_ff, b.n_layer, _model_params(hdr), cfg.budget / 2),
                   max(8, b.n_embd // 8))
    folder.mkdir(parents=True, exist_ok=True)
    fits = []
    for il in tqdm(range(b.n_layer), desc="predictors", unit="layer", disable=cfg.quiet, file=sys.stderr):
        path = folder / f"layer_{il}.npz"
        if not path.exists():
            arrays, quality = {}, {}
            for kind in ("same", "ahead"):
                x, y = data.fit_pairs(il, data.train_rows, kind == "ahead")
                fc = FitConfig(rank=rank, target_recall=cfg.target_recall, seed=cfg.seed + il)
                r = fit_predictor(x, y, fc)
                xh, yh = data.fit_pairs(il, data.held_rows, kind == "ahead")
                q = evaluate_predictor(r.a, r.b, r.c, xh, yh)
                arrays.update({f"{kind}_a": r.a, f"{kind}_b": r.b, f"{kind}_c": r.c})
                quality[kind] = {"recall": q.recall, "precision": q.precision,
                                 "overprediction": q.overprediction, "density": q.true_density}
            quality["proxy"] = _proxy_quality(arrays, xh, yh)  # (xh, yh: the ahead pairs)
            _atomic_npz(path, quality=np.array(json.dumps(quality)), **arrays)
        with np.load(path) as z:
            fit = {**json.loads(str(z["quality"])), "arrays": {k: z[k] for k in z.files if k != "quality"}}
        if "proxy" not in fit:  # a work folder fitted before the proxy was measured
            fit["proxy"] = _proxy_quality(fit["arrays"], *data.fit_pairs(il, data.held_rows, True))
        fits.append(fit)
    return fits, rank


def _group_stage(folder: Path, data: _ProfileData, cfg: PrepareConfig) -> list[dict]:
    from tqdm import tqdm

    from .grouping import group_neurons, overfetch

    b = data.base
    folder.mkdir(parents=True, exist_ok=True)
    # the co-activation graph needs a sample, not every token (kairox.grouping)
    rng = np.random.default_rng(cfg.seed)
    sample = data.train_rows
    if len(sample) > 8192:
        sample = np.sort(rng.choice(sample, 8192, replace=False))
    out = []
    for il in tqdm(range(b.n_layer), desc="grouping", unit="layer", disable=cfg.quiet, file=sys.stderr):
        path = folder / f"layer_{il}.npz"
        if not path.exists():
            train, held = data.masks(il, sample), data.masks(il, data.held_rows)
            res = {}
            for method in ("metis", "frequency", "random"):
                g = group_neurons(train, cfg.group_size, method=method, seed=cfg.seed)
                res[method] = (g, overfetch(held, g))
            g = res["metis"][0]
            of = {m: dataclasses.asdict(s) for m, (_, s) in res.items()}
            _atomic_npz(path, perm=g.perm, group=g.group, overfetch=np.array(json.dumps(of)))
        with np.load(path) as z:
            out.append({"perm": z["perm"], "group": z["group"], "overfetch": json.loads(str(z["overfetch"]))})
    return out


def _threshold_tables(model: Path, data: _ProfileData, fits: list[dict], cfg: PrepareConfig) -> Any:
    """The load-aware thresholds' calibration of the fitted predictors (kairox.thresholds), on
    held-out tokens the fit never saw."""
    from .thresholds import CALIBRATION_TOKENS, calibrate

    rows = data.held_rows
    if len(rows) > CALIBRATION_TOKENS:
        rows = np.sort(np.random.default_rng(cfg.seed).choice(rows, CALIBRATION_TOKENS, replace=False))
    xs = [data.x(il, rows) for il in range(data.base.n_layer)]
    return calibrate(model, lambda il: tuple(fits[il]["arrays"][f"same_{k}"] for k in "abc"), xs, quiet=cfg.quiet)


def listed_density(fits: list[dict]) -> list[float]:
    """Per layer, the share of its neurons the same-layer predictor lists on held-out tokens:
    the true density times the over-prediction (listed / truly active)."""
    return [float(min(1.0, f["same"]["density"] * f["same"]["overprediction"])) for f in fits]


def gain_report(listed: list[float], ratio: list[float | None] | None = None,
                threads: int | None = None) -> tuple[int, str]:
    """How many layers predicted mode runs sparse, and a sentence saying so. Without `ratio`:
    a layer whose lists hold LISTED_GAINS_BELOW of its neurons or more runs dense (the select
    falls back to every row there). With `ratio` (kairox.llama.sparse_cost on this CPU with
    `threads`: the sparse FFN's time over the dense one's per layer, None for a layer over
    that line) a layer runs sparse only where it timed 5% faster (TIMED_GAINS_BELOW), as the
    runtime decides at load."""
    from .pack import LISTED_GAINS_BELOW, TIMED_GAINS_BELOW
    lo, hi = min(listed), max(listed)
    head = f"predicted lists hold {100 * lo:.0f}-{100 * hi:.0f}% of a layer's neurons"
    if ratio is None:
        n = sum(v < LISTED_GAINS_BELOW for v in listed)
        if n == 0:
            return 0, (f"{head}: the sparse FFN will not gain on this model (it gains below "
                       f"{100 * LISTED_GAINS_BELOW:.0f}%); --sparse predicted runs it dense")
        return n, f"{head}: {n} of {len(listed)} layers run sparse in predicted mode, the others dense"
    timed = [r for r in ratio if r is not None]
    n = sum(r < TIMED_GAINS_BELOW for r in timed)
    where = f"on this CPU ({threads} threads)" if threads else "on this CPU"
    per_layer = " ".join("dense" if r is None or r >= TIMED_GAINS_BELOW else f"{1 / r:.2f}x" for r in ratio)
    if not timed:
        return 0, (f"{head}: the sparse FFN will not gain on this model (it gains below "
                   f"{100 * LISTED_GAINS_BELOW:.0f}%); --sparse predicted runs it dense")
    timing = (f"{where} the sparse FFN takes {min(timed):.2f}-{max(timed):.2f} of the dense FFN's time "
              f"at those shares")
    if n == 0:
        return 0, f"{head}; {timing}: the sparse FFN will not gain here; --sparse predicted runs it dense"
    return n, (f"{head}; {timing}: {n} of {len(listed)} layers run sparse in predicted mode, the others dense "
               f"(FFN speed-up per layer: {per_layer})")


def _measured_gain(model: Path, pack: Path, listed: list[float], threads: int | None, stats: Any) -> str:
    """gain_report with the sparse FFN timed against the dense one on this CPU (recorded in
    stats.extra["sparse_cost"]); the listed-share report where the timing cannot run."""
    from .llama import sparse_cost
    threads = threads or os.cpu_count() or 1
    try:
        ratio = sparse_cost(model, pack, "predicted", threads)
    except (OSError, ValueError) as e:
        return f"could not time the sparse FFN on this CPU ({e})"
    stats.extra["sparse_cost"] = {"threads": threads, "ratio": ratio}
    stats.extra["sparse_layers"], stats.extra["gain"] = gain_report(listed, ratio, threads)
    return stats.extra["gain"]


def _write(model: Path, hdr: Any, cfg: PrepareConfig, thr: np.ndarray, freq: np.ndarray,
           fits: list[dict], groups: list[dict], rank: int, stats: Any, target: float | None,
           tables: Any = None) -> Path:
    from .pack import write_pack

    out = cfg.out or pack_path_for(model)
    layout = PackLayout(lambda il: (groups[il]["perm"], groups[il]["group"], np.clip(freq[il], 0, 1)), thr)
    dtype = cfg.pred_type or default_pred_type(hdr)

    def trio(kind: str) -> PackPredictor:
        return PackPredictor(rank, lambda il: tuple(fits[il]["arrays"][f"{kind}_{k}"] for k in "abc"),
                             dtype, {"kind": "fit", "input": "same-layer" if kind == "same" else "previous-layer",
                                     "target_recall": cfg.target_recall})
    method = {"kind": "prepare", "grouping": "metis", "target_sparsity": target,
              "ppl_budget": cfg.ppl_budget if target is None and any(thr > 0) else None,
              "tokens": stats.tokens, "seed": cfg.seed}
    try:
        return write_pack(model, out, group_size=cfg.group_size,
                          down_type=cfg.down_type or default_down_type(hdr), method=method,
                          predictor=trio("same"), ahead=trio("ahead"),
                          layout=layout, stats=stats.to_json(), thresholds=tables, quiet=cfg.quiet,
                          listed_density=listed_density(fits))
    except PackError as e:
        raise PrepareError(str(e)) from None


# ----------------------------------------------------------- thresholds by perplexity budget


def _budget_thresholds(model: Path, segs: Segments, held: list[int], hist: np.ndarray, work: Path,
                       cfg: PrepareConfig, say: Callable) -> dict[str, Any]:
    """kairox.threshold_search over the first `budget_tokens` held-out tokens, measured by
    the in-process emulator of kairox.quality; cached in the work folder (keyed by the
    budget and the tokens, the histograms being fixed by the folder's corpus)."""
    from .quality import Emulator
    from .threshold_search import mass_ladder, search

    segments, n = [], 0
    for k in held:
        if n >= cfg.budget_tokens:
            break
        segments.append(segs.seg(k))
        n += len(segments[-1])
    if not segments:
        raise PrepareError("the perplexity budget needs held-out text: give more calibration text")
    cache = work / f"thresholds-{_key(cfg.ppl_budget, n, cfg.hist_tokens)}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    with Emulator(model, n_ctx=cfg.n_ctx, n_batch=min(cfg.n_ctx, 256), threads=cfg.threads) as emu:
        res = search(mass_ladder(hist), lambda thr: emu.cats_perplexity(segments, thr), cfg.ppl_budget,
                     say=say).to_json()
    res["tokens"] = n
    _atomic_json(cache, res)
    return res


# -------------------------------------------------------------------------- perplexity

_PPL_RE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def perplexity(model: Path, text: Path, *, chunks: int, n_ctx: int, threads: int | None,
               sparse: str | None = None, pack: Path | None = None) -> tuple[float, float]:
    """(perplexity, its standard error) from llama-perplexity on `text`.

    One token per micro-batch: a sparse FFN decides per token, and a union over a batch
    would compute neurons a token alone would skip (that would flatter the sparse modes)."""
    from ._native import find_bin_dir
    cmd = [str(find_bin_dir() / "llama-perplexity"), "-m", str(model), "-f", str(text),
           "-c", str(n_ctx), "-b", str(n_ctx), "-ub", "1", "--chunks", str(chunks),
           "-t", str(threads or os.cpu_count() or 1), "--no-repack"]
    if sparse:
        cmd += ["--sparse", sparse, "--sparse-pack", str(pack)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    m = _PPL_RE.search(p.stdout + p.stderr)
    if p.returncode != 0 or not m:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-5:])
        raise PrepareError(f"llama-perplexity failed (exit {p.returncode}): {tail}")
    return float(m.group(1)), float(m.group(2))


def _ppl_stage(model: Path, final: Path, work: Path, hist: np.ndarray | None, thr: np.ndarray,
               base: BaseModel, cfg: PrepareConfig, gated: bool, say: Callable) -> dict[str, Any]:
    from .pack import read_pack, write_pack
    from .profile import threshold_for_sparsity

    text = work / "heldout.txt"
    run = dict(chunks=cfg.ppl_chunks, n_ctx=cfg.n_ctx, threads=cfg.threads)
    cache = work / "ppl.json"
    done = json.loads(cache.read_text()) if cache.exists() else {}

    def measure(key: str, **kw: Any) -> dict[str, float]:
        if key not in done:
            t0 = time.perf_counter()
            ppl, err = perplexity(model, text, **run, **kw)
            done[key] = {"ppl": ppl, "err": err, "seconds": time.perf_counter() - t0}
            _atomic_json(cache, done)
            say(f"perplexity {key}: {ppl:.4f} +/- {err:.4f}")
        return done[key]

    res: dict[str, Any] = {"dense_ppl": measure("dense")["ppl"], "ppl_chunks": cfg.ppl_chunks}
    res["predicted_ppl"] = measure(f"predicted-{_key(thr.tolist())}", sparse="predicted", pack=final)["ppl"]
    curve = []
    targets = sorted(cfg.ppl_targets) if gated else [0.0]
    pack = read_pack(final)
    for t in targets:
        tthr = (np.array([threshold_for_sparsity(hist[il], t)[0] for il in range(base.n_layer)], np.float32)
                if gated else np.zeros(base.n_layer, np.float32))
        key = f"threshold-{_key(tthr.tolist())}"
        if key not in done:  # a pack that differs from the final one in its thresholds only
            tmp = work / "ppl-target.kxpack.gguf"
            layers = pack.layers
            write_pack(model, tmp, group_size=pack.group_size, down_type=layers[0].down_type,
                       layout=PackLayout(lambda il: (layers[il].perm, layers[il].group, layers[il].freq), tthr),
                       quiet=True)
        r = measure(key, sparse="threshold", pack=work / "ppl-target.kxpack.gguf")
        curve.append({"target_sparsity": t, "ppl": r["ppl"], "err": r["err"]})
    res["ppl_curve"] = curve
    return res


__all__ = ["DEFAULT_BUDGET", "Document", "PrepareConfig", "PrepareError", "PrepareResult",
           "default_corpus", "make_segments", "perplexity", "prepare", "read_corpus", "split_document"]
