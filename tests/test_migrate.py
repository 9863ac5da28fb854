"""kairox.migrate: the runtime migration policy's reference (rates re-estimated from the last
steps, tensors streamed into GPU scratch when that shortens the step), on modelled decodes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kairox.costs import GB, Rates
from kairox.migrate import (SLOTS, HostTensor, MigrateConfig, Migrator, RateTracker, StepSample, moved, simulate,
                            step_sample, step_time, stream_choice)

MiB = 1 << 20
IDLE = Rates(100.0, 2000.0, 50.0)
CPU_STRESS = Rates(40.0, 2000.0, 50.0)   # 60% of the cores busy: ~40% of the CPU's rate left
PCIE_STRESS = Rates(100.0, 2000.0, 8.0)  # another process copying over the same link


def layers(n_layer: int, host: set[int], nbytes: int, read: float, gpu_total: int) -> tuple[list[HostTensor], int]:
    """A decode step of n_layer layers reading gpu_total resident bytes, the layers in `host`
    each with one tensor left on the CPU halfway through the layer."""
    per = gpu_total // n_layer
    out, before = [], 0
    for il in range(n_layer):
        before += per // 2
        if il in host:
            out.append(HostTensor(f"blk.{il}.ffn", nbytes, before, read))
        before += per - per // 2
    return out, before


def random_step(rng: np.random.Generator, tensors: tuple[int, int], gpu_gbs: tuple[float, float] = (2000.0, 2000.0)):
    """Random host tensors (dense or expert-like; how many: in [tensors)), resident GPU bytes,
    rates and scratch."""
    n = int(rng.integers(*tensors))
    before, ts = 0, []
    for i in range(n):
        before += int(rng.integers(0, 400)) * MiB
        ts.append(HostTensor(f"t{i}", int(rng.integers(8, 300)) * MiB, before, float(rng.choice([1.0, 1 / 16]))))
    gpu = before + int(rng.integers(0, 400)) * MiB
    r = Rates(float(rng.uniform(20, 120)), float(rng.uniform(*gpu_gbs)), float(rng.uniform(5, 60)))
    return ts, gpu, r, int(rng.integers(0, 700)) * MiB


def test_rates_are_bytes_over_seconds_of_the_window() -> None:
    tr = RateTracker(2, IDLE)
    tr.add(StepSample(cpu_bytes=10 * GB, cpu_s=0.2, gpu_bytes=20 * GB, gpu_s=0.01))
    tr.add(StepSample(cpu_bytes=30 * GB, cpu_s=0.6, gpu_bytes=20 * GB, gpu_s=0.01, copy_bytes=1 * GB, copy_s=0.05))
    r = tr.rates()
    assert (r.cpu_gbs, r.gpu_gbs, r.pcie_gbs) == pytest.approx((50.0, 2000.0, 20.0))
    for _ in range(2):  # nothing on the CPU, nothing copied: those rates cannot be seen, the last stay
        tr.add(StepSample(cpu_bytes=0, cpu_s=0, gpu_bytes=10 * GB, gpu_s=0.01))
    assert tr.rates() == Rates(50.0, 1000.0, 20.0)
    assert moved(IDLE, CPU_STRESS) == pytest.approx(0.6) and moved(IDLE, IDLE) == 0


def runs_fit(ts: list[HostTensor], chosen, slots: int = SLOTS) -> bool:
    """No more than `slots` of chosen in a row without a CPU tensor between."""
    run = 0
    for t in ts:
        run = run + 1 if t.name in chosen else 0
        if run > slots:
            return False
    return True


def test_the_choice_is_the_best_of_every_subset() -> None:
    """stream_choice is exact: on random small steps, no other set of streamed tensors (each
    fitting a scratch slot, no more than SLOTS in a row without a CPU tensor between: what the
    runtime streams) makes the step shorter; with as many slots as tensors (no run limit, no
    copy waiting for a slot) the same holds, and some steps would be shorter."""
    rng = np.random.default_rng(1)
    streamed_some = streamed_none = capped = 0
    for _ in range(300):
        ts, gpu, r, scratch = random_step(rng, (1, 8))
        n = len(ts)
        got, t = stream_choice(ts, r, gpu, scratch)
        assert t == pytest.approx(step_time(ts, set(got), r, gpu)[0], rel=1e-12)
        assert all(x.nbytes <= scratch // 2 for x in ts if x.name in got)
        assert runs_fit(ts, got)  # the runtime streams it as chosen
        fits = [c for k in range(n + 1) for c in itertools.combinations([x.name for x in ts], k)
                if all(x.nbytes <= scratch // 2 for x in ts if x.name in c)]
        best = min(step_time(ts, set(c), r, gpu)[0] for c in fits if runs_fit(ts, c))
        assert t == pytest.approx(best, rel=1e-12)
        unlimited = stream_choice(ts, r, gpu, scratch, slots=n)[1]
        assert unlimited == pytest.approx(min(step_time(ts, set(c), r, gpu, slots=n)[0] for c in fits), rel=1e-12)
        capped += unlimited < best * (1 - 1e-9)
        streamed_some += bool(got)
        streamed_none += not got
    assert streamed_some > 30 and streamed_none > 30 and capped >= 3  # every answer was seen


def test_a_copy_that_cannot_hide_is_not_worth_it() -> None:
    """Nothing before the tensor to hide its copy behind, and PCIe slower than the CPU: it stays."""
    t = HostTensor("x", 256 * MiB, 0)
    assert stream_choice([t], IDLE, 0, 1 << 30)[0] == []
    # behind 2 GiB of GPU work (1 ms at 2000 GB/s) a 40 MiB copy (0.8 ms at 50 GB/s) hides: it streams
    hidden = HostTensor("y", 40 * MiB, 2 << 30)
    assert stream_choice([hidden], IDLE, 2 << 30, 1 << 30)[0] == ["y"]
    assert stream_choice([hidden], IDLE, 2 << 30, 79 * MiB)[0] == []  # a slot too small for it
    assert step_time([hidden], {"y"}, IDLE, 2 << 30)[1] == 0.0  # no wait


def test_a_copy_waits_for_its_slot() -> None:
    """Three tensors streamed behind 8 GiB of GPU work, a small CPU tensor between each: with two
    slots the third copy starts only once the first tensor's reader is done (that slot's
    event), not behind the GPU work as a copy engine free to run ahead would place it."""
    big, small = 40 * MiB, MiB
    ts = [HostTensor("a", big, 8 << 30), HostTensor("c1", small, 8 << 30), HostTensor("b", big, 8 << 30),
          HostTensor("c2", small, 8 << 30), HostTensor("c", big, 8 << 30)]
    r, p = IDLE, IDLE.pcie_s(big)
    a_done = r.gpu_s(8 << 30) + r.gpu_s(big)  # copies of a and b (2p) hid behind the GPU work, c's (3p) would
    assert 3 * p < r.gpu_s(8 << 30)
    b_done = a_done + r.cpu_s(small) + r.gpu_s(big)
    c_arrives = max(2 * p, a_done) + p
    c_start = b_done + r.cpu_s(small)
    assert c_arrives > c_start
    t, waited = step_time(ts, {"a", "b", "c"}, r, 8 << 30)
    assert t == pytest.approx(c_arrives + r.gpu_s(big), rel=1e-12)
    assert waited == pytest.approx(c_arrives - c_start, rel=1e-9)
    assert step_time(ts, {"a", "b", "c"}, r, 8 << 30, slots=3)[1] == 0.0  # a third slot: nothing waits
    # the choice knows it: c's wait is longer than the CPU's 40 MiB, so c stays on the CPU
    assert c_arrives - c_start > r.cpu_s(big)
    got, t_best = stream_choice(ts, r, 8 << 30, 1 << 30)
    assert "c" not in got and t_best < t


def test_steady_rates_make_no_new_choice() -> None:
    ts, gpu = layers(32, set(range(16)), 128 * MiB, 1.0, 4 << 30)
    rng = np.random.default_rng(3)
    m = Migrator(ts, gpu, 1 << 30, IDLE)
    first = list(m.streamed)
    for _ in range(200):  # ±5% noise on every measured time
        cpu_b = sum(t.read_bytes for t in ts if t.name not in first)
        s = StepSample(cpu_b, IDLE.cpu_s(cpu_b) * rng.uniform(0.95, 1.05), gpu, IDLE.gpu_s(gpu) * rng.uniform(0.95, 1.05))
        assert m.step(s) is None
    assert m.streamed == first


@pytest.mark.parametrize("cfg", [MigrateConfig(), MigrateConfig(threshold=0.3, cooldown=9, window=4)])
def test_cpu_stress_mid_run_streams_more_and_costs_less(cfg: MigrateConfig) -> None:
    """ATSInfer's experiment, modelled: a CPU stress from step 40. With migration the choice is
    made again within a window and a cooldown, streams more, and the stressed TPOT is lower
    than the load-time choice's; choices stay `cooldown` steps apart."""
    ts, gpu = layers(32, set(range(16)), 128 * MiB, 1.0, 4 << 30)
    load = lambda k: IDLE if k < 40 else CPU_STRESS  # noqa: E731
    with_m, choices = simulate(ts, gpu, 1 << 30, load, 120, cfg=cfg)
    without, none = simulate(ts, gpu, 1 << 30, load, 120, migrate=False, cfg=cfg)
    assert none == [] and with_m[:40] == without[:40]
    assert choices and 40 < choices[0].step <= 40 + max(cfg.window, cfg.cooldown) + 1
    assert all(b.step - a.step >= cfg.cooldown for a, b in zip(choices, choices[1:]))
    assert len(choices[-1].streamed) > len(Migrator(ts, gpu, 1 << 30, IDLE).streamed)
    idle, hot, cold = np.median(with_m[:40]), np.median(with_m[-20:]), np.median(without[-20:])
    assert hot < 0.8 * cold and hot > idle  # the stress still costs, less
    # every choice's lists say what changed
    prev = set(Migrator(ts, gpu, 1 << 30, IDLE).streamed)
    for c in choices:
        assert set(c.start) == set(c.streamed) - prev and set(c.stop) == prev - set(c.streamed)
        prev = set(c.streamed)


