"""DynamicInfer's two-level neuron cache (kairox.neuron_cache) and the offline comparison of
cache policies on predicted lists: small hand-checked cases and invariants on random ones."""
from __future__ import annotations

import numpy as np
import pytest

from kairox.balancer import BalancerConfig, PrefetchLayer, TraceStep
from kairox.neuron_cache import CacheConfig, TwoLevelLayer, predicted_lists, replay_listed


def mask(n: int, ids) -> np.ndarray:
    m = np.zeros(n, bool)
    m[list(ids)] = True
    return m


def test_a_listed_group_displaces_the_least_important_unpinned_resident() -> None:
    # f: group 0 most frequent (pinned at macro 0.5 of 2 slots), group 1 next, group 2 rare
    f = [0.9, 0.5, 0.1, 0.0, 0.0]
    c = TwoLevelLayer(5, 2, f, [0, 1], CacheConfig(lam=0.5, macro=0.5))
    assert c.pinned().tolist() == [True, False, False, False, False]
    d = c.step(mask(5, [3]))
    # v(3) = 1 beats v(1) = 0.25; the pinned group 0 stays whatever its v
    assert (d.admit, d.evict) == ([3], [1])
    assert c.residents() == [0, 3]


def test_a_tie_keeps_the_resident_and_nothing_beats_a_listed_resident() -> None:
    c = TwoLevelLayer(4, 1, [0.0, 0.0, 0.0, 0.0], [0], CacheConfig(lam=0.5, macro=0.0))
    d = c.step(mask(4, [0, 1]))            # both listed: v 1 = 1, the resident stays
    assert (d.admit, d.evict) == ([], [])
    d = c.step(mask(4, []))                # nothing listed: no load
    assert (d.admit, d.evict) == ([], [])


def test_the_window_caps_the_loads_best_first() -> None:
    f = np.array([0.0, 0.0, 0.3, 0.2, 0.1, 0.0], np.float32)
    c = TwoLevelLayer(6, 3, f, [], CacheConfig(lam=1.0, macro=0.0, window=2))
    d = c.step(mask(6, [2, 3, 4, 5]))
    assert d.admit == [2, 3]               # v = 1 + f: the two of highest f
    d = c.step(mask(6, [2, 3, 4, 5]))
    assert d.admit == [4] and d.evict == []  # one free slot left


def test_history_frequency_moves_as_the_momentum_score() -> None:
    cfg = CacheConfig(half_life=2.0, macro=0.0)
    c = TwoLevelLayer(3, 1, [0.5, 0.0, 1.0], [], cfg)
    c.step(mask(3, [1]))
    b = np.float32(0.5 ** 0.5)
    want = (b * np.array([0.5, 0.0, 1.0], np.float32)).astype(np.float32) + (np.float32(1) - b) * np.float32([0, 1, 0])
    assert np.array_equal(c.f, want.astype(np.float32))


def test_invariants_on_random_steps() -> None:
    rng = np.random.default_rng(0)
    n, cap = 64, 16
    for macro in (0.0, 0.5, 1.0):
        c = TwoLevelLayer(n, cap, rng.random(n), rng.choice(n, cap, replace=False),
                          CacheConfig(lam=0.5, macro=macro, half_life=8, window=5))
        for _ in range(200):
            pin = c.pinned()
            before = c.resident.copy()
            d = c.step(rng.random(n) < 0.2)
            assert len(d.admit) <= 5 and c.resident.sum() <= cap
            assert not (set(d.evict) & set(np.flatnonzero(pin)))       # pinned never leave
            assert all(not before[g] for g in d.admit) and all(before[g] for g in d.evict)
            assert np.all((c.f >= 0) & (c.f <= 1))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        TwoLevelLayer(4, 5, np.zeros(4))
    with pytest.raises(ValueError, match="freq"):
        TwoLevelLayer(4, 2, [0, 0, np.nan, 0])
    with pytest.raises(ValueError, match="macro"):
        CacheConfig(macro=1.5)
    with pytest.raises(ValueError, match="listed"):
        TwoLevelLayer(4, 2, np.zeros(4)).step(np.zeros(3, bool))


