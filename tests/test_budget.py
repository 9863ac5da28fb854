"""VRAM budget arithmetic (kairox.budget), plan files the runtime loads, and the budget on
a GPU (skipped without one; bench/device/hybrid.sh runs it on the GPU machine)."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from kairox.budget import VramBudgetError, VramReport, auto_slots, check_slots, margin_for, shrink
from kairox.plan import HwProfile, Plan, PlanError, SlotCosts
from test_hybrid import synth_model  # noqa: F401  (KB-tiny with a pack: a pytest fixture)

MiB = 1 << 20
COSTS = SlotCosts(n_layer=4, n_ff=1000, per_neuron=8192, pred=10 * MiB)


def test_auto_slots_fill_what_the_base_leaves() -> None:
    budget, base = 1024 * MiB, 600 * MiB
    s = auto_slots(budget, base, COSTS)
    left = budget - margin_for(budget) - base - COSTS.pred
    assert s == min(COSTS.n_ff, left // (COSTS.per_neuron * COSTS.n_layer))
    # one more slot per layer would not fit
    assert base + COSTS.pred + (s + 1) * COSTS.per_neuron * COSTS.n_layer + margin_for(budget) > budget or s == COSTS.n_ff
    check_slots(budget, base, COSTS, [s] * COSTS.n_layer)  # the chosen counts pass the check
    assert auto_slots(64 << 30, base, COSTS) == COSTS.n_ff  # clipped at the layer's neurons


def test_budgets_that_cannot_fit_say_why() -> None:
    with pytest.raises(VramBudgetError, match="too small.*took 600 MiB.*at least 856 MiB"):
        auto_slots(500 * MiB, 600 * MiB, COSTS)
    with pytest.raises(VramBudgetError, match="too small.*margin of 256 MiB"):
        auto_slots(820 * MiB, 600 * MiB, COSTS)
    # room for the base and its margin but not for the slots' predictors: no slots
    assert auto_slots(860 * MiB, 600 * MiB, COSTS) == 0
    with pytest.raises(VramBudgetError, match="over the budget.*--reserve"):
        check_slots(880 * MiB, 600 * MiB, COSTS, [1000] * 4)


def test_shrink_gives_the_overflow_back() -> None:
    counts = [900, 900, 10, 900]
    for over in (1, 3 * MiB, 20 * MiB, 10**12):
        out = shrink(counts, over, COSTS)
        assert all(0 <= b <= a for a, b in zip(counts, out))
        freed = (sum(counts) - sum(out)) * COSTS.per_neuron
        assert freed >= over or not any(out)  # enough given back, or nothing left to give
        assert freed < over + len(counts) * COSTS.per_neuron  # and not much more


def test_report_text() -> None:
    r = VramReport(budget=7 << 30, base=5 << 30, slots=1 << 30, used=int(6.5 * (1 << 30)), slot_counts=[10, 20])
    assert re.search(r"VRAM 6656 MiB of 7168 MiB: base 5120 MiB .* slots 1024 MiB \(30 neurons\), rest 512 MiB", r.text())


def _plan(tmp: Path, model: str, n_layer: int, neurons: list[int], dense_cpu: list[str] | None = None) -> Path:
    p = Plan(model, 1 << 30, HwProfile(), [], ["output.weight"] if dense_cpu is None else dense_cpu,
             [[0]] * n_layer, [8] * n_layer, 0, slot_neurons=neurons)
    f = tmp / "m.kxplan.json"
    f.write_text(p.to_json())
    return f


def test_plan_files_round_trip_and_refuse_old_or_foreign_ones(tmp_path: Path) -> None:
    f = _plan(tmp_path, "m.gguf", 2, [32, 64])
    assert Plan.read(f).slot_neurons == [32, 64]
    d = json.loads(f.read_text())
    del d["slot_neurons"]
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="older plan"):
        Plan.read(f)
    f.write_text("{not json")
    with pytest.raises(PlanError, match="not a kairox plan"):
        Plan.read(f)
    with pytest.raises(PlanError, match="cannot read"):
        Plan.read(tmp_path / "missing.json")


def test_a_plan_keeps_exactly_its_named_tensors_in_host_memory(tmp_path: Path, synth_model: Path) -> None:
    """The runtime's overrides (kx_model_params_apply) put the FFN and the plan's CPU tensors
    in kairox's page-locked host buffers and nothing else: attn_q of layer 1 is named, layer
    0's is not, nor attn_q's norm. Without a GPU the slots themselves are refused (fallback: dense),
    but the placement is made at load and can be read."""
    import kairox
    from kairox._native import has_gpu
    if has_gpu():
        pytest.skip("on a GPU every unnamed tensor is on the device: the CPU run tells them apart")
    named = ["blk.1.attn_q.weight", "blk.0.attn_output.weight"]
    f = _plan(tmp_path, synth_model.name, 2, [8, 8], dense_cpu=named)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = kairox.Llama(str(synth_model), sparse="predicted", plan=str(f), verbose=False, fallback="dense")
    try:
        for t in named + ["blk.0.ffn_up.weight", "blk.1.ffn_down.weight", "blk.0.ffn_gate.weight"]:
            assert llm.tensor_buffer_type(t) == "KX_Host_Pinned", t
        for t in ["blk.0.attn_q.weight", "blk.1.attn_output.weight", "blk.0.attn_norm.weight", "output_norm.weight"]:
            assert llm.tensor_buffer_type(t) == "CPU", t
    finally:
        llm.close()


def test_the_runtime_loads_a_plan(tmp_path: Path, synth_model: Path) -> None:
    import kairox
    f = _plan(tmp_path, synth_model.name, 2, [32, 64])
    llm = kairox.Llama(str(synth_model), sparse="predicted", plan=str(f), slots_device="CPU", verbose=False)
    try:
        assert llm.sparse == "predicted" and llm.sparse_error is None
        assert [len(llm.slot_residents(il)) for il in range(2)] == [32, 64]
    finally:
        llm.close()
    other = _plan(tmp_path, "other.gguf", 2, [1, 1])
    with pytest.raises(ValueError, match="made for other.gguf"):
        kairox.Llama(str(synth_model), sparse="predicted", plan=str(other), slots_device="CPU", verbose=False)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers of 1024 x 2816 in F16 with a pack: an FFN (66 MiB) larger than the budget's
    rounding slack, so that a budget can hold part of it."""
    from kairox._native import has_gpu
    from kairox.synth import Shape
    from test_hybrid import permuted_tiny
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    return permuted_tiny(tmp_path_factory.mktemp("place") / "kb-wide.gguf", Shape(4, 1024, 2816, 16, 16, "f16"), 3)


