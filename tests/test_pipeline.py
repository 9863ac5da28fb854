"""The balancer's one-layer-ahead pipeline (kx_balance_params::pipeline; graph nodes in
llama/kx-ffn.cpp, decisions in llama/kx-pipeline.cpp).

While hybrid layer i computes, layer i+1's active set is predicted from layer i's input and
its best missing neurons are copied into its slots; what landed enters layer i+1's slot map
before its slot part is queued. Outputs must stay those of the unsplit run whatever lands
when (late reloads included), and every step must decide what kairox.balancer.PrefetchLayer
decides on the same predicted lists, stalls and landing reports. Slots on the CPU device here
(the host engine; `late_every` makes batches land late); CUDA slots on the GPU machine.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kairox.balancer import PIPE_MAX_ADMIT, BalancerConfig, PrefetchLayer, tam_key

PROMPT = list(range(1, 9))
N_GEN = 40
N_LAYER, N_FF = 4, 256
SLOTS = [60, 100, 80, 120]


@pytest.fixture(scope="module")
def model4(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Path:
    """KB-tiny with four layers, a sketch predictor and a permuted layout."""
    from kairox.synth import PRESETS
    from test_hybrid import permuted_tiny
    shape = dataclasses.replace(PRESETS["KB-tiny"], n_layer=N_LAYER)
    return permuted_tiny(tmp_path_factory.mktemp("pipeline") / "kb-tiny4.gguf", shape, seed=7)


def drifting(n: int, seed: int = 3) -> list[int]:
    """Token ids whose range changes every 10 tokens: the active sets drift."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        base = int(rng.integers(10, 200))
        out += [int(t) for t in rng.integers(base, base + 16, 10)]
    return out[:n]


def fast() -> BalancerConfig:
    # low, adaptive λ: candidates qualify after two predictions, so neurons move every step
    return BalancerConfig(lam=0.2, eps=0.01, lam_min=0.05, adaptive=True, max_admit=12)


def gen(model: Path, mode: str, gpu: bool = False, slots=None, tokens=None, pack: Path | None = None, **balancer):
    import kairox
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}
    kw = {"gpu_slots": slots, **where} if slots else {}
    if pack:
        kw["sparse_pack"] = str(pack)
    # two compute threads: the prefetch's scan phase runs split over them
    llm = kairox.Llama(str(model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                       n_threads=2, verbose=False, sparse=mode, balancer_record=bool(balancer.pop("record", False)),
                       **kw)
    initial = {il: llm.slot_residents(il) for il in range(N_LAYER)} if slots else {}
    if balancer:
        llm.start_balancer(balancer.pop("config"), pipeline=True, **balancer)
    llm.eval(PROMPT)
    toks = []
    for k in range(N_GEN):
        toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[k] if tokens else toks[-1]])
    return toks, np.array(llm.scores[:llm.n_tokens]), llm, initial


def _gpu_or_skip(gpu: bool) -> None:
    from kairox._native import has_gpu
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")


@pytest.mark.parametrize("mode,late,decide", [("exact", 0, "auto"), ("predicted", 0, "auto"), ("predicted", 3, "auto"),
                                              ("exact", 0, "worker"), ("predicted", 3, "worker")])
