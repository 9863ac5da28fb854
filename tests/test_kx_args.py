"""kairox's parameters through llama.cpp's own tools (patch 0005: common/arg.cpp) and through
a plain libllama client: the hybrid split, the balancer run by the runtime's own per-decode
boundary (patch 0013), its trace, the environment-variable forms, and refused values.

Runs on the CPU: the slots live in host memory (--kx-slots-device CPU), which exercises the
same split, maps and balancer as a GPU run, without a GPU.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import subprocess
from pathlib import Path

import pytest

from test_hybrid import synth_model  # noqa: F401  (KB-tiny with a pack: a pytest fixture)
from test_sparse import same_text

CPU_SLOTS = ("--kx-slots-device", "CPU")


def tool(native: Path, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = native.parent / "bin" / name
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=full_env)


def complete(native: Path, model: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return tool(native, "llama-completion", "-m", str(model), "-p", "Once upon a time", "-n", "48", "--temp", "0",
                "-no-cnv", "-t", "2", "--no-warmup", *extra, env=env)


@pytest.fixture(scope="module")
def dense_text(native: Path, synth_model: Path) -> str:  # noqa: F811
    r = complete(native, synth_model)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_hybrid_split_in_the_completion_tool(native: Path, synth_model: Path, dense_text: str) -> None:  # noqa: F811
    """--gpu-slots places each layer's hottest neurons in slots; exact mode over the split
    computes every active neuron once, so the text is dense's (a ReLU model)."""
    r = complete(native, synth_model, "--sparse", "exact", "--gpu-slots", "24", *CPU_SLOTS)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "neurons in slots on CPU" in r.stderr and "FFN mode exact" in r.stderr
    assert same_text(r.stdout, dense_text), (r.stdout, dense_text)