def test_pcie_stress_streams_less_and_its_end_streams_again() -> None:
    ts, gpu = layers(32, set(range(16)), 128 * MiB, 1.0, 4 << 30)
    start = Migrator(ts, gpu, 1 << 30, IDLE).streamed
    assert start  # idle PCIe hides copies behind the step's work: the load-time choice streams some
    load = lambda k: IDLE if k < 30 or k >= 90 else PCIE_STRESS  # noqa: E731
    with_m, choices = simulate(ts, gpu, 1 << 30, load, 150)
    without, _ = simulate(ts, gpu, 1 << 30, load, 150, migrate=False)
    during = [c for c in choices if c.step < 90]
    assert during and len(during[-1].streamed) < len(start)
    assert np.median(with_m[70:90]) < np.median(without[70:90])
    # the stress over, it streams again, as fast as the idle choice (the last choice may be made
    # on a window not yet all idle: an equal set of other layers)
    assert choices[-1].step > 90 and len(choices[-1].streamed) > len(during[-1].streamed)
    assert np.median(with_m[-20:]) == pytest.approx(np.median(without[-20:]), rel=0.01)


def test_moe_experts_stream_only_when_the_whole_tensor_hides() -> None:
    """An expert tensor is read at 8/128 per token but copied whole: idle, none streams."""
    ts, gpu = layers(48, set(range(4)) | set(range(39, 48)), 340 * MiB, 8 / 128, int(11.9 * 1024) * MiB)
    chosen, t = stream_choice(ts, IDLE, gpu, 1 << 30)
    assert t <= step_time(ts, set(), IDLE, gpu)[0]
    copied = sum(x.nbytes for x in ts if x.name in chosen)
    assert IDLE.pcie_s(copied) <= t  # what streams hides within the step


