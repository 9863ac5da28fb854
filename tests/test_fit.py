"""The fitted predictor: recall and precision on synthetic activations, the recall target
on held-out rows, raw-input folding, determinism, the rank budget, and input checks."""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kairox.fit as fit
from kairox.fit import (FitConfig, FitResult, evaluate_predictor, fit_predictor, predictor_params,
                        rank_for_budget)
from kairox.pack import predictor_scores

N_EMBD, N_FF, R0, DENSITY = 128, 256, 8, 0.15
Sampler = Callable[[int, int], tuple[np.ndarray, np.ndarray]]


def activation_sampler(seed: int = 0, *, noise: float = 0.0, flip: float = 0.0,
                       spread: bool = False) -> tuple[Sampler, Sampler]:
    """(noisy, clean) samplers of (x, y) with y = (W x + b > 0) and flip-noise on y.

    x ~ N(m, diag(s²)) with channel scales s log-uniform in 0.1..10 (hidden states are
    anisotropic) and offsets m; W is rank R0 plus `noise` times a dense part of the same
    norm (which no rank-16 predictor can capture); b gives each neuron density DENSITY,
    or with `spread` densities log-normal around it (many rare neurons). The clean
    sampler returns the labels before flipping.
    """
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.uniform(math.log(0.1), math.log(10.0), N_EMBD))
    offsets = rng.standard_normal(N_EMBD) * scales * 0.5
    w = rng.standard_normal((N_FF, R0)) @ rng.standard_normal((R0, N_EMBD)) / math.sqrt(R0 * N_EMBD)
    w += noise * rng.standard_normal((N_FF, N_EMBD)) / math.sqrt(N_EMBD)
    ref = rng.standard_normal((20000, N_EMBD)) * scales + offsets
    density = (np.clip(np.exp(rng.normal(math.log(DENSITY), 1.0, N_FF)), 0.004, 0.6)
               if spread else np.full(N_FF, DENSITY))
    bias = -np.array([np.quantile(col, 1 - d) for col, d in zip((ref @ w.T).T, density)])

    def draw(n: int, s: int, clean: bool) -> tuple[np.ndarray, np.ndarray]:
        r = np.random.default_rng(s)
        x = (r.standard_normal((n, N_EMBD)) * scales + offsets).astype(np.float32)
        y = x @ w.T + bias > 0
        if flip and not clean:
            y ^= r.random(y.shape) < flip
        return x, y
    return (lambda n, s: draw(n, s, False)), (lambda n, s: draw(n, s, True))


