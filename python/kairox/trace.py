"""Scheduler traces: when the CPU and the GPU worked, layer by layer.

Run anything kairox runs with the scheduler trace on (`--kx-sched-trace FILE` in the tools,
`sched_trace=FILE` in kairox.Llama, `bench/tpot.py --sched-trace FILE`):
every split the scheduler computes is written as one JSON line with its backend, its
first and last node names (which carry the layer number, "ffn_out-12") and its interval
in µs on one monotonic clock. GPU intervals are stamped by the GPU's stream itself when it
reaches the split's start and end, so they show when the device worked, not when the host
queued the work (ggml_ext/include/kx-trace.h).

`kairox trace FILE` reads such a file and says how much of each hybrid layer's CPU work
ran while the GPU worked on the same layer: for every CPU split followed by a GPU split
whose leading nodes were queued before it ("head", the scheduler's overlap, patch 0010),
the two intervals and their intersection. A run with the live balancer also records when
its reload engine moved each batch of neuron rows into the slots ("reload" records, part
r); the summary then compares the hand-offs, hand-backs and splits that ran beside a
reload with the same ones that did not (what a reload costs the critical path). `--png`
draws one token's timeline. A trace may be gzip-compressed (the results keep theirs as
.jsonl.gz): open_text reads either.
"""
from __future__ import annotations

import gzip
import json
import re
import statistics
import zlib
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

_LAYER_RE = re.compile(r"-(\d+)(?:\D.*)?$")


@dataclass(frozen=True)
class TraceRec:
    graph: int
    split: int
    part: str          # w whole split, h head queued early, t tail, i input copies (host time),
                       # r a batch of slot reloads (backend "reload", n_nodes its copies)
    backend: str
    n_nodes: int
    first: str
    last: str
    t0: int            # µs
    t1: int
    bytes: int = 0     # reloads: the bytes the batch moved

    @property
    def cpu(self) -> bool:
        return self.backend.upper().startswith("CPU")

    @property
    def layer(self) -> int | None:
        for name in (self.first, self.last):
            m = _LAYER_RE.search(name)
            if m:
                return int(m.group(1))
        return None

    @property
    def us(self) -> int:
        return self.t1 - self.t0


class TraceError(ValueError):
    pass


GZIP_MAGIC = b"\x1f\x8b"
# what reading a text file that may be compressed can raise: the file itself (OSError, and
# gzip.BadGzipFile, an OSError), a truncated or corrupt stream (EOFError, zlib.error), bytes
# that are not text
READ_ERRORS = (OSError, EOFError, zlib.error, UnicodeDecodeError)


def is_gzip(path: str | Path) -> bool:
    """Whether the file starts with gzip's magic bytes: by content, not by name, so a renamed
    or suffix-less compressed trace reads too."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def open_text(path: str | Path) -> TextIO:
    """A text file for reading, decompressed on the fly when it is gzip-compressed."""
    if is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_text(path: str | Path) -> str:
    """A whole text file, plain or gzip-compressed (raises one of READ_ERRORS)."""
    with open_text(path) as f:
        return f.read()


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def read_trace(path: str | Path) -> tuple[list[TraceRec], int]:
    """Records (complete ones only: both stamps set) and the number the writer dropped.
    The file may be gzip-compressed (.jsonl.gz)."""
    try:
        lines = read_text(path).splitlines()
    except READ_ERRORS as e:
        raise TraceError(f"cannot read the trace {path}: {_reason(e)}") from None
    recs, dropped = [], 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if "dropped" in d:
                dropped = int(d["dropped"])
                continue
            r = TraceRec(int(d["graph"]), int(d["split"]), str(d["part"]), str(d["backend"]), int(d["n_nodes"]),
                         str(d["first"]), str(d["last"]), int(d["t0"]), int(d["t1"]), int(d.get("bytes", 0)))
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{path}:{i}: not a kairox trace line ({e})") from None
        if r.t0 > 0 and r.t1 >= r.t0:
            recs.append(r)
    return recs, dropped


@dataclass(frozen=True)
class Overlap:
    graph: int
    layer: int | None
    cpu: TraceRec      # the CPU split
    gpu: TraceRec      # the next split's head, queued on the GPU before the CPU split ran

    @property
    def overlap_us(self) -> int:
        return max(0, min(self.cpu.t1, self.gpu.t1) - max(self.cpu.t0, self.gpu.t0))


def overlaps(recs: list[TraceRec]) -> list[Overlap]:
    """Every CPU split paired with the head of the split after it (same graph)."""
    heads = {(r.graph, r.split): r for r in recs if r.part == "h" and not r.cpu}
    out = []
    for r in recs:
        if r.cpu and r.part in "wt":
            h = heads.get((r.graph, r.split + 1))
            if h is not None:
                out.append(Overlap(r.graph, r.layer, r, h))
    return out


def by_graph(recs: list[TraceRec]) -> dict[int, list[TraceRec]]:
    """The scheduler's records (splits and hand-offs) by graph; reload batches are left out:
    they are queued during one graph and may run into the next."""
    g: dict[int, list[TraceRec]] = {}
    for r in recs:
        if r.part != "r":
            g.setdefault(r.graph, []).append(r)
    return g


def _union(spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Disjoint intervals covering the given ones, as sorted starts and ends."""
    starts: list[int] = []
    ends: list[int] = []
    for t0, t1 in sorted(spans):
        if ends and t0 <= ends[-1]:
            ends[-1] = max(ends[-1], t1)
        else:
            starts.append(t0)
            ends.append(t1)
    return starts, ends