def _native_migrator(lib, ts: list[HostTensor], gpu: int, scratch: int, r: Rates, cfg: MigrateConfig):
    import ctypes
    n = len(ts)
    st = lib.kx_migrate_new((ctypes.c_int64 * max(n, 1))(*[t.nbytes for t in ts]),
                            (ctypes.c_int64 * max(n, 1))(*[t.gpu_bytes_before for t in ts]),
                            (ctypes.c_double * max(n, 1))(*[t.read for t in ts]), n, gpu, scratch,
                            r.cpu_gbs, r.gpu_gbs, r.pcie_gbs, cfg.threshold, cfg.cooldown, cfg.window,
                            cfg.min_gain)
    assert st

    def streamed() -> list[str]:
        flags = (ctypes.c_bool * max(n, 1))()
        k = lib.kx_migrate_streamed(st, flags, n)
        got = [t.name for t, f in zip(ts, flags) if f]
        assert k == len(got)
        return got
    return st, streamed


def test_the_runtime_policy_is_the_reference(native) -> None:
    """kx_migrate_* (C++) against Migrator: the same choice at load on random steps, and the
    same choices step for step on modelled decodes under stress."""
    from kairox.llama import _lib
    rng = np.random.default_rng(9)
    cfg = MigrateConfig()
    for _ in range(200):
        ts, gpu, r, scratch = random_step(rng, (0, 12), (500.0, 3000.0))
        st, streamed = _native_migrator(_lib, ts, gpu, scratch, r, cfg)
        try:
            assert streamed() == stream_choice(ts, r, gpu, scratch)[0]
        finally:
            _lib.kx_migrate_free(st)
    loads = [lambda k: IDLE if k < 40 else CPU_STRESS, lambda k: IDLE if k < 30 or k >= 90 else PCIE_STRESS,
             lambda k: Rates(100.0 * (1 + 0.5 * np.sin(k / 7)), 2000.0, 50.0 * (1 + 0.3 * np.cos(k / 5)))]
    for load in loads:
        ts, gpu = layers(32, set(range(0, 32, 2)), 128 * MiB, 1.0, 4 << 30)
        m = Migrator(ts, gpu, 1 << 30, load(0), cfg)
        st, streamed = _native_migrator(_lib, ts, gpu, 1 << 30, load(0), cfg)
        made = 0
        try:
            for k in range(150):
                s = step_sample(ts, set(m.streamed), load(k), gpu)
                want = m.step(s)
                got = _lib.kx_migrate_step(st, s.cpu_bytes, s.cpu_s, s.gpu_bytes, s.gpu_s, s.copy_bytes, s.copy_s)
                assert got == (want is not None), k
                assert streamed() == m.streamed, k
                made += got
        finally:
            _lib.kx_migrate_free(st)
        assert made >= 1 and m.moved_n >= made  # the load moved the rates past the threshold
    assert not _lib.kx_migrate_new(None, None, None, 1, 0, 0, 100.0, 2000.0, 50.0, 0.15, 5, 8, 0.03)
    assert _lib.kx_migrate_step(None, 0, 0, 0, 0, 0, 0) == -1