@pytest.mark.parametrize("gpu", [False, True])
def test_pipeline_keeps_the_output(model4: Path, mode: str, late: int, decide: str, gpu: bool) -> None:
    """decide: the compute threads make each prefetch (auto) or the balancer's thread does
    while the CPU part of the layer before computes (worker)."""
    _gpu_or_skip(gpu)
    from kairox._native import pipe_counters
    want_toks, want, ref, _ = gen(model4, mode)
    ref.close()
    pipe_counters(reset=True)
    toks, got, llm, _ = gen(model4, mode, gpu=gpu, slots=SLOTS, config=fast(), late_every=late, decide=decide)
    trace = llm.balance_trace()
    llm.close()
    phases = pipe_counters(reset=True)
    assert toks == want_toks
    tol = 1e-3 if gpu else 1e-5  # CUDA kernels vs the CPU's: rounding
    assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max())
    decided = [r for r in trace if r["decided"]]
    # every layer decides: layers 1-3 within each decode (one step per graph), layer 0 between decodes
    for il in range(N_LAYER):
        steps = [r["step"] for r in decided if r["layer"] == il]
        assert len(steps) >= (N_GEN if il == 0 else N_GEN + len(PROMPT)), (il, len(steps))
    assert sum(r["n_load"] for r in decided if r["layer"] > 0) > N_GEN
    assert sum(r["n_evict"] for r in decided) > 0
    assert all(0 <= r["n_hit"] <= r["n_active"] for r in trace)
    assert sum(r["n_active"] for r in trace if r["layer"] == N_LAYER - 1) > 0  # the boundary observes the last
    if late and not gpu:
        assert any(r["late"] & 1 for r in trace) and any(r["late"] & 2 for r in trace)
        assert any(r["stall"] == "io" for r in decided)
    # the phase counters count every step that got past its landing check (in and between decodes)
    assert len([r for r in decided if not r["late"] & 1]) <= phases["steps"] <= len(decided), phases
    assert all(v >= 0 for v in phases.values()) and phases["scan_ns"] > 0 and phases["publish_ns"] > 0
    # the CPU part's wait for the balancer's thread is recorded where that thread decides
    held = [r["hold_us"] for r in decided if r["layer"] > 0]
    assert all(h >= 0 for h in held) and (any(h > 0 for h in held) if decide == "worker" else not any(held))
    # every prefetch found its list (the device writes it beside the CPU part; the prefetch waits for it)
    no_list = sum(1 for r in trace if r["late"] & 4)
    assert no_list == 0, no_list


@pytest.mark.parametrize("fault", ["fail_at", "hang_at"])
@pytest.mark.parametrize("decide", ["auto", "worker"])
@pytest.mark.parametrize("gpu", [False, True])
def test_a_failing_prefetch_stops_the_balancer_not_the_output(model4: Path, fault: str, decide: str, gpu: bool,
                                                              capfd) -> None:
    """Fault injection inside the decode: the 5th prefetch batch fails to queue, or never
    lands. The layer's evictions made before the failure still reach the device map (else
    both sides would compute those neurons), the pending loads never enter it, the balancer
    stops with one line, and a batch that never lands costs the wait limit, not a hang."""
    import time
    from test_balance_live import assert_stopped_by_fault
    _gpu_or_skip(gpu)

    def one_more(llm, pause: float) -> np.ndarray:
        # a batch that never lands is given up once the limit passed: the next decode after it
        time.sleep(pause)
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        out = np.array(llm.scores[:llm.n_tokens])
        llm.close()
        return out
    want_toks, _, ref, _ = gen(model4, "predicted")
    want = one_more(ref, 0.0)
    capfd.readouterr()
    t0 = time.perf_counter()
    toks, _, llm, _ = gen(model4, "predicted", gpu=gpu, slots=SLOTS, config=fast(), decide=decide,
                          wait_limit_ms=300, **{fault: 5})
    got = one_more(llm, 0.35)
    elapsed = time.perf_counter() - t0
    assert_stopped_by_fault(fault, gpu, (toks, got), (want_toks, want), capfd.readouterr().err, elapsed)


@pytest.mark.parametrize("late,gpu,decide,eps,cap", [(0, False, "auto", 0.01, 12), (3, False, "auto", 0.01, 12),
                                                     (0, True, "auto", 0.01, 12), (3, False, "worker", 0.01, 12),
                                                     (0, True, "worker", 0.01, 12), (0, False, "auto", -1.0, 12),
                                                     (0, True, "auto", -1.0, 12), (0, False, "auto", -1.0, None),
                                                     (0, False, "worker", 0.01, 1)])
