"""The live balancer (llama/kx-balance.cpp): neurons move between the two sides of every
hybrid layer after each decode, by the TAM policy, with reloads behind the next decode.

Outputs must stay those of the unsplit run (a neuron enters the slot map only once its rows
have landed, and the host maps hold the complement), the decisions must be the reference's
(kairox.balancer.LayerBalancer fed the same active lists and stall types), and the
residents after a drain must be the reference's residents. Slots on the CPU device here
(the host reload engine); CUDA slots with the gather kernel on the GPU machine.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from test_hybrid import N_FF, N_GEN, PROMPT, run, synth_model  # noqa: F401 (fixture)

SLOTS = [60, 100]


def topic_tokens(n: int, seed: int = 1) -> list[int]:
    """Token ids that change 'topic' every 12 tokens (runs from different id ranges), so the
    active sets drift and the balancer has something to follow."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        base = int(rng.integers(10, 200))
        out += [int(t) for t in rng.integers(base, base + 20, 12)]
    return out[:n]


def run_live(model: Path, mode: str, config, gpu: bool = False, record: bool = False, tokens=None,
             **start) -> tuple[list[int], np.ndarray, list[dict], object]:
    import kairox
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}
    llm = kairox.Llama(str(model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                       verbose=False, sparse=mode, gpu_slots=SLOTS, balancer_record=record, **where)
    llm.start_balancer(config, **start)
    llm.eval(PROMPT)
    toks = []
    for k in range(N_GEN):
        toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[k] if tokens else toks[-1]])
    return toks, np.array(llm.scores[:llm.n_tokens]), llm.balance_trace(), llm


def fast_config():
    from kairox.balancer import BalancerConfig
    # λ low and adaptive: many loads and evictions per step, so the test exercises reloads
    return BalancerConfig(lam=0.2, eps=0.01, lam_min=0.05, adaptive=True, max_admit=16)


@pytest.mark.parametrize("mode", ["exact", "predicted"])
@pytest.mark.parametrize("gpu", [False, True])
def test_live_balancing_keeps_the_output(synth_model: Path, mode: str, gpu: bool) -> None:
    from kairox._native import has_gpu
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    from kairox._native import balance_counters
    want_toks, want, _ = run(synth_model, sparse=mode)
    balance_counters(reset=True)
    toks, got, trace, llm = run_live(synth_model, mode, fast_config(), gpu=gpu)
    llm.close()
    # the boundary's clock: one per decode call, its phases within its total
    bc = balance_counters(reset=True)
    assert bc["steps"] == N_GEN + len(PROMPT), bc  # one per decode: n_batch=1, the prompt a token a decode
    phases = sum(v for k, v in bc.items() if k not in ("steps", "ns"))
    assert 0 < phases <= bc["ns"], bc
    assert all(bc[k] > 0 for k in ("snap_ns", "apply_ns", "store_ns", "queue_ns")), bc
    assert toks == want_toks
    tol = 1e-3 if gpu else 1e-5  # CUDA kernels vs the CPU's: rounding
    assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max())
    # one record per decode after the prompt and per hybrid layer; neurons really moved
    assert len(trace) == (N_GEN + len(PROMPT)) * len(SLOTS)  # every decode is a step, the prompt's too
    assert sum(r["n_load"] for r in trace) > N_GEN
    assert sum(r["n_evict"] for r in trace) > 0
    # hits are counted from what ran: never more than listed
    assert all(0 <= r["n_hit"] <= r["n_active"] for r in trace)
    assert all(r["reload_bytes"] > 0 for r in trace if r["n_load"])


