"""The `kairox` command line and the drop-in llama.cpp tool entry points, as a user runs them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def kairox(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kairox", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def test_help_lists_subcommands():
    r = kairox("--help")
    assert r.returncode == 0
    head = r.stdout.split("positional arguments")[0]  # the summary, one line per subcommand
    for cmd in SUBCOMMANDS:
        assert f"  kairox {cmd} " in head, cmd


SUBCOMMANDS = ("run", "info", "convert", "synth", "pack", "prepare", "stats", "plan", "profile-hw", "trace",
               "balance", "report")


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_subcommand_help_is_for_users(cmd):
    """A subcommand's help says what it does in a short paragraph, then its options; the
    developers' notes (source paths, C structs, algorithms' internals) stay in the modules."""
    r = kairox(cmd, "--help")
    assert r.returncode == 0, r.stderr
    head = r.stdout.split("\n\n", 1)[1]
    about = head.split("positional arguments:")[0].split("options:")[0].strip()
    assert 0 < len(about.splitlines()) <= 8, about
    for internal in ("python/kairox", "struct kx_", ".py", "ggml_ext/"):
        assert internal not in about, (internal, about)
    assert "options:" in r.stdout and "-h, --help" in r.stdout


def test_no_command_prints_help_and_fails():
    r = kairox()
    assert r.returncode == 2 and "usage:" in r.stdout


def test_info_build(native):
    r = kairox("info")
    assert r.returncode == 0, r.stderr
    assert "llama.cpp 0c1e570" in r.stdout and str(native) in r.stdout


def test_info_model(tiny_relu_gguf):
    r = kairox("info", str(tiny_relu_gguf))
    assert r.returncode == 0, r.stderr
    assert any(ln.split()[:2] == ["activation", "relu"] for ln in r.stdout.splitlines()), r.stdout
    assert "architecture" in r.stdout and "llama" in r.stdout


def test_info_bad_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    r = kairox("info", str(bad))
    assert r.returncode == 2 and "not a readable GGUF" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_run_tiny_streams_with_tokens_per_second(native, tiny_relu_gguf):
    r = kairox("run", "-m", str(tiny_relu_gguf), "-p", "Hello", "-n", "8", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello") and len(r.stdout) > len("Hello\n")
    assert "generated 8 tokens, decode" in r.stderr and "tokens/s" in r.stderr


def test_run_writes_the_scheduler_trace(native, tiny_relu_gguf, tmp_path):
    """--kx-sched-trace: every token's splits, written at exit, read by `kairox trace`."""
    out = tmp_path / "sched.jsonl"
    r = kairox("run", "-m", str(tiny_relu_gguf), "-p", "Hello", "-n", "6", "-t", "2", "--kx-sched-trace", str(out))
    assert r.returncode == 0, r.stderr
    assert f"scheduler trace in {out}" in r.stderr
    from kairox.trace import read_trace
    recs, dropped = read_trace(out)
    assert dropped == 0 and len({x.graph for x in recs}) >= 6  # the prompt and each decode
    t = kairox("trace", str(out))
    assert t.returncode == 0 and "graphs" in t.stdout, t.stderr