def test_pipeline_decisions_equal_the_reference(model4: Path, late: int, gpu: bool, decide: str, eps: float,
                                                cap: int | None) -> None:
    """Each decided record's loads, evictions and λ equal PrefetchLayer's fed the recorded
    predicted list, stall and landing bits; after a drain the slots hold its residents.
    ε = −1 is the micro level (every listed neuron a candidate, kairox.neuron_cache); cap:
    max_admit (None: the pipeline's own cap, PIPE_MAX_ADMIT, which binds on some steps here)."""
    _gpu_or_skip(gpu)
    cfg = dataclasses.replace(fast(), eps=eps, max_admit=cap)
    _, _, llm, initial = gen(model4, "predicted", gpu=gpu, slots=SLOTS, tokens=drifting(N_GEN), config=cfg,
                             late_every=late, record=True, decide=decide)
    try:
        trace = llm.balance_trace()
        llm.drain_balancer()
        moved = 0
        for il in range(N_LAYER):
            ref = PrefetchLayer(N_FF, initial[il], cfg)
            recs = [r for r in trace if r["layer"] == il and r["decided"]]
            assert recs
            for r in recs:
                pred = llm.balance_activity(r["step"], il)
                d = ref.step(pred, r["stall"], r["late"], r["step"], il)
                assert (len(d.admit), len(d.evict)) == (r["n_load"], r["n_evict"]), r
                assert np.float32(d.lam) == np.float32(r["lam"]), r
                moved += len(d.admit)
            ref.drain()
            assert sorted(llm.slot_residents(il)) == ref.residents(), il
        assert moved > N_GEN
        assert max(r["n_load"] for r in trace) == (PIPE_MAX_ADMIT if cap is None else cap)
    finally:
        llm.close()


@pytest.mark.parametrize("gpu", [False, True])
def test_the_ahead_predictor_lists_the_layer_a_layer_early(model4: Path, tmp_path: Path, gpu: bool) -> None:
    """Where the pack has ahead predictors (kx_ahead_*, trained on the previous layer's FFN
    input), they write the list the pipeline (and on a GPU the warm-up) reads one layer
    early, not the layer's own predictor. Each layer's ahead predictor here lists a fixed set
    (A and B zero, c ±1): every list a layer's prefetch decided from is that set, and the
    output is the pack's without them (the own predictor still picks what a layer computes)."""
    _gpu_or_skip(gpu)
    from kairox.pack import PackLayout, PackPredictor, pack_path_for, read_pack, write_pack
    from kairox.predictor import sketch_for_model
    src = read_pack(pack_path_for(model4))
    rng = np.random.default_rng(11)
    fixed = [np.sort(rng.choice(N_FF, 40 + 10 * il, replace=False)) for il in range(N_LAYER)]
    rank = src.layers[0].pred_a.shape[0]
    n_embd = src.base.n_embd

    def ahead_layer(il: int):
        c = np.full(N_FF, -1.0, np.float32)
        c[fixed[il]] = 1.0
        return np.zeros((rank, n_embd), np.float32), np.zeros((N_FF, rank), np.float32), c

    layout = PackLayout(layer=lambda il: (src.layers[il].perm, src.layers[il].group, src.layers[il].freq),
                        threshold=src.threshold)
    pack = write_pack(model4, tmp_path / "ahead.kxpack.gguf", predictor=sketch_for_model(model4), layout=layout,
                      ahead=PackPredictor(rank=rank, layer=ahead_layer), quiet=True)
    assert read_pack(pack).layers[1].ahead_a is not None
    cfg = dataclasses.replace(fast(), eps=-1.0)
    want_toks, want, ref, _ = gen(model4, "predicted", gpu=gpu, slots=SLOTS, config=cfg)
    ref.close()
    toks, got, llm, _ = gen(model4, "predicted", gpu=gpu, slots=SLOTS, pack=pack, config=cfg, record=True)
    try:
        assert toks == want_toks
        tol = 1e-3 if gpu else 1e-5
        assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max())
        seen = 0
        for r in llm.balance_trace():
            if r["decided"] and r["layer"] > 0 and not r["late"] & 4:
                assert sorted(llm.balance_activity(r["step"], r["layer"])) == fixed[r["layer"]].tolist(), r
                seen += 1
        assert seen >= (N_LAYER - 1) * N_GEN
    finally:
        llm.close()


