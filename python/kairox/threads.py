"""Load-aware decode threads: the CPU's thread count follows what the machine gives it.

The CPU part of a decode step (host FFN rows, host tensors) is split across `n` threads that
meet at a barrier after every op. When other processes take some of the cores, a thread that
is descheduled holds up all the others at each barrier, so a step with as many threads as
cores slows by far more than the share of CPU taken (KB-7B SiLU F16 at 7 GiB on a 16-core
host, a stress on 10 cores: +1141% per token with 16 threads, +117% with 8;
bench/results/KB-7B-silu-f16-h200/migrate/). Fewer threads than cores then decode faster.

The controller times every single-token decode (the decode's wall time; prompt batches are
not counted) in windows of `window` decodes, and compares windows by their mean (the decode
rate: a load shows as descheduled steps of several times the usual length, which a median
would not see). It holds its count while the window's mean stays within `drift` of the one it
held at; when two windows in a row moved by more (a load started or ended; one noisy window
does not count), it probes: each candidate count (n, 3n/4, n/2, n/4, most first) runs one
window, and the fastest wins, the largest count within 3% of the fastest mean on a tie, so an
idle machine keeps all its threads. A probe that kept the count it started from (a machine
whose speed wanders by itself: a VM's neighbours) makes the next move wait `quiet` decodes,
4 windows at first, twice as long after each such probe (at most 8 x recheck); a probe that
changed the count ends the wait. Holding fewer threads than `n`, after `recheck` decodes
it peeks: one window at `n` (a load that ended leaves the held count's time where it was, within
the drift); if `n` is as fast as the held count, a probe follows, else the held count comes back
and the next peek waits twice as long (at most 8 x recheck), so a load that stays costs one
window in many. The first decode after each change is not timed (the thread pool changes
size). An idle machine pays nothing: no probe runs until a window's median moved.

This is the reference the runtime's C++ (llama/kx-threads.cpp) is checked against, count for
count, on the same series of decode times (tests/test_threads.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HOLD, PROBE, PEEK = 0, 1, 2
MAX_WAIT = 8  # a peek that lost waits twice as long as the last, up to this many times recheck
TIE = 1.03  # a count within this factor of the fastest median counts as fast as it


@dataclass(frozen=True)
class ThreadsConfig:
    window: int = 8       # decodes timed per measurement (their mean)
    drift: float = 0.15   # two windows in a row whose mean moved by more than this share: probe
    recheck: int = 256    # holding fewer threads than the maximum, probe again after this many decodes

    def __post_init__(self) -> None:
        if self.window < 1 or self.recheck < self.window:
            raise ValueError(f"window must be >= 1 and recheck >= window, got {self.window}, {self.recheck}")
        if not 0.0 < self.drift < 1.0:
            raise ValueError(f"drift must be in (0, 1), got {self.drift}")

    def native(self) -> Any:
        """The runtime's struct kx_threads_config for this configuration."""
        from .capi import ThreadsParams
        return ThreadsParams(self.window, self.drift, self.recheck)


def candidates(n_max: int) -> list[int]:
    """The counts a probe tries, most first: n, 3n/4, n/2, n/4 (distinct, >= 1)."""
    if n_max < 1:
        raise ValueError(f"the thread count must be >= 1, got {n_max}")
    return sorted({n_max, max(1, n_max * 3 // 4), max(1, n_max // 2), max(1, n_max // 4)}, reverse=True)


@dataclass
class ThreadsPolicy:
    n_max: int
    cfg: ThreadsConfig = field(default_factory=ThreadsConfig)
    n: int = 0                     # the count the next decode runs with
    state: int = HOLD
    base: float | None = None      # the held count's mean when it was chosen (None: not measured yet)
    moved: int = 0                 # windows in a row whose mean moved by more than the drift
    held: int = 0                  # decodes timed at the held count since it was chosen (or peeked)
    wait: int = 0                  # decodes the next peek waits for (recheck, doubled by each lost peek)
    kept: int = 0                  # the held count while a peek or probe runs
    quiet: int = 0                 # decodes held before a move may probe (grows with fruitless probes)
    skip: int = 0                  # decodes still not timed after a change
    probes: int = 0                # probes run so far
    samples: list[float] = field(default_factory=list)
    tried: dict[int, float] = field(default_factory=dict)  # a probe's means by count

    def __post_init__(self) -> None:
        self.cands = candidates(self.n_max)
        self.n = self.n_max
        self.wait = self.cfg.recheck

    def _set(self, n: int) -> None:
        if n != self.n:
            self.skip = 1
        self.n = n

    def step(self, seconds: float) -> int:
        """One single-token decode's wall time (at the current count); returns the count the
        next decode runs with."""
        if self.skip > 0:
            self.skip -= 1
            return self.n
        self.samples.append(seconds)
        if len(self.samples) < self.cfg.window:
            return self.n
        mean = 0.0
        for x in self.samples:  # summed in order, as the C++ does
            mean += x
        mean /= len(self.samples)
        self.samples = []
        if self.state == HOLD:
            self.held += self.cfg.window
            if self.base is None:
                self.base = mean
            elif abs(mean - self.base) > self.cfg.drift * self.base:
                self.moved += 1
                if self.moved >= 2 and self.held >= self.quiet:
                    self.state, self.tried, self.moved, self.kept = PROBE, {}, 0, self.n
                    self.probes += 1
                    self._set(self.cands[0])
            else:
                self.moved = 0
                if self.n < self.n_max and self.held >= self.wait:
                    self.state, self.kept = PEEK, self.n
                    self._set(self.n_max)
            return self.n
        if self.state == PEEK:
            if mean <= self.base * TIE:  # all the threads are as fast again: which count is fastest now
                self.state, self.tried = PROBE, {self.n: mean}
                self.probes += 1
                self._set(self.cands[1])
            else:
                self.state, self.held = HOLD, 0
                self.wait = min(2 * self.wait, MAX_WAIT * self.cfg.recheck)
                self._set(self.kept)
            return self.n
        self.tried[self.n] = mean
        left = [c for c in self.cands if c not in self.tried]
        if left:
            self._set(left[0])
            return self.n
        fastest = min(self.tried.values())
        best = max(c for c, t in self.tried.items() if t <= fastest * TIE)
        self.state, self.base, self.held, self.wait = HOLD, self.tried[best], 0, self.cfg.recheck
        self.quiet = min(max(2 * self.quiet, 4 * self.cfg.window), MAX_WAIT * self.cfg.recheck) \
            if best == self.kept else 0
        self._set(best)
        return self.n

    def run(self, times: list[float]) -> list[int]:
        """The count after each of `times` (tests: the C++ runs the same series)."""
        return [self.step(t) for t in times]