def trace_of(n: int, steps: int, layers: int = 2, seed: int = 1) -> list[TraceStep]:
    """Drifting activity: each phase of 40 tokens draws from its own hot set."""
    rng = np.random.default_rng(seed)
    out, hot = [], np.arange(n // 4)
    for t in range(steps):
        if t % 40 == 0:
            hot = rng.permutation(n)[:n // 4]
        for il in range(layers):
            act = np.unique(np.concatenate([rng.choice(hot, 6, replace=False), rng.choice(n, 2)]))
            out.append(TraceStep(t, il, tuple(act.tolist())))
    return out


def test_policies_on_a_drifting_trace_rank_as_the_design_says() -> None:
    n, cap = 96, 24
    trace = trace_of(n, 160)
    freq = {il: np.full(n, 0.05, np.float32) for il in range(2)}
    initial = {il: list(range(cap)) for il in range(2)}
    oracle = predicted_lists(trace, n)
    assert all(np.array_equal(m, mask(n, s.active)) for m, s in zip(oracle, trace))
    run = lambda pol, cfg=None, w=8: replay_listed(trace, oracle, n, cap, initial, pol, cfg, freq, w)  # noqa: E731
    static = run("static")
    # static: the share is the listed neurons among the fixed residents
    want = sum(len(set(s.active) & set(range(cap))) for s in trace) / sum(len(s.active) for s in trace)
    assert static.share == pytest.approx(want) and static.loads == 0 and static.tokens == 160
    tam = run("tam", BalancerConfig(lam=0.5, adaptive=False))
    ahead = run("tam-ahead", BalancerConfig(lam=0.5, adaptive=False))
    micro = run("two-level", CacheConfig(lam=0.5, macro=0.0))
    assert static.share < tam.share < micro.share and ahead.share < micro.share
    # loads one layer ahead serve the step that listed them: with a window as large as a
    # list, the oracle's lists are all on the GPU once the slots have room
    wide = run("two-level", CacheConfig(lam=0.5, macro=0.0), w=None)
    assert wide.share > 0.95
    # every listed group admitted (ε = −1) is the micro level for the momentum policy too
    every = run("tam-ahead", BalancerConfig(lam=0.5, eps=-1.0, adaptive=False), w=None)
    assert every.share > 0.95 > run("tam-ahead", BalancerConfig(lam=0.5, adaptive=False), w=None).share


def test_a_noisy_predictor_keeps_about_its_recall_and_precision() -> None:
    n = 400
    trace = [TraceStep(t, 0, tuple(range(t % 7, 200, 3))) for t in range(50)]
    lists = predicted_lists(trace, n, recall=0.9, precision=0.5, seed=4)
    tp = sum(int(m[list(s.active)].sum()) for m, s in zip(lists, trace))
    act = sum(len(s.active) for s in trace)
    listed = sum(int(m.sum()) for m in lists)
    assert tp / act == pytest.approx(0.9, abs=0.03)
    assert tp / listed == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="recall"):
        predicted_lists(trace, n, recall=0.0)


def test_eps_minus_one_admits_a_one_hit_neuron() -> None:
    p = PrefetchLayer(8, [0, 1], BalancerConfig(lam=0.5, eps=-1.0, adaptive=False))
    d = p.step([5], "none", 0)
    assert d.admit == [5]
    q = PrefetchLayer(8, [0, 1], BalancerConfig(lam=0.5, adaptive=False))
    assert q.step([5], "none", 0).admit == []   # τ = 0.51: one prediction scores 0.5
    with pytest.raises(ValueError, match="eps"):
        BalancerConfig(eps=-1.5)


def test_static_hits_counts_the_fired_neurons_in_resident_groups() -> None:
    from kairox.neuron_cache import static_hits
    trace = [TraceStep(0, 0, (0, 1, 2), counts=(3, 1, 1)), TraceStep(0, 1, (5,)),
             TraceStep(1, 0, ()), TraceStep(1, 1, ()),
             TraceStep(2, 0, (4,)), TraceStep(2, 1, (5, 6))]
    got = static_hits(trace, 8, {0: [0, 2], 1: [6]})
    # token 0: layer 0 hits 3 + 1 of 5, layer 1 none of 1; token 1: nothing fired; token 2: 1 of 3
    np.testing.assert_allclose(got, [4 / 6, 1.0, 1 / 3])
