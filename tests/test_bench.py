"""The offload benchmark's arithmetic: GPU memory from llama.cpp's log, bytes per token
and the physical bound (bench/offload.py), and the bandwidth probe (kairox.hw)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from kairox.hw import cpu_read_gbs, gpu_bandwidths
from kairox.synth import Shape, synth

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("offload", ROOT / "bench" / "offload.py")
offload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(offload)

LOG = """
load_tensors: offloaded 17/33 layers to GPU
load_tensors:        CUDA0 model buffer size =  6656.25 MiB
load_tensors:   CPU_Mapped model buffer size =  6182.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    76.50 MiB
llama_kv_cache:        CPU KV buffer size =    72.00 MiB
llama_context:      CUDA0 compute buffer size =   296.00 MiB
llama_context:  CUDA_Host compute buffer size =    17.01 MiB
llama_kv_cache:      CUDA0 KV buffer size =    20.00 MiB
llama_context:      CUDA0 compute buffer size =   100.00 MiB
"""


def test_gpu_buffers_from_the_log() -> None:
    g = offload.gpu_buffers(LOG)
    # device buffers only (not CPU_Mapped / CUDA_Host), largest context
    assert g["model_mib"] == 6656.25 and g["kv_mib"] == 76.5 and g["compute_mib"] == 296.0
    assert g["total_mib"] == pytest.approx(6656.25 + 76.5 + 296.0)
    assert g["offloaded"] == "17/33"
    assert offload.gpu_buffers("nothing")["total_mib"] == 0


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> "offload.Layout":
    m = synth(tmp_path_factory.mktemp("b") / "m.gguf", Shape(4, 64, 256, 4, 4, "f32"), quiet=True)
    return offload.Layout(m)


def test_bytes_per_token_follow_the_split(layout) -> None:
    L = layout
    ffn = 3 * 64 * 256 * 4
    assert L.n_layer == 4 and L.layer_ffn == [ffn] * 4 and L.layer_gate == [ffn // 3] * 4
    total = sum(L.layer_ffn) + sum(L.layer_other) + L.output
    cpu_only = L.bytes_per_token(0)
    assert cpu_only == {"gpu": 0.0, "cpu": total, "pcie": 0}
    half = L.bytes_per_token(2)  # the last two layers on the GPU, output head on the CPU
    assert half["gpu"] == L.layer_ffn[3] + L.layer_other[3] + L.layer_ffn[2] + L.layer_other[2]
    assert half["gpu"] + half["cpu"] == total and half["pcie"] == 2 * 64 * 4
    full = L.bytes_per_token(5)  # ngl > n_layer: the output head too; logits come back
    assert full["cpu"] == 0 and full["gpu"] == total and full["pcie"] == 64 * 4 + L.n_vocab * 4
    # sparse CPU layers read a fraction of the FFN rows; exact mode the whole gate first
    sp = L.bytes_per_token(2, density=0.1)
    assert sp["cpu"] == pytest.approx(half["cpu"] - 2 * 0.9 * ffn)
    ex = L.bytes_per_token(2, density=0.1, exact=True)
    assert ex["cpu"] == pytest.approx(sp["cpu"] + 2 * 0.9 * ffn / 3)
    assert L.bytes_per_token(2, density=0.1, pred_bytes=1000)["cpu"] == pytest.approx(sp["cpu"] + 1000)


def test_bound_is_the_slowest_resource() -> None:
    bw = {"cpu_read": 50.0, "gpu_hbm": 4000.0, "pcie_h2d": 50.0}
    b = offload.bound({"gpu": 4e9, "cpu": 1e9, "pcie": 1e4}, bw)
    assert b["limit"] == "cpu" and b["seconds"] == pytest.approx(0.02)
    b = offload.bound({"gpu": 400e9, "cpu": 1e9, "pcie": 0}, bw)
    assert b["limit"] == "gpu" and b["seconds"] == pytest.approx(0.1)
    # no GPU measured: only the CPU counts
    b = offload.bound({"gpu": 0, "cpu": 5e9, "pcie": 0}, {"cpu_read": 50.0, "gpu_hbm": None, "pcie_h2d": None})
    assert b["seconds"] == pytest.approx(0.1)


def test_backoff_schedule_models_probing(tmp_path: Path) -> None:
    """bench/backoff_schedule.py: the schedule of an always-losing balancer (kairox.backoff's
    count, by hand for the first probes), the cost formula, and the calibrated probe speed
    reproducing the measured ratio it was solved from."""
    import json
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("backoff_schedule", ROOT / "bench" / "backoff_schedule.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    from kairox.backoff import BackoffConfig
    cfg = BackoffConfig(window=16, settle=2, max_doubling=4)
    # probe on 18 (settle + window), held 18 (the probe's held half), then holds of 32: one
    # return per lost probe, 18 balancer tokens each
    on, homes = bs.schedule(18 + 18, cfg)
    assert (on, homes) == (18, 1)
    on, homes = bs.schedule(1024, cfg)
    assert on == 18 * homes and 0 < homes < 1024 // 36
    c = bs.cost(1024, cfg, 0.5, 0.01, 0.01)  # a return costs one token
    assert c["vs_static"] == pytest.approx(1024 / ((1024 - on) + 2 * on + homes))
    r = bs.probe_ratio(c["vs_static"], 1024, cfg, 0.01, 0.01)
    assert r == pytest.approx(0.5)
    # longer holds: fewer balancer tokens and returns over a long run
    assert bs.schedule(65536, BackoffConfig(max_doubling=6))[0] < bs.schedule(65536, cfg)[0] / 3
    # end to end on two call files
    def rows(static: float, kind: float, homes: int) -> dict:
        bd = {"homes": homes, "home_ns": homes * 30e6} if homes else {}
        return {"config": "KB-7B", "session": "code", "commit": "abc", "gen": 1024,
                "rows": [{"row": "static", "tok_s": static},
                         {"row": "adaptive λ0=0.5" + (" [--backoff=16]" if homes else ""), "tok_s": kind,
                          "counters": {"boundary": bd}}]}
    (tmp_path / "with.json").write_text(json.dumps(rows(100.0, 97.0, 7)))
    (tmp_path / "without.json").write_text(json.dumps(rows(100.0, 80.0, 0)))
    assert bs.main(["--backoff", str(tmp_path / "with.json"), "--no-backoff", str(tmp_path / "without.json"),
                    "--tokens", "1024", "--doubling", "4", "--out", str(tmp_path / "s")]) == 0
    got = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert len(got) == 1 and got[0]["vs_static_calibrated"] == pytest.approx(0.97)
    on, homes = bs.schedule(1024, cfg)
    assert got[0]["vs_static_bound"] == pytest.approx(1024 / ((1024 - on) + on / 0.8 + homes * 0.03 / 0.01))


def test_balance_live_summarizes_a_rows_scheduler_trace(tmp_path: Path) -> None:
    """A row run with @--sched-trace=FILE: its trace summarized (the reloads' figures with it)
    and kept gzip-compressed."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trace import reload_lines
    from kairox.trace import read_trace
    spec = importlib.util.spec_from_file_location("balance_live", ROOT / "bench" / "balance_live.py")
    bl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bl)
    path = tmp_path / "pipe.jsonl"
    path.write_text("\n".join(reload_lines()) + "\n")
    s = bl.sched_summary(path)
    assert not path.exists() and s["file"] == "pipe.jsonl.gz"
    assert read_trace(tmp_path / "pipe.jsonl.gz")[0] and s["dropped"] == 7
    assert s["reloads"]["batches"] == 2 and s["reloads"]["hand-off"]["delay_us"] == 6


