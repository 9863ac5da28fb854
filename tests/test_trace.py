"""The scheduler trace (kx_params.sched_trace): its analysis on known intervals, and a real run writing it."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kairox import trace as kt
from test_hybrid import synth_model  # noqa: F401  (KB-tiny with a pack: a pytest fixture)


def rec(graph: int, split: int, part: str, backend: str, t0: int, t1: int, first: str = "n", last: str = "n") -> str:
    return json.dumps({"graph": graph, "split": split, "part": part, "backend": backend, "n_nodes": 3,
                       "first": first, "last": last, "t0": t0, "t1": t1})


def known_lines() -> list[str]:
    """One graph of two hybrid layers whose overlaps are known by hand, a split never stamped
    and the writer's count of dropped records."""
    return [
        # graph 0: layer 0's CPU split [100, 200] beside its GPU head [90, 150] -> 50 µs together
        rec(0, 0, "w", "CUDA0", 10, 90, "attn_norm-0"),
        rec(0, 1, "i", "CPU", 90, 100, "x-0"),
        rec(0, 2, "h", "CUDA0", 90, 150, "kx_slots-0"),
        rec(0, 1, "w", "CPU", 100, 200, "kx_host-0", "ffn_cpu-0"),
        rec(0, 2, "t", "CUDA0", 205, 230, "ffn_out-0"),
        # layer 1: the head ends before the CPU starts -> nothing hidden
        rec(0, 4, "h", "CUDA0", 230, 240, "kx_slots-1"),
        rec(0, 3, "w", "CPU", 250, 300, "kx_host-1"),
        rec(0, 5, "w", "CUDA0", 0, 0),  # never stamped: dropped by the reader
        json.dumps({"dropped": 7}),
    ]


