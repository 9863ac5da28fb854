"""`kairox prepare`: the native activation collector against the numpy reference, threshold
calibration, the whole pipeline on small models (predicted mode afterwards), resuming an
interrupted run, and bad calibration input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kairox.pack import read_pack

pytestmark = pytest.mark.usefixtures("native")

SMALL = dict(max_tokens=3072, max_fit_tokens=2048, n_ctx=256, hist_tokens=1024, quiet=True)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def test_collector_matches_reference(tiny_silu_gguf: Path, tiny_silu_hf: Path) -> None:
    """FFN inputs, active masks, counts, histograms and adjacent-layer cosines from the
    native collector equal what the float64 reference computes for the same tokens."""
    from kairox.profile import Profiler, unpack_masks
    from kairox.reference import LlamaReference

    ref = LlamaReference.from_checkpoint(tiny_silu_hf)
    toks = np.array([1, 5, 9, 300, 42, 7, 7, 100, 2000, 15, 8, 31999], np.int32)
    h_in, gate, out = {}, {}, {}

    def ffn_in(il, h, lw):
        h_in[il], gate[il] = h, h @ lw.w_gate.T
    ref._forward(toks, ffn_in, lambda il, x: out.__setitem__(il, x))
    with Profiler(tiny_silu_gguf, n_ctx=64, n_batch=5, threads=2) as p:  # 3 decodes
        n_layer, n_ff = p.base.n_layer, p.base.n_ff
        # about half the neurons active, a different cut per layer
        thr = np.array([np.quantile(np.abs(_silu(gate[il])), 0.4 + 0.1 * il) for il in range(n_layer)],
                       np.float32)
        p.set_thresholds(thr)
        rows = p.run(toks)
        agg = p.pull()
        assert p.pull().counts.sum() == 0  # pull zeroes the collector
    for il in range(n_layer):
        np.testing.assert_allclose(rows[il].x, h_in[il], rtol=0, atol=2e-3 * np.abs(h_in[il]).max())
        a = np.abs(_silu(gate[il]))
        m = unpack_masks(rows[il].mask, n_ff)
        clear = np.abs(a - thr[il]) > 1e-3 * max(1.0, float(a.max()))  # float32 vs float64 ties
        assert np.array_equal(m[clear], (a > thr[il])[clear])
        assert 0.2 < m.mean() < 0.99
        np.testing.assert_array_equal(agg.counts[il], m.sum(0))
        assert agg.hist[il].sum() == len(toks) * n_ff
    for il in range(1, n_layer):
        a, b = out[il - 1], out[il]
        want = np.mean(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))
        assert agg.cos_n[il] == len(toks)
        assert agg.cos_sum[il] / agg.cos_n[il] == pytest.approx(want, abs=1e-4)
    assert agg.cos_n[0] == 0 and agg.skipped == 0


def test_threshold_from_histogram(native: Path) -> None:
    """A threshold read from the native histogram's bins lands on the requested quantile."""
    from kairox.profile import hist_edges, threshold_for_sparsity

    edges = hist_edges()
    rng = np.random.default_rng(0)
    v = np.abs(rng.standard_normal(200_000)) * 0.1
    v[:50_000] = 0.0  # a quarter exact zeros, as ReLU gives
    lo = np.log10(edges[2])
    width = np.log10(edges[3]) - lo
    bins = np.where(v > 0, np.clip(np.floor((np.log10(np.maximum(v, 1e-30)) - lo) / width) + 2, 1,
                                   len(edges) - 1), 0).astype(int)
    hist = np.bincount(bins, minlength=len(edges))
    for target in (0.3, 0.5, 0.8):
        thr, got = threshold_for_sparsity(hist, target)
        assert np.mean(v <= thr) == pytest.approx(target, abs=0.005)
    assert threshold_for_sparsity(hist, 0.1) == (0.0, pytest.approx(0.25))
    with pytest.raises(ValueError):
        threshold_for_sparsity(hist, 1.0)


