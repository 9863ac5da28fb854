"""The sketch predictor: exactness on low-rank gates, recall on noisy ones, its helpers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kairox.pack import predictor_scores
from kairox.predictor import (default_rank, recall_and_overprediction,
                              sketch_predictor)


def low_rank_gate(rng: np.random.Generator, n_ff: int, n_embd: int, rank: int,
                  noise: float = 0.0) -> np.ndarray:
    """A gate of entry std ~0.02 that is exactly rank `rank`, plus `noise` x that std dense."""
    u = rng.standard_normal((n_ff, rank))
    v = rng.standard_normal((rank, n_embd))
    w = u @ v * (0.02 / math.sqrt(rank)) + rng.standard_normal((n_ff, n_embd)) * (0.02 * noise)
    return w.astype(np.float32)


def ffn_inputs(rng: np.random.Generator, n_tokens: int, norm_w: np.ndarray) -> np.ndarray:
    """x = x̂ ⊙ w for isotropic x̂ normalised to RMS exactly 1 per token."""
    xh = rng.standard_normal((n_tokens, norm_w.size))
    xh /= np.sqrt(np.mean(xh * xh, axis=1, keepdims=True))
    return (xh * norm_w).astype(np.float32)


@pytest.mark.parametrize("n_ff,n_embd,rank,method", [
    (96, 40, 6, "exact"), (40, 96, 6, "exact"), (1024, 512, 16, "randomized"), (1024, 512, 16, "auto"),
])
def test_exact_on_a_low_rank_gate(n_ff: int, n_embd: int, rank: int, method: str) -> None:
    rng = np.random.default_rng(0)
    w_gate = low_rank_gate(rng, n_ff, n_embd, rank)
    norm_w = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    norm_w[3] = 0.0  # a dead channel: its x is always 0, and its 1/w must not blow up A
    a, b, c = sketch_predictor(w_gate, norm_w, rank, margin=0.0, method=method)
    assert np.all(np.isfinite(a)) and np.all(a[:, 3] == 0)
    np.testing.assert_array_equal(c, np.zeros(n_ff, np.float32))
    x = ffn_inputs(rng, 64, norm_w)
    g = x @ w_gate.T
    scores = predictor_scores(a, b, c, x)
    np.testing.assert_allclose(scores, g, rtol=0, atol=1e-4 * np.abs(g).max())
    recall, over = recall_and_overprediction(scores > 0, g > 0)
    assert recall == 1.0 and over == pytest.approx(1.0, abs=0.01)
    # with a margin, the exact fit leaves no error to cover: c stays ~0
    _, _, c3 = sketch_predictor(w_gate, norm_w, rank, margin=3.0, method=method)
    assert np.abs(c3).max() < 1e-3 * np.abs(g).std()


def test_bias_is_margin_times_residual_norm() -> None:
    rng = np.random.default_rng(1)
    w_gate = low_rank_gate(rng, 80, 48, 5, noise=0.3)
    norm_w = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    a, b, c = sketch_predictor(w_gate, norm_w, 5, margin=2.5, method="exact")
    g = w_gate.astype(np.float64) * norm_w
    _, _, vt = np.linalg.svd(g)
    v = vt[:5].T
    rho = np.linalg.norm(g - g @ v @ v.T, axis=1)
    np.testing.assert_allclose(c, 2.5 * rho, rtol=1e-3)
    np.testing.assert_allclose(b @ a, (g @ v @ v.T) / norm_w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_ff,n_embd,rank", [(512, 128, 8), (2048, 768, 48)])
def test_recall_on_a_noisy_low_rank_gate(n_ff: int, n_embd: int, rank: int) -> None:
    rng = np.random.default_rng(2)
    w_gate = low_rank_gate(rng, n_ff, n_embd, rank, noise=0.2)
    norm_w = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    a, b, c = sketch_predictor(w_gate, norm_w, rank, margin=3.0)
    x = ffn_inputs(rng, 256, norm_w)
    truth = x @ w_gate.T > 0
    recall, over = recall_and_overprediction(predictor_scores(a, b, c, x) > 0, truth)
    assert recall >= 0.99
    assert over < 1.5  # ~50% of neurons fire here, so at most all of them can be predicted
    # margin 0 is an unbiased guess: it misses far more
    a0, b0, c0 = sketch_predictor(w_gate, norm_w, rank, margin=0.0)
    assert recall_and_overprediction(predictor_scores(a0, b0, c0, x) > 0, truth)[0] < recall


def test_shapes_dtypes_and_determinism() -> None:
    rng = np.random.default_rng(3)
    w_gate = rng.standard_normal((300, 260)).astype(np.float16)  # any float input is accepted
    norm_w = np.ones(260, np.float64)
    a, b, c = sketch_predictor(w_gate, norm_w, 7)
    assert (a.shape, b.shape, c.shape) == ((7, 260), (300, 7), (300,))
    assert a.dtype == b.dtype == c.dtype == np.float32
    assert np.all(c >= 0)
    a2, b2, c2 = sketch_predictor(w_gate, norm_w, 7)
    assert np.array_equal(a, a2) and np.array_equal(b, b2) and np.array_equal(c, c2)
    # one token or a batch
    x = rng.standard_normal(260).astype(np.float32)
    assert predictor_scores(a, b, c, x).shape == (300,)
    np.testing.assert_allclose(predictor_scores(a, b, c, x[None])[0], predictor_scores(a, b, c, x),
                               rtol=1e-6)


def test_default_rank() -> None:
    assert default_rank(4096, 11008) == 256
    assert default_rank(1024, 2816) == 64
    assert default_rank(64, 256) == 8      # at least 8
    assert default_rank(64, 5) == 5        # at most min(n_ff, n_embd)


@pytest.mark.parametrize("kwargs,message", [
    ({"rank": 0}, r"rank must be an integer in 1\.\.20"),
    ({"rank": 21}, r"rank must be an integer in 1\.\.20"),
    ({"rank": 2.0}, "rank must be an integer"),
    ({"rank": True}, "rank must be an integer"),
    ({"margin": -1.0}, "margin must be"),
    ({"margin": math.nan}, "margin must be"),
    ({"method": "qr"}, "method must be one of"),
    ({"norm_w": np.ones(31)}, r"norm_w must have shape \(20,\)"),
    ({"w_gate": np.ones(20)}, "w_gate must be 2-D"),
    ({"w_gate": np.full((40, 20), np.inf)}, "must be finite"),
])
def test_errors(kwargs: dict, message: str) -> None:
    args = {"w_gate": np.ones((40, 20), np.float32), "norm_w": np.ones(20, np.float32), "rank": 4,
            **kwargs}
    with pytest.raises(ValueError, match=message):
        sketch_predictor(**args)


def test_recall_and_overprediction() -> None:
    true = np.array([[1, 1, 0, 0], [0, 1, 0, 0]], bool)
    assert recall_and_overprediction(true, true) == (1.0, 1.0)
    pred = np.array([[1, 0, 1, 1], [1, 1, 0, 0]], bool)
    assert recall_and_overprediction(pred, true) == (2 / 3, 5 / 3)
    nothing = np.zeros((2, 4), bool)
    assert recall_and_overprediction(nothing, true) == (0.0, 0.0)
    assert recall_and_overprediction(nothing, nothing) == (1.0, 1.0)
    assert recall_and_overprediction(pred, nothing) == (1.0, math.inf)
    with pytest.raises(ValueError, match="differs"):
        recall_and_overprediction(pred, true[0])
    with pytest.raises(ValueError, match="channels"):
        predictor_scores(np.ones((2, 4)), np.ones((3, 2)), np.zeros(3), np.ones(5))
