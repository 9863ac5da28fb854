"""Sparsity that pays or steps aside: a pack records how dense its predicted lists were on
calibration tokens (kx.listed_density); before the model loads the runtime reads it, times
each layer's sparse FFN at that share against llama.cpp's dense FFN on this CPU (measure_gain,
kx_sparse_cost), keeps llama.cpp's repacked FFN weights for the layers that would not gain
(slower, or lists of 60% of the neurons or more) and runs those layers dense; when no layer
gains the whole model runs dense and says so. The tests of the listed-share rule alone turn the
timing off (measure_gain=False, --no-kx-measure-gain) so that their layers do not depend on
this machine's speed."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from kairox.pack import TIMED_GAINS_BELOW, PackError, read_pack, write_pack
from kairox.prepare import gain_report, listed_density

from test_sparse import completion, make_llm, run_tool


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Path:
    """A synthetic ReLU model in Q4_0 (a type the CPU backend repacks), wide enough for the
    repacked layouts (rows in groups of 8, 256-wide)."""
    from kairox.synth import Shape, synth
    return synth(tmp_path_factory.mktemp("gain") / "kb-q4.gguf", Shape(2, 256, 1024, 4, 2, "q4_0"), seed=7,
                 quiet=True)


def packed(model: Path, tmp_path: Path, listed: list[float] | None) -> Path:
    from kairox.predictor import sketch_for_model
    return write_pack(model, tmp_path / "p.kxpack.gguf", predictor=sketch_for_model(model), down_type="q8_0",
                      listed_density=listed, quiet=True)


def ffn_buffers(llm) -> list[str]:
    return [llm.tensor_buffer_type(f"blk.{il}.ffn_{k}.weight") for il in range(2) for k in ("gate", "up", "down")]


def greedy(llm, n: int = 24) -> tuple[list[int], np.ndarray]:
    llm.eval([1, 2, 3, 4])
    toks = []
    for _ in range(n):
        toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([toks[-1]])
    return toks, np.array(llm.scores[:llm.n_tokens])


@pytest.fixture(scope="module")
def dense(q4_model: Path) -> tuple[list[str], list[int], np.ndarray]:
    llm = make_llm(q4_model)
    try:
        bufs = ffn_buffers(llm)
        if "CPU_REPACK" not in bufs:
            pytest.skip(f"this CPU does not repack Q4_0 weights ({bufs})")
        return (bufs, *greedy(llm))
    finally:
        llm.close()


def test_the_pack_round_trips_its_listed_density(q4_model: Path, tmp_path: Path) -> None:
    assert read_pack(packed(q4_model, tmp_path, [0.25, 0.75])).listed_density == [0.25, 0.75]
    assert read_pack(packed(q4_model, tmp_path, None)).listed_density is None
    for bad in ([0.5], [0.5, 1.5], [0.5, float("nan")]):
        with pytest.raises(PackError, match="listed_density"):
            packed(q4_model, tmp_path, bad)


def test_a_pack_that_cannot_gain_runs_dense_repacked_and_says_so(q4_model: Path, tmp_path: Path, dense,
                                                                  native: Path) -> None:
    import kairox
    bufs, want_toks, want = dense
    pack = packed(q4_model, tmp_path, [0.9, 0.7])
    with pytest.warns(kairox.SparseNoGainWarning, match="would not gain"):
        llm = make_llm(q4_model, sparse="predicted", sparse_pack=str(pack), measure_gain=False)
    try:
        assert llm.sparse == "dense" and llm.sparse_layers == 0
        assert ffn_buffers(llm) == bufs  # llama.cpp's own (repacked) weights
        toks, got = greedy(llm)
        assert toks == want_toks
        np.testing.assert_array_equal(got, want)  # the dense path itself
    finally:
        llm.close()
    r = completion(native, q4_model, "--sparse", "predicted", "--sparse-pack", str(pack))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the sparse FFN would not gain on this model" in r.stderr and "70-90%" in r.stderr
    assert "FFN on this CPU," not in r.stderr  # nothing under the line to time
    assert "FFN mode predicted" not in r.stderr


def test_only_the_layers_that_gain_run_sparse(q4_model: Path, tmp_path: Path, dense, native: Path) -> None:
    from kairox._native import sparse_counters
    bufs, want_toks, want = dense
    pack = packed(q4_model, tmp_path, [0.2, 0.8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = make_llm(q4_model, sparse="predicted", sparse_pack=str(pack), measure_gain=False)
    try:
        assert llm.sparse == "predicted" and llm.sparse_layers == 1
        got_bufs = ffn_buffers(llm)
        assert "REPACK" not in "".join(got_bufs[:3])  # layer 0: plain rows, read by the sparse kernels
        assert got_bufs[3:] == bufs[3:]               # layer 1: as llama.cpp loads it
        sparse_counters(reset=True)
        toks, got = greedy(llm)
        c = sparse_counters(reset=True)
        assert c.calls == llm.n_tokens  # one selection per decode (one token each): layer 0's only
        assert toks == want_toks
        assert float(np.abs(got - want).max()) <= 1e-2 * float(np.abs(want).max())
    finally:
        llm.close()
    r = completion(native, q4_model, "--sparse", "predicted", "--sparse-pack", str(pack), "--no-kx-measure-gain")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FFN mode predicted (1 of 2 layers sparse)" in r.stderr


def test_without_a_measure_every_layer_runs_sparse(q4_model: Path, tmp_path: Path) -> None:
    llm = make_llm(q4_model, sparse="predicted", sparse_pack=str(packed(q4_model, tmp_path, None)))
    try:
        assert llm.sparse == "predicted" and llm.sparse_layers == 2
        assert not any("REPACK" in b for b in ffn_buffers(llm))
    finally:
        llm.close()


def test_the_load_times_with_the_contexts_threads() -> None:
    """The context parameters the load sees (its sparse FFN timing, the budget's dry run) carry
    the threads the context will run with: the ones asked for, else llama-cpp-python's
    defaults (half the cores for decoding, all for batches). With other threads the load timed
    anew and could choose otherwise than kx_sparse_cost at the context's threads."""
    import multiprocessing
    from kairox.llama import _context_params
    cp = _context_params({"n_threads": 3, "n_threads_batch": 5})
    assert (cp.n_threads, cp.n_threads_batch) == (3, 5)
    cores = multiprocessing.cpu_count()
    cp = _context_params({})
    assert (cp.n_threads, cp.n_threads_batch) == (max(cores // 2, 1), cores)


def test_the_load_runs_sparse_exactly_where_the_sparse_ffn_timed_faster(q4_model: Path, tmp_path: Path, dense,
                                                                       native: Path) -> None:
    from kairox.llama import sparse_cost
    bufs, want_toks, want = dense
    pack = packed(q4_model, tmp_path, [0.1, 0.5])
    # the load's own measurement: memoized per model, pack, mode and threads, so the load
    # below decides on these very numbers
    ratio = sparse_cost(q4_model, pack, "predicted", n_threads=2)
    assert len(ratio) == 2 and all(r is not None and 0.0 < r < 1e3 for r in ratio), ratio
    gains = [r < TIMED_GAINS_BELOW for r in ratio]
    llm = make_llm(q4_model, sparse="predicted", sparse_pack=str(pack), n_threads=2)
    try:
        assert llm.sparse_layers == sum(gains)
        assert llm.sparse == ("predicted" if any(gains) else "dense")
        got = ffn_buffers(llm)
        for il, g in enumerate(gains):
            layer = got[3 * il:3 * il + 3]
            if g:
                assert not any("REPACK" in b for b in layer), (il, ratio, got)  # plain rows for the row ops
            else:
                assert layer == bufs[3 * il:3 * il + 3], (il, ratio, got)  # llama.cpp's own weights
        toks, out = greedy(llm)
        assert toks == want_toks
        assert float(np.abs(out - want).max()) <= 1e-2 * float(np.abs(want).max())
    finally:
        llm.close()
    # a layer over the line is not timed: it runs dense whatever the timing would say
    assert sparse_cost(q4_model, packed(q4_model, tmp_path, [0.1, 0.7]), "predicted", n_threads=2)[1] is None


def test_the_tools_time_the_sparse_ffn_and_say_what_they_chose(q4_model: Path, tmp_path: Path, native: Path) -> None:
    pack = packed(q4_model, tmp_path, [0.1, 0.5])
    r = completion(native, q4_model, "--sparse", "predicted", "--sparse-pack", str(pack), "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if "FFN on this CPU, 2 threads" in ln)  # libllama's info (-v)
    assert "layout q4_0,q4_0,q4_0,q8_0: dense " in line
    n = int(line.split("sparse gains on ")[1].split(" of ")[0])
    assert line.endswith("of 2 layers") and 0 <= n <= 2
    if n:
        assert f"FFN mode predicted ({n} of 2 layers sparse)" in r.stderr
    else:
        assert "the sparse FFN would not gain on this model here" in r.stderr
    help_text = run_tool(native, "llama-completion", "--help").stdout
    assert "--no-kx-measure-gain" in help_text


def test_sparse_cost_refuses_what_it_cannot_time(q4_model: Path, tmp_path: Path) -> None:
    from kairox.llama import sparse_cost
    with pytest.raises(ValueError, match="no densities|lists 0 layers"):
        sparse_cost(q4_model, packed(q4_model, tmp_path, None), "predicted", n_threads=1)
    with pytest.raises(ValueError, match="not a sparse pack"):
        sparse_cost(q4_model, q4_model, "predicted", n_threads=1)
    with pytest.raises(ValueError, match="predicted or threshold"):
        sparse_cost(q4_model, packed(q4_model, tmp_path, [0.1, 0.5]), "exact", n_threads=1)


def test_prepare_reports_the_gain_per_layer() -> None:
    fits = [{"same": {"density": 0.1, "overprediction": 2.0}}, {"same": {"density": 0.5, "overprediction": 1.9}}]
    listed = listed_density(fits)
    assert listed == pytest.approx([0.2, 0.95])
    n, text = gain_report(listed)
    assert n == 1 and "1 of 2 layers run sparse" in text
    n, text = gain_report([0.7, 0.95])
    assert n == 0 and "will not gain on this model" in text and "70-95%" in text
    # measured on this CPU: a layer gains only where its sparse FFN timed 5% faster
    n, text = gain_report([0.1, 0.2, 0.3, 0.7], [0.5, 1.25, 0.97, None], threads=4)
    assert n == 1 and "1 of 4 layers run sparse" in text and "(4 threads)" in text
    assert "0.50-1.25 of the dense FFN's time" in text and "2.00x dense dense dense" in text
    n, text = gain_report([0.1, 0.2], [1.1, 1.3], threads=2)
    assert n == 0 and "will not gain here" in text