def test_run_refuses_a_prompt_longer_than_the_context(native, tiny_relu_gguf):
    r = kairox("run", "-m", str(tiny_relu_gguf), "-p", "hello world " * 400, "-n", "4", "-c", "256", "-t", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "the context holds 256" in r.stderr and "raise -c" in r.stderr


def test_run_rounds_a_small_context_up(native, tiny_relu_gguf):
    r = kairox("run", "-m", str(tiny_relu_gguf), "-p", "Hello", "-n", "4", "-c", "8", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "context 8 rounded up to 256" in r.stderr and "(256 ctx" in r.stderr


def test_run_ctrl_c_keeps_the_output_and_exits_130(native, tiny_relu_gguf):
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "kairox", "run", "-m", str(tiny_relu_gguf), "-p", "Hello",
                          "-n", "100000", "-c", "4096", "-t", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert p.stdout.read(len("Hello")) == "Hello"  # generating
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "interrupted after" in err and "Traceback" not in err


def test_run_never_runs_dense_in_silence(native, tiny_relu_gguf, tmp_path):
    """A sparse mode or hybrid asked for that cannot run stops with the reason (exit 2); with
    --fallback dense the model runs dense and the reason is printed without -v."""
    bad = tmp_path / "bad.kxpack.gguf"
    bad.write_bytes(b"not a pack" * 100)
    r = kairox("run", "-m", str(tiny_relu_gguf), "-n", "4", "--sparse", "exact", "--sparse-pack", str(bad))
    assert r.returncode == 2 and "not a readable GGUF" in r.stderr and "--fallback dense" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not r.stdout
    r = kairox("run", "-m", str(tiny_relu_gguf), "-n", "4", "--sparse", "exact", "--sparse-pack", str(bad),
               "--fallback", "dense")
    assert r.returncode == 0 and "warning: kairox: sparse mode unavailable, running dense" in r.stderr, r.stderr
    assert "FFN dense" in r.stderr


def test_run_says_threshold_mode_is_approximate_off_relu(native, tiny_silu_gguf, tmp_path):
    """Off ReLU, threshold mode is the declared approximation; exact stays exact (its FFN runs
    dense: every neuron of a gated model fires) and says nothing runs sparse."""
    from kairox.pack import write_pack
    model = tmp_path / "silu.gguf"
    model.write_bytes(tiny_silu_gguf.read_bytes())
    write_pack(model, quiet=True)
    r = kairox("run", "-m", str(model), "-n", "4", "--sparse", "threshold")
    assert r.returncode == 0, r.stderr
    assert "warning: kairox: threshold mode on a silu model" in r.stderr, r.stderr
    assert "FFN threshold, 2 of 2 layers sparse" in r.stderr, r.stderr
    r = kairox("run", "-m", str(model), "-n", "4", "--sparse", "exact")
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr and "FFN exact, 0 of 2 layers sparse" in r.stderr, r.stderr


def test_run_missing_model(tmp_path):
    r = kairox("run", "-m", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "not found" in r.stderr
    r = kairox("run", "-m", str(tmp_path))
    assert r.returncode == 2 and "is a directory, not a model file" in r.stderr


def test_run_default_model(native, gemma_gguf):
    """README command 1's main job: the embedded Gemma model generates text with tokens/s."""
    r = kairox("run", "-n", "16", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "gemma-3-270m" in r.stderr
    generated = r.stdout.split("were", 1)[1]
    assert len(generated.strip()) > 10
    assert "tokens/s" in r.stderr


def _tool(entry: str, *args: str) -> subprocess.CompletedProcess:
    code = f"import sys; sys.argv[0] = {entry!r}; from kairox.tools import {entry.split('-')[1]} as m; m()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_completion_tool_matches_python_greedy(native, tiny_relu_gguf):
    """kairox-completion is llama.cpp's tool: every flag passes through, output is the model's."""
    import kairox
    r = _tool("kairox-completion", "-m", str(tiny_relu_gguf), "-p", "Hello", "-n", "8", "--temp", "0",
              "-no-cnv", "-t", "2", "--no-warmup")
    assert r.returncode == 0, r.stderr
    llm = kairox.Llama(str(tiny_relu_gguf), n_ctx=64, verbose=False)
    ref = llm.create_completion("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    assert r.stdout.strip().startswith("Hello")
    assert ref.strip() and ref.strip() in r.stdout


def test_bench_tool_runs(native, tiny_relu_gguf):
    r = _tool("kairox-bench", "-m", str(tiny_relu_gguf), "-p", "0", "-n", "4", "-r", "1", "-t", "2",
              "-o", "csv")
    assert r.returncode == 0, r.stderr
    assert "tiny" in r.stdout or "llama" in r.stdout


def test_tool_flag_errors_come_from_llama_cpp(native):
    r = _tool("kairox-cli", "--definitely-not-a-flag")
    assert r.returncode != 0 and "definitely-not-a-flag" in (r.stderr + r.stdout)