def test_pipeline_arguments_are_checked(model4: Path) -> None:
    import kairox
    with pytest.raises(ValueError, match="balancer="):
        kairox.Llama(str(model4), sparse="predicted", gpu_slots=SLOTS, slots_device="CPU", verbose=False,
                     balancer_pipeline=True)
    with pytest.raises(ValueError, match="balancer_decide"):
        kairox.Llama(str(model4), sparse="predicted", gpu_slots=SLOTS, slots_device="CPU", verbose=False,
                     balancer=True, balancer_pipeline=True, balancer_decide="gpu")
    llm = kairox.Llama(str(model4), sparse="predicted", gpu_slots=SLOTS, slots_device="CPU", verbose=False)
    try:
        with pytest.raises(ValueError, match="pipeline"):
            llm.start_balancer(True, pipeline=True, observe=True)
        with pytest.raises(ValueError, match="decide"):
            llm.start_balancer(True, pipeline=True, decide="elsewhere")
        with pytest.raises(ValueError, match="late_every"):
            llm.start_balancer(True, pipeline=True, late_every=-1)
    finally:
        llm.close()


def test_pipeline_stops_and_the_graph_drops_its_nodes(model4: Path) -> None:
    """Stopping the pipeline rebuilds the graph without its nodes: no more prefetch steps,
    and the output is still the unsplit run's."""
    want_toks, _, ref, _ = gen(model4, "predicted")
    ref.close()
    import kairox
    llm = kairox.Llama(str(model4), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                       verbose=False, sparse="predicted", gpu_slots=SLOTS, slots_device="CPU",
                       balancer=fast(), balancer_pipeline=True, balancer_backoff=None)
    try:
        llm.eval(PROMPT)
        toks = []
        for k in range(N_GEN):
            if k == N_GEN // 2:
                n_before = len(llm.balance_trace())
                assert n_before > 0
                llm.start_balancer(None)
                llm.start_balancer(fast(), decide="inline")  # the between-decodes balancer again
            toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([toks[-1]])
        assert toks == want_toks
        assert all(r["late"] == 0 for r in llm.balance_trace())
    finally:
        llm.close()


def test_run_cli_pipeline_needs_the_balancer(model4: Path, capsys) -> None:
    from kairox.cli import main
    assert main(["run", "-m", str(model4), "-n", "2", "--pipeline"]) == 2
    assert "--balancer" in capsys.readouterr().err
    assert main(["run", "-m", str(model4), "-n", "2", "--balancer", "fixed", "--balancer-thread"]) == 2
    assert "--pipeline" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the reference alone

def test_reference_one_hit_wonders_never_enter() -> None:
    ref = PrefetchLayer(16, [0, 1, 2, 3], BalancerConfig(lam=0.5, eps=0.01, adaptive=False))
    for g in range(4, 16):  # each group predicted once
        d = ref.step([g])
        assert d.admit == [] and d.evict == []
    assert ref.residents() == [0, 1, 2, 3]


def test_reference_sustained_use_displaces_the_coldest_unpredicted() -> None:
    ref = PrefetchLayer(16, [0, 1, 2, 3], BalancerConfig(lam=0.5, eps=0.01, adaptive=False))
    ref.step([0, 1, 2])            # 3 never predicted: the coldest
    d = ref.step([0, 1, 2, 9])     # 9 once: below τ
    assert d.admit == []
    d = ref.step([0, 1, 2, 9])     # 9 twice: 0.5·0.5+0.5 = 0.75 > τ = 0.51; 3 scores 0
    assert d.admit == [9] and d.evict == [3]
    assert ref.residents() == [0, 1, 2, 9]
    # a predicted resident is never a victim, even when colder than the candidate
    d = ref.step([3, 9, 10])
    d = ref.step([3, 9, 10, 11])
    assert 9 in ref.residents() and all(v not in (3, 9, 10, 11) for v in d.evict)


def test_reference_late_loads_skip_and_land() -> None:
    cfg = BalancerConfig(lam=0.2, eps=0.01, adaptive=False)
    ref = PrefetchLayer(8, [0, 1, -1], cfg)
    ref.step([5])
    d = ref.step([5], late=2)      # 5 takes the free slot; its rows have not landed
    assert d.admit == [5] and ref.residents() == [0, 1]
    d = ref.step([6], late=1 | 2)  # still in flight at the next step (no decision) and at its end
    assert d.admit == [] and ref.residents() == [0, 1]
    d = ref.step([6, 7])           # landed now: resident, and the step decides again
    assert ref.residents() == [0, 1, 5]
    assert d.admit == []           # 6 predicted twice but the skipped steps did not score it
    assert tam_key(0.5, True, 3) > tam_key(0.5, False, 2)  # a resident wins a tie