def test_the_runtime_runs_the_balancer_for_a_plain_tool(native: Path, synth_model: Path, dense_text: str,  # noqa: F811
                                                        tmp_path: Path) -> None:
    """llama-completion has no code of kairox's between tokens: the balancer's steps and
    its trace come from libllama's own boundary. Output stays dense's (exact mode)."""
    trace = tmp_path / "trace.jsonl"
    r = complete(native, synth_model, "--sparse", "exact", "--gpu-slots", "8,40", *CPU_SLOTS,
                 "--balancer", "adaptive", "--balancer-lambda", "0.3", "--kx-trace", str(trace),
                 "--balancer-backoff", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert same_text(r.stdout, dense_text), (r.stdout, dense_text)
    from kairox.report import read_trace
    recs = read_trace(trace)
    steps = {x["step"] for x in recs}
    # one step per decode after the prompt's (48 tokens generated: the prompt pass and 47 decodes;
    # the back-off off: it would hold the balancer at some of them)
    assert len(steps) >= 40, len(steps)
    assert {x["layer"] for x in recs} == {0, 1}
    assert any(x["n_load"] > 0 for x in recs)  # the balancer moved neurons
    assert recs[0]["lam"] != 0.5                  # --balancer-lambda reached it (adapted from 0.3)


def test_slots_hold_both_predictors_of_a_prepared_pack(native: Path, tmp_path: Path) -> None:
    """A pack with own and ahead predictors in every layer (what `kairox prepare` writes) and
    slots in every layer: the slots hold device copies of both (a load past four such layers
    used to abort: the slots' tensor count left the ahead copies out)."""
    import dataclasses

    from kairox.pack import write_pack
    from kairox.predictor import sketch_for_model
    from kairox.synth import PRESETS, synth
    model = synth(tmp_path / "kb-tiny6.gguf", dataclasses.replace(PRESETS["KB-tiny"], n_layer=6), seed=1, quiet=True)
    sk = sketch_for_model(model)
    write_pack(model, predictor=sk, ahead=sk, quiet=True)
    r = complete(native, model, "--sparse", "predicted", "--gpu-slots", "64", *CPU_SLOTS)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "hybrid FFN: 384 neurons in slots" in r.stderr, r.stderr[-2000:]  # 64 in each of 6 layers


def test_environment_names(native: Path, synth_model: Path, dense_text: str, tmp_path: Path) -> None:  # noqa: F811
    trace = tmp_path / "env-trace.jsonl"
    env = {"LLAMA_ARG_SPARSE": "exact", "LLAMA_ARG_GPU_SLOTS": "16", "LLAMA_ARG_KX_SLOTS_DEVICE": "CPU",
           "LLAMA_ARG_BALANCER": "fixed", "LLAMA_ARG_KX_TRACE": str(trace)}
    r = complete(native, synth_model, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "neurons in slots on CPU" in r.stderr
    assert same_text(r.stdout, dense_text)
    lines = trace.read_text().splitlines()
    assert lines and all(json.loads(x)["stall"] in ("none", "io", "cpu") for x in lines)


@pytest.mark.parametrize("args,message", [
    (("--vram-budget", "lots"), "--vram-budget must be a size > 0 such as 7GiB"),
    (("--vram-budget", "0"), "--vram-budget must be a size > 0"),
    (("--gpu-slots", "-3"), "--gpu-slots must be a whole number >= 0"),
    (("--gpu-slots", "8,x"), "--gpu-slots must be a whole number >= 0, not 'x'"),
    (("--mapped-share", "1.5"), "--mapped-share must be a number in [0, 1)"),
    (("--balancer", "sometimes"), "--balancer must be off, fixed or adaptive"),
    (("--balancer-lambda", "2"), "--balancer-lambda must be a number in [0.05, 0.95]"),
    (("--balancer-max-admit", "many"), "--balancer-max-admit must be a whole number"),
    (("--sparse", "fast"), "--sparse must be dense, exact, predicted or threshold"),
    (("--kx-error-budget", "-1"), "--kx-error-budget must be a number in [0, 1]"),
])
def test_bad_values_are_refused_with_a_sentence(native: Path, synth_model: Path, args: tuple[str, ...],  # noqa: F811
                                                message: str) -> None:
    r = complete(native, synth_model, *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-1500:]


def test_bad_environment_value_is_refused(native: Path, synth_model: Path) -> None:  # noqa: F811
    r = complete(native, synth_model, env={"LLAMA_ARG_VRAM_BUDGET": "seven"})
    assert r.returncode != 0
    assert "LLAMA_ARG_VRAM_BUDGET" in r.stderr and "must be a size" in r.stderr


@pytest.mark.parametrize("args,message", [
    (("--balancer", "fixed"), "the balancer moves neurons between GPU slots and the CPU"),
    (("--gpu-slots", "8", *CPU_SLOTS, "--kx-trace", "t.jsonl"), "a balancer trace needs the balancer"),
    (("--gpu-slots", "8", *CPU_SLOTS, "--sparse", "dense"), "need a sparse mode"),
    (("--gpu-slots", "8", *CPU_SLOTS, "--mapped-share", "0.5", "--balancer", "fixed"), "do not mix"),
])
def test_contradictory_settings_stop_the_tool(native: Path, synth_model: Path, args: tuple[str, ...],  # noqa: F811
                                              message: str, tmp_path: Path) -> None:
    r = complete(native, synth_model, *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-1500:]


def test_a_budget_without_a_gpu_is_an_error(native: Path, synth_model: Path) -> None:  # noqa: F811
    from kairox._native import has_gpu
    if has_gpu():
        pytest.skip("this machine has a GPU")
    r = complete(native, synth_model, "--vram-budget", "1GiB")
    assert r.returncode != 0
    assert "a VRAM budget needs a GPU" in r.stderr


def test_the_scheduler_trace_from_a_tool(native: Path, synth_model: Path, tmp_path: Path) -> None:  # noqa: F811
    """--kx-sched-trace records every split of every graph, written at exit (kairox trace reads it)."""
    from kairox import trace as kt
    out = tmp_path / "sched.jsonl"
    r = complete(native, synth_model, "-n", "4", "--kx-sched-trace", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    recs, dropped = kt.read_trace(out)
    assert recs and dropped == 0 and len({x.graph for x in recs}) >= 4  # the prompt and the decodes
    small = tmp_path / "small.jsonl"
    r = complete(native, synth_model, "-n", "4", "--kx-sched-trace", str(small), "--kx-sched-trace-max", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    recs, dropped = kt.read_trace(small)
    assert len(recs) == 2 and dropped > 0


def test_a_balanced_tool_traces_its_reloads(native: Path, synth_model: Path, tmp_path: Path) -> None:  # noqa: F811
    """The balancer in a tool, under --kx-sched-trace: its reload batches are records beside the
    splits, of the bytes its steps loaded (--kx-trace)."""
    from kairox import trace as kt
    base = ("--gpu-slots", "60", *CPU_SLOTS, "--balancer", "fixed", "--balancer-lambda", "0.2",
            "--balancer-backoff", "0")
    out, steps = tmp_path / "sched.jsonl", tmp_path / "steps.jsonl"
    r = complete(native, synth_model, *base, "--kx-sched-trace", str(out), "--kx-trace", str(steps))
    assert r.returncode == 0, r.stderr[-2000:]
    recs, _ = kt.read_trace(out)
    rel = [x for x in recs if x.part == "r"]
    moved = sum(json.loads(ln)["reload_bytes"] for ln in steps.read_text().splitlines())
    assert rel and moved > 0 and sum(x.bytes for x in rel) == moved


def test_help_lists_the_options(native: Path) -> None:
    r = tool(native, "llama-completion", "--help")
    for flag in ("--vram-budget", "--gpu-slots", "--kx-plan", "--mapped-share", "--balancer ", "--balancer-lambda",
                 "--balancer-pipeline", "--balancer-backoff", "--kx-error-budget", "--kx-trace", "--kx-sched-trace", "--sparse-pack",
                 "--kx-hw-profile",
                 "LLAMA_ARG_VRAM_BUDGET"):
        assert flag in r.stdout, flag


def test_llama_cpp_python_own_llama_gets_the_boundary(native: Path, synth_model: Path) -> None:  # noqa: F811
    """A libllama client that is not kairox's (llama-cpp-python's own Llama) applies the
    parameters once; the runtime then balances after each of its decodes."""
    from kairox import capi
    from kairox.llama import _lib, llama_cpp
    llm = llama_cpp.Llama(str(synth_model), n_ctx=128, n_threads=2, verbose=False)
    try:
        kp = _lib.kx_params_default()
        kp.sparse, kp.gpu_slots, kp.slots_device = 1, 16, b"CPU"
        kp.balancer = capi.BALANCER_MODES.index("fixed")
        err = ctypes.create_string_buffer(512)
        assert _lib.kx_context_apply(llm._ctx.ctx, os.fsencode(synth_model), ctypes.byref(kp), err, 512) == 0, err.value
        out = llm("Once upon a time", max_tokens=12, temperature=0.0)
        assert out["choices"][0]["text"]
        n = _lib.kx_model_balance_trace(llm._model.model, None, 0)
        recs = (capi.BalanceRecord * max(n, 1))()
        n = _lib.kx_model_balance_trace(llm._model.model, recs, n)
        assert len({r.step for r in recs[:n]}) >= 10  # a step per decode, with no call of ours
    finally:
        llm.close()


def test_llama_bench_lists_and_columns(native: Path, synth_model: Path) -> None:  # noqa: F811
    """kairox-bench takes kairox's options as lists like -ngl: every combination is a row, and
    each row carries what it ran (the columns of dense placement and the hybrid side by side)."""
    r = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "4", "-r", "1", "-t", "2", "-o", "json",
             "--gpu-slots", "-,16", "--sparse", "auto", "--kx-slots-device", "CPU")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert [(x["gpu_slots"], x["sparse"], x["vram_budget"], x["balancer"]) for x in rows] == \
        [(-1, "auto", "-", "off"), (16, "auto", "-", "off")]
    assert all(x["avg_ts"] > 0 for x in rows)
    md = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "2", "-r", "1", "-t", "2",
              "--gpu-slots", "8", "--sparse", "exact", "--balancer", "off,fixed", "--kx-slots-device", "CPU")
    assert md.returncode == 0, md.stderr[-2000:]
    header = next(ln for ln in md.stdout.splitlines() if ln.startswith("| model"))
    for col in ("gpu_slots", "sparse", "balancer"):
        assert col in header, header


def test_llama_bench_takes_the_warm_up_switch(native: Path, synth_model: Path) -> None:  # noqa: F811
    """--no-kx-warm, the common tools' switch for the hybrid's host-cache warm-up, is a
    kairox-bench option too (rows with and without it compare through the same binary)."""
    h = tool(native, "llama-bench", "--help")
    assert "--no-kx-warm" in h.stdout + h.stderr
    r = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "2", "-r", "1", "-t", "2",
             "--gpu-slots", "8", "--sparse", "predicted", "--kx-slots-device", "CPU", "--no-kx-warm")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (("--vram-budget", "lots"), "--vram-budget must be a size > 0"),
    (("--sparse", "fast"), "--sparse must be auto, dense, exact, predicted or threshold"),
    (("--balancer", "sometimes"), "--balancer must be off, fixed or adaptive"),
    (("--gpu-slots", "x"), "--gpu-slots must be a whole number >= 0"),
])
def test_llama_bench_refuses_bad_values(native: Path, synth_model: Path, args: tuple[str, ...],  # noqa: F811
                                        message: str) -> None:
    r = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "2", *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-1500:]