def _random_model(rng: np.random.Generator) -> list:
    """Tensors of a random LLaMA- or MoE-shaped model (bytes in MiB steps, some sizes shared)."""
    from kairox.plan import DenseItem
    MiB = 1 << 20
    moe = rng.random() < 0.3
    attn, ffn = int(rng.integers(2, 40)), int(rng.integers(10, 120))
    items = []
    for il in range(int(rng.integers(2, 9))):
        for k in ("attn_q", "attn_k", "attn_v", "attn_output"):
            items.append(DenseItem(f"blk.{il}.{k}.weight", attn * MiB if rng.random() < 0.8 else
                                   int(rng.integers(1, 60)) * MiB))
        for k in ("ffn_gate", "ffn_up", "ffn_down"):
            if moe:
                items.append(DenseItem(f"blk.{il}.{k}_exps.weight", 8 * ffn * MiB, read=0.125))
            else:
                items.append(DenseItem(f"blk.{il}.{k}.weight", ffn * MiB if rng.random() < 0.8 else
                                       int(rng.integers(5, 150)) * MiB))
        if moe:
            items.append(DenseItem(f"blk.{il}.ffn_gate_inp.weight", MiB))
    items.append(DenseItem("output.weight", int(rng.integers(20, 300)) * MiB))
    return items


