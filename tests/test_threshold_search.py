"""Thresholds by perplexity budget (kairox.threshold_search) and the histogram readings
under it (kairox.profile.threshold_for_mass / sparsity_at), against numpy on known samples."""
from __future__ import annotations

import numpy as np
import pytest

from kairox.profile import hist_edges, sparsity_at, threshold_for_mass, threshold_for_sparsity
from kairox.threshold_search import mass_ladder, quantile_ladder, search


def _hist(v: np.ndarray) -> np.ndarray:
    edges = hist_edges()
    k = np.searchsorted(edges, v, side="right") - 1
    k[v == 0] = 0
    return np.bincount(k, minlength=len(edges)).astype(np.int64)


@pytest.fixture(scope="module")
def samples(native) -> list[np.ndarray]:
    """|act| of two layers: one spread evenly (half-normal), one heavy-tailed (lognormal)."""
    rng = np.random.default_rng(0)
    return [np.abs(rng.standard_normal(200_000)) * 0.1, rng.lognormal(-3.0, 1.5, 200_000)]


def test_histogram_readings_match_the_samples(samples: list[np.ndarray]) -> None:
    for v in samples:
        h = _hist(v)
        for target in (0.1, 0.5, 0.9):
            thr, _ = threshold_for_sparsity(h, target)
            assert abs(sparsity_at(h, thr) - target) < 1e-6        # the two readings invert
            assert abs((v <= thr).mean() - target) < 0.01          # and match the sample
        for share in (0.01, 0.05, 0.2):
            thr, sp = threshold_for_mass(h, share)
            assert abs(v[v <= thr].sum() / v.sum() - share) < 0.1 * share + 0.002
            assert abs(sp - (v <= thr).mean()) < 0.01


def test_equal_mass_gives_heavy_tails_more_sparsity(samples: list[np.ndarray]) -> None:
    hist = np.stack([_hist(v) for v in samples])
    thr, sp = mass_ladder(hist).at(0.05)
    assert thr.dtype == np.float32 and thr.shape == (2,)
    # the same 5% of the mass: 44% of a heavy-tailed layer's neurons, 25% of the other's
    assert sp[1] > sp[0] + 0.15, sp


def test_search_finds_the_largest_share_within_budget(samples: list[np.ndarray]) -> None:
    """A perplexity that rises with the mass left out (here: 10 x the mean mass share skipped,
    measured on the samples themselves): the search lands just under the budget."""
    hist = np.stack([_hist(v) for v in samples])
    calls = []

    def ppl_of(thr: np.ndarray) -> tuple[float, float]:
        lost = np.mean([v[v <= t].sum() / v.sum() for v, t in zip(samples, thr)])
        calls.append(thr.copy())
        return 10.0 * (1.0 + 10.0 * lost), float(np.mean([(v <= t).mean() for v, t in zip(samples, thr)]))

    res = search(mass_ladder(hist), ppl_of, 0.2, bisections=5)
    assert calls[0].tolist() == [0.0, 0.0]                  # dense first
    assert res.dense_ppl == 10.0 and res.ppl <= 12.0
    assert 0.015 <= res.share <= 0.02 and res.rise > 0.15   # share 0.02 is the exact answer
    assert res.ladder == "mass" and np.array_equal(res.thresholds, mass_ladder(hist).at(res.share)[0])
    assert all(s.ppl > 12.0 for s in res.steps if s.share > res.share)
    assert len(res.steps) <= 1 + 7 + 5


def test_search_keeps_dense_when_nothing_fits(samples: list[np.ndarray]) -> None:
    hist = np.stack([_hist(v) for v in samples])
    ladder = mass_ladder(hist)
    res = search(ladder, lambda thr: (10.0 + 100.0 * float(np.any(thr > 0)), 0.5), 0.02, bisections=2)
    assert res.share == 0.0 and not res.thresholds.any() and res.ppl == 10.0
    assert res.steps[0].share == ladder.first and all(s.share < ladder.first for s in res.steps[1:])
    with pytest.raises(ValueError, match="budget"):
        search(ladder, lambda thr: (1.0, 0.0), 0.0)


def test_quantile_ladder_is_uniform_sparsity(samples: list[np.ndarray]) -> None:
    hist = np.stack([_hist(v) for v in samples])
    thr, sp = quantile_ladder(hist).at(0.3)
    np.testing.assert_allclose(sp, 0.3)
    for v, t in zip(samples, thr):
        assert abs((v <= t).mean() - 0.3) < 0.01