@pytest.fixture(scope="module")
def separable() -> tuple[FitResult, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A rank-16 fit on 6000 rows of an exactly rank-8 threshold problem, its data and
    4000 held-out rows."""
    draw, _ = activation_sampler(0)
    data, held = draw(6000, 1), draw(4000, 2)
    return fit_predictor(*data, FitConfig(rank=16, seed=0, backend="numpy")), data, held


def test_separable_activation_recall_and_precision(separable) -> None:
    res, _, (xt, yt) = separable
    q = evaluate_predictor(res.a, res.b, res.c, xt, yt)
    assert abs(q.true_density - DENSITY) < 0.01
    # measured: recall 0.991, precision 0.965; predicting every neuron gives precision 0.15
    assert q.recall >= 0.98
    assert q.precision >= 0.9
    assert q.overprediction == pytest.approx(q.recall / q.precision)
    assert q.predicted_density == pytest.approx(q.overprediction * q.true_density)
    assert res.loss_curve[-1] < 0.7 * res.loss_curve[0]       # Adam improved on the start
    assert res.train.recall >= 0.98 and res.train_recall == res.train.recall


def test_training_beats_the_regression_start(separable) -> None:
    res, data, (xt, yt) = separable
    start = fit_predictor(*data, FitConfig(rank=16, seed=0, epochs=0, backend="numpy"))
    assert start.loss_curve == []
    q0 = evaluate_predictor(start.a, start.b, start.c, xt, yt)
    q = evaluate_predictor(res.a, res.b, res.c, xt, yt)
    # measured: precision 0.79 from the regression alone, 0.97 after 8 epochs, same recall
    assert q0.recall >= 0.98
    assert q.precision > q0.precision + 0.1


def test_noisy_labels_keep_recall() -> None:
    draw, clean = activation_sampler(1, flip=0.02)
    x, y = draw(6000, 1)
    res = fit_predictor(x, y, FitConfig(rank=16, backend="numpy"))
    xt, yt = draw(6000, 2)
    _, yt_clean = clean(6000, 2)
    q = evaluate_predictor(res.a, res.b, res.c, xt, yt)
    q_clean = evaluate_predictor(res.a, res.b, res.c, xt, yt_clean)
    # ~10% of the noisy positives are flipped negatives scattered at random, so reaching
    # 0.99 of them costs most of the precision; the target is still met on held-out rows.
    assert q.recall == pytest.approx(0.99, abs=0.01)
    assert q_clean.recall >= 0.99


@pytest.mark.parametrize("target", [0.9, 0.99])
def test_target_recall_is_met_on_held_out_rows(target: float) -> None:
    # a dense gate component a rank-16 predictor cannot capture, and many rare neurons
    draw, _ = activation_sampler(3, noise=1.0, spread=True)
    x, y = draw(8000, 1)
    res = fit_predictor(x, y, FitConfig(rank=16, target_recall=target, backend="numpy"))
    assert res.n_calibrated > 0 and res.n_pooled > 0    # both calibration paths in use
    xt, yt = draw(12000, 2)
    q = evaluate_predictor(res.a, res.b, res.c, xt, yt)
    # measured: 0.896 and 0.990
    assert q.recall == pytest.approx(target, abs=0.012)
    assert q.precision > q.true_density * 1.5
    # Rare neurons meet it too, not only the frequent ones that dominate the pooled count.
    # Measured at 0.99: 0.987; a per-neuron quantile extrapolated below the smallest of
    # their few held-out positives reached 0.974.
    rare = y.mean(0) < 0.05
    assert rare.sum() >= 30
    qr = evaluate_predictor(res.a, res.b[rare], res.c[rare], xt, yt[:, rare])
    assert target - 0.01 <= qr.recall <= target + 0.02


def test_result_reads_raw_x() -> None:
    """Standardization is folded into A and c: refitting on x' = x·s + m (per channel)
    gives the same scores on x' as the first fit gives on x."""
    draw, _ = activation_sampler(3)
    x, y = draw(3000, 1)
    xt, yt = draw(2000, 2)
    rng = np.random.default_rng(7)
    s = np.exp(rng.uniform(math.log(1e-2), math.log(1e2), N_EMBD)).astype(np.float32)
    # offsets of a few standard deviations: far larger ones would make x' itself lose the
    # signal to float32 rounding, which no folding can undo
    m = (rng.standard_normal(N_EMBD) * 3 * x.std(0) * s).astype(np.float32)
    cfg = FitConfig(rank=16, epochs=3, backend="numpy")
    r1 = fit_predictor(x, y, cfg)
    r2 = fit_predictor(x * s + m, y, cfg)
    s1 = predictor_scores(r1.a, r1.b, r1.c, xt)
    s2 = predictor_scores(r2.a, r2.b, r2.c, xt * s + m)
    # measured: largest difference 2e-5 of the scores' spread
    np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-3 * float(s1.std()))
    q1 = evaluate_predictor(r1.a, r1.b, r1.c, xt, yt)
    q2 = evaluate_predictor(r2.a, r2.b, r2.c, xt * s + m, yt)
    assert q2.recall == pytest.approx(q1.recall, abs=1e-3)
    assert q2.precision == pytest.approx(q1.precision, abs=1e-3)
    assert q1.recall >= 0.97


def test_train_quality_is_the_raw_predictor_on_the_fit_rows(separable) -> None:
    res, (x, y), _ = separable
    pred = (x @ res.a.astype(np.float64).T) @ res.b.astype(np.float64).T + res.c > 0
    hit = np.count_nonzero(pred & y)
    assert res.train.recall == pytest.approx(hit / np.count_nonzero(y), abs=1e-3)
    assert res.train.precision == pytest.approx(hit / np.count_nonzero(pred), abs=1e-3)
    assert res.train.true_density == pytest.approx(y.mean())


def test_shapes_dtypes_and_info(separable) -> None:
    res, (x, _), _ = separable
    assert res.a.shape == (16, N_EMBD) and res.b.shape == (N_FF, 16) and res.c.shape == (N_FF,)
    for arr in (res.a, res.b, res.c):
        assert arr.dtype == np.float32 and arr.flags.c_contiguous and np.all(np.isfinite(arr))
    assert len(res.loss_curve) == 8 and all(math.isfinite(v) for v in res.loss_curve)
    assert res.backend == "numpy" and res.seconds > 0
    assert res.n_train + res.n_calib == x.shape[0] and res.n_calib == 600
    assert res.n_calibrated + res.n_pooled + res.n_never_active == N_FF
    assert res.pos_weight == pytest.approx((1 - DENSITY) / DENSITY, rel=0.05)


