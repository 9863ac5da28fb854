"""Load-aware decode threads: the Python policy (kairox.threads) on modelled machines, the
runtime's C++ (kx_threads_run) against it count for count, and a context whose thread count
the boundary changes while it decodes the same logits."""
from __future__ import annotations

import ctypes
import random
from pathlib import Path

import numpy as np
import pytest

from kairox.threads import MAX_WAIT, ThreadsConfig, ThreadsPolicy, candidates


def machine(n: int, free: int, rnd: random.Random) -> float:
    """A decode's seconds with n threads on a machine that has `free` cores for them: work
    split n ways, and each barrier waits for threads beyond the free cores (descheduled)."""
    t = 0.010 / min(n, free) + 0.0005
    if n > free:
        t *= 1.0 + 4.0 * (n - free) / n
    return t * (1.0 + 0.02 * rnd.random())


def closed_loop(p: ThreadsPolicy, free_at: list[int], seed: int = 1) -> list[int]:
    rnd = random.Random(seed)
    counts = []
    for free in free_at:
        counts.append(p.n)
        p.step(machine(p.n, free, rnd))
    return counts


def test_candidates_are_distinct_and_most_first() -> None:
    assert candidates(16) == [16, 12, 8, 4]
    assert candidates(3) == [3, 2, 1]
    assert candidates(1) == [1]
    with pytest.raises(ValueError):
        candidates(0)
    for bad in ({"window": 0}, {"drift": 0.0}, {"drift": 1.0}, {"window": 8, "recheck": 4}):
        with pytest.raises(ValueError):
            ThreadsConfig(**bad)


def test_an_idle_machine_keeps_its_threads_and_never_probes() -> None:
    p = ThreadsPolicy(16)
    counts = closed_loop(p, [16] * 2000)
    assert set(counts) == {16} and p.probes == 0


def test_a_load_that_starts_and_ends_moves_the_count_down_and_back() -> None:
    p = ThreadsPolicy(16, ThreadsConfig(window=8, recheck=128))
    free = [16] * 200 + [6] * 600 + [16] * 600
    counts = closed_loop(p, free)
    # under the load (6 free cores) it settles on fewer threads than cores are left, and
    # peeks at 16 one window at a time, each wait twice the last (128, 256 decodes) ...
    assert counts[799] == 4 and sum(c > 8 for c in counts[260:800]) == 2 * 9
    # ... and after the load, a peek finds all of them as fast again: a probe brings them back
    assert counts[-1] == 16 and p.probes == 2 and set(counts[-100:]) == {16}
    # the decode time it bought: the held count against 16 threads under the load
    rnd = random.Random(2)
    assert machine(counts[799], 6, rnd) < 0.5 * machine(16, 6, rnd)


def test_the_runtime_makes_the_references_choices(native: Path) -> None:
    """kx_threads_run against ThreadsPolicy on the same series of decode times: random series,
    and the series the closed loop above produced (the C++ replays them open loop)."""
    from kairox.llama import _lib as lib
    rnd = random.Random(7)
    series = []
    for _ in range(40):
        n = rnd.randrange(1, 600)
        level = [rnd.choice([0.01, 0.02, 0.05]) for _ in range(4)]
        series.append([level[i * 4 // n] * (1 + 0.3 * rnd.random()) for i in range(n)])
    rnd2 = random.Random(3)
    free = [16] * 150 + [5] * 400 + [16] * 400
    p = ThreadsPolicy(16, ThreadsConfig(window=4, drift=0.1, recheck=64))
    loop = []
    for f in free:
        loop.append(machine(p.n, f, rnd2))
        p.step(loop[-1])
    series.append(loop)
    for k, s in enumerate(series):
        n_max = 16 if k == len(series) - 1 else rnd.choice([1, 2, 3, 8, 16, 64])
        cfg = ThreadsConfig(window=4, drift=0.1, recheck=64) if k == len(series) - 1 else \
            ThreadsConfig(window=rnd.choice([1, 3, 8]), drift=rnd.choice([0.05, 0.15, 0.5]), recheck=64)
        want = ThreadsPolicy(n_max, cfg).run(s)
        got = (ctypes.c_int32 * len(s))()
        arr = (ctypes.c_double * len(s))(*s)
        assert lib.kx_threads_run(ctypes.byref(cfg.native()), n_max, arr, len(s), got) == 0
        assert list(got) == want, k
    bad = ThreadsConfig().native()
    bad.recheck = 2
    assert lib.kx_threads_run(ctypes.byref(bad), 16, None, 0, None) == 1
    assert lib.kx_threads_run(ctypes.byref(ThreadsConfig().native()), 0, None, 0, None) == 1
    # the parameter struct's default: off, with the reference's drift and recheck
    kp = lib.kx_params_default()
    assert (kp.threads.window, kp.threads.drift, kp.threads.recheck) == (0, ThreadsConfig().drift,
                                                                         ThreadsConfig().recheck)


def test_a_context_changes_its_threads_and_decodes_the_same(native: Path, tiny_silu_gguf: Path) -> None:
    """The boundary sets the thread count of the next decode (a drift this small probes at every
    window), and the logits are those of a context that keeps its threads."""
    import kairox
    from llama_cpp import llama_cpp as lc
    toks = list(range(100, 164))

    def run(adapt) -> tuple[np.ndarray, set[int]]:
        llm = kairox.Llama(str(tiny_silu_gguf), n_ctx=128, n_threads=4, n_threads_batch=4, verbose=False,
                           adapt_threads=adapt)
        llm.eval(toks[:4])
        seen, rows = set(), []
        for t in toks[4:]:
            seen.add(lc.llama_n_threads(llm._ctx.ctx))
            llm.eval([t])
            rows.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
        llm.close()
        return np.stack(rows), seen
    base, seen0 = run(None)
    got, seen = run(ThreadsConfig(window=1, drift=1e-6, recheck=1))
    assert seen0 == {4} and seen == {4, 3, 2, 1}
    np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError):
        kairox.Llama(str(tiny_silu_gguf), adapt_threads="yes")


def test_a_machine_whose_speed_wanders_by_itself_probes_less_and_less() -> None:
    """Every probe on a machine that slows and speeds up by itself (a VM's neighbours; fewer
    threads never faster) keeps the count, and each makes the next move wait twice as long:
    the probes' share of the decodes falls."""
    p = ThreadsPolicy(2)
    rnd = random.Random(5)
    counts = []
    for k in range(6000):
        counts.append(p.n)
        p.step((0.02 if (k // 40) % 2 else 0.026) * 2 / p.n * (1 + 0.01 * rnd.random()))
    assert p.probes >= 3 and p.quiet == MAX_WAIT * ThreadsConfig().recheck
    first, last = counts[:1000], counts[-3000:]
    assert sum(c < 2 for c in last) * 10 < sum(c < 2 for c in first) * 3 + 10
    assert sum(c < 2 for c in counts) < 0.02 * len(counts)
