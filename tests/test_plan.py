"""The placement solver (kairox.plan) against brute force, and `kairox plan`."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from kairox.cli import main
from kairox.plan import (MiB, DenseItem, HwProfile, PlanError, dense_groups, make_plan, names_text, parse_size, solve_dense, solve_slots,
                         solve_slots_exact)
from kairox.gguf_header import scan_header
from kairox.synth import Shape, synth

HW = HwProfile(cpu_gbs=50.0, gpu_gbs=2000.0, pcie_gbs=50.0, handoff_us=40.0)


def brute_dense(items: list[DenseItem], budget: int, hw: HwProfile) -> float:
    hop = hw.handoff_us * 1e-6 / 2
    best = np.inf
    for on in itertools.product((0, 1), repeat=len(items)):
        if sum(it.nbytes for it, g in zip(items, on) if g) > budget:
            continue
        t, prev = 0.0, 0
        for it, g in zip(items, on):
            t += it.nbytes / ((hw.gpu_gbs if g else hw.cpu_gbs) * 1e9) + (hop if g != prev else 0)
            prev = g
        best = min(best, t + (hop if prev else 0))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dense_knapsack_is_optimal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    items = [DenseItem(f"t{i}", int(rng.integers(1, 40)) * MiB) for i in range(9)]
    budget = int(rng.integers(20, 150)) * MiB
    on, t = solve_dense(items, budget, HW, unit=MiB)
    assert sum(it.nbytes for it, g in zip(items, on) if g) <= budget
    assert t == pytest.approx(brute_dense(items, budget, HW), rel=1e-9)


def test_handoffs_can_keep_a_small_tensor_on_the_cpu() -> None:
    # a tiny tensor between two CPU tensors: moving it saves less than its two hand-offs
    items = [DenseItem("a", 100 * MiB), DenseItem("tiny", 1 * MiB), DenseItem("b", 100 * MiB)]
    on, _ = solve_dense(items, 1 * MiB, HW, unit=MiB)
    assert on == [False, False, False]
    on, _ = solve_dense(items, 300 * MiB, HW, unit=MiB)
    assert on == [True, True, True]


def runtime_dense(items: list[DenseItem], budget: int, hw: HwProfile, unit: int) -> tuple[list[bool], float]:
    """kx_plan_dense, the load path's knapsack (C++), on the items solve_dense takes (a pinned
    point cannot run on the CPU: an infinite time there, as the load path gives it)."""
    import ctypes
    from kairox.llama import _lib
    n = len(items)
    nb = (ctypes.c_int64 * n)(*[it.nbytes for it in items])
    cpu = (ctypes.c_double * n)(*[math.inf if it.pinned else it.seconds(hw.cpu_rate) for it in items])
    gpu = (ctypes.c_double * n)(*[it.seconds(hw.gpu_rate) for it in items])
    on = (ctypes.c_bool * n)()
    t = _lib.kx_plan_dense(nb, cpu, gpu, n, budget, unit, hw.handoff_us * 1e-6 / 2, on)
    return list(on), t


def test_the_runtime_knapsack_is_the_reference(native: Path) -> None:
    """kx_plan_dense, the load path's knapsack (C++), against solve_dense on random tensors of
    mixed types and measured rates, budgets from nothing to more than all."""
    from kairox.llama import _lib
    rng = np.random.default_rng(11)
    hw = HwProfile(cpu_gbs=60.0, gpu_gbs=2000.0, handoff_us=23.5, cpu_type_gbs={"q4_0": 25.0})
    moved = kept = 0
    for _ in range(40):
        n = int(rng.integers(1, 50))
        items = [DenseItem(f"t{i}", int(rng.integers(1, 200 * MiB)), str(rng.choice(["f16", "q4_0"])))
                 for i in range(n)]
        budget = int(rng.integers(0, int(sum(it.nbytes for it in items) * 1.2)))
        unit = int(rng.choice([MiB, 16 * MiB]))
        want, t = solve_dense(items, budget, hw, unit=unit)
        on, got = runtime_dense(items, budget, hw, unit)
        assert got == pytest.approx(t, rel=1e-12) and on == want
        moved += want.count(False)
        kept += want.count(True)
    assert moved and kept  # both sides were chosen
    assert _lib.kx_plan_dense(None, None, None, 0, 1 << 30, MiB, 0.0, None) == 0.0  # nothing to place
    assert _lib.kx_plan_dense(None, None, None, 3, 1 << 30, MiB, 0.0, None) < 0  # bad arguments


def kb7b_tensors(types: dict[str, str]) -> list[DenseItem]:
    """KB-7B's dense tensors (the synth preset's shape; the llama SPM vocabulary's 32000 rows of
    output), each of the ggml type its kind is given in `types`, sized by gguf's block table."""
    import gguf
    from kairox.synth import PRESETS
    sh = PRESETS["KB-7B"]

    def item(name: str, kind: str, n: int) -> DenseItem:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[types[kind].upper()]]
        return DenseItem(name, n // block * type_size, types[kind])

    items = []
    for il in range(sh.n_layer):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output"):
            items.append(item(f"blk.{il}.{kind}.weight", kind, sh.n_embd * sh.n_embd))
        for kind in ("ffn_gate", "ffn_up", "ffn_down"):
            items.append(item(f"blk.{il}.{kind}.weight", kind, sh.n_embd * sh.n_ff))
    items.append(item("output.weight", "output", sh.n_embd * 32000))
    return items


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])
def test_the_runtime_knapsack_on_a_recorded_profile(native: Path, quant: str) -> None:
    """The budget sweep's placements at the planner: kx_plan_dense with the rates `kairox
    profile-hw` recorded on the H200 machine (bench/results/hw/profile-hw-h200.json), on KB-7B's
    dense tensors (F16, and Q4_K_M's types), at every budget from 0 to 14 GiB: solve_dense's
    placement and time, never more bytes than the budget, and no slower for a larger budget."""
    hw = HwProfile.from_json(json.loads((Path(__file__).parent.parent / "bench/results/hw/profile-hw-h200.json")
                                        .read_text()))
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
    types = dict.fromkeys(kinds, "f16") if quant == "f16" else \
        {**dict.fromkeys(kinds, "q4_k"), "attn_v": "q6_k", "ffn_down": "q6_k", "output": "q6_k"}
    items = dense_groups(kb7b_tensors(types))
    last = math.inf
    for gib in range(15):
        budget = gib << 30
        want, t = solve_dense(items, budget, hw, unit=MiB)
        on, got = runtime_dense(items, budget, hw, MiB)
        assert got == pytest.approx(t, rel=1e-12) and on == want, gib
        assert sum(it.nbytes for it, g in zip(items, on) if g) <= budget
        assert t <= last
        last = t
    # 14 GiB holds every tensor; at 0 only the pinned points (no bytes) run on the GPU
    assert all(on) and [it.pinned for it in items] == runtime_dense(items, 0, hw, MiB)[0]


