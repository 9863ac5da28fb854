"""The balancer's reference policy (kairox.balancer) on traces with known answers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kairox.balancer import (BalancerConfig, LayerBalancer, TraceStep, groups_active, read_activation_trace,
                             replay, write_activation_trace)

FIXED = BalancerConfig(lam=0.5, adaptive=False)


def act(n: int, ids) -> np.ndarray:
    a = np.zeros(n, bool)
    a[list(ids)] = True
    return a


def test_tam_scores_follow_the_recurrence() -> None:
    lb = LayerBalancer(4, 2, FIXED)
    lb.step(act(4, [0, 1]))
    lb.step(act(4, [0]))
    # s0: 0.5 then 0.75; s1: 0.5 then 0.25; τ = 0.51
    np.testing.assert_array_equal(lb.score, np.float32([0.75, 0.25, 0, 0]))
    assert lb.tau == pytest.approx(0.51)


def test_one_hit_wonders_are_never_admitted() -> None:
    """Groups 0-3 in sustained use, a different group firing once every step: the spikes
    never enter the slots, even with slots free, and the hot groups never leave."""
    n, cap = 64, 6
    lb = LayerBalancer(n, cap, FIXED)
    rng = np.random.default_rng(0)
    spikes = rng.permutation(np.arange(4, n))
    for t in range(40):
        d = lb.step(act(n, [0, 1, 2, 3, spikes[t]]), step=t)
        assert not set(d.admit) - {0, 1, 2, 3}
        assert not set(d.evict) & {0, 1, 2, 3}
    assert lb.residents() == [0, 1, 2, 3]


def test_two_steps_in_a_row_qualify_once_lambda_allows() -> None:
    # λ(1 − λ) > ε: two consecutive activations pass τ; with λ = 0.99 they do not
    lb = LayerBalancer(8, 2, FIXED)
    assert lb.step(act(8, [5])).admit == []
    assert lb.step(act(8, [5])).admit == [5]
    slow = LayerBalancer(8, 2, BalancerConfig(lam=0.99, lam_max=0.99, adaptive=False))
    assert slow.step(act(8, [5])).admit == [] and slow.step(act(8, [5])).admit == []


def test_a_phase_change_is_followed_within_k_steps() -> None:
    n, cap, k = 32, 8, 3
    a, b = range(0, 8), range(16, 24)
    lb = LayerBalancer(n, cap, FIXED, initial=list(a))
    for t in range(30):
        d = lb.step(act(n, a), step=t)
        assert d.admit == [] and d.evict == []
    for t in range(30, 30 + k):
        lb.step(act(n, b), step=t)
    assert lb.residents() == list(b)


def test_capacity_and_admission_budget_hold() -> None:
    n, cap = 40, 5
    lb = LayerBalancer(n, cap, BalancerConfig(lam=0.5, adaptive=False, max_admit=2), initial=[0, 1, 2])
    rng = np.random.default_rng(3)
    for t in range(200):
        before = set(lb.residents())
        d = lb.step(rng.random(n) < 0.3, step=t)
        after = set(lb.residents())
        assert len(d.admit) <= 2 and len(after) <= cap
        assert after == (before - set(d.evict)) | set(d.admit)
        assert not set(d.admit) & before and set(d.evict) <= before
        # every admitted group beat τ; nothing is evicted without a load taking its slot
        assert all(lb.score[g] > lb.tau for g in d.admit)
        assert len(d.evict) <= len(d.admit)


def test_ties_keep_residents() -> None:
    # 2 and 3 score the same as resident 0 after two steps: no churn for equal scores
    lb = LayerBalancer(4, 1, FIXED, initial=[0])
    lb.step(act(4, [0, 3]))
    d = lb.step(act(4, [0, 3]))
    assert d.admit == [] and lb.residents() == [0]


def test_lambda_adapts_to_the_stall_and_stays_bounded() -> None:
    c = BalancerConfig(lam=0.5, alpha=0.05, alpha_min=0.005, lam_min=0.1, lam_max=0.9)
    lb = LayerBalancer(8, 2, c)
    none = np.zeros(8, bool)
    for _ in range(30):
        lb.step(none, "io")
    assert lb.lam == pytest.approx(0.9)  # waiting on reloads: conservative, capped
    for _ in range(30):
        lb.step(none, "cpu")
    assert lb.lam == pytest.approx(0.1)  # waiting on the CPU: reacts faster, floored
    lb2 = LayerBalancer(8, 2, c)
    lams = []
    for t in range(200):  # a layer at its balance point: the stall alternates
        lb2.step(none, "io" if t % 2 == 0 else "cpu")
        lams.append(float(lb2.lam))
    late = lams[100:]
    assert max(late) - min(late) <= 0.005 + 1e-6  # the dither shrank to alpha_min
    assert abs(lams[-1] - 0.5) < 0.06
    lb3 = LayerBalancer(8, 2, c)
    lb3.step(none, "none")
    assert lb3.lam == np.float32(0.5)
    fixed = LayerBalancer(8, 2, FIXED)
    fixed.step(none, "io")
    assert fixed.lam == np.float32(0.5)


def test_replay_matches_stepping_and_round_trips(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    n = 16
    trace = [TraceStep(t, il, tuple(sorted(rng.choice(n, 4, replace=False).tolist())),
                       ["none", "io", "cpu"][int(rng.integers(3))]) for t in range(50) for il in range(2)]
    f = tmp_path / "trace.jsonl"
    write_activation_trace(f, trace)
    assert read_activation_trace(f) == trace
    got = list(replay(read_activation_trace(f), n, [4, 6]))
    want = []
    lbs = [LayerBalancer(n, 4), LayerBalancer(n, 6)]
    for s in trace:
        want.append(lbs[s.layer].step(act(n, s.active), s.stall, s.step, s.layer))
    assert got == want
    f.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=":1: not an activation trace"):
        read_activation_trace(f)


def test_groups_active_and_bad_input() -> None:
    group_of = np.arange(12) // 4
    np.testing.assert_array_equal(groups_active([1, 9], group_of, 3), [True, False, True])
    assert not groups_active([], group_of, 3).any()
    with pytest.raises(ValueError, match="capacity"):
        LayerBalancer(4, 5)
    with pytest.raises(ValueError, match="initial"):
        LayerBalancer(4, 2, initial=[0, 0])
    with pytest.raises(ValueError, match="lam"):
        BalancerConfig(lam=1.0)
    lb = LayerBalancer(4, 2)
    with pytest.raises(ValueError, match="stall"):
        lb.step(np.zeros(4, bool), "gpu")
    with pytest.raises(ValueError, match="4 booleans"):
        lb.step(np.zeros(5, bool))


def test_neuron_groups_of_the_pack_and_by_frequency() -> None:
    from kairox.balancer import neuron_groups
    perm = np.array([2, 0, 3, 1])        # pack row i is neuron perm[i]
    group = np.array([0, 0, 1, 1])
    freq = np.array([0.9, 0.9, 0.1, 0.5], np.float32)  # by neuron id, as the pack's kx_freq
    np.testing.assert_array_equal(neuron_groups(perm, group, freq), [0, 1, 0, 1])
    # neuron frequencies: n0 0.9, n1 0.9, n2 0.1, n3 0.5 -> order n0, n1, n3, n2
    np.testing.assert_array_equal(neuron_groups(perm, group, freq, 2), [0, 0, 1, 1])
    np.testing.assert_array_equal(neuron_groups(perm, group, freq, 1), [0, 1, 3, 2])
    with pytest.raises(ValueError, match="group_size"):
        neuron_groups(perm, group, freq, 0)


def test_simulation_counts_hits_loads_and_stalls() -> None:
    from kairox.balancer import SimCosts, simulate
    n = 16
    # one layer: groups 0-3 hot for 20 steps, then 8-11; 5 neurons fire in each active group
    trace = [TraceStep(t, 0, tuple(range(0, 4) if t < 20 else range(8, 12)), counts=(5,) * 4) for t in range(40)]
    cheap_io = SimCosts(cpu_s_per_neuron=1e-6, io_s_per_group=1e-9)
    static = simulate(trace, n, 4, cheap_io, {0: [0, 1, 2, 3]}, None)
    assert (static.steps, static.active, static.loads) == (40, 40 * 20, 0)
    assert static.hit_rate == pytest.approx(0.5)  # the first phase only
    assert static.stalls == {"none": 20, "io": 0, "cpu": 20}
    tam = simulate(trace, n, 4, cheap_io, {0: [0, 1, 2, 3]}, FIXED)
    assert tam.loads == 4 and tam.hit_rate == pytest.approx(38 / 40)  # two steps to follow the change
    costly_io = SimCosts(cpu_s_per_neuron=1e-9, io_s_per_group=1e-3)
    assert simulate(trace, n, 4, costly_io, {0: [0, 1, 2, 3]}, FIXED).stalls["io"] == 1  # the loading step


def test_balance_cli_records_and_compares_policies(tmp_path: Path, native: Path) -> None:
    import json
    from kairox.cli import main
    from kairox.pack import write_pack
    from kairox.synth import PRESETS, synth
    model = synth(tmp_path / "kb-tiny.gguf", PRESETS["KB-tiny"], seed=2, quiet=True)
    write_pack(model, group_size=8, quiet=True)
    out, rec = tmp_path / "bal.json", tmp_path / "trace.jsonl"
    assert main(["balance", str(model), "--tokens", "24", "--capacity", "0.5", "--json", str(out),
                 "--record", str(rec), "-t", "2"]) == 0
    d = json.loads(out.read_text())
    assert [r["policy"] for r in d["runs"]] == ["static", "TAM λ=0.5", "TAM, adaptive λ"]
    assert d["n_groups"] == 32 and d["capacity"] == 16 and d["tokens"] == 48
    assert all(0 < r["hit_rate"] <= 1 for r in d["runs"]) and d["runs"][0]["loads_per_token"] == 0
    steps = read_activation_trace(rec)
    assert len(steps) == 48 * 2 and all(len(s.counts) == len(s.active) > 0 for s in steps)
    # replaying the recording gives the same figures
    assert main(["balance", str(model), "--trace", str(rec), "--capacity", "0.5", "--json", str(out)]) == 0
    assert [r["hit_rate"] for r in json.loads(out.read_text())["runs"]] == [r["hit_rate"] for r in d["runs"]]
    assert main(["balance", str(model), "--capacity", "99", "--tokens", "8"]) == 2


def test_balance_cli_gives_a_real_model_real_text(tmp_path: Path, tiny_relu_gguf: Path, native: Path) -> None:
    """A model that is not synthetic is profiled on requests of real text (kairox.workload),
    one per prompt with BOS, whose domains cycle: the recorded trace holds their tokens."""
    import json
    from kairox.cli import main
    from kairox.pack import write_pack
    from kairox.profile import Profiler
    from kairox.workload import TEXT_DOMAINS, text_requests
    model = tmp_path / "tiny.gguf"
    model.symlink_to(tiny_relu_gguf)
    write_pack(model, group_size=8, quiet=True)
    out, rec = tmp_path / "bal.json", tmp_path / "trace.jsonl"
    assert main(["balance", str(model), "--prompts", "5", "--tokens", "12", "--json", str(out), "--record", str(rec),
                 "-t", "2"]) == 0
    d = json.loads(out.read_text())
    assert d["tokens"] == 60 and all(0 < r["hit_rate"] <= 1 for r in d["runs"])
    with Profiler(model, n_ctx=16) as prof:
        want = text_requests(lambda t: prof.tokenize(t).tolist(), [*TEXT_DOMAINS, TEXT_DOMAINS[0]], 12, prof.bos())
        # the first request's activations: the same trace as profiling its tokens again
        rows = prof.run(np.asarray(want[0], np.int32))
    from kairox.profile import unpack_masks
    steps = [s for s in read_activation_trace(rec) if s.step < 12 and s.layer == 0]
    m = unpack_masks(rows[0].mask, prof.base.n_ff)
    groups = np.zeros((12, d["n_groups"]), bool)
    for t, i in zip(*np.nonzero(m)):
        groups[t, i // 8] = True
    assert [list(s.active) for s in steps] == [np.flatnonzero(g).tolist() for g in groups]