def run_child(code: str, native: Path) -> None:
    """Python code in a child process (the trace is written at its exit) that imports the same
    kairox package (source tree or installed) and library as this one."""
    import kairox
    pkg_parent = str(Path(kairox.__file__).resolve().parent.parent)
    env = {**os.environ, "KAIROX_LIB_DIR": str(native),
           "PYTHONPATH": f"{pkg_parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


def test_overlap_of_known_intervals(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(known_lines()) + "\n")
    recs, dropped = kt.read_trace(f)
    assert dropped == 7 and len(recs) == 7
    ov = kt.overlaps(recs)
    assert [(o.layer, o.overlap_us) for o in ov] == [(0, 50), (1, 0)]
    s = kt.summarize(recs)
    assert s["pairs"] == 2 and s["hidden"] == pytest.approx(50 / (60 + 10))
    busy = (80 + 60 + 25 + 10) + (100 + 50)
    assert s["concurrency"] == pytest.approx(busy / (300 - 10))
    # the critical chain: layer 0 only (layer 1 has no device split after it): the device's
    # serial part [10, 90], its list ready at 90 -> CPU part done at 200, the split after
    # starts at 205 and runs 25 µs: one layer's step 110 + 5 + 25
    assert s["chain"] == {"layers": 1, "serial_us": 80, "window_us": 110, "handback_us": 5, "head_us": 60,
                          "period_us": 140}
    assert "step 140.0 µs" in kt.summary_text(s)
    assert kt.chain([r for r in recs if r.split != 2]) is None  # no head, no chain
    assert kt.pick_graph(recs) == 0
    png = tmp_path / "t.png"
    kt.plot_graph(recs, 0, png)
    assert png.stat().st_size > 1000
    # a second, longer graph (a prompt's batch): the breakdown's default
    f2 = tmp_path / "t2.jsonl"
    f2.write_text("\n".join([rec(1, 0, "w", "CUDA0", 1000, 1400, "attn-0"), rec(1, 1, "i", "CUDA0", 1400, 2400, "w-0"),
                             rec(1, 1, "w", "CUDA0", 2400, 2600, "ffn-0"), rec(1, 2, "w", "CPU", 2600, 2700, "out")]))
    recs += kt.read_trace(f2)[0]
    assert kt.longest_graph(recs) == 1
    b = kt.breakdown(recs, 1, top=2)
    assert b["span_ms"] == pytest.approx(1.7) and b["splits"] == 3
    assert (b["cpu_ms"], b["gpu_ms"], b["input_copy_ms"]) == pytest.approx((0.1, 0.6, 1.0))
    assert [(x["split"], x["part"]) for x in b["longest"]] == [(1, "i"), (0, "w")]
    assert "input copies (host) 1.00 ms" in kt.breakdown_text(b)
    with pytest.raises(kt.TraceError, match="no graph 9"):
        kt.breakdown(recs, 9)
    f.write_text("garbage\n")
    with pytest.raises(kt.TraceError, match=":1: not a kairox trace"):
        kt.read_trace(f)


def gzipped(src: Path, dst: Path) -> Path:
    dst.write_bytes(gzip.compress(src.read_bytes()))
    return dst


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The results keep their traces as .jsonl.gz: every reader takes them as they are, told by
    the gzip magic bytes (so a compressed file without the suffix reads too)."""
    from kairox.cli import main
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(known_lines()) + "\n")
    gz = gzipped(plain, tmp_path / "t.jsonl.gz")
    bare = gzipped(plain, tmp_path / "t-compressed")
    want = kt.read_trace(plain)
    assert len(want[0]) == 7 and want[1] == 7  # not two empty reads agreeing
    assert kt.read_trace(gz) == want and kt.read_trace(bare) == want
    # the command line prints and writes the same figures for both
    outs = []
    for f in (plain, gz):
        js = tmp_path / f"{f.name}.json"
        assert main(["trace", str(f), "--breakdown", "--json", str(js)]) == 0
        outs.append((capsys.readouterr().out, json.loads(js.read_text())))
    assert outs[0] == outs[1] and outs[0][1]["pairs"] == 2
    # trim reads a compressed source (bench/offload.py trims the runs' traces)
    assert kt.trim(gz, tmp_path / "g.jsonl", [0]) == kt.trim(plain, tmp_path / "p.jsonl", [0]) == 8
    assert (tmp_path / "g.jsonl").read_text() == (tmp_path / "p.jsonl").read_text()
    # a truncated archive is a reading error, not a crash
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:-12])
    with pytest.raises(kt.TraceError, match="cannot read the trace"):
        kt.read_trace(cut)
    assert main(["trace", str(cut)]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_a_run_writes_its_trace(tmp_path: Path, synth_model: Path, native: Path) -> None:
    """sched_trace= on a hybrid run (slots on the CPU device here): one graph per decode, every
    split stamped; `kairox trace` reads it. (The GPU machine's run has the CPU and GPU
    splits: bench/device/hybrid.sh.)"""
    out = tmp_path / "run.jsonl"
    code = (f"import kairox; llm = kairox.Llama({str(synth_model)!r}, sparse='predicted', gpu_slots=64, "
            f"slots_device='CPU', n_ctx=64, verbose=False, sched_trace={str(out)!r}); llm.eval([1, 2, 3]); llm.eval([4]); llm.eval([5])")
    run_child(code, native)
    recs, dropped = kt.read_trace(out)
    assert dropped == 0 and recs
    graphs = sorted({r.graph for r in recs})
    assert graphs == [0, 1, 2]  # one graph per eval
    assert all(r.t1 >= r.t0 > 0 for r in recs)
    from kairox._native import has_gpu
    if not has_gpu():
        # one backend: one split per graph, from the input embedding to the logits
        assert [(r.part, r.first, r.last) for r in recs] == [("w", "embd", "result_output")] * 3
        assert kt.summarize(recs)["pairs"] == 0  # nothing to overlap with
    else:  # a CUDA build also splits off what it offloads: every graph still starts at the embedding
        for g in graphs:
            assert min((r for r in recs if r.graph == g and r.part != "i"), key=lambda r: r.t0).first == "embd"
    from kairox.cli import main
    assert main(["trace", str(out), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["graphs"] == len(graphs)


def test_gpu_stamps_agree_with_the_host_clock(tmp_path: Path, synth_model: Path, native: Path) -> None:
    """On a GPU, the device's stamps (events resolved on the device's clock, anchored once to
    the host's) against the host's records of the same hybrid layers: a CPU split cannot end
    before the device split whose list it reads has ended, and the device cannot start the
    split that adds the CPU's output before the CPU split that wrote it has ended."""
    from kairox._native import has_gpu
    if not has_gpu():
        pytest.skip("needs a GPU")
    out = tmp_path / "run.jsonl"
    code = (f"import kairox; llm = kairox.Llama({str(synth_model)!r}, sparse='predicted', gpu_slots=100, "
            f"n_gpu_layers=-1, n_ctx=64, n_batch=1, n_ubatch=1, verbose=False, sched_trace={str(out)!r})\n"
            "llm.eval([1, 2, 3])\n"
            "for t in range(4, 20):\n"
            "    llm.eval([t])\n")
    run_child(code, native)
    recs, dropped = kt.read_trace(out)
    assert dropped == 0 and all(r.t1 >= r.t0 > 0 for r in recs)
    tol = 10  # µs: the anchor's offset is at most half its few-µs window
    checked = 0
    for g in sorted({r.graph for r in recs}):
        rg = [r for r in recs if r.graph == g and r.part != "i"]
        dev = [r for r in rg if r.backend != "CPU"]
        for c in (r for r in rg if r.backend == "CPU" and r.last.startswith("ffn_out_cpu-")):
            il = c.last.rsplit("-", 1)[1]
            sel = [d for d in dev if d.last == f"kx_sel-{il}"]
            add = [d for d in dev if d.first == f"ffn_out-{il}"]
            assert len(sel) == 1 and len(add) == 1, (g, il, sel, add)
            assert c.t1 >= sel[0].t1 - tol, (c, sel[0])
            assert add[0].t0 >= c.t1 - tol, (c, add[0])
            checked += 1
    assert checked >= 2 * 16, checked  # both layers of every decoded token


def reload_lines() -> list[str]:
    """known_lines() with two reload batches: [95, 130] (beside layer 0's hand-off [90, 100],
    its GPU head [90, 150], its CPU split [100, 200]) and [195, 210] (beside the CPU split's end
    and the tail [205, 230]), queued during graph 0; plus a second graph of the same splits,
    none beside a reload, whose hand-off took 4 µs."""
    def reload(t0: int, t1: int, nbytes: int, name: str) -> str:
        return json.dumps({"graph": 0, "split": -1, "part": "r", "backend": "reload", "n_nodes": 6,
                           "first": name, "last": name, "t0": t0, "t1": t1, "bytes": nbytes})
    second = [rec(1, 0, "w", "CUDA0", 1010, 1090, "attn_norm-0"), rec(1, 1, "i", "CPU", 1090, 1094, "x-0"),
              rec(1, 2, "h", "CUDA0", 1094, 1150, "kx_slots-0"), rec(1, 1, "w", "CPU", 1094, 1180, "kx_host-0"),
              rec(1, 2, "t", "CUDA0", 1185, 1200, "ffn_out-0"), rec(1, 4, "h", "CUDA0", 1200, 1210, "kx_slots-1"),
              rec(1, 3, "w", "CPU", 1210, 1250, "kx_host-1")]
    return known_lines() + [reload(95, 130, 3 << 20, "reload-1"), reload(195, 210, 1 << 20, "reload")] + second


def test_reloads_beside_the_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reload records: counted apart from the splits (the overlap figures do not change), and
    what ran beside them compared with the same splits that did not, by hand."""
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(known_lines()[:-1] + reload_lines()[len(known_lines()) + 2:]) + "\n")
    path = tmp_path / "reloads.jsonl"
    path.write_text("\n".join(reload_lines()) + "\n")
    recs, _ = kt.read_trace(path)
    s, s0 = kt.summarize(recs), kt.summarize(kt.read_trace(plain)[0])
    assert {k: v for k, v in s.items() if k != "reloads"} == {k: v for k, v in s0.items() if k != "reloads"}
    assert s0["reloads"] is None
    rl = s["reloads"]
    assert rl["batches"] == 2 and rl["mib"] == 4.0 and rl["busy_us"] == 35 + 15
    assert rl["gbs"] == pytest.approx((4 << 20) / 50 / 1e3)
    # hand-offs: graph 0's [90, 100] beside (10 µs), graph 1's [1090, 1094] not (4 µs): delay 6
    h = rl["hand-off"]
    assert (h["beside"], h["alone"], h["beside_us"], h["alone_us"], h["delay_us"]) == (1, 1, 10, 4, 6)
    # hand-backs, a CPU split's end to its device tail's start: graph 0's [200, 205] beside the
    # second reload, graph 1's [1180, 1185] not (layer 1 has no tail: none)
    b = rl["hand-back"]
    assert (b["beside"], b["alone"], b["beside_us"], b["alone_us"], b["delay_us"]) == (1, 1, 5, 5, 0)
    # CPU splits: layer 0's [100, 200] beside (100 µs; alone in graph 1: 86), layer 1's [250, 300] not
    c = rl["CPU split"]
    assert (c["beside"], c["alone"], c["paired"]) == (1, 3, 1) and c["delay_us"] == 100 - 86
    assert c["alone_us"] == 50  # the median of 86, 50 and 40
    # GPU splits beside one: graph 0's head [90, 150] and tail [205, 230]; the first split
    # [10, 90] ends before the first reload starts
    g = rl["GPU split"]
    assert g["beside"] == 2 and g["delay_us"] == pytest.approx(((60 - 56) + (25 - 15)) / 2)
    from kairox.cli import main
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "reloads: 2 batches, 4.0 MiB" in out and "hand-offs beside a reload: 1, median 10.0 µs" in out
    # the timeline draws the reload lane (matplotlib is a test dependency)
    png = tmp_path / "g.png"
    kt.plot_graph(recs, 0, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_reload_overlap_equals_a_per_microsecond_count() -> None:
    """_covered over the union of random intervals against counting each µs by hand."""
    import numpy as np
    rng = np.random.default_rng(3)
    for _ in range(50):
        spans = [(int(a), int(a + b)) for a, b in zip(rng.integers(0, 400, 8), rng.integers(0, 60, 8))]
        mask = np.zeros(600, bool)
        for a, b in spans:
            mask[a:b] = True  # µs [t, t+1) for t in [a, b)
        starts, ends = kt._union(spans)
        for _ in range(20):
            t0 = int(rng.integers(0, 500))
            t1 = t0 + int(rng.integers(0, 90))
            assert kt._covered(starts, ends, t0, t1) == int(mask[t0:t1].sum())


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("gpu", [False, True])
def test_a_balanced_run_traces_its_reloads(tmp_path: Path, synth_model: Path, native: Path, pipeline: bool,
                                           gpu: bool) -> None:
    """The live balancer under the scheduler trace: every reload batch it queued is one reload
    record, stamped by the engine (the host engine on CPU slots, the reload stream on the
    GPU), of the bytes its steps decided to load; the pipeline's batches name their layer."""
    from kairox._native import has_gpu
    if gpu and not has_gpu():
        pytest.skip("needs a GPU")
    out, steps = tmp_path / "run.jsonl", tmp_path / "steps.json"
    where = "n_gpu_layers=-1" if gpu else "slots_device='CPU'"
    code = (
        "import json, kairox\n"
        "from kairox.balancer import BalancerConfig\n"
        f"llm = kairox.Llama({str(synth_model)!r}, sparse='predicted', gpu_slots=[60, 100], n_ctx=128, n_batch=1, "
        f"n_ubatch=1, verbose=False, sched_trace={str(out)!r}, {where}, balancer_backoff=None, "
        f"balancer_pipeline={pipeline}, balancer=BalancerConfig(lam=0.2, eps=0.01, lam_min=0.05, adaptive=True, "
        "max_admit=16))\n"
        "llm.eval([1, 2, 3, 4])\n"
        "for k in range(40):\n"
        "    llm.eval([10 + 20 * (k // 10) + k % 7])\n"
        "llm.drain_balancer()\n"
        f"json.dump(llm.balance_trace(), open({str(steps)!r}, 'w'))\n"
        "llm.close()\n")
    run_child(code, native)
    recs, dropped = kt.read_trace(out)
    rel = [r for r in recs if r.part == "r"]
    tr = json.loads(steps.read_text())
    loads = [r for r in tr if r["n_load"] > 0]
    assert dropped == 0 and loads, "the balancer moved nothing: the test checks nothing"
    assert sum(r.bytes for r in rel) == sum(r["reload_bytes"] for r in tr)
    assert all(r.backend == "reload" and r.split == -1 and r.t1 >= r.t0 > 0 and r.n_nodes % 3 == 0 for r in rel)
    if pipeline:
        # a batch per layer step that loaded, named for the model layer it fills
        assert len(rel) == len(loads)
        assert sorted(r.first for r in rel) == sorted(f"reload-{r['layer']}" for r in loads)
    else:
        # a batch per boundary that loaded, every layer's loads in one
        assert len(rel) == len({r["step"] for r in loads}) and {r.first for r in rel} == {"reload"}
    assert kt.summarize(recs)["reloads"]["batches"] == len(rel)