def test_float16_input() -> None:
    draw, _ = activation_sampler(4)
    x, y = draw(2000, 1)
    res = fit_predictor(x.astype(np.float16), y, FitConfig(rank=8, epochs=2, backend="numpy"))
    assert res.a.dtype == np.float32
    xt, yt = draw(2000, 2)
    assert evaluate_predictor(res.a, res.b, res.c, xt.astype(np.float16), yt).recall >= 0.97


def test_deterministic_for_a_seed() -> None:
    draw, _ = activation_sampler(5)
    x, y = draw(2000, 1)
    cfg = FitConfig(rank=8, epochs=2, seed=3, backend="numpy")
    r1, r2 = fit_predictor(x, y, cfg), fit_predictor(x, y, cfg)
    for u, v in ((r1.a, r2.a), (r1.b, r2.b), (r1.c, r2.c)):
        np.testing.assert_array_equal(u, v)
    assert r1.loss_curve == r2.loss_curve
    r3 = fit_predictor(x, y, FitConfig(rank=8, epochs=2, seed=4, backend="numpy"))
    assert not np.array_equal(r1.c, r3.c)


def test_small_chunks_give_the_same_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    draw, _ = activation_sampler(6)
    x, y = draw(2000, 1)
    cfg = FitConfig(rank=8, epochs=2, backend="numpy")
    ref = fit_predictor(x, y, cfg)
    monkeypatch.setattr(fit, "_CHUNK_BYTES", 4096)    # a few rows / columns per chunk
    res = fit_predictor(x, y, cfg)
    np.testing.assert_allclose(res.b, ref.b, rtol=1e-3, atol=1e-3 * float(np.abs(ref.b).max()))
    assert res.train.recall == pytest.approx(ref.train.recall, abs=2e-3)
    assert res.train.precision == pytest.approx(ref.train.precision, abs=2e-3)
    assert evaluate_predictor(ref.a, ref.b, ref.c, x, y) == ref.train   # chunked evaluation


def test_never_active_neurons_stay_off() -> None:
    draw, _ = activation_sampler(7)
    x, y = draw(3000, 1)
    y[:, :40] = False                        # never active in the data
    y[::500, 20:40] = True                   # 6 positives each, unrelated to x
    res = fit_predictor(x, y, FitConfig(rank=8, epochs=2, backend="numpy"))
    assert res.n_never_active == 20 and res.n_pooled >= 20
    pred = predictor_scores(res.a, res.b, res.c, x) > 0
    assert not pred[:, :20].any()
    assert res.train.recall >= 0.98
    # Untrained, with a huge positive weight, the model's own bias would switch the
    # never-active neurons on everywhere (their B rows are 0): the clip keeps them off.
    hot = fit_predictor(x, y, FitConfig(rank=8, epochs=0, pos_weight=1e6, backend="numpy"))
    assert not (predictor_scores(hot.a, hot.b, hot.c, x)[:, :20] > 0).any()

    y0 = np.zeros_like(y)
    none = fit_predictor(x, y0, FitConfig(rank=4, epochs=1, backend="numpy"))
    assert none.n_never_active == N_FF
    assert none.train.predicted_density == 0 and none.train.recall == 1.0


def test_evaluate_predictor_counts() -> None:
    # one channel, scores = x - 0.5 for neuron 0 and 0.5 - x for neuron 1
    a = np.ones((1, 1), np.float32)
    b = np.array([[1.0], [-1.0]], np.float32)
    c = np.array([-0.5, 0.5], np.float32)
    x = np.array([[0.0], [1.0], [1.0], [0.0]], np.float32)
    y = np.array([[False, True], [True, False], [False, True], [False, False]])
    # predicted: row0 [F, T], row1 [T, F], row2 [T, F], row3 [F, T] -> 4 predicted, 2 hits, 3 true
    q = evaluate_predictor(a, b, c, x, y)
    assert (q.recall, q.precision, q.overprediction) == (2 / 3, 0.5, 4 / 3)
    assert (q.predicted_density, q.true_density) == (0.5, 3 / 8)
    empty = evaluate_predictor(a, b, c - 10, x, np.zeros_like(y))
    assert (empty.recall, empty.precision, empty.overprediction) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="neurons"):
        evaluate_predictor(a, b, c, x, y[:, :1])