def _covered(starts: list[int], ends: list[int], t0: int, t1: int) -> int:
    """µs of [t0, t1] inside the union (starts, ends)."""
    k = max(0, bisect_right(starts, t0) - 1)
    got = 0
    while k < len(starts) and starts[k] < t1:
        got += max(0, min(t1, ends[k]) - max(t0, starts[k]))
        k += 1
    return got


RELOAD_KINDS = ("hand-off", "hand-back", "CPU split", "GPU split")


def _spans(recs: list[TraceRec]) -> list[tuple[str, tuple[int, str], int, int]]:
    """The intervals a reload may stretch, as (kind, key, t0, t1), the key naming the same
    interval in every graph: input copies (host time, which includes waiting for the
    producer), CPU splits, GPU splits, and each hand-back, from a CPU split's end to the start
    of the device split that follows it (its result's copy and the launch: the gap the
    critical path waits through)."""
    out = []
    nxt = {(r.graph, r.split): r for r in recs if r.part in "tw" and not r.cpu}
    for r in recs:
        if r.part == "r":
            continue
        if r.part == "i":
            out.append(("hand-off", (r.split, r.part), r.t0, r.t1))
            continue
        out.append(("CPU split" if r.cpu else "GPU split", (r.split, r.part), r.t0, r.t1))
        tail = nxt.get((r.graph, r.split + 1)) if r.cpu and r.part in "tw" else None
        if tail is not None and tail.t0 >= r.t1:
            out.append(("hand-back", (r.split, "b"), r.t1, tail.t0))
    return out


def beside_reloads(recs: list[TraceRec]) -> dict[str, Any] | None:
    """What the reloads cost the decode: the reload batches (count, MiB, busy µs, GB/s while
    running), and for each kind of interval (_spans) those that overlapped a reload against
    those that did not: count and median µs of each, and the paired delay, the median over the
    beside ones of (its µs - the median µs of the same interval in the graphs where it was not
    beside one). Medians, because a prompt's graphs (batches of many tokens) share the decode
    steps' split numbers at many times their length. None without reload records."""
    rel = [r for r in recs if r.part == "r"]
    if not rel:
        return None
    starts, ends = _union([(r.t0, r.t1) for r in rel])
    busy = sum(e - b for b, e in zip(starts, ends))
    moved = sum(r.bytes for r in rel)
    groups: dict[tuple[str, tuple[int, str]], tuple[list[int], list[int]]] = {}
    for kind, key, t0, t1 in _spans(recs):
        beside, alone = groups.setdefault((kind, key), ([], []))
        (beside if _covered(starts, ends, t0, t1) > 0 else alone).append(t1 - t0)
    out: dict[str, Any] = {"batches": len(rel), "mib": moved / 2**20, "busy_us": busy,
                           "us_per_batch": sum(r.us for r in rel) / len(rel),
                           "gbs": moved / busy / 1e3 if busy else None}
    for kind in RELOAD_KINDS:
        keys = [k for k in groups if k[0] == kind]
        beside = [u for k in keys for u in groups[k][0]]
        alone = [u for k in keys for u in groups[k][1]]
        delays = [u - statistics.median(groups[k][1]) for k in keys if groups[k][1] for u in groups[k][0]]
        out[kind] = {"beside": len(beside), "alone": len(alone),
                     "beside_us": statistics.median(beside) if beside else None,
                     "alone_us": statistics.median(alone) if alone else None,
                     "delay_us": statistics.median(delays) if delays else None, "paired": len(delays)}
    return out


CHAIN_KEYS = ("serial_us", "window_us", "handback_us", "head_us", "period_us")