def test_balance_live_rows_and_their_bound() -> None:
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("balance_live", ROOT / "bench" / "balance_live.py")
    bl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bl)
    assert bl.parse_row("static", 0.5, None, 16) == ("static", 0.5, None, 16)
    assert bl.parse_row("pipe-thread:0.9:32:15", 0.5, None, 16) == ("pipe-thread", 0.9, 32, 15)
    assert bl.parse_row("pipe::8", 0.5, None, 16) == ("pipe", 0.5, 8, 16)
    # plain: the static split without a balancer (tpot.py --balancer none), labelled as its kind
    assert bl.parse_row("plain", 0.5, None, 16) == ("plain", 0.5, None, 16)
    assert bl.POLICY["plain"] == "none" and "plain" not in bl.PIPELINED
    assert bl.row_of("plain", 0.5, None, 16, {"tok_s": 1.0, "tpot_p50_ms": 1.0, "tpot_p99_ms": 1.0,
                                               "command": "c"}, None)["row"] == "plain"
    assert bl.split_env("static@GGML_CUDA_DISABLE_GRAPHS=1@A=b") == ("static", {"GGML_CUDA_DISABLE_GRAPHS": "1",
                                                                                 "A": "b"})
    assert bl.split_env("pipe:0.9") == ("pipe:0.9", {})
    for bad in ("static@X", "static@=1"):
        with pytest.raises(ValueError):
            bl.split_env(bad)
    # rows over the rounds: medians against the static rows' median, held boundaries listed
    runs = [{"row": "static", "tok_s": 100.0}, {"row": "pipe", "tok_s": 90.0,
                                                 "counters": {"boundary": {"held": 7, "homes": 2,
                                                                           "home_loads": 300, "home_late": 3}}},
            {"row": "static", "tok_s": 130.0}, {"row": "pipe", "tok_s": 120.0,
                                                 "counters": {"boundary": {"held": 9}}},
            {"row": "static", "tok_s": 110.0}]
    t = bl.medians(runs)
    assert t[2] == "| static | 3 | 110.00 (100.00-130.00) | 1.00x | - | - | - |"
    assert t[3] == "| pipe | 2 | 105.00 (90.00-120.00) | 0.95x | - | 7, 9 | 2 (300, 3) |"
    assert bl.medians(runs[1:2])[2] == "| pipe | 1 | 90.00 (90.00-90.00) | - | - | 7 | 2 (300, 3) |"
    # against the plain row of the same round: (90/80, 120/150) and (100/80, 130/150, 110/100)
    runs += [{"row": "plain", "tok_s": 80.0}, {"row": "plain", "tok_s": 150.0}, {"row": "plain", "tok_s": 100.0}]
    t = bl.medians(runs)
    assert t[3] == "| pipe | 2 | 105.00 (90.00-120.00) | 0.95x | 0.96x (0.80-1.12) | 7, 9 | 2 (300, 3) |"
    assert t[2] == "| static | 3 | 110.00 (100.00-130.00) | 1.00x | 1.10x (0.87-1.25) | - | - |"
    assert t[4] == "| plain | 3 | 100.00 (80.00-150.00) | 0.91x | 1.00x (1.00-1.00) | - | - |"
    # static-split and static-sync: rows of older results, their switches retired
    for bad in ("pipes", "pipe:0.9:32:15:1", "static-split", "static-sync"):
        with pytest.raises(ValueError):
            bl.parse_row(bad, 0.5, None, 16)
    # 2 layers of 10 neurons (1000 B each): 30 listed rows per token, 20 on the GPU
    lay = SimpleNamespace(n_layer=2, n_embd=4, layer_other=[100, 100], output=50)
    costs = SimpleNamespace(per_neuron=1000.0, pred=300.0, n_ff=10, gate_row=0)
    bw = {"cpu_read": 1.0, "gpu_hbm": 10.0, "pcie_h2d": 1.0}
    c = {"rows": 10 * 4, "elsewhere": 20 * 4}
    b = bl.row_bound(lay, costs, c, 4, 0.0, False, bw)
    assert b["bytes"]["cpu"] == 10_000 and b["bytes"]["gpu"] == 200 + 50 + 300 + 20_000
    assert b["limit"] == "cpu" and b["seconds"] == pytest.approx(1e-5)
    # one layer ahead: predictors read twice; reloads cross PCIe
    b2 = bl.row_bound(lay, costs, c, 4, 1e5, True, bw)
    assert b2["bytes"]["gpu"] == b["bytes"]["gpu"] + 300
    assert b2["bytes"]["pcie"] == b["bytes"]["pcie"] + 1e5 and b2["limit"] == "pcie"
    # per layer step: 2 tokens of 1 ms over 2 x 2 host calls; the op's span and its loops
    res = {"tpot_s": [1e-3, 1e-3], "counters": {"ffn_calls": 4, "ffn_op_ns": 4 * 300_000,
                                                 "ffn_work_max_ns": 4 * 200_000, "ffn_work_mean_ns": 4 * 150_000}}
    assert bl.host_op_us(res) == pytest.approx({"step": 500.0, "op": 300.0, "loop_max": 200.0, "loop_mean": 150.0})
    assert bl.host_op_us({"tpot_s": [1e-3], "counters": {"rows": 3}}) is None
    # with the scheduler's counters: 4 CPU splits; 0.2 ms of the 2 ms outside the split loop
    res["counters"]["sched"] = {"cpu_splits": 4, "cpu_ns": 4 * 320_000, "drain_ns": 4 * 100_000,
                                "launch_ns": 4 * 10_000, "copy_ns": 4 * 5_000, "splits_ns": 1_800_000}
    lu = bl.host_op_us(res)
    assert lu["cpu_split"] == pytest.approx(320.0) and lu["device_wait"] == pytest.approx(100.0)
    assert lu["launch"] == pytest.approx(10.0) and lu["copy"] == pytest.approx(5.0)
    assert lu["outside"] == pytest.approx(50.0) and "boundary" not in lu
    # with the balancer's boundary counters: 0.1 ms of the outside time, by phase
    res["counters"]["boundary"] = {"steps": 2, "ns": 100_000, "sync_ns": 4_000, "snap_ns": 8_000, "wait_ns": 0,
                                   "fetch_ns": 12_000, "apply_ns": 16_000, "launch_ns": 20_000, "store_ns": 2_000,
                                   "queue_ns": 6_000}
    lu = bl.host_op_us(res)
    assert lu["boundary"] == pytest.approx(25.0)
    assert lu["boundary_phases"] == pytest.approx({"sync": 1.0, "snap": 2.0, "wait": 0.0, "fetch": 3.0,
                                                   "apply": 4.0, "launch": 5.0, "store": 0.5, "queue": 1.5})
    # the op's phases, µs per call; all zero (a tree without them) adds nothing
    from kairox._native import FFN_PHASES
    res["counters"]["ffn_phases"] = dict.fromkeys(FFN_PHASES, 0)
    assert "op_phases" not in bl.host_op_us(res)
    res["counters"]["ffn_phases"].update(x_ns=4 * 2_000, a_ns=4 * 100_000, b_ns=4 * 150_000, sums_ns=4 * 1_000)
    assert bl.host_op_us(res)["op_phases"] == pytest.approx({"x": 2.0, "wait1": 0.0, "a": 100.0, "wait2": 0.0,
                                                            "b": 150.0, "wait3": 0.0, "sums": 1.0, "skew": 0.0})
    # a gate row of 400 B known: the host reads it for each listed neuron, up and down (600 B)
    # only for the 4 of 10 per token that fired
    relu = SimpleNamespace(per_neuron=1000.0, pred=300.0, n_ff=10, gate_row=400)
    b3 = bl.row_bound(lay, relu, {**c, "nonzero": 4 * 4}, 4, 0.0, False, bw)
    assert b3["bytes"]["cpu"] == 10 * 400 + 4 * 600 and b3["bytes"]["gpu"] == b["bytes"]["gpu"]