@pytest.mark.parametrize("decide,gpu", [("worker", False), ("inline", False), ("auto", True)])
def test_live_decisions_equal_the_reference(synth_model: Path, decide: str, gpu: bool) -> None:
    """Every step's loads, evictions and λ equal LayerBalancer's on the recorded active lists
    and stall types, and after a drain the slots hold the reference's residents (host
    decisions here; on the GPU machine, one kernel deciding every layer)."""
    from kairox._native import has_gpu
    from kairox.balancer import LayerBalancer
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    cfg = fast_config()
    _, _, trace, llm = run_live(synth_model, "predicted", cfg, gpu=gpu, record=True, tokens=topic_tokens(N_GEN),
                                decide=decide)
    try:
        initial = {}
        import kairox
        ref_llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=SLOTS, verbose=False,
                               **({"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}))
        initial = {il: ref_llm.slot_residents(il) for il in range(len(SLOTS))}
        ref_llm.close()
        llm.drain_balancer()
        moved = 0
        for il, cap in enumerate(SLOTS):
            lb = LayerBalancer(N_FF, cap, cfg, initial=initial[il])
            recs = [r for r in trace if r["layer"] == il]
            assert [r["step"] for r in recs] == list(range(N_GEN + len(PROMPT)))
            # the residents decode k ran with: boundary k commits step k-2's loads (copied since
            # boundary k-1), then drops step k-1's evictions (and queues its loads)
            ran_with, loads, evicts = set(initial[il]), [], []
            for r in recs:
                k = r["step"]
                ids = llm.balance_activity(k, il)
                act = np.zeros(N_FF, bool)
                act[ids] = True
                assert int(act.sum()) == r["n_active"]
                assert r["n_hit"] == len(ran_with.intersection(ids)), r
                d = lb.step(act, r["stall"])
                assert (len(d.admit), len(d.evict)) == (r["n_load"], r["n_evict"]), r
                assert np.float32(d.lam) == np.float32(r["lam"])
                moved += len(d.admit)
                loads.append(list(d.admit))
                evicts.append(list(d.evict))
                ran_with |= set(loads[k - 2]) if k >= 2 else set()
                ran_with -= set(evicts[k - 1]) if k >= 1 else set()
            assert sorted(llm.slot_residents(il)) == lb.residents()
        assert moved > N_GEN
        if not gpu:  # the host engine never waits for a reload
            assert {r["stall"] for r in trace} <= {"cpu", "none"}
    finally:
        llm.close()


def test_balancer_arguments_are_checked(synth_model: Path) -> None:
    import kairox
    from kairox.balancer import BalancerConfig
    with pytest.raises(ValueError, match="gpu_slots"):
        kairox.Llama(str(synth_model), sparse="predicted", balancer=True, verbose=False)
    with pytest.raises(TypeError, match="BalancerConfig"):
        kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=10, slots_device="CPU", balancer="yes",
                     verbose=False)
    with pytest.raises(ValueError, match="reload_method"):
        kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=10, slots_device="CPU", reload_method="dma",
                     verbose=False)
    llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=10, slots_device="CPU", verbose=False)
    try:
        with pytest.raises(ValueError, match="no balancer"):
            llm.drain_balancer()
        with pytest.raises(ValueError, match="no activity"):
            llm.balance_activity(0, 0)
        llm.start_balancer(BalancerConfig(), max_blocks=0)
    except ValueError as e:
        assert "block cap" in str(e)
    else:
        raise AssertionError("a block cap of 0 was accepted")
    finally:
        llm.close()
    plain = kairox.Llama(str(synth_model), sparse="predicted", verbose=False)
    try:
        with pytest.raises(ValueError, match="slots"):
            plain.start_balancer(True)
    finally:
        plain.close()


def test_balancer_option_starts_it(synth_model: Path) -> None:
    """Llama(balancer=...) starts the balancer at load; the runtime then balances after every decode."""
    import kairox
    llm = kairox.Llama(str(synth_model), n_ctx=64, n_batch=1, n_ubatch=1, sparse="predicted", gpu_slots=SLOTS,
                       slots_device="CPU", balancer=fast_config(), balancer_backoff=None, verbose=False)
    try:
        llm.eval(PROMPT)
        for t in topic_tokens(10):
            llm.eval([t])
        tr = llm.balance_trace()
        assert len(tr) == (len(PROMPT) + 10) * len(SLOTS) and {r["layer"] for r in tr} == {0, 1}  # a step a decode
    finally:
        llm.close()


