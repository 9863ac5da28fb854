"""Load-aware thresholds: the calibration tables, the search (reference against the runtime's),
the pack's tables, and the runtime's controller on a synthetic model (slots on the CPU)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from kairox import thresholds as th
from kairox.thresholds import K, K0, SideCosts


def random_tables(rng: np.random.Generator, n_ff: int) -> tuple[np.ndarray, np.ndarray]:
    """Tables shaped like a calibration's: shares falling and errors rising with the offset."""
    scores = rng.standard_normal((64, n_ff)).astype(np.float32) + rng.normal(0, 1, n_ff).astype(np.float32)
    contrib = np.abs(rng.standard_normal((64, n_ff))).astype(np.float32) * (scores > -0.5)
    return th.layer_tables(scores, contrib, th.layer_grid(scores))


def test_layer_tables_count_and_weigh_the_skipped() -> None:
    scores = np.array([[-1.0, 0.5], [0.2, -0.1], [2.0, 0.05]], np.float32)
    contrib = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    grid = np.array([-0.5, 0.0, 0.1], np.float32)
    sel, err = th.layer_tables(scores, contrib, grid)
    # neuron 0: scores -1, .2, 2 ; neuron 1: .5, -.1, .05
    np.testing.assert_allclose(sel[0], [2 / 3, 2 / 3, 2 / 3])
    np.testing.assert_allclose(sel[1], [1.0, 2 / 3, 1 / 3])
    np.testing.assert_allclose(err[0], [1 / 3, 1 / 3, 1 / 3])
    np.testing.assert_allclose(err[1], [0.0, 4 / 3, 10 / 3])
    # with the rows each listed token reads (ReLU: a third where the gate is <= 0)
    work = np.array([[1.0, 1 / 3], [1 / 3, 1.0], [1.0, 1 / 3]], np.float32)
    sel, _ = th.layer_tables(scores, contrib, grid, work)
    np.testing.assert_allclose(sel[0], [4 / 9, 4 / 9, 4 / 9], rtol=1e-6)
    np.testing.assert_allclose(sel[1], [5 / 9, 2 / 9, 1 / 9], rtol=1e-6)


def test_grid_ascends_through_zero() -> None:
    g = th.layer_grid(np.random.default_rng(0).standard_normal((10, 50)) * 3)
    assert len(g) == K and g[K0] == 0 and np.all(np.diff(g) > 0)
    assert np.allclose(th.layer_grid(np.zeros((4, 4)))[[0, -1]], [-1, 1])  # no spread: unit steps


def test_search_properties() -> None:
    rng = np.random.default_rng(3)
    sel, err = random_tables(rng, 400)
    res = rng.random(400) < 0.5
    s = th.layer_sums(sel, err, res)
    e0 = s.e_gpu[K0] + s.e_cpu[K0]
    norm = 10 * e0
    # the GPU is the slower side: the moves mirror (the GPU skips, the CPU computes more)
    kg, kc = th.solve_sums(s, 0.0, norm, SideCosts(t_gpu=1.0, t_cpu=1e-6))
    assert kc <= K0 <= kg and s.n_gpu[kg] < s.n_gpu[K0]
    # both sides cost nothing: a time tie goes to the lower error
    kg, kc = th.solve_sums(s, 0.4, norm, SideCosts(t_gpu=0.0, t_cpu=0.0))
    assert s.e_gpu[kg] + s.e_cpu[kc] == min(s.e_gpu) + min(s.e_cpu)
    # the CPU is: the GPU threshold goes down, the CPU one up, the error stays in the bound
    for budget in (0.0, 0.05, 0.5):
        kg, kc = th.solve_sums(s, budget, norm, SideCosts(t_gpu=1e-3, t_cpu=1.0))
        assert kg <= K0 <= kc and (kg, kc) != (K0, K0)
        assert s.e_gpu[kg] + s.e_cpu[kc] <= e0 * (1 + 1e-6) + budget * norm
        assert s.n_cpu[kc] < s.n_cpu[K0]
    # a larger budget never costs time
    t = [s.n_cpu[th.solve_sums(s, b, norm, SideCosts(1e-3, 1.0))[1]] for b in (0.0, 0.05, 0.5, 1e6)]
    assert all(a >= b for a, b in zip(t, t[1:]))


