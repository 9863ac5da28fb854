"""The balancer's back-off: it runs only while it measurably pays.

A dynamic policy costs every token something (its decisions, its reloads) and gains only
where the workload drifts. The back-off measures both sides on the run itself: it lets the
balancer run for `window` decoded tokens, then holds it for `window` tokens (on the static
split, below), and compares the median token times. The balancer keeps running only when
its median is below the held one by `margin`; either way the outcome holds for a while
before the next probe, twice as long each time the same outcome repeats (up to
window * 2**max_doubling tokens), so a run that settles pays little for the probing. The
first `settle` tokens after each switch are not measured (a switch rebuilds the graph).

Held means the static split, exactly: at each switch from running to held the runtime puts
back the residents the balancer started from and restarts the policy's state there (scores,
λ), so the held probe phase measures the balancer against the static split (not against
the placement its own probe left, which on a stationary workload is worse), a lost probe
costs only its own tokens, and a resumed balancer starts from the static split as a new one
would (`Backoff.home`: the token after which that happens).

This is the reference the runtime's C++ (llama/kx-backoff.cpp) is checked against, decision
for decision, on the same series of token times (tests/test_backoff.py).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

PROBE_ON, PROBE_OFF, HOLD = 0, 1, 2


@dataclass(frozen=True)
class BackoffConfig:
    window: int = 16        # tokens measured in each probe phase; 0: never back off
    settle: int = 2         # tokens after a switch not measured
    margin: float = 0.0     # the balancer must be this much faster (share of the held median)
    max_doubling: int = 4   # a repeated outcome holds window * 2**k tokens, k <= max_doubling

    def __post_init__(self) -> None:
        if self.window < 0 or self.settle < 0 or self.max_doubling < 0:
            raise ValueError(f"window, settle and max_doubling must be >= 0, got {self.window}, "
                             f"{self.settle}, {self.max_doubling}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.max_doubling > 30:
            raise ValueError(f"max_doubling must be <= 30, got {self.max_doubling}")

    def native(self) -> Any:
        """The runtime's struct kx_backoff_config for this configuration."""
        from .capi import BackoffParams
        return BackoffParams(self.window, self.settle, self.margin, self.max_doubling)


@dataclass
class Backoff:
    """Feed it each decoded token's seconds (`step`); it says whether the balancer runs for
    the next token."""
    cfg: BackoffConfig
    on: bool = True
    phase: int = PROBE_ON
    n: int = 0
    streak: int = 0
    last_won: bool | None = None
    hold: int = 0
    samples_on: list[float] = field(default_factory=list)
    samples_off: list[float] = field(default_factory=list)
    home: bool = False      # the last step switched it from running to held (the static split back)

    def step(self, seconds: float) -> bool:
        was = self.on
        if self.cfg.window == 0:
            return True
        c = self.cfg
        self.n += 1
        if self.phase == PROBE_ON:
            if self.n > c.settle:
                self.samples_on.append(float(seconds))
            if self.n == c.settle + c.window:
                self.phase, self.n, self.on = PROBE_OFF, 0, False
        elif self.phase == PROBE_OFF:
            if self.n > c.settle:
                self.samples_off.append(float(seconds))
            if self.n == c.settle + c.window:
                # the margin as the runtime holds it (a float)
                margin = float(np.float32(c.margin))
                won = statistics.median(self.samples_on) < statistics.median(self.samples_off) * (1.0 - margin)
                self.streak = self.streak + 1 if won == self.last_won else 0
                self.last_won = won
                self.hold = c.window << min(self.streak, c.max_doubling)
                self.phase, self.n, self.on = HOLD, 0, won
                self.samples_on.clear()
                self.samples_off.clear()
        elif self.n == self.hold:
            self.phase, self.n, self.on = PROBE_ON, 0, True
        self.home = was and not self.on
        return self.on


def run_backoff(cfg: BackoffConfig, seconds: Iterable[float]) -> list[bool]:
    """Whether the balancer runs after each token of a series of token times."""
    b = Backoff(cfg)
    return [b.step(t) for t in seconds]