def test_a_budget_below_the_dense_tensors_runs(wide_model: Path) -> None:
    """On a GPU: a budget that cannot hold every dense tensor beside the KV cache and compute
    buffers is not refused. A dry run of the load measures those; the tensors worth the least
    per byte wait in host memory; the run stays under the budget and computes what the
    all-GPU placement computes. A budget below the KV cache and compute buffers is refused
    with their sizes."""
    import kairox
    from kairox.gguf_header import scan_header
    from test_hybrid import PROMPT
    model = wide_model
    dense = {t.name: t.nbytes for t in scan_header(model).tensors
             if "ffn_" not in t.name and t.name != "token_embd.weight" and len(t.ne) >= 2 and t.ne[1] > 1}
    toks = PROMPT + list(range(100, 140))

    def decode(budget: int) -> tuple[np.ndarray, VramReport, dict[str, str | None]]:
        llm = kairox.Llama(str(model), sparse="predicted", vram_budget=budget, n_ctx=256, n_batch=1, n_ubatch=1,
                           logits_all=True, verbose=False)
        try:
            llm.eval(toks)
            assert llm.vram is not None and llm.vram_used() <= budget
            return np.array(llm.scores[:llm.n_tokens]), llm.vram, {t: llm.tensor_buffer_type(t) for t in dense}
        finally:
            llm.close()
    want, full, where = decode(4 << 30)
    assert set(where.values()) == {"CUDA0"}
    # the dense tensors fit, the FFN (in host memory) does not: nothing dense moves (the
    # placement keeps 16 MiB beyond the margin for what the driver adds to its buffers)
    _, v, where = decode(full.base + margin_for(full.base) + 24 * MiB)
    assert set(where.values()) == {"CUDA0"} and v.base == pytest.approx(full.base, abs=64 * MiB)
    # half the dense bytes cannot stay: the rest of the base and the margin still fit
    budget = full.base + margin_for(full.base) - sum(dense.values()) // 2
    got, v, where = decode(budget)
    on_cpu = [t for t, b in where.items() if b != "CUDA0"]
    assert on_cpu and sum(dense[t] for t in on_cpu) >= sum(dense.values()) // 2 - 16 * MiB
    assert v.used <= budget and v.base < full.base
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 2e-3 * scale  # the same model, CPU and GPU kernels
    with pytest.raises(VramBudgetError, match="too small: the KV cache .* and compute buffers .* alone take"):
        decode(margin_for(0) + 1 * MiB)