def test_the_runtime_orders_and_groups_tensors_as_the_reference(native: Path) -> None:
    """kx_place_order (C++) against dense_groups on shuffled tensor sets of dense and MoE
    layers: the same items in the same execution order, tensors side by side (q/k/v, gate/up,
    a layer's experts) one item."""
    import ctypes
    from kairox.llama import _lib
    kinds = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_qkv.weight",
             "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
             "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
             "ffn_norm_other.weight"]
    rng = np.random.default_rng(5)
    for _ in range(60):
        names = [f"blk.{il}.{k}" for il in range(int(rng.integers(1, 5))) for k in kinds if rng.random() < 0.6]
        names += [n for n in ("output.weight", "rope_freqs.weight") if rng.random() < 0.5]
        names = [str(x) for x in rng.permutation(names)]
        want = dense_groups([DenseItem(n, 1) for n in names])  # the pinned points hold no names
        group = (ctypes.c_int32 * max(len(names), 1))()
        got = _lib.kx_place_order((ctypes.c_char_p * max(len(names), 1))(*[n.encode() for n in names]), len(names),
                                  group)
        assert got == len(want)
        assert [sorted(n for n, g in zip(names, group) if g == k) for k in range(got)] == \
            [sorted(it.names) for it in want]
    order = [it.names or it.name for it in dense_groups([DenseItem(n, 1) for n in (
        "output.weight", "blk.0.ffn_down_exps.weight", "blk.0.attn_output.weight", "blk.0.ffn_up_exps.weight",
        "blk.0.ffn_gate_inp.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_down.weight",
        "blk.1.ffn_up.weight")])]
    assert order == ["blk.0.attn_norm", ("blk.0.attn_q.weight",), "blk.0.attention", ("blk.0.attn_output.weight",),
                     "blk.0.ffn_norm", ("blk.0.ffn_gate_inp.weight",),
                     ("blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"),
                     "blk.1.attn_norm", "blk.1.attention", "blk.1.ffn_norm", ("blk.1.ffn_up.weight",),
                     ("blk.1.ffn_down.weight",), ("output.weight",)]
    assert _lib.kx_place_order(None, 2, None) == -1
    twice = (ctypes.c_char_p * 2)(b"a", b"a")
    assert _lib.kx_place_order(twice, 2, (ctypes.c_int32 * 2)()) == -1  # a name twice