def test_llama_bench_row_that_cannot_run_fails(native: Path, synth_model: Path, tmp_path: Path) -> None:  # noqa: F811
    """A row naming a pack that cannot be used fails rather than running dense under its name."""
    bad = tmp_path / "bad.kxpack.gguf"
    bad.write_bytes(b"not a pack")
    r = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "2", "-r", "1", "--sparse", "exact",
             "--sparse-pack", str(bad))
    assert r.returncode != 0 and "kairox:" in r.stderr


def _hw_profiles(tmp_path: Path) -> dict[str, Path]:
    """A good `kairox profile-hw` file and bad ones, by what is wrong with each."""
    good = {"cpu_gbs": 120.0, "gpu_gbs": 3000.0, "pcie_gbs": 50.0, "handoff_us": 20.0,
            "cpu_type_gbs": {"f16": 90.0, "q4_0": 70.0}, "gpu_type_gbs": {"f16": 2800.0}}
    files = {"good": good, "no cpu rate": {k: v for k, v in good.items() if k != "cpu_gbs"},
             "a zero type rate": {**good, "cpu_type_gbs": {"f16": 0.0}}, "negative": {**good, "gpu_gbs": -1.0},
             "a zero PCIe rate": {**good, "pcie_gbs": 0.0}}
    out = {}
    for name, body in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '-')}.json"
        out[name].write_text(json.dumps(body))
    out["not json"] = tmp_path / "not.json"
    out["not json"].write_text("cpu_gbs = 120")
    out["missing"] = tmp_path / "missing.json"
    return out