def chain(recs: list[TraceRec]) -> dict[str, Any] | None:
    """The decode's critical chain, layer by layer: for each CPU split with a GPU head beside
    it, the device split before it (its end is when the list the CPU part reads is ready)
    and the device split after it (it adds the CPU part's output), the medians over those
    layers of: serial_us, the device split before (the sum, attention, predictor and select:
    nothing else runs then but the CPU's warm-up); window_us, from that list on the device to
    the CPU part's end (the read-back and the host part, with the head on the device beside
    it); handback_us, from the CPU part's end to the device starting the split after (the
    copy of its output and the launch); head_us; period_us, window + handback + the split
    after (the next layer's serial part): one layer's step. None without such layers."""
    dev = {(r.graph, r.split): r for r in recs if not r.cpu and r.part in "tw"}
    rows: list[tuple[int, ...]] = []
    for o in overlaps(recs):
        before = dev.get((o.graph, o.cpu.split - 1))
        after = dev.get((o.graph, o.cpu.split + 1))
        if before is None or after is None or after.part != "t":
            continue
        window, handback = o.cpu.t1 - before.t1, after.t0 - o.cpu.t1
        rows.append((before.us, window, handback, o.gpu.us, window + handback + after.us))
    if not rows:
        return None
    return {"layers": len(rows), **{k: statistics.median(v) for k, v in zip(CHAIN_KEYS, zip(*rows))}}


def summarize(recs: list[TraceRec]) -> dict[str, Any]:
    """Figures over the graphs that had overlapped layers (decode steps of hybrid layers).

    hidden: Σ overlap / Σ min(CPU, GPU head) over the pairs, 1.0 when the shorter side of
    every layer ran entirely beside the longer one; concurrency: (CPU busy + GPU busy) /
    wall time of those graphs, above 1.0 only when the two worked at the same time."""
    ov = overlaps(recs)
    graphs = sorted({o.graph for o in ov})
    per = by_graph(recs)
    busy_cpu = busy_gpu = wall = 0
    for g in graphs:
        rs = [r for r in per[g] if r.part != "i"]
        busy_cpu += sum(r.us for r in rs if r.cpu)
        busy_gpu += sum(r.us for r in rs if not r.cpu)
        wall += max(r.t1 for r in rs) - min(r.t0 for r in rs)
    n = len(ov)
    short = sum(min(o.cpu.us, o.gpu.us) for o in ov)
    return {
        "graphs": len(per), "overlapped_graphs": len(graphs), "pairs": n,
        "pairs_per_graph": n / len(graphs) if graphs else 0.0,
        "cpu_us_per_pair": sum(o.cpu.us for o in ov) / n if n else None,
        "gpu_head_us_per_pair": sum(o.gpu.us for o in ov) / n if n else None,
        "overlap_us_per_pair": sum(o.overlap_us for o in ov) / n if n else None,
        "hidden": sum(o.overlap_us for o in ov) / short if short else None,
        "concurrency": (busy_cpu + busy_gpu) / wall if wall else None,
        "graph_ms": wall / len(graphs) / 1e3 if graphs else None,
        "handoff_us_per_pair": (sum(r.us for g in graphs for r in per[g] if r.part == "i") / n) if n else None,
        "reloads": beside_reloads(recs),
        "chain": chain(recs),
    }