@pytest.fixture(scope="module")
def lib(native: Path):
    from kairox.llama import _lib
    return _lib


def native_solve(lib, sel, err, res, budget, norm, c: SideCosts) -> tuple[int, int]:
    kg, kc = ctypes.c_int32(), ctypes.c_int32()
    fp = ctypes.POINTER(ctypes.c_float)
    sel, err = np.ascontiguousarray(sel, np.float32), np.ascontiguousarray(err, np.float32)
    r = np.ascontiguousarray(res, np.uint8)
    lib.kx_thresholds_solve(sel.ctypes.data_as(fp), err.ctypes.data_as(fp), sel.shape[0],
                            r.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), budget, norm, c.t_gpu, c.t_cpu,
                            c.o_gpu, c.o_cpu, ctypes.byref(kg), ctypes.byref(kc))
    return kg.value, kc.value


def test_runtime_search_matches_the_reference(lib) -> None:
    rng = np.random.default_rng(11)
    moved = 0
    for trial in range(60):
        n_ff = int(rng.integers(1, 700))
        sel, err = random_tables(rng, n_ff)
        res = rng.random(n_ff) < rng.random()
        c = SideCosts(t_gpu=float(rng.uniform(0.01, 1)), t_cpu=float(rng.uniform(0.01, 1)),
                      o_gpu=float(rng.uniform(0, 20)), o_cpu=float(rng.uniform(0, 20)))
        budget = float(np.float32(rng.choice([0.0, 0.001, 0.01, 0.1, 1.0])))
        norm = float(np.float32(rng.uniform(0.1, 3) * err[:, K0].sum()))
        want = th.solve_layer(sel, err, res, budget, norm, c)
        assert native_solve(lib, sel, err, res, budget, norm, c) == want, trial
        moved += want != (K0, K0)
    assert moved > 10  # the cases are not all trivial


# ---------------------------------------------------------------------------- end to end

PROMPT = list(range(5, 45))
N_GEN = 40


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Path:
    """KB-tiny with its sketch predictor and the thresholds' calibration in its pack."""
    from kairox.pack import write_pack
    from kairox.predictor import sketch_for_model
    from kairox.synth import PRESETS, calibrated_thresholds, measured_layout, synth
    model = synth(tmp_path_factory.mktemp("thr") / "kb-tiny.gguf", PRESETS["KB-tiny"], seed=7, quiet=True)
    layout, xs = measured_layout(model, 1024, seed=7, keep_x=512)
    pred, tables = calibrated_thresholds(model, sketch_for_model(model), xs)
    write_pack(model, predictor=pred, layout=layout, thresholds=tables, quiet=True)
    return model


def test_pack_keeps_the_tables(calibrated: Path) -> None:
    from kairox.pack import pack_path_for, read_pack
    pk = read_pack(pack_path_for(calibrated), calibrated)
    assert pk.thr_grid is not None and pk.thr_grid.shape == (pk.base.n_layer, K)
    assert pk.thr_norm is not None and np.all(pk.thr_norm > 0)
    for L in pk.layers:
        assert L.thr_sel.shape == (pk.base.n_ff, K) and L.thr_err.shape == (pk.base.n_ff, K)
        assert np.all(np.diff(L.thr_sel, axis=1) <= 0) and np.all(np.diff(L.thr_err, axis=1) >= 0)
        assert L.thr_err[:, K0].sum() >= 0 and L.thr_sel[:, K0].mean() > 0