def test_a_hardware_profile_sets_the_rates(native: Path, tmp_path: Path) -> None:
    """kx_params_read_hw_profile: a `kairox profile-hw` file gives the stall model's rates
    where none were set (set ones are kept) and is named for the placement; a file that is
    missing, not JSON, without cpu_gbs or with a rate <= 0 is refused with its name."""
    from kairox import capi
    from kairox.llama import _lib as lib
    files = _hw_profiles(tmp_path)
    err = ctypes.create_string_buffer(1024)
    kp = lib.kx_params_default()
    assert lib.kx_params_read_hw_profile(ctypes.byref(kp), str(files["good"]).encode(), err, 1024) == 0
    assert (kp.balance.cpu_gbs, kp.balance.gpu_gbs) == (120.0, 3000.0)
    assert kp.hw_profile == str(files["good"]).encode()
    kp = lib.kx_params_default()
    kp.balance.cpu_gbs = 77.0
    assert lib.kx_params_read_hw_profile(ctypes.byref(kp), str(files["good"]).encode(), err, 1024) == 0
    assert (kp.balance.cpu_gbs, kp.balance.gpu_gbs) == (77.0, 3000.0)
    for name in ("no cpu rate", "a zero type rate", "negative", "a zero PCIe rate", "not json", "missing"):
        kp = lib.kx_params_default()
        rc = lib.kx_params_read_hw_profile(ctypes.byref(kp), str(files[name]).encode(), err, 1024)
        msg = err.value.decode()
        assert rc == capi.Status.PARAMS and str(files[name]) in msg, (name, msg)
        assert kp.hw_profile is None and kp.balance.cpu_gbs == 0.0, name
        assert ("cannot read" in msg) if name == "missing" else ("kairox profile-hw" in msg), (name, msg)


def test_the_tools_take_a_hardware_profile(native: Path, synth_model: Path, tmp_path: Path,  # noqa: F811
                                            dense_text: str) -> None:
    """--kx-hw-profile in the completion tool and in llama-bench: a good file runs (the text of
    a run without a split is dense's), a bad one stops the tool naming the file."""
    files = _hw_profiles(tmp_path)
    r = complete(native, synth_model, "--kx-hw-profile", str(files["good"]))
    assert r.returncode == 0 and same_text(r.stdout, dense_text), r.stderr[-1500:]
    r = complete(native, synth_model, "--kx-hw-profile", str(files["no cpu rate"]))
    assert r.returncode != 0 and "is not a kairox hardware profile" in r.stderr, r.stderr[-1500:]
    r = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "2", "-r", "1",
             "--kx-hw-profile", str(files["good"]))
    assert r.returncode == 0, r.stderr[-1500:]
    r = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "2", "-r", "1",
             "--kx-hw-profile", str(files["missing"]))
    assert r.returncode != 0 and "cannot read the hardware profile" in r.stderr, r.stderr[-1500:]


def test_the_tools_take_the_decode_threads_switch(native: Path, synth_model: Path, dense_text: str) -> None:  # noqa: F811
    """--kx-adapt-threads (load-aware decode threads) in the common tools (the same text as
    without: the count changes only how rows are shared), in kairox-bench and in `kairox run`."""
    r = complete(native, synth_model, "--kx-adapt-threads")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == dense_text
    h = tool(native, "llama-bench", "--help")
    assert "--kx-adapt-threads" in h.stdout + h.stderr
    b = tool(native, "llama-bench", "-m", str(synth_model), "-p", "0", "-n", "20", "-r", "1", "-t", "2",
             "--kx-adapt-threads")
    assert b.returncode == 0, b.stderr[-2000:]
    k = subprocess.run([sys.executable, "-m", "kairox", "run", "-m", str(synth_model), "-n", "8", "-t", "2",
                        "--kx-adapt-threads"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KAIROX_LIB_DIR": str(native)})
    assert k.returncode == 0, k.stderr[-2000:]
