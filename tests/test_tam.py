"""The native balancer decision (include/kx-tam.h: host in libllama, one CUDA kernel in
libggml-cuda) against the Python reference (kairox.balancer.LayerBalancer) on recorded
traces: every step's loads, evictions and λ must be the same."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kairox.balancer import BalancerConfig, LayerBalancer

CONFIGS = {
    "fixed": BalancerConfig(lam=0.5, adaptive=False),
    "adaptive": BalancerConfig(),
    "budget": BalancerConfig(max_admit=3),
    "no-eps": BalancerConfig(eps=0.0, lam=0.3, alpha=0.1, alpha_min=0.01),
    "zero-budget": BalancerConfig(max_admit=0, adaptive=False),
}


def drifting_trace(n: int, steps: int, seed: int, phase: int = 40, hot: float = 0.15,
                   ties: bool = False) -> tuple[np.ndarray, list[str]]:
    """bool [steps, n]: a hot set that changes every `phase` steps, background noise and
    one-hit wonders; ties=True activates whole blocks together (many equal scores)."""
    rng = np.random.default_rng(seed)
    act = np.zeros((steps, n), bool)
    for t in range(steps):
        if t % phase == 0:
            hot_set = rng.choice(n, max(1, int(hot * n)), replace=False)
        if ties:
            block = rng.integers(0, 4)
            act[t, block * n // 4:(block + 1) * n // 4] = rng.random() < 0.7
        act[t, hot_set[rng.random(hot_set.size) < 0.8]] = True
        act[t, rng.choice(n, max(1, n // 50), replace=False)] = True  # noise
    stalls = list(rng.choice(["none", "io", "cpu"], steps, p=[0.4, 0.3, 0.3]))
    return act, stalls


def reference(config: BalancerConfig, capacity: int, initial: np.ndarray, act: np.ndarray, stalls: list[str]):
    lb = LayerBalancer(act.shape[1], capacity, config, np.flatnonzero(initial).tolist())
    for t, (a, s) in enumerate(zip(act, stalls)):
        d = lb.step(a, s, t)
        yield sorted(d.admit), d.evict, np.float32(d.lam)


def check_same(config: BalancerConfig, capacity: int, initial: np.ndarray, act: np.ndarray, stalls: list[str],
               device: str) -> float | None:
    """Replays natively and compares each step; a trace with a load budget of 0 must move nothing."""
    from kairox.tam import replay_native
    got = replay_native(config, capacity, initial, act, stalls, device)
    n_moves = 0
    for t, (adm, ev, lam) in enumerate(reference(config, capacity, initial, act, stalls)):
        assert np.flatnonzero(got.admit[t]).tolist() == adm, f"step {t}: loads differ"
        assert np.flatnonzero(got.evict[t]).tolist() == ev, f"step {t}: evictions differ"
        assert got.lam[t] == lam, f"step {t}: λ {got.lam[t]} != {lam}"
        n_moves += len(adm) + len(ev)
    # the trace exercised admission, not only the steady state (a zero load budget moves nothing)
    assert (n_moves > 0) == (config.max_admit != 0)
    return got.step_us


CASES = [  # (n groups, capacity, steps, seed, ties)
    (64, 16, 120, 0, False),
    (300, 60, 200, 1, False),
    (300, 60, 200, 2, True),
    (1000, 250, 60, 3, True),
]


def _run(device: str) -> list[float | None]:
    times = []
    for name, cfg in CONFIGS.items():
        for n, cap, steps, seed, ties in CASES:
            act, stalls = drifting_trace(n, steps, seed, ties=ties)
            initial = np.zeros(n, bool)
            if seed % 2:  # a static plan's residents at start (fewer than the capacity)
                initial[np.random.default_rng(seed).choice(n, cap // 2, replace=False)] = True
            if name == "zero-budget":  # nothing may load: the residents must stay
                initial[:] = False
                initial[:cap] = True
            times.append(check_same(cfg, cap, initial, act, stalls, device))
    return times


def test_host_decisions_match_the_reference(native: Path) -> None:
    _run("cpu")


def test_host_decisions_match_on_a_70b_layer(native: Path) -> None:
    # single-neuron groups of a 70B FFN layer: the size the GPU kernel walks in passes
    act, stalls = drifting_trace(28672, 12, 7, phase=4, hot=0.1)
    check_same(BalancerConfig(max_admit=512), 7000, np.zeros(28672, bool), act, stalls, "cpu")


def test_bad_arguments_are_refused(native: Path) -> None:
    from kairox.tam import replay_native
    act = np.zeros((2, 8), bool)
    with pytest.raises(RuntimeError, match="capacity 9 of 8"):
        replay_native(BalancerConfig(), 9, np.zeros(8, bool), act, ["none"] * 2)
    with pytest.raises(ValueError, match="one entry per step"):
        replay_native(BalancerConfig(), 4, np.zeros(8, bool), act, ["none"])


def _need_gpu() -> None:
    from kairox._native import has_gpu
    if not has_gpu():
        pytest.skip("no GPU: the CUDA decision kernel is compile-checked only (test_cuda_sources)")


def test_gpu_decisions_match_the_reference(native: Path) -> None:
    _need_gpu()
    _run("cuda")


def test_gpu_decisions_match_on_a_70b_layer(native: Path, record_property) -> None:
    _need_gpu()
    act, stalls = drifting_trace(28672, 12, 7, phase=4, hot=0.1)
    us = check_same(BalancerConfig(max_admit=512), 7000, np.zeros(28672, bool), act, stalls, "cuda")
    record_property("step_us", us)
    print(f"GPU decision for 28672 groups: {us:.1f} µs per step")