def test_predictor_params() -> None:
    assert predictor_params(4096, 11008, 256) == 256 * (4096 + 11008) + 11008
    assert predictor_params(8, 16, 1) == 8 + 16 + 16
    with pytest.raises(ValueError, match="rank"):
        predictor_params(8, 16, 0)


@pytest.mark.parametrize("n_embd,n_ff,n_layer,params,frac", [
    (4096, 11008, 32, 6_738_415_616, 0.06),     # Llama-2-7B
    (640, 2048, 18, 268_000_000, 0.06),
    (640, 2048, 18, 268_000_000, 0.001),        # a rank below 8 stays as it is
])
def test_rank_for_budget(n_embd: int, n_ff: int, n_layer: int, params: int, frac: float) -> None:
    rank = rank_for_budget(n_embd, n_ff, n_layer, params, frac)
    fits = lambda r: n_layer * predictor_params(n_embd, n_ff, r) <= frac * params  # noqa: E731
    assert fits(rank)
    if rank >= 8:
        assert rank % 8 == 0 and not fits(rank + 8)
    else:
        assert not fits(rank + 1)
    assert rank_for_budget(4096, 11008, 32, 6_738_415_616) == 832   # 404.3M / 32 layers


def test_rank_for_budget_limits() -> None:
    # exactly rank 1: 2 layers x (1 x (4 + 8) + 8) = 40 parameters
    assert rank_for_budget(4, 8, 2, 400, 0.1) == 1
    with pytest.raises(ValueError, match="rank-1"):
        rank_for_budget(4, 8, 2, 399, 0.1)
    assert rank_for_budget(64, 128, 1, 10**9, 0.5) == 64          # capped at min(n_embd, n_ff)
    with pytest.raises(ValueError, match="budget_fraction"):
        rank_for_budget(64, 128, 1, 10**9, 0)


@pytest.mark.parametrize("change,match", [
    (lambda x, y, cfg: (x[:-1], y, cfg), "rows"),
    (lambda x, y, cfg: (x, y.astype(np.float32), cfg), "bool"),
    (lambda x, y, cfg: (x.astype(np.int32), y, cfg), "floating"),
    (lambda x, y, cfg: (x[0], y, cfg), "2-D"),
    (lambda x, y, cfg: (np.where(np.arange(x.size).reshape(x.shape) == 1234, np.nan, x), y, cfg), "NaN"),
    (lambda x, y, cfg: (np.where(np.arange(x.size).reshape(x.shape) == 99, np.inf, x), y, cfg), "infinite"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=N_EMBD + 1)), r"rank must be an integer in 1\.\.128"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=0)), "rank"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=4, target_recall=0.0)), "target_recall"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=4, val_fraction=1.0)), "val_fraction"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=4, backend="jax")), "backend"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=4, lr=-1.0)), "lr"),
    (lambda x, y, cfg: (x, y, FitConfig(rank=4, pos_weight=0.0)), "pos_weight"),
])
def test_bad_input(change: Callable, match: str) -> None:
    draw, _ = activation_sampler(8)
    x, y = draw(64, 1)
    args = change(x, y, FitConfig(rank=4, backend="numpy"))
    with pytest.raises(ValueError, match=match):
        fit_predictor(*args)


def test_rank_above_n_ff_is_rejected() -> None:
    x = np.zeros((10, 32), np.float32)
    y = np.zeros((10, 6), bool)
    with pytest.raises(ValueError, match=r"1\.\.6 \(min of n_embd 32 and n_ff 6\)"):
        fit_predictor(x, y, FitConfig(rank=7))


def test_import_does_not_load_torch() -> None:
    code = "import sys, kairox.fit; assert 'torch' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env={"PYTHONPATH": str(root / "python"), "PATH": "/usr/bin:/bin"})


def test_torch_backend_needs_torch() -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed")
    draw, _ = activation_sampler(9)
    x, y = draw(64, 1)
    with pytest.raises(ImportError, match="backend='torch' needs PyTorch"):
        fit_predictor(x, y, FitConfig(rank=4, backend="torch"))
    assert fit_predictor(x, y, FitConfig(rank=4, epochs=1, backend="auto")).backend == "numpy"
