"""The balancer's back-off (kairox.backoff; the runtime's llama/kx-backoff.cpp, wired into the
per-token boundary): it runs the balancer only while the balancer measurably pays."""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kairox.backoff import Backoff, BackoffConfig, run_backoff
from test_pipeline import model4  # noqa: F401 (the fixture)


def phases(on: list[bool]) -> list[tuple[bool, int]]:
    """Runs of equal answers: (answer, length)."""
    out: list[tuple[bool, int]] = []
    for x in on:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


def test_a_balancer_that_loses_is_held_ever_longer() -> None:
    """Tokens with the balancer take 2 s, held ones 1 s: after each probe (window + settle on,
    the same held) the hold lasts window, 2 window, 4 window, ... up to 2^max_doubling. Each
    switch to held, and only those, puts the static split back (home)."""
    cfg = BackoffConfig(window=4, settle=1, max_doubling=2)
    b, b_on, on, home = Backoff(cfg), True, [], []
    for _ in range(200):
        was, b_on = b_on, b.step(2.0 if b_on else 1.0)
        on.append(b_on)
        home.append(b.home)
        assert b.home == (was and not b_on)
    assert sum(home) == sum(r[0] is False for r in phases(on)) > 5
    runs = phases(on)
    # first answer follows the first token: 4 more on (settle + window = 5 tokens ran on)
    assert runs[0] == (True, 4)
    # held: the probe's 5 tokens and its outcome's hold, then 5 on again
    assert runs[1:8] == [(False, 5 + 4), (True, 5), (False, 5 + 8), (True, 5), (False, 5 + 16), (True, 5),
                         (False, 5 + 16)]


def test_a_balancer_that_pays_keeps_running() -> None:
    """Tokens with the balancer take 1 s, held ones 2 s: held only while probing."""
    from kairox.backoff import Backoff
    cfg = BackoffConfig(window=4, settle=1, max_doubling=3)
    b, last, on = Backoff(cfg), True, []
    for _ in range(300):
        last = b.step(1.0 if last else 2.0)
        on.append(last)
    held = [n for x, n in phases(on) if not x]
    assert held and all(n == 5 for n in held)  # each probe's held half, nothing more
    assert on.count(False) < 0.2 * len(on)


def test_a_lost_probe_waits_for_the_hit_rate_to_fall() -> None:
    """The drift gate: the balancer loses every probe (2 s against 1 s). While the static
    split's hit rate stays put, a lost probe repeats only after four holds; once the held
    tokens' median hit rate falls more than `drift` below the lost probe's, the next probe
    follows at the end of the hold; hit rates are asked for only in the held probe phase and
    the hold's last window."""
    from kairox.backoff import HOLD
    cfg = BackoffConfig(window=4, settle=1, max_doubling=2, drift=0.05)
    b, last, on, asked, where = Backoff(cfg), True, [], [], []
    for i in range(400):
        hit = 0.60 if i < 250 else 0.50  # the text changes at token 250
        asked.append(b.wants_hit)
        where.append((b.phase, b.hold, last, b.n + 1))
        last = b.step(2.0 if last else 1.0, hit if b.wants_hit else None)
        on.append(last)
    runs = phases(on)
    assert runs[:6] == [(True, 4), (False, 5 + 4 * 4), (True, 5), (False, 5 + 4 * 8), (True, 5),
                        (False, 5 + 4 * 16)]
    # the change: a probe at the end of the hold length it fell into (16: its last window
    # below 0.60 - 0.05), not four holds later
    starts = [sum(n for _, n in runs[:k]) for k in range(len(runs)) if runs[k][0]]
    assert 250 < next(s for s in starts if s > 250) <= 250 + 16
    # asked: never while the balancer runs; in gated holds of 16, on each length's last window
    assert not any(a and ran for a, (_, _, ran, _) in zip(asked, where))
    in16 = [(a, n) for a, (ph, hold, _, n) in zip(asked, where) if ph == HOLD and hold == 16]
    assert len(in16) >= 64 and all(a == (n % 16 == 0 or n % 16 > 12) for a, n in in16)
    # without the gate (drift 0) the probes come on schedule
    b0, last, on0 = Backoff(dataclasses.replace(cfg, drift=0.0)), True, []
    for i in range(400):
        assert not b0.wants_hit
        last = b0.step(2.0 if last else 1.0, 0.6)
        on0.append(last)
    assert phases(on0)[:4] == [(True, 4), (False, 5 + 4), (True, 5), (False, 5 + 8)]
    with pytest.raises(ValueError):
        BackoffConfig(drift=1.0)