def test_the_runtimes_streaming_placement_is_the_reference(native, tmp_path) -> None:
    """kx_stream_place (C++, the runtime's kx_stream_choose) against stream_placement: the same
    host tensors, the same streamed ones, the same ones a slot holds and the same scratch on
    random models, budgets and rates (a third of them with weight types, priced at a hardware
    profile's per-type rates whatever the case of the type's name, one type left to its
    default); every run of streamed tensors fits the two slots."""
    import ctypes
    import dataclasses
    import json

    from kairox.llama import _lib
    from kairox.migrate import stream_placement, stream_step
    from kairox.plan import HwProfile, PlanError
    MiB = 1 << 20
    rng = np.random.default_rng(11)
    streamed_any = typed = 0
    for case in range(120):
        items = _random_model(rng)
        total = sum(it.nbytes for it in items)
        fixed = int(rng.integers(50, 600)) * MiB
        budget = fixed + int(rng.integers(0, total // MiB + 400)) * MiB + 300 * MiB
        hw = HwProfile(float(rng.uniform(40, 150)), float(rng.uniform(800, 4000)), float(rng.uniform(15, 60)),
                       float(rng.uniform(5, 40)))
        prof = None
        if case % 3 == 0:
            # ggml's names as the runtime passes them ("q4_K"), profile keys as profile-hw
            # writes them ("q4_k") or as a hand-edited profile might ("Q6_K")
            spelled = [str(rng.choice(["f16", "q8_0", "q4_0", "q4_K", "q6_K"])) for _ in items]
            items = [dataclasses.replace(it, type=t) for it, t in zip(items, spelled)]
            d = {"cpu_gbs": hw.cpu_gbs, "gpu_gbs": hw.gpu_gbs, "pcie_gbs": hw.pcie_gbs, "handoff_us": hw.handoff_us,
                 "cpu_type_gbs": {"f16": float(rng.uniform(20, 150)), "q4_0": float(rng.uniform(20, 150)),
                                  "q4_k": float(rng.uniform(20, 150))},
                 "gpu_type_gbs": {"q8_0": float(rng.uniform(800, 4000)), "Q6_K": float(rng.uniform(800, 4000))}}
            prof = tmp_path / f"hw{case}.json"
            prof.write_text(json.dumps(d))
            hw = HwProfile.from_json(d)
        n = len(items)
        copies = bool(case % 2)
        where, scratch = (ctypes.c_int8 * n)(), ctypes.c_int64()
        rc = _lib.kx_stream_place((ctypes.c_char_p * n)(*[it.name.encode() for it in items]),
                                  (ctypes.c_int64 * n)(*[it.nbytes for it in items]),
                                  (ctypes.c_double * n)(*[it.read for it in items]),
                                  (ctypes.c_char_p * n)(*[t.encode() for t in spelled]) if prof else None,
                                  n, fixed, budget, hw.cpu_gbs, hw.gpu_gbs, hw.pcie_gbs, hw.handoff_us,
                                  str(prof).encode() if prof else None, copies, where, ctypes.byref(scratch))
        try:
            want = stream_placement(items, fixed, budget, hw, copies)
        except PlanError:
            assert rc == -2, case
            continue
        assert rc == 0, case
        got_cpu = {it.name for it, w in zip(items, where) if w}
        got_streamed = {it.name for it, w in zip(items, where) if w == 2}
        # (both sides sum a group's seconds tensor by tensor: tensors of one size tie alike)
        assert got_cpu == set(want.cpu), case
        assert got_streamed == set(want.streamed), case
        # the tensors a slot holds (runtime migration may stream them), the streamed among them
        got_slotted = {it.name for it, w in zip(items, where) if w in (2, 3)}
        assert got_slotted == set(want.slotted) and got_streamed <= got_slotted, case
        assert scratch.value == want.scratch, case
        t, streamed = stream_step(items, sorted(got_cpu), scratch.value, hw)
        assert t == want.step_s and set(streamed) == got_streamed
        assert not want.streamed or want.step_s < want.plain_s
        assert all(by.nbytes * SLOTS <= want.scratch and by.read == 1.0
                   for by in items if by.name in got_streamed)
        streamed_any += bool(want.streamed)
        typed += bool(prof and want.streamed)
    assert streamed_any >= 20 and typed >= 5  # the cases do exercise streaming, typed ones too
    bad = (ctypes.c_int8 * 1)()
    assert _lib.kx_stream_place(None, None, None, None, 1, 0, 1 << 30, 100.0, 2000.0, 50.0, 20.0, None, False, bad,
                                ctypes.byref(ctypes.c_int64())) == -1
    one = (ctypes.c_char_p * 1)(b"output.weight")
    size, share = (ctypes.c_int64 * 1)(MiB), (ctypes.c_double * 1)(1.0)
    assert _lib.kx_stream_place(one, size, share, None, 1, 0, 1 << 30, 100.0, 2000.0, 50.0, 20.0,
                                str(tmp_path / "missing.json").encode(), False, bad, ctypes.byref(ctypes.c_int64())) == -1


def test_the_output_head_stays_on_the_gpu_when_its_copy_costs_more() -> None:
    """A KB-7B-shaped model (32 layers of 32 MiB attention and 86 MiB FFN matrices, a 250 MiB
    output head) at a budget where about a GiB must leave the GPU: when a prompt batch's offload
    copies the largest host tensor into the compute buffers, the head on the CPU saves its bytes
    and costs them again, so the placement keeps it on the GPU and moves fewer bytes than the
    uncapped choice; without the copies the head may go, and the cap changes nothing."""
    from kairox.migrate import place_fixed
    from kairox.plan import DenseItem, HwProfile, dense_groups, solve_dense
    MiB = 1 << 20
    items = [DenseItem(f"blk.{il}.{k}.weight", (32 if k.startswith("attn") else 86) * MiB)
             for il in range(32) for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                           "ffn_down")]
    items.append(DenseItem("output.weight", 250 * MiB))
    total = sum(it.nbytes for it in items)
    hw = HwProfile(100.0, 2000.0, 55.0, 23.5)
    fixed, budget = 134 * MiB, 12288 * MiB - 172 * MiB
    by = {it.name: it.nbytes for it in items}
    cpu = place_fixed(items, fixed, budget, hw, copies=True)
    assert "output.weight" not in cpu
    moved = sum(by[n] for n in cpu)
    # it fits with the copy of its largest host tensor
    from kairox.budget import margin_for
    from kairox.migrate import PLACE_SLACK
    assert fixed + total - moved + max(by[n] for n in cpu) + margin_for(budget) + PLACE_SLACK <= budget
    # the uncapped choice (what the load made before) takes the head and moves more
    groups = dense_groups(items)
    room = budget - margin_for(budget) - PLACE_SLACK - fixed
    on_gpu, _ = solve_dense(groups, room - 250 * MiB - MiB, hw)
    old = [n for g, on in zip(groups, on_gpu) if not on for n in g.names]
    assert "output.weight" in old and sum(by[n] for n in old) > moved
    # without copies the choice is the one knapsack's
    on_gpu, _ = solve_dense(groups, room, hw)
    assert place_fixed(items, fixed, budget, hw) == [n for g, on in zip(groups, on_gpu) if not on for n in g.names]