def test_trace_report_draws_and_summarizes(synth_model: Path, tmp_path: Path, capsys) -> None:
    from kairox.cli import main
    from kairox.report import read_trace, summary, write_trace
    _, _, trace, llm = run_live(synth_model, "predicted", fast_config(), tokens=topic_tokens(N_GEN))
    llm.close()
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    s = summary(read_trace(path))
    assert s["steps"] == N_GEN + len(PROMPT) and s["layers"] == len(SLOTS)
    act = sum(r["n_active"] for r in trace)
    assert s["hit_rate"] == pytest.approx(sum(r["n_hit"] for r in trace) / act)
    assert s["loads_per_step"] == pytest.approx(sum(r["n_load"] for r in trace) / (N_GEN + len(PROMPT)))
    png = tmp_path / "t.png"
    assert main(["report", str(path), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "GPU hit rate" in capsys.readouterr().out
    import gzip
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_trace(gz) == read_trace(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\n')
    assert main(["report", str(bad)]) == 2
    assert "not a balancer trace" in capsys.readouterr().err


def test_observing_records_the_static_split(synth_model: Path) -> None:
    """observe=True: hits of the static split recorded, nothing decided or moved."""
    import kairox
    llm = kairox.Llama(str(synth_model), n_ctx=64, n_batch=1, n_ubatch=1, sparse="predicted", gpu_slots=SLOTS,
                       slots_device="CPU", verbose=False)
    try:
        before = [llm.slot_residents(il) for il in range(len(SLOTS))]
        llm.start_balancer(True, observe=True)
        llm.eval(PROMPT)
        for t in topic_tokens(10):
            llm.eval([t])
        tr = llm.balance_trace()
        assert len(tr) == (len(PROMPT) + 10) * len(SLOTS)  # a step a decode
        assert all(r["n_load"] == 0 and r["n_evict"] == 0 for r in tr)
        assert sum(r["n_hit"] for r in tr) > 0
        assert [llm.slot_residents(il) for il in range(len(SLOTS))] == before
        with pytest.raises(ValueError, match="decide"):
            llm.start_balancer(True, decide="gpu")
    finally:
        llm.close()


def test_run_cli_trace_needs_the_balancer(synth_model: Path, capsys) -> None:
    from kairox.cli import main
    assert main(["run", "-m", str(synth_model), "-n", "2", "--kx-trace", "t.jsonl"]) == 2
    assert "--balancer" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["fail_at", "hang_at"])
@pytest.mark.parametrize("gpu", [False, True])
def test_a_failing_reload_stops_the_balancer_not_the_output(synth_model: Path, fault: str, gpu: bool,
                                                            capfd) -> None:
    """Fault injection: the balancer's 3rd reload batch fails to queue, or never finishes.
    The decode goes on with the split as it was (outputs equal the unsplit run's: a neuron
    enters the slot map only once its rows landed), the balancer stops with one line saying
    why, and a reload that never finishes costs the wait limit once, not a hang."""
    import time
    from kairox._native import has_gpu
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this)")
    want_toks, want, _ = run(synth_model, sparse="exact")
    t0 = time.perf_counter()
    toks, got, trace, llm = run_live(synth_model, "exact", fast_config(), gpu=gpu, wait_limit_ms=300,
                                     **{fault: 3})
    elapsed = time.perf_counter() - t0
    llm.close()
    assert_stopped_by_fault(fault, gpu, (toks, got), (want_toks, want), capfd.readouterr().err, elapsed)


def assert_stopped_by_fault(fault: str, gpu: bool, got, want, err: str, elapsed: float) -> None:
    """A run whose balancer a fault stopped (wait limit 300 ms): the unsplit run's tokens and
    logits, one line saying why, and no hang (one wait limit, then the decode's own pace)."""
    assert got[0] == want[0]
    tol = 1e-3 if gpu else 1e-5  # CUDA kernels vs the CPU's: rounding
    assert float(np.abs(got[1] - want[1]).max()) <= tol * float(np.abs(want[1]).max())
    words = "did not finish within 300 ms" if fault == "hang_at" else "queueing slot reloads failed"
    assert err.count("the balancer failed and stops") == 1 and words in err, err[-2000:]
    assert elapsed < 60


@pytest.mark.parametrize("profile", [None, {"cpu_gbs": 40.0, "gpu_gbs": 50.0}])
def test_the_runtime_stall_model_is_the_cost_model(synth_model: Path, tmp_path: Path, profile) -> None:
    """Each step's stall type is kairox.costs.stall_type of the step's CPU and GPU bytes at the
    runtime's rates: the defaults (kx_balance_params 0), or a `kairox profile-hw` file's
    (hw_profile=). The equal-ish profile rates make both "cpu" and "none" steps occur."""
    import json
    import kairox
    from kairox.costs import Rates, stall_type
    from kairox.plan import HwProfile
    kw = {}
    if profile:
        (tmp_path / "hw.json").write_text(json.dumps(profile))
        kw["hw_profile"] = str(tmp_path / "hw.json")
    rates = HwProfile.from_json(profile).rates if profile else Rates()
    llm = kairox.Llama(str(synth_model), n_ctx=256, n_batch=1, n_ubatch=1, verbose=False, sparse="exact",
                       gpu_slots=SLOTS, slots_device="CPU", **kw)
    try:
        llm.start_balancer(fast_config())
        for t in PROMPT + topic_tokens(N_GEN):
            llm.eval([t])
        trace = llm.balance_trace()
    finally:
        llm.close()
    row_bytes = {r["layer"]: r["reload_bytes"] // r["n_load"] for r in trace if r["n_load"]}
    checked = [(r["stall"], stall_type((r["n_active"] - r["n_hit"]) * row_bytes[r["layer"]],
                                       r["n_hit"] * row_bytes[r["layer"]], rates))
               for r in trace if r["decided"] and r["stall"] != "io"]
    assert len(checked) > N_GEN
    assert all(got == want for got, want in checked), [c for c in checked if c[0] != c[1]][:5]
    if profile:
        assert {got for got, _ in checked} == {"cpu", "none"}


def test_reload_wait_limit_and_faults_are_checked(synth_model: Path) -> None:
    import kairox
    llm = kairox.Llama(str(synth_model), n_ctx=64, verbose=False, sparse="exact", gpu_slots=SLOTS,
                       slots_device="CPU")
    try:
        with pytest.raises(ValueError, match="fail_at and hang_at must be >= 0"):
            llm.start_balancer(True, fail_at=-1)
    finally:
        llm.close()


def test_the_records_kept_in_memory_are_bounded(synth_model: Path) -> None:
    """A balancer decoding for a long time keeps only its newest records in memory (a server's
    would otherwise grow by one record per layer and decode forever): with trace_keep 1024,
    700 decodes of 2 hybrid layers (1400 records) leave between 512 and 1024, the newest."""
    import kairox
    llm = kairox.Llama(str(synth_model), n_ctx=1024, n_batch=1, n_ubatch=1, verbose=False, sparse="exact",
                       gpu_slots=SLOTS, slots_device="CPU")
    try:
        llm.start_balancer(fast_config(), trace_keep=1024)
        llm.eval(topic_tokens(700))
        trace = llm.balance_trace()
        steps = [r["step"] for r in trace]
        assert 512 <= len(trace) <= 1024, len(trace)
        assert steps == sorted(steps) and steps[-1] == 699 and steps[0] == 700 - -(-len(trace) // len(SLOTS))
    finally:
        llm.close()