def test_ablation_compares_each_row_with_its_own_calls_static(tmp_path: Path) -> None:
    import json
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("ablation", ROOT / "bench" / "ablation.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)

    def row(kind: str, tok_s: float, threads: int = 16) -> dict:
        return {"kind": kind, "row": kind, "threads": threads, "tok_s": tok_s, "tpot_p50_ms": 1e3 / tok_s,
                "tpot_p99_ms": 2e3 / tok_s, "gpu_share": 0.7, "reload_mib_per_token": 1.0, "late_loads": 0,
                "bound": {"seconds": 0.005, "limit": "cpu"}}
    # two calls on a machine whose speed differs between them: the ratio is taken within each
    files = []
    for k, scale in enumerate((1.0, 2.0)):
        f = tmp_path / f"b{k}.json"
        f.write_text(json.dumps({"config": "KB-7B", "budget_gib": 7.0, "commit": "abcdef0",
                                 "rows": [row("static", 50 * scale), row("pipe", 45 * scale)]}))
        files.append(f)
    lines = ab.fold(files, None)
    pipe = next(ln for ln in lines if ln.startswith("| one layer ahead, TAM adaptive λ (compute"))
    cells = [c.strip() for c in pipe.split("|")]
    assert cells[4] == "2" and cells[5] == "67.50 (45.00-90.00)" and cells[6] == "0.90x"
    assert cells[-2] == f"{0.005 * 67.5:.2f}"  # efficiency of the median row

    # the host warm-up is read from the counters, not the label: a default "static" row that
    # warmed is shown apart from one with KX_WARM=0, and only the unwarmed static is the base
    # (stealing likewise: a warmed row whose threads took chunks is a step of its own). The
    # rows with KX_FFN_STATIC_CHUNKS and KX_FFN_NO_STEAL are as older results hold them (the
    # switches are retired; their rows are still folded)
    def warm(r: dict, kib: float, env: dict | None = None, stolen: float = 0.0) -> dict:
        lu = ({"warm_kib": kib} if kib else {}) | ({"stolen": stolen} if stolen else {})
        return {**r, "layer_us": lu, **({"env": env} if env else {}),
                "row": r["row"] + (" [" + " ".join(f"{k}={v}" for k, v in env.items()) + "]" if env else "")}
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"config": "KB-7B", "budget_gib": 7.0, "commit": "abcdef0",
                             "rows": [warm(row("static", 40), 0, {"KX_WARM": "0"}), warm(row("static", 50), 900),
                                      warm(row("static", 30), 0, {"KX_WARM": "0", "KX_FFN_STATIC_CHUNKS": "1"}),
                                      warm(row("adaptive", 44), 800), warm(row("static", 56), 900, None, 7.5),
                                      warm(row("static", 36), 900, {"KX_FFN_NO_STEAL": "1"})]}))
    lines = [[c.strip() for c in ln.split("|")] for ln in ab.fold([f], None) if ln.startswith("| static split")
             or ln.startswith("| between")]
    got = {(c[1], c[2]): (c[5], c[6]) for c in lines}
    assert got == {("static split (profiled hot neurons in the slots)", "static"): ("40.00", "1.00x"),
                   ("static split (profiled hot neurons in the slots)", "static [KX_FFN_STATIC_CHUNKS=1]"): ("30.00", "0.75x"),
                   ("static split (profiled hot neurons in the slots), host warm-up", "static"): ("50.00", "1.25x"),
                   ("static split (profiled hot neurons in the slots), host warm-up, stealing", "static"): ("56.00", "1.40x"),
                   ("static split (profiled hot neurons in the slots), host warm-up", "static [KX_FFN_NO_STEAL=1]"):
                       ("36.00", "0.90x"),
                   ("between decodes, TAM adaptive λ, host warm-up", "adaptive"): ("44.00", "1.10x")}, got


