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

A lost probe is not repeated while nothing has changed (`drift`): the held tokens also give
the static split's hit rate (the share of the decode's active neurons that its slots held),
and after a lost probe the next one waits, beyond its hold, until the median hit rate of the
last `window` held tokens has fallen more than `drift` below the one measured in the lost
probe's held phase: the requests moved to text the static split covers worse, where a
dynamic cache can gain (checked at the end of each hold length, on its last window; at most
four holds pass without a probe). On a stationary workload
the probing then stops after the first loss; a change of domain probes again. (The hit rate
of one synthetic workload's static split: per 16 tokens 0.624-0.648 on one domain; 0.56,
0.64 and 0.69 on three: bench/results/KB-350M-cpu/backoff-drift/.)

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
    drift: float = 0.03     # a lost probe repeats only once the static split's hit rate fell by this; 0: on schedule

    def __post_init__(self) -> None:
        if self.window < 0 or self.settle < 0 or self.max_doubling < 0:
            raise ValueError(f"window, settle and max_doubling must be >= 0, got {self.window}, "
                             f"{self.settle}, {self.max_doubling}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not 0.0 <= self.drift < 1.0:
            raise ValueError(f"drift must be in [0, 1), got {self.drift}")
        if self.max_doubling > 30:
            raise ValueError(f"max_doubling must be <= 30, got {self.max_doubling}")

    def native(self) -> Any:
        """The runtime's struct kx_backoff_config for this configuration."""
        from .capi import BackoffParams
        return BackoffParams(self.window, self.settle, self.margin, self.max_doubling, self.drift)


@dataclass
class Backoff:
    """Feed it each decoded token's seconds and, where `wants_hit`, the static split's hit
    rate on it (`step`); it says whether the balancer runs for the next token."""
    cfg: BackoffConfig
    on: bool = True
    phase: int = PROBE_ON
    n: int = 0
    streak: int = 0
    last_won: bool | None = None
    hold: int = 0
    samples_on: list[float] = field(default_factory=list)
    samples_off: list[float] = field(default_factory=list)
    hits_off: list[float] = field(default_factory=list)
    lost_hit: float | None = None   # the static split's hit rate in the last lost probe (drift gate)
    recent: list[float] = field(default_factory=list)  # the hit rates of the hold's last window tokens
    home: bool = False      # the last step switched it from running to held (the static split back)

    @property
    def wants_hit(self) -> bool:
        """Whether the next token's hit rate is used (the runtime counts it only then)."""
        c = self.cfg
        return c.window > 0 and c.drift > 0 and (
            self.phase == PROBE_OFF or (self.phase == HOLD and self.lost_hit is not None and self._checked(self.n + 1)))

    def _checked(self, n: int) -> bool:
        # a gated hold is checked at the end of each hold length, on the window before it
        m = n % self.hold
        return m == 0 or m > self.hold - self.cfg.window

    def step(self, seconds: float, hit: float | None = None) -> bool:
        """One decoded token (it ran with the previous answer): its seconds and, held, the
        static split's hit rate on it (None: not counted)."""
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
                if hit is not None:
                    self.hits_off.append(float(hit))
            if self.n == c.settle + c.window:
                # the margin as the runtime holds it (a float)
                margin = float(np.float32(c.margin))
                won = statistics.median(self.samples_on) < statistics.median(self.samples_off) * (1.0 - margin)
                self.streak = self.streak + 1 if won == self.last_won else 0
                self.last_won = won
                self.hold = c.window << min(self.streak, c.max_doubling)
                gate = not won and c.drift > 0 and len(self.hits_off) > 0
                self.lost_hit = statistics.median(self.hits_off) if gate else None
                self.phase, self.n, self.on = HOLD, 0, won
                self.samples_on.clear()
                self.samples_off.clear()
                self.hits_off.clear()
                self.recent.clear()
        else:
            if self.lost_hit is not None and hit is not None and self._checked(self.n):
                self.recent = (self.recent + [float(hit)])[-c.window:]
            if self.n % self.hold == 0 and (self.lost_hit is None or self.n == 4 * self.hold or self._drifted()):
                self.phase, self.n, self.on = PROBE_ON, 0, True
        self.home = was and not self.on
        return self.on

    def _drifted(self) -> bool:
        # the hit rate as the runtime holds it (floats): a window's median below the lost probe's
        drift = float(np.float32(self.cfg.drift))
        return (len(self.recent) == self.cfg.window
                and statistics.median(self.recent) < self.lost_hit - drift)


def run_backoff(cfg: BackoffConfig, seconds: Iterable[float], hits: Iterable[float] | None = None) -> list[bool]:
    """Whether the balancer runs after each token of a series of token times (and of the
    static split's hit rates, given where the back-off asks for one)."""
    b = Backoff(cfg)
    hit_list = list(hits) if hits is not None else None
    return [b.step(t, hit_list[i] if hit_list is not None and b.wants_hit else None) for i, t in enumerate(seconds)]