def test_margin_and_window_zero() -> None:
    assert run_backoff(BackoffConfig(window=0), [5.0, 1.0, 9.0]) == [True] * 3
    # equal times: the balancer does not pay (its median must be lower, by the margin)
    on = run_backoff(BackoffConfig(window=3, settle=0), [1.0] * 12)
    assert on == [True, True, False, False, False, False, False, False, True, True, True, False]
    with pytest.raises(ValueError):
        BackoffConfig(margin=1.0)
    with pytest.raises(ValueError):
        BackoffConfig(window=-1)


@pytest.mark.parametrize("cfg", [BackoffConfig(), BackoffConfig(window=3, settle=0, margin=0.05, max_doubling=1),
                                 BackoffConfig(window=8, settle=3, margin=0.0, max_doubling=5, drift=0.0),
                                 BackoffConfig(window=1, settle=2, margin=0.2, max_doubling=0, drift=0.1),
                                 BackoffConfig(window=4, settle=1, max_doubling=1, drift=0.02)])
def test_the_runtime_policy_is_the_reference(native, cfg: BackoffConfig) -> None:
    """kx_backoff_run (C++) answers as run_backoff on the same token times and hit rates: noisy
    series whose levels move, with ties and even windows (the medians' means of two)."""
    from kairox.llama import _lib
    rng = np.random.default_rng(cfg.window * 7 + cfg.settle)
    for _ in range(20):
        n = int(rng.integers(1, 600))
        level = np.repeat(rng.uniform(0.5, 2.0, n // 40 + 1), 40)[:n]
        t = np.round(level * rng.uniform(0.8, 1.2, n), int(rng.integers(1, 4)))
        hits = np.round(np.repeat(rng.uniform(0.4, 0.8, n // 60 + 1), 60)[:n] + rng.normal(0, 0.01, n), 3)
        got = (ctypes.c_uint8 * n)()
        assert _lib.kx_backoff_run(ctypes.byref(cfg.native()), (ctypes.c_double * n)(*t), None, n, got) == 0
        assert [bool(x) for x in got] == run_backoff(cfg, t.tolist())
        assert _lib.kx_backoff_run(ctypes.byref(cfg.native()), (ctypes.c_double * n)(*t), (ctypes.c_double * n)(*hits),
                                   n, got) == 0
        assert [bool(x) for x in got] == run_backoff(cfg, t.tolist(), hits.tolist())
    bad = BackoffConfig().native()
    bad.margin = 1.5
    assert _lib.kx_backoff_run(ctypes.byref(bad), None, None, 0, None) == 1


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("gpu", [False, True])
def test_the_runtime_holds_the_balancer_as_the_reference_says(model4: Path, pipeline: bool, gpu: bool) -> None:
    """Live, CPU-device slots (or GPU ones: the device's decision, rebuilt at each return): with
    a margin no balancer meets (0.9999: it would have to be 10^4 times faster, more than a held
    token stalled by a busy machine can make it seem), every probe ends held. The boundaries
    held are the reference's answers on as many token times, a held boundary leaves the slots
    holding the static split (the residents the balancer started from, which its probes had
    moved away from; on the GPU a return's loads enter when they have landed), the decode's
    outputs stay the unbalanced run's, and the pipeline's graph nodes come and go with the
    holds."""
    import kairox
    from kairox._native import balance_counters, pipe_counters
    from test_pipeline import N_GEN, N_LAYER, PROMPT, SLOTS, _gpu_or_skip, drifting, fast

    _gpu_or_skip(gpu)
    toks = drifting(N_GEN)
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}

    def decode(backoff: BackoffConfig | None):
        llm = kairox.Llama(str(model4), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                           n_threads=2, verbose=False, sparse="predicted", gpu_slots=SLOTS, **where)
        try:
            home = [set(llm.slot_residents(il)) for il in range(N_LAYER)]
            if backoff is not None:
                llm.start_balancer(dataclasses.replace(fast(), eps=-1.0), pipeline=pipeline, backoff=backoff)
            balance_counters(reset=True)
            pipe_counters(reset=True)
            held, moved, at_home, within = 0, 0, 0, 0
            for t in PROMPT + toks:  # (n_batch 1: the prompt too, a boundary per token)
                llm.eval([t])
                placed = [set(llm.slot_residents(il)) for il in range(N_LAYER)]
                now = balance_counters()["held"]
                if now > held:  # this boundary held the balancer
                    at_home += placed == home
                    within += all(p <= h for p, h in zip(placed, home))
                else:
                    moved += placed != home
                held = now
            return np.array(llm.scores[:llm.n_tokens]), {**balance_counters(reset=True), "moved": moved,
                                                         "at_home": at_home, "within": within,
                                                         "prefetches": pipe_counters(reset=True)["steps"]}
        finally:
            llm.close()

    want, _ = decode(None)
    cfg = BackoffConfig(window=3, settle=1, margin=0.9999, max_doubling=2, drift=0.0)
    got, c = decode(cfg)
    tol = 1e-3 if gpu else 1e-5  # CUDA kernels vs the CPU's: rounding
    assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max())
    boundaries = len(PROMPT) + N_GEN
    assert c["steps"] == boundaries
    ref, on, homes = Backoff(cfg), [], 0  # the first boundary has no token time before it
    for _ in range(boundaries - 1):
        on.append(ref.step(1.0))
        homes += ref.home
    assert c["held"] == on.count(False) > boundaries // 2
    assert c["homes"] == homes > 1
    # every held boundary: the static split once a return's loads have landed (a host engine's
    # at once), never a neuron it does not hold
    assert c["within"] == c["held"]
    assert c["at_home"] == c["held"] - c["home_late"]
    if not gpu:
        assert c["home_late"] == 0
    assert c["moved"] > 0 and c["home_loads"] > 0  # which the probes had left
    if pipeline:  # layers 1-3 prefetch within the decodes the balancer ran (the first, and those
        # after a boundary that ran it), layer 0 at those boundaries; none in held ones
        assert 0 < c["prefetches"] <= N_LAYER * (boundaries - c["held"] + 1) < N_LAYER * boundaries // 2


def test_run_cli_backoff_needs_the_balancer(model4: Path, capsys) -> None:
    from kairox.cli import main
    assert main(["run", "-m", str(model4), "-n", "2", "--backoff", "8"]) == 2
    assert "--backoff needs the live balancer" in capsys.readouterr().err
    assert main(["run", "-m", str(model4), "-n", "2", "--gpu-slots", "64", "--balancer", "fixed",
                 "--backoff", "-1"]) == 2
    assert "window" in capsys.readouterr().err


@pytest.mark.parametrize("gpu", [False, True])
def test_each_return_restarts_the_decision_from_the_static_split(model4: Path, gpu: bool) -> None:  # noqa: F811
    """Recorded, with every probe ending held: each run of the balancer decides as a new one
    would (kairox.balancer.LayerBalancer made afresh from the static split, fed the run's
    recorded active lists and stall types): loads, evictions and λ of every step. On the GPU
    machine the device's decision table, reset in place at each return."""
    import kairox
    from kairox.balancer import LayerBalancer
    from test_pipeline import N_FF, N_GEN, N_LAYER, PROMPT, SLOTS, _gpu_or_skip, drifting, fast

    _gpu_or_skip(gpu)
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}
    llm = kairox.Llama(str(model4), n_ctx=256, n_batch=1, n_ubatch=1, type_k=0, type_v=0, n_threads=2,
                       verbose=False, sparse="predicted", gpu_slots=SLOTS, balancer_record=True, **where)
    try:
        home = [llm.slot_residents(il) for il in range(N_LAYER)]
        bal, cfg = dataclasses.replace(fast(), eps=-1.0), BackoffConfig(window=3, settle=1, margin=0.9999, max_doubling=2, drift=0.0)
        llm.start_balancer(bal, decide="auto" if gpu else "inline", backoff=cfg)
        for t in PROMPT + drifting(N_GEN):
            llm.eval([t])
        trace = llm.balance_trace()
        # the runs: boundary 0 runs (no token time before it), then the reference's answers
        ref, runs, on = Backoff(cfg), [1], True
        for _ in range(len(PROMPT) + N_GEN - 1):
            now = ref.step(1.0)
            if now and on:
                runs[-1] += 1
            elif now:
                runs.append(1)
            on = now
        assert len(runs) > 2 and sum(runs) == len({r["step"] for r in trace})
        compared = 0
        for il in range(N_LAYER):
            recs = sorted((r for r in trace if r["layer"] == il), key=lambda r: r["step"])
            k = 0
            for n in runs:
                lb = LayerBalancer(N_FF, SLOTS[il], bal, initial=home[il])
                for r in recs[k:k + n]:
                    act = np.zeros(N_FF, bool)
                    act[llm.balance_activity(r["step"], il)] = True
                    d = lb.step(act, r["stall"])
                    assert (len(d.admit), len(d.evict)) == (r["n_load"], r["n_evict"]), r
                    assert np.float32(d.lam) == np.float32(r["lam"]), r
                    compared += len(d.admit) + len(d.evict)
                k += n
        assert compared > len(runs) * N_LAYER
    finally:
        llm.close()


@pytest.mark.parametrize("gpu", [False, True])
def test_the_runtime_gates_probes_on_its_own_hit_rates(model4: Path, gpu: bool) -> None:  # noqa: F811
    """The drift gate live: the runtime's back-off samples (kairox.Llama.backoff_trace) carry a
    hit rate exactly where the reference asks for one, each a share in (0, 1], and the
    reference fed those samples answers as the runtime did, token for token."""
    import kairox
    from test_pipeline import N_GEN, PROMPT, SLOTS, _gpu_or_skip, drifting, fast

    _gpu_or_skip(gpu)
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}
    llm = kairox.Llama(str(model4), n_ctx=512, n_batch=1, n_ubatch=1, type_k=0, type_v=0, n_threads=2,
                       verbose=False, sparse="predicted", gpu_slots=SLOTS, **where)
    try:
        cfg = BackoffConfig(window=3, settle=1, margin=0.9999, max_doubling=1, drift=0.02)
        llm.start_balancer(dataclasses.replace(fast(), eps=-1.0), backoff=cfg)
        for t in PROMPT + drifting(3 * N_GEN):
            llm.eval([t])
        trace = llm.backoff_trace()
    finally:
        llm.close()
    assert len(trace) == len(PROMPT) + 3 * N_GEN - 1  # every boundary but the first times a token
    ref, counted = Backoff(cfg), 0
    for seconds, hit, on in trace:
        assert ref.wants_hit == (hit is not None)
        if hit is not None:
            assert 0.0 < hit <= 1.0
            counted += 1
        assert ref.step(seconds, hit) == on
    assert counted > 2 * cfg.window and sum(not on for _, _, on in trace) > len(trace) // 2
