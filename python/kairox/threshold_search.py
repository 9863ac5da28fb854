"""Thresholds of gated (SiLU/GELU) models chosen by quality: a perplexity budget.

A gated model has no exact zeros: its sparse modes skip neuron i of a token when
|act(gate_i)| <= t_l, a declared approximation (threshold mode, and what the predictor is
trained to list). A fixed sparsity per layer (e.g. CATS's 50%) does not bound what that
costs: on Gemma 3 270M, 50% costs +28% perplexity. Here the budget is the bound: the largest
thresholds whose perplexity on held-out text rises by at most `budget` over dense.

Per layer, the threshold leaves out the same share e of the layer's activation mass (the
|act| values <= t_l carry share e of the layer's total |act|; kairox.profile.threshold_for_mass),
so every layer gives up about the same relative FFN output, and layers whose activations
are concentrated in few neurons get more sparsity than layers where they are spread evenly.
The search brackets e by doubling from `FIRST_SHARE`, then bisects it geometrically, each
step one perplexity measurement (`ppl_of`: in `kairox prepare`, the in-process emulator of
kairox.quality on the held-out segments, which the tests hold equal to the runtime's
threshold mode).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .profile import threshold_for_mass, threshold_for_sparsity

DEFAULT_BUDGET = 0.02   # perplexity may rise by 2% over dense on held-out text


@dataclass(frozen=True)
class Ladder:
    """One knob from dense to very sparse: `at(level)` gives per layer (thresholds, expected
    sparsity); the search doubles the level from `first` until past the budget or `last`."""
    name: str
    at: Callable[[float], tuple[np.ndarray, np.ndarray]]
    first: float
    last: float


def mass_ladder(hist: np.ndarray) -> Ladder:
    """Level e: every layer leaves out the share e of its |act| mass."""
    return Ladder("mass", lambda e: _per_layer(hist, threshold_for_mass, e), 0.005, 0.64)


def quantile_ladder(hist: np.ndarray) -> Ladder:
    """Level s: every layer skips the share s of its neurons (CATS's uniform sparsity)."""
    return Ladder("quantile", lambda q: _per_layer(hist, threshold_for_sparsity, q), 0.05, 0.8)


def _per_layer(hist: np.ndarray, fn: Callable, level: float) -> tuple[np.ndarray, np.ndarray]:
    pairs = [fn(hist[il], level) for il in range(len(hist))]
    return np.array([p[0] for p in pairs], np.float32), np.array([p[1] for p in pairs], np.float64)


@dataclass
class SearchStep:
    share: float            # the ladder's level
    ppl: float
    sparsity: float         # mean over layers of the share of neurons skipped (measured)

    def to_json(self) -> dict[str, float]:
        return {"share": self.share, "ppl": self.ppl, "sparsity": self.sparsity}


@dataclass
class SearchResult:
    budget: float
    dense_ppl: float
    ladder: str
    share: float                    # the chosen level (0: no threshold fits the budget)
    thresholds: np.ndarray          # float32 [n_layer]
    sparsity: np.ndarray            # float64 [n_layer], expected from the histograms
    steps: list[SearchStep] = field(default_factory=list)

    @property
    def ppl(self) -> float:
        """The chosen thresholds' measured perplexity."""
        return next((s.ppl for s in self.steps if s.share == self.share), self.dense_ppl)

    @property
    def rise(self) -> float:
        return self.ppl / self.dense_ppl - 1.0

    def to_json(self) -> dict:
        return {"budget": self.budget, "dense_ppl": self.dense_ppl, "ladder": self.ladder, "share": self.share,
                "ppl": self.ppl,
                "rise": self.rise, "thresholds": self.thresholds.tolist(), "sparsity": self.sparsity.tolist(),
                "steps": [s.to_json() for s in self.steps]}


def search(ladder: Ladder, ppl_of: Callable[[np.ndarray], tuple[float, float]], budget: float = DEFAULT_BUDGET,
           *, bisections: int = 4, say: Callable[[str], None] = lambda m: None) -> SearchResult:
    """The highest level of `ladder` whose thresholds keep perplexity within (1 + budget) x dense.

    ppl_of(thresholds) -> (perplexity, mean measured sparsity); thresholds of 0 measure dense.
    Perplexity rises with the level (more is skipped); the search assumes so and keeps the
    best level seen within budget, so a non-monotone step can only make it cautious."""
    if not 0.0 < budget < 1.0:
        raise ValueError(f"the perplexity budget must be in (0, 1), got {budget}")
    zero, _ = ladder.at(ladder.first)
    dense, _ = ppl_of(np.zeros_like(zero))
    limit = dense * (1.0 + budget)
    say(f"thresholds by perplexity budget ({ladder.name}): dense {dense:.4f}, limit {limit:.4f} (+{budget:.1%})")
    steps: list[SearchStep] = []

    def within(level: float) -> bool:
        thr, _ = ladder.at(level)
        ppl, sp = ppl_of(thr)
        steps.append(SearchStep(level, ppl, sp))
        say(f"  {ladder.name} {level:.4f}: perplexity {ppl:.4f} ({ppl / dense - 1.0:+.2%}), sparsity {sp:.1%}")
        return ppl <= limit

    ok, bad = 0.0, None
    level = ladder.first
    while level <= ladder.last:
        if not within(level):
            bad = level
            break
        ok, level = level, level * 2.0
    if bad is not None:
        lo = ok if ok > 0 else bad / 2.0 ** bisections  # nothing fit yet: bisect below the first
        hi = bad
        for _ in range(bisections):
            mid = math.sqrt(lo * hi)
            if within(mid):
                ok = lo = mid
            else:
                hi = mid
    thr, sparsity = ladder.at(ok) if ok > 0 else (np.zeros_like(zero), np.zeros(len(zero)))
    res = SearchResult(budget, dense, ladder.name, ok, thr, sparsity, steps)
    say(f"chose {ladder.name} {ok:.4f}: perplexity {res.ppl:.4f} ({res.rise:+.2%}), "
        f"expected sparsity {sparsity.mean():.1%} (layers {sparsity.min():.0%}-{sparsity.max():.0%})")
    return res


__all__ = ["DEFAULT_BUDGET", "Ladder", "SearchResult", "SearchStep", "mass_ladder", "quantile_ladder", "search"]