def test_tpot_percentiles() -> None:
    s = offload.summarize_tpot({"tpot_s": [0.01] * 98 + [0.05, 0.1], "prefill_s": 0.2})
    # nearest rank: index round(0.99 * 99) = 98 of the sorted times
    assert s["tpot_p50_ms"] == pytest.approx(10) and s["tpot_p99_ms"] == pytest.approx(50)
    assert s["tok_s"] == pytest.approx(100 / (0.98 + 0.15))


def test_cpu_bandwidth_probe() -> None:
    gbs = cpu_read_gbs(64 << 20, threads=2, reps=2)
    assert math.isfinite(gbs) and 0.1 < gbs < 10_000


def test_gpu_probe_without_cuda() -> None:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    r = gpu_bandwidths(64 << 20, reps=1)
    if has_cuda:
        assert r["gpu_hbm"] > r["pcie_h2d"] > 0
    else:
        assert r is None


def test_shape_clone_keeps_the_layout(tmp_path: Path) -> None:
    import gguf

    from kairox.gguf_header import scan_header
    spec = importlib.util.spec_from_file_location("shape_clone", ROOT / "bench" / "shape_clone.py")
    sc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sc)
    m = synth(tmp_path / "q.gguf", Shape(2, 128, 384, 4, 2, "q4_0"), quiet=True)
    sc.extract(m, tmp_path / "q.kxshape")
    assert (tmp_path / "q.kxshape").stat().st_size < m.stat().st_size / 2
    sc.expand(tmp_path / "q.kxshape", tmp_path / "c.gguf")
    a, b = m.read_bytes(), (tmp_path / "c.gguf").read_bytes()
    hdr = scan_header(m)
    start = min(t.offset for t in hdr.tensors)
    assert len(a) == len(b) and a[:start] == b[:start]
    for t in hdr.tensors:
        x, y = a[t.offset:t.offset + t.nbytes], b[t.offset:t.offset + t.nbytes]
        if t.type_id == int(gguf.GGMLQuantizationType.F32):
            assert x == y, t.name
        else:  # tiled from one tensor's blocks: whole 18-byte Q4_0 blocks of the sample
            assert len(y) == t.nbytes and len(y) % 18 == 0
    with pytest.raises(SystemExit, match="not a shape file"):
        sc.expand(m, tmp_path / "x.gguf")


def test_result_name_keeps_one_file_per_budget():
    assert offload.result_name("KB-7B", 7.0) == "offload-KB-7B"
    assert offload.result_name("KB-7B", 4.0) == "offload-KB-7B-4GiB"
    assert offload.result_name("gemma3-270m", 0.5) == "offload-gemma3-270m-0.5GiB"