def decode(model: Path, **kw):
    """Teacher-forced decode of PROMPT + a fixed continuation: logits, CPU rows, and each
    hybrid layer's thresholds and residents after the run."""
    import kairox
    from kairox._native import sparse_counters
    llm = kairox.Llama(str(model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, verbose=False,
                       sparse="predicted", **kw)
    try:
        assert llm.sparse_error is None, llm.sparse_error
        sparse_counters(reset=True)
        llm.eval(PROMPT + list(range(50, 50 + N_GEN)))
        rows = sparse_counters().rows
        from kairox.llama import _C
        n_layer = _C.llama_model_n_layer(llm._model.model)
        info = [llm.thresholds(il) for il in range(n_layer)]
        res = [llm.slot_residents(il) for il in range(n_layer)]
        return np.array(llm.scores[:llm.n_tokens]), rows, info, res
    finally:
        llm.close()


SLOTS = dict(gpu_slots=96, slots_device="CPU")


def test_runtime_thresholds_follow_the_reference(calibrated: Path) -> None:
    from kairox.pack import pack_path_for, read_pack
    pk = read_pack(pack_path_for(calibrated))
    base, base_rows, off, _ = decode(calibrated, **SLOTS)
    assert all(i is None for i in off)
    same, same_rows, info0, _ = decode(calibrated, error_budget=None, **SLOTS)
    np.testing.assert_array_equal(same, base)  # off: the static split exactly
    for budget in (0.0, 0.5):
        got, rows, info, res = decode(calibrated, error_budget=budget, **SLOTS)
        for il, i in enumerate(info):
            assert i is not None and i["solves"] >= 1 and i["t_cpu_ns"] > 0
            L = pk.layers[il]
            r = np.zeros(pk.base.n_ff, bool)
            r[[x for x in res[il] if x >= 0]] = True
            # the controller's pair is the reference's on the live state (its measured costs,
            # the residents, the pack's tables); the GPU's cost is its row bytes at 2000 GB/s
            row_bytes = 3 * pk.base.n_embd * 4
            want = th.solve_layer(L.thr_sel, L.thr_err, r, np.float32(budget), pk.thr_norm[il],
                                  SideCosts(row_bytes / 2000.0, i["t_cpu_ns"], 0.0, i["o_cpu_ns"]))
            assert (i["kg"], i["kc"]) == want, (il, budget)
            assert i["err_added"] <= budget + 1e-5
            assert i["theta_g"] == pytest.approx(float(pk.thr_grid[il, i["kg"]]))
            assert i["theta_c"] == pytest.approx(float(pk.thr_grid[il, i["kc"]]))
        if budget == 0.5:
            # the CPU is the slower side (slots on the CPU count as a 2000 GB/s device): it skips neurons
            assert any(i["kc"] > K0 for i in info)
            assert rows < base_rows
            # most of what it skips is a predictor's false positive (ReLU: the gate is <= 0 and
            # the neuron adds nothing): a bounded approximation, often exact
            scale = float(np.abs(base).max())
            assert np.abs(got - base).max() < 0.5 * scale


def test_refusals(calibrated: Path, tmp_path: Path) -> None:
    import kairox
    with pytest.raises(ValueError, match="error_budget"):
        kairox.Llama(str(calibrated), sparse="exact", error_budget=0.0, verbose=False, **SLOTS)
    with pytest.raises(ValueError, match="error_budget"):
        kairox.Llama(str(calibrated), sparse="predicted", error_budget=0.0, verbose=False)
    with pytest.raises(ValueError, match="error_budget"):
        kairox.Llama(str(calibrated), sparse="predicted", error_budget=-1.0, verbose=False, **SLOTS)
    # a pack without the calibration
    from kairox.pack import write_pack
    from kairox.predictor import sketch_for_model
    other = tmp_path / "pack.gguf"
    write_pack(calibrated, other, predictor=sketch_for_model(calibrated), quiet=True)
    with pytest.raises(Exception, match="calibration"):
        kairox.Llama(str(calibrated), sparse="predicted", sparse_pack=str(other), error_budget=0.0,
                     verbose=False, **SLOTS)