@pytest.mark.parametrize("kw,match", [
    ({"vram_budget": "lots"}, "vram_budget"), ({"vram_budget": 0}, "vram_budget"),
    ({"gpu_slots": 3, "sparse": "dense"}, "sparse mode"),
    ({"plan": "x.json", "gpu_slots": 3}, "not both")])
def test_bad_hybrid_options_are_refused(synth_model: Path, kw: dict, match: str) -> None:
    import kairox
    with pytest.raises(ValueError, match=match):
        kairox.Llama(str(synth_model), verbose=False, **kw)


def test_budget_on_the_gpu(synth_model: Path) -> None:
    """On a GPU: the runtime measures what it took, stays under the budget, and refuses a
    budget the dense part alone exceeds."""
    import kairox
    from kairox._native import has_gpu
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    budget = 512 * MiB
    llm = kairox.Llama(str(synth_model), sparse="predicted", vram_budget=budget, n_ctx=256, verbose=False)
    try:
        assert llm.vram is not None and 0 < llm.vram.used <= budget
        assert llm.vram.slot_counts == [256, 256]  # KB-tiny's whole FFN fits
        assert llm.slots_bytes == llm.vram.slots > 0
        llm.eval(list(range(1, 40)))
        assert llm.vram_used() <= budget
    finally:
        llm.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(VramBudgetError, match="too small"):
            kairox.Llama(str(synth_model), sparse="predicted", vram_budget=1 * MiB, n_ctx=256, verbose=False)


def test_budget_counts_per_layer_on_the_gpu(wide_model: Path) -> None:
    """On a GPU, a budget that holds about half the FFN: the runtime's per-layer counts are
    the reference's (budget.auto_slot_counts on the pack's frequencies and the measured base)."""
    import kairox
    from kairox.budget import auto_slot_counts
    from kairox.pack import pack_path_for, read_pack
    from kairox.plan import slot_costs
    synth_model = wide_model
    costs = slot_costs(synth_model)
    freqs = [layer.freq for layer in read_pack(pack_path_for(synth_model), synth_model).layers]
    assert not all(np.all(f == 1) for f in freqs)  # measured: the solve, not the equal split, decides
    llm = kairox.Llama(str(synth_model), sparse="predicted", vram_budget=2 << 30, n_ctx=256, verbose=False)
    base = llm.vram.base
    llm.close()
    half = costs.pred + costs.n_layer * costs.n_ff * costs.per_neuron // 2
    assert half > 24 * MiB
    budget = base + margin_for(0) + half  # above the placement's margin and slack: nothing dense moves
    llm = kairox.Llama(str(synth_model), sparse="predicted", vram_budget=budget, n_ctx=256, verbose=False)
    try:
        v = llm.vram
        assert v is not None and v.used <= budget
        want = auto_slot_counts(budget, v.base, costs, freqs)
        assert 0 < sum(want) < costs.n_layer * costs.n_ff
        assert v.slot_counts == want
        llm.eval(list(range(1, 40)))
    finally:
        llm.close()