@pytest.fixture(scope="module")
def kb_tiny(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Path:
    """The synthetic sparse ReLU model (89% zeros) at its smallest preset."""
    from kairox.synth import PRESETS, synth
    return synth(tmp_path_factory.mktemp("kb") / "kb-tiny.gguf", PRESETS["KB-tiny"], quiet=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, kb_tiny: Path):
    from kairox.prepare import PrepareConfig, prepare
    work = tmp_path_factory.mktemp("work")
    return prepare(kb_tiny, PrepareConfig(work_dir=work, out=work / "kb.kxpack.gguf", **SMALL))


def test_prepare_relu_predicted_mode(kb_tiny: Path, prepared) -> None:
    """On a sparse ReLU model the prepared pack's predictor keeps >= 95% of the truly active
    neurons of held-out text inside the runtime, and greedy text equals dense."""
    from kairox import Llama
    from kairox.bench import counters_per_mode

    pack = read_pack(prepared.pack, kb_tiny)
    assert pack.version == 3 and pack.stats and pack.method["kind"] == "prepare"
    assert pack.threshold.tolist() == [0.0] * pack.base.n_layer
    for layer in pack.layers:
        assert layer.has_predictor and layer.ahead_a is not None
        assert not np.array_equal(layer.perm, np.arange(pack.base.n_ff))  # METIS reordered
        assert 0.0 < layer.freq.mean() < 0.3
    for ls in prepared.stats.layers:
        assert ls.recall >= 0.95 and ls.precision > 0.2
        assert ls.overfetch["metis"] < ls.overfetch["random"]
    # one layer early: the ahead predictor beside the layer's own fed the same (previous) input
    for il, a in enumerate(prepared.stats.extra["ahead"]):
        assert 0.0 <= a["proxy_recall"] <= 1.0 and 0.0 <= a["proxy_precision"] <= 1.0, il
        assert a["recall"] >= 0.9, (il, a)

    kw = dict(n_ctx=512, n_threads=2, verbose=False, seed=0)
    dense = Llama(str(kb_tiny), **kw)
    prompt = "It is a truth universally acknowledged"
    want = dense(prompt, max_tokens=48, temperature=0.0)["choices"][0]["text"]
    dense.close()
    # every layer sparse whatever this CPU's timing says (measure_gain: tests/test_gain.py)
    llm = Llama(str(kb_tiny), sparse="predicted", sparse_pack=str(prepared.pack), measure_gain=False, **kw)
    assert llm(prompt, max_tokens=48, temperature=0.0)["choices"][0]["text"] == want

    # recall inside the runtime: the same held-out tokens one at a time, exact vs predicted
    text = (prepared.work_dir / "heldout.txt").read_text()[:3000]
    toks = llm.tokenize(text.encode())[:300]
    counts = counters_per_mode(llm, toks)
    llm.close()
    exact, pred = counts["exact"], counts["predicted"]
    assert exact.calls == pred.calls == len(toks) * pack.base.n_layer
    assert pred.nonzero / exact.nonzero >= 0.95
    assert pred.selected < 0.5 * pred.total  # and it stayed sparse

    # the load-aware thresholds' calibration, on held-out tokens, and the runtime using it
    assert pack.thr_grid is not None and pack.thr_norm is not None and np.all(pack.thr_norm > 0)
    assert all(layer.thr_sel is not None and layer.thr_err[:, -1].sum() > 0 for layer in pack.layers)
    llm = Llama(str(kb_tiny), sparse="predicted", sparse_pack=str(prepared.pack), gpu_slots=pack.base.n_ff // 4,
                slots_device="CPU", error_budget=0.01, **kw)
    llm(prompt, max_tokens=16, temperature=0.0)
    info = [llm.thresholds(il) for il in range(pack.base.n_layer)]
    llm.close()
    assert all(i is not None and i["solves"] >= 1 and i["err_added"] <= 0.01 + 1e-6 for i in info), [(i["solves"], i["err_added"], i["t_cpu_ns"]) for i in info]


def test_prepare_resumes_after_interrupt(tmp_path: Path, kb_tiny: Path, prepared) -> None:
    """A run stopped mid-profile continues from its checkpoint and ends with the same pack
    as an uninterrupted run."""
    from kairox.prepare import PrepareConfig, prepare

    seen = []

    def stop(n: int) -> None:
        seen.append(n)
        if n == 3:
            raise KeyboardInterrupt
    cfg = PrepareConfig(work_dir=tmp_path / "w", out=tmp_path / "p.kxpack.gguf", **SMALL)
    with pytest.raises(KeyboardInterrupt):
        prepare(kb_tiny, cfg, on_segment=stop)
    assert not cfg.out.exists()
    seen.clear()
    res = prepare(kb_tiny, cfg, on_segment=seen.append)
    assert seen[0] == 4  # continued after the 3 segments already done
    _same_pack(read_pack(res.pack), read_pack(prepared.pack))


def test_prepare_stopped_right_after_a_checkpoint(tmp_path: Path, kb_tiny: Path, prepared, monkeypatch) -> None:
    """A run that dies just after the profile's checkpoint reached the disk (the third
    segment's) resumes at the fourth segment, not the third again: the checkpoint holds the
    aggregates and their progress together, so the pack is the uninterrupted run's (with the
    progress in a file of its own the third segment was counted twice)."""
    import kairox.prepare as kp

    write, n = kp._atomic_npz, []

    def write_then_die(path: Path, **arrays) -> None:
        write(path, **arrays)
        n.append(path.name)
        if path.name == "agg.npz" and n.count("agg.npz") == 3:
            raise SystemExit("killed")
    cfg = kp.PrepareConfig(work_dir=tmp_path / "w", out=tmp_path / "p.kxpack.gguf", **SMALL)
    monkeypatch.setattr(kp, "_atomic_npz", write_then_die)
    with pytest.raises(SystemExit):
        kp.prepare(kb_tiny, cfg)
    monkeypatch.setattr(kp, "_atomic_npz", write)
    seen: list[int] = []
    res = kp.prepare(kb_tiny, cfg, on_segment=seen.append)
    assert seen[0] == 4
    _same_pack(read_pack(res.pack), read_pack(prepared.pack))


def test_prepare_killed_at_random_points(tmp_path: Path, kb_tiny: Path, prepared) -> None:
    """`kairox prepare` killed (SIGKILL: no clean-up runs) at random moments, then run again:
    the output is at every point absent or the complete pack, never one that loads but is
    incomplete; the last run ends with the uninterrupted run's pack and no temporary files."""
    import signal
    import subprocess
    import sys
    import time

    out, work = tmp_path / "p.kxpack.gguf", tmp_path / "w"
    cmd = [sys.executable, "-m", "kairox", "prepare", str(kb_tiny), "-o", str(out), "--work-dir", str(work),
           "--tokens", "3072", "--fit-tokens", "2048", "--ctx", "256", "-q", "-t", "2"]
    t0 = time.perf_counter()
    r = subprocess.run([*cmd[:6], str(tmp_path / "ref.kxpack.gguf"), "--work-dir", str(tmp_path / "ref"), *cmd[9:]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    whole = time.perf_counter() - t0  # kills land anywhere in a run of this length
    (tmp_path / "ref.kxpack.gguf").unlink()
    rng = np.random.default_rng(38)
    kills = 0
    for delay in sorted(rng.uniform(0.2 * whole, 0.95 * whole, 6)):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
        if out.exists():  # complete: it loads and equals the reference
            _same_pack(read_pack(out, kb_tiny), read_pack(prepared.pack))
            break
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    _same_pack(read_pack(out, kb_tiny), read_pack(prepared.pack))
    assert kills >= 1, f"no run was killed (an uninterrupted one took {whole:.1f} s)"
    assert not list(tmp_path.glob(".*.tmp")), list(tmp_path.iterdir())


def _same_pack(a, b) -> None:
    for la, lb in zip(a.layers, b.layers, strict=True):
        for f in ("perm", "group", "freq", "pred_a", "pred_b", "pred_c", "ahead_c"):
            np.testing.assert_array_equal(np.asarray(getattr(la, f)), np.asarray(getattr(lb, f)), err_msg=f)
        np.testing.assert_array_equal(la.down_t(), lb.down_t())


def test_prepare_gated_hits_target_sparsity(tmp_path: Path, tiny_silu_gguf: Path) -> None:
    """A SiLU model gets per-layer thresholds whose measured sparsity on all profiled tokens
    matches the target."""
    from kairox.prepare import PrepareConfig, prepare

    res = prepare(tiny_silu_gguf, PrepareConfig(work_dir=tmp_path, out=tmp_path / "s.kxpack.gguf",
                                                target_sparsity=0.6, **SMALL))
    pack = read_pack(res.pack, tiny_silu_gguf)
    assert np.all(pack.threshold > 0)
    for ls in res.stats.layers:
        assert ls.density == pytest.approx(0.4, abs=0.05)
        assert ls.threshold > 0 and ls.recall > 0.9


def test_prepare_gated_thresholds_within_perplexity_budget(tmp_path: Path, tiny_silu_gguf: Path) -> None:
    """Without a target sparsity, a SiLU model's thresholds are the search's (kairox.threshold_search):
    within the budget on the held-out tokens, and the pack holds exactly them; measured again
    at the pack's thresholds, the perplexity is the one the search reported."""
    from kairox.prepare import PrepareConfig, Segments, prepare
    from kairox.quality import Emulator, Rule

    res = prepare(tiny_silu_gguf, PrepareConfig(work_dir=tmp_path, out=tmp_path / "b.kxpack.gguf",
                                                ppl_budget=0.05, **SMALL))
    b = res.stats.extra["ppl_budget"]
    pack = read_pack(res.pack, tiny_silu_gguf)
    assert pack.method["ppl_budget"] == 0.05 and pack.method["target_sparsity"] is None
    np.testing.assert_array_equal(pack.threshold, np.asarray(b["thresholds"], np.float32))
    assert np.all(pack.threshold > 0) and 0.0 < b["share"] and b["rise"] <= 0.05
    over = [s for s in b["steps"] if s["share"] > b["share"]]
    assert over and all(s["ppl"] > b["dense_ppl"] * 1.05 for s in over)  # the next step up did not fit
    segs = Segments.load(next(tmp_path.glob("corpus-*/segments.npz")))
    held = [segs.seg(k) for k in range(len(segs.length)) if segs.heldout[k]]
    chosen, n = [], 0
    for seg in held:
        if n >= b["tokens"]:
            break
        chosen.append(seg)
        n += len(seg)
    with Emulator(tiny_silu_gguf, n_ctx=SMALL["n_ctx"], n_batch=SMALL["n_ctx"], threads=2) as emu:
        r = emu.perplexity(chosen, Rule.of_cats(pack.threshold))
    assert r.ppl == pytest.approx(b["ppl"], rel=1e-5)
    assert np.mean(b["sparsity"]) == pytest.approx(r.sparsity.fraction("gate"), abs=0.1)


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("what,data,msg", [
    ("binary", b"text\0\1\2" * 100, "binary"),
    ("latin1", "caf\xe9 au lait ".encode("latin-1") * 100, "not UTF-8"),
    ("empty", b"  \n\n ", "empty"),
    ("short", b"Just a few words.", "segments"),
])
def test_bad_calibration_input(tmp_path: Path, kb_tiny: Path, what: str, data: bytes, msg: str) -> None:
    from kairox.prepare import PrepareConfig, PrepareError, prepare
    f = _write(tmp_path / f"{what}.txt", data)
    with pytest.raises(PrepareError, match=msg):
        prepare(kb_tiny, PrepareConfig(calib=[f], work_dir=tmp_path / "w", **SMALL))
    with pytest.raises(PrepareError, match="not found"):
        prepare(kb_tiny, PrepareConfig(calib=[tmp_path / "missing.txt"], work_dir=tmp_path / "w", **SMALL))
    assert not (tmp_path / "kb-tiny.kxpack.gguf").exists()


def test_cli_prepare_and_stats(tmp_path: Path, kb_tiny: Path, prepared,
                               capsys: pytest.CaptureFixture) -> None:
    from kairox.cli import main

    assert main(["stats", str(prepared.pack)]) == 0
    out = capsys.readouterr().out
    assert "hot 80%" in out and "PowerInfer" in out
    assert main(["stats", str(prepared.pack), "--png", str(tmp_path)]) == 0
    assert (tmp_path / "stats-locality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["prepare", str(tmp_path / "none.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["prepare", str(kb_tiny), "--calib", str(_write(tmp_path / "b.txt", b"\0\0"))]) == 2
    assert "binary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prepare", str(kb_tiny), "--target-sparsity", "1.5"])


def test_runtime_validates_ahead_predictors(tmp_path: Path, kb_tiny: Path, prepared) -> None:
    """The native pack loader accepts the ahead predictors, refuses an incomplete trio, and
    refuses a pack of an older version."""
    import gguf
    from kairox import Llama
    from test_pack import rewrite

    kw = dict(n_ctx=64, n_threads=2, verbose=False)
    llm = Llama(str(kb_tiny), sparse="predicted", sparse_pack=str(prepared.pack), measure_gain=False, **kw)
    assert llm.sparse == "predicted"
    llm.close()
    cases = {
        "trio": (rewrite(prepared.pack, tmp_path / "a.gguf", tensors={"blk.1.kx_ahead_c": None}),
                 "come together"),
        "v2": (rewrite(prepared.pack, tmp_path / "b.gguf",
                       kv={"kx.pack.version": (2, gguf.GGUFValueType.UINT32)}), "format version 2"),
    }
    for path, words in cases.values():
        with pytest.raises(ValueError, match=words):
            Llama(str(kb_tiny), sparse="predicted", sparse_pack=str(path), **kw)


def test_record_trace_uses_the_packs_thresholds(tiny_silu_gguf: Path, tiny_silu_hf: Path, tmp_path: Path) -> None:
    """A recorded trace lists, per token and layer, the neurons with |act(gate)| above the
    pack's threshold of that layer (the sparse mode's rule), as the float64 reference
    computes them, with requests profiled one after another from an empty cache."""
    from kairox.pack import PackLayout, write_pack
    from kairox.profile import record_trace
    from kairox.reference import LlamaReference

    ref = LlamaReference.from_checkpoint(tiny_silu_hf)
    reqs = [[1, 5, 9, 300, 42, 7], [7, 100, 2000, 15, 8, 31999, 3]]
    gates = []
    for r in reqs:
        g = {}
        ref._forward(np.array(r, np.int32), lambda il, h, lw: g.__setitem__(il, h @ lw.w_gate.T))
        gates.append(g)
    n_layer, n_ff = len(gates[0]), gates[0][0].shape[1]
    acts = [np.abs(_silu(np.concatenate([g[il] for g in gates]))) for il in range(n_layer)]
    thr = np.array([np.quantile(acts[il], 0.5 + 0.15 * il) for il in range(n_layer)], np.float32)
    ids = np.arange(n_ff)
    model = tmp_path / "m.gguf"
    model.symlink_to(tiny_silu_gguf)
    write_pack(model, group_size=4, quiet=True, workers=1,
               layout=PackLayout(lambda il: (ids, ids // 4, np.full(n_ff, 0.5, np.float32)), thr))
    trace, n_groups, _ = record_trace(model, None, reqs, threads=2, group_size=1)
    assert n_groups == n_ff and len(trace) == n_layer * sum(map(len, reqs))
    tokens = sum(map(len, reqs))
    for s in trace:
        a = acts[s.layer][s.step]
        clear = np.abs(a - thr[s.layer]) > 1e-3 * max(1.0, float(a.max()))
        got = np.zeros(n_ff, bool)
        got[list(s.active)] = True
        assert np.array_equal(got[clear], (a > thr[s.layer])[clear]), (s.step, s.layer)
    assert sorted({s.step for s in trace}) == list(range(tokens))
    dens = [np.mean([len(s.active) for s in trace if s.layer == il]) / n_ff for il in range(n_layer)]
    assert dens[0] > dens[-1] + 0.1  # the thresholds differ by layer, and so do the traces