def test_budget_plot_only_for_sweeps(tmp_path: Path):
    def res(budget: float, tok_s: float) -> dict:
        return {"model": "m.gguf", "budget_gib": budget, "rows": [
            {"impl": "llama.cpp", "mode": "dense", "how": "llama-bench", "tg_tok_s": tok_s},
            {"impl": "kairox", "mode": "dense", "how": "tpot", "tok_s": tok_s * 1.1}]}
    assert not offload.plot_budgets([res(7, 10.0)], tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()
    assert offload.plot_budgets([res(7, 10.0), res(4, 6.0)], tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_stamp_result_wraps_a_raw_file(tmp_path) -> None:
    import json
    from kairox.bench import main, stamp_result
    f = tmp_path / "r.json"
    f.write_text(json.dumps([{"avg_ts": 1.5}]))
    d = stamp_result(f, "llama-bench -p 512", "abc123", {"host": "h"})
    assert json.loads(f.read_text()) == d == {"command": "llama-bench -p 512", "commit": "abc123",
                                              "machine": {"host": "h"}, "result": [{"avg_ts": 1.5}]}
    g = tmp_path / "g.json"
    g.write_text('{"x": 1}')
    assert main([str(g), "--command", "tool --flag", "--commit", "def456"]) == 0
    d = json.loads(g.read_text())
    assert (d["command"], d["commit"], d["result"]) == ("tool --flag", "def456", {"x": 1})
    assert d["machine"]["cpus"] >= 1


def test_kernel_profile_groups_kernels_per_layer_step(tmp_path):
    """bench/kernel_profile.py: an Nsight Compute CSV (one row per launch, ns and µs units)
    -> per-step counts and times, the median step in launch order."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from kernel_profile import read_kernels, short_name, summarize
    assert short_name("void kx_select_kernel<(ggml_type)1>(const float *, int)") == "kx_select_kernel"
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [("void kx_select_kernel(int)", "nsecond", "6,000"), ("void mmv<float>(int)", "usecond", "12.0"),
            ("void kx_select_kernel(int)", "nsecond", "7000"), ("void mmv<float>(int)", "usecond", "10.0"),
            ("void kx_select_kernel(int)", "nsecond", "5000")]
    f = tmp_path / "ncu.csv"
    f.write_text("==PROF== noise\n" + head + "".join(
        f'"{i}","{n}","gpu__time_duration.sum","{u}","{v}"\n' for i, (n, u, v) in enumerate(rows)))
    k = read_kernels(f)
    assert k == [("kx_select_kernel", 6.0), ("mmv", 12.0), ("kx_select_kernel", 7.0), ("mmv", 10.0),
                 ("kx_select_kernel", 5.0)]
    text = "\n".join(summarize(k, "kx_select"))
    assert "2 whole layer steps" in text and "17.5 µs of kernel time per step" in text
    assert "| mmv | 1.00 | 11.0 | 11.0 |" in text
    # CUDA's select is two kernels (ballots, then the write): one step, starting at the first
    two = [("kx_select_ballot_kernel", 2.0), ("kx_select_write_kernel", 4.0), ("mmv", 12.0),
           ("kx_select_ballot_kernel", 2.0), ("kx_select_write_kernel", 4.0), ("mmv", 10.0),
           ("kx_select_ballot_kernel", 2.0)]
    text = "\n".join(summarize(two, "kx_select"))
    assert "2 whole layer steps" in text and "17.0 µs of kernel time per step" in text
    assert "| kx_select_write_kernel | 1.00 | 4.0 | 4.0 |" in text
    # the default: a step from one layer's attention to the next, whatever runs between (a
    # hybrid layer with the warm-up selects twice: its own list and the next layer's)
    dense = [("flash_attn_ext_vec", 3.0), ("mmvq", 9.0), ("flash_attn_ext_vec", 3.0), ("mmvq", 7.0),
             ("flash_attn_ext_vec", 3.0)]
    text = "\n".join(summarize(dense))
    assert "2 whole layer steps (flash_attn_ext to flash_attn_ext)" in text and "11.0 µs of kernel time" in text
    layer = [("flash_attn_ext_vec", 3.0), ("kx_select_one_kernel", 2.0), ("mmvq", 4.0), ("kx_select_one_kernel", 2.0),
             ("kx_mul_mat_rows_k_kernel", 5.0)]
    text = "\n".join(summarize(layer * 3 + layer[:1]))
    assert "3 whole layer steps" in text and "16.0 µs of kernel time per step" in text
    assert "| kx_select_one_kernel | 2.00 | 4.0 | 2.0 |" in text


@pytest.mark.parametrize("probe", ["snap_probe", "apply_probe", "select_probe"])
def test_boundary_probes_build_and_run(tmp_path: Path, probe: str) -> None:
    """bench/snap_probe.cpp, bench/apply_probe.cpp (the balancer's boundary phases alone) and
    bench/select_probe.cpp (the pipeline's end phase, its selection) compile and print their
    JSON; the snapshot probe exits non-zero when its bit map counts other hits than the neuron
    -> slot map, the selection probe when its two variants select other loads."""
    import json
    import shutil
    import subprocess
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / probe
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", str(ROOT / "bench" / f"{probe}.cpp"), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe), "1", "1"], check=True, capture_output=True, text=True).stdout
    res = json.loads(out)
    assert res["threads"] == 1 and res["reps"] == 1
    timed = {k: v for k, v in res.items() if isinstance(v, dict)}
    assert len(timed) == (8 if probe == "snap_probe" else 2)
    assert all(0 < v["min_us"] <= v["median_us"] for v in timed.values())
    if probe == "snap_probe":
        assert res["hits_per_token"] > 0
    if probe == "select_probe":  # 700 candidates against 2300 victims at half their range
        assert 0 < res["pairs_last"] <= res["candidates"] == 700


@pytest.mark.parametrize("types", ["q4", "q4k", "q5k", "f16"])
def test_host_op_probe_builds_and_splits_the_op(tmp_path: Path, native: Path, types: str) -> None:
    """bench/host_op.c (the host FFN op alone on one model's layer shapes) builds against the
    native ggml, about half of its listed neurons fire with every weight type (its random rows
    and zero-sum x), and the op's own counters split its span: span >= slowest thread's loop
    >= the mean thread's > 0."""
    import json
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "host_op"
    subprocess.run([cc, "-O2", str(ROOT / "bench" / "host_op.c"), "-I", str(ROOT / "vendor/llama.cpp/ggml/include"),
                    "-I", str(ROOT / "ggml_ext/include"), "-L", str(native), "-lggml-base", "-lggml-cpu",
                    f"-Wl,-rpath,{native}", "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "4k", "2", "2", "200", "2", "1024", "512", types], check=True,
                         capture_output=True, text=True).stdout
    res = json.loads(out)
    assert res["types"] == types and res["listed"] == 200
    assert 60 <= res["fired"] <= 140
    assert res["op_us"] >= res["loop_max_us"] >= res["loop_mean_us"] > 0
    bad = subprocess.run([str(exe), "4k", "1", "1", "10", "1", "256", "256", "q5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "TYPES" in bad.stderr


def test_device_out_fits_the_returned_files(tmp_path):
    """bench/device/out_fit.sh: more than 8 files in $OUT go into results.tar (tables and
    device.log beside it while they fit), nothing lost; 8 or fewer stay as they are."""
    import subprocess
    import tarfile

    script = Path(__file__).resolve().parent.parent / "bench" / "device" / "out_fit.sh"

    def fit(names: list[str]) -> Path:
        out = tmp_path / f"out{len(names)}-{sum(n.endswith('.md') for n in names)}"
        out.mkdir()
        for n in names:
            (out / n).write_text(n)
        subprocess.run(["bash", "-c", f'. "{script}"; kx_out_fit'], env={"OUT": str(out), "PATH": "/usr/bin:/bin"},
                       check=True, capture_output=True)
        return out

    few = [f"r{i}.json" for i in range(7)] + ["device.log"]
    assert sorted(p.name for p in fit(few).iterdir()) == sorted(few)
    many = [f"r{i}.json" for i in range(6)] + [f"r{i}.md" for i in range(3)] + ["r.png", "device.log"]
    out = fit(many)
    kept = sorted(p.name for p in out.iterdir())
    assert kept == sorted(["device.log", "r0.md", "r1.md", "r2.md", "results.tar"])
    with tarfile.open(out / "results.tar") as t:
        assert sorted(t.getnames()) == sorted(n for n in many if n not in kept)
        assert t.extractfile("r3.json").read() == b"r3.json"
    # too many tables to keep beside the archive: they go in too
    tables = [f"t{i}.md" for i in range(9)] + ["device.log"]
    out = fit(tables)
    assert sorted(p.name for p in out.iterdir()) == ["device.log", "results.tar"]
    with tarfile.open(out / "results.tar") as t:
        assert len(t.getnames()) == 9


def test_budget_sweeps_of_one_machine_merge_into_one_table(tmp_path: Path) -> None:
    """Two calls' sweeps (one machine) as one table and plot: budgets in order, each part's
    commit and rounds named; a budget measured twice, another machine or another decode
    length is refused, since the table would compare across them."""
    import json
    import subprocess
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("budget_sweep", ROOT / "bench" / "budget_sweep.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)

    def sweep(name: str, commit: str, budgets: list[float], host: str = "gpu-1", gen: int = 32,
              prefill: int = 0) -> Path:
        rows = [{"budget_gib": b, "kairox": {"command": f"llama-bench --vram-budget {b:g}GiB", "tok_s": [10.0 * b],
                                             "error": "", "peak_mib": [b * 1000], "median": 10.0 * b,
                                             "pp_median": 300.0 * b if prefill else None},
                 "llama": {"flags": "-ngl 9 -fa 1", "command": "llama-bench -ngl 9", "tok_s": [8.0 * b],
                           "median": 8.0 * b, "all": {}, "peak_mib_all": {"-ngl 9 -fa 1": [b * 990]},
                           "pp_all": {"-ngl 9 -fa 1": [100.0 * b]} if prefill else {}},
                 "also": {}} for b in budgets]
        res = {"commit": commit, "command": "budget_sweep.py", "model": "m.gguf", "model_mib": 100, "sparse": "auto",
               "gen": gen, "threads": 16, "rounds": 2, "prefill": prefill, "ngl0_peak_mib": 500,
               "machine": {"host": host}, "budgets": rows}
        (tmp_path / name).write_text(json.dumps(res))
        return tmp_path / name

    a, b = sweep("a.json", "c1", [8.0, 14.0]), sweep("b.json", "c2", [1.0, 4.0])
    res = bs.merge([a, b])
    assert [r["budget_gib"] for r in res["budgets"]] == [1.0, 4.0, 8.0, 14.0]
    assert res["commit"] == "c1,c2" and [p["budgets"] for p in res["parts"]] == ["8,14", "1,4"]
    lines = bs.render(res, tmp_path / "out", "merged")
    table = [ln for ln in lines if ln.startswith("| ") and "GiB |" in ln]
    assert [ln.split(" | ")[0] for ln in table] == ["| 1 GiB", "| 4 GiB", "| 8 GiB", "| 14 GiB"]
    assert all("1.25x" in ln for ln in table)  # 10 b against 8 b
    assert "8,14 GiB: 2 round(s), commit c1" in lines[2]
    assert (tmp_path / "out" / "merged.json").exists() and (tmp_path / "out" / "merged.md").exists()
    # a part that prefilled: its budgets get prefill rows, the others none
    pre = bs.merge([a, b, sweep("p.json", "c3", [6.0], prefill=512)])
    lines = bs.render(pre, tmp_path / "out", "prefilled")
    assert pre["prefill"] == 512
    assert [ln for ln in lines if ln.startswith("| 6 GiB | 1800.0 |")] == ["| 6 GiB | 1800.0 | 600.0 (`-ngl 9 -fa 1`) | 3.00x |"]
    assert not any(ln.startswith("| 4 GiB | 1200.0") for ln in lines)
    # a part with an extra row: its column is blank at the other parts' budgets
    x = json.loads(a.read_text())
    for r in x["budgets"]:
        r["also"] = {"hw": {**r["kairox"], "tok_s": [11.0 * r["budget_gib"]], "median": 11.0 * r["budget_gib"]}}
    (tmp_path / "x.json").write_text(json.dumps(x))
    lines = bs.render(bs.merge([tmp_path / "x.json", b]), tmp_path / "out", "extra")
    assert "| budget | kairox-bench tok/s | kairox hw tok/s |" in "\n".join(lines)
    assert any(ln.startswith("| 8 GiB | 80.00 | 88.00 | 64.00") for ln in lines)
    assert any(ln.startswith("| 1 GiB | 10.00 | - | 8.00") for ln in lines)
    for bad in (sweep("c.json", "c3", [4.0]), sweep("d.json", "c3", [2.0], host="gpu-2"),
                sweep("e.json", "c3", [2.0], gen=64)):
        with pytest.raises(ValueError):
            bs.merge([a, b, bad])
    with pytest.raises(ValueError):  # two prefill lengths
        bs.merge([sweep("f.json", "c3", [2.0], prefill=512), sweep("g.json", "c3", [3.0], prefill=128)])
    # the CLI: a merge needs neither --model nor --bin
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "budget_sweep.py"), "--merge", str(a), str(b),
                        "--out", str(tmp_path / "cli"), "--name", "m"], capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "cli" / "m.md").exists(), r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "budget_sweep.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--model and --bin are required" in r.stderr


def _budget_sweep_module():
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("budget_sweep", ROOT / "bench" / "budget_sweep.py")
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    return bs


def test_budget_sweep_times_each_token_of_llama_cpps_fastest_placement(tmp_path: Path, monkeypatch) -> None:
    """--tpot: kairox at the budget and llama.cpp at the flags of its fastest decode row (-ngl,
    -fa, every -ot) through bench/tpot.py; a refused budget gets no row, a failed row keeps its
    error, and the table shows p50 / p99."""
    import argparse
    bs = _budget_sweep_module()
    calls = []
    monkeypatch.setattr(bs, "write_tokens", lambda model, path: path.write_text("[1, 2]"))

    def fake(impl, mode, model, tokens, ngl, threads, env, extra=()):
        calls.append((impl, mode, ngl, threads, list(extra), env["LLAMA_CPP_LIB_PATH"]))
        if impl == "kairox" and "9GiB" not in extra:
            raise SystemExit("failed (1): kairox: the budget is too small")
        return {"command": f"tpot {impl}", "tok_s": 10.0, "tpot_p50_ms": 100.0 if impl == "stock" else 50.0,
                "tpot_p99_ms": 150.0, "prefill_s": 0.1}
    monkeypatch.setattr(bs, "tpot_run", fake)
    ot = r"blk\.(0|1)\.ffn_(gate|up|down)\.weight=CPU"
    llama = {"-ngl 23 -fa 0": {"args": ["-ngl", "23", "-fa", "0"], "tok_s": [18.0]},
             f"-ngl 99 -ot {ot} -fa 1": {"args": ["-ngl", "99", "-ot", ot, "-fa", "1"], "tok_s": [21.0, 20.0, 22.0]}}
    rows = [{"budget_gib": 9.0, "kairox": {"tok_s": [20.0]}, "llama": llama},
            {"budget_gib": 1.0, "kairox": {"tok_s": []}, "llama": llama},
            {"budget_gib": 2.0, "kairox": {"tok_s": [5.0]}, "llama": {"-ngl 3 -fa 1": {
                "args": ["-ngl", "3", "-fa", "1"], "tok_s": [4.0]}}}]
    args = argparse.Namespace(out=str(tmp_path), sparse="auto", threads=4)
    bs.tpot_rows(rows, args, tmp_path / "m.gguf", tmp_path / "bin")
    assert calls[:2] == [
        ("kairox", "dense", 999, 4, ["--vram-budget", "9GiB", "--flash-attn", "on", "--balancer", "none"],
         str(tmp_path / "bin")),
        ("stock", "dense", 99, 4, ["--flash-attn", "on", "--override-tensor", ot], str(tmp_path / "bin"))]
    assert calls[3][:3] == ("stock", "dense", 3) and calls[3][4] == ["--flash-attn", "on"]
    assert bs.tpot_flags(["-ngl", "99", "-ncmoe", "2", "-fa", "0"]) == [
        "--flash-attn", "off", "--override-tensor", r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
        "--override-tensor", r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"]
    assert len(calls) == 4 and "tpot" not in rows[1]  # the refused budget
    assert rows[0]["tpot"]["llama_flags"] == f"-ngl 99 -ot {ot} -fa 1"
    assert rows[0]["tpot"]["llama"]["tpot_p50_ms"] == 100.0 and "error" in rows[2]["tpot"]["kairox"]
    res = {"commit": "c", "model": "m.gguf", "model_mib": 1, "gen": 32, "threads": 4, "rounds": 1, "prefill": 0,
           "ngl0_peak_mib": None, "budgets": [
               {"budget_gib": b["budget_gib"], "tpot": b["tpot"], "also": {},
                "kairox": {"command": "k", "tok_s": b["kairox"]["tok_s"], "median": b["kairox"]["tok_s"][0],
                           "error": "", "peak_mib": []},
                "llama": {"flags": "f", "tok_s": [1.0], "median": 1.0}} for b in (rows[0], rows[2])]}
    lines = bs.render(res, tmp_path / "out", "s")
    assert f"| 9 GiB | 50.0 / 150.0 | 100.0 / 150.0 (`-ngl 99 -ot {ot} -fa 1`) |" in lines
    assert "| 2 GiB | failed | 100.0 / 150.0 (`-ngl 3 -fa 1`) |" in lines
    # --tpot 2: that budget's rows only
    calls.clear()
    for r in rows:
        r.pop("tpot", None)
    bs.tpot_rows(rows, argparse.Namespace(out=str(tmp_path), sparse="auto", threads=4, tpot=[2.0]),
                 tmp_path / "m.gguf", tmp_path / "bin")
    assert [c[2] for c in calls] == [999, 3] and "tpot" in rows[2] and "tpot" not in rows[0]


def test_tpot_keeps_tensors_on_the_host_as_llama_cpps_ot(native: Path, tiny_silu_gguf: Path, tmp_path: Path) -> None:
    """bench/tpot.py --impl stock -ot PATTERN=CPU: the loader gets the overrides (llama_cpp.Llama
    has no parameter for them) and decodes the same logits; other targets and kairox refuse it."""
    import json
    import os
    import subprocess
    import sys
    import numpy as np
    toks = tmp_path / "t.json"
    toks.write_text(json.dumps(list(range(100, 112))))
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(native)}

    def tpot(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "bench" / "tpot.py"), "--model", str(tiny_silu_gguf),
                               "--tokens", str(toks), "--prompt-len", "4", "--threads", "2", *extra],
                              capture_output=True, text=True, env=env, timeout=300)
    a = tpot("--impl", "stock", "--logits-out", str(tmp_path / "a.npy"))
    b = tpot("--impl", "stock", "--logits-out", str(tmp_path / "b.npy"), "-ot", r"blk\.0\.ffn_up\.weight=CPU",
             "--override-tensor", "output=CPU")
    assert a.returncode == 0 and b.returncode == 0, b.stderr[-2000:]
    assert len(json.loads(b.stdout.strip().splitlines()[-1])["tpot_s"]) == 8
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    # the patterns reach llama.cpp's loader: one that is not a regular expression fails the load
    bad = tpot("--impl", "stock", "-ot", "blk[=CPU")
    assert bad.returncode != 0 and "Failed to load model" in bad.stderr, bad.stderr[-2000:]
    bad = tpot("--impl", "stock", "-ot", "output=CUDA0")
    assert bad.returncode != 0 and "only PATTERN=CPU" in bad.stderr
    bad = tpot("--impl", "kairox", "-ot", "output=CPU")
    assert bad.returncode != 0 and "--impl stock" in bad.stderr


def test_device_scripts_parse() -> None:
    """Every bench/device script is valid bash (`bash -n`): a syntax error found on the GPU
    machine costs a cold start there."""
    import subprocess

    scripts = sorted((ROOT / "bench" / "device").glob("*.sh"))
    assert len(scripts) > 10
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, (s.name, r.stderr)


def test_stream_rates_replays_each_choice(tmp_path: Path) -> None:
    """bench/stream_rates.py: the streaming choice made at each CPU rate and replayed at each
    true rate. A choice replayed at the rate it was priced at takes its modelled step; priced
    slower, it streams at least as many bytes; bad rates are refused before anything runs."""
    import json

    spec = importlib.util.spec_from_file_location("stream_rates", ROOT / "bench" / "stream_rates.py")
    sr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sr)
    assert sr.main(["--preset", "KB-7B", "--budgets", "7", "--cpu", "30,100", "--truth", "30,100",
                    "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "stream-rates-KB-7B.json").read_text())
    assert d["command"].startswith("python3 bench/stream_rates.py --preset KB-7B") and d["commit"]
    rows = {r["cpu_gbs"]: r for r in d["rows"]}
    assert set(rows) == {30.0, 100.0} and all(r["streamed"] > 0 for r in rows.values())
    for c, r in rows.items():
        assert r["truth_ms"][str(c)] == pytest.approx(r["modelled_ms"], rel=1e-9)
    assert rows[30.0]["pcie_mib"] >= rows[100.0]["pcie_mib"]
    assert "| 7168 MiB | 30 |" in (tmp_path / "stream-rates-KB-7B.md").read_text()
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            sr.main(["--cpu", bad, "--out", str(tmp_path)])