def test_a_budget_that_holds_the_whole_model_runs_it_dense(wide_model: Path) -> None:
    """On a GPU, the automatic sparse mode: a budget that holds every tensor dense (FFN
    included) beside the KV cache, compute buffers and margin runs the model on the GPU as
    llama.cpp does, without the split (no pack loaded, no slots, the FFN weights in device
    memory); the same budget with an explicit --sparse predicted splits as asked. A budget
    that cannot hold the FFN too splits in the automatic mode as well."""
    import kairox
    from kairox.gguf_header import scan_header
    ffn_mats = {t.name: t.nbytes for t in scan_header(wide_model).tensors if "ffn_" in t.name and len(t.ne) >= 2}
    mats, ffn = list(ffn_mats), sum(ffn_mats.values())
    toks = list(range(1, 40))

    def load(budget: int, **kw: object):
        llm = kairox.Llama(str(wide_model), vram_budget=budget, n_ctx=256, logits_all=True, verbose=False, **kw)
        llm.eval(toks)
        return llm
    llm = load(4 << 30)
    try:
        assert llm.whole_fits and llm.sparse == "dense" and llm.slots_bytes == 0
        assert {llm.tensor_buffer_type(t) for t in mats} == {"CUDA0"}
        assert llm.vram is not None and llm.vram.slots == 0 and llm.vram_used() <= 4 << 30
        want = np.array(llm.scores[:llm.n_tokens])
        base = llm.vram.base
    finally:
        llm.close()
    llm = load(4 << 30, sparse="dense")  # whole tensors by the budget: the same placement (the model read,
    try:                                   # not mapped), the same kernels
        assert float(np.abs(np.array(llm.scores[:llm.n_tokens]) - want).max()) <= 1e-5 * float(np.abs(want).max())
    finally:
        llm.close()
    llm = load(4 << 30, sparse="predicted")
    try:
        assert not llm.whole_fits and llm.sparse == "predicted" and llm.slots_bytes > 0
        assert "CUDA0" not in {llm.tensor_buffer_type(t) for t in mats}  # the split's FFN: host memory
    finally:
        llm.close()
    # the dense tensors and half the FFN: the automatic mode splits
    budget = base - ffn + margin_for(0) + ffn // 2
    llm = load(budget)
    try:
        assert not llm.whole_fits and llm.sparse == "predicted" and llm.slots_bytes > 0
        assert llm.vram_used() <= budget
    finally:
        llm.close()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_budget_without_a_pack_places_whole_tensors(tmp_path: Path, moe: bool) -> None:
    """On a GPU: a model without a pack (never prepared, or MoE, or dense) runs under a budget
    by whole tensors, its FFN's among them; what does not fit computes on the CPU, the logits
    are the all-GPU run's, and nothing of the sparse path runs. An MoE model's experts (2 of
    16 read per token) are what goes to the CPU."""
    import kairox
    from kairox._native import has_gpu
    from kairox.gguf_header import scan_header
    from kairox.synth import Shape, synth
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    if moe:  # F32: CPU and GPU pick the same experts (F16 rounding would flip close routing calls)
        model = synth(tmp_path / "kb-moe.gguf", Shape(4, 1024, 512, 16, 4, "f32", n_expert=16, n_expert_used=2,
                                                      head_dim=64), act="silu", quiet=True)
    else:
        model = synth(tmp_path / "kb-wide.gguf", Shape(4, 1024, 2816, 16, 16, "f16"), quiet=True)
    mats = {t.name: t.nbytes for t in scan_header(model).tensors
            if t.name != "token_embd.weight" and len(t.ne) >= 2 and t.ne[1] > 1}
    toks = list(range(1, 40))

    def decode(budget: int, **kw: object) -> tuple[np.ndarray, VramReport, dict[str, str | None]]:
        llm = kairox.Llama(str(model), vram_budget=budget, n_ctx=256, logits_all=True, verbose=False, **kw)
        try:
            assert llm.sparse == "dense"
            llm.eval(toks)
            assert llm.vram is not None and llm.vram_used() <= budget and llm.vram.slots == 0
            return np.array(llm.scores[:llm.n_tokens]), llm.vram, {t: llm.tensor_buffer_type(t) for t in mats}
        finally:
            llm.close()
    want, full, where = decode(4 << 30)
    assert set(where.values()) == {"CUDA0"}  # the FFN too: no pack keeps it in host memory
    budget = full.base + margin_for(0) + 16 * MiB - sum(mats.values()) // 2
    for kw in ({}, {"sparse": "dense"}):
        got, v, where = decode(budget, **kw)
        on_cpu = [t for t, b in where.items() if b != "CUDA0"]
        assert on_cpu and sum(mats[t] for t in on_cpu) >= sum(mats.values()) // 2 - 16 * MiB
        assert not moe or all("_exps" in t for t in on_cpu), on_cpu
        assert v.used <= budget
        assert float(np.abs(got - want).max()) <= 2e-3 * float(np.abs(want).max())