def brute_slots(freqs, gbytes, budget, hw):
    def t(f, k):
        f = np.sort(f)[::-1]
        return max(f[k:].sum() / (hw.cpu_gbs * 1e9), f[:k].sum() / (hw.gpu_gbs * 1e9)) * gbytes
    best = np.inf
    for ks in itertools.product(*[range(len(f) + 1) for f in freqs]):
        if sum(ks) * gbytes <= budget:
            best = min(best, sum(t(f, k) for f, k in zip(freqs, ks)))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_slot_allocation_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    freqs = [rng.exponential(1.0, 5) * rng.uniform(0.2, 3) for _ in range(3)]
    budget = int(rng.integers(1, 15)) * MiB
    hw = HwProfile(cpu_gbs=50.0, gpu_gbs=120.0)  # close speeds: balancing matters
    slots, t = solve_slots(freqs, [MiB] * 3, budget, hw)
    assert sum(len(s) for s in slots) * MiB <= budget
    for f, s in zip(freqs, slots):  # hottest groups first
        assert list(s) == list(np.argsort(-f, kind="stable")[:len(s)])
    assert t == pytest.approx(brute_slots(freqs, MiB, budget, hw), rel=1e-9)


def test_expert_tensors_count_the_share_a_token_reads() -> None:
    """An MoE expert tensor (8 of 64 experts read per token) saves an eighth of what an
    attention matrix of its size saves per byte of VRAM: with room for one, attention stays."""
    hw = HwProfile(cpu_gbs=50.0, gpu_gbs=1000.0, handoff_us=0.0)
    attn = DenseItem("blk.0.attn_q.weight", 64 * MiB)
    exps = DenseItem("blk.0.ffn_up_exps.weight", 64 * MiB, read=8 / 64)
    for order in ([attn, exps], [exps, attn]):
        on, t = solve_dense(order, 64 * MiB, hw, unit=MiB)
        assert [it.name for it, g in zip(order, on) if g] == [attn.name]
        assert t == pytest.approx(64 * MiB / 1e12 + 64 * MiB * 8 / 64 / 50e9)