def pick_graph(recs: list[TraceRec]) -> int:
    """The overlapped graph of median length (a typical decode step)."""
    per = by_graph(recs)
    graphs = sorted({o.graph for o in overlaps(recs)}) or sorted(per)
    if not graphs:
        raise TraceError("the trace holds no complete records")
    span = sorted((max(r.t1 for r in per[g]) - min(r.t0 for r in per[g]), g) for g in graphs)
    return span[len(span) // 2][1]


def longest_graph(recs: list[TraceRec]) -> int:
    """The graph of the longest span (a prompt's batch, where one was traced)."""
    per = by_graph(recs)
    if not per:
        raise TraceError("the trace holds no complete records")
    return max(per, key=lambda g: max(r.t1 for r in per[g]) - min(r.t0 for r in per[g]))


def breakdown(recs: list[TraceRec], graph: int, top: int = 5) -> dict[str, Any]:
    """Where one graph's time went: its span, CPU and GPU busy time, host time in input
    copies (activations, and the weights of ops offloaded to the GPU from host memory),
    and its longest splits."""
    rs = by_graph(recs).get(graph)
    if not rs:
        raise TraceError(f"the trace has no graph {graph}")
    work = [r for r in rs if r.part != "i"]
    longest = sorted(rs, key=lambda r: -r.us)[:top]
    return {
        "graph": graph, "span_ms": (max(r.t1 for r in rs) - min(r.t0 for r in rs)) / 1e3,
        "splits": len({r.split for r in rs}),
        "cpu_ms": sum(r.us for r in work if r.cpu) / 1e3,
        "gpu_ms": sum(r.us for r in work if not r.cpu) / 1e3,
        "input_copy_ms": sum(r.us for r in rs if r.part == "i") / 1e3,
        "longest": [{"split": r.split, "part": r.part, "backend": r.backend, "first": r.first, "last": r.last,
                     "n_nodes": r.n_nodes, "ms": r.us / 1e3} for r in longest],
    }


def breakdown_text(b: dict[str, Any]) -> str:
    lines = [f"graph {b['graph']}: {b['span_ms']:.2f} ms, {b['splits']} splits; CPU busy {b['cpu_ms']:.2f} ms, "
             f"GPU busy {b['gpu_ms']:.2f} ms, input copies (host) {b['input_copy_ms']:.2f} ms; longest:"]
    for x in b["longest"]:
        lines.append(f"  split {x['split']} {x['part']} {x['backend']}: {x['ms']:.2f} ms, "
                     f"{x['n_nodes']} nodes {x['first']} .. {x['last']}")
    return "\n".join(lines)


def plot_graph(recs: list[TraceRec], graph: int, path: str | Path, title: str = "") -> None:
    """One graph's timeline: GPU, CPU and hand-off lanes, layer numbers on the CPU bars."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(f"plotting needs matplotlib ({e}); install it with `pip install matplotlib`") from None
    rs = by_graph(recs).get(graph)
    if not rs:
        raise TraceError(f"graph {graph} is not in the trace")
    t_start, t_end = min(r.t0 for r in rs), max(r.t1 for r in rs)
    # the reload batches that ran during the graph, whichever graph queued them
    rs = rs + [r for r in recs if r.part == "r" and r.t1 > t_start and r.t0 < t_end]
    lanes = {"reload": 3, "GPU": 2, "CPU": 1, "hand-off": 0}
    colors = {"h": "tab:green", "t": "tab:blue", "w": "tab:blue", "i": "tab:gray", "r": "tab:red"}
    fig = Figure(figsize=(14, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in rs:
        lane = "hand-off" if r.part == "i" else "reload" if r.part == "r" else ("CPU" if r.cpu else "GPU")
        color = "tab:orange" if lane == "CPU" else colors[r.part]
        x0, w = (r.t0 - t_start) / 1e3, max(r.us, 1) / 1e3
        ax.broken_barh([(x0, w)], (lanes[lane] - 0.38, 0.76), facecolors=color, edgecolors="none")
        if lane == "CPU" and r.layer is not None:
            ax.text(x0 + w / 2, lanes[lane], str(r.layer), ha="center", va="center", fontsize=6)
    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_xlabel("ms since the step's first split")
    ax.set_title(title or f"graph {graph}: GPU (green: head queued beside the CPU split, blue: rest), "
                          f"CPU (orange, layer numbers), input hand-offs (gray, host time), slot reloads (red)",
                 fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path), dpi=130)


def trim(src: str | Path, dst: str | Path, graphs: list[int]) -> int:
    """Copy the records of some graphs to a smaller trace file (src plain or gzip-compressed,
    dst plain); returns lines written."""
    keep = set(graphs)
    n = 0
    with open_text(src) as f, open(dst, "w") as out:
        for line in f:
            d = json.loads(line)
            if d.get("graph") in keep:
                out.write(line)
                n += 1
    return n


def summary_text(s: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)
    text = (f"{s['graphs']} graphs, {s['overlapped_graphs']} with overlapped layers "
            f"({f(s['pairs_per_graph'])} CPU splits beside a GPU head per graph)\n"
            f"per pair: CPU {f(s['cpu_us_per_pair'])} µs, GPU head {f(s['gpu_head_us_per_pair'])} µs, "
            f"both at once {f(s['overlap_us_per_pair'])} µs, hand-offs {f(s['handoff_us_per_pair'])} µs\n"
            f"hidden: {f(s['hidden'], '.2f')} of the shorter side ran beside the longer; "
            f"concurrency {f(s['concurrency'], '.2f')} (CPU+GPU busy / wall); step {f(s['graph_ms'], '.2f')} ms")
    ch = s.get("chain")
    if ch:
        text += (f"\nchain per layer (medians of {ch['layers']}): device serial part {f(ch['serial_us'])} µs, "
                 f"then list ready -> CPU part done {f(ch['window_us'])} µs (GPU head {f(ch['head_us'])} µs "
                 f"beside it), hand-back {f(ch['handback_us'])} µs; step {f(ch['period_us'])} µs")
    rl = s.get("reloads")
    if rl:
        text += (f"\nreloads: {rl['batches']} batches, {rl['mib']:.1f} MiB, {f(rl['us_per_batch'])} µs each, "
                 f"{f(rl['gbs'])} GB/s while running")
        for kind in RELOAD_KINDS:
            k = rl[kind]
            text += (f"\n  {kind}s beside a reload: {k['beside']}, median {f(k['beside_us'])} µs; not beside "
                     f"one: {k['alone']}, {f(k['alone_us'])} µs; delay, paired by split: {f(k['delay_us'])} µs")
    return text