def test_streamed_tensors_compute_what_the_cpu_computes(tmp_path: Path) -> None:
    """On a GPU: under a budget of whole tensors, some of the host tensors are streamed: copied
    into a GPU scratch ahead of their use and multiplied there, beside the CPU's work. A
    token-by-token decode then gives the all-GPU run's logits, as the run without streaming
    does; each streamed tensor is copied once a token (beyond the two slots' first fills),
    and reports its host memory as where the placement put it. With runtime migration the
    choice follows the rates measured while decoding, and the logits stay the same."""
    import kairox
    from kairox._native import has_gpu
    from kairox.gguf_header import scan_header
    from kairox.synth import Shape, synth
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    # 8 layers: a copy hides behind the CPU's work on the layers before it (4 are too few for
    # the placement's model to find a gain)
    model = synth(tmp_path / "kb-wide.gguf", Shape(8, 1024, 2816, 16, 16, "f16"), act="silu", quiet=True)
    mats = {t.name: t.nbytes for t in scan_header(model).tensors
            if t.name != "token_embd.weight" and len(t.ne) >= 2 and t.ne[1] > 1}
    toks = list(range(1, 48))

    def decode(budget: int, **kw: object) -> tuple[np.ndarray, dict[str, int], dict[str, str | None]]:
        llm = kairox.Llama(str(model), vram_budget=budget, n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True,
                           verbose=False, **kw)
        try:
            llm.eval(toks)
            assert llm.vram is not None and llm.vram_used() <= budget
            return (np.array(llm.scores[:llm.n_tokens]), llm.stream_stats(),
                    {t: llm.tensor_buffer_type(t) for t in mats})
        finally:
            llm.close()
    want, none, _ = decode(4 << 30)
    assert none["tensors"] == 0
    llm = kairox.Llama(str(model), vram_budget=4 << 30, n_ctx=256, verbose=False)
    base = llm.vram.base
    llm.close()
    budget = base + margin_for(0) + 16 * MiB - sum(mats.values()) // 2
    plain, off, where_plain = decode(budget, stream=False)
    mapped, off_mapped, _ = decode(budget, pinned=False)  # streaming needs the page-locked load
    got, st, where = decode(budget)
    assert off["tensors"] == 0 and off_mapped["tensors"] == 0 and "KX_Host_Pinned" not in where_plain.values()
    streamed = [t for t, b in where.items() if b == "KX_Host_Pinned"]  # (without migration: those streamed)
    assert st["tensors"] == st["slotted"] == len(streamed) > 0, (st, where)
    assert st["migrations"] == st["steps"] == 0
    assert st["scratch_bytes"] >= 2 * max(mats[t] for t in streamed)
    if len(streamed) > 2:  # two of them stay in their slots otherwise
        assert st["copies"] >= (len(toks) - 1) * len(streamed)
    assert st["copy_bytes"] >= st["copies"] * min(mats[t] for t in streamed)
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 2e-3 * scale
    assert float(np.abs(plain - want).max()) <= 2e-3 * scale
    assert float(np.abs(mapped - want).max()) <= 2e-3 * scale
    # a hardware profile's PCIe rate prices the copies: over a link this slow nothing streams
    slow_link = tmp_path / "slow-pcie.json"
    slow_link.write_text(json.dumps({"cpu_gbs": 100.0, "gpu_gbs": 2000.0, "pcie_gbs": 1e-3, "handoff_us": 20.0}))
    _, sst, swhere = decode(budget, hw_profile=str(slow_link))
    assert sst["tensors"] == 0 and "KX_Host_Pinned" not in swhere.values(), sst
    # Runtime migration: rates of a CPU of 2 GB/s make the load stream all it can, and hold
    # every host tensor a slot can in page-locked memory. Every decode step is measured; the
    # rates measured differ from those by far more than the threshold, so the choice is made
    # again; whichever set streams after it (the graph split anew), the logits stay the
    # all-GPU run's.
    prof = tmp_path / "slow-cpu.json"
    prof.write_text(json.dumps({"cpu_gbs": 2.0, "gpu_gbs": 2000.0, "pcie_gbs": 50.0, "handoff_us": 20.0}))
    moved, mst, mwhere = decode(budget, hw_profile=str(prof), migrate=True)
    slotted = [t for t, b in mwhere.items() if b == "KX_Host_Pinned"]
    assert mst["slotted"] == len(slotted) >= mst["tensors"] > 0, mst
    assert mst["steps"] >= len(toks) - 1 and mst["choices"] >= 1, mst
    assert mst["migrations"] <= mst["choices"]
    assert float(np.abs(moved - want).max()) <= 2e-3 * scale