def test_a_model_without_a_pack_is_planned_in_whole_tensors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """No pack (an MoE model has none): no slots, the FFN's tensors are knapsack items, and an
    expert tensor (4 of 32 experts read per token) goes to the CPU before any other matrix."""
    shape = Shape(2, 512, 512, 8, 2, "f16", n_expert=32, n_expert_used=4, head_dim=64)
    m = synth(tmp_path / "moe.gguf", shape, act="silu", quiet=True)
    hw = dataclasses.replace(HW, handoff_us=0.0)  # this small a model's layers would not pay for a hand-off
    everything = make_plan(m, 1 << 30, hw, reserved=MiB)
    assert everything.dense_cpu == [] and everything.slots == [] and everything.bytes["slots"] == 0
    experts = [n for n in everything.dense_gpu if "_exps" in n]
    assert len(experts) == 6 and len(everything.dense_gpu) == 6 + 2 * 5 + 1  # + q k v o router, output
    # room (at the DP's 1 MiB resolution) for every other matrix and one layer's experts and a
    # half: a layer's three expert tensors move together
    sizes = {t.name: -(-t.nbytes // MiB) * MiB for t in scan_header(m).tensors}
    room = sum(sizes[n] for n in everything.dense_gpu if n not in experts) + 4 * sizes[experts[0]]
    p = make_plan(m, room + MiB, hw, reserved=MiB)
    assert set(p.dense_gpu) == set(everything.dense_gpu) - set(p.dense_cpu)
    assert len(p.dense_cpu) == 3 and all("_exps" in n for n in p.dense_cpu)
    assert len({n.split(".")[1] for n in p.dense_cpu}) == 1  # one layer's
    assert main(["plan", str(m), "--budget", f"{(room + MiB) // MiB}MiB", "--reserve", "1MiB", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "FFN slots: none (no sparse pack" in text and "dense on the CPU: " in text
    assert names_text(["blk.0.attn_q.weight", "output.weight", "blk.3.attn_q.weight", "blk.1.attn_q.weight",
                       "blk.2.ffn_up_exps.weight"]) == "attn_q.weight 0-1,3; ffn_up_exps.weight 2; output.weight"


def test_busier_layers_get_more_slots() -> None:
    freqs = [np.full(100, 0.5), np.full(100, 2.0)]
    slots, _ = solve_slots(freqs, [MiB, MiB], 60 * MiB, HW)
    assert len(slots[1]) > len(slots[0]) and len(slots[0]) + len(slots[1]) == 60


def test_parse_size() -> None:
    assert parse_size("7GiB") == 7 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == int(1.5 * (1 << 30)) and parse_size("100") == 100
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_plan_a_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    m = synth(tmp_path / "m.gguf", Shape(4, 256, 1024, 4, 4, "f32"), quiet=True)
    assert main(["pack", str(m), "-q"]) == 0
    budget = 40 * MiB
    rc = main(["plan", str(m), "--budget", "40MiB", "--reserve", "8MiB", "--explain"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "FFN slots" in text and "layer   3" in text
    plan = json.loads((tmp_path / "m.kxplan.json").read_text())
    assert plan["bytes"]["dense_gpu"] + plan["bytes"]["slots"] <= budget - 8 * MiB
    assert len(plan["slots"]) == 4 and any(len(s) > 0 for s in plan["slots"])
    p = make_plan(m, 1 << 30, HW)  # everything fits
    assert all(len(s) == n for s, n in zip(p.slots, p.n_groups)) and p.dense_cpu == []
    with pytest.raises(PlanError, match="leaves nothing"):
        make_plan(m, 100 * MiB, HW)
    assert main(["plan", str(m), "--budget", "1MiB"]) == 2
    assert "leaves nothing" in capsys.readouterr().err


def test_the_plan_splits_the_budget_at_the_least_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense tensors and slots share the budget: the planner's split is the least modelled
    time over its grid, never worse than a coarser grid's (which holds the old fixed 75% cap
    and dense-first), and within the budget."""
    import kairox.plan as planmod
    m = synth(tmp_path / "m.gguf", Shape(4, 256, 1024, 4, 4, "f32"), quiet=True)
    assert main(["pack", str(m), "-q"]) == 0
    total = lambda p: p.seconds["dense"] + p.seconds["ffn"]  # noqa: E731
    for budget in (24 * MiB, 40 * MiB, 56 * MiB):
        fine = make_plan(m, budget, HW, reserved=8 * MiB)
        assert fine.bytes["dense_gpu"] + fine.bytes["slots"] <= budget - 8 * MiB
        monkeypatch.setattr(planmod, "PLAN_SPLITS", 4)  # shares 0, 1/4, 1/2, 3/4, all
        coarse = make_plan(m, budget, HW, reserved=8 * MiB)
        monkeypatch.setattr(planmod, "PLAN_SPLITS", 1)  # none or all
        ends = make_plan(m, budget, HW, reserved=8 * MiB)
        monkeypatch.undo()
        assert total(fine) <= total(coarse) <= total(ends)


def test_profile_rates_round_trip_and_reject_nonsense() -> None:
    d = {"cpu_gbs": 90.0, "gpu_gbs": 4000.0, "pcie_gbs": 55.0, "handoff_us": 20.0,
         "cpu_type_gbs": {"f16": 80.0, "q4_0": 30.0}, "gpu_type_gbs": {"q4_0": 2500.0}, "details": {}}
    hw = HwProfile.from_json(d)
    assert hw.cpu_rate("q4_0") == 30e9 and hw.cpu_rate("q8_0") == 90e9  # unmeasured type: streaming read
    assert hw.gpu_rate("q4_0") == 2500e9 and hw.gpu_rate("f16") == 4000e9
    plan_hw = json.loads(json.dumps({"hw": dataclasses.asdict(hw)}))["hw"]
    assert HwProfile.from_json(plan_hw) == hw  # a plan file keeps the rates
    with pytest.raises(ValueError, match="cpu_type_gbs"):
        HwProfile.from_json({**d, "cpu_type_gbs": {"q4_0": 0.0}})


def test_measured_type_rates_steer_dense_placement() -> None:
    # two tensors of equal bytes, room for one on the GPU: the one whose type the CPU reads
    # slower goes there (no hand-off difference: each sits alone between CPU tensors)
    items = [DenseItem("a", 64 * MiB, "f16"), DenseItem("pad1", 64 * MiB, "f32"),
             DenseItem("b", 64 * MiB, "q4_0"), DenseItem("pad2", 64 * MiB, "f32")]
    slow_q4 = HwProfile(cpu_gbs=50.0, gpu_gbs=2000.0, handoff_us=1.0, cpu_type_gbs={"f16": 50.0, "q4_0": 20.0})
    slow_f16 = HwProfile(cpu_gbs=50.0, gpu_gbs=2000.0, handoff_us=1.0, cpu_type_gbs={"f16": 20.0, "q4_0": 50.0})
    on, t = solve_dense(items, 64 * MiB, slow_q4, unit=MiB)
    assert on == [False, False, True, False]
    # a, pad1, pad2 read on the CPU at 50 GB/s, b on the GPU, two one-way hand-offs of 0.5 µs
    assert t == pytest.approx(3 * 64 * MiB / 50e9 + 64 * MiB / 2000e9 + 1e-6, rel=1e-9)
    on, _ = solve_dense(items, 64 * MiB, slow_f16, unit=MiB)
    assert on == [True, False, False, False]


def test_measured_type_rates_steer_slots() -> None:
    # identical layers but for their FFN type: the layer whose type the CPU computes slower
    # gets more of the slots
    freqs = [np.full(100, 1.0), np.full(100, 1.0)]
    hw = HwProfile(cpu_gbs=50.0, gpu_gbs=2000.0, cpu_type_gbs={"q4_0": 20.0, "f16": 50.0})
    slots, _ = solve_slots(freqs, [MiB, MiB], 80 * MiB, hw, types=["f16", "q4_0"])
    assert len(slots[1]) > len(slots[0]) and len(slots[0]) + len(slots[1]) == 80
    slots, _ = solve_slots(freqs, [MiB, MiB], 80 * MiB, hw, types=["q4_0", "f16"])
    assert len(slots[0]) > len(slots[1]) and len(slots[0]) + len(slots[1]) == 80


def test_matvec_rates_are_measured_by_ggml(native: Path) -> None:
    from kairox.hw import MATVEC_TYPES, matvec_rates, matvec_seconds
    s, nb = matvec_seconds("q4_0", 8 << 20, threads=1, reps=2)
    assert nb == (8 << 20) // (4096 // 32 * 18) * (4096 // 32 * 18) and 0 < s < 10  # whole Q4_0 rows
    for bad in ("q8_1", "nope"):
        with pytest.raises((RuntimeError, ValueError), match="unsupported|unknown"):
            matvec_seconds(bad, 1 << 20)
    for t in MATVEC_TYPES:  # every type profile-hw measures by default has a kernel here
        assert matvec_seconds(t, 1 << 20, threads=1, reps=1)[1] > 0, t
    r = matvec_rates(1, types=("f16", "q4_0"), cpu_bytes=16 << 20, gpu_bytes=16 << 20)
    assert set(r["cpu"]) == {"f16", "q4_0"} and all(0.1 < v < 5000 for v in r["cpu"].values())
    from kairox._native import has_gpu
    assert bool(r["gpu"]) == has_gpu()


def test_matvec_rates_keep_each_types_best_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU types are measured in interleaved passes and each keeps its best: a type slow
    in one pass only (another pool's threads still spinning) is not priced at that pass."""
    import kairox._native
    import kairox.hw as hwmod
    calls: list[str] = []

    def fake(t: str, n: int, gpu: bool = False, threads: int | None = None, reps: int = 5) -> tuple[float, int]:
        calls.append(t)
        slow = t == "f16" and calls.count("f16") == 1  # the first f16 measurement only
        return (4.0 if slow else 1.0) * (2.0 if t == "q4_0" else 1.0), 10 ** 9
    monkeypatch.setattr(hwmod, "matvec_seconds", fake)
    monkeypatch.setattr(kairox._native, "has_gpu", lambda: False)
    r = hwmod.matvec_rates(types=("f16", "q4_0"))
    assert calls == ["f16", "q4_0", "f16", "q4_0"]
    assert r == {"cpu": {"f16": 1.0, "q4_0": 0.5}, "gpu": {}}
    calls.clear()
    assert hwmod.matvec_rates(types=("f16", "q4_0"), passes=1)["cpu"]["f16"] == 0.25


def test_profile_hw_says_how_it_was_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    import kairox.hw as hwmod
    monkeypatch.setattr(hwmod, "profile", lambda threads: {
        "cpu_gbs": 90.0, "gpu_gbs": 4000.0, "pcie_gbs": 55.0, "handoff_us": 23.5,
        "cpu_type_gbs": {"q4_0": 40.0}, "gpu_type_gbs": {}, "details": {"gpu": True}})
    out = tmp_path / "hw.json"
    assert main(["profile-hw", "-t", "3", "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["command"] == f"kairox profile-hw -t 3 -o {out}" and d["commit"] and "cpus" in d["machine"]
    hw = HwProfile.from_json(d)  # the stamp does not get in the plan's way
    assert hw.cpu_rate("q4_0") == 40e9 and hw.cpu_gbs == 90.0
    assert "CPU matvec GB/s: q4_0 40.0" in capsys.readouterr().out


def _random_slot_case(rng: np.random.Generator) -> tuple[list[np.ndarray], list[int], int, list[str]]:
    """Heavy-tailed group frequencies, layers of different group sizes and weight types."""
    L = int(rng.integers(2, 6))
    freqs = [np.sort(rng.pareto(1.2 + rng.random(), size=int(rng.integers(15, 70))) * rng.random() + 0.01)[::-1]
             for _ in range(L)]
    gbytes = [int(rng.integers(1, 4)) * MiB for _ in range(L)]
    total = sum(len(f) * g for f, g in zip(freqs, gbytes))
    return freqs, gbytes, int(total * rng.uniform(0.05, 0.9)), [str(rng.choice(["f16", "q4_0", ""])) for _ in range(L)]


def test_the_runtime_slot_solve_is_the_reference(native: Path) -> None:
    """kx_plan_slots, the load path's per-layer slot solve (C++), against solve_slots: group
    frequencies in id order (heavy-tailed, with ties), mixed group sizes and weight types,
    close and far CPU/GPU rates, budgets from nothing to more than all."""
    import ctypes
    from kairox.llama import _lib
    rng = np.random.default_rng(23)
    spread = set()
    for case in range(60):
        hw = HW if case % 2 else HwProfile(cpu_gbs=50.0, gpu_gbs=120.0, cpu_type_gbs={"q4_0": 20.0})
        freqs, gbytes, budget, types = _random_slot_case(rng)
        freqs = [rng.permutation(f) for f in freqs]
        if case % 3 == 0:
            freqs = [np.round(f, 1) for f in freqs]  # equal frequencies: ties break alike
        if case % 10 == 0:
            budget = int(sum(len(f) * g for f, g in zip(freqs, gbytes)) * 1.1)
        rows = [int(rng.integers(1, 64)) for _ in freqs]
        want, t = solve_slots(freqs, gbytes, budget, hw, rows, types)
        L = len(freqs)
        taken = (ctypes.c_int64 * L)()
        got = _lib.kx_plan_slots((ctypes.c_double * sum(map(len, freqs)))(*np.concatenate(freqs)),
                                 (ctypes.c_int64 * L)(*map(len, freqs)), (ctypes.c_int64 * L)(*gbytes),
                                 (ctypes.c_int64 * L)(*rows), (ctypes.c_double * L)(*[hw.cpu_rate(ty) for ty in types]),
                                 (ctypes.c_double * L)(*[hw.gpu_rate(ty) for ty in types]), L, budget, taken)
        assert list(taken) == [len(w) for w in want] and got == pytest.approx(t, rel=1e-12)
        spread.add(len({len(w) for w in want}) > 1)
    assert spread == {True, False}  # the layers got different counts, and (a full budget) equal ones
    zero = (ctypes.c_int64 * 1)(0)
    assert _lib.kx_plan_slots(None, None, None, None, None, None, 0, MiB, None) == 0.0  # no layers
    assert _lib.kx_plan_slots(None, zero, zero, zero, None, None, 1, MiB, zero) < 0  # bad arguments


@pytest.mark.parametrize("seed", range(4))
def test_exact_slot_solve_is_the_optimum(seed: int) -> None:
    """The MILP reference against every subset of every layer's groups (tiny cases)."""
    pytest.importorskip("scipy", reason="the exact slot solve's reference needs SciPy")
    rng = np.random.default_rng(100 + seed)
    hw = HwProfile(cpu_gbs=50.0, gpu_gbs=120.0)
    freqs = [rng.exponential(1.0, 4) * rng.uniform(0.2, 3) for _ in range(2)]
    gbytes = [MiB, 2 * MiB]
    budget = int(rng.integers(2, 10)) * MiB
    a = [g / hw.cpu_rate("") for g in gbytes]
    b = [g / hw.gpu_rate("") for g in gbytes]
    best = math.inf
    for bits in itertools.product((0, 1), repeat=8):
        x = [np.array(bits[:4], bool), np.array(bits[4:], bool)]
        if sum(int(x[l].sum()) * gbytes[l] for l in range(2)) > budget:
            continue
        best = min(best, sum(max(a[l] * freqs[l][~x[l]].sum(), b[l] * freqs[l][x[l]].sum()) for l in range(2)))
    slots, t = solve_slots_exact(freqs, gbytes, budget, hw, rel_gap=1e-9)
    assert sum(len(s) * g for s, g in zip(slots, gbytes)) <= budget
    assert t == pytest.approx(best, rel=1e-7)


def test_greedy_slot_solve_is_within_one_percent_of_the_exact_one() -> None:
    """The planner's greedy (best seconds saved per byte, then exchanges at the budget's edge)
    against the MILP on random cases; a greedy by gain alone is up to 10% off on these."""
    pytest.importorskip("scipy", reason="the exact slot solve's reference needs SciPy")
    rng = np.random.default_rng(7)
    worst = 0.0
    for _ in range(24):
        freqs, gbytes, budget, types = _random_slot_case(rng)
        slots, t = solve_slots(freqs, gbytes, budget, HW, types=types)
        assert sum(len(s) * g for s, g in zip(slots, gbytes)) <= budget
        _, t_exact = solve_slots_exact(freqs, gbytes, budget, HW, types=types)
        assert t >= t_exact * (1 - 1e-4)  # (the reference stops within 1e-4 of the optimum)
        worst = max(worst, t / t_exact - 1)
    assert worst <= 0.01, f"greedy {100 * worst:.2f}% above the optimum"


def test_dense_items_of_a_gguf(tmp_path: Path) -> None:
    """plan.dense_items: every matrix but the token embeddings, norms left out, an MoE expert
    tensor read at n_expert_used / n_expert of its bytes, and the names `skip` matches left out."""
    from kairox.gguf_header import scan_header
    from kairox.plan import FFN_RE, dense_items
    from kairox.synth import PRESETS, synth
    out = tmp_path / "moe.gguf"
    synth(out, PRESETS["KB-MoE-tiny"], act="silu", quiet=True)
    hdr = scan_header(out)
    items = {it.name: it for it in dense_items(hdr)}
    assert "token_embd.weight" not in items and not any("norm" in n for n in items)
    assert items["blk.0.ffn_up_exps.weight"].read == 2 / 8 and items["blk.0.attn_q.weight"].read == 1.0
    assert {it.name for it in dense_items(hdr, skip=FFN_RE)} == set(items)  # experts do not match FFN_RE
    assert "blk.1.attn_q.weight" not in {it.name for it in dense_items(hdr, skip=re.compile(r"blk\.1\."))}
